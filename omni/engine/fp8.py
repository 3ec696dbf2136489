"""FP8 (e4m3) linear layers: weights scaled per output channel, activations per token (W8A8).

Hopper's FP8 tensor cores run this scheme at twice bf16's rate, and decode reads half the
bytes. A row's scale is its absolute max over e4m3's largest value (448), so every row
uses the whole range; the products of two e4m3 values are exact in fp32, and the sums
are fp32.

This module holds the math's definition (`fp8_linear_ref`, which the CPU tests and the
accuracy checks run; kernels/w8a8.py is the GPU's) and the work done at load:
quantizing a bf16 checkpoint's projections (`quantize_projections`), and reading the
Hub's FP8 checkpoints, whose format `checkpoint_quantization` recognises. The
projections are quantized. The embedding, the lm head, norms and MoE routers stay in the
model's dtype, as the Hub's FP8 checkpoints keep them.
"""

from __future__ import annotations

import torch
from torch import nn

from .checkpoint import CheckpointError
from .kernels import ops
from .kernels.e4m3 import FP8, quantize_rows

METHODS = ("fp8",)  # what `quantization` may name
# the projections quantized, by their (fused) names in the model
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


SCALE_STEPS = 16  # candidate weight scales per row: absmax's, times 2^(i/16) for i < 16


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's rows in e4m3, each row's scale the one of SCALE_STEPS candidates (from
    its absmax's up to twice it) with the least squared error: e4m3's steps are relative
    (3 mantissa bits), so where a row's values fall between them depends on the scale.
    On SmolLM2 this takes the W8A8 perplexity cost from +2.8% to +2.3% (bench/
    fp8_accuracy.py's text; means over fp32 rounding orders, README) at no cost when
    serving."""
    wf = w.float()
    q, scale = quantize_rows(wf)
    err = ((q.float() * scale[:, None] - wf) ** 2).sum(dim=-1)
    base = scale
    y = torch.empty_like(wf)  # in place in one buffer: 2.4x faster on a 2-core CPU, same bits
    for i in range(1, SCALE_STEPS):
        s = base * 2 ** (i / SCALE_STEPS)
        # |w| / s <= 448 / 2^(1/16) here: within e4m3's range, no clamp needed
        qi = torch.div(wf, s[:, None], out=y).to(FP8)
        torch.mul(qi.float(), s[:, None], out=y)
        e = y.sub_(wf).square_().sum(dim=-1)
        better = e < err
        q = torch.where(better[:, None], qi.view(torch.uint8), q.view(torch.uint8)).view(FP8)
        scale, err = torch.where(better, s, scale), torch.where(better, e, err)
    return q, scale


class Fp8Linear(nn.Module):
    """A projection with e4m3 weights and a scale per output channel (checkpoint names:
    `weight`, `weight_scale`, `bias`), through the `ops` switch."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        weight = torch.empty(out_features, in_features, dtype=FP8, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        scale = torch.empty(out_features, dtype=torch.float32, device=device)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops(x.device).fp8_linear(x, self.weight, self.weight_scale, self.bias)


def is_projection(name: str) -> bool:
    return any(name.endswith(f".{p}.weight") for p in PROJECTIONS)


def quantize_projections(state: dict[str, torch.Tensor]) -> None:
    """A state's (fused) projection weights in e4m3 with their scales, in place; those
    that already are (a Hub FP8 checkpoint's) keep theirs."""
    for name in [n for n in state if is_projection(n)]:
        if state[name].dtype == FP8:
            continue
        state[name], state[name + "_scale"] = quantize_weight(state[name])


def normalize_scales(state: dict[str, torch.Tensor]) -> None:
    """Hub checkpoints' weight scales as one fp32 value per output channel: per-channel
    ones come as [N, 1], per-tensor ones as [1] or a scalar (repeated for every row)."""
    for name in [n for n in state if n.endswith(".weight_scale")]:
        scale = state[name].float().reshape(-1)
        rows = state[name.removesuffix("_scale")].shape[0]
        if scale.numel() == 1:
            scale = scale.expand(rows).contiguous()
        elif scale.numel() != rows:
            raise CheckpointError(
                f"{name}: {scale.numel()} scales for {rows} rows (only per-channel and "
                "per-tensor FP8 scales are supported)"
            )
        state[name] = scale


def checkpoint_quantization(config: dict, path) -> str | None:
    """The FP8 scheme an HF config.json's `quantization_config` names (None: none), or a
    CheckpointError saying what is not supported: per-channel or per-tensor e4m3 weights
    (compressed-tensors, fbgemm_fp8, fp8 without blocks) are read; their activations are
    always quantized per token on the fly, static input scales are not used."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fbgemm_fp8":
        return "fp8"
    if method == "fp8":
        if q.get("weight_block_size"):
            raise CheckpointError(
                f"{path}: block-wise FP8 scales (weight_block_size "
                f"{q['weight_block_size']}) are not supported; per-channel and per-tensor are"
            )
        return "fp8"
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if (w.get("type"), w.get("num_bits")) != ("float", 8):
                raise CheckpointError(
                    f"{path}: compressed-tensors weights of type {w.get('type')!r} with "
                    f"{w.get('num_bits')} bits are not supported (FP8 only)"
                )
            if w.get("strategy") not in ("channel", "tensor"):
                raise CheckpointError(
                    f"{path}: FP8 weight scales by {w.get('strategy')!r} are not supported "
                    "(per channel or per tensor only)"
                )
        return "fp8"
    raise CheckpointError(f"{path}: quantization method {method!r} is not supported")


def check_device(device: torch.device | str, reference: bool) -> None:
    """FP8 serves only where its kernels run (FP8 tensor cores). The CPU computes the
    math's reference for tests and accuracy checks (`reference`): never a silent fallback."""
    device = torch.device(device)
    if device.type == "cpu":
        if not reference:
            raise CheckpointError(
                "FP8 models need a GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                "Hopper); this one would run on the CPU"
            )
        return
    if torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise CheckpointError(f"FP8 models need FP8 tensor cores (8.9+); {name} has none")
