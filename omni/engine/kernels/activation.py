"""SiLU-and-mul: the gated MLP's activation, reading gate and up halves once.

Before an FP8 down projection (`quantize`), the kernel also writes its output's rows in
e4m3 with their scales, the bits of w8a8.quantize_rows on that output, attached for the
projection (fp8.attach_rows), as the norm kernel does before q/k/v and gate/up: one kernel
fewer a layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..fp8 import FP8, FP8_MAX, attach_rows
from .pdl import pdl_options, wait_for_inputs
from .rows import empty_rows
from .w8a8 import WHOLE_ROW, e4m3_scale, e4m3_values


def silu_and_mul_ref(x: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """(`quantize`: nothing here; the reference FP8 projection quantizes its input itself.)"""
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    q_ptr,
    scale_ptr,
    n,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    QUANTIZE: tl.constexpr = False,
    FMAX: tl.constexpr = 448.0,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    out = (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n + cols, out, mask=mask)
    if QUANTIZE:  # (one program a row: BLOCK >= n) quantize_rows' math on the row written
        yf = out.to(tl.float32)
        scale = e4m3_scale(tl.max(tl.abs(yf), axis=0), FMAX)
        tl.store(scale_ptr + row, scale)
        q = e4m3_values(yf, scale, FMAX)
        tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """silu(gate) * up; `quantize`: its rows in e4m3 too, attached for an FP8 projection
    (module docstring), where a row fits one program (up to WHOLE_ROW wide)."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n).contiguous()
    rows = x2.shape[0]
    out = empty_rows(rows, n, x.dtype, x.device)  # feeds the down projection
    quantize = quantize and n <= WHOLE_ROW
    if quantize:  # (room for whole row tiles: the W8A8 TMA kernel's loads, rows.py)
        q, scale = empty_rows(rows, n, FP8, x.device), torch.empty(rows, device=x.device)
        block = triton.next_power_of_2(n)
        grid, launch = (rows, 1), {"num_warps": min(16, max(4, block // 512))}
    else:
        q, scale = out, out  # (not written)
        block = min(1024, triton.next_power_of_2(n))
        grid, launch = (rows, triton.cdiv(n, block)), {}
    _silu_and_mul_kernel[grid](
        x2, out, q, scale, n, BLOCK=block, QUANTIZE=quantize, FMAX=FP8_MAX,
        **launch, **pdl_options(x.device),
    )  # fmt: skip
    result = out.view(*x.shape[:-1], n)
    if quantize:
        attach_rows(result, q, scale)
    return result
