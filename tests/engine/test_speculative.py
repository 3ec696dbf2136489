"""Speculative decoding (speculative.py): the same greedy tokens with and without it on the
real SmolLM2 (CPU), the target's distribution kept by rejection sampling, proposals and
the adaptive k."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

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
from omni.testing.checkpoints import pruned_llama
from omni.testing.runs import run_requests, tokens

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


def started(work: Callable[[], object]) -> Future:
    """`work` begun on a thread of its own, .result() waiting for what it returns: plain
    decoding's reference run on one engine while a test speculates on another (each
    engine batches only its own requests, so neither run's outputs change)."""
    future = Future()

    def run():
        try:
            future.set_result(work())
        except BaseException as exc:  # re-raised by .result()
            future.set_exception(exc)

    threading.Thread(target=run, name="plain-reference", daemon=True).start()
    return future


@pytest.fixture(scope="module")
def plain_greedy(engines) -> Future:
    """Plain decoding's greedy tokens for each of TASKS, batched, 60 at most (.result()):
    what every speculating engine below must emit. Run once for the module, while the
    first test speculates; a test that asks for fewer tokens compares with their first
    ones (greedy, a shorter run stops there: the same batch, step by step, until then)."""
    plain, _ = engines
    prompts = [chat(plain, t) for t in TASKS]
    params = SamplingParams(max_tokens=60, temperature=0.0)
    return started(lambda: [tokens(s) for s in run_requests(plain, prompts, params)])


def test_greedy_outputs_are_identical_with_speculation(engines, plain_greedy):
    """Each task alone and all together (batched verify rows): the very tokens plain
    decoding emits, with most of them from accepted proposals. (On the GPU the kernels
    are batch-invariant, so a verify row's logits are a decode row's bits; torch's CPU
    matmul may differ in the last bits with the rows, which would flip a pick only
    between two logits within ~1e-6 of each other.)"""
    _, spec = engines
    prompts = [chat(spec, t) for t in TASKS]
    params = SamplingParams(max_tokens=60, temperature=0.0)
    alone = [tokens(run_requests(spec, [prompt], params)[0]) for prompt in prompts]
    together = [tokens(s) for s in run_requests(spec, prompts, params)]
    want = plain_greedy.result()
    for got, expected in zip(alone, want, strict=True):
        assert got == expected
    assert together == want
    stats = spec.stats()
    assert stats["spec_steps"] > 0 and stats["spec_accepted_tokens"] > 30, stats
    assert stats["spec_tokens_per_step"] > 1.5, stats


def test_speculation_keeps_stops_limits_and_logprobs(engines):
    plain, spec = engines
    prompt = chat(plain, TASKS[0])
    params = SamplingParams(max_tokens=23, temperature=0.0, logprobs=2, stop=["calm"])
    reference = started(lambda: run_requests(plain, [prompt], params))
    (b,), (a,) = run_requests(spec, [prompt], params), reference.result()
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
    if temperature == 0.0:
        # compiled here, as a server does before submitting: the engines' grammar set-ups
        # (transformers' lazy imports) are then not run on two threads at once
        for engine in engines:
            engine.check_grammar(params.grammar)
        reference = started(lambda: run_requests(plain, [prompt], params))
    before = spec.stats()["spec_accepted_tokens"]
    (got,) = run_requests(spec, [prompt], params)
    text = "".join(s.text for s in got)
    assert got[-1].finish_reason == "stop", text
    assert all({"name", "city", "job"} <= set(r) for r in json.loads(text))
    assert spec.stats()["spec_accepted_tokens"] - before > 10
    if temperature == 0.0:
        (want,) = reference.result()
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
    for engine in engines:  # compiled here, as in the test above
        engine.check_grammar(params.grammar)
    reference = started(lambda: run_requests(plain, [prompt], params))
    (got,), (want,) = run_requests(spec, [prompt], params), reference.result()
    assert got[-1].finish_reason == "stop" and tokens(got) == tokens(want)
    assert "zebra" in "".join(s.text for s in got)


# ------------------------------------------------------------------ draft models, EAGLE-3


def speculating(model, ckpt, spec: SpecConfig) -> Engine:
    from omni.engine.proposers import load_draft

    draft = load_draft(spec, model, ckpt.path)
    return Engine(model, TextTokenizer(ckpt), max_batch_tokens=256, speculative=spec, draft=draft)


@pytest.fixture(scope="module")
def smollm2(text_model_dir):
    ckpt = Checkpoint.open(text_model_dir)
    return LlamaForCausalLM.load(ckpt), ckpt


