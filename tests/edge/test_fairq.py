"""The edge's admission core: weighted fairness, no starvation, shedding, deadlines, permits."""

from __future__ import annotations

import asyncio
import time

import pytest

from edge.fairq import FairQueue, Permit, Shed


def run(coro, timeout_s: float = 5.0):
    """Run a test coroutine; a hang fails the test instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def settle() -> None:
    """Let woken waiters run (a dispatch resolves a future; its task resumes a step later)."""
    for _ in range(5):
        await asyncio.sleep(0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """Waiters that record the order they got permits in; the test releases permits by hand."""

    def __init__(self, fq: FairQueue) -> None:
        self.fq = fq
        self.order: list[str] = []
        self.held: list[Permit] = []
        self.errors: list[Shed] = []
        self.tasks: list[asyncio.Task] = []

    def submit(self, tenant: str, cost: float = 10.0, actual: float | None = None, **kw):
        async def one() -> None:
            try:
                permit = await self.fq.acquire(tenant, cost, **kw)
            except Shed as e:
                self.errors.append(e)
                raise
            if actual is not None:
                permit.correct_cost(actual)
            self.order.append(tenant)
            self.held.append(permit)

        task = asyncio.create_task(one())
        self.tasks.append(task)
        return task

    async def finish_one(self) -> None:
        """The oldest running request finishes; its permit goes to the next in line."""
        self.held.pop(0).release()
        await settle()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def test_weights_split_dispatched_cost_25_75():
    async def main() -> None:
        fq = FairQueue(permits=2, weights={"a": 1.0, "b": 3.0})
        h = Harness(fq)
        for _ in range(300):
            h.submit("a")
            h.submit("b")
        await settle()
        assert fq.in_use == 2 and fq.queued() == 598
        for _ in range(240):  # both tenants stay backlogged throughout
            await h.finish_one()
        assert fq.queued("a") > 0 and fq.queued("b") > 0
        served = fq.served_cost
        share_b = served["b"] / (served["a"] + served["b"])
        assert abs(share_b - 0.75) < 0.05, served
        await h.close()

    run(main())


def test_light_tenant_is_never_starved_by_two_flooders():
    async def main() -> None:
        fq = FairQueue(permits=1)
        h = Harness(fq)
        for _ in range(200):
            h.submit("flood1")
            h.submit("flood2")
        await settle()
        waits = []
        for step in range(150):
            if step % 10 == 5:
                submitted_at = len(h.order)
                light = h.submit("light")
                await settle()
                while not light.done():
                    await h.finish_one()
                waits.append(h.order.index("light", submitted_at) - submitted_at)
            await h.finish_one()
        assert len(waits) == 15
        assert max(waits) <= 2, waits
        assert fq.queued("flood1") > 0 and fq.queued("flood2") > 0  # still flooding
        await h.close()

    run(main())


def test_idle_tenant_cannot_bank_credit():
    async def main() -> None:
        fq = FairQueue(permits=1)
        h = Harness(fq)
        h.submit("a")  # a is served once, then goes idle
        for _ in range(100):
            h.submit("b")
        await settle()
        for _ in range(60):  # b alone is served for a long while
            await h.finish_one()
        assert h.order.count("a") == 1
        for _ in range(50):  # a comes back flooding
            h.submit("a")
        await settle()
        start = len(h.order)
        for _ in range(30):
            await h.finish_one()
        after = h.order[start:]
        lead = max(after[:i].count("a") - after[:i].count("b") for i in range(1, len(after) + 1))
        assert lead <= 1, after
        assert 13 <= after.count("a") <= 17, after  # and then they share evenly
        await h.close()

    run(main())


def test_full_queue_sheds_the_flooder_not_the_light_tenant():
    async def main() -> None:
        fq = FairQueue(permits=1, max_queued=4)
        h = Harness(fq)
        flood = [h.submit("flood") for _ in range(5)]  # one runs, four fill the queue
        await settle()
        assert fq.in_use == 1 and fq.queued() == 4

        light = h.submit("light")
        await settle()
        assert flood[-1].done()  # the flooder's newest request made room
        with pytest.raises(Shed) as shed:
            flood[-1].result()
        assert (shed.value.status, shed.value.reason) == (429, "shed_for_fairness")
        assert shed.value.retry_after_s >= 1.0
        assert fq.queued("light") == 1 and fq.queued("flood") == 3

        with pytest.raises(Shed) as shed:  # the flooder's newcomer is refused at once
            await fq.acquire("flood", 10.0)
        assert (shed.value.status, shed.value.reason) == (429, "queue_full")
        assert fq.shed_counts == {
            "queue_full": 1,
            "shed_for_fairness": 1,
            "deadline": 0,
            "no_capacity": 0,
        }

        while h.held:  # nothing hangs: everything still queued is served
            await h.finish_one()
        assert light.done() and not light.exception()
        assert all(t.done() for t in flood)
        assert fq.in_use == 0 and fq.queued() == 0

    run(main())


def test_retry_after_is_queued_cost_over_recent_rate():
    async def main() -> None:
        clock = FakeClock()
        fq = FairQueue(permits=1, max_queued=2, clock=clock)
        held = await fq.acquire("a", 10.0)
        for _ in range(9):  # 10 dispatches of cost 10 over 9 s: about 10 cost/s
            clock.now += 1.0
            held.release()
            held = await fq.acquire("a", 10.0)
        waiters = [asyncio.create_task(fq.acquire("a", 30.0)) for _ in range(2)]
        await settle()
        with pytest.raises(Shed) as shed:
            await fq.acquire("a", 30.0)
        assert shed.value.reason == "queue_full"
        assert shed.value.retry_after_s == pytest.approx(60.0 / (100.0 / 9.0))
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert fq.queued() == 0

    run(main())


def test_deadline_rejects_queued_request_promptly_without_leaking():
    async def main() -> None:
        fq = FairQueue(permits=1)
        held = await fq.acquire("a", 10.0)
        doomed = asyncio.create_task(fq.acquire("b", 10.0, deadline=time.monotonic() + 0.05))
        patient = asyncio.create_task(fq.acquire("c", 10.0))
        await settle()
        assert fq.queued() == 2
        began = time.monotonic()
        with pytest.raises(Shed) as shed:
            await doomed
        assert (shed.value.status, shed.value.reason) == (504, "deadline")
        assert time.monotonic() - began < 5  # its deadline, not the 10 s the others wait
        assert fq.queued() == 1 and fq.queued("b") == 0 and fq.in_use == 1
        held.release()
        permit = await patient
        assert permit.tenant == "c" and fq.in_use == 1
        permit.release()
        assert fq.in_use == 0 and fq.shed_counts["deadline"] == 1

    run(main())


def test_expired_request_is_skipped_at_dispatch_not_run():
    async def main() -> None:
        clock = FakeClock()
        fq = FairQueue(permits=1, clock=clock)
        held = await fq.acquire("a", 10.0)
        late = asyncio.create_task(fq.acquire("b", 10.0, deadline=clock.now + 5.0))
        other = asyncio.create_task(fq.acquire("c", 10.0))
        await settle()
        clock.now += 6.0  # the deadline passes before a permit frees up
        held.release()
        with pytest.raises(Shed) as shed:
            await late
        assert shed.value.status == 504
        assert (await other).tenant == "c"
        assert "b" not in fq.served_cost  # no GPU time spent on it
        with pytest.raises(Shed):  # a deadline already past is refused at once
            await fq.acquire("d", 1.0, deadline=clock.now)

    run(main())


def test_release_counts_once_hands_over_at_once_and_cancellation_does_not_leak():
    async def main() -> None:
        fq = FairQueue(permits=1)
        first = await fq.acquire("a", 10.0)
        second = asyncio.create_task(fq.acquire("b", 10.0))
        await settle()
        first.release()  # early release: GPU work done, client still reading
        assert fq.in_use == 1 and fq.queued() == 0  # handed over in the same step
        first.release()  # the response path releases again: counted once
        assert fq.in_use == 1
        await asyncio.sleep(0)
        assert second.done()
        permit = second.result()

        gone = asyncio.create_task(fq.acquire("c", 10.0))  # client leaves while queued
        await settle()
        gone.cancel()
        await settle()
        assert fq.queued() == 0 and fq.in_use == 1

        raced = asyncio.create_task(fq.acquire("d", 10.0))
        await settle()
        permit.release()  # a permit is handed to "d" ...
        raced.cancel()  # ... whose client leaves before seeing it
        await settle()
        assert raced.cancelled()
        assert fq.in_use == 0 and fq.served_cost["d"] == 0.0  # returned and refunded

        with await fq.acquire("e", 1.0):
            assert fq.in_use == 1
        assert fq.in_use == 0
        async with await fq.acquire("e", 1.0):
            assert fq.in_use == 1
        assert fq.in_use == 0

    run(main())


def test_set_permits_grows_and_shrinks_capacity():
    async def main() -> None:
        fq = FairQueue(permits=1)
        h = Harness(fq)
        for _ in range(4):
            h.submit("a")
        await settle()
        assert fq.in_use == 1
        fq.set_permits(3)  # an instance was added
        await settle()
        assert fq.in_use == 3 and len(h.held) == 3
        fq.set_permits(1)  # removed again: running requests finish, no new ones start
        await h.finish_one()
        await h.finish_one()
        assert fq.in_use == 1 and fq.queued() == 1
        await h.finish_one()
        assert fq.in_use == 1 and fq.queued() == 0
        await h.close()

    run(main())


def test_corrected_costs_shift_the_share_to_the_cheaper_tenant():
    async def main() -> None:
        fq = FairQueue(permits=1)
        h = Harness(fq)
        for _ in range(300):
            h.submit("cheap", cost=100.0, actual=25.0)  # estimate 100, real 25
            h.submit("dear", cost=100.0, actual=100.0)
        await settle()
        for _ in range(200):
            await h.finish_one()
        cheap, dear = h.order.count("cheap"), h.order.count("dear")
        assert cheap / (cheap + dear) == pytest.approx(0.8, abs=0.05), (cheap, dear)
        served = fq.served_cost  # the real work done is what ends up even
        assert served["cheap"] == pytest.approx(served["dear"], rel=0.1)
        await h.close()

    run(main())
