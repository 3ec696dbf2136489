"""Node picking (two random choices, session affinity, ejection) and what admission does
when a model's nodes go away."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest

from edge.admission import ANONYMOUS, Admission
from edge.nodes import EJECT_AFTER, Node, NodeSet
from omni.api.errors import ApiError


def node_set(n: int, permits: int = 4, seed: int = 0) -> NodeSet:
    nodes = NodeSet([f"http://n{i}" for i in range(n)], rng=random.Random(seed))
    for node in nodes.nodes:
        node.models = {"m": permits}
    return nodes


def test_two_choices_send_work_to_the_less_loaded_node():
    nodes = node_set(2)
    busy, idle = nodes.nodes
    busy.in_flight["m"] = 3
    picks = Counter(nodes.pick("m").url for _ in range(200))
    assert picks[idle.url] > 170, picks  # 16x cheaper: wins ~94%


def test_two_choices_spread_load_over_nodes_that_differ_by_noise():
    nodes = node_set(4, seed=1)
    for i, node in enumerate(nodes.nodes):
        node.latency_s = 0.001 + i * 1e-5  # loopback jitter must not pick a favourite
    picks = Counter(nodes.pick("m").url for _ in range(400))
    assert len(picks) == 4 and min(picks.values()) > 70, picks  # no hotspot, no herd


def test_a_farther_node_gets_less_work():
    nodes = node_set(2, seed=2)
    near, far = nodes.nodes
    near.latency_s, far.latency_s = 0.001, 0.050
    picks = Counter(nodes.pick("m").url for _ in range(200))
    assert picks[near.url] > 180, picks  # 50x closer: wins ~98%


def test_a_session_keeps_its_node_and_moves_only_when_that_one_is_full_or_down():
    nodes = node_set(5)
    homes = {key: nodes.pick("m", key) for key in ("a", "b", "c", "d")}
    for _ in range(10):
        assert all(nodes.pick("m", key) is node for key, node in homes.items())
    home = homes["a"]
    home.in_flight["m"] = 4  # full
    spill = nodes.pick("m", "a")
    assert spill is not home
    home.in_flight["m"] = 0
    home.ejected_until = time.monotonic() + 60  # down
    assert nodes.pick("m", "a") is spill  # the same next choice: its order is stable
    # removing a node moves only the sessions that lived there (rendezvous hashing)
    others = {k: v for k, v in homes.items() if v is not home}
    assert all(nodes.pick("m", key) is node for key, node in others.items())


def test_consecutive_failures_eject_a_node_with_doubling_backoff():
    nodes = node_set(2)
    bad, good = nodes.nodes
    for _ in range(EJECT_AFTER - 1):
        nodes.failed(bad)
    assert bad.healthy
    nodes.failed(bad)
    assert not bad.healthy and bad.ejections == 1
    first = bad.ejected_until - time.monotonic()
    assert all(nodes.pick("m") is good for _ in range(20))
    assert nodes.models() == {"m": 4}  # its permits are gone from the edge's view
    bad.ejected_until = time.monotonic()  # backoff over, still failing
    for _ in range(EJECT_AFTER):
        nodes.failed(bad)
    assert bad.ejected_until - time.monotonic() > 1.5 * first


def test_a_success_resets_the_failure_count():
    nodes = node_set(1)
    (node,) = nodes.nodes
    for _ in range(EJECT_AFTER - 1):
        nodes.failed(node)
    nodes.started(node, "m")
    nodes.finished(node, "m", ok=True)
    nodes.failed(node)
    assert node.healthy and node.in_flight["m"] == 0


def test_a_model_that_loses_its_nodes_answers_503_or_404_never_a_wait():
    async def main():
        nodes = node_set(1, permits=1)
        admission = Admission(nodes, None)
        admission.resize()
        held = await admission.permit("m", ANONYMOUS, 1.0, None)
        waiter = asyncio.create_task(admission.permit("m", ANONYMOUS, 1.0, None))
        await asyncio.sleep(0.01)
        (node,) = nodes.nodes
        node.models = {}  # unloaded from its only node
        admission.resize()
        with pytest.raises(ApiError) as queued:
            await waiter
        unknown = await admission.permit("m", ANONYMOUS, 1.0, None)
        held.release()
        node.models, node.ejected_until = {"m": 1}, time.monotonic() + 60  # listed, but down
        admission.resize()
        with pytest.raises(ApiError) as down:
            await admission.permit("m", ANONYMOUS, 1.0, None)
        return queued.value, unknown, down.value

    queued, unknown, down = asyncio.run(main())
    assert queued.status == 503 and queued.retry_after
    assert unknown is None  # no node lists it: the node it goes to answers 404
    assert down.status == 503


def test_a_new_node_starts_at_the_latency_maps_round_trip_to_its_location():
    nodes = NodeSet([])
    nodes.rtt_from_here = {"fra": 0.001, "sin": 0.180}
    nodes.set_urls(["http://a", "http://b", "http://c"], {"http://a": "fra", "http://b": "sin"})
    got = {n.url: n.latency_s for n in nodes.nodes}
    assert got["http://a"] == 0.001 and got["http://b"] == 0.180
    assert got["http://c"] == Node("x").latency_s  # no location known: the default
    nodes.nodes[1].latency_s = 0.05  # measured since
    nodes.rtt_from_here = {"sin": 0.3}
    nodes.set_urls(["http://b"], {"http://b": "sin"})
    assert nodes.nodes[0].latency_s == 0.05  # a known node keeps what was measured
