"""Continuous batching and the prefix cache, through the edge, on the CPU engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from .conftest import wait_until

TEXT = "smollm2-135m-instruct"
N_CLIENTS = 32


def instance_health(server) -> dict:
    sock = server.runtime_dir / "instances" / TEXT / "io" / "sock"
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://i") as c:
        return c.get("/health").json()


def prompts() -> list[str]:
    topics = ["rivers", "stars", "bread", "music", "trains", "cats", "rain", "chess"]
    return [f"Write one sentence about {topics[i % 8]} number {i}." for i in range(N_CLIENTS)]


def test_concurrent_streams_each_get_their_own_text_and_cancelled_ones_free_blocks(server):
    idle = instance_health(server)
    assert idle["running"] == 0 and idle["kv_blocks_free"] == idle["kv_blocks_total"]
    kwargs = dict(model=TEXT, max_tokens=12, temperature=0)
    sync = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    # each even client's answer alone, one request at a time (odd clients hang up: theirs
    # are never compared)
    alone = {
        i: sync.chat.completions.create(messages=[{"role": "user", "content": p}], **kwargs)
        .choices[0]
        .message.content
        for i, p in enumerate(prompts())
        if i % 2 == 0
    }

    client = openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300
    )

    async def one(i: int) -> str | None:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": prompts()[i]}],
            stream=True,
            **{**kwargs, "max_tokens": 200 if i % 2 else 12},
        )
        text = ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                if i % 2 and len(text) > 3:  # odd clients hang up mid-stream
                    await stream.close()
                    return None
        return text

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(N_CLIENTS)))

    results = asyncio.run(all_of_them())
    for i, text in enumerate(results):
        if i % 2 == 0:
            assert text == alone[i], (i, text, alone[i])
    # every block of the cancelled and the finished requests is free again
    health = wait_until(
        lambda: (h := instance_health(server))["running"] == 0 and h, 60, "engine idle"
    )
    assert health["kv_blocks_free"] == health["kv_blocks_total"]


def test_prefix_cache_is_shared_within_a_tenant_or_session_only(server):
    long_prompt = "Summarize: " + " ".join(f"fact {i} is {i * i}." for i in range(60))

    def cached(tenant: str, session: str | None = None) -> int:
        headers = {"x-omni-tenant": tenant}
        if session:
            headers["x-session-affinity"] = session
        resp = httpx.post(  # straight to omnid: the edge does not let clients name a tenant
            f"http://127.0.0.1:{server.omnid_port}/v1/completions",
            headers=headers,
            timeout=120,
            json={"model": TEXT, "prompt": long_prompt, "max_tokens": 1},
        )
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        assert usage["prompt_tokens"] > 200
        return usage["prompt_tokens_details"]["cached_tokens"]

    stamp = str(time.time_ns())  # tenants no earlier test used
    assert cached(f"a-{stamp}", "s1") == 0
    assert cached(f"b-{stamp}", "s1") == 0  # another tenant, same session id: no hit
    assert cached(f"a-{stamp}", "s2") == 0  # same tenant, another session: no hit
    assert cached(f"a-{stamp}", "s1") > 200  # the same session again: its prefix is reused


def test_the_edge_does_not_let_a_client_name_its_tenant(server):
    prompt = "Tell me about " + " ".join(f"item {i}" for i in range(80))
    body = {"model": TEXT, "prompt": prompt, "max_tokens": 1}
    victim = {"x-omni-tenant": f"victim-{time.time_ns()}"}
    direct = httpx.post(
        f"http://127.0.0.1:{server.omnid_port}/v1/completions",
        json=body,
        headers=victim,
        timeout=120,
    )
    assert direct.status_code == 200
    again = httpx.post(
        f"http://127.0.0.1:{server.omnid_port}/v1/completions",
        json=body,
        headers=victim,
        timeout=120,
    )
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # control
    # the same prompt, claiming the victim's tenant through the edge: no hit on its prefix
    spoofed = httpx.post(
        f"{server.base_url}/v1/completions", json=body, headers=victim, timeout=120
    )
    assert spoofed.status_code == 200
    assert spoofed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
