"""A Llama-3-8B-shaped model (random bf16 weights, made in process) on the GPU.

Against HF transformers on a 512-token prompt, and 64 concurrent requests
against the same requests run one at a time (device machine only).
"""

from __future__ import annotations

import pytest
import torch

from omni.testing.checkpoints import LLAMA3_8B, text_tokenizer
from omni.testing.runs import run_requests, tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models():
    import transformers

    from omni.engine.llama import LlamaForCausalLM

    hf_cfg = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    ours = LlamaForCausalLM.from_state(LLAMA3_8B, dict(hf.state_dict()))  # the same tensors
    return hf, ours


def test_logits_on_a_512_token_prompt_match_transformers(models):
    from omni.engine.model_runner import ModelRunner, SoloSequence

    hf, ours = models
    ids = torch.randint(0, 128256, (512,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids[None].cuda()).logits[0].float()
    got = SoloSequence(ModelRunner(ours, num_blocks=64)).extend(ids.tolist(), all_logits=True)
    rel = ((got - want).norm() / want.norm()).item()
    print(f"relative error of the logits against transformers: {rel:.2e}")
    assert rel < 2e-2, rel


def test_64_concurrent_requests_match_one_at_a_time(models, tmp_path):
    from omni.engine.engine import Engine
    from omni.engine.sampling import SamplingParams

    _, ours = models
    engine = Engine(ours, text_tokenizer(tmp_path, LLAMA3_8B.vocab_size), num_blocks=2048)
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(0, 128256, (int(n),), generator=gen).tolist()
        for n in torch.randint(16, 600, (64,), generator=gen)
    ]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    def run(batch_of_prompts):
        return [tokens(r) for r in run_requests(engine, batch_of_prompts, params, 600)]

    try:
        together = run(prompts)
        alone = [run([p])[0] for p in prompts]
    finally:
        engine.shutdown()
    assert engine.scheduler.preemptions == 0  # a recompute is not bit-exact (other kernel)
    same = sum(a == b for a, b in zip(together, alone, strict=True))
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        for a, b in zip(together, alone, strict=True)
    ]
    assert same == 64, f"{same}/64 identical; first differing token per request: {first_diff}"


def speculating(ours, method: str, tmp_path):
    """(SpecConfig, draft) for each proposer: n-grams; the model as its own draft (the
    GPU's kernels are batch-invariant, so it must accept every proposal); a random
    EAGLE-3 head of the published format and the model's shape."""
    from omni.engine.eagle3 import load_eagle3
    from omni.engine.spec_config import SpecConfig
    from omni.testing.checkpoints import eagle3_head

    if method == "ngram":
        return SpecConfig(k=4), None
    if method == "draft":
        return SpecConfig(method="draft", k=4, path="/the-model-itself"), ours
    head_dir = eagle3_head(tmp_path / "eagle3", LLAMA3_8B, draft_vocab=32000)
    head, taps = load_eagle3(head_dir, ours)
    ours.taps = taps
    return SpecConfig(method="eagle3", k=4, path=str(head_dir)), (head, taps)


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3"])
def test_speculative_greedy_outputs_are_plain_decodings_bits(models, tmp_path, method):
    """Speculation on the GPU (verify rows through the decode graphs; a draft's steps
    through its own): each request's tokens alone and 8 together are the tokens plain
    decoding gives."""
    from omni.engine.engine import Engine
    from omni.engine.sampling import SamplingParams

    _, ours = models
    tok = text_tokenizer(tmp_path, LLAMA3_8B.vocab_size)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128256, (40,), generator=gen).tolist() * 3 for _ in range(8)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = Engine(ours, tok, num_blocks=1024)
    try:
        want = [tokens(r) for r in run_requests(plain, prompts, params, 600)]
    finally:
        plain.shutdown()
    config, draft = speculating(ours, method, tmp_path)
    spec = Engine(ours, tok, num_blocks=1024, speculative=config, draft=draft)
    try:
        alone = [tokens(run_requests(spec, [p], params, 600)[0]) for p in prompts]
        together = [tokens(r) for r in run_requests(spec, prompts, params, 600)]
        stats = spec.stats()
    finally:
        spec.shutdown()
        ours.taps = None
    print(method, stats)
    assert stats["spec_steps"] > 0
    assert alone == want and together == want
    if method == "draft":
        assert stats["spec_acceptance"] > 0.9  # (near-ties of random logits may flip)


