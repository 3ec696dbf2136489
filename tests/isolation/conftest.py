"""Real sandboxes for the escape-attempt suite: each attempt is a small program run inside one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from omni.isolation.cgroups import CgroupError, CgroupManager
from omni.isolation.isolated import IsolatedSandbox
from omni.isolation.sandbox import ExitStatus, Limits, SandboxSpec
from omni.isolation.seccomp import export_bpf
from omni.isolation.view import ViewConfig

UID = 65534


@dataclass
class Result:
    status: ExitStatus
    output: str

    @property
    def report(self) -> dict:
        """The attempt's last output line, a JSON object."""
        lines = [line for line in self.output.splitlines() if line.startswith("{")]
        assert lines, f"attempt printed no report; output:\n{self.output}"
        return json.loads(lines[-1])


@dataclass
class Host:
    """What a sandbox must not reach, laid out the way omnid lays out a node."""

    root: Path
    cgroups: CgroupManager
    seccomp: Path
    own_model: Path = field(init=False)
    other_model: Path = field(init=False)
    shared: Path = field(init=False)  # visible read-only dir holding another model
    hidden_model: Path = field(init=False)
    state_dir: Path = field(init=False)
    admin_socket: Path = field(init=False)
    runtime: Path = field(init=False)
    counter: int = 0

    def __post_init__(self):
        r = self.root
        self.own_model, self.other_model = r / "models" / "mine", r / "models" / "other"
        self.shared, self.hidden_model = r / "shared", r / "shared" / "hidden-model"
        self.state_dir, self.runtime = r / "state", r / "run"
        for d in (
            self.own_model,
            self.other_model,
            self.hidden_model,
            self.state_dir,
            self.runtime,
        ):
            d.mkdir(parents=True)
            d.chmod(0o755)
        (self.own_model / "weights.bin").write_bytes(b"mine")
        (self.own_model / "cache.bin").write_bytes(b"")  # writable by anyone, on the host
        (self.other_model / "secret.txt").write_text("other tenant's weights")
        (self.hidden_model / "secret.txt").write_text("hidden weights")
        (self.shared / "public.txt").write_text("visible")
        (self.state_dir / "catalog.json").write_text("{}")
        for f in (self.own_model / "weights.bin", self.shared / "public.txt"):
            f.chmod(0o644)
        (self.own_model / "cache.bin").chmod(0o666)
        self.admin_socket = self.runtime / "omnid.sock"
        self._admin = socket.socket(socket.AF_UNIX)
        self._admin.bind(str(self.admin_socket))
        self._admin.listen()

    def spec(self, code: str, **overrides) -> SandboxSpec:
        self.counter += 1
        name = f"esc{os.getpid()}-{self.counter}"
        spec = SandboxSpec(
            name=name,
            argv=[sys.executable, "-c", code],
            env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
            model_dir=self.own_model,
            socket_dir=self.runtime / "instances" / name,
            limits=Limits(memory_bytes=512 << 20, cpu_cores=1, pids=64),
            hide=(self.other_model, self.hidden_model),
            extra_ro=(self.shared,),
            log_path=self.root / f"{name}.log",
        )
        return replace(spec, **overrides)

    def sandbox(self, spec: SandboxSpec, view: ViewConfig | None = None) -> IsolatedSandbox:
        return IsolatedSandbox(
            spec, self.cgroups, self.runtime / "sandboxes", view=view, seccomp_bpf=self.seccomp
        )

    def run(
        self, code: str, timeout_s: float = 60, view: ViewConfig | None = None, **overrides
    ) -> Result:
        spec = self.spec(code, **overrides)

        async def go() -> ExitStatus:
            box = self.sandbox(spec, view)
            await box.start()
            try:
                return await asyncio.wait_for(box.wait(), timeout_s)
            except TimeoutError:
                return await box.stop(grace_s=0)

        status = asyncio.run(go())
        return Result(status, spec.log_path.read_text() if spec.log_path.exists() else "")

    def close(self) -> None:
        self._admin.close()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def host() -> Host:
    if os.geteuid() != 0:
        pytest.skip("sandboxes need root")
    try:
        cgroups = CgroupManager.detect(f"escape-{os.getpid()}")
    except (CgroupError, OSError) as exc:
        pytest.skip(f"no usable cgroups: {exc}")
    root = Path(tempfile.mkdtemp(prefix="omni-esc-", dir="/tmp"))
    root.chmod(0o755)
    try:
        h = Host(root, cgroups, export_bpf(root / "seccomp.bpf"))
        yield h
        h.close()
    finally:  # its escape-<pid> cgroup scope and tmp dir, also where Host(...) failed
        cgroups.close()
        shutil.rmtree(root, ignore_errors=True)


def setuid_copy(src: str, dst: Path) -> Path:
    shutil.copy(src, dst)
    os.chown(dst, 0, 0)
    dst.chmod(stat.S_ISUID | 0o755)
    return dst
