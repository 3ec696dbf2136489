"""Blocks of the paged KV cache: who holds which, and which full blocks can be reused.

A full block is identified by the hash chain of its tokens *and the principal*
(tenant, or session) that computed it, so a prefix is shared only within one
principal. A hit is confirmed by comparing the stored principal and tokens, so
even a hash collision can never hand one tenant another's KV. Cached blocks
nobody holds stay reusable until a new block is needed; then the least
recently used of them is evicted.

Where the pool is backed by memory only as far as it is used (the shim's KV pool,
omni/cudashim/kv_pool.py), blocks are taken lowest first, and a cached block is evicted
before the pool grows past its `extent`: an instance holds the cache its requests need,
not its whole quota, and a cold model swapped in is charged little more than its weights.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_tiers import HostTier, Payload


@dataclass
class BlockOwner:
    """What the block manager needs of a sequence."""

    token_ids: list[int]
    principal: str = ""
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix tokens whose KV came from the cache (last allocation)
    # (hash, key) of its full blocks so far: tokens only append, so the chain is extended,
    # never recomputed (it was, for every sequence at every step: O(context) each)
    block_hashes: list[tuple[int, tuple]] = field(default_factory=list)
    num_registered: int = 0  # blocks of block_table offered for reuse already
    # K/V of its first blocks computed elsewhere (a prefill instance's, kv_transfer.py):
    # taken like the host tier's blocks where the pool lacks them, then let go
    imported: list[Payload] = field(default_factory=list)


@dataclass
class _Block:
    ref_count: int = 0
    key: tuple | None = None  # (principal, parent hash, tokens) once full and registered
    hash: int | None = None


TIER = -1  # in a list of prefix hits: a block the host tier holds (kv_tiers.py)
IMPORTED = -2  # ... one whose K/V came with the request (BlockOwner.imported)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        tier: HostTier | None = None,
        grow: Callable[[int], int] | None = None,
    ):
        """`grow(n)`: back at least the first n blocks with memory and return how many are
        backed now (raises if it cannot); None: all of them are."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        # made as blocks are first taken (lowest first: this list grows as the pool's use
        # does), not up front: a CPU pool of a small model holds 100k+ blocks
        self.blocks: list[_Block] = []
        self._free: list[int] = list(range(num_blocks))  # a heap: hold nothing reusable
        self.grow = grow
        self.extent = num_blocks if grow is None else grow(1)  # blocks backed by memory
        self._cached: OrderedDict[int, None] = OrderedDict()  # unheld but reusable, LRU first
        self._by_hash: dict[int, int] = {}
        # With a host tier: an evicted block's K/V goes there (read by `read_block`, the
        # model runner's), and a hit there comes back into a fresh block: `restores` lists
        # (block, K/V) to copy in before the next step runs.
        self.tier = tier
        self.read_block: Callable[[int], Payload] | None = None
        self.restores: list[tuple[int, Payload]] = []

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    def forget_contents(self) -> None:
        """The pool's contents are gone (a swap-out released the memory, kv_pool.py): no
        block holds a prefix to reuse any more, and only the first blocks are backed
        again. Blocks held by sequences stay theirs."""
        for b in self.blocks:
            b.key = b.hash = None
        self._by_hash.clear()
        self._free.extend(self._cached)
        heapq.heapify(self._free)
        self._cached.clear()
        if self.grow is not None:
            self.extent = self.grow(1)

    def _chain(self, owner: BlockOwner, n_full: int) -> list[tuple[int, tuple]]:
        """(hash, key) of at least the first n_full blocks of `owner` (its cached chain,
        extended where needed)."""
        out = owner.block_hashes
        parent = out[-1][0] if out else 0
        for i in range(len(out), n_full):
            tokens = tuple(owner.token_ids[i * self.block_size : (i + 1) * self.block_size])
            key = (owner.principal, parent, tokens)
            parent = hash(key)
            out.append((parent, key))
        return out

    def _lookup(self, h: int, key: tuple) -> int | None:
        block = self._by_hash.get(h)
        if block is not None and self.blocks[block].key == key:
            return block
        return None

    def _take(self) -> int:
        if self._free and (self._free[0] < self.extent or not self._cached):
            block = heapq.heappop(self._free)
            if block >= self.extent:
                try:
                    self.extent = self.grow(block + 1)
                except BaseException:
                    heapq.heappush(self._free, block)
                    raise
            if block >= len(self.blocks):
                self.blocks.extend(_Block() for _ in range(len(self.blocks), block + 1))
            return block
        block, _ = self._cached.popitem(last=False)  # evict the least recently used
        b = self.blocks[block]
        if self.tier is not None and self.read_block is not None:
            self.tier.store(b.hash, b.key, self.read_block(block))
        del self._by_hash[b.hash]
        b.key = b.hash = None
        return block

    def _prefix_hits(self, owner: BlockOwner) -> list[int]:
        """Cached blocks that hold `owner`'s prefix (TIER: one the host tier holds,
        IMPORTED: one the request brought), stopping short of the block with its last
        token: that token's logits must be computed."""
        n_tokens = len(owner.token_ids)
        hits = []
        n_full = n_tokens // self.block_size
        for h, key in self._chain(owner, n_full)[:n_full]:
            if (len(hits) + 1) * self.block_size >= n_tokens:
                break
            block = self._lookup(h, key)
            if block is None:
                if self.tier is not None and self.tier.has(h, key):
                    block = TIER
                elif len(hits) < len(owner.imported):
                    block = IMPORTED
                else:
                    break
            hits.append(block)
        return hits

    def blocks_needed(self, owner: BlockOwner) -> int:
        """Blocks allocate() would take from the free pool (held hits take none)."""
        hits = self._prefix_hits(owner)
        held = sum(b >= 0 and self.blocks[b].ref_count > 0 for b in hits)
        return -(-len(owner.token_ids) // self.block_size) - held

    def can_allocate(self, owner: BlockOwner) -> bool:
        return self.blocks_needed(owner) <= self.num_free

    def allocate(self, owner: BlockOwner) -> int:
        """Blocks for all of `owner`'s tokens; returns how many tokens need no computing
        (cache hits, imported blocks)."""
        assert not owner.block_table, "already allocated"
        if not self.can_allocate(owner):
            raise MemoryError("not enough KV cache blocks")
        hits = self._prefix_hits(owner)
        # the pool's hits held and the tier's taken first: taking a block below evicts
        # one, into the tier, which may drop the oldest it holds
        payloads = {}
        for i, block in enumerate(hits):
            if block == TIER:
                payloads[i] = self.tier.take(*owner.block_hashes[i])
            elif block == IMPORTED:
                payloads[i] = owner.imported[i]
            else:
                self._cached.pop(block, None)
                self.blocks[block].ref_count += 1
        for i, block in enumerate(hits):
            if block < 0:  # back from the host tier (or imported), into a fresh block
                h, key = owner.block_hashes[i]
                block = self._take()
                b = self.blocks[block]
                b.ref_count = 1
                if h not in self._by_hash:  # (registered again: reusable in the pool)
                    b.hash, b.key = h, key
                    self._by_hash[h] = block
                self.restores.append((block, payloads[i]))
            owner.block_table.append(block)
        for _ in range(len(hits), -(-len(owner.token_ids) // self.block_size)):
            block = self._take()
            self.blocks[block].ref_count = 1
            owner.block_table.append(block)
        # (imported blocks are another instance's work: its cache hits are reported instead)
        owner.num_cached_tokens = sum(b != IMPORTED for b in hits) * self.block_size
        owner.imported = []
        return len(hits) * self.block_size

    def can_append(self, owner: BlockOwner) -> bool:
        return len(owner.token_ids) <= len(owner.block_table) * self.block_size or bool(
            self.num_free
        )

    def append_slot(self, owner: BlockOwner) -> None:
        """Room for `owner`'s newest token (a new block at a block boundary)."""
        if len(owner.token_ids) > len(owner.block_table) * self.block_size:
            if not self.num_free:
                raise MemoryError("not enough KV cache blocks")
            block = self._take()
            self.blocks[block].ref_count = 1
            owner.block_table.append(block)

    def reserve(self, owner: BlockOwner, n_tokens: int) -> bool:
        """Room for `n_tokens` of `owner` (more than it holds: a speculative step's proposed
        tokens, which may be rejected; their blocks then serve its next tokens). False,
        and nothing taken, if the free blocks are too few."""
        needed = -(-n_tokens // self.block_size) - len(owner.block_table)
        if needed > self.num_free:
            return False
        for _ in range(needed):
            block = self._take()
            self.blocks[block].ref_count = 1
            owner.block_table.append(block)
        return True

    def fork(self, parent: BlockOwner, child: BlockOwner) -> list[tuple[int, int]] | None:
        """Give `child` the KV of its tokens, which `parent` has computed: the full blocks
        are shared (held once more; nobody writes a full block), a partial last block is
        copied, since each writes its own next token into it. Returns the (source,
        destination) blocks to copy; None (and nothing held) if no block is free."""
        n_full, partial = divmod(len(child.token_ids), self.block_size)
        if partial and not self.num_free:
            return None
        for block in parent.block_table[:n_full]:
            self.blocks[block].ref_count += 1
            child.block_table.append(block)
        copies = []
        if partial:
            block = self._take()
            self.blocks[block].ref_count = 1
            child.block_table.append(block)
            copies.append((parent.block_table[n_full], block))
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_registered = min(parent.num_registered, n_full)
        return copies

    def register_full_blocks(self, owner: BlockOwner, n_computed: int) -> None:
        """Make the blocks whose KV is now fully computed reusable by the same principal."""
        n_full = n_computed // self.block_size
        chain = self._chain(owner, n_full)
        for i in range(owner.num_registered, n_full):
            h, key = chain[i]
            block = owner.block_table[i]
            b = self.blocks[block]
            if b.hash is not None or h in self._by_hash:
                continue  # already registered (or an identical block is)
            b.hash, b.key = h, key
            self._by_hash[h] = block
        owner.num_registered = max(owner.num_registered, n_full)

    def free(self, owner: BlockOwner) -> None:
        """Release `owner`'s blocks; registered ones stay reusable until evicted."""
        for block in reversed(owner.block_table):  # tail first: evicted before the prefix
            b = self.blocks[block]
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.hash is not None:
                    self._cached[block] = None
                else:
                    heapq.heappush(self._free, block)
        owner.block_table = []  # num_cached_tokens stays: usage reports it after the end
        owner.num_registered = 0  # a new allocation registers its own blocks
