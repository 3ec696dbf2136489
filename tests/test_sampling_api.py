"""The sampling extensions agents use, through `omni serve` and the openai client: logit_bias,
min_tokens, ignore_eos, stop_token_ids; bad values are 400s naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from omni.engine.checkpoint import Checkpoint
from omni.engine.tokenizer import TextTokenizer

TEXT = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def tok(text_model_dir) -> TextTokenizer:
    return TextTokenizer(Checkpoint.open(text_model_dir))


def chat(client, **kw):
    return client.chat.completions.create(model=TEXT, messages=ASK, **kw)


def test_logit_bias_forces_and_bans_tokens(client, tok):
    bang = tok.encode("!")[0]
    forced = chat(client, max_tokens=4, temperature=1.0, logit_bias={str(bang): 100})
    assert forced.choices[0].message.content == "!!!!"
    plain = chat(client, max_tokens=16, temperature=0).choices[0].message.content
    assert plain.startswith("The capital of France is Paris")
    paris = tok.encode(" Paris")[0]
    banned = chat(client, max_tokens=16, temperature=0, logit_bias={str(paris): -100})
    assert " Paris" not in banned.choices[0].message.content


def test_min_tokens_ignore_eos_and_stop_token_ids(client, tok):
    plain = chat(client, max_tokens=40, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 20
    longer = chat(client, max_tokens=40, temperature=0, extra_body={"min_tokens": 25})
    assert longer.usage.completion_tokens >= 25
    full = chat(client, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    assert (full.usage.completion_tokens, full.choices[0].finish_reason) == (30, "length")
    stop = tok.encode(" France")[0]
    cut = chat(client, max_tokens=40, temperature=0, extra_body={"stop_token_ids": [stop]})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == "The capital of"  # the stop token is not shown
    newer = chat(client, temperature=0, max_completion_tokens=3, extra_body={"user": "u1"})
    assert newer.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "Token ids must be in [0, 49152)."),
        ({"logit_bias": {"5": 150}}, "logit_bias.5", "less than or equal to 100"),
        ({"stop_token_ids": [99999999]}, "stop_token_ids", "Token ids must be in [0, 49152)."),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "more than max_tokens (10)"),
        ({"ignore_eos": "yes"}, "ignore_eos", "valid boolean"),
    ],
)
def test_bad_sampling_values_are_400_naming_the_field(server, extra, param, message):
    body = {"model": TEXT, "messages": ASK, **extra}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
