"""SiLU-and-mul: the gated MLP's activation, reading gate and up halves once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import pdl_options, wait_for_inputs
from .rows import empty_rows


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n).contiguous()
    out = empty_rows(x2.shape[0], n, x.dtype, x.device)  # feeds the down projection
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
        x2, out, n, BLOCK=block, **pdl_options(x.device)
    )
    return out.view(*x.shape[:-1], n)
