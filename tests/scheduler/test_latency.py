"""The latency map: aggregation by location, probes over a real network with a real
delay between locations (tests/scheduler/netlab.py), rows and map through a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import pytest

from omni.cluster.latency import (
    LatencyMap,
    Prober,
    peers_from_nodes,
    publish_row,
    read_map,
    tcp_rtt,
)
from omni.cluster.state import ClusterStore
from scheduler.latency import build_map, publish_map, read_rows

from . import netlab
from .etcd import EtcdServer

REPO = Path(__file__).resolve().parents[2]
MS = 1e-3

# ------------------------------------------------------------------ LatencyMap


def four_nodes() -> LatencyMap:
    rows = {
        "a1": {"a2": 1 * MS, "b1": 40 * MS, "b2": 42 * MS},
        "a2": {"a1": 3 * MS, "b1": 44 * MS, "b2": None},  # b2 did not answer a2
        "b1": {"a1": 41 * MS, "a2": 43 * MS, "b2": 2 * MS},
        "b2": {"a1": 45 * MS, "a2": 46 * MS, "b1": 4 * MS},
    }
    return LatencyMap(rows, {"a1": "east", "a2": "east", "b1": "west", "b2": "west"})


def test_the_matrix_is_the_median_of_every_measurement_between_two_locations():
    m = four_nodes().matrix()
    assert m["east"]["east"] == pytest.approx(2 * MS)  # a1->a2 1, a2->a1 3
    assert m["west"]["west"] == pytest.approx(3 * MS)
    # both directions count, the unanswered probe does not: 40 42 44 41 43 45 46
    assert m["east"]["west"] == m["west"]["east"] == pytest.approx(43 * MS)


def test_node_rtt_averages_both_directions_and_knows_when_neither_answered():
    lm = four_nodes()
    assert lm.node_rtt("a1", "b1") == pytest.approx(40.5 * MS)
    assert lm.node_rtt("a2", "b2") == pytest.approx(46 * MS)  # only b2 -> a2 answered
    assert lm.node_rtt("a1", "a1") == 0.0
    assert lm.node_rtt("a1", "nowhere") is None
    assert lm.location_rtt("east", "west") == pytest.approx(43 * MS)
    assert lm.location_rtt("east", "mars") is None


def test_a_node_without_a_location_counts_as_default_and_a_lone_node_has_no_diagonal():
    lm = LatencyMap({"x": {"y": 5 * MS}, "y": {"x": 7 * MS}}, {"x": "east"})
    assert lm.matrix() == {"east": {"default": 6 * MS}, "default": {"east": 6 * MS}}


def test_the_map_round_trips_through_json():
    lm = four_nodes()
    back = LatencyMap.from_json(lm.to_json())
    assert back.rows == lm.rows
    assert back.matrix() == lm.matrix()
    assert back.at == lm.at
    published = json.loads(lm.to_json())  # readers in other languages take the matrix as is
    assert published["matrix"]["east"]["west"] == pytest.approx(43 * MS)
    assert published["locations"]["b2"] == "west"


def test_peers_come_from_the_node_records_urls():
    records = {
        "n1": {"url": "http://10.0.0.1:8081"},
        "n2": {"url": "http://[fd00::2]:9000"},
        "n3": {"url": "https://n3.example"},
        "n4": {},
    }
    assert peers_from_nodes(records, exclude="n1") == {
        "n2": ("fd00::2", 9000),
        "n3": ("n3.example", 443),
    }


# ----------------------------------------------------------------- probes


@contextlib.asynccontextmanager
async def listeners(count: int):
    """`count` TCP listeners on loopback: their ports."""
    servers = [
        await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0) for _ in range(count)
    ]
    try:
        yield [s.sockets[0].getsockname()[1] for s in servers]
    finally:
        for s in servers:
            s.close()
            await s.wait_closed()


def test_tcp_rtt_times_a_handshake_and_gives_none_for_a_closed_port():
    async def main():
        async with listeners(1) as (port,):
            rtt = await tcp_rtt("127.0.0.1", port, samples=3)
        t0 = time.monotonic()
        closed = await tcp_rtt("127.0.0.1", port, samples=5)  # refused: no retries
        return rtt, closed, time.monotonic() - t0

    rtt, closed, took = asyncio.run(main())
    assert rtt is not None and 0 < rtt < 0.05
    assert closed is None and took < 0.5


def test_a_prober_skips_itself_follows_its_peers_and_survives_a_failed_publish():
    peers = {}
    published = []

    async def publish(row):
        published.append(dict(row))
        if len(published) == 1:
            raise ConnectionError("etcd away")

    async def main():
        async with listeners(3) as ports:
            peers.update({"me": ("127.0.0.1", ports[0]), "p1": ("127.0.0.1", ports[1])})
            prober = Prober("me", lambda: peers, interval_s=0.05, samples=2, publish=publish)
            task = asyncio.create_task(prober.run())
            while len(published) < 2:
                await asyncio.sleep(0.01)
            peers["p2"] = ("127.0.0.1", ports[2])
            while "p2" not in published[-1]:
                await asyncio.sleep(0.01)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return prober.row

    row = asyncio.run(main())
    assert set(published[0]) == {"p1"}
    assert set(row) == {"p1", "p2"} and all(0 < v < 0.05 for v in row.values())


# ----------------------------------------------------------------- the lab

DELAY_MS = 40
PORT = 9000
LISTENER = (
    "import socket\n"
    f"s = socket.create_server(('0.0.0.0', {PORT}), backlog=64)\n"
    "print('listening', flush=True)\n"
    "while True:\n"
    "    s.accept()[0].close()\n"
)


@pytest.fixture(scope="module")
def lab_ok():
    reason = netlab.unavailable_reason()
    if reason:
        pytest.skip(reason)


def host_links() -> set[str]:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return {link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}


def lab_namespaces(lab: netlab.NetLab) -> list[str]:
    from pyroute2 import netns

    return [n for n in netns.listnetns() if n.startswith(lab.prefix)]


def probe_all(lab: netlab.NetLab) -> dict[str, dict[str, float | None]]:
    """Each node's row, measured from inside its namespace by the CLI."""
    for ready in [
        lab.popen_in(n, [sys.executable, "-c", LISTENER], stdout=-1, text=True) for n in lab.nodes
    ]:
        assert ready.stdout.readline().strip() == "listening"
    rows = {}
    for node in lab.nodes:  # one at a time: on a small host, parallel ones would skew each other
        probe = lab.run_in(
            node,
            [sys.executable, "-m", "omni.cluster.latency", "probe", "--samples", "5"]
            + [f"--peer={p.name}={p.ip}:{PORT}" for p in lab.nodes if p != node],
            cwd=REPO,
            timeout=30,
        )
        assert probe.returncode == 0, probe.stderr
        rows[node.name] = json.loads(probe.stdout)
    return rows


