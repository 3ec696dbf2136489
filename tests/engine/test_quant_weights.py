"""Block-FP8 and INT4 weight-only linears as the Hub's checkpoints ship them: the formats
against dequantizers written here, the Triton kernels against the references (Triton's
interpreter without a GPU: small, ragged shapes), scheme detection and its refusals, and
a tiny DeepSeek-V3 quantized both ways loading to the logits of its dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from omni.engine.checkpoint import Checkpoint, CheckpointError
from omni.engine.deepseek_v3 import DeepseekV3ForCausalLM
from omni.engine.kernels import block_fp8_linear, block_fp8_linear_ref, int4_linear, int4_linear_ref
from omni.engine.kernels.wq import FP8, dequantize_block_fp8, pack_int4, unpack_int4
from omni.engine.layers import Linear
from omni.engine.model_runner import ModelRunner, SoloSequence
from omni.engine.quant_weights import (
    BlockFP8Linear,
    Int4Linear,
    WeightScheme,
    gpu_problem,
    permute_rows,
    scheme_of,
)
from omni.testing.checkpoints import save_word_level_tokenizer

from .test_deepseek_v3 import VOCAB, deepseek_config, randomize

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = {"atol": 3e-2, "rtol": 3e-2} if GPU else {"atol": 1e-4, "rtol": 1e-4}
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
INT4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
            },
            "targets": ["Linear"],
        }
    },
    "ignore": ["lm_head", "re:.*kv_a_proj_with_mqa$"],
}


@pytest.fixture
def gen():
    g = torch.Generator(device=DEVICE)
    g.seed()  # fresh inputs every run
    return g


def rand(*shape, gen, scale=1.0):
    return torch.randn(*shape, generator=gen, device=DEVICE) * scale


# The formats, written out here independently of kernels/wq.py.


def quantize_fp8(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scale_inv [ceil(N/bn), ceil(K/bk)], block by block."""
    (n, k), (bn, bk) = w.shape, block
    scale = torch.empty(-(-n // bn), -(-k // bk), device=w.device)
    q = torch.empty(n, k, dtype=FP8, device=w.device)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            scale[i, j] = tile.abs().max().clamp(min=1e-8) / 448.0
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / scale[i, j]).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    (bn, bk), w = block, q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scale[i, j]
    return w


def quantize_int4(w: torch.Tensor, group=32, scale_dtype=torch.bfloat16):
    """(int values in [-8, 7] [N, K], scales [N, ceil(K/group)] in scale_dtype)."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % group)).view(n, -1, group)
    scale = (padded.abs().amax(-1) / 7).clamp(min=1e-8).to(scale_dtype)
    q = (padded / scale.float()[..., None]).round().clamp(-8, 7).view(n, -1)[:, :k]
    return q.to(torch.int8), scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, group=32) -> torch.Tensor:
    cols = torch.arange(q.shape[1], device=q.device) // group
    return q.float() * scale.float()[:, cols]


def pack_words(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' packing: value i in bits 4*(i % 8) of word i // 8, as q + 8."""
    n, k = q.shape
    u = torch.nn.functional.pad(q.long() + 8, (0, -k % 8))
    words = torch.zeros(n, u.shape[1] // 8, dtype=torch.int64, device=q.device)
    for j in range(8):
        words |= u[:, j::8] << (4 * j)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def test_int4_packing_round_trips_in_compressed_tensors_order(gen):
    q = torch.randint(-8, 8, (5, 203), generator=gen, device=DEVICE)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, 26)
    assert torch.equal(packed, pack_words(q))
    assert torch.equal(unpack_int4(packed, 203).long(), q)
    lowest_first = torch.arange(-8, 0).view(1, 8)  # nibbles 0..7
    assert pack_int4(lowest_first).item() == 0x76543210
    assert pack_int4(torch.full((1, 8), 7)).item() == -1  # all nibbles 15: the sign bit


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_references_are_dequantize_then_matmul(gen, kind):
    x, w = rand(7, 200, gen=gen), rand(72, 200, gen=gen, scale=0.1).clamp(-0.6, 0.6)
    bias = rand(72, gen=gen)
    if kind == "fp8":
        q, s = quantize_fp8(w)
        ours, dense = block_fp8_linear_ref(x, q, s, bias), dequantize_fp8(q, s)
    else:
        q, s = quantize_int4(w)
        ours, dense = int4_linear_ref(x, pack_int4(q), s, bias), dequantize_int4(q, s)
    torch.testing.assert_close(ours, x @ dense.T + bias)
    # within e4m3's relative step (3 mantissa bits), or half an int4 step of the largest
    near = {"rtol": 0.07, "atol": 1e-3} if kind == "fp8" else {"rtol": 0, "atol": 0.6 / 7}
    torch.testing.assert_close(dense, w, **near)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize(("n", "k", "bias"), [(72, 200, False), (130, 300, True)])
def test_block_fp8_kernel_matches_reference(gen, m, n, k, bias):
    """Partial blocks both ways (130 x 300 is 2 x 3 blocks, the last ones part-filled)."""
    x, w = rand(m, k, gen=gen).to(DTYPE), rand(n, k, gen=gen, scale=0.05)
    q, s = quantize_fp8(w)
    b = rand(n, gen=gen).to(DTYPE) if bias else None
    torch.testing.assert_close(
        block_fp8_linear(x, q, s, b), block_fp8_linear_ref(x, q, s, b), **TOL
    )


def test_block_fp8_kernel_decodes_every_e4m3_byte():
    """Each of the 254 non-NaN bytes as a weight row, read out by x = 1: exact."""
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    w = bits.view(FP8).view(-1, 1).to(DEVICE)
    s = torch.ones(2, 1, device=DEVICE)
    out = block_fp8_linear(torch.ones(1, 1, device=DEVICE), w, s)
    assert torch.equal(out[0], w[:, 0].float())


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 96, False), (70, 200, True)])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_kernel_matches_reference(gen, m, n, k, bias, group):
    """200 inputs: a part-filled last group and last packed word; groups of 128 take the
    kernel's K step up to a group."""
    x, w = rand(m, k, gen=gen).to(DTYPE), rand(n, k, gen=gen, scale=0.05)
    q, s = quantize_int4(w, group)
    b = rand(n, gen=gen).to(DTYPE) if bias else None
    p = pack_int4(q)
    torch.testing.assert_close(
        int4_linear(x, p, s, b, group), int4_linear_ref(x, p, s, b, group), **TOL
    )


