"""logit_bias, min_tokens, ignore_eos and stop_token_ids on the engine (SmolLM2, CPU),
checked on the token ids it emits."""

from __future__ import annotations

from collections import Counter

import pytest

from omni.engine.sampling import SamplingParams
from omni.testing.runs import run_requests, tokens


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    return tok.encode(tok.apply_chat_template(messages))


def run(engine, prompt, **params) -> tuple[list[int], str]:
    (steps,) = run_requests(engine, [prompt], SamplingParams(**params))
    return tokens(steps), steps[-1].finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_minus_100_never_emits_the_token(engine, prompt, temperature):
    plain, _ = run(engine, prompt, max_tokens=40, temperature=temperature, seed=7)
    banned = {t for t, _ in Counter(plain).most_common(3)}  # what it emits most, unbiased
    biased, _ = run(
        engine,
        prompt,
        max_tokens=40,
        temperature=temperature,
        seed=7,
        logit_bias=dict.fromkeys(banned, -100.0),
    )
    assert len(biased) >= 10 and not banned & set(biased)


def test_logit_bias_plus_100_forces_the_token(engine, prompt):
    token = engine.tokenizer.encode("!")[0]
    out, reason = run(engine, prompt, max_tokens=5, temperature=1.0, logit_bias={token: 100.0})
    assert (out, reason) == ([token] * 5, "length")


def test_min_tokens_holds_back_the_end_and_ignore_eos_runs_to_the_limit(engine, prompt):
    eos = engine.tokenizer.eos_ids
    plain, reason = run(engine, prompt, max_tokens=200, temperature=0)
    assert reason == "stop" and len(plain) < 150  # it ends by itself
    longer, _ = run(engine, prompt, max_tokens=200, temperature=0, min_tokens=len(plain) + 20)
    assert len(longer) >= len(plain) + 20
    assert not eos & set(longer[: len(plain) + 19])  # no end of turn before min_tokens
    full, reason = run(engine, prompt, max_tokens=len(plain) + 30, temperature=0, ignore_eos=True)
    assert (len(full), reason) == (len(plain) + 30, "length")


def test_stop_token_ids_end_the_answer(engine, prompt):
    plain, _ = run(engine, prompt, max_tokens=60, temperature=0)
    stop = plain[5]
    out, reason = run(engine, prompt, max_tokens=60, temperature=0, stop_token_ids=[stop])
    assert reason == "stop" and out == plain[: plain.index(stop) + 1]
