"""RMSNorm with the residual add fused in: one read of x and residual, one write each.

x may also be a mixture-of-experts layer's output as its k weighted slots [tokens, k,
hidden] in fp32 (fused_moe(summed=False)): the norm adds them up in slot order and rounds
them to the residual's dtype first, the bits of the slot-sum kernel, with one kernel
fewer a layer.

Before an FP8 projection (`quantize`), the kernel also writes its output's rows in e4m3
with their scales, the bits of w8a8.quantize_rows on that output, attached to it for the
projection (e4m3.attach_rows): one kernel fewer a projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .e4m3 import FP8, FP8_MAX, attach_rows
from .moe import add_slots, sum_slots_ref
from .pdl import pdl_options, wait_for_inputs
from .rows import empty_rows
from .w8a8 import e4m3_scale, e4m3_values


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new residual): with a residual, x + residual is both normed and returned.
    (`quantize`: nothing here; the reference FP8 projection quantizes its input itself.)"""
    if residual is not None:
        if x.dim() == 3:  # a MoE layer's slots (module docstring)
            x = sum_slots_ref(x, residual.dtype)
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
    q_ptr,
    scale_ptr,
    n_cols,
    x_row,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    QUANTIZE: tl.constexpr = False,
    FMAX: tl.constexpr = 448.0,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # before the wait (PDL): the weights, and the residual, which the kernel right before
    # (a projection's, the experts') never writes
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    if SLOTS:  # x: [rows, SLOTS, n_cols] fp32, added up in order and rounded
        x = add_slots(x_ptr, row, cols, mask, n_cols, SLOTS, BLOCK)
        x = x.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += residual
        tl.store(res_out_ptr + row * n_cols + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = (x * rstd * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, y, mask=mask)
    if QUANTIZE:  # quantize_rows' math on the row just written
        yf = y.to(tl.float32)
        scale = e4m3_scale(tl.max(tl.abs(yf), axis=0), FMAX)
        tl.store(scale_ptr + row, scale)
        q = e4m3_values(yf, scale, FMAX)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new residual) as rms_norm_ref; `quantize`: the normed rows in e4m3 too,
    attached for an FP8 projection (module docstring). On Hopper the kernel reads
    `residual` before its wait for the kernel before (pdl.py): the residual must not be
    that kernel's output (in the models it is the last norm's, and x the projection's or
    the experts')."""
    slots = 0
    if x.dim() == 3 and residual is not None:  # a MoE layer's slots (module docstring)
        slots = x.shape[1]
        x2, dtype = x.contiguous(), residual.dtype
        shape = residual.shape
    else:  # rows may be strided (a view of a wider projection's output): no copy
        shape = x.shape
        strided = x.dim() == 2 and x.stride(-1) == 1
        x2, dtype = x if strided else x.reshape(-1, shape[-1]).contiguous(), x.dtype
    rows, cols = x2.shape[0], shape[-1]
    out = empty_rows(rows, cols, dtype, x2.device)  # feeds a linear layer
    res_in = residual.reshape(-1, cols).contiguous() if residual is not None else x2
    res_out = torch.empty(rows, cols, dtype=dtype, device=x2.device) if residual is not None else x2
    if quantize:  # (room for whole row tiles: the W8A8 TMA kernel's loads, rows.py)
        q, scale = empty_rows(rows, cols, FP8, x2.device), torch.empty(rows, device=x2.device)
    else:
        q, scale = out, out  # (not written)
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](
        x2,
        res_in,
        weight,
        out,
        res_out,
        q,
        scale,
        cols,
        x2.stride(0) if not slots else cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        SLOTS=slots,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        QUANTIZE=quantize,
        FMAX=FP8_MAX,
        **pdl_options(x.device),
    )
    normed = out.view(shape)
    if quantize:
        attach_rows(normed, q, scale)
    return normed, (res_out.view(shape) if residual is not None else None)
