"""The scheduler wired to telemetry, the autoscaler and the latency map, over a real etcd:
the leader tells the nodes where to report (and a standby takes that over), a saturated
model's reports raise its replicas and its placements, the latency map is published,
and `omnictl cluster latency|forecast` show what the leader decided."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import pytest

from omni.cluster.latency import publish_row, read_map
from omni.cluster.reports import IntervalReport, ModelFigures
from omni.cluster.state import TELEMETRY, ClusterStore
from omni.cluster.telemetry import LoadAccumulator, TelemetryReporter
from scheduler.autoscale import AutoscaleConfig
from scheduler.history import HistoryStore
from scheduler.placement import ModelSpec
from scheduler.service import AUTOSCALE, ClusterScheduler, WantedModel
from scheduler.telemetry import TelemetryServer
from tests.conftest import free_port, wait_until

from .etcd import EtcdServer, lease_of
from .omnictl import omnictl

REPO = Path(__file__).resolve().parents[2]
# seconds: the leadership lease, with room for a renewal (every third of it) that comes
# late on a loaded host: at 2 s the leader's lapsed once under make test
TTL = 5
RES = 0.5  # seconds: the history's resolution and the reporters' interval
GPU = {"kind": "H100", "budget_bytes": 8 << 30}


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd-data")
    yield server
    server.stop()


async def until(predicate, timeout_s: float, what: str):
    """Awaits an async predicate until it holds; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := await predicate():
            return result
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def read_json(store: ClusterStore, key: bytes):
    kv = await store.client.get(key)
    return None if kv is None else orjson.loads(kv.value)


