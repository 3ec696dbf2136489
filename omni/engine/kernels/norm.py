"""RMSNorm with the residual add fused in: one read of x and residual, one write each."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, wait_for_inputs
from .rows import empty_rows


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new residual): with a residual, x + residual is both normed and returned."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), residual


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * n_cols + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = empty_rows(*x2.shape, x2.dtype, x2.device)  # feeds a linear layer
    res_in = residual.reshape(-1, shape[-1]).contiguous() if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else x2
    block = triton.next_power_of_2(shape[-1])
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        res_in,
        weight,
        out,
        res_out,
        shape[-1],
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        **pdl_options(x.device),
    )
    return out.view(shape), (res_out.view(shape) if residual is not None else None)
