"""One cgroup per instance, under omnid's own subtree, on cgroup v2 or v1.

v2 (GPU hosts) is written directly; v1 (this CI) goes through cgroupspy.
Either way an instance gets a memory limit without swap, a CPU quota and
weight, and a pids limit, where the host lets omnid's subtree have those
controllers (`CgroupManager.enforced()` says which); teardown kills every
process in the group, however it was forked, before the group is removed, and
`close()` removes omnid's own directories when it stops.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from pathlib import Path
from typing import Protocol

from cgroupspy.controllers import Controller
from cgroupspy.nodes import Node

from .sandbox import Limits

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "cpu", "pids", "freezer")
V2_CONTROLLERS = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000
SUBTREE = "omni"  # instances live under <own cgroup>/omni/<scope>/<instance>
LEAF = "omnid"  # v2: where omnid's own processes go, beside SUBTREE (no inner processes)
# v1: the files each limit is written to, in its hierarchy (cpu: quota and weight)
V1_LIMIT_FILES = {
    "memory": ("memory.limit_in_bytes",),
    "cpu": ("cpu.cfs_quota_us", "cpu.shares"),
    "pids": ("pids.max",),
}
NOT_ENFORCED = {  # logged once for each limit a host keeps from omnid's subtree
    "memory": "memory controller not delegated: instances cannot start",
    "cpu": "cpu controller not delegated: CPU quota and weight not enforced",
    "pids": "pids controller not delegated: process counts are capped by RLIMIT_NPROC only",
}


class CgroupError(RuntimeError):
    pass


class Cgroup(Protocol):
    name: str

    def join_files(self) -> list[str]: ...  # write a pid into each to move it in

    def pids(self) -> list[int]: ...

    def oom_kills(self) -> int: ...

    def destroy(self, timeout_s: float = 5.0) -> None: ...


def _read(path: Path) -> str:
    return path.read_text().strip()


def _write(path: Path, value) -> None:
    try:
        path.write_text(str(value))
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror}") from None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _wait_empty(cgroup: Cgroup, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while cgroup.pids():
        if time.monotonic() > deadline:
            raise CgroupError(f"cgroup {cgroup.name} still has processes {cgroup.pids()}")
        time.sleep(0.005)


def _rmdir(path: Path, timeout_s: float) -> None:
    """Remove a killed group. Its tasks leave cgroup.procs before they have finished
    exiting, and until then rmdir answers EBUSY: retry until the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise CgroupError(f"cannot remove cgroup {path}: {exc.strerror}") from None
            time.sleep(0.005)


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class CgroupV2:
    def __init__(self, path: Path):
        self.path, self.name = path, path.name

    def set_limits(self, limits: Limits) -> None:
        """Limits of the controllers delegated to us; a host may keep some to itself
        (then pids falls back to the launcher's RLIMIT_NPROC, and CPU goes unlimited)."""
        available = set(_read(self.path / "cgroup.controllers").split())
        if limits.memory_bytes is not None:
            if "memory" not in available:
                raise CgroupError("the memory controller is not delegated to omnid")
            _write(self.path / "memory.max", limits.memory_bytes)
            if (self.path / "memory.swap.max").exists():
                _write(self.path / "memory.swap.max", 0)
        if "pids" in available:
            if limits.pids is not None:
                _write(self.path / "pids.max", limits.pids)
        else:
            _warn_once(NOT_ENFORCED["pids"])
        if "cpu" in available:
            if limits.cpu_cores is not None:
                quota = max(1000, int(limits.cpu_cores * CPU_PERIOD_US))
                _write(self.path / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            _write(self.path / "cpu.weight", limits.cpu_weight)
        else:
            _warn_once(NOT_ENFORCED["cpu"])

    def join_files(self) -> list[str]:
        return [str(self.path / "cgroup.procs")]

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in _read(self.path / "cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def oom_kills(self) -> int:
        for line in _read(self.path / "memory.events").splitlines():
            key, value = line.split()
            if key == "oom_kill":
                return int(value)
        return 0

    def destroy(self, timeout_s: float = 5.0) -> None:
        if not self.path.exists():
            return
        if (self.path / "cgroup.kill").exists():
            _write(self.path / "cgroup.kill", 1)
        elif (self.path / "cgroup.freeze").exists():  # before 5.14: freeze, kill, thaw
            _write(self.path / "cgroup.freeze", 1)
            _kill_pids(self.pids())
            _write(self.path / "cgroup.freeze", 0)
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():  # no freezer at all: kill until none is left
            _kill_pids(pids)
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        _wait_empty(self, timeout_s)
        _rmdir(self.path, timeout_s)


class CgroupV1:
    """The same group in each v1 hierarchy, through cgroupspy's controllers.

    cgroupspy types memory and cpu; pids and freezer use its generic controller.
    """

    def __init__(self, name: str, nodes: dict[str, Node]):
        self.name, self.nodes = name, nodes
        self.ctl = {c: n.controller or Controller(n) for c, n in nodes.items()}

    def set_limits(self, limits: Limits) -> None:
        mem, cpu = self.ctl["memory"], self.ctl["cpu"]
        try:
            if limits.memory_bytes is not None:
                mem.limit_in_bytes = limits.memory_bytes
                if os.path.exists(mem.filepath(b"memory.memsw.limit_in_bytes")):
                    mem.memsw_limit_in_bytes = limits.memory_bytes  # no swap beyond it
            mem.swappiness = 0
            if limits.cpu_cores is not None:
                cpu.cfs_period_us = CPU_PERIOD_US
                cpu.cfs_quota_us = max(1000, int(limits.cpu_cores * CPU_PERIOD_US))
            cpu.shares = max(2, limits.cpu_weight * 1024 // 100)
            if limits.pids is not None:
                self.ctl["pids"].set_property(b"pids.max", limits.pids)
        except OSError as exc:
            raise CgroupError(f"cannot set limits {limits} on {self.name}: {exc}") from None

    def join_files(self) -> list[str]:
        return [os.fsdecode(c.filepath(b"cgroup.procs")) for c in self.ctl.values()]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for ctl in self.ctl.values():
            with contextlib.suppress(FileNotFoundError):
                found.update(ctl.procs)
        return sorted(found)

    def _memory_field(self, filename: bytes, key: str) -> int:
        for line in self.ctl["memory"].get_property(filename).splitlines():
            k, value = line.split()
            if k == key:
                return int(value)
        return 0

    def oom_kills(self) -> int:
        return self._memory_field(b"memory.oom_control", "oom_kill")

    def destroy(self, timeout_s: float = 5.0) -> None:
        if not any(os.path.isdir(n.full_path) for n in self.nodes.values()):
            return
        freezer = self.ctl.get("freezer")
        if freezer is not None:
            # Frozen processes cannot fork while we kill them.
            freezer.set_property(b"freezer.state", "FROZEN")
            deadline = time.monotonic() + timeout_s
            while freezer.get_property(b"freezer.state") != "FROZEN":
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            _kill_pids(self.pids())
            freezer.set_property(b"freezer.state", "THAWED")
        _kill_pids(self.pids())
        _wait_empty(self, timeout_s)
        for node in self.nodes.values():
            _rmdir(Path(os.fsdecode(node.full_path)), timeout_s)


def _own_paths() -> dict[str, str]:
    """controller -> this process's cgroup path ('' key: the v2 unified path)."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _v1_mounts() -> dict[str, tuple[Path, str, str]]:
    """controller -> (mount point, root of the hierarchy that mount shows, all the
    controllers of that hierarchy: "cpu,cpuacct" where the host mounts them together)."""
    known = {line.split()[0] for line in Path("/proc/cgroups").read_text().splitlines()[1:]}
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        fields, (fstype, _src, opts) = left.split(), right.split()[:3]
        if fstype != "cgroup":
            continue
        controllers = ",".join(o for o in opts.split(",") if o in known)
        for opt in opts.split(","):
            if opt in V1_CONTROLLERS:
                out[opt] = (Path(fields[4]), fields[3], controllers)
    return out


def _node_chain(path: Path) -> Node:
    """cgroupspy nodes from the cgroup mount root down to `path`, without scanning the tree."""
    parts = path.relative_to(CGROUP_ROOT).parts
    node = Node(str(CGROUP_ROOT).encode() + b"/")
    for part in parts:
        node = Node(part.encode(), parent=node)
    return node


class CgroupManager:
    """omnid's own cgroup subtree; hands out one group per instance."""

    def __init__(
        self, version: int, base: dict[str, Path], hierarchies: dict[str, str] | None = None
    ):
        self.version = version
        self.base = base  # controller ('' for v2) -> directory holding instance groups
        self.hierarchies = hierarchies or {}  # v1: mount name -> its controllers

    def view_mounts(self) -> list[dict]:
        """Mounts (launcher plan entries) that show an instance its own group and nothing
        else: made in its cgroup namespace, whose root is that group."""
        if self.version == 2:
            return [{"type": "cgroup", "dst": "/sys/fs/cgroup", "fstype": "cgroup2"}]
        return [
            {"type": "cgroup", "dst": f"/sys/fs/cgroup/{name}", "fstype": "cgroup", "options": c}
            for name, c in sorted(self.hierarchies.items())
        ]

    def enforced(self) -> dict[str, bool]:
        """Which of an instance's limits this host enforces: memory, cpu (quota and
        weight), pids (without it only the launcher's RLIMIT_NPROC, per uid, caps process
        counts). v2: the controllers the scope enables for its groups; v1: the limit files
        of each mounted hierarchy. Each one missing is logged once."""
        if self.version == 2:
            enabled = set(_read(self.base[""] / "cgroup.subtree_control").split())
            out = {c: c in enabled for c in V2_CONTROLLERS}
        else:
            out = {
                c: all((self.base[c] / f).exists() for f in files)
                for c, files in V1_LIMIT_FILES.items()
            }
        for limit, held in out.items():
            if not held:
                _warn_once(NOT_ENFORCED[limit])
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Remove the scope's directories, and omnid's subtree where no other scope is
        left in it. A group still inside (a stop that failed) is destroyed first."""
        scopes = sorted(set(self.base.values()))
        names = {d.name for s in scopes if s.is_dir() for d in s.iterdir() if d.is_dir()}
        for name in sorted(names):
            log.warning("cgroup %s left behind at shutdown: destroying it", name)
            try:
                self.existing(name).destroy(timeout_s)
            except CgroupError as exc:
                log.warning("%s", exc)
        for path in [*scopes, *sorted({s.parent for s in scopes})]:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # the subtree: another omnid's scope is in it
                if path in scopes:
                    log.warning("cannot remove cgroup %s: %s", path, exc.strerror)

    def existing(self, name: str) -> CgroupV1 | CgroupV2:
        """The group `name` as it is (an adopted instance's, or one left behind)."""
        if self.version == 2:
            return CgroupV2(self.base[""] / name)
        found = {c: _node_chain(b / name) for c, b in self.base.items() if (b / name).is_dir()}
        return CgroupV1(name, found)

    @classmethod
    def detect(cls, scope: str) -> CgroupManager:
        """`scope` separates the groups of several omnids that share one cgroup."""
        own = _own_paths()
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            group = CGROUP_ROOT / own[""].lstrip("/")
            if group.name == LEAF and (group.parent / SUBTREE).is_dir():
                group = group.parent  # the leaf an earlier omnid moved us into: not our own
            return cls(2, {"": cls._prepare_v2(group, scope)})
        mounts = _v1_mounts()
        missing = [c for c in V1_CONTROLLERS if c not in mounts]
        if missing:
            raise CgroupError(f"cgroup v1 controllers not mounted: {', '.join(missing)}")
        base, hierarchies = {}, {}
        for c in V1_CONTROLLERS:
            mount_point, mount_root, controllers = mounts[c]
            rel = os.path.relpath(own.get(c, "/"), mount_root)
            base[c] = (mount_point / rel / SUBTREE / scope).resolve()
            base[c].mkdir(parents=True, exist_ok=True)
            hierarchies[mount_point.name] = controllers
        return cls(1, base, hierarchies)

    @staticmethod
    def _prepare_v2(own: Path, scope: str) -> Path:
        """Enable controllers for our subtree. v2 forbids processes in an inner node that
        enables controllers, so if ours must enable any, its processes (omnid alone under
        systemd) first move into a leaf."""
        enabled = set(_read(own / "cgroup.subtree_control").split())
        available = set(_read(own / "cgroup.controllers").split())
        missing = {c for c in V2_CONTROLLERS if c in available} - enabled
        if own != CGROUP_ROOT and missing and _read(own / "cgroup.procs"):
            leaf = own / LEAF
            leaf.mkdir(exist_ok=True)
            for pid in _read(own / "cgroup.procs").split():
                with contextlib.suppress(ProcessLookupError, OSError):
                    _write(leaf / "cgroup.procs", pid)
        subtree = own / SUBTREE / scope
        subtree.mkdir(parents=True, exist_ok=True)
        for parent in (own, own / SUBTREE, subtree):
            available = set(_read(parent / "cgroup.controllers").split())
            wanted = [f"+{c}" for c in V2_CONTROLLERS if c in available]
            if wanted:
                _write(parent / "cgroup.subtree_control", " ".join(wanted))
        return subtree

    def create(self, name: str, limits: Limits) -> CgroupV1 | CgroupV2:
        """A fresh group for `name`; a stale one from an earlier run is destroyed first."""
        if self.version == 2:
            path = self.base[""] / name
            if path.exists():
                CgroupV2(path).destroy()
            path.mkdir()
            group: CgroupV1 | CgroupV2 = CgroupV2(path)
        else:
            stale = {c: _node_chain(b / name) for c, b in self.base.items() if (b / name).exists()}
            if stale:
                CgroupV1(name, stale).destroy()
            group = CgroupV1(
                name, {c: _node_chain(b).create_cgroup(name) for c, b in self.base.items()}
            )
        try:
            group.set_limits(limits)
        except CgroupError:
            group.destroy()
            raise
        return group
