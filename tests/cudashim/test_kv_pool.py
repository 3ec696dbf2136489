"""The shim's KV pool (native/omnicuda/kv_pool.c, omni/cudashim/kv_pool.py) under the fake
driver: the whole pool is committed against the quota but backed by memory only where the
process maps it; a swap-out waits for the process to leave the pool, then releases that
memory instead of copying it; after a swap-in the pool is empty until the process maps
again."""

from __future__ import annotations

import queue
import threading

import pytest

from omni.cudashim import Mode, SwapError, swap_in, swap_out

MiB = 1 << 20

PROGRAM = """
import ctypes, sys
lib = ctypes.CDLL(None)
lib.omni_pool_alloc.argtypes, lib.omni_pool_alloc.restype = [ctypes.c_uint64], ctypes.c_uint64
lib.omni_pool_epoch.restype = ctypes.c_uint64
lib.omni_pool_map.argtypes, lib.omni_pool_map.restype = [ctypes.c_uint64] * 2, ctypes.c_int
rt = ctypes.CDLL("libcudart.so.13")
other = ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(other), ctypes.c_size_t(4 << 20)) == 0
pool = lib.omni_pool_alloc(11 << 20)
second = lib.omni_pool_alloc(1 << 20) if pool else 0  # one pool a process
print(hex(pool), hex(other.value or 0), second, flush=True)
for line in sys.stdin:
    if line.strip() == "enter":
        lib.omni_pool_enter()
        print("entered", lib.omni_pool_epoch(), flush=True)
    elif line.strip() == "leave":
        lib.omni_pool_leave()
        print("left", flush=True)
    elif line.startswith("map "):
        offset, length = (int(x) for x in line.split()[1:])
        print("mapped", lib.omni_pool_map(offset, length), flush=True)
    elif line.startswith("malloc "):
        p = ctypes.c_void_p()
        print("malloc", rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(int(line.split()[1]))),
              flush=True)
"""


class Program:
    """The program above under the shim, its output read by a thread."""

    def __init__(self, fake, tmp_path, quota: int, mode: Mode = Mode.MANAGED):
        self.proc, self.block, self.log = fake.spawn(tmp_path, PROGRAM, quota, mode)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pool, self.other, self.second = self.line().split()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float = 10) -> str:
        return self.lines.get(timeout=timeout)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()

    def close(self) -> None:
        self.proc.communicate("", timeout=10)
        assert self.proc.returncode == 0, self.proc.stderr


def called(calls: list[str], prefix: str) -> bool:
    return any(c.startswith(prefix) for c in calls)


def background(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(_call(fn, *args)), daemon=True)
    thread.start()
    return thread, out


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # handed to the test
        return exc


