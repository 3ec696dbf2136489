"""Which instances hold GPU memory: a budget per GPU, demand-aware swap-out, one shared swap-in.

Every GPU instance has a quota (the shim enforces it). While its memory is on the GPU
or moving, it is charged what it holds there: its quota while it loads, then the most
it has held since its last swap-in (the shim's high-water mark of that window) and a
margin, never more than its quota. A quota is a cap set with room to spare (a detector
given 2.5 GiB may hold 0.2; an LLM's KV pool is backed only as far as its requests use
it); charged whole, that spare room stayed empty while other models waited for room.
The instances resident on a GPU hold no more than its budget (growth past a charge is
charged when the request that grew ends, and idle instances make room), though their
quotas together may exceed it many times. Like the quota, the use is the shim's word,
and the shim runs inside the instance. A request for a swapped-out instance waits
(boundedly) while the pool swaps out idle instances and swaps the wanted one in;
concurrent requests for the same cold instance share one swap-in.

Before a swap-out the instance is asked to free what it holds unused (its allocator's
cache, before_swap_out, bounded by TRIM_TIMEOUT_S): that memory is then not moved.

Swaps overlap where the link allows: one swap-in and one swap-out of a GPU at a time
(PCIe is full duplex: a swap-out no longer holds up an unrelated swap-in), each
moving with the pool's lock let go, so requests and the other direction's swaps go
on. Swap-ins go in by priority: the hot set's first (the hotter the sooner), the
others in the order they were asked for.

The victim is the idle instance whose absence costs least: its recent demand
(requests decayed with a half-life) times the seconds its swap-in takes (measured,
or its charge at the GPU's measured rate), per byte it frees; ties to the least
recently used. Plain LRU would evict the busiest model between two of its requests
whenever a cold one arrives; demand alone would evict a large model as readily as a
small one of equal demand, for more swap time. The hottest instances that fit the
budget with the largest charge to spare are never evicted for a colder one: cold models
take turns in the room left, and the hot ones never wait for a swap.

A large cold model needs many idle instances at once, and smaller ones arriving later
took each piece of room as it came free. So a cold swap-in that has wanted room for
HEAD_AFTER_S becomes the head: later cold swap-ins neither evict nor take the room it
still needs, and the resident cold instances hold their new requests (up to
DRAIN_MAX_S) until it is in. Strict turns from the first moment cost the small models
more than the large ones gained (a simulation of bench/catalog_bench.py's catalog). The
head's room may still be lent (backfilled): a cold model whose swap-in, request and
swap-out should be over before the head's victims have drained takes it meanwhile, so
short requests for small models do not wait behind a large one that cannot go in yet.

While an instance serves, the colder instances of its GPU hold back their steps
(gpuyield.py), so the hot models do not share the GPU's time slices either. A swap
that fails or times out marks the instance unhealthy (its supervisor restarts it);
the waiting requests get 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from omni.api.errors import ApiError, unavailable
from omni.cudashim import ControlBlock, SwapError, SwapResult, swap_in, swap_out
from omni.cudashim.control import ShimResidency

from .gpuyield import YieldFlag

log = logging.getLogger(__name__)

SWAP_HISTORY = 100  # recent swaps kept per instance for the admin API
DEMAND_HALF_LIFE_S = 30.0  # how fast a model's past requests stop protecting it
# An instance outside the hot set that has served nothing for this long goes out on its
# own, while the GPU is free and only if a colder arrival would need its room: the next
# cold request then waits for its own swap-in only, not for a swap-out first (on the
# H100 a 2.5 GiB quota went out in 140-270 ms and came in in 70 ms while its KV pool was
# copied; released instead, p50 39 and 36 ms: overcommit-h100-s0.json).
EVICT_IDLE_S = 0.2
# What a swap-in costs before one is measured on this GPU: the H100 moved 30-45 ms a GiB
# (overcommit-h100-s1.json); each measured swap-in then moves the GPU's own rate.
DEFAULT_SWAP_S_PER_BYTE = 0.04 / (1 << 30)
RATE_WEIGHT = 0.2  # how much each swap-in moves a measured rate (a moving average)
# A cold swap-in that has wanted room this long goes first (the module's docstring). In
# the simulation: 0.3 s, cold p50 0.4-0.55 s and p99 1.3-1.6 s; 0.6 s, 0.18-0.6 / 1.45-1.8;
# 1.0 s, 0.13 / 1.8-2.0; never, 0.13 / 2.5-4.
HEAD_AFTER_S = 0.5
DRAIN_MAX_S = 0.5  # longest a cold instance's new request waits while the head wants room
# Longest a swap-out waits for the instance to free its unused memory (before_swap_out):
# freeing a cache takes milliseconds, and the answer is the instance's word.
TRIM_TIMEOUT_S = 0.25
# charged beyond an instance's use, for growth before the request that grows ends
CHARGE_MARGIN_MIN = 64 << 20
CHARGE_MARGIN_SHARE = 1 / 16  # of the use


class Residency(enum.StrEnum):
    STOPPED = "stopped"  # no process: charged nothing
    STARTING = "starting"  # loading its weights: charged
    RESIDENT = "resident"  # on the GPU: charged
    MOVING = "moving"  # being swapped (either way): charged
    SWAPPED = "swapped"  # in host memory: charged nothing


CHARGED = {Residency.STARTING, Residency.RESIDENT, Residency.MOVING}


SWAP_PRIORITY: contextvars.ContextVar[float] = contextvars.ContextVar("swap_priority", default=0.0)


class PriorityLock:
    """An asyncio lock whose waiters get it by priority (the calling task's
    SWAP_PRIORITY, highest first; FIFO among equals): a hot model that was swapped
    out goes back in before a queue of cold ones. Duck-types asyncio.Lock, so an
    asyncio.Condition can wait on it.

    The lock is granted one loop tick after it is free, so that tasks woken
    together (a Condition's notify_all) have all queued before it picks one.
    """

    def __init__(self):
        self._locked = False
        self._granting = False
        self._waiters: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()

    def locked(self) -> bool:
        return self._locked

    async def acquire(self) -> bool:
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (-SWAP_PRIORITY.get(), next(self._order), fut))
        self._grant_soon()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted just as we were cancelled
                self.release()
            raise
        return True

    def release(self) -> None:
        self._locked = False
        self._grant_soon()

    def _grant_soon(self) -> None:
        if not self._locked and not self._granting and self._waiters:
            self._granting = True
            asyncio.get_running_loop().call_soon(self._grant)

    def _grant(self) -> None:
        self._granting = False
        while not self._locked and self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():  # skip waiters that gave up
                self._locked = True
                fut.set_result(True)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self.release()


@dataclass(frozen=True)
class SwapRecord:
    direction: str  # "in" | "out"
    seconds: float  # as the shim measured it
    bytes: int
    at: float  # unix time

    def to_json(self) -> dict:
        return {
            "direction": self.direction,
            "seconds": round(self.seconds, 6),
            "bytes": self.bytes,
            "at": self.at,
        }


SwapObserver = Callable[[str, str, SwapResult], None]  # (instance, direction, result)


@dataclass(eq=False)
class PoolMember:
    """One instance's standing on its GPU."""

    name: str
    quota_bytes: int
    on_failure: Callable[[str], None]  # restart the instance, with the reason
    block: ControlBlock | None = None
    yield_flag: YieldFlag | None = None  # raised while a hotter instance of its GPU serves
    state: Residency = Residency.STOPPED
    in_flight: int = 0
    waiting: int = 0  # requests waiting for its swap-in: once in, it is theirs, not a victim
    last_used: float = 0.0  # monotonic
    last_used_unix: float | None = None
    swaps_in: int = 0
    swaps_out: int = 0
    history: deque[SwapRecord] = field(default_factory=lambda: deque(maxlen=SWAP_HISTORY))
    demand: float = 0.0  # requests, decayed to `demand_at`
    demand_at: float = 0.0
    after_swap_out: Callable[[], None] | None = None  # a multi-GPU instance's other ranks
    # asks the idle process to free what it holds unused (its allocator's cache) first
    before_swap_out: Callable[[], Awaitable[None]] | None = None
    trim_timed_out: bool = False  # this process let an ask time out: not asked again
    swap_in_s: float | None = None  # its swap-ins' moving average, once one is measured
    hold_s: float | None = None  # how long a request holds it: its GPU phase and what follows
    busy_since: float = 0.0  # monotonic: when its requests in flight last went from none
    charge: int = -1  # bytes charged while on the GPU or moving (-1: its quota)
    _swap_in: asyncio.Task | None = None
    _moving: asyncio.Task | None = None  # its memory's move under way

    def __post_init__(self) -> None:
        if self.charge < 0:
            self.charge = self.quota_bytes

    def measure(self) -> None:
        """Charge the most it has held since its last swap-in, and a margin (its quota
        caps it); the quota until a shim has reported a use. Kept through a swap-out: the
        next swap-in is charged what this window held (an LLM's KV pool is released at a
        swap-out and grows back as its requests take blocks)."""
        used = self.block.window_peak_bytes if self.block is not None else None
        if used is None or used <= 0:
            self.charge = self.quota_bytes
            return
        margin = max(CHARGE_MARGIN_MIN, int(used * CHARGE_MARGIN_SHARE))
        self.charge = min(self.quota_bytes, used + margin)

    def demand_now(self, now: float) -> float:
        return self.demand * 0.5 ** ((now - self.demand_at) / DEMAND_HALF_LIFE_S)

    def requested(self) -> None:
        now = time.monotonic()
        self.demand, self.demand_at = self.demand_now(now) + 1.0, now

    def to_json(self) -> dict:
        stats = self.block.stats() if self.block is not None else {}
        return {
            "residency": str(self.state),
            "quota_bytes": self.quota_bytes,
            "charged_bytes": self.charge if self.state in CHARGED else 0,
            "used_bytes": stats.get("used_bytes", 0),
            "peak_bytes": stats.get("peak_bytes", 0),
            "swaps_in": self.swaps_in,
            "swaps_out": self.swaps_out,
            "in_flight": self.in_flight,
            "request_hold_s": None if self.hold_s is None else round(self.hold_s, 4),
            "last_used": self.last_used_unix,
            "swap_history": [r.to_json() for r in self.history],
        }


class GpuPool:
    """The instances of one GPU and its memory budget."""

    def __init__(
        self,
        index: int,
        budget_bytes: int,
        swap_timeout_s: float = 30.0,
        max_waiting: int = 256,
        observer: SwapObserver | None = None,
        yield_max_s: float = 0.0,
        evict_idle_s: float = EVICT_IDLE_S,
    ):
        self.index = index
        self.evict_idle_s = evict_idle_s  # 0: instances go out only to make room
        self.yield_max_s = yield_max_s  # 0: instances never yield to hotter ones
        self.budget_bytes = budget_bytes
        self.swap_timeout_s = swap_timeout_s
        self.max_waiting = max_waiting
        self.observer = observer
        self.members: dict[str, PoolMember] = {}
        self.waiting = 0
        self._cond = asyncio.Condition(PriorityLock())  # guards states and the charge
        self._lanes = {"in": PriorityLock(), "out": PriorityLock()}  # one move each way
        self._notifies: set[asyncio.Task] = set()
        self.swap_s_per_byte = DEFAULT_SWAP_S_PER_BYTE  # this GPU's swap-in rate, measured
        # room an instance's swap-outs freed for it, held until it is charged: with the lock
        # let go during moves, another waiter would take it (and a hot one wait again)
        self._claims: dict[PoolMember, int] = {}
        # swap-ins that want room, with when they began to: the oldest cold one (the head)
        # is the only cold one that evicts, and the room it still needs is kept for it, so
        # a large model is not passed again and again by smaller ones taking each piece
        self._room_wanted: dict[PoolMember, float] = {}

    # ------------------------------------------------------------- accounting

    @property
    def charged_bytes(self) -> int:
        return sum(t.charge for t in self.members.values() if t.state in CHARGED)

    def add(self, member: PoolMember) -> None:
        if member.quota_bytes > self.budget_bytes:
            raise ValueError(
                f"quota of {member.name} ({member.quota_bytes} bytes) exceeds the budget "
                f"of GPU {self.index} ({self.budget_bytes} bytes)"
            )
        self.members[member.name] = member

    async def remove(self, name: str) -> None:
        async with self._cond:
            self.members.pop(name, None)
            self._cond.notify_all()

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "budget_bytes": self.budget_bytes,
            "charged_bytes": self.charged_bytes,
            "resident": sorted(n for n, t in self.members.items() if t.state in CHARGED),
            "waiting": self.waiting,
        }

    # --------------------------------------------------- instance lifecycle

    async def starting(self, member: PoolMember, block: ControlBlock) -> None:
        """A new process is about to load its weights: make room for its quota first."""
        async with self._cond:
            await self._make_room(member, deadline=None)
            member.block = block
            member.charge = member.quota_bytes  # until it has loaded, anything up to it
            member.state = Residency.STARTING
            member._swap_in = None
            member.trim_timed_out = False  # a new process: asked again
            self._cond.notify_all()

    async def adopted(self, member: PoolMember, block: ControlBlock) -> None:
        """A running process an earlier omnid left (live restore): resident or swapped
        out as its shim says, making no room (its memory is where it already is)."""
        async with self._cond:
            member.block = block
            member.measure()
            out = block.residency is ShimResidency.HOST
            member.state = Residency.SWAPPED if out else Residency.RESIDENT
            member.last_used = time.monotonic()
            member._swap_in = None
            self._update_yields()
            self._cond.notify_all()

    async def ready(self, member: PoolMember, cold: bool) -> None:
        """Loaded: resident now, or swapped out at once when it was asked to start cold."""
        async with self._cond:
            member.state = Residency.RESIDENT
            member.last_used = time.monotonic()
            member.measure()
            self._cond.notify_all()
            if cold:
                await self._swap(member, "out")

    async def stopped(self, member: PoolMember) -> None:
        """The process is gone, and its memory with it (its control block is closed once
        a move under way, which still uses it, has ended)."""
        if member._moving is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(member._moving)
        async with self._cond:
            member.state = Residency.STOPPED
            if member.block is not None:
                member.block.close()
                member.block = None
            if member.yield_flag is not None:
                member.yield_flag.close()
                member.yield_flag = None
            self._update_yields()
            self._cond.notify_all()

    # -------------------------------------------------------------- requests

    @contextlib.asynccontextmanager
    async def use(self, member: PoolMember, deadline: float) -> AsyncIterator[None]:
        """Hold `member` resident for one request (swapping it in if needed)."""
        member.requested()
        if member.state is Residency.RESIDENT and self._room_wanted:
            await self._let_room_drain(member, deadline)  # (returns at once if not a victim)
        if member.state is not Residency.RESIDENT:
            await self._bring_in(member, deadline)
        started = time.monotonic()
        if not member.in_flight:
            member.busy_since = started
        member.in_flight += 1
        member.last_used, member.last_used_unix = started, time.time()
        self._update_yields()
        try:
            yield
        finally:
            member.in_flight -= 1
            member.last_used, member.last_used_unix = time.monotonic(), time.time()
            member.hold_s = moving_average(member.hold_s, member.last_used - started)
            self._update_yields()
            if member.state is Residency.RESIDENT:
                member.measure()
            if member.in_flight == 0:
                self._notify_soon()
                self._evict_when_idle(member)
            if self.charged_bytes > self.budget_bytes:
                self._shed_soon()

    async def _let_room_drain(self, member: PoolMember, deadline: float) -> None:
        """A resident instance the head will evict takes no new request until the head is
        in (up to DRAIN_MAX_S): otherwise its steady trickle of requests keeps it busy, and
        a large cold model waits for every such instance to be idle at once. The others
        serve on."""
        until = min(deadline, time.monotonic() + DRAIN_MAX_S)
        while member in self._head_victims(time.monotonic()):
            left = until - time.monotonic()
            if left <= 0 or member.state is not Residency.RESIDENT:
                return
            async with self._cond:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._cond.wait(), min(left, 0.05))

    def _update_yields(self) -> None:
        """While one of the hot set serves, every colder instance yields its steps: the
        hot models never share the GPU's time slices with a cold one. The instances that
        yield with work to do share one step per `yield_max_s` between them (each may
        wait that times their number), so their steps cannot crowd the hot one however
        many they are. Cold instances never yield to one another: a chain of priorities
        among models that each take a swap to serve would stall all of them."""
        now = time.monotonic()
        hot = self._hot_set(now)
        serving = [t.demand_now(now) for t in hot if t.in_flight and t.state is Residency.RESIDENT]
        hottest = max(serving, default=-math.inf)
        flagged = {t for t in self.members.values() if t.demand_now(now) < hottest}
        waiting = sum(1 for t in flagged if t.in_flight)
        max_defer = self.yield_max_s * max(1, waiting)
        for t in self.members.values():
            if t.yield_flag is not None:
                t.yield_flag.set(t in flagged, max_defer)

    def _notify_soon(self) -> None:
        """Wake the requests waiting for an idle instance, from a task of its own and
        ahead of queued swaps: the request that went idle returns now, instead of
        after every swap that holds or waits for this GPU's lock."""

        async def notify() -> None:
            SWAP_PRIORITY.set(math.inf)  # this task's own context
            async with self._cond:
                self._cond.notify_all()

        task = asyncio.create_task(notify())
        self._notifies.add(task)
        task.add_done_callback(self._notifies.discard)

    def _evict_when_idle(self, member: PoolMember) -> None:
        """Swap `member` out `evict_idle_s` from now if it is still idle then, outside the
        hot set, and its room is needed by a colder arrival (see EVICT_IDLE_S); its swap
        takes the lock after every waiting swap-in."""
        if self.evict_idle_s <= 0:
            return
        used_at = member.last_used

        async def evict() -> None:
            await asyncio.sleep(self.evict_idle_s)
            SWAP_PRIORITY.set(-math.inf)  # this task's own context
            async with self._cond:
                if member.state is not Residency.RESIDENT or member.in_flight + member.waiting:
                    return
                if member.last_used != used_at or member in self._hot_set(time.monotonic()):
                    return
                if self._room_for_any():
                    return
                with contextlib.suppress(ApiError):  # a failed swap restarts it
                    await self._swap(member, "out")

        task = asyncio.create_task(evict())
        self._notifies.add(task)
        task.add_done_callback(self._notifies.discard)

    def _shed_soon(self) -> None:
        """An instance grew past its charge and the GPU's past its budget: swap idle
        instances out (the least costly first) until it is within again, or none is idle."""

        async def shed() -> None:
            SWAP_PRIORITY.set(-math.inf)  # after every waiting swap-in: they free room too
            async with self._cond:
                while self.charged_bytes > self.budget_bytes:
                    now = time.monotonic()
                    hot = self._hot_set(now)
                    idle = [t for t in self.members.values() if t not in hot and self._idle(t)]
                    if not idle:
                        return
                    victim = min(idle, key=lambda t: (self._keep_value(t, now), t.last_used))
                    with contextlib.suppress(ApiError):  # a failed swap restarts it
                        await self._swap(victim, "out")

        task = asyncio.create_task(shed())
        self._notifies.add(task)
        task.add_done_callback(self._notifies.discard)

    def _room_for_any(self) -> bool:
        """Whether any instance that is out fits the budget without a swap-out."""
        out = [t.charge for t in self.members.values() if t.state is Residency.SWAPPED]
        taken = self.charged_bytes + sum(self._claims.values())
        return taken + max(out, default=0) <= self.budget_bytes

    def _claimed_by_others(self, member: PoolMember) -> int:
        return sum(self._claims.values()) - self._claims.get(member, 0)

    def _fits(self, member: PoolMember) -> bool:
        """Whether `member` fits the budget beside what is charged and claimed by others,
        and (a cold one) beside the room the head still needs."""
        taken = self.charged_bytes + self._claimed_by_others(member)
        now = time.monotonic()
        head = self._head(now)
        kept = head not in (None, member) and member not in self._hot_set(now)
        if kept and not self._backfills(member, head, now):
            taken += max(0, head.charge - self._claims.get(head, 0))
        return taken + member.charge <= self.budget_bytes

    def _backfills(self, member: PoolMember, head: PoolMember, now: float) -> bool:
        """Whether cold `member` may take room kept for the head: only if its swap-in, a
        request and its swap-out should be over before the head's room could be free
        anyway (its victims still serving). While a large model waits for a busy one to
        drain, the small ones are served in the room it cannot use yet, instead of all
        waiting behind it (the H100 catalog bench: 16 requests waited with 1.2 GiB free)."""
        if member.hold_s is None:
            return False  # nothing measured: it could hold the room for long
        victims = self._head_victims(now) - {member}
        head_waits = max((self._idle_in(t, now) for t in victims), default=0.0)
        if math.isinf(head_waits):  # a victim's first request: as long as a drain may last
            head_waits = DRAIN_MAX_S
        return 2 * self._swap_cost_s(member) + member.hold_s <= head_waits

    def _head(self, now: float) -> PoolMember | None:
        """The cold swap-in that has wanted room longest."""
        hot = self._hot_set(now)
        cold = [(at, t.name, t) for t, at in self._room_wanted.items() if t not in hot]
        at, _, head = min(cold, default=(math.inf, None, None))
        return head if now - at >= HEAD_AFTER_S else None

    async def _bring_in(self, member: PoolMember, deadline: float) -> None:
        if self.waiting >= self.max_waiting:
            raise unavailable(f"GPU {self.index} has too many requests waiting for a swap.", 1.0)
        self.waiting += 1
        member.waiting += 1
        try:
            while member.state is not Residency.RESIDENT:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise unavailable(f"Model '{member.name}' could not be swapped in in time.", 2)
                if member.state is Residency.SWAPPED:
                    if member._swap_in is None or member._swap_in.done():
                        member._swap_in = asyncio.create_task(self._swap_in_task(member))
                    # shielded: a request that gives up does not cancel the others' swap-in
                    await asyncio.wait_for(asyncio.shield(member._swap_in), left)
                else:  # starting, moving out, or restarting: wait for its next state
                    async with self._cond:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(
                                self._cond.wait_for(lambda: member.state is Residency.RESIDENT),
                                min(left, 0.5),
                            )
        except TimeoutError:
            message = f"Model '{member.name}' could not be swapped in in time."
            raise unavailable(message, 2) from None
        finally:
            self.waiting -= 1
            member.waiting -= 1

    async def _swap_in_task(self, member: PoolMember) -> None:
        # (this task's own context) a hot-set instance's swap-in goes first, the hotter
        # the sooner; the others in the order they were asked for. Ordered by demand, the
        # least wanted of them starved while the others kept coming: one waited 27 s on
        # an H100 run of bench/overcommit_bench.py.
        # (Priorities, not the lock's arrival order: a swap-in that waits for room waits on
        # the condition and queues for the lock again, behind later arrivals.)
        now = time.monotonic()
        hot = member in self._hot_set(now)
        SWAP_PRIORITY.set(member.demand_now(now) if hot else -now)
        async with self._cond:
            if member.state is not Residency.SWAPPED:
                return  # restarted or removed meanwhile
            await self._make_room(member, deadline=None)
            await self._swap(member, "in")

    # ----------------------------------------------------------------- admin

    async def force(self, member: PoolMember, direction: str) -> None:
        """Swap out (if idle) or in, now."""
        async with self._cond:
            if direction == "out":
                if member.state is not Residency.RESIDENT:
                    raise ApiError(409, f"Model '{member.name}' is {member.state}, not resident.")
                if member.in_flight:
                    raise ApiError(409, f"Model '{member.name}' has requests in flight.")
                await self._swap(member, "out")
            else:
                if member.state is not Residency.SWAPPED:
                    raise ApiError(409, f"Model '{member.name}' is {member.state}, not swapped.")
                await self._make_room(member, deadline=time.monotonic() + self.swap_timeout_s)
                await self._swap(member, "in")

    async def release(self, member: PoolMember) -> None:
        """Swap `member` out if it is resident and idle (a multi-GPU instance whose other
        rank went out); nothing otherwise."""
        async with self._cond:
            if member.state is Residency.RESIDENT and member.in_flight == 0:
                with contextlib.suppress(ApiError):  # a failed swap restarts it
                    await self._swap(member, "out")

    # -------------------------------------------------------------- internals

    def _hot_set(self, now: float) -> set[PoolMember]:
        """The most wanted instances that fit the budget with room for the largest quota
        left over: a colder instance never evicts one of these, so the hot models stay on
        the GPU and the cold ones take turns in the room that is left."""
        room = self.budget_bytes - max((t.charge for t in self.members.values()), default=0)
        hot: set[PoolMember] = set()
        for t in sorted(self.members.values(), key=lambda t: -t.demand_now(now)):
            if t.demand_now(now) <= 0 or t.charge > room:
                break
            room -= t.charge
            hot.add(t)
        return hot

    def _head_victims(self, now: float) -> set[PoolMember]:
        """The resident instances the head will send out for the room it still needs: the
        idle ones, then those whose requests should end soonest (by how long a request
        holds each: its GPU phase and what follows), the least costly to lose first among
        equals; they drain. None without a head."""
        head = self._head(now)
        if head is None:
            return set()
        free = self.budget_bytes - self.charged_bytes - self._claimed_by_others(head)
        need = head.charge - free
        hot = self._hot_set(now)
        spared = {t for t in hot if t.demand_now(now) > head.demand_now(now)}
        candidates = [
            t
            for t in self.members.values()
            if t.state is Residency.RESIDENT and t is not head and t not in spared
        ]
        victims: set[PoolMember] = set()

        def soonest(t: PoolMember) -> tuple:
            return self._idle_in(t, now), self._keep_value(t, now), t.last_used

        for t in sorted(candidates, key=soonest):
            if need <= 0:
                break
            victims.add(t)
            need -= t.charge
        return victims

    def _pick_victim(self, member: PoolMember, now: float) -> PoolMember | None:
        """The idle resident instance least costly to lose (_keep_value) that `member` may
        evict; None to wait for one (a colder instance is busy, starting or moving, or room
        is claimed, and room will come free)."""
        others = [t for t in self.members.values() if t is not member]
        idle = [t for t in others if self._idle(t)]
        if not idle:
            return None
        hot, wanted = self._hot_set(now), member.demand_now(now)
        if member not in hot and self._head(now) not in (member, None):
            return None  # the head cold swap-in takes the room that frees first
        spared = {t for t in hot if t.demand_now(now) > wanted}
        allowed = [t for t in idle if t not in spared]
        # room another request claimed will be charged, then freed, like any cold one's
        claimed = any(n for t, n in self._claims.items() if t is not member)
        charged = any(t.state in CHARGED and t not in spared for t in others)
        if not allowed and not claimed and not charged:
            allowed = idle  # nothing else will ever free room: the hot one has to go
        return min(allowed, key=lambda t: (self._keep_value(t, now), t.last_used), default=None)

    @staticmethod
    def _idle_in(member: PoolMember, now: float) -> float:
        """Seconds until its requests in flight should have ended: 0 idle, inf before its
        first request has ended (nothing measured)."""
        if not member.in_flight:
            return 0.0
        if member.hold_s is None:
            return math.inf
        return max(0.0, member.hold_s - (now - member.busy_since))

    @staticmethod
    def _idle(member: PoolMember) -> bool:
        """Resident with no request in flight or waiting for it: it may go out."""
        return member.state is Residency.RESIDENT and not member.in_flight + member.waiting

    def _swap_cost_s(self, member: PoolMember) -> float:
        """How long its swap-in takes: measured, or its charge at the GPU's measured rate."""
        if member.swap_in_s is not None:
            return member.swap_in_s
        return member.charge * self.swap_s_per_byte

    def _keep_value(self, member: PoolMember, now: float) -> float:
        """The swap time its residency saves, per second and per byte of quota it holds."""
        return member.demand_now(now) * self._swap_cost_s(member) / max(member.charge, 1)

    async def _make_room(self, member: PoolMember, deadline: float | None) -> None:
        """With the lock held: swap out idle instances until `member` fits the budget,
        waiting (lock released) while none may go. The caller charges `member` at once
        (no await between): the room claimed for it is then its own."""
        try:
            while not self._fits(member):
                self._room_wanted.setdefault(member, time.monotonic())
                victim = self._pick_victim(member, time.monotonic())
                if victim is not None:
                    with contextlib.suppress(ApiError):  # a failed victim restarts: charged 0
                        await self._swap(victim, "out", claimant=member)
                    continue
                # none may go: waiting, it claims nothing (two waiters each holding room
                # the other needs would wait for ever; the head's need is kept free by _fits)
                self._claims.pop(member, None)
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    raise unavailable(f"GPU {self.index} has no idle instance to swap out.", 2)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._cond.wait(), 1.0 if timeout is None else timeout)
        finally:
            self._claims.pop(member, None)
            self._room_wanted.pop(member, None)

    async def _swap(
        self, member: PoolMember, direction: str, claimant: PoolMember | None = None
    ) -> None:
        """With the lock held: move `member`'s memory; a failure restarts the instance.
        The lock is let go while the memory moves (the instance stays charged, MOVING),
        and held again on return, as Condition.wait does. A swap-out made for `claimant`
        leaves it the room freed."""
        block = member.block
        if block is None:
            raise unavailable(f"Model '{member.name}' is restarting.", 2)
        member.state = Residency.MOVING
        move = asyncio.create_task(self._move(member, block, direction, claimant))
        move.add_done_callback(lambda task: task.cancelled() or task.exception())
        member._moving = move
        self._cond.release()
        try:
            await asyncio.shield(move)  # a caller that gives up leaves the move to finish
        finally:
            await self._hold_again()

    async def _hold_again(self) -> None:
        """Take the lock back, even through a cancellation (raised once it is held)."""
        cancelled = None
        while True:
            try:
                await self._cond.acquire()
                break
            except asyncio.CancelledError as exc:
                cancelled = exc
        if cancelled is not None:
            raise cancelled

    async def _move(
        self, member: PoolMember, block: ControlBlock, direction: str, claimant: PoolMember | None
    ) -> None:
        """(Its own task, in the caller's priority.) Wait for the direction's lane, move,
        and record the new state under the lock, ahead of every waiter: it frees room."""
        move = swap_in if direction == "in" else swap_out
        if direction == "out":
            await self._trim(member)
        try:
            async with self._lanes[direction]:
                result = await asyncio.to_thread(move, block, self.swap_timeout_s)
        except (SwapError, OSError) as exc:
            SWAP_PRIORITY.set(math.inf)
            async with self._cond:
                log.error("swap %s of %s failed: %s; restarting it", direction, member.name, exc)
                member._moving = None
                member.state = Residency.STOPPED  # charged nothing once the process is killed
                member.on_failure(f"swap-{direction} failed: {exc}")
                self._cond.notify_all()
            message = f"Model '{member.name}' failed to swap and is restarting."
            raise unavailable(message, 5) from None
        SWAP_PRIORITY.set(math.inf)
        async with self._cond:
            member._moving = None
            self._moved(member, direction, result)
            if claimant is not None and direction == "out":
                self._claims[claimant] = self._claims.get(claimant, 0) + member.charge
            self._cond.notify_all()

    @staticmethod
    async def _trim(member: PoolMember) -> None:
        """Before its memory moves out, let the idle instance free what it holds but does
        not use (a handler's allocator cache: a detector's batches leave a GiB of it): what
        is freed is neither copied out nor back in. Waited for TRIM_TIMEOUT_S at most; a
        process that lets it pass is not asked again (a hostile one would otherwise slow
        every swap-out made for its neighbours), and a failure costs only the saving."""
        if member.before_swap_out is None or member.trim_timed_out:
            return
        try:
            await asyncio.wait_for(member.before_swap_out(), TRIM_TIMEOUT_S)
        except TimeoutError:
            member.trim_timed_out = True
            log.warning("%s did not trim in %.2f s: not asked again", member.name, TRIM_TIMEOUT_S)
        except Exception as exc:
            log.debug("%s did not trim before its swap-out: %r", member.name, exc)

    def _moved(self, member: PoolMember, direction: str, result: SwapResult) -> None:
        """With the lock held: a move is done; its state, counters and measured cost."""
        member.state = Residency.RESIDENT if direction == "in" else Residency.SWAPPED
        if direction == "in":
            member.swaps_in += 1
            member.last_used = time.monotonic()  # its waiters are about to use it: not a victim
            member.swap_in_s = moving_average(member.swap_in_s, result.seconds)
            if result.bytes > 0:
                rate = result.seconds / result.bytes
                self.swap_s_per_byte = moving_average(self.swap_s_per_byte, rate)
        else:
            member.swaps_out += 1
            if member.after_swap_out is not None:
                member.after_swap_out()
        member.history.append(SwapRecord(direction, result.seconds, result.bytes, time.time()))
        if self.observer:
            self.observer(member.name, direction, result)
        log.info(
            "swapped %s %s: %.1f MiB in %.1f ms",
            direction,
            member.name,
            result.bytes / (1 << 20),
            result.seconds * 1e3,
        )


def moving_average(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + RATE_WEIGHT * (sample - mean)
