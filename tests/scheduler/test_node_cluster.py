"""omnid in a cluster beyond membership: it reports its load to the scheduler's telemetry
server (found in etcd at /omni/telemetry, or given with --telemetry) and publishes its
latency row (RTTs to the other nodes) for the latency map."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sqlite3
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import orjson
import pytest

from omni.cluster.state import TELEMETRY, ClusterStore
from omni.runtime.cluster import ClusterMember
from omni.testing.checkpoints import tiny_llama
from scheduler.history import HistoryStore
from scheduler.latency import read_rows
from scheduler.telemetry import TelemetryServer
from tests.conftest import wait_until
from tests.nodes import Omnid

from .etcd import EtcdServer

TTL = 5  # seconds; room for a renewal (every third of it) that comes late on a loaded host
INTERVAL = "0.5"


class Loop:
    """An event loop in a thread, for what the test process serves (telemetry, etcd calls)
    while the test itself waits synchronously."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def telemetry(tmp_path):
    """A scheduler's telemetry server with its history, on a free port."""
    loop = Loop()
    store = HistoryStore(tmp_path / "history.sqlite")
    server = TelemetryServer(store)
    port = loop.run(server.start("127.0.0.1", 0))
    try:
        yield SimpleNamespace(loop=loop, server=server, target=f"127.0.0.1:{port}", path=store.path)
    finally:
        loop.run(server.stop(0))
        store.close()
        loop.close()


def node_totals(path: Path, node: str, model: str) -> dict[str, float]:
    """What the history holds of one node's model, summed over its reports (node_load,
    the per-node rows kept for inspection)."""
    columns = ("requests", "oc", "prompt_tokens", "completion_tokens", "wall_s")
    sums = ", ".join(f"COALESCE(SUM({c}), 0)" for c in columns)
    with contextlib.closing(sqlite3.connect(path)) as db:
        row = db.execute(
            f"SELECT COUNT(*), {sums}, COALESCE(MAX(permits_total), 0) FROM node_load "
            "WHERE node = ? AND model = ?",
            (node, model),
        ).fetchone()
    return dict(zip(("reports", *columns, "permits_total"), row, strict=True))


def complete(base: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": "t1 t2 t3", "max_tokens": 3}
    return httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)


@pytest.mark.serial  # RTTs and lease timing: another test's load on the host moves them
def test_nodes_report_load_and_latency_to_the_cluster(tmp_path, telemetry):
    """Two omnids with --etcd: the one that serves reports its requests and tokens to the
    telemetry server the leader named in etcd (the other reports its idle permits), and
    each publishes its RTT to the other under its lease, gone at once on a clean stop."""
    etcd = EtcdServer(tmp_path / "etcd-data")
    endpoint = f"127.0.0.1:{etcd.port}"
    model = tiny_llama(tmp_path / "tiny")
    config = f'[[models]]\nname = "tiny"\npath = "{model}"\npermits = 2\n'
    store = telemetry.loop.run(_store(endpoint))
    nodes: dict[str, Omnid] = {}
    try:
        for name in ("n1", "n2"):
            (tmp_path / name).mkdir()
            nodes[name] = Omnid(
                tmp_path / name,
                config,
                "--sandbox",
                "process",
                "--etcd",
                endpoint,
                "--node-id",
                name,
                "--lease-ttl",
                str(TTL),
                "--probe-interval",
                INTERVAL,
                "--telemetry-interval",
                INTERVAL,
            )
        for node in nodes.values():
            node.wait_ready(["tiny"])
        # Written once the nodes follow the key: they learn it from their watch, as from
        # a new leader (counted from their start all the same: one accumulator).
        value = {"target": telemetry.target, "leader": "s1"}
        telemetry.loop.run(store.client.put(TELEMETRY, orjson.dumps(value)))

        usages = []
        for origin in ("fra", "fra", None):  # as an edge in fra names itself; one direct
            resp = complete(nodes["n1"].base_url, {"x-omni-origin": origin} if origin else None)
            assert resp.status_code == 200, resp.text
            usages.append(resp.json()["usage"])
        prompt = sum(u["prompt_tokens"] for u in usages)
        completion = sum(u["completion_tokens"] for u in usages)
        assert prompt > 0 and completion == 9

        def reported():
            n1 = node_totals(telemetry.path, "n1", "tiny")
            return n1 if n1["requests"] >= 3 else None

        n1 = wait_until(reported, 20, "n1's requests in the history", interval_s=0.2)
        assert n1["requests"] == 3 and n1["oc"] == 0
        assert (n1["prompt_tokens"], n1["completion_tokens"]) == (prompt, completion)
        assert n1["wall_s"] > 0 and n1["permits_total"] == 2
        with contextlib.closing(sqlite3.connect(telemetry.path)) as db:
            origins = db.execute("SELECT origin, SUM(requests) FROM origin_load GROUP BY origin")
            assert dict(origins.fetchall()) == {"fra": 2}  # where the demand came from
        n2 = node_totals(telemetry.path, "n2", "tiny")  # idle: its permits all the same
        assert n2["reports"] > 0 and n2["requests"] == 0 and n2["permits_total"] == 2

        def rows():
            got = telemetry.loop.run(read_rows(store))
            pairs = got.get("n1", {}).get("n2"), got.get("n2", {}).get("n1")
            return got if all(isinstance(r, float) for r in pairs) else None

        got = wait_until(rows, 20, "both nodes' latency rows", interval_s=0.2)
        for a, b in (("n1", "n2"), ("n2", "n1")):
            assert 0 < got[a][b] < 0.5, got
            assert set(got[a]) == {b}, got  # a node does not probe itself

        for node in nodes.values():
            assert node.stop() == 0
        assert telemetry.loop.run(read_rows(store)) == {}  # at once: revoked, not expired
    finally:
        for node in nodes.values():
            if node.proc.poll() is None:
                node.stop()
        telemetry.loop.run(store.close())
        etcd.stop()


