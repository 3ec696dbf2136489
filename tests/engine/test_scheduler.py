"""Continuous batching with a deterministic fake model: next token = f(all tokens so far)."""

from __future__ import annotations

import random

import pytest

from omni.engine.block_manager import BlockManager
from omni.engine.scheduler import Scheduler
from omni.engine.sequence import Sequence, Status


def next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 7919) % 50_000


def run(sched: Scheduler, arrivals: dict[int, list[Sequence]], check=None) -> int:
    """Step until every sequence has its max_tokens; returns the number of steps."""
    step = 0
    while sched.has_work() or any(k >= step for k in arrivals):
        for seq in arrivals.get(step, []):
            sched.add(seq)
        batch = sched.schedule()
        step += 1
        if batch is None:
            continue
        assert batch.total_tokens <= sched.max_batch_tokens
        assert len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
        if check:
            check(batch)
        new = {}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            assert n >= 1 and seq.status is Status.RUNNING
            assert len(seq.block_table) * sched.blocks.block_size >= seq.num_computed + n
            if batch.samples(i):
                new[seq.seq_id] = next_token(seq.token_ids)
        sched.update(batch, new)
        for seq in list(sched.running):
            if seq.num_generated >= seq.max_tokens:
                sched.finish(seq)
        assert step < 100_000, "no progress"
    return step


def expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens


def make(rng: random.Random, n: int, principal: str = "t") -> list[Sequence]:
    return [
        Sequence(
            token_ids=[rng.randrange(50_000) for _ in range(rng.randrange(1, 90))],
            principal=principal,
            max_tokens=rng.randrange(1, 40),
        )
        for _ in range(n)
    ]


def test_a_long_prompt_is_prefilled_in_chunks_under_the_budget():
    sched = Scheduler(BlockManager(64, 16), max_batch_tokens=32)
    seq = Sequence(token_ids=list(range(100)), max_tokens=5)
    chunks = []
    run(sched, {0: [seq]}, lambda b: chunks.append(b.num_tokens[0]))
    assert chunks == [32, 32, 32, 4, 1, 1, 1, 1]
    assert seq.token_ids == expected(list(range(100)), 5)
    assert sched.blocks.num_free == 64


def test_requests_join_and_leave_between_steps_and_decodes_go_first():
    rng = random.Random()
    sched = Scheduler(BlockManager(512, 16), max_batch_tokens=64, max_seqs=8)
    seqs = make(rng, 30)
    originals = {s.seq_id: list(s.token_ids) for s in seqs}
    arrivals = {i * 3: [s] for i, s in enumerate(seqs)}

    def decodes_first(batch):
        kinds = [
            n == 1 and not s.is_prefilling
            for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
        ]
        assert kinds == sorted(kinds, reverse=True)  # all decodes before any prefill
        assert len(batch.seqs) <= 8

    run(sched, arrivals, decodes_first)
    for s in seqs:
        assert s.token_ids == expected(originals[s.seq_id], s.max_tokens)
        assert s.status is Status.FINISHED
    assert sched.blocks.num_free == 512


def test_preemption_under_memory_pressure_gives_the_same_outputs():
    rng = random.Random()
    sched = Scheduler(BlockManager(24, 8), max_batch_tokens=64)  # 192 token slots in all
    seqs = make(rng, 25)
    for s in seqs:
        assert sched.fits(s)
    originals = {s.seq_id: list(s.token_ids) for s in seqs}
    run(sched, {0: seqs})
    assert sum(s.preemptions for s in seqs) > 0, "the test did not create pressure"
    for s in seqs:
        assert s.token_ids == expected(originals[s.seq_id], s.max_tokens)
    assert sched.blocks.num_free == 24


def test_abort_frees_blocks_at_once():
    rng = random.Random()
    sched = Scheduler(BlockManager(128, 16), max_batch_tokens=64)
    seqs = make(rng, 10)
    for s in seqs:
        sched.add(s)
    for _ in range(3):
        batch = sched.schedule()
        sched.update(batch, {s.seq_id: 1 for i, s in enumerate(batch.seqs) if batch.samples(i)})
    assert sched.blocks.num_free < 128
    for s in seqs:
        sched.finish(s)  # running or still waiting
    assert sched.blocks.num_free == 128 and not sched.has_work()


def test_prefix_hits_skip_computed_tokens_within_a_principal_only():
    sched = Scheduler(BlockManager(64, 16), max_batch_tokens=512)
    prompt = list(range(70))
    first = Sequence(token_ids=list(prompt), principal="a", max_tokens=2)
    run(sched, {0: [first]})
    computed = []

    def record(batch):
        computed.extend(zip([s.principal for s in batch.seqs], batch.num_tokens, strict=True))

    same = Sequence(token_ids=list(prompt), principal="a", max_tokens=2)
    other = Sequence(token_ids=list(prompt), principal="b", max_tokens=2)
    run(sched, {0: [same]}, record)
    run(sched, {0: [other]}, record)
    assert same.num_cached_tokens == 64 and other.num_cached_tokens == 0
    assert computed[0] == ("a", 70 - 64) and ("b", 70) in computed
    assert same.token_ids == other.token_ids == first.token_ids


@pytest.mark.parametrize("n_blocks", [1, 4])
def test_a_sequence_larger_than_the_cache_does_not_fit(n_blocks):
    sched = Scheduler(BlockManager(n_blocks, 16))
    assert not sched.fits(Sequence(token_ids=list(range(n_blocks * 16)), max_tokens=1))
    assert sched.fits(Sequence(token_ids=list(range(n_blocks * 16 - 1)), max_tokens=1))


def test_a_backlog_starts_its_longest_request_first_and_ends_with_it():
    """One long request behind a hundred short ones: it is admitted in the first step,
    the short ones ride along in the steps its decode takes anyway, and the whole backlog
    ends when the long request does (first come, first served would start it last and
    leave a tail of steps for it alone)."""
    rng = random.Random()
    sched = Scheduler(BlockManager(2048, 16), max_batch_tokens=512, max_seqs=64)
    shorts = [
        Sequence(token_ids=[rng.randrange(50_000) for _ in range(30)], max_tokens=20)
        for _ in range(100)
    ]
    long_ = Sequence(token_ids=list(range(10)), max_tokens=400)
    originals = {s.seq_id: list(s.token_ids) for s in [*shorts, long_]}
    first = []
    steps = run(sched, {0: [*shorts, long_]}, lambda b: first or first.extend(b.seqs))
    assert long_ in first
    assert steps <= long_.max_tokens + 1
    for seq in [*shorts, long_]:
        assert seq.token_ids == expected(originals[seq.seq_id], seq.max_tokens)