def test_int4_groups_that_are_no_power_of_two_are_refused(gen):
    w = rand(8, 48, gen=gen, scale=0.05)
    q, s = quantize_int4(w, 24)
    with pytest.raises(ValueError, match="power of two"):
        int4_linear(rand(1, 48, gen=gen).to(DTYPE), pack_int4(q), s, group_size=24)


def with_changes(config: dict, **changes) -> dict:
    new = json.loads(json.dumps(config))
    for key, value in changes.items():
        if key in new:
            new[key] = value
        else:
            new["config_groups"]["group_0"]["weights"][key] = value
    return new


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "awq"),
        (with_changes(FP8_CONFIG, fmt="e5m2"), "fmt 'e5m2'"),
        (with_changes(FP8_CONFIG, activation_scheme="static"), "activation_scheme 'static'"),
        (with_changes(FP8_CONFIG, weight_block_size=None), "weight_block_size"),
        (with_changes(FP8_CONFIG, weight_block_size=[128, 100]), "weight_block_size"),
        (with_changes(INT4_CONFIG, format="float-quantized"), "format 'float-quantized'"),
        (with_changes(INT4_CONFIG, num_bits=8), "num_bits 8"),
        (with_changes(INT4_CONFIG, symmetric=False), "symmetric False"),
        (with_changes(INT4_CONFIG, strategy="channel"), "strategy 'channel'"),
    ],
)
def test_unsupported_schemes_are_refused_by_name(config, named):
    with pytest.raises(CheckpointError, match=named):
        scheme_of({"quantization_config": config})


def test_schemes_and_the_gpus_that_run_them():
    assert scheme_of({}) is None
    assert scheme_of({"quantization_config": FP8_CONFIG}) == "fp8-block"
    assert scheme_of({"quantization_config": INT4_CONFIG}) == "int4-group"
    fp8, int4 = WeightScheme("fp8-block"), WeightScheme("int4-group")
    assert gpu_problem(fp8, (8, 0)) is None and gpu_problem(int4, (9, 0)) is None
    assert "8.0 or newer; this GPU has 7.5" in gpu_problem(int4, (7, 5))
    assert "W8A8 needs compute capability 8.9" in gpu_problem(fp8, (8, 6), w8a8=True)
    assert gpu_problem(fp8, (9, 0), w8a8=True) is None


