"""FP8 (W8A8) on the CPU: the math's reference, quantizing at load, the Hub's FP8
checkpoints, clear errors, and the accuracy on the real SmolLM2 weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.fp8_accuracy import VARIANTS, measure
from omni.engine.checkpoint import Checkpoint, CheckpointError
from omni.engine.fp8 import Fp8Linear, quantize_weight
from omni.engine.kernels.e4m3 import FP8, fp8_linear_ref, quantize_rows
from omni.engine.llama import LlamaForCausalLM
from omni.testing.runs import greedy_steps

from ..test_engine import ARCHES, tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_rows_use_the_whole_range_and_round_within_e4m3_precision():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 200, generator=gen) * torch.logspace(-3, 3, 33)[:, None]  # per-row scale
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (33,)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((33,), 448.0))
    err = (q.float() * scale[:, None] - x).abs()
    # 3 mantissa bits: half a step of 1/8 relative, or the subnormal step (2^-9) near zero
    assert (err <= x.abs() / 16 + scale[:, None] * 2**-9).all()


def test_the_linear_is_the_exact_sum_of_the_quantized_products():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 96, generator=gen), torch.randn(40, 96, generator=gen) * 0.05
    bias = torch.randn(40, generator=gen)
    wq, ws = quantize_rows(w)
    y = fp8_linear_ref(x, wq, ws, bias)
    xq, xs = quantize_rows(x)
    exact = (xq.double() * xs[:, None].double()) @ (wq.double() * ws[:, None].double()).T
    torch.testing.assert_close(y.double(), exact + bias.double(), rtol=1e-5, atol=1e-5)
    full = x @ w.T + bias  # and near the unquantized one
    assert torch.nn.functional.cosine_similarity(y, full, dim=1).min() > 0.995


def hub_fp8_checkpoint(src: Checkpoint, dst: Path, strategy: str) -> Checkpoint:
    """`src` as the Hub publishes FP8 models (compressed-tensors): each projection's
    weight in e4m3 with its scale ([N, 1] per channel, [1] per tensor), the rest as is."""
    dst.mkdir()
    state = {}
    for f in src.shard_files():
        state |= load_file(str(f))
    for name in [n for n in state if any(f".{p}.weight" in n for p in PROJECTIONS)]:
        w = state[name]
        if strategy == "channel":  # (the scales omnid picks when it quantizes at load)
            q, scale = quantize_weight(w)
            scale = scale[:, None]
        else:
            q, s = quantize_rows(w.reshape(1, -1))
            q, scale = q.view_as(w), s
        state[name], state[name + "_scale"] = q, scale.float()
    save_file(state, str(dst / "model.safetensors"))
    config = dict(src.config)
    scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    tokens = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    group = {"targets": ["Linear"], "weights": scheme, "input_activations": tokens}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "tokenizer.json").write_bytes((src.path / "tokenizer.json").read_bytes())
    return Checkpoint.open(dst)


def test_a_hub_fp8_checkpoint_loads_as_the_same_model_quantized_at_load(tmp_path):
    _, ckpt = tiny_checkpoint(tmp_path / "bf16", ARCHES["llama"]())
    prompts = [[5, 17, 3, 40, 8], [9, 61, 2]]
    quantized = LlamaForCausalLM.load(ckpt, quantization="fp8", reference=True)
    layer = quantized.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    assert layer.mlp.down_proj.weight.dtype == FP8
    assert quantized.lm_head.weight.dtype == torch.float32  # the lm head stays
    tokens, logits = greedy_steps(quantized, prompts, 6)
    hub = LlamaForCausalLM.load(hub_fp8_checkpoint(ckpt, tmp_path / "hub", "channel"),
                                reference=True)  # fmt: skip
    assert hub.cfg.quantization == "fp8"
    hub_tokens, hub_logits = greedy_steps(hub, prompts, 6)
    assert hub_tokens == tokens  # the same e4m3 weights and scales: the same numbers
    for a, b in zip(hub_logits, logits, strict=True):
        assert torch.equal(a, b)
    # per-tensor scales: one per weight, repeated per row; near the bf16 model still
    whole = LlamaForCausalLM.load(hub_fp8_checkpoint(ckpt, tmp_path / "t", "tensor"),
                                  reference=True)  # fmt: skip
    _, whole_logits = greedy_steps(whole, prompts, 6, forced=tokens)
    _, bf16_logits = greedy_steps(LlamaForCausalLM.load(ckpt), prompts, 6, forced=tokens)
    for a, b in zip(whole_logits, bf16_logits, strict=True):
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98


def test_what_fp8_cannot_do_says_so(tmp_path):
    _, ckpt = tiny_checkpoint(tmp_path / "bf16", ARCHES["llama"]())
    with pytest.raises(CheckpointError, match="need a GPU with FP8 tensor cores"):
        LlamaForCausalLM.load(ckpt, quantization="fp8")  # serving on the CPU: refused
    with pytest.raises(CheckpointError, match="quantization 'int4' is not one of"):
        LlamaForCausalLM.load(ckpt, quantization="int4")
    hub = hub_fp8_checkpoint(ckpt, tmp_path / "hub", "channel")
    config = json.loads((hub.path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (hub.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="block-wise FP8 scales"):
        LlamaForCausalLM.load(Checkpoint.open(hub.path), reference=True)
    config["quantization_config"] = {"quant_method": "awq"}
    (hub.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization method 'awq' is not supported"):
        LlamaForCausalLM.load(Checkpoint.open(hub.path), reference=True)
    _, moe = tiny_checkpoint(tmp_path / "moe", ARCHES["mixtral"]())
    with pytest.raises(CheckpointError, match="FP8 is for dense models"):
        LlamaForCausalLM.load(moe, quantization="fp8", reference=True)


# What each FP8 variant reaches on SmolLM2 against bf16 (bench/fp8_accuracy.py measures
# it, bench/results/fp8-accuracy-*.json): the tests hold these lines. The issue asks for
# perplexity within 2% and cosine >= 0.99; the README says where the scheme falls short.
HELD = {  # variant: (perplexity ratio at most, mean cosine at least)
    "w8a8": (1.035, 0.997),
    "kv_cache": (1.02, 0.998),
    "w8a8+kv_cache": (1.045, 0.996),
}


def hold_the_line(figures: dict[str, dict]) -> None:
    for name, f in figures.items():
        ratio, cosine = HELD[name]
        assert 1.0 < f["perplexity_ratio"] <= ratio, (name, f)
        assert f["cosine_mean"] >= cosine and f["share_cosine_ge_0.99"] >= 0.9, (name, f)


def test_fp8_stays_near_bf16_on_smollm2_over_1000_tokens(text_model_dir):
    """The real weights and a fixed text (tests/data/accuracy_text.md: the opening of this
    repository's README as of this test), bf16 against FP8 weights and KV cache together
    on the CPU reference. One variant over the text's first 1,000 tokens (on this
    repository's 2-core CPU: 28 s with both threads, 44 s with the one make test gives
    each worker); all 2,000 with every variant are bench/fp8_accuracy.py's (2,000 tokens
    there: ratio 1.018, mean cosine 0.9970; 1,000 here: 1.008, 0.9967)."""
    variants = {"w8a8+kv_cache": VARIANTS["w8a8+kv_cache"]}
    hold_the_line(measure(Checkpoint.open(text_model_dir), "cpu", variants, tokens=1000))


GPU_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_FP8, reason="needs FP8 tensor cores")
def test_the_w8a8_kernel_computes_the_reference_and_rows_do_not_depend_on_the_batch():
    from omni.engine.kernels import w8a8 as kernel

    gen = torch.Generator(device="cuda").manual_seed(3)
    k, n = 4096, 6144
    x = torch.randn(300, k, generator=gen, device="cuda").to(torch.bfloat16)
    x[:, 7] *= 30  # an outlier channel, as real activations have
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    wq, ws = quantize_weight(w)
    xq, xs = kernel.quantize_rows(x)
    ref_q, ref_s = quantize_rows(x)
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(xs, ref_s)
    y = kernel.fp8_linear(x, wq, ws, bias)
    torch.testing.assert_close(y, fp8_linear_ref(x, wq, ws, bias), rtol=3e-2, atol=3e-2)  # bf16 out
    # every kernel: the few-rows one (1, 3, 16 rows), the pointer one (64), the TMA one
    # (200, 300)
    for rows in (slice(0, 1), slice(7, 10), slice(5, 21), slice(40, 104), slice(100, 300)):
        assert torch.equal(kernel.fp8_linear(x[rows], wq, ws, bias), y[rows]), rows
    # past VENDOR_MIN_ROWS on Hopper, torch._scaled_mm: the kernels' bits (no bias: theirs
    # is not added in our order). A size's first call compares the two and returns ours.
    big = torch.randn(3000, k, generator=gen, device="cuda").to(torch.bfloat16)
    first, again = kernel.fp8_linear(big, wq, ws), kernel.fp8_linear(big, wq, ws)
    assert torch.equal(first, again)
    if torch.cuda.get_device_capability()[0] == 9:
        assert kernel._VENDOR_GIVES_OUR_BITS[(big.device.index, n, k, 4096)] is True
    for rows in (slice(0, 1), slice(5, 21), slice(100, 300), slice(0, 1500), slice(0, 1500)):
        assert torch.equal(kernel.fp8_linear(big[rows], wq, ws), again[rows]), rows
    # a down projection's shape (K 14,336: the few-rows kernel's deeper pipeline), and rows
    # too long to quantize in one read
    for k, n in ((14336, 4096), (20000, 512)):
        x = torch.randn(80, k, generator=gen, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
        wq, ws = quantize_weight(w)
        xq, xs = kernel.quantize_rows(x)
        ref_q, ref_s = quantize_rows(x)
        assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)), k
        assert torch.equal(xs, ref_s), k
        y = kernel.fp8_linear(x, wq, ws)
        for rows in (slice(0, 1), slice(60, 76)):
            assert torch.equal(kernel.fp8_linear(x[rows], wq, ws), y[rows]), (k, rows)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_FP8, reason="needs FP8 tensor cores")
def test_an_fp8_model_runs_on_the_gpu_with_cuda_graphs_near_bf16(tmp_path):
    _, ckpt = tiny_checkpoint(tmp_path / "bf16", ARCHES["qwen2"]())  # biases: the epilogue's
    prompts = [[5, 17, 3, 40, 8], [9, 61, 2]]
    bf16 = LlamaForCausalLM.load(ckpt, "cuda", torch.bfloat16)
    tokens, want = greedy_steps(bf16, prompts, 6)
    fp8 = LlamaForCausalLM.load(ckpt, "cuda", torch.bfloat16, quantization="fp8")
    assert fp8.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
    _, got = greedy_steps(fp8, prompts, 6, forced=tokens)
    for a, b in zip(got, want, strict=True):
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_FP8, reason="needs FP8 tensor cores")
def test_a_norm_hands_its_fp8_projection_the_rows_quantize_rows_would_give(tmp_path):
    """The norm kernel's e4m3 rows (kernels/norm.py, `quantize`): quantize_rows' bits on its
    output, and an FP8 model's logits the same with them as without."""
    from omni.engine.kernels import norm
    from omni.engine.kernels import w8a8 as kernel
    from omni.engine.kernels.e4m3 import attached_rows

    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(300, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    x[:, 9] *= 40  # an outlier channel
    res = torch.randn(300, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.rand(4096, generator=gen, device="cuda").to(torch.bfloat16) + 0.5
    out, new_res = norm.rms_norm(x, w, 1e-5, res, quantize=True)
    plain, plain_res = norm.rms_norm(x, w, 1e-5, res)
    assert torch.equal(out, plain) and torch.equal(new_res, plain_res)
    q, scale = attached_rows(out)
    want_q, want_scale = kernel.quantize_rows(out)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    assert attached_rows(plain) is None

    _, ckpt = tiny_checkpoint(tmp_path / "bf16", ARCHES["qwen2"]())
    prompts = [[5, 17, 3, 40, 8], [9, 61, 2]]
    fp8 = LlamaForCausalLM.load(ckpt, "cuda", torch.bfloat16, quantization="fp8")
    norms = [m for m in fp8.modules() if getattr(m, "feeds_fp8", False)]
    assert len(norms) == 2 * len(fp8.model.layers)
    tokens, fused = greedy_steps(fp8, prompts, 6)
    for m in norms:
        m.feeds_fp8 = False
    _, separate = greedy_steps(fp8, prompts, 6, forced=tokens)
    assert all(torch.equal(a, b) for a, b in zip(fused, separate, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_FP8, reason="needs FP8 tensor cores")
def test_fp8_on_the_gpu_stays_near_bf16_on_smollm2_over_2000_tokens(text_model_dir):
    """The same text through the Triton kernels: W8A8, the e4m3 KV cache, and both."""
    figures = measure(Checkpoint.open(text_model_dir), "cuda", VARIANTS)
    print(figures)
    hold_the_line(figures)