def test_a_draft_model_keeps_its_cache_in_the_targets_blocks(smollm2, engines, plain_greedy):
    """The model as its own draft: every proposal is what the target picks, so anything
    wrong in the draft's K/V (its catch-up after a verify step, its rollback, a prefix
    block it trusts) shows as a rejected proposal. A prompt's blocks cached by a request
    that never speculated hold no draft K/V: the draft computes them; cached by one that
    did, it reuses them."""
    model, ckpt = smollm2
    plain, _ = engines
    spec = speculating(model, ckpt, SpecConfig(method="draft", k=4, path=str(ckpt.path)))
    try:
        prompts = [chat(plain, t) for t in TASKS]
        params = SamplingParams(max_tokens=24, temperature=0.0)
        want = [w[:24] for w in plain_greedy.result()]
        run_requests(spec, prompts[:1], SamplingParams(max_tokens=1))  # caches the prompt
        assert spec.proposer.caught_up_tokens == 0
        got = [tokens(s) for s in run_requests(spec, prompts, params)]
        assert got == want
        stats = spec.stats()
        assert stats["spec_acceptance"] > 0.97 and stats["spec_tokens_per_step"] > 4, stats
        assert spec.proposer.caught_up_tokens > sum(len(p) for p in prompts)  # all computed
        before, accepted = spec.proposer.caught_up_tokens, stats["spec_accepted_tokens"]
        assert tokens(run_requests(spec, prompts[:1], params)[0]) == want[0]
        assert spec.proposer.caught_up_tokens - before < len(prompts[0]) // 2  # reused
        again = spec.stats()
        rate = (again["spec_accepted_tokens"] - accepted) / (
            again["spec_proposed_tokens"] - stats["spec_proposed_tokens"]
        )
        assert rate > 0.97, again
    finally:
        spec.shutdown()


def test_a_weaker_draft_model_changes_no_token(smollm2, engines, plain_greedy, tmp_path):
    """A draft of the model's first 12 layers proposes what the target often refuses:
    the outputs, batched, greedy and seeded, stay plain decoding's."""
    model, ckpt = smollm2
    plain, _ = engines
    draft_dir = pruned_llama(ckpt.path, tmp_path / "draft", list(range(12)))
    spec = speculating(model, ckpt, SpecConfig(method="draft", k=3, path=str(draft_dir)))
    try:
        prompts = [chat(plain, t) for t in TASKS]
        greedy = SamplingParams(max_tokens=16, temperature=0.0)
        want = [w[:16] for w in plain_greedy.result()]
        assert [tokens(s) for s in run_requests(spec, prompts, greedy)] == want
        stats = spec.stats()
        assert (
            stats["spec_steps"] > 0
            and stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"]
        )
        seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
        first = tokens(run_requests(spec, prompts[:1], seeded)[0])
        assert tokens(run_requests(spec, prompts[:1], seeded)[0]) == first
    finally:
        spec.shutdown()


def test_a_draft_with_another_tokenizer_is_refused(smollm2, tmp_path):
    import json
    import shutil

    from omni.engine.checkpoint import CheckpointError
    from omni.engine.proposers import load_draft

    model, ckpt = smollm2
    other = pruned_llama(ckpt.path, tmp_path / "other", [0])
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    spec = SpecConfig(method="draft", path=str(other))
    with pytest.raises(CheckpointError, match="needs the model's tokenizer"):
        load_draft(spec, model, ckpt.path)
    shutil.rmtree(other)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_draft(spec, model, ckpt.path)