def test_the_pool_is_backed_where_mapped_and_released_at_a_swap_out(fake, tmp_path):
    prog = Program(fake, tmp_path, quota=64 * MiB)
    try:
        pool, base = prog.pool, int(prog.pool, 16)
        assert prog.second == "0"  # one pool a process
        stats = prog.block.stats()  # 11 MiB, rounded up to the 2 MiB granularity
        assert (stats["pool_bytes"], stats["pool_mapped_bytes"]) == (12 * MiB, 0)
        assert stats["used_bytes"] == 4 * MiB  # committed, not held
        assert not any(c.startswith("cuMemMap") for c in prog.calls())

        prog.send("enter")
        assert prog.line() == "entered 0"
        prog.send(f"map 0 {3 * MiB}")  # rounded out to whole granules
        assert prog.line() == "mapped 0"
        prog.send(f"map {2 * MiB} {4 * MiB}")  # the second granule is there already
        assert prog.line() == "mapped 0"
        calls = prog.calls()
        assert called(calls, f"cuMemMap {pool} {4 * MiB} ")
        assert called(calls, f"cuMemMap {hex(base + 4 * MiB)} {2 * MiB} ")
        assert f"cuMemsetD8 {pool} 0 {4 * MiB}" in calls  # zeroed
        assert f"cuMemSetAccess {hex(base + 4 * MiB)} {2 * MiB}" in calls
        stats = prog.block.stats()
        assert stats["pool_mapped_bytes"] == 6 * MiB
        assert stats["used_bytes"] == stats["window_peak_bytes"] == 10 * MiB

        thread, result = background(swap_out, prog.block, 10)
        thread.join(0.5)
        assert thread.is_alive()  # waits for the process to leave
        assert not any(c.startswith("cuMemUnmap") for c in prog.calls())
        prog.send("leave")
        assert prog.line() == "left"
        thread.join(10)
        assert result[0].bytes == 4 * MiB  # the other allocation moved; the pool did not
        calls = prog.calls()
        unmapped = [i for i, c in enumerate(calls) if c.startswith("cuMemUnmap")]
        assert {calls[i] for i in unmapped} == {
            f"cuMemUnmap {pool} {4 * MiB}",
            f"cuMemUnmap {hex(base + 4 * MiB)} {2 * MiB}",
        }
        assert calls.index("cuCtxSynchronize") < unmapped[0]  # after the work it queued
        assert all(calls[i + 1].startswith("cuMemRelease") for i in unmapped)
        assert f"prefetch {prog.other} {4 * MiB} host" in calls
        assert not any(c.startswith(f"prefetch {pool}") for c in calls)
        stats = prog.block.stats()
        assert (stats["used_bytes"], stats["pool_mapped_bytes"]) == (4 * MiB, 0)

        prog.send("enter")  # waits while the pool is away
        with pytest.raises(queue.Empty):
            prog.line(timeout=0.5)
        start = len(prog.calls())
        swap_in(prog.block, timeout_s=10)
        assert prog.line() == "entered 1"  # in, and told its contents were lost
        assert not any(c.startswith("cuMemMap") for c in prog.calls()[start:])  # empty
        assert prog.block.stats()["window_peak_bytes"] == 4 * MiB  # a new window
        prog.send(f"map {8 * MiB} {MiB}")
        assert prog.line() == "mapped 0"
        assert called(prog.calls()[start:], f"cuMemMap {hex(base + 8 * MiB)} {2 * MiB} ")
        assert prog.block.stats()["window_peak_bytes"] == 6 * MiB
        prog.send(f"map {10 * MiB} {4 * MiB}")  # past its end
        assert prog.line() != "mapped 0"
        prog.send("leave")
        assert prog.line() == "left"
    finally:
        prog.close()


def test_the_whole_pool_counts_against_the_quota_before_it_is_mapped(fake, tmp_path):
    prog = Program(fake, tmp_path, quota=20 * MiB)  # 4 MiB held, 12 MiB of pool committed
    try:
        assert prog.pool != "0x0"
        prog.send(f"malloc {6 * MiB}")
        assert prog.line() == "malloc 2"  # cudaErrorMemoryAllocation: 4 + 12 + 6 > 20
        prog.send(f"malloc {4 * MiB}")
        assert prog.line() == "malloc 0"
        prog.send("enter")
        assert prog.line() == "entered 0"
        prog.send(f"map 0 {12 * MiB}")  # mapping what was committed needs no more room
        assert prog.line() == "mapped 0"
        assert prog.block.stats()["used_bytes"] == 20 * MiB
    finally:
        prog.close()


def test_a_process_that_does_not_leave_fails_the_swap_and_keeps_its_pool(
    fake, tmp_path, monkeypatch
):
    monkeypatch.setenv("OMNI_POOL_WAIT_MS", "300")
    prog = Program(fake, tmp_path, quota=64 * MiB)
    try:
        prog.send("enter")
        assert prog.line() == "entered 0"
        with pytest.raises(SwapError, match="CUDA error 600"):
            swap_out(prog.block, timeout_s=10)
        assert not any(c.startswith("cuMemUnmap") for c in prog.calls())
        prog.send("enter")  # not away: a second enter goes straight in
        assert prog.line() == "entered 0"
    finally:
        prog.close()


@pytest.mark.parametrize(("quota", "mode"), [(8 * MiB, Mode.MANAGED), (64 * MiB, Mode.PASSTHROUGH)])
def test_no_pool_over_the_quota_or_outside_managed_mode(fake, tmp_path, quota, mode):
    prog = Program(fake, tmp_path, quota=quota, mode=mode)
    try:
        assert prog.pool == "0x0"
        assert prog.block.stats()["used_bytes"] == 4 * MiB
        assert not any(c.startswith("cuMemMap") for c in prog.calls())
    finally:
        prog.close()
