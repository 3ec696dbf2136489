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