def rope(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [tokens, heads, dim] at positions 0.. (rotate-half form)."""
    angles = torch.arange(x.shape[0])[:, None].float() * inv_freq[None]
    cos, sin = (
        torch.cat([angles, angles], -1).cos()[:, None],
        torch.cat([angles, angles], -1).sin()[:, None],
    )
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def eagle3_reference(model, head, taps, tokens_: list[int], k: int) -> list[int]:
    """EAGLE-3's draft as its paper defines it, dense and from scratch: the target's
    features at every computed position (one prefill), the layer over positions 0..n-1
    reading token t + 1 and feature t, then k tokens, each feeding the layer's output
    back as the next position's feature."""
    import torch.nn.functional as F

    from omni.engine.model_runner import ModelRunner, SoloSequence

    n = len(tokens_) - 1
    SoloSequence(ModelRunner(model, 16, num_blocks=64)).extend(tokens_[:-1])
    features = head.fc(taps.buffer[:n].clone())
    ids, out, cfg = list(tokens_[1:]), [], head.cfg
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for _ in range(k):
        m = len(ids)
        e = model.embed(torch.tensor(ids))
        x = torch.cat([head.input_layernorm(e), head.hidden_norm(features)], -1)
        q, kk, v = (x @ head.self_attn.qkv_proj.weight.T).split([qd, kd, kd], -1)
        q = rope(q.view(m, cfg.num_heads, -1), head.inv_freq)
        kk = rope(kk.view(m, cfg.num_kv_heads, -1), head.inv_freq)
        v = v.view(m, cfg.num_kv_heads, -1)
        group = cfg.num_heads // cfg.num_kv_heads
        kk, v = kk.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        a = F.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        h = features + a.transpose(0, 1).reshape(m, -1) @ head.self_attn.o_proj.weight.T
        h = h + head.mlp(head.post_attention_layernorm(h))
        draft = int(head.lm_head(head.norm(h[-1:])).argmax(-1))
        out.append(draft + int(head.d2t[draft]))
        ids.append(out[-1])
        features = torch.cat([features, h[-1:]])
    return out


@pytest.fixture(scope="module")
def eagle_head(smollm2, tmp_path_factory):
    from omni.testing.checkpoints import eagle3_head

    model, _ = smollm2
    return eagle3_head(tmp_path_factory.mktemp("eagle3"), model.cfg, draft_vocab=4096)


def test_eagle3_drafts_as_the_paper_defines_them(smollm2, engines, plain_greedy, eagle_head):
    """An EAGLE-3 head in the published format, random: its proposals inside the engine
    (features kept from prefill, decode and verify steps, caught up after each, draft
    K/V in the target's blocks) against the dense reference at the same tokens. The
    target is steered onto plain decoding's tokens (the proposals replaced by them, so
    every verify row is accepted and its features used); the output stays plain
    decoding's."""
    model, ckpt = smollm2
    plain, _ = engines
    spec = speculating(model, ckpt, SpecConfig(method="eagle3", k=3, path=str(eagle_head)))
    head, taps = spec.proposer.draft, spec.proposer.taps
    try:
        with torch.no_grad():
            head.lm_head.weight.mul_(50)  # clear winners: no near-ties between two sums
        prompt = chat(plain, TASKS[2])
        params = SamplingParams(max_tokens=24, temperature=0.0)
        want = plain_greedy.result()[2][:24]
        calls, propose = [], spec.proposer.propose

        def steered(seqs, ks):
            drafts = propose(seqs, ks)
            calls.extend((list(s.token_ids), d) for s, d in zip(seqs, drafts, strict=True) if d)
            done = [len(s.token_ids) - len(prompt) for s in seqs]
            return [want[d : d + len(g)] for d, g in zip(done, drafts, strict=True)]

        spec.proposer.propose = steered
        assert tokens(run_requests(spec, [prompt], params)[0]) == want
        assert spec.stats()["spec_acceptance"] == 1.0 and len(calls) >= 4
        for toks, drafted in calls:
            assert drafted == eagle3_reference(model, head, taps, toks, len(drafted))
            assert all(0 <= t < model.cfg.vocab_size for t in drafted)
    finally:
        spec.shutdown()


def test_eagle3_speculation_changes_no_token(smollm2, engines, plain_greedy, eagle_head):
    model, ckpt = smollm2
    plain, _ = engines
    spec = speculating(model, ckpt, SpecConfig(method="eagle3", k=4, path=str(eagle_head)))
    try:
        prompts = [chat(plain, t) for t in TASKS[1:]]
        params = SamplingParams(max_tokens=16, temperature=0.0)
        want = [w[:16] for w in plain_greedy.result()[1:]]
        assert [tokens(s) for s in run_requests(spec, prompts, params)] == want
        assert spec.stats()["spec_steps"] > 0
    finally:
        spec.shutdown()


def test_an_eagle3_head_for_another_model_is_refused(smollm2, tmp_path):
    import json

    from omni.engine.checkpoint import CheckpointError
    from omni.engine.eagle3 import load_eagle3
    from omni.testing.checkpoints import eagle3_head

    model, _ = smollm2
    path = eagle3_head(tmp_path / "h", model.cfg, draft_vocab=64)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with pytest.raises(CheckpointError, match="vocabulary of 1000 tokens"):
        load_eagle3(path, model)
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 7}))
    with pytest.raises(CheckpointError, match=r"mlp\.gate_up_proj\.weight has shape"):
        load_eagle3(path, model)
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_eagle3(tmp_path, model)
