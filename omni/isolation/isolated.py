"""The isolating sandbox: cgroup + namespaces + filesystem view + dropped privileges.

omnid-side half: creates the cgroup, writes the plan, starts the launcher
inside the cgroup, waits until the instance runs (or learns which setup step
failed), and on exit or stop kills whatever is left in the cgroup and cleans up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from . import hostfs, launch
from .cgroups import CgroupManager
from .record import OUTPUT, Record, claim, exit_status, started
from .sandbox import ExitStatus, SandboxSpec, open_log
from .view import ViewConfig, build_plan

log = logging.getLogger(__name__)

LAUNCHER = Path(launch.__file__)
SETUP_TIMEOUT_S = 10.0


class SandboxError(RuntimeError):
    """The sandbox could not be built: the step that failed, on which path, and why."""

    def __init__(self, name: str, step: str, path: str, reason: str):
        where = f"{step} {path}" if path else step
        super().__init__(f"sandbox {name}: {where}: {reason}")
        self.step, self.path, self.reason = step, path, reason


def _read_to_eof(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


class IsolatedSandbox:
    def __init__(
        self,
        spec: SandboxSpec,
        cgroups: CgroupManager,
        workdir_root: Path,
        view: ViewConfig | None = None,
        seccomp_bpf: Path | None = None,
        orphan_timeout_s: float = 60.0,
    ):
        """`orphan_timeout_s`: how long the sandbox outlives omnid, waiting to be adopted
        by the next (live restore), before it ends itself."""
        self.spec = spec
        self.view = view or ViewConfig()
        self.seccomp_bpf = seccomp_bpf
        self.workdir = workdir_root / spec.name
        self.launcher_pid: int | None = None
        self.output: asyncio.StreamReader | None = None
        self._cgroups = cgroups
        self._cgroup = None
        self._proc: asyncio.subprocess.Process | None = None
        self._oom_before = 0
        self._teardown_task: asyncio.Future[ExitStatus] | None = None
        self.orphan_timeout_s = orphan_timeout_s
        self.record: Record | None = None
        self._pidfd: int | None = None  # the launcher's, where it is not our child (adopted)
        self._gone: asyncio.Future | None = None  # ... and its exit
        self._output: asyncio.ReadTransport | None = None

    async def start(self) -> None:
        spec = self.spec
        shutil.rmtree(self.workdir, ignore_errors=True)
        (self.workdir / "root").mkdir(parents=True, mode=0o700)
        claim(self.workdir)
        uid = self.view.uid
        spec.socket_dir.parent.mkdir(parents=True, exist_ok=True)
        hostfs.mount_tmpfs(spec.socket_dir, spec.limits.io_bytes, uid)  # fresh, bounded
        for path in spec.extra_rw:  # its own, nobody else's, and empty
            path.parent.mkdir(parents=True, exist_ok=True)
            hostfs.fresh_dir(path, 0o700, owner=uid)
        plan = build_plan(spec, self.view, self.workdir, self._cgroups.view_mounts())
        plan["env"] = {**plan["env"], "HOME": "/tmp"}
        plan["seccomp"] = str(self.seccomp_bpf) if self.seccomp_bpf else None
        plan["held_fds"] = list(spec.pass_fds)
        plan["workdir"] = str(self.workdir)
        plan["orphan_timeout_s"] = self.orphan_timeout_s
        if spec.log_path is None:  # through a FIFO that the next omnid can read too
            os.mkfifo(self.workdir / OUTPUT, 0o600)
            plan["output"] = str(self.workdir / OUTPUT)
        if spec.limits.cpu_cores:  # thread pools sized to the quota, not the host
            plan["env"].setdefault("OMP_NUM_THREADS", str(max(1, int(spec.limits.cpu_cores))))
        self._cgroup = self._cgroups.create(spec.name, spec.limits)
        self._oom_before = self._cgroup.oom_kills()
        err_r, err_w = os.pipe()
        plan["error_fd"] = err_w
        join_files = self._cgroup.join_files()

        def preexec() -> None:  # in the child, before exec: join the cgroup first
            pid = str(os.getpid()).encode()  # (no parent-death signal: it outlives omnid)
            for path in join_files:
                fd = os.open(path, os.O_WRONLY)
                os.write(fd, pid)
                os.close(fd)

        plan_path = self.workdir / "plan"
        plan_path.write_bytes(marshal.dumps(plan))  # the launcher reads it with marshal
        out = open_log(spec.log_path) if spec.log_path is not None else subprocess.DEVNULL
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                str(LAUNCHER),
                str(plan_path),
                pass_fds=(err_w, *spec.pass_fds),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,
            )
        except BaseException:
            os.close(err_r)
            await self._teardown()  # the cgroup
            raise
        finally:
            os.close(err_w)
            if out not in (subprocess.PIPE, subprocess.DEVNULL):
                out.close()
        self.launcher_pid = self._proc.pid
        try:
            await self._wait_setup(err_r)
            self.output = await self._read_output()
            self.record = Record(
                spec.name,
                self._proc.pid,
                started(self._proc.pid) or 0,
                self._init_pid() or 0,
                self.view.uid,
                spec.fingerprint,
                tuple(spec.pass_fds),
            )
            self.record.save(self.workdir)
        except BaseException:
            await self._teardown()
            raise
        finally:
            os.close(err_r)

    @classmethod
    async def adopt(
        cls,
        spec: SandboxSpec,
        cgroups: CgroupManager,
        workdir_root: Path,
        record: Record,
        view: ViewConfig | None = None,
        orphan_timeout_s: float = 60.0,
    ) -> IsolatedSandbox:
        """The running sandbox `record` describes, left by an earlier omnid: owned by this
        one from now on (its launcher stops counting down), watched through a pidfd."""
        box = cls(spec, cgroups, workdir_root, view, orphan_timeout_s=orphan_timeout_s)
        pidfd = os.pidfd_open(record.launcher_pid)
        if not record.alive():  # the pid was reused between the check and the pidfd
            os.close(pidfd)
            raise ProcessLookupError(record.launcher_pid)
        box._watch_exit(pidfd)
        box.launcher_pid, box.record = record.launcher_pid, record
        box._cgroup = cgroups.existing(spec.name)
        claim(box.workdir)
        if (box.workdir / OUTPUT).exists():
            box.output = await box._read_output()
        return box

    def detach(self) -> None:
        """Leave it running for the next omnid to adopt (live restore)."""
        if self._output is not None:
            self._output.close()
        self._close_pidfd()

    def _watch_exit(self, pidfd: int) -> None:
        """The launcher's exit (not our child: a pidfd turns readable) as a future."""
        loop = asyncio.get_running_loop()
        self._pidfd, self._gone = pidfd, loop.create_future()

        def gone() -> None:
            self._close_pidfd()
            if not self._gone.done():
                self._gone.set_result(None)

        loop.add_reader(pidfd, gone)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    async def _read_output(self) -> asyncio.StreamReader | None:
        """Its output FIFO, read from now on (EOF once the launcher, its one writer, exits)."""
        if not (self.workdir / OUTPUT).exists():
            return None
        fd = os.open(self.workdir / OUTPUT, os.O_RDONLY | os.O_NONBLOCK)
        reader = asyncio.StreamReader(limit=1 << 20)
        self._output, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
        )
        return reader

    def _init_pid(self) -> int | None:
        """The sandbox's init (the launcher's child), by its host pid."""
        try:
            path = f"/proc/{self.launcher_pid}/task/{self.launcher_pid}/children"
            return int(Path(path).read_text().split()[0])
        except (OSError, IndexError, ValueError):
            return None

    async def _launcher_exited(self) -> None:
        """Until the launcher has exited: our child's wait, or an adopted one's pidfd."""
        if self._proc is not None:
            await self._proc.wait()
            return
        assert self._gone is not None, "neither started nor adopted"
        await asyncio.shield(self._gone)

    @property
    def pid(self) -> int | None:
        """The instance's host pid (launcher -> sandbox init -> instance), once it runs."""
        pid = self.launcher_pid
        for _ in range(2):
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except (OSError, TypeError):
                return None
            if not children:
                return None
            pid = int(children[0])
        return pid

    async def _wait_setup(self, err_r: int) -> None:
        """Until the instance's exec closes the error pipe, or a report on it names the
        setup step that failed."""
        name = self.spec.name
        try:
            report = await asyncio.wait_for(asyncio.to_thread(_read_to_eof, err_r), SETUP_TIMEOUT_S)
        except TimeoutError:
            raise SandboxError(name, "setup", "", f"not done in {SETUP_TIMEOUT_S:.0f} s") from None
        if report:
            step, path, reason = marshal.loads(report)
            raise SandboxError(name, step, path, reason)

    async def exited(self) -> None:
        """The launcher has exited (its sandbox's init with it); the teardown is wait's."""
        await self._launcher_exited()

    async def wait(self) -> ExitStatus:
        await self._launcher_exited()
        return await self._teardown()

    def owns(self, pid: int, uid: int) -> bool:
        """Its uid, and a process in its cgroup (where nothing else can enter)."""
        if uid != self.view.uid or self._cgroup is None:
            return False
        try:
            return pid in self._cgroup.pids()
        except OSError:
            return False

    async def stop(self, grace_s: float = 5.0) -> ExitStatus:
        with contextlib.suppress(ProcessLookupError):
            if self._proc is not None and self._proc.returncode is None:
                self._proc.send_signal(signal.SIGTERM)  # forwarded to the instance
            elif self._pidfd is not None:  # adopted, still running
                signal.pidfd_send_signal(self._pidfd, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._launcher_exited()), grace_s)
        return await self._teardown()  # kills whatever is left

    def _teardown(self) -> asyncio.Future[ExitStatus]:
        """Once per sandbox, however many callers (wait, stop) ask."""
        if self._teardown_task is None:
            self._teardown_task = asyncio.ensure_future(self._do_teardown())
        return asyncio.shield(self._teardown_task)

    async def _do_teardown(self) -> ExitStatus:
        oom = False
        if self._cgroup is not None:
            with contextlib.suppress(OSError):
                oom = self._cgroup.oom_kills() > self._oom_before
            await asyncio.to_thread(self._cgroup.destroy)
        if self._proc is not None:
            code = await self._proc.wait()
        else:  # adopted: not our child, its launcher wrote the instance's status
            status = exit_status(self.workdir)
            code = os.waitstatus_to_exitcode(status) if status is not None else None
        self.detach()
        shutil.rmtree(self.workdir, ignore_errors=True)
        try:  # what it wrote goes with it: nothing of it stays on the host
            await asyncio.to_thread(hostfs.remove_tree, self.spec.socket_dir)
        except OSError as exc:
            log.error("sandbox %s: cannot remove %s: %s", self.spec.name, self.spec.socket_dir, exc)
        if oom:
            reason = "oom"
        elif code == launch.SETUP_FAILED:
            reason = "setup-failed"
        else:
            reason = "killed" if code is not None and code < 0 else "exited"
        return ExitStatus(code, reason)