def test_the_leader_publishes_its_telemetry_target_and_a_standby_takes_it_over(etcd, tmp_path):
    endpoint = f"127.0.0.1:{etcd.port}"
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str) -> str:
        """A scheduler replica listening for telemetry on a port of its own; its target."""
        port = free_port()
        history = tmp_path / name / "state" / "history.sqlite"
        argv = ["--etcd", endpoint, "--name", name, "--interval", "0.5"]
        argv += ["--lease-ttl", str(TTL), "--history", str(history)]
        argv += ["--telemetry-listen", f"127.0.0.1:{port}"]
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "scheduler", *argv],
            stdout=(tmp_path / f"{name}.log").open("w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        return f"127.0.0.1:{port}"

    def published():
        async def get():
            store = ClusterStore(port=etcd.port)
            try:
                return await read_json(store, TELEMETRY)
            finally:
                await store.close()

        return asyncio.run(get())

    def standing_by(name: str) -> bool:
        log = (tmp_path / f"{name}.log").read_text()
        assert procs[name].poll() is None, log
        return "telemetry at" in log

    try:
        first = spawn("s1")
        wait_until(lambda: published() == {"target": first, "leader": "s1"}, 30, "s1 to lead")
        assert (tmp_path / "s1" / "state" / "history.sqlite").exists()  # its directory made
        second = spawn("s2")
        wait_until(lambda: standing_by("s2"), 30, "s2 to start")
        time.sleep(0.5)  # campaigning
        assert published() == {"target": first, "leader": "s1"}

        assert lease_of(etcd.port, TELEMETRY)[0] == TTL  # so s2 waits one TTL at most
        procs["s1"].send_signal(signal.SIGKILL)  # death: its lease runs out, and the key
        procs["s1"].wait()
        want = {"target": second, "leader": "s2"}
        wait_until(lambda: published() == want, 15 * TTL, "s2 to take over")

        third = spawn("s3")
        wait_until(lambda: standing_by("s3"), 30, "s3 to start")
        time.sleep(0.5)
        procs["s2"].send_signal(signal.SIGTERM)  # a clean stop resigns: no lease to wait for
        assert procs["s2"].wait(timeout=20) == 0
        assert published() != {"target": second, "leader": "s2"}, "s2 left its lease"
        want = {"target": third, "leader": "s3"}
        wait_until(lambda: published() == want, 15 * TTL, "s3 to take over")
        procs["s3"].send_signal(signal.SIGTERM)
        assert procs["s3"].wait(timeout=20) == 0
        assert published() is None  # gone with the last leader's lease
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def register_nodes(store: ClusterStore, n: int) -> None:
    """n nodes of two GPUs each, alternately in fra and ams (no omnid behind them)."""
    for i in range(n):
        node, location = f"n{i + 1}", ("fra", "ams")[i % 2]
        gpus = [{"index": i, **GPU} for i in range(2)]
        record = {"id": node, "location": location, "gpus": gpus}
        await store.register_node({**record, "url": "http://127.0.0.1:9"}, ttl_s=10)


@asynccontextmanager
async def leading(store: ClusterStore, scheduler: ClusterScheduler):
    """The scheduler running (and leading: it is alone) until the block ends."""
    task = asyncio.create_task(scheduler.run())
    try:
        yield scheduler
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await scheduler.election.resign()


class Saturated(LoadAccumulator):
    """A node's accumulator whose model is saturated in every interval taken: busy wall
    time = interval x permits, all permits taken, as many requests refused (429) as
    admitted."""

    def __init__(self, model: str, permits: int):
        # Its first interval starts on the reporters' grid, so that it is a whole one too.
        self.since = math.floor(time.time() / RES) * RES
        super().__init__(clock=lambda: self.since)
        self.model, self.permits = model, permits
        self.set_permits(model, permits, 0, replicas=1)

    def take(self, now: float) -> IntervalReport:
        span, self.since = max(now - self.since, 0.0), now
        for _ in range(5):
            self.record_request(self.model, wall_s=span * self.permits / 5)
            self.record_request(self.model, wall_s=0.0, status=429)
        return super().take(now)


def test_a_saturated_model_gets_more_replicas_placed_and_omnictl_shows_why(etcd, tmp_path):
    endpoint = f"127.0.0.1:{etcd.port}"

    async def main():
        store = ClusterStore(port=etcd.port)
        # Three nodes: a node runs one instance of a model (its key is node/model).
        await register_nodes(store, 3)
        history = HistoryStore(tmp_path / "history.sqlite", resolution_s=RES)
        # An earlier term's history, an hour ago, lightly loaded: the new leader's forecast
        # starts from it.
        hour_ago = (math.floor(time.time() / 300) - 12) * 300
        for k in range(int(600 / RES)):
            light = ModelFigures(
                wall_s=0.05, requests=1, permits_total=2, permits_free=2, replicas=1
            )
            history.add("n1", IntervalReport(hour_ago + k * RES, RES, {"m": light}))
        server = TelemetryServer(history)
        target = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
        model = WantedModel(ModelSpec("m", 1 << 30, replicas=1), "/models/m", 2, max_replicas=4)
        scheduler = ClusterScheduler(
            store,
            "lead",
            [model],
            interval_s=0.25,
            lease_ttl_s=TTL,
            history=history,
            telemetry_target=target,
            autoscale=AutoscaleConfig(),
        )

        async def placed():
            return sorted(
                (k.split("/")[0], p["gpu"])
                for k, p in (await store.placements()).items()
                if k.endswith("/m")
            )

        try:
            async with leading(store, scheduler):
                where = await until(lambda: read_json(store, TELEMETRY), 10, "/omni/telemetry")
                assert where == {"target": target, "leader": "lead"}
                assert len(await until(placed, 10, "m placed")) == 1
                quiet = await until(lambda: read_json(store, AUTOSCALE), 10, "a decision")
                assert quiet["m"]["replicas"] == 1 and quiet["m"]["reason"] == "no-data"
                assert quiet["m"]["predicted"] is not None  # preloaded from the history
                assert (quiet["m"]["min"], quiet["m"]["max"]) == (1, 4)
                view = json.loads(await asyncio.to_thread(omnictl, endpoint, "forecast", "--json"))
                assert view["leader"] == "lead"
                assert [(r["model"], r["replicas"], r["placed"]) for r in view["models"]] == [
                    ("m", 1, 1)
                ]

                # n1 streams the node's reports where etcd says: m is saturated.
                node = Saturated("m", permits=2)
                reporter = TelemetryReporter(
                    node, where["target"], "n1", interval_s=RES, backoff_s=(0.05, 0.2)
                )
                reporting = asyncio.create_task(reporter.run())
                try:
                    # demand: one replica fully busy x (5 + 5 offered) / 5 admitted = 2
                    # replicas' worth; at 70% target, 3 replicas, placed on 3 GPUs.
                    grown = await until(
                        lambda: placed_if(placed, 3), 15, "m's placements to grow to 3"
                    )
                    assert sorted(node for node, _ in grown) == ["n1", "n2", "n3"]
                    decision = (await read_json(store, AUTOSCALE))["m"]
                    assert decision["replicas"] == 3
                    assert decision["demand"] == pytest.approx(2.0)
                    assert reporter.acked > 0 and server.received > 0
                    view = json.loads(
                        await asyncio.to_thread(omnictl, endpoint, "forecast", "--json")
                    )
                    (row,) = view["models"]
                    assert (row["replicas"], row["placed"]) == (3, 3)
                    assert row["reason"] in ("up:capacity", "hold")
                    text = await asyncio.to_thread(omnictl, endpoint, "forecast")
                    assert "leader: lead" in text
                    (line,) = [x for x in text.splitlines() if x.split()[:1] == ["m"]]
                    assert line.split()[1:5] == ["3", "3", "1", "4"]
                    await asyncio.sleep(2 * RES)  # still saturated: it stays at 3
                    assert len(await placed()) == 3
                finally:
                    reporting.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await reporting
        finally:
            await server.stop()
            history.close()
            await store.close()

    asyncio.run(main())


async def placed_if(placed, n: int):
    got = await placed()
    return got if len(got) == n else None


def test_the_leader_publishes_the_latency_map_and_omnictl_shows_it(etcd, tmp_path):
    endpoint = f"127.0.0.1:{etcd.port}"

    async def main():
        store = ClusterStore(port=etcd.port)
        await register_nodes(store, 2)
        await publish_row(store, "n1", {"n2": 0.040})
        await publish_row(store, "n2", {"n1": 0.042, "gone": 0.5})  # a peer since gone
        await publish_row(store, "ghost", {"n1": 0.3})  # a node that is not announced
        scheduler = ClusterScheduler(store, "lead", [], interval_s=0.25, lease_ttl_s=TTL)
        async with leading(store, scheduler):
            latency_map = await until(lambda: read_map(store), 10, "the latency map")
            assert latency_map.rows == {"n1": {"n2": 0.040}, "n2": {"n1": 0.042}}
            rtt = pytest.approx(0.041)
            assert latency_map.matrix() == {"ams": {"fra": rtt}, "fra": {"ams": rtt}}
            await publish_row(store, "n1", {"n2": 0.044})  # the next round has it
            await until(lambda: rtt_is(store, "n1", "n2", 0.044), 10, "the map to follow the rows")
            view = json.loads(await asyncio.to_thread(omnictl, endpoint, "latency", "--json"))
            text = await asyncio.to_thread(omnictl, endpoint, "latency")
        await store.close()
        return view, text

    view, text = asyncio.run(main())
    assert view["matrix_ms"] == {"ams": {"fra": 43.0}, "fra": {"ams": 43.0}}
    assert view["locations"] == {"n1": "fra", "n2": "ams"}
    assert view["rows_ms"] == {"n1": {"n2": 44.0}, "n2": {"n1": 42.0}}
    lines = [line.split() for line in text.splitlines()]
    assert "latency map of 2 nodes" in text
    assert ["ams", "-", "43.00"] in lines and ["fra", "43.00", "-"] in lines
    assert ["n1", "fra", "-", "44.00"] in lines and ["n2", "ams", "42.00", "-"] in lines


async def rtt_is(store: ClusterStore, a: str, b: str, rtt: float) -> bool:
    latency_map = await read_map(store)
    return latency_map is not None and latency_map.rows.get(a, {}).get(b) == rtt


def test_a_model_is_placed_near_where_its_requests_come_from(etcd, tmp_path):
    """Demand through an edge in lon, where the model may not run: the latency map says
    ams is nearest, so the model is placed there; without that demand it packs onto the
    first node, in fra."""

    async def main():
        store = ClusterStore(port=etcd.port)
        for node_id, location in (("n1", "fra"), ("n2", "ams"), ("n3", "lon")):
            record = {"id": node_id, "location": location, "gpus": [{"index": 0, **GPU}]}
            await store.register_node({**record, "url": "http://127.0.0.1:9"}, ttl_s=10)
        await publish_row(store, "n1", {"n2": 0.030, "n3": 0.040})
        await publish_row(store, "n3", {"n2": 0.010, "n1": 0.040})
        history = HistoryStore(tmp_path / "history.sqlite")
        acc = LoadAccumulator()
        for _ in range(30):
            acc.record_request("m", wall_s=0.1, origin="lon")
        acc.record_request("m", wall_s=0.1, origin="fra")
        history.add("n1", acc.take(time.time()))
        assert history.demand_by_origin("m", time.time() - 60) == {"lon": 30, "fra": 1}
        no_lon = frozenset({"lon"})
        models = [WantedModel(ModelSpec("m", 1 << 30, denied_locations=no_lon), "/models/m")]
        placed = {}
        try:
            for name, known in (("no demand", None), ("demand", history)):
                await ClusterScheduler(store, "lead", models, history=known).reconcile()
                (key,) = await store.placements()
                placed[name] = key.split("/")[0]
                await store.remove_placement(*key.split("/"))
        finally:
            history.close()
            await store.close()
        return placed

    assert asyncio.run(main()) == {"no demand": "n1", "demand": "n2"}
