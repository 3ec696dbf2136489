"""Telemetry over real gRPC on localhost: nodes' load reports reach the scheduler's
history, which survives a scheduler restart and feeds the autoscaler."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Callable

import pytest

from omni.cluster.reports import IntervalReport, ModelFigures
from omni.cluster.telemetry import LoadAccumulator, TelemetryReporter
from scheduler.autoscale import AutoscaleConfig, Autoscaler
from scheduler.history import HistoryStore, demand_buckets, demand_series, telemetry_series
from scheduler.telemetry import TelemetryServer

INTERVAL = 0.2  # the tests' report interval (and history resolution)
SUMMED = (
    "wall_s",
    "queue_s",
    "queued",
    "requests",
    "errors",
    "out_of_capacity",
    "prompt_tokens",
    "completion_tokens",
)


async def until(predicate: Callable[[], object], timeout_s: float, what: str):
    """Polls predicate until it holds; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := predicate():
            return result
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def history_totals(store: HistoryStore) -> dict[str, dict[str, float]]:
    """Per model, the counters summed over all of its stored history (rounded)."""
    out = {}
    for model in store.models():
        sums: Counter = Counter()
        for point in store.series(model, 0, time.time() + 3600):
            for name in SUMMED:
                sums[name] += getattr(point, name)
        out[model] = {name: round(sums[name], 6) for name in SUMMED}
    return out


