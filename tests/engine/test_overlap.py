"""The engine launches a greedy step before the last one's tokens reach the host.

Those tokens stay placeholders on the host until they land; a request that needs
host-side sampling (temperature, penalties, logprobs) switches steps back to
waiting. Whatever the mix, every request must get exactly what it gets alone.
"""

from __future__ import annotations

import queue

import pytest

from omni.engine.engine import Engine, GenerationRequest
from omni.engine.sampling import SamplingParams
from omni.engine.sequence import PLACEHOLDER
from omni.testing.runs import run_requests, tokens

MIX = [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.8, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=17, temperature=0, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(max_tokens=25, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0, stop=["e"]),
]


def test_greedy_and_sampled_requests_together_get_what_they_get_alone(engine):
    prompts = [engine.tokenizer.encode(f"Count to {n}: 1, 2,") for n in range(len(MIX))]
    alone = [run_requests(engine, [p], params)[0] for p, params in zip(prompts, MIX, strict=True)]
    together = _run_mixed(engine, prompts)
    for a, t, params in zip(alone, together, MIX, strict=True):
        assert tokens(t) == tokens(a)
        assert "".join(s.text for s in t) == "".join(s.text for s in a)
        assert t[-1].finish_reason == a[-1].finish_reason
        assert t[-1].completion_tokens == a[-1].completion_tokens <= params.max_tokens
        if params.logprobs:  # the CPU's matmuls round by batch shape: values nearly equal
            got, want = [s.logprobs[0] for s in t], [s.logprobs[0] for s in a]
            assert [(tok, [alt for alt, _ in alts]) for tok, _, alts in got] == [
                (tok, [alt for alt, _ in alts]) for tok, _, alts in want
            ]
            assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
    assert not any(PLACEHOLDER in s.token_ids for r in together for s in r)
    assert engine.stats()["running"] == 0
    assert engine.scheduler.blocks.num_free == engine.runner.num_blocks


def _run_mixed(engine: Engine, prompts: list[list[int]]):
    """All at once, each with its own parameters."""
    queues = [queue.Queue() for _ in prompts]
    for prompt, params, q in zip(prompts, MIX, queues, strict=True):
        engine.submit(GenerationRequest(prompt, params), q.put)
    results = []
    for q in queues:
        steps = [q.get(timeout=120)]
        while not steps[-1].finished:
            steps.append(q.get(timeout=120))
        results.append(steps)
    return results


def test_max_tokens_is_exact_when_the_last_token_is_still_in_flight(engine):
    prompt = engine.tokenizer.encode("a b c")
    for n in (1, 2, 3, 8):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        steps = run_requests(engine, [prompt, [*prompt, 7]], params)
        for s in steps:
            assert len(tokens(s)) == n and s[-1].completion_tokens == n
            assert s[-1].finish_reason == "length"
