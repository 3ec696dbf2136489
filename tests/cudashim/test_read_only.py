"""Weights declared read-only to libomnicuda (omni/cudashim/read_only.py): only their
whole pages are declared, and a swap keeps their host copy (the fake driver's log)."""

from __future__ import annotations

import re

from omni.cudashim import Mode, swap_in, swap_out
from omni.cudashim.read_only import PAGE, page_ranges

MiB = 1 << 20


class Fake:
    """A stand-in with a tensor's three methods, at an address of our choosing."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes, self.is_cuda = ptr, nbytes, True

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1


def test_only_whole_pages_inside_the_tensors_are_declared():
    base = 64 * PAGE
    tensors = [
        Fake(base + 100, 3 * PAGE),  # pages 1-2 of it whole
        Fake(base + 3 * PAGE + 100, PAGE),  # joins the first: page 3 whole too
        Fake(base + 10 * PAGE + 5, PAGE),  # no whole page
        Fake(base + 20 * PAGE, 2 * PAGE),  # exactly two
        Fake(base + 20 * PAGE, 2 * PAGE),  # the same tensor twice (tied weights)
    ]
    assert page_ranges(tensors) == [
        (base + PAGE, 3 * PAGE),
        (base + 20 * PAGE, 2 * PAGE),
    ]


DECLARE_AND_WAIT = """
import ctypes, sys
rt = ctypes.CDLL("libcudart.so.13")
p = ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t({size})) == 0
declare = ctypes.CDLL(None).omni_read_only
declare.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
assert declare(p.value, {size} // 2) == 0
print(hex(p.value), flush=True)
sys.stdin.readline()
"""


def test_a_swap_keeps_the_host_copy_of_what_was_declared(fake, tmp_path):
    size = 8 * MiB
    proc, block, log = fake.spawn(tmp_path, DECLARE_AND_WAIT.format(size=size), 0, Mode.MANAGED)
    try:
        ptr = proc.stdout.readline().strip()
        swap_out(block, timeout_s=10)
        swap_in(block, timeout_s=10)
        lines = log.read_text().splitlines()
        half = size // 2
        out = lines.index(f"advise {ptr} {half} 1 host")  # read-mostly before the copy out
        copied = lines.index(f"prefetch {ptr} {size} host")
        dropped = lines.index(f"advise {ptr} {half} 2 host")  # unmarked after: GPU copy gone
        back = lines.index(f"advise {ptr} {half} 1 device")  # marked again on the way in
        assert out < copied < dropped < back < lines.index(f"prefetch {ptr} {size} device")
        # nothing else is made read-mostly
        assert len(re.findall(r"^advise \S+ \d+ [12] ", log.read_text(), re.M)) == 3
    finally:
        proc.communicate("done\n", timeout=10)
    assert proc.returncode == 0, proc.stderr
