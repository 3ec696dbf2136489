"""n > 1 and grammars in the batched sampler, on the engine (SmolLM2, CPU): the n sequences
share the prompt's KV and each is what n=1 gives with its own seed; grammar rows masked in
the batch pick what the per-row path picks."""

from __future__ import annotations

import dataclasses
import json
import queue

import jsonschema
import pytest

from omni.engine.engine import GenerationRequest, StepOutput
from omni.engine.grammar import GrammarSpec
from omni.engine.sampling import SamplingParams
from omni.testing.runs import run_requests, tokens


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "Name three colours and a fruit."}]
    return tok.encode(tok.apply_chat_template(messages))


def choices(engine, prompt: list[int], params: SamplingParams) -> dict[int, list[StepOutput]]:
    """Each of the request's n sequences' outputs, by index."""
    q: queue.Queue[StepOutput] = queue.Queue()
    engine.submit(GenerationRequest(prompt, params), q.put)
    out: dict[int, list[StepOutput]] = {}
    while sum(steps[-1].finished for steps in out.values()) < params.n:
        step = q.get(timeout=120)
        assert step.finish_reason != "error", step.error
        out.setdefault(step.index, []).append(step)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_n_sequences_are_each_what_n_1_gives_with_its_seed(engine, prompt, temperature):
    params = dict(max_tokens=24, temperature=temperature, ignore_eos=True)
    forked = choices(engine, prompt, SamplingParams(n=3, seed=11, **params))
    assert sorted(forked) == [0, 1, 2]
    for index, steps in forked.items():
        (alone,) = run_requests(engine, [prompt], SamplingParams(seed=11 + index, **params))
        assert tokens(steps) == tokens(alone)
        assert steps[-1].completion_tokens == 24
    if temperature:  # three streams, not one copied
        assert len({tuple(tokens(s)) for s in forked.values()}) > 1


def test_fork_on_a_prompt_of_whole_blocks(engine, prompt):
    """No partial block to copy: every prompt block is shared, the next token opens a new one."""
    whole = prompt[: len(prompt) // 16 * 16]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    forked = choices(engine, whole, dataclasses.replace(params, n=2))
    (alone,) = run_requests(engine, [whole], params)
    assert tokens(forked[0]) == tokens(forked[1]) == tokens(alone)


SCHEMA = {
    "type": "object",
    "properties": {
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "fruit": {"type": "string", "maxLength": 12},
    },
    "required": ["colours", "fruit"],
    "additionalProperties": False,
}


def test_grammar_rows_masked_in_the_batch_pick_what_the_per_row_path_picks(engine, prompt):
    grammar = GrammarSpec.json_schema(SCHEMA)
    batched = run_requests(
        engine, [prompt] * 3, SamplingParams(max_tokens=80, temperature=0, grammar=grammar)
    )
    # logprobs keep a row off the device path: its mask is applied on the host, per row
    (per_row,) = run_requests(
        engine, [prompt], SamplingParams(max_tokens=80, temperature=0, grammar=grammar, logprobs=0)
    )
    for steps in [*batched, per_row]:
        assert steps[-1].finish_reason == "stop"
        assert tokens(steps) == tokens(per_row)
    text = "".join(s.text for s in per_row)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_n_with_a_grammar_gives_n_valid_answers(engine, prompt):
    grammar = GrammarSpec.json_schema(SCHEMA)
    forked = choices(
        engine, prompt, SamplingParams(n=3, max_tokens=80, temperature=1.0, seed=5, grammar=grammar)
    )
    for steps in forked.values():
        jsonschema.validate(json.loads("".join(s.text for s in steps)), SCHEMA)


def test_a_grammar_request_streams_every_token_it_counts(engine, prompt):
    """The grammar path launches the next step before streaming the last tokens: the
    count that ends a request at max_tokens is of tokens streamed, not of those held."""
    endless = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
    params = SamplingParams(max_tokens=12, temperature=0, grammar=GrammarSpec.json_schema(endless))
    for steps in run_requests(engine, [prompt] * 3, params):
        assert len(tokens(steps)) == 12 == steps[-1].completion_tokens
        assert steps[-1].finish_reason == "length"
