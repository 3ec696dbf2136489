"""Who is admitted next: longest first, arrival order once someone waited too long, and
sequences that already ran before everyone."""

from __future__ import annotations

import random

import pytest

from omni.engine.sequence import Sequence
from omni.engine.wait_queue import WaitQueue


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drain(queue: WaitQueue) -> list[Sequence]:
    out = []
    while (seq := queue.peek()) is not None:
        queue.remove(seq)
        out.append(seq)
    return out


def test_the_most_tokens_left_go_first_and_ties_keep_arrival_order():
    rng = random.Random()
    queue = WaitQueue(clock=Clock())
    seqs = [
        Sequence(token_ids=[1] * rng.randrange(1, 50), max_tokens=rng.randrange(1, 8))
        for _ in range(40)
    ]
    for seq in seqs:
        queue.push(seq)
    assert len(queue) == 40
    want = sorted(seqs, key=lambda s: -s.max_tokens)  # sorted() is stable: arrival order
    assert drain(queue) == want
    assert len(queue) == 0 and not queue


def test_tokens_left_count_what_a_sequence_already_generated():
    queue = WaitQueue(clock=Clock())
    done_most = Sequence(token_ids=[1, 2, 3, 4, 5, 6], num_prompt_tokens=2, max_tokens=6)
    fresh = Sequence(token_ids=[1, 2], max_tokens=3)
    queue.push(done_most)  # 2 left
    queue.push(fresh)  # 3 left
    assert drain(queue) == [fresh, done_most]


def test_once_the_oldest_waited_too_long_arrival_order_rules():
    clock = Clock()
    queue = WaitQueue(max_wait_s=2.0, clock=clock)
    short = Sequence(token_ids=[1], max_tokens=1)
    queue.push(short)
    clock.now = 1.0
    long_ = Sequence(token_ids=[1], max_tokens=100)
    newer_short = Sequence(token_ids=[1], max_tokens=2)
    queue.push(long_)
    queue.push(newer_short)
    assert queue.peek() is long_
    clock.now = 2.0  # `short` has waited 2 s
    assert queue.peek() is short
    queue.remove(short)
    assert queue.peek() is long_  # the next oldest (`long_`, 1 s) is young enough
    clock.now = 3.5  # both left have waited 2.5 s: oldest first
    assert drain(queue) == [long_, newer_short]


def test_sequences_that_already_ran_go_before_everyone():
    queue = WaitQueue(clock=Clock())
    new = Sequence(token_ids=[1], max_tokens=100)
    queue.push(new)
    first, second = Sequence(token_ids=[1], max_tokens=1), Sequence(token_ids=[1], max_tokens=1)
    queue.push_front(first)
    queue.push_front(second)  # preempted after `first`: the older of the two, so first
    assert drain(queue) == [second, first, new]


def test_a_removed_sequence_that_comes_back_is_queued_once():
    queue = WaitQueue(clock=Clock())
    a, b = Sequence(token_ids=[1], max_tokens=9), Sequence(token_ids=[1], max_tokens=5)
    queue.push(a)
    queue.push(b)
    queue.remove(a)  # admitted, then preempted: back in the front lane
    assert a not in queue and b in queue
    queue.push_front(a)
    assert len(queue) == 2
    assert drain(queue) == [a, b]  # the stale longest-first entry of `a` is not served
    with pytest.raises(ValueError, match="already waiting"):
        queue.push(b)
        queue.push(b)
