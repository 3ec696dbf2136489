"""omnid's side of a sandbox trusts nothing the instance wrote: hostile code plants links
and fills its directories inside a real sandbox, and omnid's own supervisor, GPU claim,
health check and KV handoff then run against what it left."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni.cudashim.control import ControlStruct
from omni.isolation import hostfs
from omni.isolation.sandbox import Limits
from omni.runtime import disaggregated
from omni.runtime.catalog import ModelEntry, Placement
from omni.runtime.instance import Backoff, GpuPlacement, Instance
from omni.runtime.residency import GpuPool

from .conftest import UID

BLOCK_SIZE = ctypes.sizeof(ControlStruct)  # the sealed control block's size, unchanged

IO_BYTES = 2 << 20
TMP_BYTES = 4 << 20
HANDOFF = "kv-" + "ab" * 16

# Runs at every start of the instance: says what it finds, plants a link under every name
# omnid uses, fills its writable directories, stays a moment (omnid's health checks run
# against the links) and crashes, so that omnid restarts it over what it left.
HOSTILE = """
import errno, json, os, sys, time
d = os.path.dirname(json.loads(os.environ["OMNI_INSTANCE_SETTINGS"])["yield_path"])
io = os.path.join(d, "io")
ctl = os.environ["OMNI_CUDA_CONTROL"]
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
def fill(path):
    written = 0
    try:
        with open(path, "wb") as f:
            while True:
                f.write(b"x" * 65536)
                f.flush()
                written += 65536
    except OSError as e:
        return written, errno.errorcode[e.errno]
found = {"dir": sorted(os.listdir(d)), "io": sorted(os.listdir(io))}
planted = {}
for name in ("cuda.ctl.tmp", "cuda.1.ctl", "gpu.yield.tmp", "sock"):
    planted[name] = attempt(lambda: os.symlink(TARGET, os.path.join(d, name)))
for name in ("gpu.yield", "io"):
    planted[name] = attempt(lambda: os.unlink(os.path.join(d, name)))
def scribble():  # its half and omnid's, with values no shim writes
    with open(ctl, "r+b") as f:
        f.write(b"\\xff" * BLOCK_SIZE)
control = {"truncate": attempt(lambda: os.truncate(ctl, 0)), "write": attempt(scribble),
           "size": os.stat(ctl).st_size}
for name in ("sock", "cuda.ctl", "cuda.ctl.tmp", "gpu.yield", "gpu.yield.tmp", HANDOFF):
    target = DECOY if name == "sock" else TARGET
    planted["io/" + name] = attempt(lambda: os.symlink(target, os.path.join(io, name)))
