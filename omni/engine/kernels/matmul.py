"""Batch-invariant linear layer: y = x @ w.T (+ bias), each row computed the same way for any M.

cuBLAS picks its algorithm (split-K among others) from the problem size, so a
request's logits change with what else is in the batch, and greedy outputs of
concurrent requests drift from the same requests run alone. Here every output
element is one fp32 accumulator chained through `tl.dot` over K in order, never
split: the tile shape can then follow M (narrow tiles spread a decode step's
weight reads over all SMs, wide ones feed the tensor cores in prefill) without
changing a single bit of any row. The kernel tests check exactly that.

Two kernels compute those sums: one that loads tiles through pointers (any GPU; the fastest
for a few rows, where a step streams weights) and, from 65 rows on Hopper, one whose tiles
the TMA engine brings in (bit-identical; 25-30% faster on the H100 from 512 rows).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .hardware import capability, sm_count
from .pdl import pdl_options, prefetch_l2, wait_for_inputs
from .rows import TMA_MIN_ROWS, tile_rows

WIDE = 16384  # output columns from which a layer counts as wide (gate/up, lm head)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """torch's linear layer; bf16 on the CPU as one fp32 product rounded to bf16, which is
    a GPU's bf16 GEMM (fp32 accumulation): CPUs without bf16 instructions run torch's own
    bf16 GEMM at a sixth of fp32's speed (5.6x slower at SmolLM2's shapes here)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        up = None if bias is None else bias.float()
        return torch.nn.functional.linear(x.float(), weight.float(), up).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


SHARED_MEMORY = 200 * 1024  # of an H100 SM's 227 KiB, for the pipelined x and w tiles
TMA_SHARED_MEMORY = 226 * 1024  # the same, plus the epilogue's output tile
# TMA_MIN_ROWS (rows.py, whose row room starts there too): below it the pointer kernel's
# narrow tiles stream weights as fast
TMA_ENABLED = os.environ.get("OMNI_LINEAR_TMA", "1") != "0"  # 0: the pointer kernel only
# Steps of up to 16 rows under PDL: each program asks L2 for its first PREFETCH_TILES
# weight tiles (a power of two) before it waits for the kernel before, so its loads start
# warm (two were faster than none at batch 1 on an H100; every tile was slower: they take
# the bandwidth of the kernel that runs).
PREFETCH_TILES = int(os.environ.get("OMNI_LINEAR_PREFETCH_TILES", "2"))


def early_tiles(launch: dict, m: int) -> int:
    """The weight tiles a linear kernel's programs ask L2 for before their wait: launched
    dependently (`launch`: pdl_options') with up to 16 rows, PREFETCH_TILES; else none."""
    return PREFETCH_TILES if launch["PDL"] and m <= 16 else 0


@triton.jit
def prefetch_weight_tiles(w_ptr, pid_n, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          TILES: tl.constexpr):  # fmt: skip
    """Ask L2 for the first TILES tiles of K of this program's BLOCK_N weight rows ([N, K],
    row-major), a 128-byte line at a time."""
    line: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    cols = tl.minimum(tl.arange(0, TILES * BLOCK_K // line) * line, K - 1)
    prefetch_l2(w_ptr + rows[:, None] * K + cols[None, :])


def tile_config(m: int, n: int, itemsize: int = 2, tma: bool = False) -> dict:
    """The tiles measured fastest on an H100 (bf16) for this many rows, for the TMA kernel
    (`tma`: the hardware and the tensors allow it; then "persistent" is among the keys) or
    the pointer one (bench/diagnostics/tune_linear.py: bench/results/tune-linear-h100.json
    up to 64 rows, tune-linear-h100-mid.json up to 256, tune-linear-h100-prefill.json
    beyond; the wide layers' of 17-64 rows on an H200, tune-linear-moonlight-h200.json),
    with fewer pipeline stages where wider types need it."""
    if tma and m >= TMA_MIN_ROWS:
        return _tma_tiles(m, n, itemsize)
    if m <= 16:  # decode of a few sequences: pure weight streaming, 16-row tiles
        # narrow layers (o, down, a router) have few column tiles: 4 warps each read
        # faster (measured on an H100 at one row, the same bits)
        warps = 4 if n <= 4096 else 2
        cfg, stages = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=warps), 6
        if 2048 < n <= 4096:  # 32 columns a tile: fastest for Llama-3-8B's o and
            # Moonlight's q/latent input (tune-linear-h100.json, -moonlight-h200.json)
            cfg["BLOCK_N"], stages = 32, 5
    elif m <= 64 and n >= WIDE:  # an lm head, gate/up: wider tiles of 32 rows
        # (tune-linear-moonlight-h200.json; docs/performance.md)
        cfg, stages = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=2), 3
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


