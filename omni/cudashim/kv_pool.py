"""The shim's KV pool: GPU memory a swap-out releases instead of copying (kv_pool.c).

An engine's KV cache is most of an instance's quota, and an idle instance keeps nothing
in it but the prefixes it cached; copying it to the host was most of a swap-out (~1.4 of
2.5 GiB in the overcommit bench). Under the shim in managed mode the engine takes its
cache from this pool instead. The whole pool counts against the quota, but memory backs
only what the engine maps (`map`, as its blocks are taken), so the instance holds, and
omnid charges it, the cache its requests use. A swap-out releases that memory once the
engine has gone idle (`leave`), nothing copied; `epoch` tells the engine its cached
prefixes, and the mappings, are gone. Anywhere else (no shim, passthrough, the CPU)
`open` gives None and the cache is an ordinary tensor.
"""

from __future__ import annotations

import ctypes

import torch


class _DeviceBytes:
    """`nbytes` of device memory at `ptr`, as torch takes it (the CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


class KVPool:
    def __init__(self, lib: ctypes.CDLL):
        self._alloc = lib.omni_pool_alloc
        self._alloc.argtypes, self._alloc.restype = [ctypes.c_uint64], ctypes.c_uint64
        self._enter, self._leave = lib.omni_pool_enter, lib.omni_pool_leave
        self._enter.argtypes = self._leave.argtypes = []
        self._enter.restype = self._leave.restype = None
        self._epoch = lib.omni_pool_epoch
        self._epoch.argtypes, self._epoch.restype = [], ctypes.c_uint64
        self._map = lib.omni_pool_map
        self._map.argtypes, self._map.restype = [ctypes.c_uint64] * 2, ctypes.c_int

    @classmethod
    def open(cls, device: torch.device) -> KVPool | None:
        """The pool, where this process runs on a GPU under the shim; None elsewhere."""
        if device.type != "cuda":
            return None
        lib = ctypes.CDLL(None)
        if not hasattr(lib, "omni_pool_alloc"):
            return None
        return cls(lib)

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        """`nbytes` of pool as a uint8 tensor, none of it backed yet (`map` before use), or
        None where the shim has no pool to give (passthrough mode, a pool made already,
        the quota): allocate as usual."""
        with torch.cuda.device(device):
            torch.cuda.current_stream().synchronize()  # a context current on this thread
            ptr = self._alloc(nbytes)
        if not ptr:
            return None
        return torch.as_tensor(_DeviceBytes(ptr, nbytes), device=device)

    def map(self, offset: int, nbytes: int, device: torch.device) -> None:
        """Back bytes [offset, offset + nbytes) of the pool with zeroed memory (those
        backed already stay as they are). Only inside (`enter`)."""
        with torch.cuda.device(device):
            rc = self._map(offset, nbytes)
        if rc:
            message = f"the KV pool could not map {nbytes} bytes: CUDA error {rc}"
            raise torch.OutOfMemoryError(message)

    def enter(self) -> None:
        """Before work that may touch the pool: waits while it is swapped out."""
        self._enter()

    def leave(self) -> None:
        """Idle: a swap-out may release the pool once the work queued so far is done."""
        self._leave()

    def epoch(self) -> int:
        """Swap-outs so far that lost the pool's contents."""
        return self._epoch()
