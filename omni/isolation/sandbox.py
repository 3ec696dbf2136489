"""The one interface through which omnid starts and stops model instances.

`SandboxSpec` says what an instance needs (its command, model directory,
socket directory, resource limits); a `Sandbox` runs it. `ProcessSandbox` is a
plain subprocess in its own session; the isolating sandbox (cgroups,
namespaces, a read-only filesystem view) implements the same interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from omni.proc import die_with_parent, kill_group

from . import hostfs

# Where an isolated instance sees its model's own packages (SandboxSpec.python_env).
PYTHON_ENV_MOUNT = Path("/omni/env")


@dataclass(frozen=True)
class Limits:
    memory_bytes: int | None = None  # no swap beyond it
    cpu_cores: float | None = None  # CPU quota
    cpu_weight: int = 100  # share under contention (1-10000)
    pids: int | None = None
    tmp_bytes: int = 256 << 20  # its private /tmp (tmpfs: charged to its memory)
    io_bytes: int = 256 << 20  # its socket directory: the socket, KV handoffs (tmpfs)


@dataclass(frozen=True)
class SandboxSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    model_dir: Path  # the only model files the instance may read
    socket_dir: Path  # where it listens and writes handoffs: fresh, size-limited, its own
    limits: Limits = field(default_factory=Limits)
    hide: tuple[Path, ...] = ()  # other models' files that must stay out of view
    gpus: tuple[int, ...] | None = None  # GPU indices whose device nodes it gets
    extra_ro: tuple[Path, ...] = ()  # more read-only paths it needs
    extra_rw: tuple[Path, ...] = ()  # directories of its own it may write (a disk KV tier)
    # omnid's files for it (control blocks): it may write them, never add, replace or
    # remove an entry (root's directory)
    shared_dir: Path | None = None
    # descriptors its processes reach as /proc/1/fd/N (sealed control blocks): held by
    # the sandbox's init, never by the instance's own processes
    pass_fds: tuple[int, ...] = ()
    log_path: Path | None = None  # its stdout and stderr; None: a pipe (Sandbox.output)
    fingerprint: str = ""  # what it was started as: a restarted omnid adopts it if unchanged
    # its model's own packages (omni.runtime.envs): read-only, on its import path after
    # omni's own code and before site-packages; an isolated sandbox shows it at
    # PYTHON_ENV_MOUNT and no other model's
    python_env: Path | None = None
    # where set (a python-runtime model's): of site-packages, an isolated sandbox shows
    # these entries alone (the shared base, envs.shared_base_entries), plus omni itself
    python_base: tuple[Path, ...] | None = None


@dataclass(frozen=True)
class ExitStatus:
    returncode: int | None  # negative: killed by that signal
    reason: str = "exited"  # exited | killed | oom | unhealthy | restarted | setup-failed

    def describe(self) -> str:
        if self.returncode is not None and self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"{self.reason} ({name})"
        if self.returncode is None:
            return self.reason
        return f"{self.reason} (code {self.returncode})"


class Sandbox(Protocol):
    pid: int | None
    output: asyncio.StreamReader | None  # its stdout and stderr, where no log_path is set

    async def start(self) -> None: ...

    async def exited(self) -> None:
        """Returns once its process has exited, before any teardown (wait's)."""
        ...

    async def wait(self) -> ExitStatus: ...

    async def stop(self, grace_s: float = 5.0) -> ExitStatus: ...

    def owns(self, pid: int, uid: int) -> bool:
        """Whether process `pid`, running as `uid`, is this sandbox's (SO_PEERCRED's view
        of a socket's listener: omnid talks to no other)."""
        ...


def with_import_path(env: dict[str, str], entry: str) -> dict[str, str]:
    """`env` with `entry` last on its PYTHONPATH: after omni's own code (which a model's
    package must not shadow), still before site-packages (which it may)."""
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([*parts, entry])}


def open_log(path: Path | None):
    """Where a sandbox's output goes: the log file, or a pipe omnid reads."""
    return subprocess.PIPE if path is None else path.open("ab")


class ProcessSandbox:
    """A plain child process in its own session, killed with its whole process group."""

    def __init__(self, spec: SandboxSpec):
        self.spec = spec
        self.pid: int | None = None
        self.output: asyncio.StreamReader | None = None
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        for path in (self.spec.socket_dir, *self.spec.extra_rw):
            path.parent.mkdir(parents=True, exist_ok=True)
            hostfs.fresh_dir(path, 0o700)
        env = self.spec.env
        if self.spec.python_env is not None:  # no view: its host path
            env = with_import_path(env, str(self.spec.python_env))
        log = open_log(self.spec.log_path)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.spec.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        finally:
            if log is not subprocess.PIPE:
                log.close()
        self.pid = self._proc.pid
        self.output = self._proc.stdout

    async def exited(self) -> None:
        assert self._proc is not None, "not started"
        await self._proc.wait()

    async def wait(self) -> ExitStatus:
        assert self._proc is not None, "not started"
        code = await self._proc.wait()
        kill_group(self._proc.pid)  # leftovers that stayed in its group
        return ExitStatus(code, "killed" if code < 0 else "exited")

    async def stop(self, grace_s: float = 5.0) -> ExitStatus:
        assert self._proc is not None, "not started"
        if self._proc.returncode is None:
            kill_group(self._proc.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._proc.wait()), grace_s)
        kill_group(self._proc.pid, signal.SIGKILL)
        return await self.wait()

    def owns(self, pid: int, uid: int) -> bool:
        """omnid's own uid, and a process of the session it started the instance in."""
        if self._proc is None or uid != os.geteuid():
            return False
        try:
            return os.getsid(pid) == self._proc.pid
        except OSError:
            return False
