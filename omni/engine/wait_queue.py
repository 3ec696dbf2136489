"""The requests waiting for a place in the batch, and which one goes next.

Longest first. A backlog's run lasts as long as its longest request: that many steps
happen whatever else runs. Admitting the requests with the most tokens left to generate
first lets the shorter ones ride along in those steps, instead of leaving a tail of
steps that each read all the weights for one or two sequences (the longest-processing-
time rule for a makespan). Ties keep arrival order.

Nobody starves: once the oldest request has waited `max_wait_s`, arrival order rules
until the oldest is younger than that again. Preempted and forked sequences go in a front
lane, ahead of everyone: they already ran, and hold users mid-answer.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable

from .sequence import Sequence


def tokens_left(seq: Sequence) -> int:
    """Tokens `seq` may still generate (its max_tokens less what it has)."""
    return seq.max_tokens - seq.num_generated


class WaitQueue:
    def __init__(self, max_wait_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.max_wait_s = max_wait_s
        self.clock = clock
        # Entries are (…, ticket, seq); an entry is live while its ticket is the one
        # `_tickets` holds for the sequence (a popped or re-queued sequence leaves stale
        # entries behind, dropped when they reach a head).
        self._tickets: dict[int, int] = {}
        self._next_ticket = itertools.count()
        self._front: deque[tuple[int, Sequence]] = deque()
        self._arrivals: deque[tuple[float, int, Sequence]] = deque()
        self._longest: list[tuple[int, int, Sequence]] = []  # heap on -tokens left

    def push(self, seq: Sequence) -> None:
        """A new arrival."""
        ticket = self._enter(seq)
        self._arrivals.append((self.clock(), ticket, seq))
        heapq.heappush(self._longest, (-tokens_left(seq), ticket, seq))

    def push_front(self, seq: Sequence) -> None:
        """A sequence that already ran (preempted, or a fork without a free block)."""
        self._front.appendleft((self._enter(seq), seq))

    def peek(self) -> Sequence | None:
        """Who goes next: the front lane, else the oldest arrival once it has waited too
        long, else the one with the most tokens left."""
        for lane in (self._front, self._arrivals, self._longest):
            while lane and not self._live(lane[0]):
                heapq.heappop(lane) if lane is self._longest else lane.popleft()
        if self._front:
            return self._front[0][-1]
        if self._arrivals and self.clock() - self._arrivals[0][0] >= self.max_wait_s:
            return self._arrivals[0][-1]
        return self._longest[0][-1] if self._longest else None

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out (admitted, finished or aborted); its entries go stale."""
        del self._tickets[seq.seq_id]

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tickets

    def __len__(self) -> int:
        return len(self._tickets)

    def sequences(self) -> list[Sequence]:
        """Those waiting (copies of the lanes first: another thread may read this)."""
        entries = [*list(self._front), *list(self._arrivals)]
        return [entry[-1] for entry in entries if self._live(entry)]

    def _enter(self, seq: Sequence) -> int:
        if seq.seq_id in self._tickets:
            raise ValueError(f"sequence {seq.seq_id} is already waiting")
        ticket = self._tickets[seq.seq_id] = next(self._next_ticket)
        return ticket

    def _live(self, entry: tuple) -> bool:
        return self._tickets.get(entry[-1].seq_id) == entry[-2]
