"""Bad input gets an OpenAI-style error with the right status, through the edge and omnid."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from .conftest import free_port, wait_until

TEXT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
CHAT = {"model": TEXT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def error(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@pytest.fixture
def edge(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture
def omnid(server) -> httpx.Client:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.omnid_port}", timeout=60) as client:
        yield client


CASES = [
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "model": "nope"},
        404,
        error(
            "The model 'nope' does not exist or is not loaded.",
            param="model",
            code="model_not_found",
        ),
        id="unknown-model",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "temperature": 5},
        400,
        error(
            "Invalid value for 'temperature': Input should be less than or equal to 2.",
            param="temperature",
            code="invalid_value",
        ),
        id="temperature-out-of-range",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "max_tokens": "10"},
        400,
        error(
            "Invalid value for 'max_tokens': Input should be a valid integer.",
            param="max_tokens",
            code="invalid_value",
        ),
        id="max-tokens-wrong-type",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "top_p": 0},
        400,
        error(
            "Invalid value for 'top_p': Input should be greater than 0.",
            param="top_p",
            code="invalid_value",
        ),
        id="top-p-zero",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "robot", "content": "x"}]},
        400,
        error(
            "Invalid value for 'messages[0].role': Input should be 'system', 'developer', "
            "'user', 'assistant' or 'tool'.",
            param="messages[0].role",
            code="invalid_value",
        ),
        id="bad-role",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"model": TEXT},
        400,
        error("Missing required parameter: 'messages'.", param="messages", code="invalid_value"),
        id="missing-messages",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "frobnicate": True},
        400,
        error(
            "Unrecognized request argument supplied: frobnicate",
            param="frobnicate",
            code="invalid_value",
        ),
        id="unknown-argument",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "frequency_penalty": 2.5},
        400,
        error(
            "Invalid value for 'frequency_penalty': Input should be less than or equal to 2.",
            param="frequency_penalty",
            code="invalid_value",
        ),
        id="frequency-penalty-out-of-range",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "top_logprobs": 2},
        400,
        error(
            "top_logprobs requires logprobs to be true.", param="top_logprobs", code="invalid_value"
        ),
        id="top-logprobs-without-logprobs",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "n": 129},
        400,
        error(
            "Invalid value for 'n': Input should be less than or equal to 128.",
            param="n",
            code="invalid_value",
        ),
        id="n-above-128",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "stop": ["a", "b", "c", "d", "e"]},
        400,
        error(
            "Invalid value for 'stop': List should have at most 4 items after validation, not 5.",
            param="stop",
            code="invalid_value",
        ),
        id="too-many-stops",
    ),
    pytest.param(
        "/v1/completions",
        {"model": TEXT, "prompt": "hi", "max_tokens": 9000},
        400,
        error(
            "max_tokens is 9000, but the prompt (1 tokens) leaves room for 8191 in this "
            "model's 8192-token context.",
            param="max_tokens",
            code="context_length_exceeded",
        ),
        id="context-exceeded",
    ),
    pytest.param(
        "/v1/completions",
        {"model": TEXT, "prompt": [0, 10**9]},
        400,
        error("Token ids must be in [0, 49152).", param="prompt"),
        id="token-id-out-of-vocab",
    ),
    pytest.param(
        "/v1/embeddings",
        {"model": TEXT, "input": "hi"},
        400,
        error(
            f"Model '{TEXT}' does not serve /v1/embeddings.", param="model", code="wrong_model_kind"
        ),
        id="embeddings-on-text-model",
    ),
    pytest.param(
        "/v1/chat/completions",
        {**CHAT, "model": EMBED},
        400,
        error(
            f"Model '{EMBED}' does not serve /v1/chat/completions.",
            param="model",
            code="wrong_model_kind",
        ),
        id="chat-on-embedding-model",
    ),
    pytest.param(
        "/v1/embeddings",
        {"model": EMBED, "input": ["ok", ""]},
        400,
        error(
            "Invalid value for 'input': input must not contain empty strings or token lists.",
            param="input",
            code="invalid_value",
        ),
        id="empty-embedding-input",
    ),
    pytest.param(
        "/v1/embeddings",
        {"model": EMBED, "input": "x", "dimensions": 7},
        400,
        error(
            "This model returns 384 dimensions; 'dimensions' cannot change that.",
            param="dimensions",
        ),
        id="embedding-dimensions",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "expected"), CASES)
def test_bad_request_through_edge_and_omnid(edge, omnid, path, body, status, expected):
    via_edge = edge.post(path, json=body)
    assert via_edge.status_code == status
    assert via_edge.json() == expected
    assert via_edge.headers["content-type"].startswith("application/json")
    # The edge passes omnid's errors through unchanged.
    direct = omnid.post(path, json=body)
    assert (direct.status_code, direct.json()) == (status, expected)


@pytest.mark.parametrize("content", [b"{not json", b'{"model": "x",', b"\xff\xfe"])
def test_malformed_json(edge, content):
    resp = edge.post(
        "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    assert resp.json() == error("Request body is not valid JSON.", code="invalid_json")


@pytest.mark.parametrize("content", [b"[]", b"42", b'"model"'])
def test_body_must_be_an_object(edge, content):
    resp = edge.post("/v1/completions", content=content)
    assert resp.status_code == 400
    assert resp.json() == error("Request body must be a JSON object.", code="invalid_value")


def test_missing_model(edge):
    resp = edge.post("/v1/chat/completions", json={"messages": CHAT["messages"]})
    assert resp.status_code == 400
    assert resp.json() == error(
        "Missing required parameter: 'model'.", param="model", code="invalid_value"
    )


def test_body_over_limit_is_413(edge):
    limit = 4 << 20  # the edge's default
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (limit + 1)}]}
    expected = error(f"Request body exceeds the {limit}-byte limit.", code="request_too_large")
    resp = edge.post("/v1/chat/completions", json=big)
    assert (resp.status_code, resp.json()) == (413, expected)

    def chunked():  # no Content-Length: the limit holds while streaming the body in
        for _ in range(5):
            yield b"x" * (1 << 20)

    resp = edge.post("/v1/chat/completions", content=chunked())
    assert (resp.status_code, resp.json()) == (413, expected)


def test_unknown_path_and_wrong_method(edge):
    resp = edge.post("/v1/nothing-here", json=CHAT)
    assert resp.status_code == 404
    assert resp.json() == error("Unknown path /v1/nothing-here")
    resp = edge.get("/v1/chat/completions")
    assert resp.status_code == 405
    assert resp.json() == error("Method GET not allowed")
    assert "POST" in resp.headers["allow"]


def test_omnictl_load_errors(server, tmp_path):
    missing = server.omnictl("load", "broken", str(tmp_path))
    assert missing.returncode == 1
    assert f"{tmp_path}/config.json: missing" in missing.stderr
    (tmp_path / "config.json").write_text("{not json")
    bad = server.omnictl("load", "broken", str(tmp_path))
    assert bad.returncode == 1 and "config.json: not valid JSON" in bad.stderr
    dup = server.omnictl("load", TEXT, str(tmp_path))
    assert dup.returncode == 1 and f"Model '{TEXT}' is already loaded." in dup.stderr
    unknown = server.omnictl("unload", "nope")
    assert unknown.returncode == 1 and "does not exist" in unknown.stderr


def test_edge_without_omnid_answers_503():
    port, dead = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edge.server",
            "--port",
            str(port),
            "--upstream",
            f"http://127.0.0.1:{dead}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def health():
            try:
                return httpx.get(f"{base}/healthz", timeout=2)
            except httpx.TransportError:
                return None

        resp = wait_until(health, 30, "edge up")
        assert resp.status_code == 503
        resp = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=10)
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "1"
        assert resp.json() == error(
            "omnid is unavailable; retry shortly.", "service_unavailable_error", code="unavailable"
        )
    finally:
        proc.terminate()
        proc.wait(10)