io_fill = fill(os.path.join(io, "fill"))
tmp_fill = fill("/tmp/fill")
report = dict(found=found, planted=planted, control=control, io_fill=io_fill, tmp_fill=tmp_fill)
print(json.dumps(report), flush=True)
time.sleep(1.5)
sys.exit(1)
"""


class Decoy:
    """A root-owned socket on the host that no connection from omnid may reach."""

    def __init__(self, path: Path):
        self.path, self.accepted = path, 0
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.bind(str(path))
        self._sock.listen()
        self._sock.settimeout(0.2)
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self._sock.close()


def snapshot(path: Path) -> tuple:
    st = os.lstat(path)
    return path.read_bytes(), st.st_uid, st.st_gid, st.st_mode


def omni_mounts(root: Path) -> list[Path]:
    return hostfs.mount_points_under(root)


@pytest.fixture
def target(host) -> Path:
    path = host.root / f"precious-{time.monotonic_ns()}"
    path.write_text("root's file")
    path.chmod(0o644)
    return path


def test_planted_links_and_full_directories_across_a_restart(host, target, tmp_path):
    decoy = Decoy(host.root / f"decoy-{os.getpid()}.sock")
    log = host.root / "hostile.log"
    program = f"TARGET = {str(target)!r}\nDECOY = {str(decoy.path)!r}\nHANDOFF = {HANDOFF!r}\n"
    program += f"BLOCK_SIZE = {BLOCK_SIZE}\n"
    program += HOSTILE
    libm = Path(os.path.realpath("/usr/lib/x86_64-linux-gnu/libm.so.6"))
    if not libm.exists():
        pytest.skip("no libm to stand in for the shim library")
    entry = ModelEntry(
        "hostile",
        host.own_model,
        "generate",
        "admin",
        Limits(memory_bytes=256 << 20, pids=64, tmp_bytes=TMP_BYTES, io_bytes=IO_BYTES),
    )
    pool = GpuPool(0, 1 << 30, swap_timeout_s=1, yield_max_s=0.01)
    # The shim is CUDA's (not here): a harmless library stands in for it, and the control
    # blocks and yield flag omnid makes for a GPU instance are made all the same.
    gpu = GpuPlacement((pool,), libm, UID)

    def factory(spec):
        spec = replace(spec, argv=[sys.executable, "-c", program], log_path=log)
        return host.sandbox(spec)

    runtime = host.runtime / "instances"

    async def go() -> dict:
        inst = Instance(entry, runtime, factory, Backoff(initial_s=0.1, max_s=0.2), gpu=gpu)
        pool.add(inst.member)
        inst.start()
        deadline = time.monotonic() + 60
        while inst.restarts < 2:
            assert time.monotonic() < deadline, f"no restarts: {inst.to_json()}"
            await asyncio.sleep(0.05)
        inside = {"dir": sorted(os.listdir(inst.dir)), "owner": os.lstat(inst.dir).st_uid}
        inside["stats"] = inst.to_json()  # its scribbled block, read as untrusted
        await inst.stop()
        return inside

    try:
        inside = asyncio.run(go())
    finally:
        decoy.close()
    runs = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert len(runs) >= 2, log.read_text()
    for run in runs:  # every start: omnid's files only, an empty io
        assert run["found"] == {"dir": ["gpu.yield", "io"], "io": []}, run
        # its control block: a sealed memfd its sandbox's init holds, writable, not resizable
        assert run["control"] == {"truncate": "EPERM", "write": "ok", "size": BLOCK_SIZE}, run
        for name in ("cuda.ctl.tmp", "cuda.1.ctl", "gpu.yield.tmp", "sock"):
            assert run["planted"][name] == "EACCES", run  # omnid's directory, not its own
        assert run["planted"]["gpu.yield"] == "EACCES", run
        assert run["planted"]["io"] in ("EACCES", "EBUSY"), run  # and a mount point
        for name in ("sock", "cuda.ctl", HANDOFF):
            assert run["planted"]["io/" + name] == "ok", run  # its own directory
        written, err = run["io_fill"]
        assert err == "ENOSPC" and written <= IO_BYTES, run
        written, err = run["tmp_fill"]
        assert err == "ENOSPC" and written <= TMP_BYTES, run
    assert inside["owner"] == 0
    assert inside["stats"]["name"] == "hostile"
    assert snapshot(target) == (b"root's file", 0, 0, 0o100644)
    assert decoy.accepted == 0  # the health checks never followed the planted `sock`
    assert not (runtime / "hostile").exists()  # nothing of it stays on the host
    assert omni_mounts(runtime) == []


def test_handoff_refuses_a_planted_link_on_either_side(tmp_path, target):
    """The disaggregated handoff copies a regular file of the prefill instance's own into
    a new file of the decode instance's; a link on either side changes nothing."""
    prefill_io, decode_io = tmp_path / "p" / "io", tmp_path / "d" / "io"
    for d in (prefill_io, decode_io):
        d.mkdir(parents=True)
    node = SimpleNamespace(isolated=False)
    prefill = SimpleNamespace(name="p", socket_path=prefill_io / "sock")
    decode = SimpleNamespace(name="d", socket_path=decode_io / "sock")
    before = snapshot(target)

    os.symlink(target, prefill_io / HANDOFF)  # the prefill side hands over a link
    with pytest.raises(Exception, match="failed"):
        asyncio.run(disaggregated._hand_over(node, prefill, decode, HANDOFF))
    assert not (decode_io / HANDOFF).exists()

    (prefill_io / HANDOFF).unlink()
    (prefill_io / HANDOFF).write_bytes(b"kv" * 1000)
    os.symlink(target, decode_io / HANDOFF)  # the decode side waits with a link
    with pytest.raises(Exception, match="failed"):
        asyncio.run(disaggregated._hand_over(node, prefill, decode, HANDOFF))
    assert snapshot(target) == before

    (decode_io / HANDOFF).unlink()
    asyncio.run(disaggregated._hand_over(node, prefill, decode, HANDOFF))
    assert (decode_io / HANDOFF).read_bytes() == b"kv" * 1000
    assert os.stat(decode_io / HANDOFF).st_mode & 0o777 == 0o600


