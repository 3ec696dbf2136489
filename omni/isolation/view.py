"""What an instance may see: the mount plan of its filesystem view.

Read-only system and Python environment (read-only down to every sub-mount;
for a python-runtime model, of site-packages only the shared base and omni), its
own model directory read-only, its model's own packages read-only at
/omni/env (no other model's), its socket directory, a private
size-limited /tmp (noexec), a JIT cache (the one place it may both write and
execute), its own /proc (read-only; on a GPU its kernel knobs alone, since the
CUDA driver needs it writable) with a meminfo, stat, loadavg and uptime that
show its memory and CPUs and nothing of the host's load (the host-wide counters
masked), a /sys of the parts it needs (CPU and NUMA topology, each node's
meminfo its own; PCI devices and the driver's module for a GPU instance) with
its own cgroup alone under /sys/fs/cgroup, and a /dev with only the harmless
nodes (plus the NVIDIA nodes of the GPUs it was given). Other models'
directories that happen to lie under a visible path are covered with an empty
tmpfs. sysinfo(2), which reads the same figures from the kernel, is answered by
the launcher (seccomp user notification, launch.py).
"""

from __future__ import annotations

import glob
import math
import os
import site
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .sandbox import PYTHON_ENV_MOUNT, SandboxSpec, with_import_path

SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
ETC_ENTRIES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "nsswitch.conf",
    "os-release",
    "ssl",
)
DEVICES = ("null", "zero", "full", "random", "urandom")
# /sys: what every instance may read (CPU topology for thread pools, NUMA nodes), and
# what the CUDA driver and NVML read besides for a GPU instance.
SYS_PARTS = ("devices/system/cpu", "devices/system/node")
SYS_GPU_PARTS = ("bus/pci", "module/nvidia", "module/nvidia_uvm")  # + devices/pci*
# /proc files that tell of the host's other processes, timers, kernel or whole-machine
# memory and load: read as empty.
PROC_MASKED = (
    "kcore",
    "keys",
    "timer_list",
    "timer_stats",
    "sched_debug",
    "latency_stats",
    "schedstat",
    "interrupts",
    "softirqs",
    "diskstats",
    "sysrq-trigger",
    "vmstat",
    "zoneinfo",
    "buddyinfo",
    "pagetypeinfo",
    "slabinfo",
    "swaps",
    "locks",
    "sys/fs/file-nr",
    "sys/fs/inode-nr",
    "sys/fs/inode-state",
    "sys/fs/dentry-state",
)
# A writable /proc's parts that change the kernel rather than the instance's own processes.
PROC_READONLY = ("sys", "bus", "fs", "irq")
PROC_MASKED_DIRS = ("acpi", "scsi", "asound", "pressure")  # pressure: as without PSI
# What glibc's getloadavg() parses (an empty file makes os.getloadavg() raise): no load,
# one process. /proc/uptime: the host's would tell when it booted and how busy it was.
LOADAVG = "0.00 0.00 0.00 1/1 1\n"
UPTIME = "0.00 0.00\n"
# The JIT cache: the one mount an instance may both write and execute from. Triton,
# TorchInductor and torch's C++ extensions compile shared objects and dlopen them,
# which a noexec /tmp forbids; everything else it can write is noexec.
JIT_CACHE = "/cache"
JIT_ENV = {
    "TRITON_CACHE_DIR": f"{JIT_CACHE}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{JIT_CACHE}/torchinductor",
    "TORCH_EXTENSIONS_DIR": f"{JIT_CACHE}/torch_extensions",
}
GPU_SHARED_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
MS_RDONLY, MS_NOEXEC = 0x1, 0x8


@dataclass(frozen=True)
class ViewConfig:
    uid: int = 65534  # owns nothing on the host; omnid gives each instance its own
    gid: int = 65534
    jit_cache_bytes: int = 512 << 20  # JIT_CACHE: tmpfs, charged to its memory
    shm_bytes: int = 64 << 20
    open_files: int = 4096