@pytest.mark.parametrize("mechanism", ["auto", "relay"])
def test_probes_across_the_lab_see_the_delay_between_locations_and_only_there(lab_ok, mechanism):
    if mechanism == "relay" and not netlab.netem_available():
        pytest.skip("no sch_netem here: the 'auto' case already ran on the relay")
    links_before = host_links()
    with netlab.NetLab({"east": 2, "west": 2}, delay_ms=DELAY_MS, mechanism=mechanism) as lab:
        assert lab.uses_netem == (lab.mechanism == "netem")
        assert lab.mechanism in ("netem", "relay")
        assert sorted(lab_namespaces(lab)) == sorted(lab.namespaces())
        rows = probe_all(lab)
        relay = lab.relay
    print(f"mechanism {lab.mechanism}; rows (ms):")
    for name, row in rows.items():
        print(f"  {name}: " + ", ".join(f"{p} {v * 1e3:.2f}" for p, v in row.items()))

    where = {n.name: n.location for n in lab.nodes}
    for a, row in rows.items():
        assert set(row) == set(where) - {a}
        for b, rtt in row.items():
            assert rtt is not None, f"{a} -> {b} unreachable"
            if where[a] == where[b]:
                assert rtt < 5 * MS, f"{a} -> {b} in one location: {rtt * 1e3:.2f} ms"
            else:
                # the delay is seen; a busy 2-core host may add to it, never take from it
                assert 0.8 * DELAY_MS * MS <= rtt <= 2 * DELAY_MS * MS, (
                    f"{a} -> {b} across locations: {rtt * 1e3:.2f} ms, not {DELAY_MS} ms"
                )
    lm = LatencyMap(rows, where)
    assert 0.8 * DELAY_MS * MS <= lm.matrix()["east"]["west"] <= 2 * DELAY_MS * MS

    # torn down: no namespace, no link on the host, no relay
    assert lab_namespaces(lab) == []
    assert host_links() - links_before == set()
    assert relay is None or relay.poll() is not None


