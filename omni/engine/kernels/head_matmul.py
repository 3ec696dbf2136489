"""Per-head products, MLA's absorbed form's two: out[r, h] = x[r, h] @ W[h].

The absorbed query (q_nope through kv_b_proj's K part) and the attended latent back out
(through its V part) are one small product a head. torch.bmm runs them through cuBLAS,
which picks its algorithm from the sizes (a row's bits could follow its batch) and cannot
start before the kernel ahead of it ends: at decode sizes a launch's latency each. Here
every output element is one fp32 chain of dot products over K in BLOCK_K pieces whatever
the rows, launched dependently (pdl.py), and the output comes out [rows, heads, N],
packed, as the next projection reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, wait_for_inputs

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def head_matmul_program(
    h, m_block, n_block, x_ptr, w_ptr, out_ptr, rows, x_row, x_head, w_head, w_k, w_n, K, N,
    HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[rows of m_block, h, columns of n_block] in x's dtype (a program's work, for
    _head_matmul_kernel and the kernels that launch it beside another's)."""
    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_at = w_ptr + h.to(tl.int64) * w_head
    wait_for_inputs(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(
            x_ptr + m[:, None].to(tl.int64) * x_row + h * x_head + k[None, :],
            mask=(m[:, None] < rows) & (k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_at + k[:, None] * w_k + n[None, :] * w_n,
            mask=(k[:, None] < K) & (n[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(x, w.to(x.dtype), acc)
    out = out_ptr + (m[:, None].to(tl.int64) * HEADS + h) * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(m[:, None] < rows) & (n[None, :] < N))


@triton.jit(do_not_specialize=["rows", "x_row", "x_head"])
def _head_matmul_kernel(
    x_ptr, w_ptr, out_ptr, rows, x_row, x_head, w_head, w_k, w_n, K, N,
    HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (head, row block, column block): out[rows, h, cols] in x's dtype."""
    head_matmul_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), x_ptr, w_ptr, out_ptr, rows,
        x_row, x_head, w_head, w_k, w_n, K, N, HEADS, BLOCK_M, BLOCK_N, BLOCK_K, PDL,
    )  # fmt: skip


def head_matmul_args(x: torch.Tensor, w: torch.Tensor, transpose: bool):
    """(out, grid, arguments, launch options) of a head_matmul launch (head_matmul says what x
    and w may be)."""
    rows, heads, k = x.shape
    if x.stride(2) != 1:
        raise ValueError("each head's values must be packed")
    n = w.shape[1] if transpose else w.shape[2]
    w_k, w_n = (w.stride(2), w.stride(1)) if transpose else (w.stride(1), w.stride(2))
    out = torch.empty(rows, heads, n, dtype=x.dtype, device=x.device)
    grid = (heads, triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
    args = (x, w, out, rows, x.stride(0), x.stride(1), w.stride(0), w_k, w_n, k, n)
    # (the tile and its warps set each output's chain of dot products: a kernel that runs
    # these programs beside its own takes them all, for the same bits)
    tile = {"HEADS": heads, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}
    return out, grid, args, tile | {"num_warps": 4, "num_stages": 3}


def head_matmul(x: torch.Tensor, w: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """x [rows, heads, K] (rows and heads may be strided, each head's values packed) times
    w [heads, K, N] a head, or with `transpose` w [heads, N, K] read as its transpose:
    [rows, heads, N] in x's dtype, packed. The launch reads shapes only: a CUDA graph
    holds it."""
    out, grid, args, launch = head_matmul_args(x, w, transpose)
    if x.shape[0]:
        _head_matmul_kernel[grid](*args, **launch, **pdl_options(x.device))
    return out


def head_matmul_ref(x: torch.Tensor, w: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """head_matmul through torch.bmm."""
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2) if transpose else w).transpose(0, 1)
