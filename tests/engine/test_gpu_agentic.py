"""The agentic paths on the GPU, with the embedded SmolLM2's real weights in bf16: grammar
masks applied to the batch on the device (xgrammar's Triton kernel), n sequences forked
on shared KV blocks (the partial block copied on the device), 50 schemas at once."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from omni.engine.checkpoint import Checkpoint
from omni.engine.engine import Engine
from omni.engine.grammar import GrammarSpec
from omni.engine.llama import LlamaForCausalLM
from omni.engine.sampling import SamplingParams
from omni.engine.tokenizer import TextTokenizer
from omni.testing.runs import run_requests, tokens

from ..json_schemas import schemas
from .test_fork import SCHEMA, choices

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(text_model_dir):
    ckpt = Checkpoint.open(text_model_dir)
    model = LlamaForCausalLM.load(ckpt, "cuda", torch.bfloat16)
    eng = Engine(model, TextTokenizer(ckpt))
    eng.warm_up()
    yield eng
    eng.shutdown()


def chat_prompt(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_grammar_masked_on_the_device_in_a_batch_equals_the_per_row_path(engine):
    prompt = chat_prompt(engine, "Name three colours and a fruit.")
    grammar = GrammarSpec.json_schema(SCHEMA)
    params = SamplingParams(max_tokens=80, temperature=0, grammar=grammar)
    others = [chat_prompt(engine, f"Count to {i}.") for i in range(5)]
    batched = run_requests(engine, [prompt] * 4 + others, params)[:4]
    (per_row,) = run_requests(engine, [prompt], SamplingParams(**{**vars(params), "logprobs": 0}))
    for steps in batched:
        assert tokens(steps) == tokens(per_row)
    jsonschema.validate(json.loads("".join(s.text for s in per_row)), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_n_sequences_on_the_gpu_are_each_n_1_with_its_seed(engine, temperature):
    prompt = chat_prompt(engine, "Write a sentence about the sea.")
    params = dict(max_tokens=32, temperature=temperature, ignore_eos=True)
    forked = choices(engine, prompt, SamplingParams(n=3, seed=3, **params))
    for index, steps in forked.items():
        (alone,) = run_requests(engine, [prompt], SamplingParams(seed=3 + index, **params))
        assert tokens(steps) == tokens(alone)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fifty_schemas_at_once_all_validate(engine, temperature):
    prompt = chat_prompt(engine, "Fill in this record with plausible values.")
    specs = schemas(50, seed=21)

    def one(i: int):
        grammar = GrammarSpec.json_schema(specs[i])
        params = SamplingParams(max_tokens=500, temperature=temperature, seed=i, grammar=grammar)
        (steps,) = run_requests(engine, [prompt], params)
        return steps

    with ThreadPoolExecutor(len(specs)) as pool:
        results = list(pool.map(one, range(len(specs))))
    for i, steps in enumerate(results):
        assert steps[-1].finish_reason == "stop", i
        jsonschema.validate(json.loads("".join(s.text for s in steps)), specs[i])
