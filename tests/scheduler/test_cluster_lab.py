"""The whole cluster on one machine: etcd, two scheduler replicas, four omnid nodes (CPU
engine) in their own network namespaces grouped into two locations 40 ms apart, and an
edge. The latency map measures the delay; the models are placed within their location
constraints; a killed node's models are placed elsewhere and the edge stops routing to
it within the lease TTL (and a reconcile); a killed leader hands over to the standby."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from omni.cluster.latency import read_map
from omni.cluster.state import ClusterStore
from omni.testing.checkpoints import tiny_llama
from tests.conftest import free_port, wait_until
from tests.nodes import Omnid

from .etcd import EtcdServer
from .netlab import NetLab, unavailable_reason
from .omnictl import omnictl_json

DELAY_MS = 40.0
TTL = 3  # nodes' and schedulers' leases, seconds
INTERVAL = 1.0  # the scheduler's reconcile period
REPO = Path(__file__).resolve().parents[2]


def placed(endpoint: str) -> dict[str, set[str]]:
    """model -> the nodes it is placed on, as etcd holds it."""
    out: dict[str, set[str]] = {}
    for p in omnictl_json(endpoint, "placements")["placements"]:
        out.setdefault(p["model"], set()).add(p["node"])
    return out


def latency_matrix(endpoint: str) -> dict[str, dict[str, float]] | None:
    async def read():
        host, port = endpoint.rsplit(":", 1)
        store = ClusterStore(host, int(port))
        try:
            found = await read_map(store)
            return found.matrix() if found else None
        finally:
            await store.close()

    return asyncio.run(read())


def complete(base: str, model: str) -> int:
    body = {"model": model, "prompt": "t1 t2", "max_tokens": 2}
    try:
        return httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code
    except httpx.TransportError:
        return 0


def edge_nodes(base: str) -> set[str]:
    try:
        nodes = httpx.get(f"{base}/v1/edge/nodes", timeout=5).json()["nodes"]
    except httpx.TransportError:
        return set()
    return {n["url"] for n in nodes}


@pytest.fixture
def lab():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with NetLab({"east": 2, "west": 2}, DELAY_MS, host_location="east") as lab:
        yield lab


def test_a_cluster_across_two_locations(lab, tmp_path):
    etcd = EtcdServer(tmp_path / "etcd-data", also_on=lab.host_ip)
    endpoint = f"{lab.host_ip}:{etcd.port}"
    model = tiny_llama(tmp_path / "tiny")
    (tmp_path / "models.toml").write_text(
        f'[[models]]\nname = "west-only"\npath = "{model}"\nquota = "1GiB"\n'
        'allowed_locations = ["west"]\n'
        f'[[models]]\nname = "everywhere"\npath = "{model}"\nquota = "1GiB"\n'
        "replicas = 2\nspread = 2\n"
    )
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, *argv: str) -> subprocess.Popen:
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdout=(tmp_path / f"{name}.log").open("w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        return procs[name]

    def scheduler(name: str) -> None:
        (tmp_path / name).mkdir()
        spawn(
            name,
            "scheduler",
            "--etcd",
            endpoint,
            "--models",
            str(tmp_path / "models.toml"),
            "--interval",
            str(INTERVAL),
            "--lease-ttl",
            str(TTL),
            "--name",
            name,
            "--telemetry-listen",
            f"{lab.host_ip}:0",
            "--history",
            str(tmp_path / name / "history.sqlite"),
        )

    nodes: dict[str, Omnid] = {}
    edge_port = free_port()
    base = f"http://127.0.0.1:{edge_port}"
    try:
        scheduler("s1")
        leader = lambda: omnictl_json(endpoint, "placements").get("leader")  # noqa: E731
        wait_until(lambda: leader() == "s1", 30, "s1 leads")
        scheduler("s2")  # the standby
        for node in lab.nodes:
            (tmp_path / node.name).mkdir()
            nodes[node.name] = Omnid(
                tmp_path / node.name,
                "",
                "--sandbox",
                "process",
                "--etcd",
                endpoint,
                "--node-id",
                node.name,
                "--location",
                node.location,
                "--lease-ttl",
                str(TTL),
                "--probe-interval",
                "0.5",
                "--telemetry-interval",
                "1",
                netns=node.netns,
                host=node.ip,
            )
        spawn(
            "edge",
            "edge.server",
            "--port",
            str(edge_port),
            "--etcd",
            endpoint,
            "--location",
            "east",
        )
        where = {n.name: n.location for n in lab.nodes}

        # placed within the constraints: west-only in west, everywhere in both locations
        def settled():
            now = placed(endpoint)
            if len(now.get("west-only", ())) == 1 and len(now.get("everywhere", ())) == 2:
                return now
            return None

        first = wait_until(settled, 60, "both models placed")

        def converged() -> bool:  # every placement reported ready by its node
            rows = omnictl_json(endpoint, "placements")["placements"]
            return len(rows) == 3 and all(r["state"] == "ready" for r in rows)

        wait_until(converged, 90, "every node to report its placements ready")
        assert {where[n] for n in first["west-only"]} == {"west"}
        assert {where[n] for n in first["everywhere"]} == {"east", "west"}

        # the latency map: east-west within 20% of the added delay, each location near
        def measured():
            m = latency_matrix(endpoint)
            return m if m and "west" in m.get("east", {}) and "east" in m.get("east", {}) else None

        matrix = wait_until(measured, 30, "the latency map")
        across = matrix["east"]["west"] * 1e3
        assert abs(across - DELAY_MS) <= 0.2 * DELAY_MS, matrix
        assert matrix["east"]["east"] * 1e3 < 0.2 * DELAY_MS, matrix
        assert matrix["west"]["west"] * 1e3 < 0.2 * DELAY_MS, matrix
        view = omnictl_json(endpoint, "latency")
        assert view["matrix_ms"]["east"]["west"] == pytest.approx(across, rel=0.5)

        for name in ("west-only", "everywhere"):
            wait_until(lambda name=name: complete(base, name) == 200, 90, f"{name} served")

        # a node dies: the edge drops it within the TTL (+ a reconcile), its model moves
        (victim,) = first["west-only"]
        dead_url = nodes[victim].base_url
        assert dead_url in edge_nodes(base)
        nodes[victim].proc.send_signal(signal.SIGKILL)
        nodes[victim].proc.wait()
        wait_until(lambda: dead_url not in edge_nodes(base), 15 * TTL, f"{victim} to leave")
        moved = wait_until(
            lambda: (p := placed(endpoint).get("west-only")) and victim not in p and p,
            TTL + INTERVAL + 10,
            "west-only placed elsewhere",
        )
        assert {where[n] for n in moved} == {"west"}  # still within its constraint
        wait_until(lambda: complete(base, "west-only") == 200, 90, "west-only served again")

        # the leader dies: the standby takes over and keeps the cluster converging
        procs["s1"].send_signal(signal.SIGKILL)
        procs["s1"].wait()
        wait_until(lambda: leader() == "s2", 15 * TTL, "s2 leads")
        east = next(n for n in placed(endpoint)["everywhere"] if where[n] == "east")
        nodes[east].proc.send_signal(signal.SIGKILL)
        nodes[east].proc.wait()
        wait_until(
            lambda: (p := placed(endpoint).get("everywhere")) and east not in p and len(p) == 2,
            TTL + INTERVAL + 10,
            "s2 re-placing everywhere",
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for node in nodes.values():
            if node.proc.poll() is None:
                node.stop()
        etcd.stop()
