"""Token-aware routing: prefill by queued prompt tokens, decode by KV occupancy, sessions
kept on the node that holds their KV, and the load each node reports in /v1/models."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
from aiohttp import web

from edge.nodes import KV_HIGH_WATER, Node, NodeSet
from edge.server import estimate_prompt_tokens

from .test_nodes import node_set


def test_a_long_prompt_avoids_the_node_with_a_deep_prefill_queue():
    nodes = node_set(2, permits=8)
    busy, idle = nodes.nodes
    busy.load["m"] = (200_000, 0.3)
    idle.load["m"] = (0, 0.3)
    picks = Counter(nodes.pick("m", prompt_tokens=8_000).url for _ in range(400))
    assert picks[idle.url] > 360, picks  # ~26x cheaper: wins ~96%


def test_a_node_with_its_kv_cache_nearly_full_loses():
    nodes = node_set(2, permits=8, seed=1)
    full, roomy = nodes.nodes
    full.load["m"], roomy.load["m"] = (0, 0.97), (0, 0.2)
    picks = Counter(nodes.pick("m", prompt_tokens=500).url for _ in range(400))
    assert picks[roomy.url] > 360, picks  # 0.8 of the cache free against 0.03: ~96%


def test_the_edges_own_prompt_tokens_in_flight_count_before_the_next_poll():
    nodes = node_set(2, permits=8, seed=2)
    loaded, alike = nodes.nodes
    nodes.started(loaded, "m", prompt_tokens=50_000)
    picks = Counter(nodes.pick("m", prompt_tokens=1_000).url for _ in range(400))
    assert picks[alike.url] > 360, picks
    nodes.finished(loaded, "m", ok=True, prompt_tokens=50_000)
    assert loaded.queued_tokens("m") == 0 and loaded.in_flight["m"] == 0
    picks = Counter(nodes.pick("m", prompt_tokens=1_000).url for _ in range(400))
    assert min(picks.values()) > 150, picks  # alike again: about even


def test_a_session_stays_on_its_kv_node_until_that_cache_is_past_the_high_water_mark():
    nodes = node_set(4, permits=8, seed=3)
    home = nodes.pick("m", "chat-1", prompt_tokens=2_000)
    for node in nodes.nodes:  # moderate load everywhere, the home node the busiest
        node.load["m"] = (5_000, 0.6)
    home.load["m"] = (40_000, 0.9)
    home.in_flight["m"] = 5
    assert all(nodes.pick("m", "chat-1", prompt_tokens=2_000) is home for _ in range(20))
    home.load["m"] = (40_000, KV_HIGH_WATER + 0.01)
    away = nodes.pick("m", "chat-1", prompt_tokens=2_000)
    assert away is not home
    assert nodes.pick("m", "chat-1") is away  # the next of its order, every time
    home.load["m"] = (40_000, 0.5)
    assert nodes.pick("m", "chat-1") is home
    assert nodes.decisions["affinity_fallback"] == 2


def test_the_prompt_estimate_reads_any_body_shape():
    assert estimate_prompt_tokens({"model": "m", "prompt": "x" * 400}) == 100
    chat = {"messages": [{"role": "user", "content": "y" * 80}, "junk", {"content": None}]}
    assert estimate_prompt_tokens(chat) == 20  # the contents only
    parts = {"messages": [{"content": [{"type": "text", "text": "z" * 40}]}]}
    assert estimate_prompt_tokens(parts) == 11  # a part's type is counted too, a little
    for odd in ({}, {"prompt": 7}, {"prompt": None, "messages": "no"}, {"input": [[1, 2]]}):
        assert estimate_prompt_tokens(odd) >= 0


def models_app(entries: list[dict]) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": entries})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app


def poll(entries: list[dict], node: Node | None = None) -> Node:
    """`node` (a fresh one if none) after one poll of a node answering `entries`."""

    async def main() -> Node:
        runner = web.AppRunner(models_app(entries), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        nodes = NodeSet([f"http://{host}:{port}"])
        if node is not None:
            node.url, nodes.nodes = nodes.nodes[0].url, [node]
        try:
            async with aiohttp.ClientSession() as session:
                await nodes.refresh(session)
        finally:
            await runner.cleanup()
        return nodes.nodes[0]

    return asyncio.run(main())


def test_a_poll_reads_each_models_load_and_zeros_for_a_node_that_sends_none():
    node = poll(
        [
            {"id": "a", "permits": 4, "load": {"queued_prompt_tokens": 1200, "kv_occupancy": 0.4}},
            {"id": "b", "permits": 2},  # an older omnid
            {"id": "c", "load": {"queued_prompt_tokens": "lots", "kv_occupancy": 7}},
            {"id": "d", "load": {"queued_prompt_tokens": -5, "kv_occupancy": True}},
            {"id": "e", "load": [1, 2]},
        ]
    )
    assert node.failures == 0 and node.models == {"a": 4, "b": 2, "c": 64, "d": 64, "e": 64}
    assert node.load == {
        "a": (1200, 0.4),
        "b": (0, 0.0),
        "c": (0, 1.0),  # past full is full
        "d": (0, 0.0),
        "e": (0, 0.0),
    }
    assert node.to_json()["load"]["a"] == {"queued_prompt_tokens": 1200, "kv_occupancy": 0.4}
    assert node.cost("b") == Node("x", models={"b": 2}, latency_s=node.latency_s).cost("b")


def test_a_poll_replaces_the_last_reported_load():
    node = Node("x", models={"m": 4}, load={"m": (9_000, 0.99), "gone": (1, 0.1)})
    node = poll([{"id": "m"}], node)
    assert node.load == {"m": (0, 0.0)}  # the node stopped reporting: no stale load
