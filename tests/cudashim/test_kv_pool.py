"""The shim's KV pool (omnicuda.c, omni/cudashim/kv_pool.py) under the fake driver: a
swap-out waits for the process to leave the pool, then releases its memory instead of
copying it; a swap-in maps zeroed memory at the same addresses and lets the process in."""

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


def test_a_swap_releases_the_pool_once_the_process_leaves_and_maps_it_back(fake, tmp_path):
    prog = Program(fake, tmp_path, quota=64 * MiB)
    try:
        pool, size = prog.pool, 12 * MiB  # 11 MiB, rounded up to the 2 MiB granularity
        assert prog.second == "0"  # one pool a process
        assert prog.block.stats()["used_bytes"] == 4 * MiB + size  # counted in the quota
        assert f"cuMemSetAccess {pool} {size}" in prog.calls()

        prog.send("enter")
        assert prog.line() == "entered 0"
        thread, result = background(swap_out, prog.block, 10)
        thread.join(0.5)
        assert thread.is_alive()  # waits for the process to leave
        assert not any(c.startswith("cuMemUnmap") for c in prog.calls())
        prog.send("leave")
        assert prog.line() == "left"
        thread.join(10)
        assert result[0].bytes == 4 * MiB  # the other allocation moved; the pool did not
        calls = prog.calls()
        unmapped = calls.index(f"cuMemUnmap {pool} {size}")
        assert calls.index("cuCtxSynchronize") < unmapped  # after the work it queued
        assert calls[unmapped + 1].startswith("cuMemRelease")
        assert f"prefetch {prog.other} {4 * MiB} host" in calls
        assert not any(c.startswith(f"prefetch {pool}") for c in calls)

        prog.send("enter")  # waits while the pool is away
        with pytest.raises(queue.Empty):
            prog.line(timeout=0.5)
        start = len(prog.calls())
        swap_in(prog.block, timeout_s=10)
        assert prog.line() == "entered 1"  # in, and told its contents were lost
        back = prog.calls()[start:]
        mapped = next(i for i, c in enumerate(back) if c.startswith(f"cuMemMap {pool} {size}"))
        assert back[mapped - 1].startswith(f"cuMemCreate {size}")
        assert f"cuMemsetD8 {pool} 0 {size}" in back[mapped:]  # zeroed
        prog.send("leave")
        assert prog.line() == "left"
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