def test_fp8_rows_leave_their_scale_blocks_only_dequantized(gen):
    """A row order within 128-row blocks moves the e4m3 rows; across blocks, the layer
    is dequantized first (the same weights either way)."""
    w = rand(256, 64, gen=gen).cpu()
    q, s = quantize_fp8(w)
    scheme = WeightScheme("fp8-block")
    within = torch.cat([torch.randperm(128) + 128 * b for b in range(2)])
    across = torch.randperm(256)
    for order, stays in ((within, True), (across, False)):
        state = {"p.weight": q.clone(), "p.weight_scale_inv": s.clone()}
        permute_rows(state, "p", order, scheme, torch.float32)
        assert (state["p.weight"].dtype == FP8) == stays
        dense = (
            dequantize_block_fp8(state["p.weight"], s, (128, 128)) if stays else state["p.weight"]
        )
        torch.testing.assert_close(dense, dequantize_fp8(q, s)[order], rtol=0, atol=0)


def quantized_checkpoints(directory, config, kind: str):
    """A tiny DeepSeek-V3 with random weights written twice: its projections quantized
    (HF names, the format's quantization_config) and as those values dequantized."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(hf)
    paths = {}
    for form in ("quantized", "dense"):
        paths[form] = directory / form
        hf.save_pretrained(paths[form])
        save_word_level_tokenizer(paths[form] / "tokenizer.json", VOCAB)
    quantized = load_file(str(paths["quantized"] / "model.safetensors"))
    dense = dict(quantized)
    for name in [n for n in quantized if n.endswith(("_proj.weight", "_mqa.weight"))]:
        prefix, w = name.removesuffix(".weight"), quantized[name]
        if kind == "fp8":
            q, s = quantize_fp8(w)
            quantized[name], quantized[prefix + ".weight_scale_inv"] = q, s
            dense[name] = dequantize_fp8(q, s)
        elif not prefix.endswith("kv_a_proj_with_mqa"):  # (the config's `ignore`)
            q, s = quantize_int4(w)
            del quantized[name]
            quantized[prefix + ".weight_packed"] = pack_int4(q)
            quantized[prefix + ".weight_scale"] = s
            quantized[prefix + ".weight_shape"] = torch.tensor(w.shape)
            dense[name] = dequantize_int4(q, s)
    save_file(quantized, str(paths["quantized"] / "model.safetensors"))
    save_file(dense, str(paths["dense"] / "model.safetensors"))
    cfg_path = paths["quantized"] / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = FP8_CONFIG if kind == "fp8" else INT4_CONFIG
    cfg_path.write_text(json.dumps(cfg))
    return Checkpoint.open(paths["quantized"]), Checkpoint.open(paths["dense"])


def logits(model) -> torch.Tensor:
    """A prefill of 11 tokens, then 3 decode steps (MLA's absorbed form)."""
    solo = SoloSequence(ModelRunner(model, block_size=8, num_blocks=16))
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = [solo.extend(ids[:11], all_logits=True)]
    return torch.cat(steps + [solo.extend([t], all_logits=True) for t in ids[11:]])


# (kind, q_lora_rank, MLP widths): 128-wide MLPs keep FP8's fused gate/up quantized (the
# shared experts join the routed FP8 stack), 96 and
# 32 (the default config's) do not line up with 128-row blocks and are dequantized
CASES = {
    "fp8_aligned": ("fp8", 24, {"intermediate_size": 128, "moe_intermediate_size": 128}),
    "fp8_ragged_q_proj": ("fp8", None, {}),
    "int4": ("int4", 24, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_quantized_checkpoint_gives_its_dequantized_weights_logits(tmp_path, case):
    kind, q_lora_rank, widths = CASES[case]
    quantized, dense = quantized_checkpoints(tmp_path, deepseek_config(q_lora_rank, **widths), kind)
    model = DeepseekV3ForCausalLM.load(quantized)
    layer = model.model.layers[1]
    fused_quantized = kind == "int4" or bool(widths)
    quantized_class = BlockFP8Linear if kind == "fp8" else Int4Linear
    assert isinstance(layer.self_attn.o_proj, quantized_class)
    if kind == "fp8" and widths:  # whole blocks: the shared MLP joins the routed FP8 stack
        assert layer.mlp.shared_experts is None and layer.mlp.shared == 1
        assert isinstance(model.model.layers[0].mlp.gate_up_proj, quantized_class)
    else:
        shared = layer.mlp.shared_experts.gate_up_proj
        assert isinstance(shared, quantized_class) == fused_quantized
    assert type(layer.self_attn.kv_b_proj) is Linear  # read as a matrix by MLA: dequantized
    if kind == "int4":  # in the config's `ignore`: stored dense
        assert type(layer.self_attn.kv_a_proj_with_mqa) is Linear
    torch.testing.assert_close(
        logits(model), logits(DeepseekV3ForCausalLM.load(dense)), atol=1e-5, rtol=1e-5
    )
