"""Triton kernels of the engine, each with the pure-torch reference it is tested against.

The GPU path runs the kernels, the CPU path the references: `ops(device)` picks.
OMNI_BATCH_INVARIANT=0 swaps the batch-invariant linear layer for cuBLAS (faster
at some shapes, but a request's output then depends on its batch neighbours).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from .activation import silu_and_mul, silu_and_mul_ref
from .attention import paged_attention_ref, paged_decode, paged_prefill, prefill_work
from .e4m3 import fp8_linear_ref
from .grouped_router import grouped_router, grouped_router_ref
from .head_matmul import head_matmul, head_matmul_ref
from .matmul import linear, linear_ref
from .mla import mla_attention, mla_attention_ref, mla_decode_ref, mla_prefill_ref
from .mla_rope import (
    mla_query_and_cache,
    mla_query_and_cache_ref,
    mla_rope_and_cache,
    mla_rope_and_cache_ref,
)
from .moe import (
    fused_moe,
    fused_moe_quantized,
    fused_moe_quantized_ref,
    fused_moe_ref,
    sum_slots,
    sum_slots_ref,
)
from .norm import rms_norm, rms_norm_ref
from .rope import rope_and_cache, rope_and_cache_ref
from .router import router, router_ref
from .w8a8 import fp8_linear
from .wq import block_fp8_linear, block_fp8_linear_ref, int4_linear, int4_linear_ref

__all__ = [
    "block_fp8_linear",
    "block_fp8_linear_ref",
    "fused_moe",
    "fused_moe_ref",
    "int4_linear",
    "int4_linear_ref",
    "linear",
    "linear_ref",
    "ops",
    "paged_attention_ref",
    "paged_decode",
    "paged_prefill",
    "prefill_work",
    "rms_norm",
    "rms_norm_ref",
    "rope_and_cache",
    "rope_and_cache_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]


BATCH_INVARIANT = os.environ.get("OMNI_BATCH_INVARIANT", "1") != "0"


_KERNELS = SimpleNamespace(
    fp8_linear=fp8_linear,
    block_fp8_linear=block_fp8_linear,
    int4_linear=int4_linear,
    rms_norm=rms_norm,
    silu_and_mul=silu_and_mul,
    rope_and_cache=rope_and_cache,
    linear=linear if BATCH_INVARIANT else linear_ref,
    fused_moe=fused_moe,
    fused_moe_quantized=fused_moe_quantized,
    router=router,
    sum_slots=sum_slots,
    grouped_router=grouped_router,
    mla_rope_and_cache=mla_rope_and_cache,
    mla_query_and_cache=mla_query_and_cache,
    head_matmul=head_matmul,
    # MLA absorbs every row on the GPU, prefill too (deepseek_v3.py): no expanded form
    mla_attention=mla_attention,
    mla_prefill=None,
    mla_decode=None,
)
_REFERENCES = SimpleNamespace(
    fp8_linear=fp8_linear_ref,
    block_fp8_linear=block_fp8_linear_ref,
    int4_linear=int4_linear_ref,
    rms_norm=rms_norm_ref,
    silu_and_mul=silu_and_mul_ref,
    rope_and_cache=rope_and_cache_ref,
    linear=linear_ref,
    fused_moe=fused_moe_ref,
    fused_moe_quantized=fused_moe_quantized_ref,
    router=router_ref,
    sum_slots=sum_slots_ref,
    grouped_router=grouped_router_ref,
    mla_rope_and_cache=mla_rope_and_cache_ref,
    mla_query_and_cache=mla_query_and_cache_ref,
    head_matmul=head_matmul_ref,
    mla_attention=mla_attention_ref,
    mla_prefill=mla_prefill_ref,
    mla_decode=mla_decode_ref,
)


def ops(device: torch.device) -> SimpleNamespace:
    """The implementations for `device`: Triton kernels on CUDA, references elsewhere."""
    return _KERNELS if device.type == "cuda" else _REFERENCES
