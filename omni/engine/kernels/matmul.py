"""Batch-invariant linear layer: y = x @ w.T (+ bias), each row computed the same way for any M.

cuBLAS picks its algorithm (split-K among others) from the problem size, so a
request's logits change with what else is in the batch, and greedy outputs of
concurrent requests drift from the same requests run alone. Here every output
element is one fp32 accumulator chained through `tl.dot` over K in order, never
split: the tile shape can then follow M (narrow tiles spread a decode step's
weight reads over all SMs, wide ones feed the tensor cores in prefill) without
changing a single bit of any row. The kernel tests check exactly that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WIDE = 16384  # output columns from which a layer counts as wide (gate/up, lm head)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    return torch.nn.functional.linear(x, weight, bias)


SHARED_MEMORY = 200 * 1024  # of an H100 SM's 227 KiB, for the pipelined x and w tiles


def tile_config(m: int, n: int, itemsize: int = 2) -> dict:
    """The tiles measured fastest on an H100 (bf16) for this many rows
    (bench/tune_linear.py: bench/results/tune-linear-h100.json up to 64 rows,
    tune-linear-h100-mid.json up to 256, tune-linear-h100-prefill.json beyond), with fewer
    pipeline stages where wider types need it."""
    if m <= 16:  # decode of a few sequences: pure weight streaming, 16-row tiles
        cfg, stages = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=2), 6
    elif m <= 64:  # memory-bound: many narrow column tiles, deep pipelines
        block_n = 16 if n <= 2048 else 32
        cfg = dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=128, num_warps=4)
        stages = 6 if block_n == 16 else 5
    elif m <= 128:  # decode of a large batch: by output width (measured at 128 rows)
        if n >= WIDE:  # gate/up, lm head
            cfg, stages = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4), 3
        elif n > 4096:  # fused q/k/v
            cfg, stages = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4), 4
        else:  # o, down
            cfg, stages = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4), 5
    elif m <= 256:  # measured at 256 rows
        if n >= WIDE:
            cfg, stages = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8), 3
        elif n > 4096:
            cfg, stages = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8), 4
        else:
            cfg, stages = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8), 4
    elif m <= 1024:  # big decode batches, short prefills (measured at 512 rows)
        cfg, stages = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4), 3
    else:  # prefill chunks (measured at 2048 rows)
        cfg, stages = dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8), 3
    per_stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * itemsize
    return {**cfg, "num_stages": max(1, min(stages, SHARED_MEMORY // per_stage))}


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Neighbouring programs share row tiles, so the weight tiles they read stay in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] < k_left), other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(
        out_ptrs,
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x: [..., K]; weight: [N, K] (contiguous, as nn.Linear stores it)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        cfg = tile_config(m, n, x.element_size())
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _linear_kernel[grid](
            x2,
            weight,
            bias if bias is not None else weight,
            out,
            m,
            n,
            k,
            HAS_BIAS=bias is not None,
            GROUP_M=8,
            **cfg,
        )
    return out.view(*shape[:-1], n)