def _tma_tiles(m: int, n: int, itemsize: int) -> dict:
    """TMA tiles by rows and output width, measured on an H100 (bf16) at 128, 256, 512, 2,048
    and 8,192 rows (bench/results/tune-linear-h100-tma.json)."""
    if m <= 128:
        if n >= WIDE:  # gate/up, lm head
            tiles = (128, 128, 128, 8, 3, True)
        elif n > 4096:  # fused q/k/v
            tiles = (64, 128, 128, 4, 4, True)
        else:  # o, down
            tiles = (64, 64, 128, 4, 6, True)
    elif m <= 256:
        tiles = (128, 128, 64, 4, 5, True) if n > 4096 else (64, 128, 128, 4, 4, True)
    elif m <= 1024:
        tiles = (128, 256, 64, 8, 3, True) if 4096 < n < WIDE else (128, 128, 64, 4, 5, True)
    else:  # prefill: one program per tile only pays for gate/up in the largest chunks
        tiles = (128, 256, 64, 8, 3, not (m > 4096 and n >= WIDE))
    bm, bn, bk, warps, stages, persistent = tiles
    per_stage, epilogue = (bm + bn) * bk * itemsize, bm * bn * itemsize
    stages = max(1, min(stages, (TMA_SHARED_MEMORY - epilogue) // per_stage))
    return dict(
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
        persistent=persistent,
    )


def tma_usable(*tensors: torch.Tensor) -> bool:
    """Whether the TMA engine can address these 2-D tensors: a Hopper-or-later GPU (or
    Triton's interpreter, on the CPU), 16-byte aligned bases and row strides."""
    first = tensors[0]
    if first.is_cuda and capability(first.device)[0] < 9:
        return False
    return all(
        t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.stride(0) * t.element_size() % 16 == 0
        for t in tensors
    )


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program `pid`'s (row tile, column tile): GROUP_M row tiles take each column tile in
    turn, so neighbouring programs share row tiles and the weight tiles they read stay in
    L2."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


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
    PDL: tl.constexpr = False,
    PREFETCH_TILES: tl.constexpr = 0,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if PREFETCH_TILES > 0:  # the first weight tiles into L2 while the kernel before ends
        prefetch_weight_tiles(w_ptr, pid_n, N, K, BLOCK_N, BLOCK_K, PREFETCH_TILES)
    wait_for_inputs(PDL)

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


# M and the program count follow the step's size: neither may be a constexpr or specialized
# on, or a step of a new size waits for a build (the program count is the tile count when
# not persistent, and below the SM count for small grids)
@triton.jit(do_not_specialize=["M", "programs"])
def _linear_tma_kernel(
    x_desc,
    w_desc,
    out_desc,
    bias_ptr,
    M,
    N,
    K,
    programs,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
    STAGES: tl.constexpr,
):
    """The same sums as `_linear_kernel`, with tiles brought in by the TMA engine: no
    address arithmetic or masks in the loop, so the SM's warps only feed the tensor cores.
    Persistent (`programs` = SMs), each program walks tiles, and the next tile's loads overlap
    this tile's epilogue; otherwise one program per tile."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, programs, flatten=PERSISTENT):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
            x = x_desc.load([off_m, k * BLOCK_K])  # out of bounds: zeros
            w = w_desc.load([off_n, k * BLOCK_K])
            acc = tl.dot(x, w.T, acc)
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))  # clipped to M x N


def weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The weight's TMA descriptor for this tile, made once (weights stay put, and an eager
    step's host time is mostly launches: ~11 us a descriptor on the H100 host). Kept on the
    tensor, so it goes with it; keyed by address and shape, which a reload may change."""
    key = (block_n, block_k, weight.data_ptr(), tuple(weight.shape))
    made = getattr(weight, "_omni_tma_descriptors", None)
    if made is None:
        made = {}
        weight._omni_tma_descriptors = made
    desc = made.get(key)
    if desc is None:
        desc = made[key] = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    return desc


def tma_programs(device: torch.device, tiles: int, persistent: bool) -> int:
    """A TMA kernel's program count: one per SM walking the tiles (persistent), else one
    per tile (in the interpreter, on the CPU, a few programs walk them)."""
    slots = sm_count(device) if device.type == "cuda" else 4
    return min(tiles, slots) if persistent else tiles


def launch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, cfg: dict
) -> None:
    """out = x @ weight.T (+ bias) with these tiles: TMA ones (with "persistent") or not."""
    (m, k), n = x.shape, weight.shape[0]
    cfg = dict(cfg)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    bias_arg = bias if bias is not None else weight
    if "persistent" not in cfg:
        launch = pdl_options(x.device)
        _linear_kernel[(tiles,)](
            x, weight, bias_arg, out, m, n, k, HAS_BIAS=bias is not None, GROUP_M=8,
            PREFETCH_TILES=early_tiles(launch, m), **launch, **cfg,
        )  # fmt: skip
        return
    persistent = cfg.pop("persistent")
    programs = tma_programs(x.device, tiles, persistent)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    _linear_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(tile_rows(x, bm), [bm, bk]),  # see rows.py
        weight_descriptor(weight, bn, bk),
        TensorDescriptor.from_tensor(out, [bm, bn]),
        bias_arg,
        m,
        n,
        k,
        programs,
        HAS_BIAS=bias is not None,
        GROUP_M=8,
        PERSISTENT=persistent,
        STAGES=cfg["num_stages"],
        **cfg,
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x: [..., K]; weight: [N, K] (contiguous, as nn.Linear stores it)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    m = x2.shape[0]
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        tma = TMA_ENABLED and m >= TMA_MIN_ROWS and tma_usable(x2, weight, out)
        launch_linear(x2, weight, bias, out, tile_config(m, n, x.element_size(), tma))
    return out.view(*shape[:-1], n)