class Recorder:
    """Records requests into a node's accumulator and the totals the history should reach."""

    def __init__(self):
        self.expected: dict[str, Counter] = {}

    def __call__(self, acc: LoadAccumulator, model: str, **kw) -> None:
        acc.record_request(model, **kw)
        e = self.expected.setdefault(model, Counter({name: 0 for name in SUMMED}))
        status = kw.get("status", 200)
        e["wall_s"] += kw["wall_s"]
        e["queue_s"] += kw.get("queue_s", 0.0)
        e["queued"] += kw.get("queue_s", 0.0) > 0
        e["prompt_tokens"] += kw.get("prompt_tokens", 0)
        e["completion_tokens"] += kw.get("completion_tokens", 0)
        if status in (429, 503):
            e["out_of_capacity"] += 1
        else:
            e["requests"] += 1
            e["errors"] += status >= 400

    def totals(self) -> dict[str, dict[str, float]]:
        return {m: {n: round(c[n], 6) for n in SUMMED} for m, c in self.expected.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reports_reach_the_history_which_survives_a_restart(tmp_path):
    db = tmp_path / "history.db"
    record = Recorder()

    async def main():
        store = HistoryStore(db, resolution_s=INTERVAL)
        server = TelemetryServer(store)
        port = await server.start("127.0.0.1", 0)
        target = f"127.0.0.1:{port}"
        acc_a, acc_b = LoadAccumulator(), LoadAccumulator()
        reporters = [
            TelemetryReporter(acc, target, node, interval_s=INTERVAL, backoff_s=(0.05, 0.2))
            for acc, node in ((acc_a, "node-a"), (acc_b, "node-b"))
        ]
        tasks = [asyncio.create_task(r.run()) for r in reporters]
        try:
            acc_a.set_permits("llm", 4, 3)
            acc_b.set_permits("llm", 4, 1)
            acc_a.set_permits("emb", 8, 8)
            for i in range(10):
                record(acc_a, "llm", wall_s=0.5, queue_s=0.25 * (i % 2), prompt_tokens=10,
                       completion_tokens=20, version="v1")  # fmt: skip
            record(acc_a, "llm", wall_s=0.0, status=429)
            record(acc_b, "llm", wall_s=0.0, queue_s=1.0, status=503)
            record(acc_b, "llm", wall_s=0.25, prompt_tokens=7, status=500, version="v2")
            record(acc_a, "emb", wall_s=0.125, prompt_tokens=5)
            keys = {("node-a", "llm"), ("node-b", "llm"), ("node-a", "emb")}
            # (a report is stored, then remembered as the latest when the store's thread
            # hands back: wait for both, or a check in between sees the history only)
            await until(
                lambda: history_totals(store) == record.totals() and keys <= set(server.latest()),
                5,
                "the first reports",
            )
            want = record.totals()
            assert want["llm"]["out_of_capacity"] == 2 and want["llm"]["errors"] == 1
            assert want["llm"]["requests"] == 11 and want["llm"]["queued"] == 6

            latest = server.latest()
            a_llm, b_llm = latest["node-a", "llm"].figures, latest["node-b", "llm"].figures
            assert (a_llm.permits_total, a_llm.permits_free, a_llm.replicas) == (4, 3, 1)
            assert (b_llm.permits_free, b_llm.version, a_llm.version) == (1, "v2", "v1")

            # Both nodes' gauges add up in a whole interval: 8 permits, 4 free, 2 replicas.
            def whole() -> list:
                points = store.series("llm", 0, time.time() + 60)
                return [p for p in points if p.nodes == pytest.approx(2)]

            p = (await until(whole, 5, "an interval with both nodes whole"))[-1]
            assert (p.permits_total, p.permits_free, p.replicas) == pytest.approx((8, 4, 2))

            # The scheduler goes away; the nodes keep taking their figures meanwhile.
            await server.stop()
            store.close()
            await until(lambda: not any(r.connected for r in reporters), 5, "disconnects")
            record(acc_b, "llm", wall_s=1.0, prompt_tokens=3, completion_tokens=4)
            sent = reporters[1].sent
            await until(lambda: reporters[1].sent > sent + 1, 5, "an interval while down")
            assert reporters[1].pending >= 2

            # A new scheduler process: same file, same port. The history is still there.
            store = HistoryStore(db, resolution_s=INTERVAL)
            assert history_totals(store) == want
            server = TelemetryServer(store)
            assert await server.start("127.0.0.1", port) == port
            await until(lambda: history_totals(store) == record.totals(), 10, "the backlog")
            record(acc_a, "emb", wall_s=0.5, prompt_tokens=1)
            await until(lambda: history_totals(store) == record.totals(), 5, "new reports")
            assert all(r.connects >= 2 and r.dropped == 0 for r in reporters)
            assert record.totals()["llm"]["prompt_tokens"] == 110
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await server.stop()
            store.close()

    asyncio.run(main())


def test_reporter_buffers_a_bounded_backlog_until_the_scheduler_is_up(tmp_path):
    async def main():
        port = free_port()
        acc = LoadAccumulator()
        acc.set_permits("llm", 2, 2)  # a gauge: every interval has a report
        reporter = TelemetryReporter(
            acc, f"127.0.0.1:{port}", "node-a", interval_s=0.05, max_buffered=3,
            backoff_s=(0.05, 0.1),
        )  # fmt: skip
        task = asyncio.create_task(reporter.run())
        store = HistoryStore(tmp_path / "h.db", resolution_s=0.05)
        server = TelemetryServer(store)
        try:
            await until(lambda: reporter.dropped >= 3, 5, "reports dropped while down")
            assert reporter.pending == 3 and not reporter.connected
            lost = reporter.dropped  # certainly never delivered: nothing was listening
            await server.start("127.0.0.1", port)

            def stored_the_backlog() -> bool:
                """All acknowledged, each report stored once: all but the dropped ones (one
                dropped while in flight on the new stream may have made it)."""
                points = store.series("llm", 0, time.time() + 60)
                sent, dropped = reporter.sent, reporter.dropped
                return reporter.pending == 0 and sent - dropped <= len(points) <= sent - lost

            await until(stored_the_backlog, 5, "the kept backlog in the history")
            assert reporter.connected and reporter.connects == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop()
            store.close()

    asyncio.run(main())


def test_accumulator_classifies_and_resets():
    clock = [100.0]
    acc = LoadAccumulator(clock=lambda: clock[0])
    acc.set_permits("llm", 4, 1)
    acc.record_request("llm", wall_s=2.0, queue_s=0.5, prompt_tokens=3, completion_tokens=5)
    acc.record_request("llm", wall_s=0.0, status=429)
    acc.record_request("llm", wall_s=0.0, status=503)
    acc.record_request("llm", wall_s=1.0, status=400, version="r7")
    acc.record_request("llm", wall_s=0.5, status=499, version="r7")  # the client left
    acc.record_request("emb", wall_s=0.1)
    first = acc.take(110.0)
    assert (first.start, first.interval_s) == (100.0, 10.0)
    llm = first.models["llm"]
    assert (llm.requests, llm.errors, llm.out_of_capacity, llm.queued) == (3, 1, 2, 1)
    assert llm.by_version == {"r7": [2, 1]}  # a canary is not blamed for a client leaving
    assert (llm.wall_s, llm.queue_s, llm.prompt_tokens, llm.completion_tokens) == (3.5, 0.5, 3, 5)
    assert (llm.permits_total, llm.permits_free, llm.replicas, llm.version) == (4, 1, 1, "r7")
    second = acc.take(120.0)  # counters restart; the gauge stays; emb had only counters
    assert set(second.models) == {"llm"} and second.start == 110.0
    assert second.models["llm"] == ModelFigures(permits_total=4, permits_free=1, replicas=1,
                                                version="r7")  # fmt: skip
    acc.remove("llm")
    assert acc.take(130.0).models == {}
    # The wire format round-trips.
    msg = first.to_proto("node-a", seq=7)
    assert (msg.node_id, msg.seq) == ("node-a", 7)
    assert IntervalReport.from_proto(msg) == first


def report(start: float, interval_s: float = 10.0, **models: ModelFigures) -> IntervalReport:
    return IntervalReport(start, interval_s, dict(models))


def test_history_store_aggregates_splits_dedups_and_prunes(tmp_path):
    clock = [2000.0]
    path = tmp_path / "h.db"
    store = HistoryStore(path, retention_s=600, node_retention_s=300, clock=lambda: clock[0])
    a = ModelFigures(wall_s=1.5, requests=3, permits_total=4, permits_free=2, replicas=1)
    b = ModelFigures(wall_s=0.5, requests=1, out_of_capacity=2, permits_total=4, replicas=1)
    assert store.add("node-a", report(1800, llm=a, emb=ModelFigures(requests=5))) == 2
    assert store.add("node-b", report(1800, llm=b)) == 1
    assert store.add("node-a", report(1800, llm=a)) == 0  # a resend: ignored
    assert store.add("node-a", report(1810, llm=a)) == 1
    assert store.add("node-b", report(1825, llm=b)) == 1  # unaligned: half in each interval
    assert store.models() == ["emb", "llm"]
    with pytest.raises(ValueError):  # the server acknowledges and drops such a report
        store.add("node-a", report(1820, llm=ModelFigures(wall_s=float("nan"))))

    pts = store.series("llm", 1800, 1840)
    assert [p.t for p in pts] == [1800, 1810, 1820, 1830]
    p0 = pts[0]
    assert (p0.nodes, p0.replicas, p0.permits_total, p0.permits_free) == (2, 2, 8, 2)
    assert (p0.requests, p0.out_of_capacity, p0.wall_s) == (4, 2, 2.0)
    assert (pts[2].nodes, pts[2].requests, pts[2].permits_total) == (0.5, 0.5, 2)
    assert (pts[3].requests, pts[3].out_of_capacity) == (0.5, 1)

    coarse = store.series("llm", 1800, 1840, step=20)  # gauges: means over the intervals
    assert [(p.t, p.intervals) for p in coarse] == [(1800, 2), (1820, 2)]
    assert (coarse[0].requests, coarse[0].permits_total, coarse[0].nodes) == (7, 6, 1.5)
    with pytest.raises(ValueError):
        store.series("llm", 1800, 1840, step=15)
    store.close()

    with pytest.raises(ValueError, match="resolution"):
        HistoryStore(path, resolution_s=5)
    store = HistoryStore(path, retention_s=600, node_retention_s=300, clock=lambda: clock[0])
    assert len(store.series("llm", 0, 3000)) == 4  # reopened: all there
    clock[0] = 2395.0  # node rows past 300 s go, interval rows past 600 s stay
    assert store.add("node-a", report(2000, llm=a)) == 0  # too old to tell from a resend
    store.prune()
    assert store.add("node-a", report(1800, llm=a)) == 0
    assert len(store.series("llm", 0, 3000)) == 4
    clock[0] = 2425.0
    store.prune()
    assert [p.t for p in store.series("llm", 0, 3000)] == [1820, 1830]
    store.close()


def test_history_feeds_the_autoscaler(tmp_path):
    """Two nodes, 4 permits each, three 5-minute phases of known demand (in replicas):
    half the permits busy (1.0); saturated with half the requests refused (4.0); every
    permit busy for the whole interval by wall time, permits shown free (2.0)."""
    t0 = 1_704_067_200  # a Monday, on a 5-minute boundary
    store = HistoryStore(tmp_path / "h.db", clock=lambda: t0 + 3600)
    saturated = dict(wall_s=40.0, requests=10, out_of_capacity=10, queue_s=4.0)
    phases = [
        ModelFigures(wall_s=10.0, requests=10, permits_total=4, permits_free=2, replicas=1),
        ModelFigures(**saturated, permits_total=4, permits_free=0, replicas=1),
        ModelFigures(wall_s=40.0, requests=10, permits_total=4, permits_free=4, replicas=1),
    ]
    for i in range(90):
        if i == 40:
            continue  # a lost interval: no report from either node
        for node in ("node-a", "node-b"):
            store.add(node, report(t0 + 10 * i, llm=phases[i // 30]))

    reports = telemetry_series(store, "llm", t0, t0 + 900)
    assert len(reports) == 89
    first = reports[0]
    assert (first.t, first.interval_s, first.replicas, first.permits_total) == (t0 + 10, 10, 2, 8)
    assert first.busy_s == pytest.approx(5.0)  # 20 s of wall time over 4 permits x 2 nodes
    assert first.utilization(2.0) == pytest.approx(0.5)
    assert reports[30].queue_s == pytest.approx(8.0 / 40)  # per request offered
    assert (reports[30].oc_errors, reports[30].requests, reports[30].tokens) == (20, 20, 0)

    demand = demand_series(store, "llm", t0, t0 + 900)
    assert [t for t, _ in demand[:2]] == [t0, t0 + 10]
    assert [d for _, d in demand] == pytest.approx([1.0] * 30 + [4.0] * 29 + [2.0] * 30)
    buckets = demand_buckets(store, "llm", t0, t0 + 900)
    assert buckets == [(t0, 1.0), (t0 + 300, 4.0), (t0 + 600, 2.0)]
    assert demand_buckets(store, "llm", t0, t0 + 899)[-1][0] == t0 + 300  # no partial bucket

    scaler = Autoscaler(AutoscaleConfig(), clock=lambda: t0 + 900)
    scaler.preload(buckets)
    assert scaler.forecaster is not None and scaler.forecaster.observed == 3
    for r in reports[-6:]:  # the last minute, fed as live reports
        scaler.observe(r)
    decision = scaler.decide()
    assert decision.demand == pytest.approx(2.0)
    assert decision.replicas >= 3 and decision.reason.startswith("up:")  # 2.0 / 0.7 -> 3
    store.close()
