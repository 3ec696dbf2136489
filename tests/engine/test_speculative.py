"""Speculative decoding (speculative.py): the same greedy tokens with and without it on the
real SmolLM2 (CPU), the target's distribution kept by rejection sampling, proposals and
the adaptive k."""

from __future__ import annotations

import pytest
import torch

from omni.engine.checkpoint import Checkpoint
from omni.engine.engine import Engine
from omni.engine.llama import LlamaForCausalLM
from omni.engine.sampling import SamplingParams
from omni.engine.speculative import (
    AdaptiveK,
    SpecConfig,
    accept_greedy,
    accept_sampled,
    ngram_proposal,
)
from omni.engine.tokenizer import TextTokenizer

from .runs import run_requests, tokens

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and "
    "wrote in the log that the sea was calm, the wind was from the west, and two fishing "
    "boats had come home before the fog."
)
TASKS = [
    f"Repeat this sentence exactly, word for word: {PASSAGE}",
    f"Summarize in one sentence, quoting its words: {PASSAGE}",
    "Rename the variable `total` to `sum` in this code and print the whole code:\n"
    "def add(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n",
]


def test_ngram_proposes_what_followed_the_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ngram_proposal(tokens, 2) == [7, 5]  # the latest earlier "1 2 3"
    assert ngram_proposal([4, 5, 6, 7, 5], 3) == [6, 7, 5]  # "5" matched, run to the end
    assert ngram_proposal([4, 5, 6], 3) == []
    assert ngram_proposal(tokens, 0) == []


def test_greedy_acceptance_keeps_the_targets_picks():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all, and one more
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the target's token at the miss
    assert accept_greedy([4, 9], [5]) == [4]


def test_k_follows_acceptance_and_pauses_where_guesses_miss():
    k = AdaptiveK(6)
    k.update(6, 1, 0)
    assert k.k_at(2) == 2
    k.update(2, 2, 2)
    assert k.k_at(5) == 3
    k.update(0, 0, 5)  # nothing proposed: nothing learned
    assert k.k_at(6) == 3
    k.update(3, 0, 6)  # one miss: keep trying, with one token
    assert k.k_at(7) == 1
    k.update(1, 0, 7)  # a second: 4 tokens without proposals, then try again
    assert [k.k_at(g) for g in range(8, 13)] == [0, 0, 0, 0, 1]
    k.update(1, 0, 12)  # a third: 8
    assert [k.k_at(g) for g in range(13, 22)] == [0] * 8 + [1]
    k.update(1, 1, 21)  # a hit ends the misses
    assert k.k_at(23) == 2
    for n in range(20):
        k.update(1, 0, 100 * n)
    assert k.k_at(1900 + 64) == 0 and k.k_at(1900 + 65) == 1  # at most MAX_PAUSE


@pytest.mark.parametrize("draft", ["deterministic", "distribution"])
def test_rejection_sampling_keeps_the_targets_distribution(draft):
    """The first and second emitted tokens, over many draws with a fixed seed, against
    the target's distributions (a chi-square test at p < 0.001 would fail once in a
    thousand runs of a correct sampler; the seed makes it the same run every time)."""
    gen = torch.Generator().manual_seed(1234)
    p0 = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    p1 = torch.tensor([0.3, 0.1, 0.2, 0.25, 0.15])
    p2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    q = [torch.tensor([0.1, 0.1, 0.6, 0.1, 0.1]), torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])]
    draws = 20000
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(draws):
        if draft == "deterministic":
            guess, q_probs = [2, 0], None  # a guess the target finds unlikely, then a likely one
        else:
            guess = [int(torch.multinomial(qi, 1, generator=gen)) for qi in q]
            q_probs = q
        out = accept_sampled([p0, p1, p2], guess, gen, q_probs)
        first[out[0]] += 1
        if len(out) > 1 and out[0] == guess[0]:  # the second token, given the first kept
            second[out[1]] += 1
    for counts, p in ((first, p0), (second, p1)):
        expected = counts.sum() * p
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 18.47, (counts / counts.sum(), p)  # 4 degrees of freedom, p = 0.001
    wrong = torch.tensor([0.05, 0.4, 0.3, 0.1, 0.15])  # and a wrong p would be told apart
    expected = first.sum() * wrong
    assert float(((first - expected) ** 2 / expected).sum()) > 100