def test_the_lab_is_removed_after_a_failure_inside_and_during_its_construction(lab_ok, monkeypatch):
    with pytest.raises(RuntimeError, match="inside"), netlab.NetLab({"a": 1, "b": 1}, 10) as lab:
        lab.popen_in(lab.nodes[0], [sys.executable, "-c", "import time; time.sleep(60)"])
        raise RuntimeError("inside")
    assert lab_namespaces(lab) == []

    def broken(self, wan):
        raise OSError("delay link failed")

    monkeypatch.setattr(netlab.NetLab, "_join", broken)
    lab = netlab.NetLab({"a": 1, "b": 1}, 10)
    with pytest.raises(OSError, match="delay link failed"), lab:
        pass
    assert lab_namespaces(lab) == []


# ------------------------------------------------------------------ etcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    yield server
    server.stop()


def test_rows_published_by_probers_make_the_map_the_scheduler_publishes(etcd):
    locations = {"e1": "east", "e2": "east", "w1": "west", "w2": "west"}

    async def main():
        async with listeners(len(locations)) as ports:
            stores = {n: ClusterStore(port=etcd.port) for n in locations}
            leases = {}
            for (node, location), port in zip(locations.items(), ports, strict=True):
                record = {"id": node, "location": location, "url": f"http://127.0.0.1:{port}"}
                leases[node] = await stores[node].register_node(record, ttl_s=10)
            records = await stores["e1"].nodes()
            for node, store in stores.items():
                publish = functools.partial(publish_row, store, node, lease=leases[node])
                prober = Prober(node, peers_from_nodes(records), samples=2, publish=publish)
                await publish(await prober.probe_once())

            scheduler = ClusterStore(port=etcd.port)
            rows = await read_rows(scheduler)
            latency_map = await build_map(scheduler)
            await publish_map(scheduler, latency_map)
            published = await read_map(scheduler)

            await leases["w2"].revoke()  # a node that goes takes its row along
            after = await read_rows(scheduler)
            remap = await build_map(scheduler)
            for store in [*stores.values(), scheduler]:
                await store.close()
            return rows, latency_map, published, after, remap

    rows, latency_map, published, after, remap = asyncio.run(main())
    assert set(rows) == set(locations)
    for node, row in rows.items():
        assert set(row) == set(locations) - {node}
        assert all(v is not None and 0 < v < 0.05 for v in row.values())
    assert latency_map.locations == locations
    matrix = latency_map.matrix()
    assert set(matrix) == {"east", "west"} and set(matrix["east"]) == {"east", "west"}
    assert matrix["east"]["west"] == statistics.median(
        rows[a][b] for a in rows for b in rows[a] if locations[a] != locations[b]
    )
    assert published is not None
    assert published.rows == rows and published.matrix() == matrix
    assert set(after) == set(locations) - {"w2"}
    # and leaves the next map, also as a peer in the rows of the others, which still name it
    assert all("w2" in after[n] for n in after)
    assert set(remap.rows) == {"e1", "e2", "w1"}
    assert all("w2" not in row for row in remap.rows.values())
    assert "w2" not in remap.locations
