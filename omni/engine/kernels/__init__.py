"""Triton kernels of the engine, each with the pure-torch reference it is tested against.

The GPU path runs the kernels, the CPU path the references: `ops(device)` picks.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .activation import silu_and_mul, silu_and_mul_ref
from .attention import paged_attention_ref, paged_decode, paged_prefill
from .norm import rms_norm, rms_norm_ref
from .rope import rope_and_cache, rope_and_cache_ref

__all__ = [
    "ops",
    "paged_attention_ref",
    "paged_decode",
    "paged_prefill",
    "rms_norm",
    "rms_norm_ref",
    "rope_and_cache",
    "rope_and_cache_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]


_KERNELS = SimpleNamespace(
    rms_norm=rms_norm, silu_and_mul=silu_and_mul, rope_and_cache=rope_and_cache
)
_REFERENCES = SimpleNamespace(
    rms_norm=rms_norm_ref, silu_and_mul=silu_and_mul_ref, rope_and_cache=rope_and_cache_ref
)


def ops(device: torch.device) -> SimpleNamespace:
    """The implementations for `device`: Triton kernels on CUDA, references elsewhere."""
    return _KERNELS if device.type == "cuda" else _REFERENCES
