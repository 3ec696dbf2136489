"""End to end through `omni serve` with the official openai client."""

from __future__ import annotations

import os
import re
import signal
import threading

import httpx
import numpy as np
import openai
import psutil
import pytest

from .conftest import PACKAGED_MODELS, wait_until

TEXT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def test_models_lists_the_defaults(client):
    assert {m.id for m in client.models.list()} == {TEXT, EMBED, *PACKAGED_MODELS}


def test_chat_completion(client):
    resp = client.chat.completions.create(
        model=TEXT,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert resp.model == TEXT
    assert resp.usage.prompt_tokens > 10
    assert 0 < resp.usage.completion_tokens <= 24
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_chat_matches_non_streaming(client):
    kwargs = dict(
        model=TEXT,
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=20,
        temperature=0,
    )
    whole_resp = client.chat.completions.create(**kwargs)
    whole = whole_resp.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == whole_resp.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole_resp.usage.prompt_tokens


def test_completion_and_max_tokens(client):
    resp = client.completions.create(
        model=TEXT, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    assert "Paris" in resp.choices[0].text


def test_streaming_completion(client):
    stream = client.completions.create(
        model=TEXT, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in stream)
    assert "5" in text


def test_seed_makes_sampling_repeatable(client):
    kwargs = dict(model=TEXT, prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(**kwargs, seed=7).choices[0].text
    b = client.completions.create(**kwargs, seed=7).choices[0].text
    others = {client.completions.create(**kwargs, seed=s).choices[0].text for s in (8, 9, 10)}
    assert a == b
    assert others - {a}, "different seeds all gave the same text"


def test_stop_string_is_not_in_output(client):
    resp = client.completions.create(
        model=TEXT, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]
    )
    assert resp.choices[0].finish_reason == "stop"
    assert "7" not in resp.choices[0].text and "6" in resp.choices[0].text


def test_embeddings_match_sentence_transformers(client, embedding_model_dir):
    from sentence_transformers import SentenceTransformer

    texts = [
        "OMNI packs many models on one GPU.",
        "A cat sat on the mat.",
        "word " * 300,
    ]  # past the 256-token limit: truncated, on request, like the reference
    cut = {"truncate_prompt_tokens": -1}
    # the client asks for base64
    resp = client.embeddings.create(model=EMBED, input=texts, extra_body=cut)
    ours = np.array([d.embedding for d in resp.data])
    floats = httpx.post(
        f"{client.base_url}embeddings",
        json={"model": EMBED, "input": texts, "encoding_format": "float", **cut},
    ).json()
    reference = SentenceTransformer(str(embedding_model_dir), device="cpu").encode(texts)
    assert ours.shape == (3, 384)
    np.testing.assert_allclose(ours, reference, atol=1e-4)
    np.testing.assert_allclose(np.array([d["embedding"] for d in floats["data"]]), ours, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert resp.usage.prompt_tokens == floats["usage"]["prompt_tokens"] > 256


def test_killed_instance_restarts_and_serves_again(client, server):
    before = server.instances()[TEXT]
    assert before["state"] == "ready"
    # A long generation is in flight when the instance dies: it gets a clean 503.
    errors = []

    def long_request():
        try:
            client.completions.create(
                model=TEXT, prompt="Write a long story:", max_tokens=2000, temperature=0
            )
            errors.append(None)
        except openai.APIStatusError as exc:
            errors.append(exc)

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_until(
        lambda: server.instances()[TEXT]["pid"] and _busy(before["pid"]), 30, "generation in flight"
    )
    os.kill(before["pid"], signal.SIGKILL)
    thread.join(60)
    assert len(errors) == 1 and errors[0] is not None, "in-flight request did not fail"
    assert errors[0].status_code == 503
    assert int(errors[0].response.headers["retry-after"]) >= 1
    assert errors[0].body["code"] == "unavailable"

    # (a new live pid, not just "ready": /proc loses the pid a moment before omnid sees
    # the exit, and until then the dead one still reads ready)
    after = wait_replaced(server, TEXT, before["pid"], 120)
    assert after["restarts"] == before["restarts"] + 1
    assert "SIGKILL" in after["last_exit"]
    resp = client.completions.create(
        model=TEXT, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert "Paris" in resp.choices[0].text


def _busy(pid: int) -> bool:
    return psutil.Process(pid).cpu_percent(interval=0.2) > 20


def test_unload_and_load_change_models(client, server, text_model_dir):
    result = server.omnictl("unload", TEXT)
    assert result.returncode == 0, result.stderr
    try:
        assert {m.id for m in client.models.list()} == {EMBED, *PACKAGED_MODELS}
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model=TEXT, prompt="hi", max_tokens=1)
        assert err.value.body["code"] == "model_not_found"

        result = server.omnictl("load", "smol-copy", str(text_model_dir))
        assert result.returncode == 0, result.stderr
        assert {m.id for m in client.models.list()} == {EMBED, "smol-copy", *PACKAGED_MODELS}
        resp = client.completions.create(
            model="smol-copy", prompt="The capital of France is", max_tokens=5, temperature=0
        )  # waits for it to be ready
        assert "Paris" in resp.choices[0].text

        table = server.omnictl("instances")
        assert table.returncode == 0 and "smol-copy" in table.stdout and "ready" in table.stdout
        listed = server.omnictl("--json", "models")
        # omnid keeps the path resolved (a checkout reached through a symlink included)
        assert '"smol-copy"' in listed.stdout and str(text_model_dir.resolve()) in listed.stdout
    finally:  # back to the defaults for the tests that share this server, pass or fail
        server.omnictl("unload", "smol-copy")
        assert server.omnictl("load", TEXT, str(text_model_dir)).returncode == 0
        server.wait_ready([TEXT])


def wait_replaced(server, name: str, old_pid: int, timeout_s: float) -> dict:
    """The instance once a new process of it is ready."""

    def replaced():
        inst = server.instances()[name]
        return inst["state"] == "ready" and inst["pid"] not in (None, old_pid) and inst

    return wait_until(replaced, timeout_s, f"{name} replaced and ready")


def test_hung_instance_is_killed_by_health_checks(client, server):
    before = server.instances()[EMBED]
    os.kill(before["pid"], signal.SIGSTOP)  # alive, but answers nothing
    after = wait_replaced(server, EMBED, before["pid"], 90)
    assert after["restarts"] == before["restarts"] + 1
    assert after["last_exit"].startswith("unhealthy")
    assert not psutil.pid_exists(before["pid"])
    assert len(client.embeddings.create(model=EMBED, input="back").data[0].embedding) == 384


def test_omnictl_restart(client, server):
    before = server.instances()[EMBED]
    result = server.omnictl("restart", EMBED)
    assert result.returncode == 0 and f"restarting {EMBED}" in result.stdout
    after = wait_replaced(server, EMBED, before["pid"], 60)
    assert after["restarts"] == before["restarts"] + 1
    assert after["last_exit"].startswith("restarted")
    assert client.embeddings.create(model=EMBED, input="again").data[0].index == 0


def test_each_instance_runs_as_its_own_unprivileged_user(server):
    uids = {name: psutil.Process(i["pid"]).uids().real for name, i in server.instances().items()}
    assert len(set(uids.values())) == len(uids), uids
    assert all(uid >= 200_000 for uid in uids.values()), uids


def test_frequency_penalty_changes_a_repetitive_greedy_answer(client):
    kwargs = dict(model=TEXT, prompt="one one one one one one one", max_tokens=12, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    penalized = client.completions.create(**kwargs, frequency_penalty=2.0).choices[0].text
    assert penalized != plain

    def distinct_ratio(text: str) -> float:
        words = re.findall(r"\w+", text)
        return len(set(words)) / max(1, len(words))

    assert distinct_ratio(penalized) > distinct_ratio(plain)  # it repeats itself less


def test_chat_logprobs(client):
    resp = client.chat.completions.create(
        model=TEXT,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens
    assert "".join(e.token for e in entries) == resp.choices[0].message.content
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen one is the likeliest
        assert abs(e.logprob - tops[0]) < 1e-6
    stream = client.chat.completions.create(
        model=TEXT,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        stream=True,
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_completion_logprobs_legacy_format(client):
    resp = client.completions.create(
        model=TEXT, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == resp.choices[0].text
