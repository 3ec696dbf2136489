"""A host-memory tier under the paged KV cache: evicted prefix blocks, kept to come back.

The pool (block_manager.py) keeps full blocks nobody holds for reuse until a new block is
needed; then the least recently used one is evicted. With a tier, the evicted block's
K/V (every layer) is copied to host memory first, under the block's prefix-cache key
(principal, parent hash, tokens), and a later prompt whose hash chain reaches that key
takes a fresh block and copies the K/V back instead of recomputing it. The key is
compared whole on every hit, so a tenant never gets another tenant's blocks, here as in
the pool. The tier has its own budget; past it, its least recently stored blocks go.

Written here rather than taken from LMCache or Mooncake: both are built around another
engine's paged-cache layout and CUDA, and this tier must also serve the CPU path and the
engine's own block keys (principal-scoped hash chains).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

Payload = tuple[torch.Tensor, torch.Tensor]  # a block's K and V, [layers, block, heads, dim]


@dataclass
class TierStats:
    stored_blocks: int = 0
    restored_blocks: int = 0
    dropped_blocks: int = 0  # gone past the budget
    bytes_out: int = 0  # pool to tier
    bytes_in: int = 0  # tier to pool

    def as_dict(self) -> dict[str, int]:
        return {f"kv_host_{k}": v for k, v in vars(self).items()}


class HostTier:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.stats = TierStats()
        self._entries: OrderedDict[int, tuple[tuple, Payload, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, h: int, key: tuple, payload: Payload) -> None:
        """Keep an evicted block's K/V under its key (the newest of a hash replaces)."""
        size = sum(t.numel() * t.element_size() for t in payload)
        if size > self.budget_bytes:
            return
        if h in self._entries:
            self.bytes -= self._entries.pop(h)[2]
        self._entries[h] = (key, payload, size)
        self.bytes += size
        self.stats.stored_blocks += 1
        self.stats.bytes_out += size
        while self.bytes > self.budget_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
            self.stats.dropped_blocks += 1

    def has(self, h: int, key: tuple) -> bool:
        entry = self._entries.get(h)
        return entry is not None and entry[0] == key

    def take(self, h: int, key: tuple) -> Payload:
        """The block's K/V, leaving the tier (it is in the pool again)."""
        stored, payload, size = self._entries.pop(h)
        assert stored == key, "take() follows has()"
        self.bytes -= size
        self.stats.restored_blocks += 1
        self.stats.bytes_in += size
        return payload
