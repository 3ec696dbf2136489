"""Colder instances yield their GPU to the hot ones while those serve.

Instances of one GPU are separate processes, and the GPU time-slices between
processes whose work overlaps: a hot model's decode step waits whenever a cold
model's step holds the GPU, so its tail latency grows with every model on the
card even when nothing is swapped. While an instance of the GPU's hot set
serves, omnid raises the yield flag of every colder instance; their engines
hold back each step until the flag drops, for at most the flag's `max_defer`,
which omnid sets so that the yielding instances together take about one step
per `gpu_yield` window: a cold model still advances under sustained hot load.

One small shared file per instance carries the flag: omnid writes it, the
instance's engine reads it before each step (its path is in the instance's settings,
`yield_path`). It is cooperative scheduling between OMNI's own engines, not an
isolation boundary.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

from omni.isolation import hostfs

MAGIC = 0x4F4D5949  # "OMYI"
LAYOUT = struct.Struct("<III")  # magic, flag, max_defer_us
POLL_S = 0.0002


def _map(path: Path, writable: bool) -> mmap.mmap:
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    try:
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(fd, LAYOUT.size, access=access)
    finally:
        os.close(fd)


class YieldFlag:
    """omnid's side: raise or drop one instance's flag."""

    def __init__(self, path: Path, max_defer_s: float, owner: int | None = None, new: bool = True):
        """`new`: create the file (in omnid's directory for the instance); else map the
        one an adopted instance already reads."""
        self.path = Path(path)
        if new:
            data = LAYOUT.pack(MAGIC, 0, round(max_defer_s * 1e6))
            hostfs.create_file(self.path, data, 0o644, owner)  # omnid's: the instance reads it
        self._map = _map(self.path, writable=True)
        self.raised = struct.unpack_from("<I", self._map, 4)[0] != 0

    def set(self, raised: bool, max_defer_s: float | None = None) -> None:
        if max_defer_s is not None:  # first: a step that sees the flag sees its bound
            struct.pack_into("<I", self._map, 8, round(max_defer_s * 1e6))
        if raised != self.raised:
            struct.pack_into("<I", self._map, 4, int(raised))
            self.raised = raised

    def close(self) -> None:
        self._map.close()


class YieldGate:
    """The instance's side: called before each engine step."""

    def __init__(self, path: Path):
        self._map = _map(Path(path), writable=False)
        magic, _, _ = LAYOUT.unpack_from(self._map)
        if magic != MAGIC:
            raise ValueError(f"{path}: not a GPU yield flag")
        self.waited_s = 0.0  # in total, for the instance's health stats
        self.deferred_steps = 0

    def raised(self) -> bool:
        return struct.unpack_from("<I", self._map, 4)[0] != 0

    def __call__(self) -> None:
        """Hold the next step while a hotter instance serves, at most max_defer."""
        if not self.raised():
            return
        t0 = time.monotonic()
        deadline = t0 + struct.unpack_from("<I", self._map, 8)[0] / 1e6
        while self.raised() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.waited_s += time.monotonic() - t0
        self.deferred_steps += 1

    def stats(self) -> dict:
        return {"yield_wait_s": round(self.waited_s, 4), "yield_steps": self.deferred_steps}
