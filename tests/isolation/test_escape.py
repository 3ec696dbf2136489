"""Escape attempts: each runs inside a real sandbox and must fail for the right reason."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil

from omni.isolation.sandbox import Limits
from omni.runtime.catalog import ModelEntry
from omni.runtime.instance import Backoff, Instance

from .conftest import UID, setuid_copy

# Each attempt program reports `{"what": "ok" | errno name}` as its last line.
PRELUDE = """
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def attempt(fn):
    try:
        result = fn()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    if isinstance(result, int) and result == -1:  # a raw libc call
        return errno.errorcode[ctypes.get_errno()]
    return "ok"
def report(**kw):
    print(json.dumps(kw), flush=True)
"""


def run(host, body: str, **overrides):
    result = host.run(PRELUDE + body, **overrides)
    assert result.status.reason == "exited" and result.status.returncode == 0, result.output
    return result.report


def test_cannot_read_another_models_files(host):
    r = run(
        host,
        f"""
report(other=attempt(lambda: open({str(host.other_model / "secret.txt")!r}).read()),
       models=sorted(os.listdir({str(host.own_model.parent)!r})),
       own=open({str(host.own_model / "weights.bin")!r}).read())
""",
    )
    assert r == {"other": "ENOENT", "models": ["mine"], "own": "mine"}


def test_model_under_a_visible_path_is_covered(host):
    r = run(
        host,
        f"""
report(listing=os.listdir({str(host.hidden_model)!r}),
       secret=attempt(lambda: open({str(host.hidden_model / "secret.txt")!r}).read()),
       public=open({str(host.shared / "public.txt")!r}).read())
""",
    )
    assert r == {"listing": [], "secret": "ENOENT", "public": "visible"}


def test_cannot_reach_omnid_state_or_admin_socket(host):
    r = run(
        host,
        f"""
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect({str(host.admin_socket)!r})
report(state=attempt(lambda: os.listdir({str(host.state_dir)!r})),
       admin=attempt(connect),
       runtime=sorted(os.listdir({str(host.runtime)!r})))
""",
    )
    assert r == {"state": "ENOENT", "admin": "ENOENT", "runtime": ["instances"]}
    with socket.socket(socket.AF_UNIX) as s:  # control: the socket is live on the host
        s.connect(str(host.admin_socket))


def test_cannot_write_system_files_or_model(host):
    r = run(
        host,
        f"""
report(usr=attempt(lambda: open("/usr/evil", "w")),
       etc=attempt(lambda: open("/etc/passwd", "a")),
       root=attempt(lambda: open("/evil", "w")),
       model=attempt(lambda: open({str(host.own_model / "evil")!r}, "w")),
       weights=attempt(lambda: open({str(host.own_model / "weights.bin")!r}, "r+b")),
       world_writable=attempt(lambda: open({str(host.own_model / "cache.bin")!r}, "r+b")),
       tmp=attempt(lambda: open("/tmp/scratch", "w").write("x")))
""",
    )
    assert r == {
        "usr": "EROFS",
        "etc": "EACCES",  # root's file, and a read-only mount
        "root": "EROFS",
        "model": "EROFS",
        "weights": "EACCES",
        "world_writable": "EROFS",  # mode 0666 on the host, still read-only here
        "tmp": "ok",
    }
    assert not (host.own_model / "evil").exists()


def test_network_is_loopback_only(host):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        r = run(
            host,
            f"""
def tcp(addr):
    s = socket.socket()
    s.settimeout(3)
    s.connect(addr)
def own_loopback():
    srv = socket.create_server(("127.0.0.1", 0))
    socket.create_connection(srv.getsockname(), timeout=3)
report(host_port=attempt(lambda: tcp(("127.0.0.1", {port}))),
       outside=attempt(lambda: tcp(("192.0.2.1", 80))),
       interfaces=[name for _, name in socket.if_nameindex()],
       own_loopback=attempt(own_loopback))
""",
        )
    finally:
        listener.close()
    assert r == {
        "host_port": "ECONNREFUSED",
        "outside": "ENETUNREACH",
        "interfaces": ["lo"],
        "own_loopback": "ok",
    }


def test_cannot_see_or_signal_host_processes(host):
    me = os.getpid()
    r = run(
        host,
        f"""
report(pids=sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
       signal_host=attempt(lambda: os.kill({me}, 0)))
""",
    )
    assert r["pids"] == [1, 2]  # the sandbox's init and the attempt itself
    assert r["signal_host"] == "ESRCH"
    assert psutil.pid_exists(me)


def test_cannot_mount_chroot_or_unshare(host):
    r = run(
        host,
        """
report(mount=attempt(lambda: libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None)),
       chroot=attempt(lambda: os.chroot("/tmp")),
       unshare_user=attempt(lambda: libc.unshare(0x10000000)),
       unshare_mount=attempt(lambda: libc.unshare(0x00020000)),
       setns=attempt(lambda: libc.setns(os.open("/proc/1/ns/mnt", os.O_RDONLY), 0)))
""",
    )
    assert r["mount"] == "EPERM"
    assert r["chroot"] == "EPERM"
    assert r["unshare_user"] == "EPERM"  # refused by the seccomp filter
    assert r["unshare_mount"] == "EPERM"
    assert r["setns"] in ("EPERM", "EACCES")  # init's namespace handle is root's


def test_setuid_binary_does_not_raise_privileges(host):
    setuid_id = setuid_copy("/usr/bin/id", host.own_model / "id-setuid")
    try:
        r = run(
            host,
            f"""