def test_hidden_taps_in_a_cuda_graph_are_the_eager_steps(models):
    """An EAGLE-3 head's features: what a decode step's graph replay leaves in the taps
    is, bit for bit, what the same step run eagerly leaves."""
    from omni.engine.eagle3 import HiddenTaps
    from omni.engine.model_runner import ModelRunner
    from omni.engine.scheduler import Batch
    from omni.engine.sequence import Sequence

    _, ours = models
    ours.taps = taps = HiddenTaps((2, 16, 29), LLAMA3_8B.hidden_size, torch.bfloat16, "cuda")
    taps.fit(64)
    try:
        runner = ModelRunner(ours, 16, num_blocks=256)
        gen = torch.Generator().manual_seed(5)
        seqs = []
        for i in range(6):
            prompt = torch.randint(0, 128256, (30 + 7 * i,), generator=gen).tolist()
            seq = Sequence(token_ids=prompt, block_table=list(range(8 * i, 8 * i + 8)))
            runner.run(Batch([seq], [len(prompt)]))
            seq.num_computed = len(prompt)
            seq.token_ids.append(int(torch.randint(0, 128256, (1,), generator=gen)))
            seqs.append(seq)
        batch = Batch(seqs, [1] * len(seqs))
        runner.run(batch)  # decode-only: the graph of its bucket (captured here)
        assert runner.graphs is not None and runner.graphs.graphs
        replayed = taps.buffer[: len(seqs)].clone()
        taps.buffer.zero_()
        ids, step = runner.prepare(batch)
        ours.hidden_states(ids, step, runner.k_cache, runner.v_cache)  # eager
        assert torch.equal(taps.buffer[: len(seqs)], replayed)
        assert replayed.abs().sum() > 0
    finally:
        ours.taps = None


def test_eagle3_decode_graphs_propose_what_eager_steps_propose(models, tmp_path):
    """The head's draft steps replay CUDA graphs that read their features in place:
    the tokens they propose are those of the same steps run eagerly."""
    from omni.engine.block_manager import BlockManager
    from omni.engine.model_runner import ModelRunner
    from omni.engine.proposers import FeatureProposer
    from omni.engine.scheduler import Batch
    from omni.engine.sequence import Sequence

    _, ours = models
    config, (head, taps) = speculating(ours, "eagle3", tmp_path)
    taps.fit(1024)
    try:
        runner = ModelRunner(ours, 16, num_blocks=256)
        proposals = []
        for graphs in (True, False):
            blocks = BlockManager(runner.num_blocks, runner.block_size)
            proposer = FeatureProposer(config, head, taps, runner, blocks)
            if not graphs:
                proposer.runner.graphs = None
            gen = torch.Generator().manual_seed(9)
            seqs = []
            for i in range(5):
                seq = Sequence(
                    token_ids=torch.randint(0, 128256, (50 + 9 * i,), generator=gen).tolist()
                )
                blocks.allocate(seq)
                blocks.reserve(seq, len(seq.token_ids) + 8)
                seqs.append(seq)
            counts = [len(s.token_ids) - 1 for s in seqs]
            runner.run(Batch(seqs, counts))
            proposer.observe(seqs, counts)
            for seq, n in zip(seqs, counts, strict=True):
                seq.num_computed = n
            proposals.append(proposer.propose(seqs, [6, 1, 3, 6, 2]))
            if graphs:
                assert proposer.runner.graphs.graphs  # the draft steps replayed graphs
        assert proposals[0] == proposals[1]
        assert [len(p) for p in proposals[0]] == [6, 1, 3, 6, 2]
    finally:
        ours.taps = None