async def _store(endpoint: str) -> ClusterStore:
    host, port = endpoint.rsplit(":", 1)
    return ClusterStore(host, int(port))


def test_telemetry_without_etcd(tmp_path, telemetry):
    """--telemetry HOST:PORT alone: the node reports there, requests and the ones it shed
    (503 while its instance starts, with --ready-wait 0) alike."""
    model = tiny_llama(tmp_path / "tiny")
    config = f'[[models]]\nname = "tiny"\npath = "{model}"\n'
    node = Omnid(
        tmp_path,
        config,
        "--sandbox",
        "process",
        "--node-id",
        "solo",
        "--ready-wait",
        "0",
        "--telemetry",
        telemetry.target,
        "--telemetry-interval",
        INTERVAL,
    )
    try:
        shed, deadline = 0, time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, f"no completion served:\n{node.log()}"
            assert node.proc.poll() is None, node.log()
            try:
                resp = complete(node.base_url)
            except httpx.TransportError:  # not listening yet
                time.sleep(0.2)
                continue
            if resp.status_code == 200:
                break
            assert resp.status_code == 503, resp.text
            shed += 1
            time.sleep(0.2)

        def reported():
            got = node_totals(telemetry.path, "solo", "tiny")
            return got if got["requests"] >= 1 and got["oc"] >= shed else None

        got = wait_until(reported, 20, "solo's request in the history", interval_s=0.2)
        assert got["requests"] == 1 and got["oc"] == shed
        assert got["completion_tokens"] == 3
        assert node.stop() == 0
    finally:
        if node.proc.poll() is None:
            node.stop()


def test_a_new_leader_gets_the_reports(tmp_path):
    """The reporter follows /omni/telemetry: when another scheduler takes over and names
    its own server, the node's figures go there, with the same accumulator."""
    etcd = EtcdServer(tmp_path / "etcd-data")
    endpoint = f"127.0.0.1:{etcd.port}"

    async def main() -> None:
        stores = [HistoryStore(tmp_path / f"history-{i}.sqlite") for i in (0, 1)]
        servers = [TelemetryServer(s) for s in stores]
        targets = [f"127.0.0.1:{await s.start('127.0.0.1', 0)}" for s in servers]
        etcd_store = await _store(endpoint)
        node = SimpleNamespace(instances={}, load=None)
        args = argparse.Namespace(
            etcd=endpoint,
            telemetry=None,
            node_id="n9",
            lease_ttl=TTL,
            probe_interval=0.5,
            telemetry_interval=0.2,
        )
        record = {"id": "n9", "location": "x", "url": "http://127.0.0.1:9", "gpus": []}
        member = ClusterMember(node, args, record, make_entry=None)  # type: ignore[arg-type]

        async def lead(i: int) -> None:
            value = {"target": targets[i], "leader": f"s{i}"}
            await etcd_store.client.put(TELEMETRY, orjson.dumps(value))

        async def requests_at(i: int, want: int) -> None:
            for _ in range(100):
                got = node_totals(stores[i].path, "n9", "m")
                if got["requests"] >= want:
                    assert got["requests"] == want
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"server {i}: {got}")

        try:
            await member.start()
            assert node.load is member.load is not None
            assert "n9" in await etcd_store.nodes()
            await lead(0)
            node.load.record_request("m", wall_s=0.5, prompt_tokens=4, status=200)
            await requests_at(0, 1)
            await lead(1)
            for _ in range(20):
                if member.target == targets[1]:
                    break
                await asyncio.sleep(0.05)
            assert member.target == targets[1]
            node.load.record_request("m", wall_s=0.5, status=200)
            node.load.record_request("m", wall_s=0.0, status=429)
            await requests_at(1, 1)
            got = node_totals(stores[1].path, "n9", "m")
            assert got["oc"] == 1
            assert node_totals(stores[0].path, "n9", "m")["requests"] == 1
        finally:
            await member.stop()
            assert await etcd_store.nodes() == {}  # the announcement revoked
            await etcd_store.close()
            for server, store in zip(servers, stores, strict=True):
                await server.stop(0)
                store.close()

    try:
        asyncio.run(main())
    finally:
        etcd.stop()
