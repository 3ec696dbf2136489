"""The paged KV cache's block accounting and principal-scoped prefix cache."""

from __future__ import annotations

import random

import pytest

from omni.engine.block_manager import BlockManager, BlockOwner

BS = 4


def owner(tokens, principal="tenant-a") -> BlockOwner:
    return BlockOwner(list(tokens), principal)


def computed(bm: BlockManager, o: BlockOwner) -> BlockOwner:
    """Allocate and pretend the prompt ran: its full blocks become reusable."""
    bm.allocate(o)
    bm.register_full_blocks(o, len(o.token_ids))
    return o


def test_allocate_and_free_return_every_block():
    bm = BlockManager(10, BS)
    o = owner(range(10))
    assert bm.allocate(o) == 0
    assert len(o.block_table) == 3 and bm.num_free == 7
    bm.free(o)
    assert bm.num_free == 10 and o.block_table == []


@pytest.mark.parametrize(("n_tokens", "hit"), [(10, 8), (8, 4), (4, 0), (13, 12)])
def test_same_principal_reuses_full_blocks_but_computes_the_last_token(n_tokens, hit):
    bm = BlockManager(16, BS)
    first = computed(bm, owner(range(n_tokens)))
    second = owner(range(n_tokens))
    assert bm.allocate(second) == hit
    assert second.block_table[: hit // BS] == first.block_table[: hit // BS]
    assert len(second.block_table) == len(first.block_table)


def test_forgotten_contents_give_no_hits_and_every_unheld_block_is_free():
    """A swap-out released the pool's memory (kv_pool.py): nothing cached is reusable,
    and blocks still held stay with their holder."""
    bm = BlockManager(16, BS)
    bm.free(computed(bm, owner(range(12))))
    held = computed(bm, owner(range(100, 108)))
    bm.forget_contents()
    assert bm.num_free == 16 - 2
    again = owner(range(12))
    assert bm.allocate(again) == 0
    assert bm.allocate(owner(range(100, 109))) == 0  # the held blocks' prefix too
    assert not set(again.block_table) & set(held.block_table)


def test_other_principal_gets_no_hit():
    bm = BlockManager(16, BS)
    computed(bm, owner(range(12), "tenant-a"))
    other = owner(range(12), "tenant-b")
    assert bm.allocate(other) == 0
    session = owner(range(12), "tenant-a")
    assert bm.allocate(session) == 8


def test_a_hash_collision_never_crosses_principals():
    bm = BlockManager(16, BS)
    a = computed(bm, owner(range(12), "tenant-a"))
    b = owner(range(12), "tenant-b")
    for (h, _key), block in zip(bm._chain(b, 3), a.block_table, strict=True):
        bm._by_hash[h] = block  # every one of b's hashes now points at a's blocks
    assert bm.allocate(b) == 0
    assert not set(b.block_table) & set(a.block_table)


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(6, BS)
    a = computed(bm, owner(range(12)))
    bm.free(a)
    assert bm.num_free == 6  # cached blocks count as free
    again = owner(range(12))
    assert bm.allocate(again) == 8  # still there
    bm.free(again)
    filler = owner(range(100, 124))  # needs all 6 blocks: evicts the cached ones
    assert bm.allocate(filler) == 0
    bm.free(filler)
    assert bm.allocate(owner(range(12))) == 0


def test_shared_blocks_stay_held_until_the_last_holder_frees():
    bm = BlockManager(8, BS)
    a = computed(bm, owner(range(9)))
    b = owner(range(9))
    bm.allocate(b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and bm.blocks[shared[0]].ref_count == 2
    bm.free(a)
    assert all(bm.blocks[x].ref_count == 1 for x in shared)
    assert bm.num_free == 8 - len(b.block_table)


def test_append_slot_adds_a_block_at_each_boundary():
    bm = BlockManager(3, BS)
    o = owner(range(4))
    bm.allocate(o)
    assert len(o.block_table) == 1
    for n in range(5, 13):
        o.token_ids.append(n)
        assert bm.can_append(o)
        bm.append_slot(o)
        assert len(o.block_table) == -(-n // BS)
    o.token_ids.append(99)
    assert not bm.can_append(o)
    with pytest.raises(MemoryError):
        bm.append_slot(o)


def test_random_traffic_keeps_the_books_balanced():
    rng = random.Random()
    bm = BlockManager(64, BS)
    live: list[BlockOwner] = []
    prompts = [list(range(rng.randrange(1, 40))) for _ in range(6)]
    for _ in range(2000):
        if live and rng.random() < 0.45:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            o = owner(rng.choice(prompts), rng.choice(["a", "b"]))
            if bm.can_allocate(o):
                computed(bm, o)
                live.append(o)
        held = {b for o in live for b in o.block_table}
        refs = sum(bm.blocks[b].ref_count for b in held)
        assert refs == sum(len(o.block_table) for o in live)
        assert bm.num_free + len(held) == 64
    for o in live:
        bm.free(o)
    assert bm.num_free == 64


def test_a_sequence_allocated_again_registers_its_new_blocks_from_its_kept_chain():
    """The hash chain is computed once per block and kept with the sequence; a sequence
    whose blocks were evicted and that is allocated again (a recompute) offers its new
    blocks for reuse all the same."""
    bm = BlockManager(8, 4)
    seq = BlockOwner(token_ids=list(range(12)))
    bm.allocate(seq)
    bm.register_full_blocks(seq, 12)
    chain = list(seq.block_hashes)
    assert len(chain) == 3
    bm.free(seq)
    filler = BlockOwner(token_ids=list(range(100, 132)), principal="other")
    bm.allocate(filler)  # all 8 blocks: seq's cached ones are evicted
    bm.free(filler)
    assert bm.allocate(seq) == 0  # nothing left to hit
    bm.register_full_blocks(seq, 12)
    assert seq.block_hashes == chain  # kept, not recomputed
    twin = BlockOwner(token_ids=list(range(12)))
    assert bm.allocate(twin) == 8  # two blocks; the one with the last token is computed


@pytest.mark.parametrize(("n_tokens", "shared", "copied"), [(10, 2, 1), (8, 2, 0), (3, 0, 1)])
def test_fork_shares_full_blocks_and_copies_the_partial_one(n_tokens, shared, copied):
    bm = BlockManager(8, BS)
    parent = computed(bm, owner(range(n_tokens)))
    free = bm.num_free
    child = owner(range(n_tokens))
    copies = bm.fork(parent, child)
    assert child.block_table[:shared] == parent.block_table[:shared]
    assert len(copies) == copied and bm.num_free == free - copied
    if copied:  # its own block, filled from the parent's partial one
        assert copies == [(parent.block_table[-1], child.block_table[-1])]
        assert child.block_table[-1] not in parent.block_table
    bm.free(parent)  # the shared blocks stay held by the child
    assert all(bm.blocks[b].ref_count == 1 for b in child.block_table)
    bm.free(child)
    assert bm.num_free == 8


def test_fork_without_a_free_block_holds_nothing():
    bm = BlockManager(3, BS)
    parent = computed(bm, owner(range(10)))
    child = owner(range(10))
    assert bm.fork(parent, child) is None
    assert child.block_table == [] and all(bm.blocks[b].ref_count == 1 for b in parent.block_table)


# ------------------------------------------------------------------ the host tier


def tiered(num_blocks: int, budget: int = 1 << 20):
    """A block manager with a host tier, each block's "K/V" its own id as a tensor, and a
    fake pool of those values: what the tier stores and gives back can be checked."""
    import torch

    from omni.engine.kv_tiers import HostTier

    bm = BlockManager(num_blocks, BS, HostTier(budget))
    pool = {b: torch.full((2,), float(b)) for b in range(num_blocks)}  # a block's contents
    bm.read_block = lambda b: (pool[b].clone(), pool[b].clone())
    return bm, pool


def test_an_evicted_block_comes_back_from_the_host_tier_with_its_contents():
    bm, pool = tiered(6)
    a = computed(bm, owner(range(9)))  # 3 blocks, 2 full and registered
    old = a.block_table[:2]
    contents = [pool[b].clone() for b in old]
    bm.free(a)
    b = computed(bm, owner(range(100, 124)))  # 6 blocks: every cached block evicted
    assert len(bm.tier) == 2 and bm.tier.stats.stored_blocks == 2
    bm.free(b)
    again = owner(range(9))
    assert bm.allocate(again) == 8  # both full blocks: hits, from the tier
    assert [blk for blk, _ in bm.restores] == again.block_table[:2]
    assert [float(k[0]) for _, (k, _v) in bm.restores] == [float(c[0]) for c in contents]
    assert bm.tier.stats.restored_blocks == 2  # (and they left the tier:)
    assert not any(bm.tier.has(h, key) for h, key in again.block_hashes[:2])


def test_the_host_tier_serves_only_the_principal_that_computed_the_block():
    bm, _ = tiered(6)
    bm.free(computed(bm, owner(range(9), "tenant-a")))
    bm.free(computed(bm, owner(range(100, 124), "tenant-c")))  # evicts a's blocks
    assert len(bm.tier) == 2
    other = owner(range(9), "tenant-b")
    assert bm.allocate(other) == 0 and bm.restores == []
    mine = owner(range(9), "tenant-a")
    bm._chain(mine, 2)
    assert all(bm.tier.has(h, key) for h, key in mine.block_hashes[:2])  # still a's


def test_the_host_tier_keeps_to_its_budget_and_a_prompts_head_outlives_its_tail():
    """A freed sequence's tail is evicted first, so the tier, dropping its oldest past
    its budget, keeps the chain's first blocks: the ones a later prompt can reach."""
    import torch

    bm, _ = tiered(6, budget=3 * 2 * torch.zeros(2).element_size() * 2)  # 3 blocks' K+V
    bm.free(computed(bm, owner(range(24))))  # 6 full blocks
    bm.free(computed(bm, owner(range(100, 124))))  # evicts all 6: 3 kept
    assert len(bm.tier) == 3 and bm.tier.stats.dropped_blocks == 3
    assert bm.allocate(owner(range(23))) == 12  # blocks 0-2 back from the tier


class Backing:
    """A pool backed in steps of `step` blocks (the model runner's back_blocks); fails
    past `limit` like a driver out of memory."""

    def __init__(self, step: int, limit: int = 1 << 30):
        self.step, self.limit, self.backed, self.calls = step, limit, 0, []

    def __call__(self, n: int) -> int:
        self.calls.append(n)
        if n > self.limit:
            raise MemoryError("no memory to back the pool")
        self.backed = max(self.backed, -(-n // self.step) * self.step)
        return self.backed


def test_a_backed_pool_grows_only_when_its_backed_blocks_are_held():
    grow = Backing(step=4)
    bm = BlockManager(32, BS, grow=grow)
    assert bm.extent == 4  # block 0's step, backed from the start
    a = computed(bm, owner(range(10)))  # 3 blocks, lowest first
    assert a.block_table == [0, 1, 2] and bm.extent == 4
    b = computed(bm, owner(range(100, 110)))
    assert b.block_table == [3, 4, 5] and bm.extent == 8  # 4 and 5 needed a new step
    bm.free(a), bm.free(b)
    # the cached prefixes are evicted (least recently used first) before the pool grows
    c = computed(bm, owner(range(200, 240)))  # 10 blocks: 4 free, 4 evicted, 2 grown
    assert c.block_table == [2, 5, 6, 7, 1, 0, 4, 3, 8, 9]
    assert bm.extent == 12
    assert bm.num_free == 22


def test_forgotten_contents_back_the_first_step_again_and_a_failed_growth_takes_nothing():
    grow = Backing(step=4, limit=8)
    bm = BlockManager(32, BS, grow=grow)
    held = owner(range(20))  # 5 blocks: the pool backs 8
    bm.allocate(held)
    grow.backed = 0  # a swap-out released the memory
    bm.free(held)
    bm.forget_contents()
    assert grow.calls[-1] == 1 and bm.extent == 4
    big = owner(range(100, 140))  # 10 blocks: past what the driver can back
    with pytest.raises(MemoryError):
        bm.allocate(big)
    assert bm.num_free == 32 - len(big.block_table)  # what it took is still its own
