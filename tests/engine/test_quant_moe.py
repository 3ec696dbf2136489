"""The fused MoE on experts kept quantized (block FP8, INT4 by groups): the reference's
dequantized stacks against the formats as test_quant_weights.py writes them, the Triton
kernels against the reference on ragged shapes on both sides of ONE_SLOT_MAX (Triton's
interpreter without a GPU: fp32 and fp16 activations, its dot mishandles bf16), and a
token's output the same alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from omni.engine.kernels.moe import (
    MOE_TILES,
    ONE_SLOT_MAX,
    dequantize_experts,
    fused_moe_quantized,
    fused_moe_quantized_ref,
)
from omni.engine.kernels.wq import FP8, pack_int4
from omni.engine.moe import local_ids, route

from .test_quant_weights import dequantize_fp8, dequantize_int4

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
NAN_BYTES = (0x7F, 0xFF)  # e4m3fn's NaNs: no checkpoint holds them


def fp8_stack(gen, experts, n, k, block, parts=1) -> tuple[torch.Tensor, torch.Tensor]:
    """Every non-NaN e4m3 byte at random [experts, n, k], fp32 scales per block, each of
    `parts` along n with its own scale rows; real weights ~ k^-0.5."""
    bits = torch.randint(0, 256, (experts, n, k), generator=gen, device=DEVICE)
    for nan in NAN_BYTES:
        bits[bits == nan] = 0
    q = bits.to(torch.uint8).view(FP8)
    rows = parts * -(-(n // parts) // block[0])
    scale = torch.rand(experts, rows, -(-k // block[1]), generator=gen, device=DEVICE)
    return q, (scale + 0.5) * k**-0.5 / 100


def int4_stack(gen, experts, n, k, group, scale_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 [experts, n, ceil(k/8)] and scales [experts, n, ceil(k/group)]."""
    q = torch.randint(-8, 8, (experts, n, k), generator=gen, device=DEVICE)
    scale = torch.rand(experts, n, -(-k // group), generator=gen, device=DEVICE)
    return pack_int4(q), ((scale + 0.5) * k**-0.5 / 4).to(scale_dtype)


# (kind, block, hidden, inter, scale dtype): 128 x 128 blocks over ragged shapes (one
# scale column a weight tile; up's scale rows after gate's partial block), small FP8
# blocks (a scale column every 64 of a tile's 128), INT4 with K not whole words or groups
CASES = {
    "fp8_128": ("fp8", (128, 128), 160, 72, torch.float32),
    "fp8_small_blocks": ("fp8", (32, 64), 160, 72, torch.float32),
    "int4": ("int4", (1, 32), 100, 36, torch.bfloat16),
}


def experts_of(case: str, gen, experts: int):
    """(gate_up, gate_up_scale, down, down_scale, block, hidden) for a CASES entry."""
    kind, block, hidden, inter, scale_dtype = CASES[case]
    if kind == "fp8":
        gate_up = fp8_stack(gen, experts, 2 * inter, hidden, block, parts=2)
        down = fp8_stack(gen, experts, hidden, inter, block)
    else:
        gate_up = int4_stack(gen, experts, 2 * inter, hidden, block[1], scale_dtype)
        down = int4_stack(gen, experts, hidden, inter, block[1], scale_dtype)
    return (*gate_up, *down, block, hidden)


def inputs(case: str, seed: int, tokens: int, experts: int, k: int, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    gate_up, gu_scale, down, down_scale, block, hidden = experts_of(case, gen, experts)
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=DEVICE)
    weights, ids = route(logits, k, renormalize=True)
    return x, gate_up, gu_scale, down, down_scale, weights.to(dtype), ids, block


def tolerance(dtype) -> dict:
    if dtype == torch.float32:
        return {"atol": 1e-4, "rtol": 1e-4}
    return {"atol": 2e-2, "rtol": 2e-2}


def nibbles(words: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors' int4 values [N, k] of words [N, ceil(k/8)]: value i in bits
    4*(i % 8) of word i // 8, as q + 8."""
    shifts = torch.arange(0, 32, 4, device=words.device)
    return (((words[..., None] >> shifts) & 15) - 8).flatten(-2)[..., :k]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_reference_dequantizes_as_the_formats_say(case):
    """dequantize_experts against test_quant_weights' own dequantizers, expert by expert
    and part by part (gate_up's gate and up each with their scale rows)."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    gate_up, gu_scale, down, down_scale, block, hidden = experts_of(case, gen, 2)
    inter = gate_up.shape[1] // 2
    got_gate_up = dequantize_experts(gate_up, gu_scale, block, hidden, parts=2)
    got_down = dequantize_experts(down, down_scale, block, inter)
    for e in range(2):
        if gate_up.dtype == FP8:
            rows = gu_scale.shape[1] // 2
            gate = dequantize_fp8(gate_up[e, :inter], gu_scale[e, :rows], block)
            up = dequantize_fp8(gate_up[e, inter:], gu_scale[e, rows:], block)
            want_down = dequantize_fp8(down[e], down_scale[e], block)
        else:
            both = dequantize_int4(nibbles(gate_up[e], hidden), gu_scale[e], block[1])
            gate, up = both[:inter], both[inter:]
            want_down = dequantize_int4(nibbles(down[e], inter), down_scale[e], block[1])
        assert torch.equal(got_gate_up[e], torch.cat([gate, up]))
        assert torch.equal(got_down[e], want_down)


# tokens x k slots: one slot a block (<= ONE_SLOT_MAX), then grouped by expert
@pytest.mark.parametrize(("tokens", "k"), [(5, 3), (33, 2)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernels_sum_what_the_reference_sums(case, tokens, k):
    assert (tokens * k <= ONE_SLOT_MAX) == (tokens == 5)
    dtype = torch.bfloat16 if GPU else torch.float32
    args = inputs(case, tokens * 10 + k, tokens, 6, k, dtype)
    got = fused_moe_quantized(*args)
    assert got.shape == (tokens, args[0].shape[1]) and got.dtype == dtype
    tol = {"atol": 3e-2, "rtol": 3e-2} if GPU else tolerance(dtype)
    torch.testing.assert_close(got, fused_moe_quantized_ref(*args), **tol)


@pytest.mark.skipif(GPU, reason="the interpreter's fp16; the GPU runs bf16 above")
def test_half_activations_in_the_interpreter():
    args = inputs("int4", 9, 40, 6, 2, torch.float16)
    want = fused_moe_quantized_ref(*args)
    torch.testing.assert_close(fused_moe_quantized(*args), want, **tolerance(torch.float16))


def test_another_ranks_experts_add_nothing():
    """partial: ids equal to the number of experts leave their slots zero, unsummed."""
    x, gate_up, gu_scale, down, down_scale, weights, ids, block = inputs(
        "fp8_128", 4, 7, 6, 2, torch.float32
    )
    local = local_ids(ids, 0, 3)
    args = (x, gate_up[:3], gu_scale[:3], down[:3], down_scale[:3], weights, local, block)
    got = fused_moe_quantized(*args, partial=True, summed=False)
    want = fused_moe_quantized_ref(*args, partial=True, summed=False)
    assert torch.equal(got[local == 3], torch.zeros_like(got[local == 3]))
    tol = {"atol": 3e-2, "rtol": 3e-2} if GPU else tolerance(torch.float32)
    torch.testing.assert_close(got, want, **tol)


def first_in_block(ids: torch.Tensor) -> torch.Tensor:
    """Tokens [tokens] whose slots all start a block when grouped (align_by_expert):
    rank among its expert's slots a multiple of BLOCK_M."""
    flat = ids.reshape(-1)
    same = flat[:, None] == flat[None, :]
    rank = torch.tril(same, diagonal=-1).sum(dim=1)
    return (rank % MOE_TILES["BLOCK_M"] == 0).view(ids.shape).all(dim=1)


@pytest.mark.parametrize("case", ["fp8_small_blocks", "int4"])
def test_a_tokens_output_does_not_depend_on_the_batch(case):
    """Bit for bit: each token alone against a one-slot batch and a grouped one (its
    experts' blocks hold other tokens). The interpreter's numpy dot sums a row by its
    place in the tile on some CPUs (test_kernels.INTERPRETER_ROWS): there the grouped
    batch's tokens compared are those whose slots each start their block."""
    dtype = torch.bfloat16 if GPU else torch.float32
    x, gate_up, gu_scale, down, down_scale, weights, ids, block = inputs(case, 11, 48, 6, 2, dtype)
    stacks = (gate_up, gu_scale, down, down_scale)

    def moe(rows: slice) -> torch.Tensor:
        return fused_moe_quantized(x[rows], *stacks, weights[rows], ids[rows], block)

    grouped, one_slot = moe(slice(0, 48)), moe(slice(0, 20))  # 96 slots, then 40
    steady = first_in_block(ids) if not GPU else torch.ones(48, dtype=torch.bool)
    assert steady[0] and steady[:12].sum() >= 2
    for t in range(12):
        alone = moe(slice(t, t + 1))
        assert torch.equal(alone[0], one_slot[t]), t
        if steady[t]:
            assert torch.equal(alone[0], grouped[t]), t


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_a_quantized_deepseek_keeps_its_experts_quantized(tmp_path, kind):
    """The tiny DeepSeek-V3 of test_quant_weights (hidden 64, experts 32 wide: ragged
    against FP8's 128 x 128 blocks): its routed experts stacked as stored, the logits its
    dequantized weights give, and the Triton kernels on the loaded stacks as the reference."""
    from omni.engine.deepseek_v3 import DeepseekV3ForCausalLM, QuantizedExperts

    from .test_deepseek_v3 import deepseek_config
    from .test_quant_weights import logits, quantized_checkpoints

    quantized, dense = quantized_checkpoints(tmp_path, deepseek_config(24), kind)
    model = DeepseekV3ForCausalLM.load(quantized)
    for layer in model.model.layers[1:]:
        experts = layer.mlp.experts
        assert isinstance(experts, QuantizedExperts)
        assert experts.gate_up.dtype == (FP8 if kind == "fp8" else torch.int32)
    torch.testing.assert_close(
        logits(model), logits(DeepseekV3ForCausalLM.load(dense)), atol=1e-5, rtol=1e-5
    )
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=gen)
    weights, ids = route(torch.randn(6, 8, generator=gen), 2, renormalize=True)
    stacks = (experts.gate_up, experts.gate_up_scale, experts.down, experts.down_scale)
    x = x.to(DEVICE, torch.bfloat16 if GPU else torch.float32)  # (bf16 on a GPU, as served)
    args = (x, *(s.to(DEVICE) for s in stacks), weights.to(DEVICE), ids.to(DEVICE))
    torch.testing.assert_close(
        fused_moe_quantized(*args, experts.block),
        fused_moe_quantized_ref(*args, experts.block),
        **({"atol": 3e-2, "rtol": 3e-2} if GPU else tolerance(torch.float32)),
    )


def test_fp8_q_and_latent_inputs_whose_blocks_line_up_run_as_one_fp8_linear(tmp_path):
    """q_a_proj 128 rows (FP8's row block): it and kv_a_proj_with_mqa load as one block-FP8
    Linear (deepseek_v3.fuse_latent_inputs), with the dequantized weights' logits."""
    from omni.engine.deepseek_v3 import DeepseekV3ForCausalLM
    from omni.engine.quant_weights import BlockFP8Linear

    from .test_deepseek_v3 import deepseek_config
    from .test_quant_weights import logits, quantized_checkpoints

    quantized, dense = quantized_checkpoints(tmp_path, deepseek_config(128), "fp8")
    model = DeepseekV3ForCausalLM.load(quantized)
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.q_kv_a_proj, BlockFP8Linear)
        assert not hasattr(layer.self_attn, "q_a_proj")
    torch.testing.assert_close(
        logits(model), logits(DeepseekV3ForCausalLM.load(dense)), atol=1e-5, rtol=1e-5
    )


# the GPU cases: (kind, widths); 128-wide ones fuse q with the latent's input and fold
# the shared experts into the FP8 stack, and the q projection 128 rows wide with them
GPU_CASES = {
    "fp8": ("fp8", {}),
    "int4": ("int4", {}),
    "fp8_whole_blocks": ("fp8", {"q_lora_rank": 128, "moe_intermediate_size": 128}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_a_quantized_deepseek_on_the_gpu_runs_its_experts_quantized(tmp_path, case):
    """Loaded on the GPU, the tiny quantized DeepSeek keeps its routed experts as stored
    and its logits (prefill, then decode steps under the engine's kernels) are those of
    its dequantized weights, within bf16's rounding."""
    from omni.engine.deepseek_v3 import DeepseekV3ForCausalLM, QuantizedExperts

    from .test_deepseek_v3 import deepseek_config
    from .test_quant_weights import logits, quantized_checkpoints

    kind, widths = GPU_CASES[case]
    widths = dict(widths)
    config = deepseek_config(widths.pop("q_lora_rank", 24), **widths)
    quantized, dense = quantized_checkpoints(tmp_path, config, kind)
    model = DeepseekV3ForCausalLM.load(quantized, "cuda", torch.bfloat16)
    assert all(isinstance(layer.mlp.experts, QuantizedExperts) for layer in model.model.layers[1:])
    if case == "fp8_whole_blocks":  # the fused input projection and the folded shared expert
        assert all(hasattr(layer.self_attn, "q_kv_a_proj") for layer in model.model.layers)
        assert all(layer.mlp.shared == 1 for layer in model.model.layers[1:])
    want = logits(DeepseekV3ForCausalLM.load(dense, "cuda", torch.bfloat16))
    torch.testing.assert_close(logits(model), want, atol=0.15, rtol=0.05)


def test_fp8_shared_experts_whose_blocks_line_up_join_the_routed_stack(tmp_path):
    """Experts 128 wide (FP8's blocks): each MoE layer's shared MLP loads as one more
    expert in the routed FP8 stack, which the router gives every token
    (deepseek_v3.split_shared_experts), with the dequantized weights' logits."""
    from omni.engine.deepseek_v3 import DeepseekV3ForCausalLM, QuantizedExperts

    from .test_deepseek_v3 import deepseek_config
    from .test_quant_weights import logits, quantized_checkpoints

    config = deepseek_config(24, moe_intermediate_size=128)
    quantized, dense = quantized_checkpoints(tmp_path, config, "fp8")
    model = DeepseekV3ForCausalLM.load(quantized)
    for layer in model.model.layers[1:]:
        moe = layer.mlp
        assert moe.shared == 1 and moe.shared_experts is None
        assert isinstance(moe.experts, QuantizedExperts) and moe.experts.gate_up.shape[0] == 9
    torch.testing.assert_close(
        logits(model), logits(DeepseekV3ForCausalLM.load(dense)), atol=1e-5, rtol=1e-5
    )
