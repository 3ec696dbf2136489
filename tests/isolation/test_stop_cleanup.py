"""A clean stop leaves nothing behind: an unloaded instance's cgroup and directories go
with it, and a stopped omnid's (or one whose start failed) take its cgroup scope under
every controller and its runtime dir's instance and sandbox directories with them.
Live restore keeps all of it for the instances it leaves running, until an omnid that
adopted them stops them."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import psutil
import pytest

from omni.isolation.cgroups import CGROUP_ROOT, SUBTREE, V1_CONTROLLERS
from omni.testing.checkpoints import readable_tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid


@pytest.fixture(scope="module")
def model() -> Path:
    if os.geteuid() != 0:
        pytest.skip("sandboxes need root")
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        pytest.skip("finds omnid's groups where cgroup v1 puts them")
    with readable_tiny_llama("omni-clean-") as path:
        yield path


def scope_dirs(runtime_dir: Path) -> list[Path]:
    """omnid's cgroup scope under each v1 controller (omnid is in this process's groups)."""
    scope = hashlib.sha1(str(runtime_dir.resolve()).encode()).hexdigest()[:12]
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            own[c] = path.lstrip("/")
    return [CGROUP_ROOT / c / own[c] / SUBTREE / scope for c in V1_CONTROLLERS]


def isolated(tmp: Path, model: Path, *extra: str, runtime_dir: Path | None = None) -> Omnid:
    config = "".join(f'[[models]]\nname = "{n}"\npath = "{model}"\n' for n in ("a", "b"))
    return Omnid(tmp, config, "--sandbox", "isolated", *extra, runtime_dir=runtime_dir)


def test_an_unload_and_a_stop_leave_no_cgroup_and_no_directory(tmp_path, model):
    node = isolated(tmp_path, model)
    runtime = node.runtime_dir
    try:
        node.wait_ready(["a", "b"])
        scopes = scope_dirs(runtime)
        assert all((s / "a").is_dir() and (s / "b").is_dir() for s in scopes), scopes
        with node.admin() as admin:
            assert admin.delete("/v1/models/b").status_code == 200
        assert not any((s / "b").exists() for s in scopes)
        assert not (runtime / "instances" / "b").exists()
        assert not (runtime / "sandboxes" / "b").exists()
    finally:
        assert node.stop() == 0
    assert [s for s in scopes if s.exists()] == []
    assert list(runtime.iterdir()) == []  # no instances/, sandboxes/ (seccomp.bpf) or socket


def test_a_start_that_fails_leaves_no_cgroup(tmp_path, model):
    """A model whose socket path is too long is refused after the cgroups were made:
    omnid exits 2 and takes them with it."""
    runtime = Path(tempfile.mkdtemp(prefix="omni-" + "x" * 24, dir="/tmp"))
    too_long = "m" * 64  # runtime/instances/<name>/io/sock: past 107 bytes
    config = f'[[models]]\nname = "{too_long}"\npath = "{model}"\n'
    node = Omnid(tmp_path, config, "--sandbox", "isolated", runtime_dir=runtime)
    assert node.proc.wait(timeout=60) == 2, node.log()
    assert "longer than 107 bytes" in node.log()
    assert "sandboxing instances" in node.log()  # the cgroups had been made
    assert [s for s in scope_dirs(runtime) if s.exists()] == []
    assert list(runtime.iterdir()) == []


def test_live_restore_keeps_what_its_instances_use_until_they_stop(tmp_path, model):
    first = isolated(tmp_path, model, "--live-restore")
    runtime, nodes = first.runtime_dir, [first]
    try:
        first.wait_ready(["a", "b"])
        pids = [i["pid"] for i in first.instances().values()]
        assert first.stop() == 0  # they stay running, with all they need
        scopes = scope_dirs(runtime)
        assert all((s / "a").is_dir() and (s / "b").is_dir() for s in scopes), scopes
        assert all((runtime / d / n).is_dir() for d in ("instances", "sandboxes") for n in "ab")
        assert all(psutil.pid_exists(p) for p in pids)

        second = isolated(tmp_path, model, runtime_dir=runtime)  # adopts them, no live restore
        nodes.append(second)
        second.wait_ready(["a", "b"])
        assert sorted(i["pid"] for i in second.instances().values()) == sorted(pids)
        assert second.stop() == 0
        wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 30, "the instances gone")
        assert [s for s in scopes if s.exists()] == []
        assert list(runtime.iterdir()) == []
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.stop()