def test_health_check_talks_only_to_the_instances_own_listener(host, tmp_path):
    """SO_PEERCRED: a socket at the instance's path whose listener is not the instance's
    process (here the test's own, as root) is refused, not spoken to."""
    entry = ModelEntry("peer", host.own_model, "generate", "admin", Limits())
    socket_path = tmp_path / "instances" / "peer" / "io" / "sock"
    socket_path.parent.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(socket_path))
    listener.listen()

    async def probe() -> bool:
        inst = Instance(entry, tmp_path / "instances", host.sandbox)
        assert inst.socket_path == socket_path
        try:
            return await inst._probe()
        finally:
            await inst.session.close()

    try:
        assert asyncio.run(probe()) is False
        listener.settimeout(1)
        conn, _ = listener.accept()  # it connected, saw who listens, and left
        assert conn.recv(1024) == b""  # without a byte of its request
        conn.close()
    finally:
        listener.close()


# Serves its health checks, then writes past its disk KV budget.
DISK_HOG = """
import asyncio, json, os, sys
from aiohttp import web
sock, disk = sys.argv[1], sys.argv[2]
async def main():
    print(json.dumps({"found": sorted(os.listdir(disk))}), flush=True)
    app = web.Application()
    app.router.add_get("/health", lambda _r: web.json_response({}))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, sock).start()
    await asyncio.sleep(0.5)
    with open(os.path.join(disk, "blocks"), "wb") as f:
        f.write(b"x" * (24 << 20))
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_a_disk_kv_tier_past_its_budget_is_restarted_empty(host):
    log = host.root / "disk-hog.log"
    entry = ModelEntry(
        "diskhog",
        host.own_model,
        "generate",
        "admin",
        Limits(memory_bytes=512 << 20, pids=64),
        Placement(kv_disk_bytes=1 << 20),
    )
    disk = host.state_dir / "kv-disk" / "diskhog"

    def factory(spec):
        argv = [sys.executable, "-c", DISK_HOG, str(spec.socket_dir / "sock"), str(disk)]
        return host.sandbox(replace(spec, argv=argv, log_path=log))

    async def go() -> dict:
        inst = Instance(
            entry, host.runtime / "instances", factory, Backoff(0.1, 0.2), kv_disk_dir=disk
        )
        inst.HEALTH_INTERVAL_S = 0.2
        inst.start()
        deadline = time.monotonic() + 90
        while inst.restarts < 1:
            assert time.monotonic() < deadline, f"not restarted: {inst.to_json()}"
            await asyncio.sleep(0.05)
        while log.read_text().count('"found"') < 2:
            assert time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.05)
        state = inst.to_json()
        await inst.stop()
        return state

    state = asyncio.run(go())
    assert state["last_exit"].startswith("kv-disk-over-limit"), state
    runs = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert [r["found"] for r in runs[:2]] == [[], []]  # empty at every start
    assert not disk.exists()  # and gone at stop
