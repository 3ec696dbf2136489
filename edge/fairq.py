"""Admission at the edge: permits per instance and weighted fair queues per tenant.

Pure asyncio, in memory: taking a permit never waits on the network, so admission stays
cheap however busy the instances are. An instance's concurrency is a number of permits; a
request is forwarded only with one, and gives it back as soon as its GPU work ends (early
release), even while a slow client is still reading the answer.

When no permit is free, requests wait in one FIFO per tenant. Tenants are served by a
virtual token counter: each tenant's counter advances by cost / weight on every dispatch,
and the tenant whose next request would finish first in virtual time goes next, so tenants
get GPU work in proportion to their weights however many requests each one sends. A tenant
that starts waiting is lifted to the current virtual time, so time spent idle is not credit
it can spend later in one burst. Costs are estimates (prompt + max_tokens) that
`Permit.correct_cost` replaces with the real count once known.

Nothing waits without bound: a full queue sheds from the tenant furthest above its fair
share (429 with Retry-After), and a request whose deadline passes while queued is refused
(504) rather than sent to burn GPU time on an answer nobody will read.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Dispatches within this window make the "recent service rate" that Retry-After is based on.
RATE_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60.0
SHED_REASONS = ("queue_full", "shed_for_fairness", "deadline", "no_capacity")


class Shed(Exception):
    """A request the edge refuses rather than holds: 429 (shed, queue full) or 504 (deadline)."""

    def __init__(self, status: int, reason: str, retry_after_s: float) -> None:
        super().__init__(f"{status} {reason}, retry after {retry_after_s:.1f}s")
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(eq=False)  # identity comparison: two equal requests are still two requests
class Ticket:
    """A request waiting for a permit in its tenant's queue."""

    tenant: str
    cost: float
    deadline: float | None  # in the queue's clock (monotonic seconds)
    seq: int = 0
    future: asyncio.Future[Permit] | None = field(default=None, repr=False)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class Permit:
    """The right to run one request on an instance.

    Both the early-release hook (GPU work done) and the response path (client done) call
    `release`; only the first one counts.
    """

    def __init__(self, queue: FairQueue, tenant: str, cost: float) -> None:
        self._queue = queue
        self.tenant = tenant
        self.cost = cost
        self.released = False

    def release(self) -> None:
        """Give the permit back; later calls do nothing."""
        if not self.released:
            self.released = True
            self._queue._release(self.tenant)

    def correct_cost(self, actual: float) -> None:
        """Charge the tenant the real cost once known, instead of the estimate it paid."""
        if actual < 0:
            raise ValueError("cost must be >= 0")
        self._queue._charge(self.tenant, actual - self.cost)
        self.cost = actual

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Permit:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class FairQueue:
    """Permits plus per-tenant queues served in proportion to tenant weight, by cost."""

    def __init__(
        self,
        permits: int,
        max_queued: int = 1024,
        weights: dict[str, float] | None = None,
        default_weight: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if permits < 0 or max_queued < 0:
            raise ValueError("permits and max_queued must be >= 0")
        self._weights = dict(weights or {})
        if default_weight <= 0 or any(w <= 0 for w in self._weights.values()):
            raise ValueError("weights must be > 0")
        self._permits = permits
        self._max_queued = max_queued
        self._default_weight = default_weight
        self._clock = clock
        self._in_use = 0
        self.service_s: float | None = None  # a handler model's predicted GPU s a request
        self._queues: dict[str, deque[Ticket]] = {}  # only tenants with something queued
        self._n_queued = 0
        self._seq = 0
        self._counter: dict[str, float] = {}  # virtual token counter per tenant
        self._vtime = 0.0  # latest dispatch's virtual start: where tenants re-enter
        self._served: dict[str, float] = {}
        self._held: dict[str, int] = {}  # permits in use per tenant (the dashboard's share)
        self._shed = dict.fromkeys(SHED_REASONS, 0)
        self._recent: deque[tuple[float, float]] = deque()  # (when, cost) of dispatches

    # -- public API -----------------------------------------------------------------------

    def set_permits(self, n: int) -> None:
        """Capacity changed (instances added or removed); permits above `n` drain on release."""
        if n < 0:
            raise ValueError("permits must be >= 0")
        self._permits = n
        self._dispatch()

    async def acquire(self, tenant: str, cost: float, deadline: float | None = None) -> Permit:
        """A permit for one request of `tenant`, waiting its fair turn if none is free.

        Raises Shed(504) once `deadline` passes, Shed(429) when the queue is full.
        """
        if cost < 0:
            raise ValueError("cost must be >= 0")
        if deadline is not None and deadline <= self._clock():
            raise self._count(Shed(504, "deadline", self._retry_after()))
        if self._n_queued == 0 and self._in_use < self._permits:
            self._lift(tenant)
            return self._grant(tenant, cost)
        self._make_room(tenant, cost)
        ticket = self._enqueue(tenant, cost, deadline)
        self._dispatch()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            self._withdraw(ticket)
            raise

    def shed_all(self, reason: str = "no_capacity") -> int:
        """Refuse every queued request (503): the model has lost its last node, and
        nothing says it will come back."""
        tickets = [t for queue in self._queues.values() for t in queue]
        for ticket in tickets:
            self._take(ticket)
            self._fail(ticket, 503, reason)
        return len(tickets)

    def queued(self, tenant: str | None = None) -> int:
        """Requests waiting, for one tenant or all."""
        if tenant is None:
            return self._n_queued
        return len(self._queues.get(tenant, ()))

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def permits(self) -> int:
        return self._permits

    def queued_by_tenant(self) -> dict[str, int]:
        return {t: len(q) for t, q in self._queues.items() if q}

    def held_by_tenant(self) -> dict[str, int]:
        """Permits in use per tenant."""
        return {t: n for t, n in self._held.items() if n}

    @property
    def shed_counts(self) -> dict[str, int]:
        return dict(self._shed)

    @property
    def served_cost(self) -> dict[str, float]:
        """Cost dispatched per tenant, with corrections applied once real costs are known."""
        return dict(self._served)

    # -- fair order ---------------------------------------------------------------------

    def _weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._default_weight)

    def _lift(self, tenant: str) -> None:
        """A tenant starting to wait begins no earlier than anyone still waiting.

        Without this, a tenant idle for an hour would hold an hour's worth of credit and
        take every permit until it caught up. With nobody waiting, the latest dispatch's
        virtual time stands in, so capacity used while others were idle is not held
        against the user later.
        """
        now = min((self._counter[t] for t in self._queues), default=self._vtime)
        self._counter[tenant] = max(self._counter.get(tenant, 0.0), now)

    def _next_tenant(self) -> str:
        """The waiting tenant whose head request finishes first in virtual time."""

        def finish(tenant: str) -> tuple[float, float, int]:
            head = self._queues[tenant][0]
            start = self._counter[tenant]
            return (start + head.cost / self._weight(tenant), start, head.seq)

        return min(self._queues, key=finish)

    def _grant(self, tenant: str, cost: float) -> Permit:
        start = self._counter[tenant]
        self._vtime = max(self._vtime, start)
        self._charge(tenant, cost)
        self._in_use += 1
        self._held[tenant] = self._held.get(tenant, 0) + 1
        now = self._clock()
        self._recent.append((now, cost))
        self._trim(now)
        return Permit(self, tenant, cost)

    def _charge(self, tenant: str, cost: float) -> None:
        """Advance (or, for a negative correction, wind back) the tenant's counter."""
        self._counter[tenant] = self._counter.get(tenant, 0.0) + cost / self._weight(tenant)
        self._served[tenant] = self._served.get(tenant, 0.0) + cost

    def _release(self, tenant: str) -> None:
        self._in_use -= 1
        self._held[tenant] -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free permits to queued requests in fair order, skipping expired ones."""
        while self._in_use < self._permits and self._n_queued:
            tenant = self._next_tenant()
            ticket = self._queues[tenant][0]
            self._take(ticket)
            if ticket.future.done():  # its waiter was cancelled and withdraws it
                continue
            if ticket.deadline is not None and ticket.deadline <= self._clock():
                self._fail(ticket, 504, "deadline")
                continue
            ticket.future.set_result(self._grant(tenant, ticket.cost))

    # -- queue bookkeeping --------------------------------------------------------------

    def _enqueue(self, tenant: str, cost: float, deadline: float | None) -> Ticket:
        loop = asyncio.get_running_loop()
        if tenant not in self._queues:
            self._lift(tenant)
            self._queues[tenant] = deque()
        self._seq += 1
        ticket = Ticket(tenant, cost, deadline, seq=self._seq, future=loop.create_future())
        self._queues[tenant].append(ticket)
        self._n_queued += 1
        if deadline is not None:
            self._arm(ticket)
        return ticket

    def _take(self, ticket: Ticket) -> bool:
        """Remove a ticket from its queue; False if it was no longer there."""
        queue = self._queues.get(ticket.tenant)
        if queue is None or ticket not in queue:
            return False
        queue.remove(ticket)
        if not queue:
            del self._queues[ticket.tenant]
        self._n_queued -= 1
        if ticket.timer is not None:
            ticket.timer.cancel()
        return True

    def _withdraw(self, ticket: Ticket) -> None:
        """The waiter went away: drop its ticket, or return the permit it got but never saw."""
        if self._take(ticket):
            return
        future = ticket.future
        if future.done() and not future.cancelled() and future.exception() is None:
            permit = future.result()
            permit.correct_cost(0.0)  # nothing ran: refund the tenant
            permit.release()

    def _fail(self, ticket: Ticket, status: int, reason: str) -> None:
        if not ticket.future.done():
            ticket.future.set_exception(self._count(Shed(status, reason, self._retry_after())))

    def _count(self, shed: Shed) -> Shed:
        self._shed[shed.reason] += 1
        return shed

    # -- deadlines and shedding -----------------------------------------------------------

    def _arm(self, ticket: Ticket) -> None:
        delay = max(0.0, ticket.deadline - self._clock())
        ticket.timer = asyncio.get_running_loop().call_later(delay, self._on_deadline, ticket)

    def _on_deadline(self, ticket: Ticket) -> None:
        if ticket.future.done():
            return
        if ticket.deadline > self._clock():  # timer ran early against the queue's clock
            self._arm(ticket)
        elif self._take(ticket):
            self._fail(ticket, 504, "deadline")

    def _expire_due(self) -> None:
        now = self._clock()
        due = [
            t
            for q in self._queues.values()
            for t in q
            if t.deadline is not None and t.deadline <= now
        ]
        for ticket in due:
            self._take(ticket)
            self._fail(ticket, 504, "deadline")

    def _make_room(self, tenant: str, cost: float) -> None:
        """When full, shed the newest request of the tenant most over its weighted share.

        Shares are compared as queued cost / weight, the newcomer's cost included. If that
        is the newcomer's own tenant (ties included), the newcomer itself is refused.
        """
        if self._n_queued < self._max_queued:
            return
        self._expire_due()
        if self._n_queued < self._max_queued:
            return
        load = {t: sum(k.cost for k in q) / self._weight(t) for t, q in self._queues.items()}
        load[tenant] = load.get(tenant, 0.0) + cost / self._weight(tenant)
        victim = max(load, key=lambda t: (load[t], t == tenant))
        if victim == tenant:
            raise self._count(Shed(429, "queue_full", self._retry_after()))
        newest = self._queues[victim][-1]
        self._take(newest)
        self._fail(newest, 429, "shed_for_fairness")

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def _retry_after(self) -> float:
        """Seconds until the queue ahead has likely drained: queued cost / recent rate;
        with nothing served lately, the requests queued times the model's predicted
        GPU time a request (`service_s`, a handler's ETA) over its permits, if known."""
        now = self._clock()
        self._trim(now)
        queued = sum(k.cost for q in self._queues.values() for k in q)
        served = sum(cost for _, cost in self._recent)
        if served <= 0:  # nothing served lately: no rate to go by, but perhaps an ETA
            if queued == 0:
                return 1.0
            if self.service_s is not None:
                waiting = sum(len(q) for q in self._queues.values())
                eta = waiting * self.service_s / max(1, self._permits)
                return min(max(eta, 1.0), MAX_RETRY_AFTER_S)
            return RATE_WINDOW_S
        rate = served / max(now - self._recent[0][0], 1.0)
        return min(max(queued / rate, 1.0), MAX_RETRY_AFTER_S)
