"""The control block shared with an instance's shim: ctypes mirror of omnicuda.h."""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

from omni.isolation import hostfs

MAGIC = 0x494E4D4F  # "OMNI"
VERSION = 2


class Mode(enum.IntEnum):
    PASSTHROUGH = 0  # real device memory, accounting and quota only
    MANAGED = 1  # unified memory, so it can be swapped to host


class ShimResidency(enum.IntEnum):
    GPU = 0
    HOST = 1
    MOVING = 2


class ControlStruct(ctypes.Structure):
    """Field for field `struct omni_control`; a layout test compares the two."""

    _fields_ = (
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("quota_bytes", ctypes.c_uint64),
        ("mode", ctypes.c_uint32),
        ("desired_residency", ctypes.c_uint32),
        ("request_seq", ctypes.c_uint64),
        ("used_bytes", ctypes.c_uint64),
        ("peak_bytes", ctypes.c_uint64),
        ("live_allocs", ctypes.c_uint64),
        ("last_activity_ns", ctypes.c_uint64),
        ("residency", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("ack_seq", ctypes.c_uint64),
        ("last_swap_ns", ctypes.c_uint64),
        ("swapped_bytes", ctypes.c_uint64),
        ("last_swap_error", ctypes.c_int32),
        ("reserved0", ctypes.c_uint32),
        ("alloc_failures", ctypes.c_uint64),
        ("window_peak_bytes", ctypes.c_uint64),
        ("pool_bytes", ctypes.c_uint64),
        ("pool_mapped_bytes", ctypes.c_uint64),
    )


@dataclass(frozen=True)
class SwapResult:
    residency: ShimResidency
    seconds: float  # measured by the shim, from first prefetch to synchronized
    bytes: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


class SwapError(RuntimeError):
    pass


def _name(kind: type[enum.IntEnum], value: int) -> str:
    """A field's name; the instance writes its half of the block, so any number may be there."""
    return kind(value).name.lower() if value in kind._value2member_map_ else f"unknown ({value})"


class ControlBlock:
    """omnid's handle on one instance's shim."""

    def __init__(self, path: Path, fd: int | None = None):
        """The block at `path`, or the one `fd` holds (a sealed memfd, kept open to be
        handed to the instance's sandbox; `path` then only names it)."""
        self.path = Path(path)
        self.fd = fd
        own = fd if fd is not None else os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._map = mmap.mmap(own, ctypes.sizeof(ControlStruct))
        finally:
            if fd is None:
                os.close(own)
        self._ctl = ControlStruct.from_buffer(self._map)
        if self._ctl.magic != MAGIC or self._ctl.version != VERSION:
            raise ValueError(f"{path}: not a version {VERSION} control block")

    @classmethod
    def create(cls, path: Path, quota_bytes: int, mode: Mode, owner: int | None = None):
        """A fresh block; `owner` (the sandbox uid) may write its half of it."""
        ctl = ControlStruct(magic=MAGIC, version=VERSION, quota_bytes=quota_bytes, mode=mode)
        path = Path(path)
        hostfs.create_file(path, bytes(ctl), 0o600, owner)  # in omnid's directory, never a link
        return cls(path)

    @classmethod
    def create_sealed(cls, name: str, quota_bytes: int, mode: Mode, owner: int):
        """A fresh block in a sealed memfd (`fd`) that `owner` may write, never resize: for a
        sandboxed instance, which must not be able to make omnid's reads fault."""
        ctl = ControlStruct(magic=MAGIC, version=VERSION, quota_bytes=quota_bytes, mode=mode)
        fd = hostfs.sealed_memfd(name, bytes(ctl), 0o600, owner)
        return cls(Path(f"/proc/self/fd/{fd}"), fd)

    def stats(self) -> dict:
        c = self._ctl
        return {
            "quota_bytes": c.quota_bytes,
            "mode": _name(Mode, c.mode),
            "used_bytes": c.used_bytes,
            "peak_bytes": c.peak_bytes,
            "live_allocs": c.live_allocs,
            "last_activity_ns": c.last_activity_ns,
            "residency": _name(ShimResidency, c.residency),
            "alloc_failures": c.alloc_failures,
            "window_peak_bytes": c.window_peak_bytes,
            "pool_bytes": c.pool_bytes,
            "pool_mapped_bytes": c.pool_mapped_bytes,
            "pid": c.pid,
        }

    @property
    def residency(self) -> ShimResidency:
        """Where the shim says the memory is; a value no shim writes reads as moving."""
        value = self._ctl.residency
        return (
            ShimResidency(value)
            if value in ShimResidency._value2member_map_
            else ShimResidency.MOVING
        )

    @property
    def peak_bytes(self) -> int:
        """The most the instance has held at once, as its shim reports it."""
        return self._ctl.peak_bytes

    @property
    def window_peak_bytes(self) -> int:
        """The most it has held at once since its last swap-in (or its start): what it
        holds on the GPU now, at most. A swap-out releases its KV pool's memory, and the
        pool grows again with use."""
        return self._ctl.window_peak_bytes

    @property
    def used_bytes(self) -> int:
        return self._ctl.used_bytes

    def set_quota(self, quota_bytes: int) -> None:
        self._ctl.quota_bytes = quota_bytes

    def move(self, target: ShimResidency, timeout_s: float) -> SwapResult:
        """Ask the shim to move every allocation to `target`; wait for its ack."""
        if target not in (ShimResidency.GPU, ShimResidency.HOST):
            raise ValueError(f"cannot move to {target!r}")
        self._ctl.desired_residency = target
        seq = self._ctl.request_seq + 1
        self._ctl.request_seq = seq  # written last: the shim acts on the new sequence
        deadline = time.monotonic() + timeout_s
        while self._ctl.ack_seq < seq:
            if time.monotonic() > deadline:
                raise SwapError(f"shim did not finish moving to {target.name} in {timeout_s}s")
            time.sleep(0.0005)
        if self._ctl.last_swap_error:
            raise SwapError(
                f"moving to {target.name} failed: CUDA error {self._ctl.last_swap_error}"
            )
        return SwapResult(target, self._ctl.last_swap_ns / 1e9, self._ctl.swapped_bytes)

    def close(self) -> None:
        del self._ctl
        self._map.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
