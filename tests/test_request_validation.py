"""Request validation (issue 50): out-of-range seeds and wrong-typed fields are 400s
that name the field, checked where omnid and the edge check bodies, without a server."""

from __future__ import annotations

import json

import pytest

from edge.server import check_inference_body
from omni.api.errors import ApiError
from omni.api.schemas import ChatCompletionRequest, CompletionRequest, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def dumps(body: dict) -> bytes:
    """orjson refuses integers past 64 bits; the json module writes them as a client would."""
    return json.dumps(body).encode()


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1, 10**30])
@pytest.mark.parametrize("schema", [ChatCompletionRequest, CompletionRequest])
def test_seed_out_of_int64_is_400_naming_seed(schema, seed):
    base = CHAT if schema is ChatCompletionRequest else {"model": "m", "prompt": "hi"}
    body = {**base, "seed": seed}
    with pytest.raises(ApiError) as caught:
        parse_request(schema, dumps(body))
    err = caught.value
    assert (err.status, err.param, err.code) == (400, "seed", "invalid_value")
    assert err.message.startswith("Invalid value for 'seed'")


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0, -1])
def test_seed_in_int64_is_accepted(seed):
    assert parse_request(ChatCompletionRequest, dumps({**CHAT, "seed": seed})).seed == seed


def test_wrong_typed_model_says_type_not_missing():
    with pytest.raises(ApiError) as caught:
        parse_request(ChatCompletionRequest, dumps({**CHAT, "model": 123}))
    err = caught.value
    assert (err.status, err.param) == (400, "model")
    assert "Missing" not in err.message and "valid string" in err.message


def test_missing_model_says_missing():
    body = {"messages": CHAT["messages"]}
    with pytest.raises(ApiError) as caught:
        parse_request(ChatCompletionRequest, dumps(body))
    assert (caught.value.param, caught.value.message) == (
        "model",
        "Missing required parameter: 'model'.",
    )


@pytest.mark.parametrize("model", [123, ["m"], {"m": 1}, True])
def test_edge_wrong_typed_model_says_type(model):
    with pytest.raises(ApiError) as caught:
        check_inference_body(dumps({**CHAT, "model": model}))
    err = caught.value
    assert (err.status, err.param, err.code) == (400, "model", "invalid_value")
    assert err.message == "Invalid type for 'model': expected a string."


@pytest.mark.parametrize(
    "body", [{"messages": CHAT["messages"]}, {**CHAT, "model": None}, {**CHAT, "model": ""}]
)
def test_edge_missing_model_says_missing(body):
    with pytest.raises(ApiError) as caught:
        check_inference_body(dumps(body))
    assert (caught.value.param, caught.value.message) == (
        "model",
        "Missing required parameter: 'model'.",
    )
