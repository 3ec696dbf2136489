"""`omnictl undrain` undoes `omnictl drain`: the node takes requests again and the
instances the drain stopped start again; the admin API, `omnictl models`, `instances`
and `node` say what a drain did meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest

from omni.testing.checkpoints import tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("models") / "a")


@pytest.fixture
def node(tmp_path, model):
    config = f'[[models]]\nname = "a"\npath = "{model}"\n[[models]]\nname = "b"\npath = "{model}"\n'
    node = Omnid(tmp_path, config, "--sandbox", "process", env={"OMNI_TORCH_THREADS": "1"})
    node.wait_ready(["a", "b"])
    yield node
    node.stop()


def omnictl(node: Omnid, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "omni.ctl", "--socket", str(node.socket), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def complete(node: Omnid, model: str = "a", max_tokens: int = 2) -> httpx.Response:
    body = {"model": model, "prompt": "t1 t2", "max_tokens": max_tokens}
    return httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=60)


def test_undrain_after_a_drain_serves_again(node):
    assert complete(node).status_code == 200
    assert omnictl(node, "drain").strip() == "draining"
    wait_until(lambda: node.instances() == {}, 60, "the drain to stop the instances")
    refused = complete(node)
    assert refused.status_code == 503, refused.text

    models = json.loads(omnictl(node, "--json", "models"))["models"]
    assert {m["name"]: m["state"] for m in models} == {"a": "drained", "b": "drained"}
    assert "node drained: a, b stopped; `omnictl undrain`" in omnictl(node, "instances")
    status = json.loads(omnictl(node, "--json", "node"))
    assert status["draining"] is True and status["drained"] == ["a", "b"]
    snap = httpx.Client(transport=httpx.HTTPTransport(uds=str(node.socket)))
    board = snap.get("http://omnid/v1/dashboard", timeout=10).json()["node"]
    assert board["draining"] is True and board["drained"] == ["a", "b"]

    assert omnictl(node, "undrain").strip() == "serving; started again: a, b"
    node.wait_ready(["a", "b"])
    for name in ("a", "b"):
        served = complete(node, name)
        assert served.status_code == 200, served.text
    assert httpx.get(f"{node.base_url}/healthz", timeout=10).status_code == 200
    status = json.loads(omnictl(node, "--json", "node"))
    assert status["draining"] is False and status["drained"] == []
    models = json.loads(omnictl(node, "--json", "models"))["models"]
    assert {m["name"]: m["state"] for m in models} == {"a": "ready", "b": "ready"}


def test_undrain_while_requests_are_in_flight_stops_nothing(node):
    """Undone before its requests in flight have finished, a drain has stopped nothing:
    they finish, and the same processes serve again. (Under load the last request may
    finish before the undrain lands: then the drain stops the instances as it should, no
    request is cut, and the scenario is tried again.)"""
    for _ in range(3):
        pids = {name: i["pid"] for name, i in node.instances().items()}
        results, load, listed, refused, undone = drain_and_undrain_under_load(node)
        for t in load:
            t.join(timeout=120)
        assert results == [200] * 8  # none cut, whichever came first
        if undone.json()["started"]:  # they had all finished: the drain was complete
            assert undone.json() == {"draining": False, "started": ["a", "b"]}
            node.wait_ready(["a", "b"])
            continue
        assert listed["draining"] is True and listed["drained"] == []
        assert listed["instances"][0]["in_flight"] > 0  # the undrain came while they ran
        assert {i["state"] for i in listed["instances"]} == {"draining"}  # as the node is
        assert refused.status_code == 503, refused.text
        assert undone.status_code == 200 and undone.json() == {"draining": False, "started": []}
        assert {name: i["pid"] for name, i in node.instances().items()} == pids
        assert complete(node, "b").status_code == 200
        return
    pytest.fail("in three tries every request finished before the undrain landed")


def drain_and_undrain_under_load(node: Omnid):
    """Eight long requests to "a", then drain, list, a request to "b", undrain: (the
    requests' statuses as they end, their threads, the listing, b's answer, the undrain's)."""
    results: list[int] = []

    def one() -> None:
        results.append(complete(node, max_tokens=240).status_code)

    load = [threading.Thread(target=one) for _ in range(8)]
    for t in load:
        t.start()

    def all_admitted() -> bool:
        """All eight admitted (before the drain, or a late one is refused as it should be),
        some still running; under load the first may finish before the last arrives."""
        done = len(results)  # (read first: one finishing between the reads counts once)
        running = node.instances()["a"]["in_flight"]
        return running > 0 and done + running == 8

    wait_until(all_admitted, 60, "all eight requests admitted, some in flight")
    with node.admin() as admin:
        assert admin.post("/v1/node/drain").status_code == 202
        listed = admin.get("/v1/instances").json()
        refused = complete(node, "b")
        undone = admin.post("/v1/node/undrain")
    return results, load, listed, refused, undone