@pytest.fixture(scope="module")
def engines(text_model_dir):
    ckpt = Checkpoint.open(text_model_dir)
    model = LlamaForCausalLM.load(ckpt)
    plain = Engine(model, TextTokenizer(ckpt), max_batch_tokens=256)
    spec = Engine(model, TextTokenizer(ckpt), max_batch_tokens=256, speculative=SpecConfig(k=5))
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_greedy_outputs_are_identical_with_speculation(engines):
    """Each task alone and all together (batched verify rows): the very tokens plain
    decoding emits, with most of them from accepted proposals. (On the GPU the kernels
    are batch-invariant, so a verify row's logits are a decode row's bits; torch's CPU
    matmul may differ in the last bits with the rows, which would flip a pick only
    between two logits within ~1e-6 of each other.)"""
    plain, spec = engines
    prompts = [chat(plain, t) for t in TASKS]
    params = SamplingParams(max_tokens=60, temperature=0.0)
    want = [tokens(s) for s in run_requests(plain, prompts, params)]
    for prompt, expected in zip(prompts, want, strict=True):
        (alone,) = run_requests(spec, [prompt], params)
        assert tokens(alone) == expected
    together = [tokens(s) for s in run_requests(spec, prompts, params)]
    assert together == want
    stats = spec.stats()
    assert stats["spec_steps"] > 0 and stats["spec_accepted_tokens"] > 30, stats
    assert stats["spec_tokens_per_step"] > 1.5, stats


def test_speculation_keeps_stops_limits_and_logprobs(engines):
    plain, spec = engines
    prompt = chat(plain, TASKS[0])
    params = SamplingParams(max_tokens=23, temperature=0.0, logprobs=2, stop=["calm"])
    (a,), (b,) = run_requests(plain, [prompt], params), run_requests(spec, [prompt], params)
    assert tokens(a) == tokens(b) and a[-1].finish_reason == b[-1].finish_reason
    assert "".join(s.text for s in a) == "".join(s.text for s in b)
    for x, y in zip(a, b, strict=True):  # (torch's CPU matmul: last bits follow the rows)
        (tx, lx, alt_x), (ty, ly, alt_y) = x.logprobs[0], y.logprobs[0]
        assert tx == ty and [t for t, _ in alt_x] == [t for t, _ in alt_y]
        assert abs(lx - ly) < 1e-4


def test_a_large_batch_does_not_speculate(text_model_dir):
    ckpt = Checkpoint.open(text_model_dir)
    spec = SpecConfig(k=4, max_batch=2)
    engine = Engine(LlamaForCausalLM.load(ckpt), TextTokenizer(ckpt), speculative=spec)
    try:
        prompts = [chat(engine, TASKS[0])] * 3
        run_requests(engine, prompts, SamplingParams(max_tokens=8, temperature=0.0))
        assert engine.stats()["spec_steps"] == 0
    finally:
        engine.shutdown()


def test_sampled_outputs_with_speculation_follow_the_seed(engines):
    """Above temperature 0: a seeded request gives the same tokens run after run (its
    generator drives acceptance and draws), and they stay fluent text of the task."""
    _, spec = engines
    prompt = chat(spec, TASKS[0])
    params = SamplingParams(max_tokens=30, temperature=0.7, seed=11)
    first = tokens(run_requests(spec, [prompt], params)[0])
    assert tokens(run_requests(spec, [prompt], params)[0]) == first
    assert len(first) >= 10 and spec.stats()["spec_steps"] > 0


PEOPLE = (
    "Records: Alice Smith lives in Paris and works as an engineer; Bob Jones lives in "
    "Berlin and works as a teacher; Carol White lives in Madrid and works as a doctor."
)
PEOPLE_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "city": {"type": "string"},
            "job": {"type": "string"},
        },
        "required": ["name", "city", "job"],
    },
}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_structured_outputs_speculate_within_their_grammar(engines, temperature):
    """A JSON-schema answer that echoes its prompt's values: the grammar masks every
    verify row, so what is kept is valid JSON of the schema; greedy, the very tokens
    plain decoding emits."""
    import json

    from omni.engine.grammar import GrammarSpec

    plain, spec = engines
    prompt = chat(plain, f"{PEOPLE}\nList the records as JSON objects with name, city, job.")
    params = SamplingParams(
        max_tokens=120,
        temperature=temperature,
        seed=3,
        grammar=GrammarSpec.json_schema(PEOPLE_SCHEMA),
    )
    before = spec.stats()["spec_accepted_tokens"]
    (got,) = run_requests(spec, [prompt], params)
    text = "".join(s.text for s in got)
    assert got[-1].finish_reason == "stop", text
    assert all({"name", "city", "job"} <= set(r) for r in json.loads(text))
    assert spec.stats()["spec_accepted_tokens"] - before > 10
    if temperature == 0.0:
        (want,) = run_requests(plain, [prompt], params)
        assert tokens(got) == tokens(want)


def test_a_grammar_overrides_what_the_model_would_pick(engines):
    """The grammar allows only values the model would not choose unmasked: every verify
    row is picked from its masked logits, as plain decoding picks."""
    from omni.engine.grammar import GrammarSpec

    plain, spec = engines
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["zebra quartz", "zebra quince"]}},
        "required": ["colour"],
    }
    prompt = chat(
        plain,
        'Not "zebra quartz", not "zebra quince": what colour is the sky? '
        'Answer in JSON: {"colour": ...}.',
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, grammar=GrammarSpec.json_schema(schema))
    (want,), (got,) = run_requests(plain, [prompt], params), run_requests(spec, [prompt], params)
    assert got[-1].finish_reason == "stop" and tokens(got) == tokens(want)
    assert "zebra" in "".join(s.text for s in got)
