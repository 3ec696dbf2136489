"""Nodes announce themselves in a real etcd; an edge that follows etcd routes to them and
stops routing to one within its lease TTL after it dies (at once when it stops cleanly)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from omni.testing.checkpoints import tiny_llama
from tests.conftest import free_port, wait_until
from tests.nodes import Omnid

from .etcd import EtcdServer, lease_of
from .omnictl import omnictl_json

TTL = 5  # seconds; room for a renewal (every third of it) that comes late on a loaded host


@pytest.fixture
def cluster(tmp_path):
    etcd = EtcdServer(tmp_path / "etcd-data")
    model = tiny_llama(tmp_path / "tiny")
    config = f'[[models]]\nname = "tiny"\npath = "{model}"\npermits = 2\n'
    endpoint = f"127.0.0.1:{etcd.port}"
    nodes = []
    for name in ("n1", "n2"):
        (tmp_path / name).mkdir()
        nodes.append(
            Omnid(
                tmp_path / name,
                config,
                "--sandbox",
                "process",
                "--etcd",
                endpoint,
                "--node-id",
                name,
                "--location",
                "fra",
                "--lease-ttl",
                str(TTL),
            )
        )
    port = free_port()
    edge = subprocess.Popen(
        [sys.executable, "-m", "edge.server", "--port", str(port), "--etcd", endpoint],
        stdout=(tmp_path / "edge.log").open("w"),
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[2],
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for node in nodes:
            node.wait_ready(["tiny"])
        yield base, nodes, etcd
    finally:
        edge.terminate()
        edge.wait(timeout=20)
        for node in nodes:
            if node.proc.poll() is None:
                node.stop()
        etcd.stop()


def edge_nodes(base: str) -> list[str]:
    try:
        return sorted(
            n["url"] for n in httpx.get(f"{base}/v1/edge/nodes", timeout=5).json()["nodes"]
        )
    except httpx.TransportError:
        return []


def complete(base: str) -> int:
    body = {"model": "tiny", "prompt": "t1 t2", "max_tokens": 2}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code


def test_the_edge_follows_the_nodes_announced_in_etcd(cluster):
    base, (n1, n2), etcd = cluster
    both = sorted([n1.base_url, n2.base_url])
    wait_until(lambda: edge_nodes(base) == both, 20, "the edge to see both nodes")
    wait_until(lambda: complete(base) == 200, 30, "a completion through the edge")

    assert lease_of(etcd.port, b"/omni/nodes/n1")[0] == TTL  # gone one TTL after a crash
    n1.proc.send_signal(signal.SIGKILL)  # a crash: its lease runs out
    n1.proc.wait()
    wait_until(lambda: edge_nodes(base) == [n2.base_url], 15 * TTL, "n1 to leave the edge")
    assert [complete(base) for _ in range(4)] == [200] * 4

    n2.proc.send_signal(signal.SIGTERM)  # a clean stop: its lease is revoked at once
    n2.proc.wait(timeout=30)
    assert lease_of(etcd.port, b"/omni/nodes/n2") is None, "a clean stop left its lease"
    wait_until(lambda: edge_nodes(base) == [], 15 * TTL, "n2 to leave the edge")
    assert complete(base) == 503


def test_the_scheduler_places_a_model_and_replaces_it_when_its_node_dies(tmp_path):
    """etcd + a scheduler + two omnids with no models of their own + an edge: the model
    runs where the scheduler puts it, and after that node's SIGKILL, on the other one."""
    etcd = EtcdServer(tmp_path / "etcd-data")
    endpoint = f"127.0.0.1:{etcd.port}"
    model = tiny_llama(tmp_path / "tiny")
    (tmp_path / "models.toml").write_text(
        f'[[models]]\nname = "tiny"\npath = "{model}"\nquota = "1GiB"\nreplicas = 1\n'
    )
    repo = Path(__file__).resolve().parents[2]
    procs: list[subprocess.Popen] = []

    def spawn(name: str, *argv: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdout=(tmp_path / f"{name}.log").open("w"),
            stderr=subprocess.STDOUT,
            cwd=repo,
        )
        procs.append(proc)
        return proc

    nodes = {}
    for name in ("n1", "n2"):
        (tmp_path / name).mkdir()
        nodes[name] = Omnid(
            tmp_path / name,
            "",
            "--sandbox",
            "process",
            "--etcd",
            endpoint,
            "--node-id",
            name,
            "--lease-ttl",
            str(TTL),
        )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    spawn("edge", "edge.server", "--port", str(port), "--etcd", endpoint)
    spawn(
        "scheduler",
        "scheduler",
        "--etcd",
        endpoint,
        "--models",
        str(tmp_path / "models.toml"),
        "--interval",
        "1",
        "--lease-ttl",
        str(TTL),
        "--name",
        "s1",
    )

    def running() -> list[str]:
        return [
            n for n, node in nodes.items() if node.proc.poll() is None and "tiny" in node.models()
        ]

    try:
        first = wait_until(running, 30, "the scheduler to place tiny")
        assert len(first) == 1
        view = omnictl_json(endpoint, "placements")
        assert view["leader"] == "s1"
        assert [(p["model"], p["node"], p["alive"]) for p in view["placements"]] == [
            ("tiny", first[0], True)
        ]
        listed = omnictl_json(endpoint, "nodes")["nodes"]
        assert sorted(n["id"] for n in listed) == ["n1", "n2"]
        wait_until(lambda: complete(base) == 200, 60, "tiny served through the edge")
        home = nodes[first[0]]
        home.proc.send_signal(signal.SIGKILL)
        home.proc.wait()
        other = next(n for n in nodes if n != first[0])
        wait_until(lambda: running() == [other], 30, "tiny placed on the other node")
        wait_until(lambda: complete(base) == 200, 60, "tiny served again")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=20)
        for node in nodes.values():
            if node.proc.poll() is None:
                node.stop()
        etcd.stop()
