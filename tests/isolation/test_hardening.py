"""Escape routes an outside review found, each tried from inside a real sandbox.

One test (or two) per finding: socket families past the network namespace, io_uring
and the seccomp allow-list, writable sub-mounts, host and neighbour metadata, a view
built from omnid's sys.path, and failed setups that surfaced as a bare BrokenPipeError.
Then issue 48's: host-wide figures in /proc, /sys and sysinfo(2), a writable /proc,
code run from /tmp or from a memfd, and a fork at the process limit.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from omni.isolation import seccomp
from omni.isolation.isolated import SandboxError
from omni.isolation.launch import SysInfo  # struct sysinfo, as the launcher answers it
from omni.isolation.sandbox import Limits
from omni.isolation.view import JIT_CACHE, JIT_ENV, ViewConfig, build_plan
from omni.runtime.catalog import ModelEntry
from omni.runtime.instance import Backoff, Instance

from .test_escape import run

LIMITS = Limits(memory_bytes=384 << 20, cpu_cores=1, pids=64)


def test_socket_families_beyond_ip_and_unix_are_refused(host):
    """AF_VSOCK reaches the hypervisor whatever the network namespace; AF_ALG, AF_TIPC,
    AF_PACKET and netlink's uevent and audit protocols are kernel code no engine needs."""
    r = run(
        host,
        """
def open_socket(family, kind=socket.SOCK_STREAM, proto=0):
    socket.socket(family, kind, proto).close()
def vsock_host():
    s = socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK
    s.settimeout(2)
    s.connect((2, 1024))  # CID 2: the host
NETLINK = socket.AF_NETLINK
report(vsock=attempt(lambda: open_socket(40)),
       vsock_host=attempt(vsock_host),
       alg=attempt(lambda: open_socket(38, socket.SOCK_SEQPACKET)),
       tipc=attempt(lambda: open_socket(30, socket.SOCK_RDM)),
       packet=attempt(lambda: open_socket(17, socket.SOCK_RAW)),
       uevent=attempt(lambda: open_socket(NETLINK, socket.SOCK_DGRAM, 15)),
       audit=attempt(lambda: open_socket(NETLINK, socket.SOCK_RAW, 9)),
       pair_inet=attempt(lambda: socket.socketpair(socket.AF_INET)),
       unix=attempt(lambda: open_socket(socket.AF_UNIX)),
       inet=attempt(lambda: open_socket(socket.AF_INET)),
       inet6=attempt(lambda: open_socket(socket.AF_INET6)),
       route=attempt(lambda: open_socket(NETLINK, socket.SOCK_DGRAM, 0)),
       pair_unix=attempt(lambda: socket.socketpair(socket.AF_UNIX)),
       interfaces=[name for _, name in socket.if_nameindex()])
""",
    )
    refused = ("vsock", "vsock_host", "alg", "tipc", "packet", "pair_inet")
    assert {k: r[k] for k in refused} == dict.fromkeys(refused, "EAFNOSUPPORT")
    assert r["uevent"] == r["audit"] == "EPROTONOSUPPORT"
    allowed = ("unix", "inet", "inet6", "route", "pair_unix")
    assert {k: r[k] for k in allowed} == dict.fromkeys(allowed, "ok")
    assert r["interfaces"] == ["lo"]  # the route socket sees its own namespace


def test_io_uring_and_unlisted_calls_are_refused(host):
    """io_uring is refused outright; a call on neither list (POSIX AIO, vmsplice) reads as
    missing from the kernel, while the calls Python itself makes go through."""
    r = run(
        host,
        """
import platform
NR = {"x86_64": {"io_uring_setup": 425, "io_setup": 206, "vmsplice": 278},
      "aarch64": {"io_uring_setup": 425, "io_setup": 0, "vmsplice": 75}}[platform.machine()]
params = ctypes.create_string_buffer(120)
ctx = ctypes.c_ulong(0)
report(io_uring=attempt(lambda: libc.syscall(NR["io_uring_setup"], 8, params)),
       aio=attempt(lambda: libc.syscall(NR["io_setup"], 8, ctypes.byref(ctx))),
       vmsplice=attempt(lambda: libc.syscall(NR["vmsplice"], 1, None, 0, 0)),
       setuid=attempt(lambda: os.setuid(0)),
       ptrace=attempt(lambda: libc.ptrace(0, 0, None, None)),
       thread=attempt(lambda: __import__("threading").Thread(target=print).start()),
       subprocess=__import__("subprocess").run(["/bin/true"]).returncode)
""",
    )
    assert r["io_uring"] == "EPERM"
    assert r["aio"] == r["vmsplice"] == "ENOSYS"
    assert r["setuid"] == r["ptrace"] == "EPERM"
    assert (r["thread"], r["subprocess"]) == ("ok", 0)


