"""Tiers under the paged KV cache: evicted prefix blocks, kept in host memory, then on a
local disk, to come back.

The pool (block_manager.py) keeps full blocks nobody holds for reuse until a new block is
needed; then the least recently used one is evicted. With a tier, the evicted block's
K/V (every layer) is copied to host memory first, under the block's prefix-cache key
(principal, parent hash, tokens), and a later prompt whose hash chain reaches that key
takes a fresh block and copies the K/V back instead of recomputing it. The key is
compared whole on every hit, so a tenant never gets another tenant's blocks, here as in
the pool. The tier has its own budget; past it, its least recently stored blocks go: to
the disk tier below it if there is one (its own budget, one file a block), else nowhere.
The block manager talks to the host tier only; a hit there or below comes back the same.

Written here rather than taken from LMCache or Mooncake: both are built around another
engine's paged-cache layout and CUDA, and this tier must also serve the CPU path and the
engine's own block keys (principal-scoped hash chains).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

Payload = tuple[torch.Tensor, torch.Tensor]  # a block's K and V, [layers, block, heads, dim]
SUFFIX = ".kv"  # the disk tier's files: the only ones it deletes in its directory


@dataclass
class TierStats:
    stored_blocks: int = 0
    restored_blocks: int = 0
    dropped_blocks: int = 0  # gone past the budget (to the tier below, if any)
    bytes_out: int = 0  # into the tier
    bytes_in: int = 0  # tier to pool
    restore_seconds: float = 0.0  # handing blocks back (a disk read; not the device copy)

    def as_dict(self, tier: str = "host") -> dict[str, float]:
        return {f"kv_{tier}_{k}": v for k, v in vars(self).items()}


@dataclass
class DiskStats(TierStats):
    write_errors: int = 0  # blocks lost to a failed write (disk full, say)


def _size(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


class _File(NamedTuple):
    key: tuple
    path: Path
    size: int
    layout: list[tuple[torch.Size, torch.dtype]]  # K's and V's: the file is raw bytes


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):  # a file that will not go only wastes its space
        path.unlink(missing_ok=True)


def _remove_files(entries: OrderedDict[int, _File]) -> None:
    for entry in entries.values():
        _unlink(entry.path)
    entries.clear()


class DiskTier:
    """Blocks the host tier drops, one file each in `directory` (K's bytes, then V's);
    the index (keys, shapes, dtypes) is in memory only. Files of another process are
    useless (keys hash with Python's per-process salt), so the directory's *.kv files
    are deleted at start, and this tier's own on close() or at exit: the directory
    must be this tier's alone."""

    def __init__(self, directory: str | Path, budget_bytes: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(f"*{SUFFIX}"):
            _unlink(stale)
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.stats = DiskStats()
        self._entries: OrderedDict[int, _File] = OrderedDict()
        self._names = itertools.count()
        self._cleanup = weakref.finalize(self, _remove_files, self._entries)  # at exit too

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        """Delete this tier's files."""
        self._cleanup()
        self.bytes = 0

    def store(self, h: int, key: tuple, payload: Payload) -> None:
        """Write a block to disk under its key (the newest of a hash replaces); the oldest
        files go first to make room. A failed write loses the block, nothing more."""
        self.discard(h)
        size = _size(payload)
        if size > self.budget_bytes:
            self.stats.dropped_blocks += 1
            return
        while self.bytes + size > self.budget_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest.size
            _unlink(oldest.path)
            self.stats.dropped_blocks += 1
        if payload[0].is_pinned():  # the pool's copy out may still be on its way (GPU)
            torch.cuda.synchronize()
        path = self.directory / f"{next(self._names)}{SUFFIX}"
        try:
            with open(path, "wb") as f:
                for t in payload:  # raw bytes: numpy has no bfloat16, uint8 views do
                    f.write(t.contiguous().view(torch.uint8).numpy())
        except OSError:
            _unlink(path)
            self.stats.write_errors += 1
            return
        self._entries[h] = _File(key, path, size, [(t.shape, t.dtype) for t in payload])
        self.bytes += size
        self.stats.stored_blocks += 1
        self.stats.bytes_out += size

    def has(self, h: int, key: tuple) -> bool:
        entry = self._entries.get(h)
        return entry is not None and entry.key == key

    def take(self, h: int, key: tuple) -> Payload:
        """The block's K/V read back (plain CPU tensors), its file deleted."""
        start = time.perf_counter()
        entry = self._entries.pop(h)
        assert entry.key == key, "take() follows has()"
        self.bytes -= entry.size
        raw = torch.empty(entry.size, dtype=torch.uint8)
        with open(entry.path, "rb") as f:
            if f.readinto(raw.numpy()) != entry.size:
                raise OSError(f"{entry.path}: shorter than the block it holds")
        _unlink(entry.path)
        sizes = [shape.numel() * dtype.itemsize for shape, dtype in entry.layout]
        k, v = (
            part.view(dtype).view(shape)
            for part, (shape, dtype) in zip(raw.split(sizes), entry.layout, strict=True)
        )
        self.stats.restored_blocks += 1
        self.stats.bytes_in += entry.size
        self.stats.restore_seconds += time.perf_counter() - start
        return k, v

    def discard(self, h: int) -> None:
        """Forget the block under `h`, if any: a newer copy is on its way in."""
        entry = self._entries.pop(h, None)
        if entry is not None:
            self.bytes -= entry.size
            _unlink(entry.path)


class PinnedBlocks:
    """Page-locked host buffers for blocks leaving a GPU pool, handed out and taken back.

    A pinned allocation of its own for each evicted block cost milliseconds (and the
    allocator's lock) per block: thousands per long prompt. Here they are cut from slabs
    of SLAB_BLOCKS blocks and reused once the tier is done with them."""

    SLAB_BLOCKS = 64

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype):
        self.block_shape, self.dtype = block_shape, dtype
        self._free: list[Payload] = []
        self._ours: set[int] = set()  # data pointers of the buffers handed out

    def get(self) -> Payload:
        if not self._free:
            self.add_slab()
        return self._free.pop()

    def add_slab(self) -> None:
        """SLAB_BLOCKS more buffers. Pinning runs at about 2 GB/s (1 ms a Llama-8B block,
        measured on an H100 host): the engine adds the tier's slabs while idle, before
        requests need them, rather than in the middle of a prompt's evictions."""
        shape = (self.SLAB_BLOCKS, *self.block_shape)
        k, v = (torch.empty(shape, dtype=self.dtype, pin_memory=True) for _ in range(2))
        slab = [(k[i], v[i]) for i in range(self.SLAB_BLOCKS)]
        self._ours.update(t.data_ptr() for pair in slab for t in pair)
        self._free.extend(slab)

    def put(self, payload: Payload) -> None:
        """Take a buffer back (a copy into it must already be issued on the stream that
        will write it next; others' tensors, such as a handoff's, are left alone)."""
        if payload[0].data_ptr() in self._ours:
            self._free.append(payload)


class HostTier:
    def __init__(self, budget_bytes: int, below: DiskTier | None = None):
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.stats = TierStats()
        self.below = below  # where the blocks dropped past the budget go
        # where payloads the tier lets go of are recycled (the runner's PinnedBlocks.put)
        self.recycle: Callable[[Payload], None] = lambda payload: None
        self._entries: OrderedDict[int, tuple[tuple, Payload, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, h: int, key: tuple, payload: Payload) -> None:
        """Keep an evicted block's K/V under its key (the newest of a hash replaces)."""
        if self.below is not None:
            self.below.discard(h)
        size = _size(payload)
        if size > self.budget_bytes:
            self._drop(h, key, payload)
            return
        if h in self._entries:
            _, old, size = self._entries.pop(h)
            self.bytes -= size
            self.recycle(old)
        self._entries[h] = (key, payload, size)
        self.bytes += size
        self.stats.stored_blocks += 1
        self.stats.bytes_out += size
        while self.bytes > self.budget_bytes:
            oldest, (old_key, old_payload, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
            self._drop(oldest, old_key, old_payload)

    def _drop(self, h: int, key: tuple, payload: Payload) -> None:
        self.stats.dropped_blocks += 1
        if self.below is not None:
            self.below.store(h, key, payload)  # (written out before it returns)
        self.recycle(payload)

    def _here(self, h: int, key: tuple) -> bool:
        entry = self._entries.get(h)
        return entry is not None and entry[0] == key

    def has(self, h: int, key: tuple) -> bool:
        return self._here(h, key) or (self.below is not None and self.below.has(h, key))

    def take(self, h: int, key: tuple) -> Payload:
        """The block's K/V, leaving the tier (it is in the pool again): from host memory,
        or else from the disk below."""
        if not self._here(h, key):
            assert self.below is not None, "take() follows has()"
            return self.below.take(h, key)
        start = time.perf_counter()
        _, payload, size = self._entries.pop(h)
        self.bytes -= size
        self.stats.restored_blocks += 1
        self.stats.bytes_in += size
        self.stats.restore_seconds += time.perf_counter() - start
        return payload

    def stats_dict(self) -> dict[str, float]:
        """Each tier's counters, flat: kv_host_*, and kv_disk_* with a disk below."""
        below = self.below.stats.as_dict("disk") if self.below is not None else {}
        return {**self.stats.as_dict("host"), **below}

    def close(self) -> None:
        """Delete the disk tier's files (at exit they go anyway)."""
        if self.below is not None:
            self.below.close()
