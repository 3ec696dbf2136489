"""DeepSeek-V3 (MLA and DeepSeekMoE) on the CPU engine against HF transformers: logits,
greedy generation under batching, chunked prefill and prefix-cache hits, the router's
choice, the absorbed decode against the expanded form, the latent cache's size, and
speculation and structured outputs keeping plain decoding's tokens."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import save_file

from omni.engine.block_manager import BlockManager
from omni.engine.checkpoint import Checkpoint, CheckpointError
from omni.engine.deepseek_v3 import DeepseekV3ForCausalLM
from omni.engine.engine import Engine
from omni.engine.kernels.grouped_router import grouped_router_ref
from omni.engine.kernels.mla import mla_decode_ref, mla_prefill_ref
from omni.engine.llama import LlamaForCausalLM
from omni.engine.model_runner import ModelRunner, SoloSequence, kv_bytes_per_block
from omni.engine.models import load_model, model_class
from omni.engine.sampling import SamplingParams
from omni.engine.scheduler import Batch
from omni.engine.sequence import Sequence
from omni.engine.tokenizer import TextTokenizer
from omni.testing.checkpoints import save_word_level_tokenizer
from omni.testing.runs import run_requests, tokens

VOCAB = 96
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}


def deepseek_config(q_lora_rank: int | None, rope: dict | None = None, **extra):
    """3 layers (layer 0 dense), top-2 of 8 experts in 4 groups of which 2 are chosen."""
    kw = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        **extra,
    }
    if rope:
        kw["rope_parameters"] = rope
    return transformers.DeepseekV3Config(**kw)


def randomize(hf) -> None:
    """Random weights, not the init's near-zero ones, and a nonzero score bias."""
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)


def hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    """HF's greedy continuation of `prompt`: `new` tokens, no EOS."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def tiny_checkpoint(directory, config):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(hf)
    hf.save_pretrained(directory)
    save_word_level_tokenizer(directory / "tokenizer.json", VOCAB)
    return hf, Checkpoint.open(directory)


# q through its low-rank pair, interleaved rope; q_proj with YaRN (its mscale in the
# softmax scale) and rotate-half rope
CASES = {
    "q_lora": (24, None, {}),
    "q_proj_yarn": (None, YARN, {"rope_interleave": False}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    q_lora_rank, rope, extra = CASES[request.param]
    config = deepseek_config(q_lora_rank, rope, **extra)
    return tiny_checkpoint(tmp_path_factory.mktemp(request.param), config)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_logits_match_transformers_through_chunks_decode_and_a_batch(tiny):
    hf, ckpt = tiny
    model = DeepseekV3ForCausalLM.load(ckpt)
    moe_layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "shared")]
    assert moe_layers and all(  # the shared expert runs as a stacked one, after the routed
        m.shared == 1 and m.shared_experts is None and m.experts.gate_up.shape[0] == 8 + 1
        for m in moe_layers
    )
    # q's first projection and the latent's run as one
    assert all(hasattr(layer.self_attn, "q_kv_a_proj") for layer in model.model.layers)
    assert not any(hasattr(layer.self_attn, "kv_a_proj_with_mqa") for layer in model.model.layers)
    runner = ModelRunner(model, block_size=8, num_blocks=64)
    # chunked prefill (17 + 13 in chunks of 5), then one token at a time: the absorbed form
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    solo = SoloSequence(runner)
    ours = torch.cat(
        [solo.extend(ids[:17], all_logits=True), solo.extend(ids[17:30], chunk=5, all_logits=True)]
        + [solo.extend([t], all_logits=True) for t in ids[30:]]
    )
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=0)
    # ragged prompts in one step, then two steps of them decoding side by side
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    rng = torch.Generator().manual_seed(3)
    seqs = [
        Sequence(token_ids=torch.randint(0, VOCAB, (n,), generator=rng).tolist())
        for n in (5, 23, 12)
    ]
    for seq in seqs:
        blocks.allocate(seq)
    batch = Batch(seqs, [len(s.token_ids) for s in seqs])
    for step in range(3):
        logits = runner.run(batch, all_logits=True).split(batch.num_tokens)
        for seq, got in zip(seqs, logits, strict=True):
            want = hf_logits(hf, seq.token_ids)[seq.num_computed :]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for seq, n in zip(seqs, batch.num_tokens, strict=True):
            seq.num_computed += n
            seq.token_ids.append((11 * step + len(seq.token_ids)) % VOCAB)
            blocks.append_slot(seq)
        batch = Batch(seqs, [1] * len(seqs))
        assert step == 0 or runner.prepare(batch)[1].num_decodes == 3  # absorbed rows


def test_greedy_generation_matches_transformers_with_chunks_prefix_hits_and_batching(tiny):
    hf, ckpt = tiny
    # 24 tokens a step: prompts are prefilled in chunks, beside other sequences' decodes
    engine = Engine(
        DeepseekV3ForCausalLM.load(ckpt),
        TextTokenizer(ckpt),
        block_size=8,
        num_blocks=48,
        max_batch_tokens=24,
    )
    rng = torch.Generator().manual_seed(1)
    shared = torch.randint(0, VOCAB, (24,), generator=rng).tolist()
    first = [torch.randint(0, VOCAB, (n,), generator=rng).tolist() for n in (7, 31, 18)]
    second = [shared + torch.randint(0, VOCAB, (n,), generator=rng).tolist() for n in (3, 9)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        run_requests(engine, [[*shared, 1, 2, 3]], params)  # the shared prefix, cached
        results = run_requests(engine, first, params) + run_requests(engine, second, params)
    finally:
        engine.shutdown()
    assert all(r[-1].cached_tokens >= 16 for r in results[3:])  # whole blocks of the prefix
    for prompt, steps in zip(first + second, results, strict=True):
        assert tokens(steps) == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize(("experts", "groups", "top_groups", "k"), [(8, 4, 2, 2), (16, 1, 1, 4)])
def test_the_router_picks_exactly_hfs_experts_and_weights(experts, groups, top_groups, k):
    config = deepseek_config(
        24, n_routed_experts=experts, n_group=groups, topk_group=top_groups, num_experts_per_tok=k
    )
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 64, generator=gen) * 0.3)
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.5)
        x = torch.randn(200, 64, generator=gen)
        _, want_w, want_ids = router(x)
    weights, ids = grouped_router_ref(
        x, router.weight, router.e_score_correction_bias, k, groups, top_groups, True, 2.5
    )
    got_order, want_order = ids.argsort(dim=1), want_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, got_order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, got_order), want_w.gather(1, want_order))
    # the bias changes the choice (else the test would not see it used)
    _, unbiased = grouped_router_ref(x, router.weight, torch.zeros(experts), k, groups,
                                     top_groups, True, 2.5)  # fmt: skip
    assert not torch.equal(unbiased.sort(dim=1).values, ids.sort(dim=1).values)


def test_absorbed_decode_computes_what_the_expanded_form_computes():
    """One query a sequence over a paged latent cache: attention in the latent space, then
    kv_b_proj's V part, equals expanding every cached latent to per-head K and V."""
    gen = torch.Generator().manual_seed(5)
    heads, latent, rope, nope, v_dim, block = 4, 32, 8, 16, 16, 8
    cache = torch.randn(12, block, 1, latent + rope, generator=gen)
    kv_b = torch.randn(heads * (nope + v_dim), latent, generator=gen) * 0.2
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    seq_lens = torch.tensor([19, 30], dtype=torch.int32)
    q = torch.randn(2, heads, nope + rope, generator=gen)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    want = mla_prefill_ref(q, cache, kv_b, tables, seq_lens, cu, 0.2, nope, v_dim)
    w_uk, w_uv = kv_b.view(heads, nope + v_dim, latent).split([nope, v_dim], dim=1)
    q_latent = torch.einsum("shd,hdr->shr", q[..., :nope], w_uk)
    attended = mla_decode_ref(torch.cat([q_latent, q[..., nope:]], -1), cache, tables, seq_lens,
                              0.2, latent)  # fmt: skip
    got = torch.einsum("shr,hvr->shv", attended, w_uv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_holds_the_latent_and_rope_key_alone(tmp_path, dtype):
    """(kv_lora_rank + qk_rope_head_dim) x dtype bytes a token a layer, no V."""
    _, ckpt = tiny_checkpoint(tmp_path, deepseek_config(24))
    model = DeepseekV3ForCausalLM.load(ckpt, dtype=dtype)
    per_token_layer = (32 + 8) * dtype.itemsize
    assert kv_bytes_per_block(model, 16) == 3 * 16 * per_token_layer
    runner = ModelRunner(model, block_size=16, num_blocks=4)
    assert runner.k_cache.shape == (3, 4, 16, 1, 40) and runner.k_cache.dtype == dtype
    assert runner.v_cache.numel() == 0
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert runner.memory_bytes() == weights + 3 * 4 * 16 * per_token_layer


def test_prediction_layers_are_skipped_and_the_registry_names_the_class(tmp_path):
    """A checkpoint with a multi-token-prediction layer (index num_hidden_layers) loads
    without it; the architecture picks the class, as Kimi K2's model_type does."""
    _, ckpt = tiny_checkpoint(tmp_path, deepseek_config(24))
    state = ckpt.load_tensors("cpu", torch.float32)
    mtp = {
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64),
    }
    save_file({**state, **mtp}, str(tmp_path / "model.safetensors"))
    model = DeepseekV3ForCausalLM.load(Checkpoint.open(tmp_path))
    assert len(model.model.layers) == 3
    assert model_class(ckpt) is DeepseekV3ForCausalLM
    kimi = Checkpoint(tmp_path, {"architectures": ["KimiK2ForCausalLM"], "model_type": "kimi_k2"})
    assert model_class(kimi) is DeepseekV3ForCausalLM
    llama = Checkpoint(tmp_path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert model_class(llama) is LlamaForCausalLM
    with pytest.raises(CheckpointError, match=r"split over 3 ranks: attention heads \(4\)"):
        DeepseekV3ForCausalLM.load(ckpt, tp=3)  # refused before anything is read
    with pytest.raises(CheckpointError, match="no FP8 KV cache for DeepSeek-V3"):
        load_model(ckpt, "cuda", kv_cache_dtype="fp8")  # refused before anything touches a GPU
    del state["model.layers.2.mlp.gate.e_score_correction_bias"]
    with pytest.raises(CheckpointError, match="e_score_correction_bias"):
        DeepseekV3ForCausalLM.from_state(model.cfg, state, "ckpt")


def test_speculation_and_a_grammar_keep_the_tokens_plain_decoding_emits(tmp_path, text_model_dir):
    """The tiny DeepSeek with SmolLM2's tokenizer (so that JSON can be spelled): n-gram
    speculation (verify steps of several rows a sequence, through MLA and the routed
    experts) emits the very greedy tokens plain decoding emits, with and without a JSON
    schema's grammar masking every verify row."""
    import json
    import shutil

    from omni.engine.grammar import GrammarSpec
    from omni.engine.speculative import SpecConfig

    vocab = transformers.AutoTokenizer.from_pretrained(text_model_dir).vocab_size
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(deepseek_config(24, vocab_size=vocab))
    randomize(hf)
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text_model_dir / name, tmp_path / name)
    ckpt = Checkpoint.open(tmp_path)
    model = DeepseekV3ForCausalLM.load(ckpt)
    plain = Engine(model, TextTokenizer(ckpt), block_size=8, num_blocks=64)
    spec = Engine(
        model, TextTokenizer(ckpt), block_size=8, num_blocks=64, speculative=SpecConfig(k=4)
    )
    rng = torch.Generator().manual_seed(2)
    phrase = torch.randint(0, vocab, (9,), generator=rng).tolist()
    prompts = [phrase * 3, torch.randint(0, vocab, (13,), generator=rng).tolist() + phrase * 2]
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["zebra quartz", "zebra quince"]}},
        "required": ["colour"],
    }
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    masked = SamplingParams(max_tokens=40, temperature=0, grammar=GrammarSpec.json_schema(schema))
    try:
        for params in (free, masked):
            want = [tokens(s) for s in run_requests(plain, prompts, params)]
            got = run_requests(spec, prompts, params)
            assert [tokens(s) for s in got] == want
        answers = [json.loads("".join(s.text for s in steps)) for steps in got]
        assert all(a["colour"] in schema["properties"]["colour"]["enum"] for a in answers)
        stats = spec.stats()  # verify steps ran, and kept some of their proposals
        assert stats["spec_steps"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    finally:
        plain.shutdown()
        spec.shutdown()