def test_seccomp_policy_is_one_explicit_allow_list():
    allowed = [n for names in seccomp.ALLOWED.values() for n in names]
    refused = [n for names in seccomp.REFUSED.values() for n in names]
    assert len(allowed) == len(set(allowed)) and len(refused) == len(set(refused))
    assert not set(allowed) & set(refused)
    assert not set(seccomp.NOTIFIED) & (set(allowed) | set(refused))
    assert {"io_uring_setup", "io_uring_enter", "io_uring_register"} <= set(refused)
    conditional = {"clone", "clone3", "socket", "socketpair", "personality", "execveat"}
    assert not (conditional | {"sysinfo"}) & set(allowed)
    assert set(seccomp.SOCKET_FAMILIES) == {"AF_UNIX", "AF_INET", "AF_INET6"}


@pytest.fixture
def model_submount(host):
    """A filesystem mounted on the host below the instance's model directory, writable
    by anyone there: a cache disk, say."""
    point = host.own_model / "cache-disk"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "cache", point], check=True)
    yield point
    subprocess.run(["umount", "-l", point], check=True)
    point.rmdir()


def test_every_mount_below_a_read_only_bind_is_read_only(host, model_submount):
    prefix = str(Path(sys.prefix).resolve())
    r = run(
        host,
        f"""
mounts = {{}}
for line in open("/proc/self/mountinfo"):
    fields = line.split()
    mounts[fields[4]] = fields[5].split(",")
def write(path):
    with open(path, "w") as f:
        f.write("x")
report(submount=attempt(lambda: write({str(model_submount / "evil")!r})),
       writable=sorted(p for p, opts in mounts.items() if "rw" in opts
                       and (p.startswith(("/sys", "/usr", {str(host.own_model)!r}, {prefix!r}))
                            or p == "/")))
""",
    )
    assert r["submount"] == "EROFS"  # mode 1777 on the host, read-only here
    assert r["writable"] == []  # /sys, its cgroup mounts, the system, model and Python dirs
    assert not (model_submount / "evil").exists()


def test_own_cgroup_only_and_no_host_metadata(host):
    neighbour = host.cgroups.create(f"neighbour-{os.getpid()}", Limits(memory_bytes=64 << 20))
    try:
        r = run(
            host,
            """
groups = []
for top, dirs, files in os.walk("/sys/fs/cgroup"):
    groups += [os.path.join(top, d) for d in dirs]
def limit():
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        if os.path.exists(path):
            return int(open(path).read())
stat = open("/proc/stat").read().split("\\n")
report(cgroup_paths=sorted({l.split(":", 2)[2] for l in open("/proc/self/cgroup").read().split()}),
       groups=groups, limit=limit(),
       sys=sorted(os.listdir("/sys")),
       net=attempt(lambda: os.listdir("/sys/class/net")),
       firmware=attempt(lambda: os.listdir("/sys/firmware")),
       cpus=sorted(l.split()[0] for l in stat if l.startswith("cpu")),
       ctxt=[l for l in stat if l.startswith("ctxt")],
       loadavg=open("/proc/loadavg").read(),
       getloadavg=os.getloadavg(),
       timer_list=open("/proc/timer_list").read() if os.path.exists("/proc/timer_list") else "",
       online=open("/sys/devices/system/cpu/online").read().strip())
""",
            limits=LIMITS,
        )
    finally:
        neighbour.destroy()
    assert r["cgroup_paths"] == ["/"]  # a cgroup namespace rooted at its own group
    hierarchies = {"/sys/fs/cgroup/" + h for h in ("cpu", "freezer", "memory", "pids")}
    assert set(r["groups"]) <= hierarchies  # no neighbour's group, no host tree
    assert r["limit"] == LIMITS.memory_bytes  # the group it sees is its own
    assert r["sys"] == ["devices", "fs"]
    assert r["net"] == r["firmware"] == "ENOENT"  # the host's interfaces, firmware tables
    assert r["cpus"] == ["cpu", "cpu0"]  # /proc/stat: its one CPU, not the host's
    assert r["ctxt"] == ["ctxt 0"]
    assert r["timer_list"] == ""
    assert r["loadavg"] == "0.00 0.00 0.00 1/1 1\n"  # no load, in the form getloadavg reads
    assert r["getloadavg"] == [0.0, 0.0, 0.0]
    assert r["online"] == "0"


