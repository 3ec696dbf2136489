"""The layers every model file builds on, through the `ops` switch (kernels/__init__.py):
the Triton kernels on CUDA, the torch references elsewhere. A leaf of the model files:
llama.py, moe.py, deepseek_v3.py and the draft heads import these, and none of them
another for its layers."""

from __future__ import annotations

import torch
from torch import nn

from .kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, feeds_fp8: bool = False):
        """`feeds_fp8`: its output goes to an FP8 projection, to which the kernel hands the
        rows quantized (kernels/norm.py)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps
        self.feeds_fp8 = feeds_fp8

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normed x; with a residual, (normed x + residual, x + residual)."""
        norm = ops(x.device).rms_norm
        out, new_residual = norm(x, self.weight, self.eps, residual, quantize=self.feeds_fp8)
        return out if residual is None else (out, new_residual)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) through the `ops` switch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops(x.device).linear(x, self.weight, self.bias)