import subprocess
status = {{k: v.split() for k, v in
          (l.split(":", 1) for l in open("/proc/self/status") if ":" in l)}}
report(id=subprocess.run([{str(setuid_id)!r}, "-u"], capture_output=True, text=True).stdout,
       uid=os.getuid(), euid=os.geteuid(), gid=os.getgid(),
       cap_eff=status["CapEff"][0], cap_bnd=status["CapBnd"][0],
       no_new_privs=status["NoNewPrivs"][0])
""",
        )
    finally:
        setuid_id.unlink()
    assert r["id"].strip() == str(UID)  # the setuid-root bit had no effect
    assert (r["uid"], r["euid"], r["gid"]) == (UID, UID, UID)
    assert int(r["cap_eff"], 16) == 0 and int(r["cap_bnd"], 16) == 0
    assert r["no_new_privs"] == "1"


def test_fork_bomb_is_contained_by_the_pids_limit(host):
    r = run(
        host,
        """
import time
children = 0
while True:
    try:
        pid = os.fork()
    except OSError as e:
        failure = errno.errorcode[e.errno]
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children += 1
report(children=children, failure=failure)
""",
        limits=Limits(memory_bytes=512 << 20, pids=32),
    )
    assert r["failure"] == "EAGAIN"
    assert 10 < r["children"] < 32  # the limit counts init and the attempt too
    # the machine is unaffected and the sandbox's children are all gone
    assert subprocess.run(["true"]).returncode == 0
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and "children = 0" in " ".join(p.info["cmdline"])
    ]


def test_memory_past_the_limit_is_oom_killed(host):
    result = host.run(
        """
chunks = []
while True:
    chunks.append(bytearray(16 << 20))  # zero-filled: every page is touched
""",
        limits=Limits(memory_bytes=128 << 20, pids=64),
    )
    assert result.status.reason == "oom", result
    assert result.status.returncode == -9


def test_no_double_forked_child_survives_stop(host):
    marker = f"{time.time_ns() % 10**6}.{os.getpid()}"
    spec = host.spec(
        PRELUDE
        + f"""
import subprocess, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{marker}"])
    os._exit(0)
while True:
    time.sleep(1)
"""
    )

    def leftovers():
        return [
            p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]
        ]

    async def go():
        box = host.sandbox(spec)
        await box.start()
        deadline = time.monotonic() + 30
        while not leftovers():
            assert time.monotonic() < deadline, "the double-forked child never started"
            await asyncio.sleep(0.05)
        return await box.stop(grace_s=1)

    status = asyncio.run(go())
    assert status.reason in ("killed", "exited")
    assert leftovers() == []


def test_private_hostname_tmp_and_visible_limits(host):
    marker = Path("/root/.omni-escape-marker")
    marker.write_text("host secret")
    host_tmp_marker = Path(f"/tmp/omni-escape-marker-{os.getpid()}")
    host_tmp_marker.write_text("host tmp")
    try:
        r = run(
            host,
            f"""
def fill_tmp():
    with open("/tmp/big", "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20))
meminfo = dict(l.split(":", 1) for l in open("/proc/meminfo"))
report(hostname=socket.gethostname(), cpus=os.cpu_count(),
       mem_total_kb=int(meminfo["MemTotal"].split()[0]),
       host_tmp=attempt(lambda: open({str(host_tmp_marker)!r}).read()),
       fill_tmp=attempt(fill_tmp),
       dev=sorted(os.listdir("/dev")), home=attempt(lambda: os.listdir("/home")),
       root_marker=attempt(lambda: open("/root/.omni-escape-marker").read()))
""",
            limits=Limits(memory_bytes=768 << 20, cpu_cores=2, pids=64, tmp_bytes=8 << 20),
        )
    finally:
        marker.unlink()
        host_tmp_marker.unlink()
    assert r["hostname"].startswith("esc")
    assert r["cpus"] == 2
    assert r["mem_total_kb"] == (768 << 20) // 1024
    assert r["host_tmp"] == "ENOENT"  # a private /tmp, not the host's
    assert r["fill_tmp"] == "ENOSPC"  # /tmp is a size-limited tmpfs
    assert r["dev"] == [
        "fd",
        "full",
        "null",
        "random",
        "shm",
        "stderr",
        "stdin",
        "stdout",
        "urandom",
        "zero",
    ]
    assert r["home"] == "ENOENT"
    assert r["root_marker"] == "ENOENT"


def test_oom_is_reported_and_the_instance_restarted(host):
    """Through omnid's supervisor: the OOM kill is the exit reason, then a restart."""
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    entry = ModelEntry(
        "hog", host.own_model, "generate", "admin", Limits(memory_bytes=96 << 20, pids=64)
    )

    def factory(spec):
        return host.sandbox(
            replace(spec, argv=[sys.executable, "-c", hog], log_path=host.root / "hog.log")
        )

    async def go():
        inst = Instance(
            entry, host.runtime / "instances", factory, Backoff(initial_s=0.1, max_s=0.2)
        )
        inst.start()
        deadline = time.monotonic() + 60
        while inst.restarts < 2:
            assert time.monotonic() < deadline, f"no restarts: {inst.to_json()}"
            await asyncio.sleep(0.05)
        await inst.stop()
        return inst.to_json()

    state = asyncio.run(go())
    assert state["last_exit"] == "oom (SIGKILL)"
    assert state["restarts"] >= 2
    assert state["state"] == "stopped"