def test_view_is_built_from_install_locations_not_sys_path(tmp_path):
    """`cd / && python -m ...` puts the host's root first on sys.path, a script puts its
    own directory there: neither reaches an instance's view."""
    from_root = subprocess.run(
        [sys.executable, "-m", "omni.isolation.view"],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    script = tmp_path / "start_omnid.py"
    script.write_text(
        "from omni.isolation.view import python_paths\nprint(*python_paths(), sep='\\n')\n"
    )
    from_script = subprocess.run(
        [sys.executable, str(script)], cwd="/", capture_output=True, text=True, check=True
    ).stdout.split()
    package = str(Path(__file__).resolve().parents[2] / "omni")
    for shown in (from_script, from_root):
        assert "/" not in shown and str(tmp_path) not in shown
        assert package in shown
        assert str(Path(sys.prefix).resolve()) in shown or sys.prefix == sys.base_prefix


def start_and_fail(host, view: ViewConfig | None = None, **overrides) -> SandboxError:
    spec = host.spec("print('never')", **overrides)

    async def go() -> SandboxError:
        box = host.sandbox(spec, view)
        with pytest.raises(SandboxError) as failed:
            await box.start()
        assert not list((host.runtime / "sandboxes").glob(spec.name))  # cleaned up
        return failed.value

    return asyncio.run(go())


def test_failed_setup_names_its_step_and_path(host):
    missing = host.root / "not-there"
    error = start_and_fail(host, extra_ro=(missing,))
    assert (error.step, error.path) == ("bind", str(missing))
    assert error.reason.startswith(os.strerror(errno.ENOENT))
    python = str(host.root / "venv-link" / "bin" / "python")
    error = start_and_fail(host, argv=[python, "-c", "pass"])
    assert (error.step, error.path) == ("exec", python)


def test_failed_setup_is_the_instances_last_exit(host):
    missing = host.root / "no-such-lib"
    entry = ModelEntry("broken", host.own_model, "generate", "admin", Limits(pids=64))

    def factory(spec):
        return host.sandbox(replace(spec, extra_ro=(missing,), log_path=host.root / "b.log"))

    async def go() -> dict:
        inst = Instance(
            entry, host.runtime / "instances", factory, Backoff(initial_s=0.1, max_s=0.2)
        )
        inst.start()
        deadline = time.monotonic() + 30
        while inst.last_exit is None:
            assert time.monotonic() < deadline, inst.to_json()
            await asyncio.sleep(0.02)
        await inst.stop()
        return inst.to_json()

    state = asyncio.run(go())
    assert state["last_exit"].startswith("setup-failed: sandbox broken")
    assert f"bind {missing}: No such file or directory" in state["last_exit"]


def test_fork_at_the_process_limit_names_it(host):
    """RLIMIT_NPROC counts every process of the uid on the host: where the uid already
    runs that many, the instance's fork fails, and says why."""
    uid = 64_000 + os.getpid() % 1000  # one of its own, the test fills its count
    sleepers = [subprocess.Popen(["sleep", "60"], user=uid, group=uid) for _ in range(4)]
    try:
        limits = Limits(memory_bytes=LIMITS.memory_bytes, pids=4)  # pids.max leaves room
        error = start_and_fail(host, ViewConfig(uid=uid, gid=uid), limits=limits)
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    assert (error.step, error.path) == ("fork", "")
    assert error.reason.startswith(os.strerror(errno.EAGAIN))
    assert f"process limit of uid {uid} was reached (RLIMIT_NPROC 4" in error.reason


def _host_meminfo_total_kb(path: str) -> int:
    for line in Path(path).read_text().splitlines():
        if "MemTotal:" in line:
            return int(line.split()[-2])
    raise AssertionError(f"no MemTotal in {path}")


def test_host_wide_figures_are_masked(host):
    """Uptime, load, VM counters, pressure stall figures, open-file counts and each NUMA
    node's memory read as the instance's own or as nothing; on the host they are real."""
    masked = ("/proc/vmstat", "/proc/zoneinfo", "/proc/buddyinfo", "/proc/sys/fs/file-nr")
    for path in masked:
        assert Path(path).read_text(), path  # what the instance would have seen
    host_nodes = {
        str(p): _host_meminfo_total_kb(str(p))
        for p in Path("/sys/devices/system/node").glob("node*/meminfo")
    }
    r = run(
        host,
        f"""
import glob
def read(path):
    try:
        return open(path).read()
    except OSError as e:
        return errno.errorcode[e.errno]
nodes = {{}}
for path in glob.glob("/sys/devices/system/node/node*/meminfo"):
    fields = dict(line.split(":", 1) for line in open(path))
    nodes[path] = {{k.split()[-1]: int(v.split()[0]) for k, v in fields.items()}}
report(uptime=read("/proc/uptime"), masked={{p: read(p) for p in {masked!r}}},
       pressure=attempt(lambda: os.listdir("/proc/pressure")),
       pressure_memory=read("/proc/pressure/memory"), nodes=nodes)
""",
        limits=LIMITS,
    )
    assert Path("/proc/uptime").read_text() != "0.00 0.00\n"
    assert r["uptime"] == "0.00 0.00\n"
    assert r["masked"] == dict.fromkeys(masked, "")
    assert r["pressure"] == "ok" and r["pressure_memory"] == "ENOENT"  # as without PSI
    limit_kb = LIMITS.memory_bytes // 1024
    assert set(r["nodes"]) == set(host_nodes)
    for path, fields in r["nodes"].items():
        assert host_nodes[path] != limit_kb  # the host's node is bigger than the instance
        assert fields["MemTotal"] == limit_kb
        assert fields["MemFree"] <= limit_kb
        assert fields["Active"] == fields["FilePages"] == 0  # no host usage counters


def test_sysinfo_tells_the_instances_own_memory_and_no_load(host):
    """sysinfo(2) is answered by the launcher: the limit is all the RAM (glibc's
    sysconf(_SC_PHYS_PAGES) and every thread see it), no load, no swap, one process;
    a bad pointer gets EFAULT as from the kernel."""
    info = SysInfo()
    assert ctypes.CDLL(None).sysinfo(ctypes.byref(info)) == 0
    assert info.totalram * info.mem_unit != LIMITS.memory_bytes  # the host's own figure
    r = run(
        host,
        """
import threading
class SysInfo(ctypes.Structure):
    _fields_ = [("uptime", ctypes.c_long), ("loads", ctypes.c_ulong * 3)]
    _fields_ += [(n, ctypes.c_ulong) for n in ("totalram", "freeram", "sharedram",
                                              "bufferram", "totalswap", "freeswap")]
    _fields_ += [("procs", ctypes.c_ushort), ("pad", ctypes.c_ushort),
                 ("totalhigh", ctypes.c_ulong), ("freehigh", ctypes.c_ulong),
                 ("mem_unit", ctypes.c_uint)]
def call():
    info = SysInfo()
    rc = libc.sysinfo(ctypes.byref(info))
    unit = info.mem_unit
    return dict(rc=rc, total=info.totalram * unit, free=info.freeram * unit,
                swap=info.totalswap * unit, loads=list(info.loads), procs=info.procs,
                uptime=info.uptime)
in_thread = []
thread = threading.Thread(target=lambda: in_thread.append(call()))
thread.start()
thread.join()
page = os.sysconf("SC_PAGE_SIZE")
report(main=call(), thread=in_thread[0], bad=attempt(lambda: libc.sysinfo(None)),
       phys=os.sysconf("SC_PHYS_PAGES") * page, avphys=os.sysconf("SC_AVPHYS_PAGES") * page)
""",
        limits=LIMITS,
    )
    limit = LIMITS.memory_bytes
    for answer in (r["main"], r["thread"]):
        assert answer["rc"] == 0 and answer["total"] == limit
        assert 0 < answer["free"] < limit  # the limit less what the sandbox uses
        assert answer["loads"] == [0, 0, 0] and answer["procs"] == 1 and answer["swap"] == 0
        assert 0 <= answer["uptime"] < 60  # the sandbox's age, not the host's
    assert r["phys"] == limit  # glibc's sysconf reads sysinfo's struct
    assert 0 < r["avphys"] < limit
    assert r["bad"] == "EFAULT"


def test_proc_is_read_only(host):
    """Its own oom_score_adj, thread names, memory through /proc/self/mem, sysctls:
    none written through /proc (its file modes alone let the first three through)."""
    r = run(
        host,
        """
def write(path, text):
    with open(path, "w") as f:
        f.write(text)
oom = open("/proc/self/oom_score_adj").read()
report(oom=attempt(lambda: write("/proc/self/oom_score_adj", oom)),
       comm=attempt(lambda: write("/proc/self/comm", "renamed")),
       mem=attempt(lambda: open("/proc/self/mem", "r+b")),
       sysctl=attempt(lambda: write("/proc/sys/kernel/hostname", "x")),
       options=[l.split()[5] for l in open("/proc/self/mountinfo") if l.split()[4] == "/proc"])
""",
    )
    assert r["oom"] == r["comm"] == r["mem"] == "EROFS"
    assert r["sysctl"] in ("EROFS", "EACCES")
    assert r["options"][0].split(",")[0] == "ro"


def _system_library(name: str = "libm.so.6") -> str:
    """Where this host's `name` really is (a path the instance sees: under /usr or /lib)."""
    ctypes.CDLL(name)
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("/" + name):
            return line.split()[-1]
    raise AssertionError(f"{name} not mapped")


def test_tmp_is_noexec_and_the_jit_cache_is_the_one_exec_place(host):
    """A program or library written to /tmp neither runs nor loads; the JIT cache (where
    Triton and TorchInductor put what they compile) allows both."""
    r = run(
        host,
        f"""
import shutil, subprocess
def dlopen(path):
    try:
        ctypes.CDLL(path)
        return "ok"
    except OSError as e:
        return str(e)
out = {{}}
for where in ("/tmp", {JIT_CACHE!r}):
    shutil.copy("/bin/true", where + "/true")
    os.chmod(where + "/true", 0o755)
    shutil.copy({_system_library()!r}, where + "/libm-copy.so")
    out[where] = dict(run=attempt(lambda: subprocess.run([where + "/true"], check=True)),
                      dlopen=dlopen(where + "/libm-copy.so"))
options = {{l.split()[4]: l.split()[5].split(",") for l in open("/proc/self/mountinfo")}}
report(out=out, tmp=options["/tmp"], cache=options[{JIT_CACHE!r}])
""",
    )
    assert r["out"]["/tmp"]["run"] == "EACCES"
    assert "failed to map segment" in r["out"]["/tmp"]["dlopen"]
    assert r["out"][JIT_CACHE] == {"run": "ok", "dlopen": "ok"}
    assert {"rw", "noexec", "nosuid", "nodev"} <= set(r["tmp"])
    assert {"rw", "nosuid", "nodev"} <= set(r["cache"]) and "noexec" not in r["cache"]


def test_jit_caches_point_at_the_exec_mount(host, tmp_path):
    """Triton's, TorchInductor's and torch's extension caches default to the JIT cache;
    an instance's own setting wins."""
    spec = host.spec("pass", env={"PATH": "/usr/bin", "TRITON_CACHE_DIR": "/cache/mine"})
    env = build_plan(spec, ViewConfig(), tmp_path)["env"]
    assert env["TRITON_CACHE_DIR"] == "/cache/mine" and env["PATH"] == "/usr/bin"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == JIT_ENV["TORCHINDUCTOR_CACHE_DIR"]
    assert all(value.startswith(JIT_CACHE + "/") for value in JIT_ENV.values())


def test_jit_cache_settings_reach_the_instance(host):
    r = run(host, f"report(env={{k: os.environ.get(k) for k in {sorted(JIT_ENV)!r}}})")
    assert r["env"] == JIT_ENV


def test_a_memfd_cannot_be_executed(host):
    """Code written into a memfd runs neither through fexecve (execveat with AT_EMPTY_PATH:
    seccomp) nor through /proc/self/fd (vm.memfd_noexec = 2 in the sandbox's namespace);
    /bin/true still runs, and memfds without exec (torch's shared buffers) still work."""
    r = run(
        host,
        """
def exec_in_child(fn):
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except OSError as e:
            os._exit(e.errno)
        os._exit(255)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return "ok" if code == 0 else errno.errorcode.get(code, str(code))
fd = os.memfd_create("payload", 0)
os.write(fd, open("/bin/true", "rb").read())
report(scope=open("/proc/sys/vm/memfd_noexec").read().strip(),
       chmod=attempt(lambda: os.fchmod(fd, 0o755)),
       mfd_exec=attempt(lambda: os.memfd_create("exec", 0x10)),  # MFD_EXEC
       fexecve=exec_in_child(lambda: os.execve(fd, ["true"], {})),
       proc_fd=exec_in_child(lambda: os.execv(f"/proc/self/fd/{fd}", ["true"])),
       bin_true=exec_in_child(lambda: os.execv("/bin/true", ["true"])))
""",
    )
    assert r["scope"] == "2"
    assert r["fexecve"] == "EPERM"
    assert r["proc_fd"] == "EACCES"
    assert r["chmod"] != "ok" and r["mfd_exec"] != "ok"
    assert r["bin_true"] == "ok"
