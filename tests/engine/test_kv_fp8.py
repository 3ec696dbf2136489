"""The FP8 KV cache (kv_cache.py): scales that bound every value, the attention kernels
over an e4m3 cache against the reference, the pool's size, and a model served on it."""

from __future__ import annotations

import math

import pytest
import torch

from omni.engine.checkpoint import CheckpointError
from omni.engine.kernels import (
    paged_attention_ref,
    paged_decode,
    paged_prefill,
    rope_and_cache,
    rope_and_cache_ref,
)
from omni.engine.kernels.e4m3 import FP8, FP8_MAX
from omni.engine.kernels.norm import rms_norm_ref
from omni.engine.kv_cache import head_bounds
from omni.engine.llama import LlamaForCausalLM
from omni.engine.model_runner import ModelRunner
from omni.testing.runs import greedy_steps

from ..test_engine import ARCHES, tiny_checkpoint
from .test_kernels import BLOCK, DEVICE, GPU, SHAPE, TOL, paged_batch, rand

GPU_FP8 = GPU and torch.cuda.get_device_capability() >= (8, 9)


def to_fp8(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache's values in e4m3 with a scale per KV head (dim 2): (e4m3 cache, [kv] scales)."""
    scales = cache.float().abs().amax(dim=(0, 1, 3)) / FP8_MAX * 1.5
    return (cache.float() / scales[None, None, :, None]).to(FP8), scales


@pytest.fixture
def gen():
    g = torch.Generator(device=DEVICE)
    g.seed()
    return g


def layer_kv(model: LlamaForCausalLM, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's rotated K and its V for hidden states x, as the reference computes them."""
    layer = model.model.layers[0]
    attn, cfg, n = layer.self_attn, model.cfg, x.shape[0]
    h = rms_norm_ref(x, layer.input_layernorm.weight, cfg.rms_norm_eps)[0]
    q, k, v = attn.qkv_proj(h).split([attn.q_dim, attn.kv_dim, attn.kv_dim], dim=-1)
    shape = (n, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.zeros(1, n, *shape[1:]) for _ in range(2)]
    norms = (attn.q_norm.weight, attn.k_norm.weight, cfg.rms_norm_eps) if cfg.qk_norm else None
    positions = torch.randint(0, 200, (n,))
    rope_and_cache_ref(
        q.reshape(n, -1, cfg.head_dim),
        k.reshape(shape),
        v.reshape(shape),
        positions,
        model.inv_freq,
        *caches,
        torch.arange(n),
        norms,
    )
    return caches[0][0], caches[1][0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # rope only; biases; K norms
def test_head_bounds_hold_for_any_input_and_are_reached(arch, tmp_path):
    """No input exceeds a head's bound (so an FP8 cache never saturates), and the input
    that lines up with V's largest row reaches it: the bound is the least that holds."""
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES[arch]())
    model = LlamaForCausalLM.load(ckpt)
    attn, layer = model.model.layers[0].self_attn, model.model.layers[0]
    bounds = head_bounds(attn, layer.input_layernorm.weight)
    x = torch.randn(512, model.cfg.hidden_size) * torch.rand(512, 1) * 50
    x[::7, 3] *= 100  # outlier channels, as real hidden states have
    k, v = layer_kv(model, x)
    assert (k.abs().amax(dim=(0, 2)) <= bounds[0]).all()
    assert (v.abs().amax(dim=(0, 2)) <= bounds[1]).all()
    assert (k.abs().amax(dim=(0, 2)) > bounds[0] / 50).all()  # and not absurdly loose
    if arch == "llama":  # no bias: the bound is reached
        w = attn.qkv_proj.weight[attn.q_dim + attn.kv_dim :] * layer.input_layernorm.weight
        row = int(w.norm(dim=1).argmax())
        worst = w[row] / w[row].norm() * math.sqrt(w.shape[1])  # RMS 1: the norm keeps it
        _, v = layer_kv(model, worst[None])
        head = row // model.cfg.head_dim
        assert 0.999 < v[0, head].abs().max() / bounds[1, head] <= 1.0 + 1e-6


def test_attention_kernels_read_an_fp8_cache_as_the_reference_does(gen):
    """Decode and prefill over an e4m3 cache with per-head scales, against the reference
    over the same cache; decode's bits do not depend on its programs."""
    seq_lens, q_lens = [37, 300, 16], [1, 1, 1]
    if GPU:
        seq_lens = [600, 4161, 17]
    q, kc, vc, table, lens, cu = paged_batch(gen, seq_lens, q_lens)
    kc, vc = kc * 3, vc * 0.2  # scales away from one
    (k8, k_s), (v8, v_s) = to_fp8(kc), to_fp8(vc)
    scales = torch.stack([k_s, v_s]).to(DEVICE)
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_ref(q, k8, v8, table, lens, cu, scale, scales)
    assert not torch.allclose(ref, paged_attention_ref(q, kc, vc, table, lens, cu, scale))
    outs = [
        paged_decode(q, k8, v8, table, lens, scale, programs=n, kv_scales=scales) for n in (1, 4)
    ]
    torch.testing.assert_close(outs[0], ref, **TOL)
    assert torch.equal(outs[0], outs[1])
    seq_lens, q_lens = [40, 23], [40, 5]
    q, kc, vc, table, lens, cu = paged_batch(gen, seq_lens, q_lens)
    (k8, k_s), (v8, v_s) = to_fp8(kc), to_fp8(vc * 0.1)
    scales = torch.stack([k_s, v_s]).to(DEVICE)
    out = paged_prefill(q, k8, v8, table, lens, cu, scale, block_m=16, kv_scales=scales)
    torch.testing.assert_close(
        out, paged_attention_ref(q, k8, v8, table, lens, cu, scale, scales), **TOL
    )
    with pytest.raises(ValueError, match="needs its kv_scales"):
        paged_decode(q, k8, v8, table, lens, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_FP8, reason="needs a GPU with FP8")
def test_rope_writes_the_fp8_cache_as_the_reference_does(gen):
    """GPU only: Triton's interpreter rounds fp32 to e4m3 wrongly where the rounding
    carries into the exponent (3.9: 31.66 -> 16, not 32)."""
    n_q, n_kv, dim, _ = SHAPE
    tokens, n_blocks = 40, 8
    q, k, v = (
        rand(tokens, n_q, dim, gen=gen),
        rand(tokens, n_kv, dim, gen=gen),
        rand(tokens, n_kv, dim, gen=gen),
    )
    k[:, 1] *= 20  # heads of different sizes: their own scales
    positions = torch.randint(0, 4000, (tokens,), generator=gen, device=DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    slots = torch.randperm(n_blocks * BLOCK, generator=gen, device=DEVICE)[:tokens]
    slots[::5] = -1
    scales = torch.stack([k.float().abs().amax(dim=(0, 2)), v.float().abs().amax(dim=(0, 2))])
    scales = (scales / 300).contiguous()
    caches = [torch.zeros(n_blocks, BLOCK, n_kv, dim, dtype=FP8, device=DEVICE) for _ in range(4)]
    q_out = rope_and_cache(q, k, v, positions, inv_freq, *caches[:2], slots, None, scales)
    q_ref = rope_and_cache_ref(q, k, v, positions, inv_freq, *caches[2:], slots, None, scales)
    torch.testing.assert_close(q_out, q_ref, **TOL)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        got, want = got.float(), want.float()
        assert ((got - want).abs() <= want.abs() / 8 + 2**-9).all()  # one e4m3 step at most
        assert (got == want).float().mean() > 0.95
    with pytest.raises(ValueError, match="only one, takes kv_scales"):
        rope_and_cache(q, k, v, positions, inv_freq, *caches[:2], slots)


def test_an_fp8_cache_holds_twice_the_tokens_in_the_same_bytes(tmp_path, monkeypatch):
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES["llama"]())
    monkeypatch.setenv("OMNI_KV_CACHE_BYTES", str(1 << 20))
    plain = ModelRunner(LlamaForCausalLM.load(ckpt))
    fp8 = ModelRunner(LlamaForCausalLM.load(ckpt, kv_cache_dtype="fp8", reference=True))
    assert fp8.k_cache.dtype == FP8 and plain.k_cache.dtype == torch.float32
    assert fp8.num_blocks == 4 * plain.num_blocks  # e4m3 against fp32, the CPU's dtype
    assert fp8.memory_bytes() - plain.memory_bytes() < plain.k_cache.nbytes // 100


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_model_on_an_fp8_cache_stays_near_its_own_dtype(arch, tmp_path):
    """Greedy steps with the cache in e4m3 against the model's own dtype, along the same
    tokens, with forked blocks copied (raw bytes: e4m3 has no index_put everywhere)."""
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES[arch]())
    prompts = [[5, 17, 3, 40, 8, 9, 61, 2] * 3, [9, 61, 2]]
    tokens, want = greedy_steps(LlamaForCausalLM.load(ckpt), prompts, 8)
    model = LlamaForCausalLM.load(ckpt, kv_cache_dtype="fp8", reference=True)
    _, got = greedy_steps(model, prompts, 8, forced=tokens)
    for a, b in zip(got, want, strict=True):
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.995
        assert not torch.equal(a, b)


def test_what_an_fp8_cache_cannot_do_says_so(tmp_path):
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES["llama"]())
    with pytest.raises(CheckpointError, match="kv_cache_dtype 'int8' is not one of"):
        LlamaForCausalLM.load(ckpt, kv_cache_dtype="int8", reference=True)
    with pytest.raises(CheckpointError, match="need a GPU with FP8 tensor cores"):
        LlamaForCausalLM.load(ckpt, kv_cache_dtype="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_FP8, reason="needs a GPU with FP8")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_an_fp8_cache_on_the_gpu_is_batch_invariant_and_near_bf16(arch, tmp_path):
    """CUDA graphs, the kernels' FP8 paths: a prompt alone or beside others gets the same
    bits, and the logits stay near the bf16 cache's along the same tokens."""
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES[arch]())
    prompts = [[5, 17, 3, 40, 8] * 7, [9, 61, 2], [4] * 50]
    bf16 = LlamaForCausalLM.load(ckpt, "cuda", torch.bfloat16)
    tokens, want = greedy_steps(bf16, prompts, 8)
    fp8 = LlamaForCausalLM.load(ckpt, "cuda", torch.bfloat16, kv_cache_dtype="fp8")
    _, got = greedy_steps(fp8, prompts, 8, forced=tokens)
    for a, b in zip(got, want, strict=True):
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98
    _, alone = greedy_steps(fp8, prompts[:1], 8, forced=[t[:1] for t in tokens])
    for a, b in zip(alone, got, strict=True):
        assert torch.equal(a[0], b[0])


def test_the_scales_hold_no_graph(tmp_path):
    """The scales are plain tensors: a graph back to the weights would keep a widened copy
    of every layer's projection alive (6 GiB on Llama-3-8B: the pool was short by it)."""
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES["llama"]())
    runner = ModelRunner(LlamaForCausalLM.load(ckpt, kv_cache_dtype="fp8", reference=True))
    scales = runner.model.model.layers[0].self_attn.kv_scales
    assert scales.grad_fn is None and not scales.requires_grad
