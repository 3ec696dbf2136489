"""Escape routes an outside review found, each tried from inside a real sandbox.

One test (or two) per finding: socket families past the network namespace, io_uring
and the seccomp allow-list, writable sub-mounts, host and neighbour metadata, a view
built from omnid's sys.path, and failed setups that surfaced as a bare BrokenPipeError.
"""

from __future__ import annotations

import asyncio
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
from omni.isolation.sandbox import Limits
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
    assert {"io_uring_setup", "io_uring_enter", "io_uring_register"} <= set(refused)
    assert not {"clone", "clone3", "socket", "socketpair", "personality"} & set(allowed)
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
    assert r["loadavg"] == r["timer_list"] == ""
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


def start_and_fail(host, **overrides) -> SandboxError:
    spec = host.spec("print('never')", **overrides)

    async def go() -> SandboxError:
        box = host.sandbox(spec)
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