def _under(path: Path, roots: list[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def _outermost(paths: list[Path]) -> list[Path]:
    return sorted({p for p in paths if not _under(p, [q for q in paths if q != p])})


def python_paths(pythonpath: str | None = None) -> list[Path]:
    """Where the interpreter and the installed packages really are: the interpreter's
    prefixes, its site directories, the `omni` package and the instance's PYTHONPATH
    (`pythonpath`, as its environment sets it; omnid's own where None).

    Never sys.path itself: under `cd / && python -m ...` its first entry is the host's
    root, and a script-started omnid puts its own directory there. Of a source
    checkout only the `omni` package is shown, so its other files stay hidden.
    """
    package = Path(__file__).resolve().parents[1]  # the `omni` package
    checkout = package.parent
    candidates = [Path(sys.base_prefix), Path(sys.base_exec_prefix), Path(sys.prefix)]
    candidates += [Path(sys.exec_prefix), package, *map(Path, site.getsitepackages())]
    if pythonpath is None:
        pythonpath = os.environ.get("PYTHONPATH", "")
    candidates += [Path(p) for p in pythonpath.split(os.pathsep) if p]
    out: list[Path] = []
    for path in candidates:
        if not path.is_absolute():
            continue  # relative to omnid's working directory: not an installed location
        path = path.resolve()
        if path in (Path("/"), checkout) or not path.is_dir():
            continue
        out.append(path)
    return _outermost(out)


def meminfo(limit_bytes: int) -> str:
    """/proc/meminfo as the instance should see it: its limit is all the memory there is."""
    kb = limit_bytes // 1024
    lines = []
    for line in Path("/proc/meminfo").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("MemTotal", "MemFree", "MemAvailable", "CommitLimit"):
            real = int(line.split()[1])
            line = f"{key}:{min(real, kb):>16} kB"
        elif key in ("SwapTotal", "SwapFree"):
            line = f"{key}:{0:>16} kB"
        lines.append(line)
    return "\n".join(lines) + "\n"


def node_meminfo(text: str, limit_bytes: int) -> str:
    """A NUMA node's meminfo (/sys/devices/system/node/nodeN/meminfo, `text` the host's)
    as the instance should see it: total and free capped at its limit, no other counter."""
    kb = limit_bytes // 1024
    shown: dict[str, int] = {}
    lines = []
    for line in text.splitlines():
        head, _, rest = line.partition(":")  # "Node 0 MemTotal", "  7169824 kB"
        key, fields = head.split()[-1], rest.split()
        if key in ("MemTotal", "MemFree"):
            shown[key] = min(int(fields[0]), kb)
        elif key == "MemUsed":
            shown[key] = shown.get("MemTotal", 0) - shown.get("MemFree", 0)
        else:
            shown[key] = 0
        unit = f" {fields[1]}" if len(fields) > 1 else ""
        lines.append(f"{head}: {shown[key]:>15}{unit}")
    return "\n".join(lines) + "\n"


def proc_stat(cpus: int) -> str:
    """/proc/stat with the instance's CPUs and no counters: the host's would tell of the
    whole machine's activity, its neighbours' load among it. The boot time stays
    (process start times are counted from it)."""
    host = Path("/proc/stat").read_text().splitlines()
    btime = next((line for line in host if line.startswith("btime ")), "btime 0")
    zeros = " 0" * 10
    lines = [f"cpu {zeros}", *(f"cpu{i}{zeros}" for i in range(cpus))]
    lines += ["intr 0", "ctxt 0", btime, "processes 0", "procs_running 1", "procs_blocked 0"]
    return "\n".join(lines) + "\n"


def sys_parts(gpu: bool) -> list[str]:
    """The parts of /sys an instance sees (paths relative to /sys)."""
    parts = list(SYS_PARTS)
    if gpu:
        parts += SYS_GPU_PARTS
        parts += sorted(os.path.relpath(p, "/sys") for p in glob.glob("/sys/devices/pci*"))
    return parts


def _narrow_site_packages(
    entries: tuple[Path, ...], visible: list[Path], mounts: list[dict], bind: Callable[..., None]
) -> None:
    """Each visible site-packages directory holding `entries` covered with an empty
    tmpfs (root's, 0755) on which those entries alone, and the `omni` package if it
    lies there, are bound again: the packages of omnid's venv outside the shared base
    stay out of a handler's reach."""
    package = Path(__file__).resolve().parents[1]
    shown = [*entries, package]
    for site_dir in sorted({Path(e).parent for e in entries}):
        if not _under(site_dir, visible):
            continue
        mounts.append({"type": "tmpfs", "dst": str(site_dir), "options": "mode=0755,size=64k"})
        for entry in shown:
            if Path(entry).parent == site_dir and os.path.exists(entry):
                bind(Path(entry))


class _ViewBuilder:
    """Builds one instance's mount plan, a part of its view per method; `bind` and
    `generated` add to `mounts` and `visible` in the order the launcher mounts them
    (build_plan's stable sort keeps that order among mounts of equal depth)."""

    def __init__(self, spec: SandboxSpec, cfg: ViewConfig, workdir: Path) -> None:
        self.spec, self.cfg, self.workdir = spec, cfg, workdir
        self.mounts: list[dict] = []
        self.visible: list[Path] = []
        self.env = spec.env
        self.hidden_envs: list[Path] = []
        self.cpus = max(1, math.ceil(spec.limits.cpu_cores or os.cpu_count() or 1))

    def bind(self, src: Path, dst: Path | None = None, **flags) -> None:
        self.mounts.append({"type": "bind", "src": str(src), "dst": str(dst or src), **flags})
        self.visible.append(Path(dst or src))

    def generated(self, name: str, content: str, dst: str) -> None:
        (self.workdir / name).write_text(content)
        self.bind(self.workdir / name, Path(dst))

    def system(self) -> None:
        """The system directories and /etc, its passwd, group and hosts generated."""
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                self.mounts.append({"type": "symlink", "target": os.readlink(d), "dst": d})
            elif os.path.isdir(d):
                self.bind(Path(d))
        self.mounts.append({"type": "dir", "dst": "/etc"})
        for entry in ETC_ENTRIES:
            if os.path.exists(f"/etc/{entry}"):
                self.bind(Path(f"/etc/{entry}"))
        uid, gid = self.cfg.uid, self.cfg.gid
        self.generated(
            "passwd",
            f"root:x:0:0:root:/:/usr/sbin/nologin\n"
            f"omni:x:{uid}:{gid}:omni instance:/tmp:/usr/sbin/nologin\n",
            "/etc/passwd",
        )
        self.generated("group", f"root:x:0:\nomni:x:{gid}:\n", "/etc/group")
        hosts = f"127.0.0.1 localhost {self.spec.name}\n::1 localhost\n"
        self.generated("hosts", hosts, "/etc/hosts")

    def python(self) -> None:
        """The interpreter and its packages (of site-packages only the shared base and
        omni, where python_base is set), and the extra read-only paths."""
        spec = self.spec
        for path in [*python_paths(spec.env.get("PYTHONPATH", "")), *spec.extra_ro]:
            if not _under(path, self.visible):
                self.bind(path)
        if spec.python_base is not None:
            _narrow_site_packages(spec.python_base, self.visible, self.mounts, self.bind)

    def own_dirs(self) -> None:
        """The model's own directories and the instance's: model, packages, shared
        directory, socket directory and the extra writable ones."""
        spec = self.spec
        self.bind(spec.model_dir)
        if spec.python_env is not None:  # its own packages at a fixed path; no other model's
            self.bind(spec.python_env, PYTHON_ENV_MOUNT)
            self.env = with_import_path(self.env, str(PYTHON_ENV_MOUNT))
            self.hidden_envs.append(spec.python_env.parent)
        if spec.shared_dir is not None:  # root's directory: writable files, no new entries
            self.bind(spec.shared_dir, ro=False, noexec=True)
        self.bind(spec.socket_dir, ro=False, noexec=True)
        for path in spec.extra_rw:
            self.bind(path, ro=False, noexec=True)

    def hide_others(self) -> None:
        """Other models' directories under a visible path, covered with an empty tmpfs."""
        spec = self.spec
        hide = [
            h
            for h in (*spec.hide, *self.hidden_envs)
            if h.is_dir() and not _under(spec.model_dir, [h])
        ]
        for hidden in _outermost(hide):  # another model's files under a visible path
            if _under(hidden, self.visible):
                self.mounts.append(
                    {
                        "type": "tmpfs",
                        "dst": str(hidden),
                        "flags": MS_RDONLY,
                        "options": "size=4k,mode=0555",
                    }
                )

    def proc(self) -> None:
        """/proc: its mode, its generated meminfo, stat, loadavg and uptime, and the
        host-wide entries masked."""
        spec = self.spec
        # Read-only: no sysctl, /proc/<pid>/mem or oom_score_adj writes (nothing needs them),
        # except on a GPU, where the CUDA driver's cuInit fails on a read-only /proc (error
        # 304, seen on an H100 host): there its kernel knobs alone are read-only.
        if spec.gpus is None:
            self.mounts.append({"type": "proc", "dst": "/proc", "flags": MS_RDONLY})
        else:
            self.mounts.append({"type": "proc", "dst": "/proc", "readonly": PROC_READONLY})
        if spec.limits.memory_bytes:
            self.generated("meminfo", meminfo(spec.limits.memory_bytes), "/proc/meminfo")
        self.generated("stat", proc_stat(self.cpus), "/proc/stat")
        self.generated("loadavg", LOADAVG, "/proc/loadavg")
        self.generated("uptime", UPTIME, "/proc/uptime")
        self._proc_masked()

    def _proc_masked(self) -> None:
        (self.workdir / "empty").write_text("")
        for name in PROC_MASKED:  # `sys/...`: readable by anyone, host-wide counters
            if os.path.isfile(f"/proc/{name}"):
                self.bind(self.workdir / "empty", Path("/proc") / name)
        for name in PROC_MASKED_DIRS:
            if os.path.isdir(f"/proc/{name}"):
                self.mounts.append(
                    {
                        "type": "tmpfs",
                        "dst": f"/proc/{name}",
                        "flags": MS_RDONLY,
                        "options": "size=4k",
                    }
                )

    def sysfs(self, cgroup_mounts: list[dict] | None) -> None:
        """/sys: its parts, the instance's own cgroup, its CPUs and each node's meminfo."""
        spec = self.spec
        self.mounts.append(
            {"type": "sysfs", "dst": "/sys", "parts": sys_parts(spec.gpus is not None)}
        )
        self.mounts.extend(cgroup_mounts or ())
        if spec.limits.cpu_cores:
            cpus = self.cpus
            online = f"0-{cpus - 1}\n" if cpus > 1 else "0\n"
            self.generated("cpu-online", online, "/sys/devices/system/cpu/online")
        if spec.limits.memory_bytes:  # as /proc/meminfo: where it has a limit, that is all
            for path in sorted(glob.glob("/sys/devices/system/node/node*/meminfo")):
                node = Path(path).parent.name
                text = node_meminfo(Path(path).read_text(), spec.limits.memory_bytes)
                self.generated(f"{node}-meminfo", text, path)

    def dev(self) -> None:
        """/dev: a tmpfs with the harmless devices (and the GPUs given), the fd links and
        /dev/shm."""
        self.mounts.append({"type": "tmpfs", "dst": "/dev", "options": "mode=0755,size=64k"})
        devices = list(DEVICES)
        if self.spec.gpus is not None:
            devices += [f"nvidia{i}" for i in self.spec.gpus] + list(GPU_SHARED_DEVICES)
        for dev in devices:
            if os.path.exists(f"/dev/{dev}"):
                self.bind(Path(f"/dev/{dev}"), ro=False, device=True, noexec=True)
        for name, target in (
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ):
            self.mounts.append({"type": "symlink", "target": target, "dst": f"/dev/{name}"})
        self.mounts.append(
            {
                "type": "tmpfs",
                "dst": "/dev/shm",
                "options": f"mode=1777,size={self.cfg.shm_bytes}",
                "flags": MS_NOEXEC,
            }
        )

    def tmpfs(self) -> None:
        """The private /tmp (noexec) and the JIT cache."""
        self.mounts.append(
            {
                "type": "tmpfs",
                "dst": "/tmp",
                "options": f"mode=1777,size={self.spec.limits.tmp_bytes}",
                "flags": MS_NOEXEC,
            }
        )
        # The one writable mount with exec (nosuid, nodev as every tmpfs): JIT_CACHE.
        self.mounts.append(
            {
                "type": "tmpfs",
                "dst": JIT_CACHE,
                "options": f"mode=1777,size={self.cfg.jit_cache_bytes}",
            }
        )

    def rlimits(self) -> dict[str, list[int]]:
        cfg, limits = self.cfg, self.spec.limits
        rlimits = {"RLIMIT_CORE": [0, 0], "RLIMIT_NOFILE": [cfg.open_files, cfg.open_files]}
        if limits.pids:  # per uid: holds even where no pids controller is delegated
            rlimits["RLIMIT_NPROC"] = [limits.pids, limits.pids]
        return rlimits

    def plan(self) -> dict:
        """The plan of the parts added so far, its mounts parents first."""
        spec, cfg = self.spec, self.cfg
        rlimits = self.rlimits()
        # Parents before children (stable): a bind under /tmp lands on the private /tmp,
        # a hiding tmpfs on top of the bind that showed the hidden directory.
        self.mounts.sort(key=lambda m: len(Path(m["dst"]).parts))
        return {
            "hostname": spec.name,
            "root": str(self.workdir / "root"),
            "mounts": self.mounts,
            "uid": cfg.uid,
            "gid": cfg.gid,
            "rlimits": rlimits,
            "argv": spec.argv,
            "env": {**JIT_ENV, **self.env},  # the instance's own settings win
            "cwd": "/tmp",
            "memory_bytes": spec.limits.memory_bytes,  # what sysinfo(2) answers (launch.py)
        }


def build_plan(
    spec: SandboxSpec, cfg: ViewConfig, workdir: Path, cgroup_mounts: list[dict] | None = None
) -> dict:
    """The launcher's instructions: an ordered mount list plus identity and limits.

    Files the view needs (passwd, meminfo, ...) are written into `workdir`;
    `cgroup_mounts` show the instance its own cgroup (CgroupManager.view_mounts).
    """
    view = _ViewBuilder(spec, cfg, workdir)
    view.system()
    view.python()
    view.own_dirs()
    view.hide_others()
    view.proc()
    view.sysfs(cgroup_mounts)
    view.dev()
    view.tmpfs()
    return view.plan()


if __name__ == "__main__":  # `python -m omni.isolation.view`: what instances are shown
    for shown in python_paths():
        print(shown)
