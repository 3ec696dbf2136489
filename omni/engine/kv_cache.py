"""The KV cache's layout a token and its element type: the model's dtype, or FP8 (e4m3)
with a scale per KV head.

A model says what a token's cache holds in each layer (`KVLayout`): the Llama family K and
V of its KV heads; multi-head latent attention (deepseek_v3.py) one row, the compressed
latent and the rope key side by side, and no separate V.

FP8 halves the cache's bytes, so the same memory holds twice the tokens. A value is stored
divided by its head's scale, and that scale comes from a bound on what the head can ever
hold, worked out from the layer's weights:
- the layer's input is RMS-normed, so it has length sqrt(hidden) before the norm's
  weights g; a projection row w then gives |w . (g x)| <= ||w g|| sqrt(hidden)
  (Cauchy-Schwarz), plus the row's bias;
- the rotary embedding turns pairs of K's rows and keeps their length;
- Qwen3's per-head norm bounds each of K's pairs by sqrt(head_dim) max |g_k|.
So nothing saturates, and no calibration text or first request decides the scales: a
model always gets the same ones (a Hub checkpoint's calibrated k_scale / v_scale are not
needed). The bound's slack costs next to nothing: e4m3 keeps its 3 mantissa bits over
the 2^15 below its largest value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .checkpoint import CheckpointError
from .kernels.e4m3 import FP8, FP8_MAX

KV_CACHE_DTYPES = ("fp8",)  # what `kv_cache_dtype` may name (None: the model's dtype)
# above the bound: the bf16 rounding of the normed input and, in an FP8 model, its
# per-token e4m3 rounding (2^-4 at most) can each nudge a value past it
MARGIN = 1.125
ROWS_AT_ONCE = 1024  # weight rows widened to fp32 at a time: scratch the pool is not short of


@dataclass(frozen=True)
class KVLayout:
    """A token's cache in one layer: `heads` rows of `dim`, for K and, with `values`, V."""

    heads: int
    dim: int
    values: bool = True  # False: no V cache (its tensor is zero-width)

    @property
    def elements(self) -> int:
        """Cache elements a token takes in one layer, K and V together."""
        return (2 if self.values else 1) * self.heads * self.dim


def kv_layout(model) -> KVLayout:
    """`model`'s own layout where it declares one (`model.kv_layout`), else the Llama
    family's: K and V of `num_kv_heads` heads of `head_dim`."""
    declared = getattr(model, "kv_layout", None)
    if declared is not None:
        return declared
    return KVLayout(model.cfg.num_kv_heads, model.cfg.head_dim)


def check_kv_cache_dtype(kv_cache_dtype: str | None) -> None:
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise CheckpointError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}"
        )


def cache_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    return FP8 if kv_cache_dtype == "fp8" else model_dtype


def head_bounds(attn, norm_weight: torch.Tensor) -> torch.Tensor:
    """[2, kv_heads] fp32: the most any rotated K, and any V, of each of this attention's
    KV heads can be in absolute value (module docstring)."""
    proj = attn.qkv_proj
    g = norm_weight.float()[None, :]
    rows = torch.cat([(w.float() * g).norm(dim=1) for w in proj.weight.split(ROWS_AT_ONCE)])
    if hasattr(proj, "weight_scale"):  # FP8 weights: their values are weight * scale
        rows = rows * proj.weight_scale.float().abs()
    rows = rows * math.sqrt(proj.weight.shape[1])
    if proj.bias is not None:
        rows = rows + proj.bias.float().abs()
    heads, dim = attn.kv_dim // attn.cfg.head_dim, attn.cfg.head_dim
    k_rows = rows[attn.q_dim : attn.q_dim + attn.kv_dim].view(heads, dim)
    v_rows = rows[attn.q_dim + attn.kv_dim :].view(heads, dim)
    if attn.cfg.qk_norm:
        k = (attn.k_norm.weight.float().abs().max() * math.sqrt(dim)).expand(heads)
    else:
        half = dim // 2
        k = (k_rows[:, :half] ** 2 + k_rows[:, half:] ** 2).sqrt().amax(dim=1)
    return torch.stack([k, v_rows.amax(dim=1)])


@torch.no_grad()  # (the norms' weights are parameters: a graph would keep every product)
def assign_scales(model, kv_cache_dtype: str | None) -> None:
    """Give each layer's attention its FP8 cache's scales (`kv_scales`), or none."""
    if kv_cache_dtype is None:
        return  # (the scales start as None)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.kv_scales = None
        if kv_cache_dtype == "fp8":
            bounds = head_bounds(attn, layer.input_layernorm.weight)
            attn.kv_scales = (bounds * MARGIN / FP8_MAX).clamp(min=1e-12).contiguous()
    if kv_cache_dtype == "fp8" and model.lm_head.weight.is_cuda:
        torch.cuda.empty_cache()  # the pool is sized from the memory the driver sees free
