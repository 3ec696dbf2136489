"""The W8A8 linear layer on FP8 tensor cores (Ada, Hopper): fp8_linear_ref's sums, batch-invariant.

The first kernel quantizes each row of x to e4m3 by its own absolute max, so a token's
bits depend on that token alone. The second is the bf16 linear's kernel (matmul.py) on
e4m3 tiles: every output element is one fp32 accumulator chained through `tl.dot` over K
in order, whatever the tile shape. The scales (the weight row's, then the row's:
`scaled`) and the bias are applied once, at the end. Up to FEW_ROWS rows a third kernel
computes the same sums with the operands swapped (the weight rows as the MMA's 64 rows),
and from TMA_MIN_ROWS rows a fourth with tiles the TMA engine brings in, as the bf16
linear does. On Hopper they launch dependently (pdl.py), and a few rows' programs ask L2
for their first weight tiles before their wait, as the bf16 linear's do.

From VENDOR_MIN_ROWS rows, where torch's own row-wise FP8 GEMM (torch._scaled_mm: CUTLASS
on Hopper) is faster, it runs instead, for as long as it gives these kernels' bits: it
chains the same MMA over K, promoted every 128, and scales the same way (`scaled`), so a
row's bits still do not depend on its batch. Each layer shape is checked once, on first
use at each size class, against the kernels here on that call's rows; where it differs, the
kernels here keep that size (fp8_linear).
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .e4m3 import FP8, FP8_MAX, attached_rows
from .hardware import capability
from .matmul import (
    TMA_ENABLED,
    TMA_SHARED_MEMORY,
    WIDE,
    early_tiles,
    grouped_tile,
    prefetch_weight_tiles,
    tma_programs,
    tma_usable,
    weight_descriptor,
)
from .pdl import pdl_options, wait_for_inputs
from .rows import TMA_MIN_ROWS, empty_rows, tile_rows

QUANT_BLOCK = 1024  # a row's elements per loop step when quantizing a long row
# From this many rows torch._scaled_mm takes over (module docstring): on the H100, a
# Llama-3-8B layer's four projections 481 -> 361 us at 1,024 rows, 3,795 -> 2,886 at 8,192
# (bench/diagnostics/fp8_large_rows.py); at 400 rows it was slower (282 against 233).
# Above the mixed steps' CUDA graphs (up to 1,024 tokens), so the first use's check
# never runs in a capture.
VENDOR_MIN_ROWS = 1025
VENDOR = os.environ.get("OMNI_FP8_VENDOR", "1") != "0"  # 0: our kernels at every size
FEW_ROWS = 16  # up to this many rows, the few-rows kernel (its token tile)
WHOLE_ROW = 16384  # rows up to this long are quantized in one read (Llama-3-8B's down: 14,336)


@triton.jit
def e4m3_scale(amax, FMAX: tl.constexpr):
    """A row's scale from its absolute max: quantize_rows' (this file's kernel, the norm's)."""
    return tl.maximum(amax, 1e-12) / FMAX


@triton.jit
def e4m3_values(x, scale, FMAX: tl.constexpr):
    """fp32 values of a row scaled into e4m3's range, before the cast: quantize_rows'."""
    return tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)


@triton.jit
def scaled(acc, w_scale, x_scale):
    """The epilogue's scales (both broadcast to acc's shape) in the one order every kernel
    here applies them: the weight row's, then the row's. It is torch._scaled_mm's
    row-wise order on Hopper: with the row's first, a few outputs a projection differed
    from it in the last bit on an H100; with the weight's, none."""
    return acc * w_scale * x_scale


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    FMAX: tl.constexpr,
    BLOCK: tl.constexpr,
    WHOLE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if WHOLE:  # the whole row in registers (BLOCK >= K): one read
        x = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = e4m3_scale(tl.max(tl.abs(x), axis=0), FMAX)
        tl.store(scale_ptr + row, scale)
        q = e4m3_values(x, scale, FMAX)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:  # two passes, BLOCK at a time
        amax = tl.zeros((BLOCK,), tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK)):
            ks = k * BLOCK + offs
            x = tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = e4m3_scale(tl.max(amax, axis=0), FMAX)
        tl.store(scale_ptr + row, scale)
        for k in range(0, tl.cdiv(K, BLOCK)):
            ks = k * BLOCK + offs
            x = tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
            q = e4m3_values(x, scale, FMAX)
            tl.store(q_ptr + row * K + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3.quantize_rows on the GPU: (e4m3 rows, fp32 scales [rows]) of x [M, K]. A row of
    up to WHOLE_ROW elements is read once into registers (a decode step's o and down
    inputs: each of the two passes over L2 was a round trip of its own), longer ones in
    QUANT_BLOCK pieces twice; the bits are the same."""
    m, k = x.shape
    q = empty_rows(m, k, FP8, x.device)  # room for whole row tiles: the TMA loads (rows.py)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k) if k <= WHOLE_ROW else QUANT_BLOCK
        _quantize_rows_kernel[(m,)](
            x, q, scale, k, FMAX=FP8_MAX, BLOCK=block, WHOLE=block >= k,
            num_warps=min(16, max(4, block // 512)), **pdl_options(x.device),
        )  # fmt: skip
    return q, scale


@triton.jit(do_not_specialize=["M"])  # M follows the step's size (see matmul.py)
def _fp8_linear_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
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
    PROMOTE_K: tl.constexpr = 128,
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
        # (promoted into the fp32 accumulator after each tile's K: Hopper's FP8 MMA sums
        # with fewer bits, so long K would lose precision otherwise)
        acc = tl.dot(x, w, acc, max_num_imprecise_acc=PROMOTE_K)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    x_scale = tl.load(x_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    acc = scaled(acc, w_scale[None, :], x_scale[:, None])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


@triton.jit(do_not_specialize=["M"])  # M follows the step's size (see matmul.py)
def _fp8_few_rows_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROMOTE_K: tl.constexpr = 128,
    PDL: tl.constexpr = False,
    PREFETCH_TILES: tl.constexpr = 0,
):
    """`_fp8_linear_kernel`'s sums for up to BLOCK_T rows, its operands swapped: BLOCK_N
    (64+) weight rows are the MMA's rows and the tokens its columns, so a program's shared
    memory holds weight tiles and a sliver of x where the other kernel pads x to 64 rows.
    Each output element is the same fp32 chain over K with the same MMA, and the scales
    are applied in the same order (`scaled`): the same bits (the H100 test)."""
    pid_n, pid_t = tl.program_id(0), tl.program_id(1)
    if PREFETCH_TILES > 0:  # the first weight tiles into L2 while the kernel before ends
        prefetch_weight_tiles(w_ptr, pid_n, N, K, BLOCK_N, BLOCK_K, PREFETCH_TILES)
    wait_for_inputs(PDL)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
    x_ptrs = x_ptr + offs_t[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_left), other=0.0)
        x = tl.load(x_ptrs, mask=(offs_t[None, :] < M) & (offs_k[:, None] < k_left), other=0.0)
        acc = tl.dot(w, x, acc, max_num_imprecise_acc=PROMOTE_K)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    x_scale = tl.load(x_scale_ptr + offs_t, mask=offs_t < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    acc = scaled(acc, w_scale[:, None], x_scale[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + offs_t[None, :] * N + offs_n[:, None],
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_t[None, :] < M) & (offs_n[:, None] < N),
    )


# M and the program count follow the step's size: neither may be specialized on (matmul.py)
@triton.jit(do_not_specialize=["M", "programs"])
def _fp8_linear_tma_kernel(
    x_desc,
    x_scale_ptr,
    w_desc,
    w_scale_ptr,
    bias_ptr,
    out_desc,
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
    PROMOTE_K: tl.constexpr = 128,
):
    """The same sums as `_fp8_linear_kernel`, its tiles brought in by the TMA engine (as
    matmul._linear_tma_kernel's are): out-of-bounds rows and columns read as zeros, the
    store clips to M x N. Persistent (`programs` = SMs) or one program per tile."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, programs, flatten=PERSISTENT):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
            x = x_desc.load([off_m, k * BLOCK_K])
            w = w_desc.load([off_n, k * BLOCK_K])
            acc = tl.dot(x, w.T, acc, max_num_imprecise_acc=PROMOTE_K)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        x_scale = tl.load(x_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
        w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = scaled(acc, w_scale[None, :], x_scale[:, None])
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def fp8_tiles(m: int, n: int, k: int, tma: bool = False) -> dict:
    """Tiles by rows and output width. Every one has at least 64 rows (of x, or of the
    weight in the few-rows kernel) and takes K 128 at a time: on Hopper a 16-row tile's FP8
    MMA (mma) sums differently from a 64-row one's (wgmma), so a row's bits would follow the
    batch's size (the H100 test caught it); within that family, column width, warps and
    stages keep the bits (a sweep on the H100). Up to FEW_ROWS rows, the few-rows kernel: on the
    H100, Llama-3-8B's four projections at 1 row, 32 layers' weights back to back, took
    85.5 us a layer against 93.8 with the pointer kernel's tiles (down 28.4 -> 23.3 us;
    bench/diagnostics/fp8_few_rows.py). Past 512 rows: a first cut, not yet tuned. From TMA_MIN_ROWS
    with `tma` (Hopper, usable tensors): the TMA kernel's tiles, with "persistent"
    (_fp8_tma_tiles)."""
    if tma and m >= TMA_MIN_ROWS:
        return _fp8_tma_tiles(m, n, k)
    if m <= FEW_ROWS:  # the few-rows kernel: 64 weight rows a program, K 128 at a time
        return dict(BLOCK_N=64, BLOCK_T=FEW_ROWS, BLOCK_K=128, num_warps=4,
                    num_stages=12 if k > 8192 else 8)  # fmt: skip
    if m <= 128:  # (3 stages here: down at 64 rows 46.3 -> 62.5 us)
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5)
    if m <= 512:  # at 300 rows: q/k/v 44.8 -> 25.3 us, down 74.4 -> 71.6 against 128-row tiles
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4)


# The TMA kernel's tiles, the fastest of a sweep on an H100 on Llama-3-8B's projections at
# 128, 256, 512, 2,048 and 8,192 rows (bench/diagnostics/tune_linear.py --fp8,
# tune-linear-fp8-h100.json; every config kept the bits): up to this many rows, by
# layer, (BLOCK_M, BLOCK_N, warps, stages, persistent); BLOCK_K is 128 (the bits:
# fp8_tiles).
FP8_TMA_TILES = (
    (128, {"gate_up": (128, 128, 8, 6, 1), "down": (64, 64, 4, 6, 0),
           "qkv": (64, 128, 4, 3, 0), "o": (64, 64, 4, 3, 0)}),
    (256, {"gate_up": (128, 128, 8, 5, 1), "down": (64, 64, 4, 5, 0),
           "qkv": (64, 64, 4, 4, 0), "o": (64, 128, 4, 3, 0)}),
    (1024, {"gate_up": (128, 128, 8, 5, 1), "down": (64, 128, 4, 4, 0),
            "qkv": (64, 64, 4, 4, 0), "o": (64, 128, 4, 4, 0)}),
    (4096, dict.fromkeys(("gate_up", "down", "qkv", "o"), (128, 256, 8, 3, 0))),
    (None, {"gate_up": (128, 128, 8, 5, 1), "down": (128, 256, 8, 3, 0),
            "qkv": (128, 128, 8, 4, 1), "o": (128, 128, 8, 4, 1)}),
)  # fmt: skip


def _fp8_tma_tiles(m: int, n: int, k: int) -> dict:
    """FP8_TMA_TILES' tiles for this many rows and this layer's shape."""
    layer = "gate_up" if n >= WIDE else "qkv" if n > 4096 else "down" if k > 8192 else "o"
    by_layer = next(tiles for most, tiles in FP8_TMA_TILES if most is None or m <= most)
    bm, bn, warps, stages, persistent = by_layer[layer]
    per_stage, epilogue = (bm + bn) * 128, bm * bn * 2  # e4m3 tiles in, a bf16 tile out
    stages = max(1, min(stages, (TMA_SHARED_MEMORY - epilogue) // per_stage))
    return dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=warps, num_stages=stages,
        persistent=bool(persistent),
    )  # fmt: skip


def launch_fp8_linear(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: dict,
) -> None:
    """out = the W8A8 product of quantized rows with these tiles: the few-rows kernel's
    (with "BLOCK_T"), TMA ones (with "persistent") or the pointer kernel's."""
    (m, k), n = xq.shape, weight.shape[0]
    cfg = dict(cfg)
    bias_arg = bias if bias is not None else weight_scale
    if "BLOCK_T" in cfg:  # the few-rows kernel
        launch = pdl_options(xq.device)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_T"]))
        _fp8_few_rows_kernel[grid](
            xq, x_scale, weight, weight_scale, bias_arg, out, m, n, k, HAS_BIAS=bias is not None,
            PREFETCH_TILES=early_tiles(launch, m), **launch, **cfg,
        )  # fmt: skip
        return
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    if "persistent" not in cfg:
        launch = pdl_options(xq.device)
        _fp8_linear_kernel[(tiles,)](
            xq, x_scale, weight, weight_scale, bias_arg, out, m, n, k, HAS_BIAS=bias is not None,
            GROUP_M=8, PREFETCH_TILES=early_tiles(launch, m), **launch, **cfg,
        )  # fmt: skip
        return
    persistent = cfg.pop("persistent")
    programs = tma_programs(xq.device, tiles, persistent)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    _fp8_linear_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(tile_rows(xq, bm), [bm, bk]),  # see rows.py
        x_scale,
        weight_descriptor(weight, bn, bk),
        weight_scale,
        bias_arg,
        TensorDescriptor.from_tensor(out, [bm, bn]),
        m, n, k, programs, HAS_BIAS=bias is not None, GROUP_M=8, PERSISTENT=persistent,
        STAGES=cfg["num_stages"], **cfg,
    )  # fmt: skip


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """e4m3.fp8_linear_ref's W8A8 sums on the GPU: x [..., K] (bf16), weight [N, K] e4m3,
    weight_scale [N] fp32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    (m, k), n = x2.shape, weight.shape[0]
    if not m:
        return torch.empty(*shape[:-1], n, dtype=x.dtype, device=x.device)
    xq, xs = attached_rows(x) or quantize_rows(x2)  # (a norm's, before q/k/v and gate/up)
    if vendor_usable(xq, weight, bias, x.dtype):
        key = (x.device.index, n, k, triton.next_power_of_2(m))
        use = _VENDOR_GIVES_OUR_BITS.get(key)
        if use is not False:
            theirs = vendor_fp8_linear(xq, xs, weight, weight_scale)
            if use:
                return theirs.view(*shape[:-1], n)
            ours = our_fp8_linear(xq, xs, weight, weight_scale, None, x.dtype)
            _VENDOR_GIVES_OUR_BITS[key] = same = torch.equal(ours, theirs)
            if not same:
                log.warning(
                    "torch._scaled_mm does not give the W8A8 kernels' bits at %d x %d, %d "
                    "rows: this size stays on them", n, k, m,
                )  # fmt: skip
            return ours.view(*shape[:-1], n)
    return our_fp8_linear(xq, xs, weight, weight_scale, bias, x.dtype).view(*shape[:-1], n)


def our_fp8_linear(xq, xs, weight, weight_scale, bias, dtype: torch.dtype) -> torch.Tensor:
    """The product by the kernels here, with the tiles fp8_tiles picks."""
    (m, k), n = xq.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    tma = TMA_ENABLED and m >= TMA_MIN_ROWS and tma_usable(xq, weight, out)
    launch_fp8_linear(xq, xs, weight, weight_scale, bias, out, fp8_tiles(m, n, k, tma))
    return out


log = logging.getLogger(__name__)
# (device, N, K, rows rounded up to a power of two): whether torch._scaled_mm gave the
# kernels' bits the first time it ran there (it picks its tiles by size)
_VENDOR_GIVES_OUR_BITS: dict[tuple, bool] = {}


def vendor_usable(xq: torch.Tensor, weight: torch.Tensor, bias, dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm may take this product: enough rows, on Hopper, outside a
    CUDA graph's capture (its first run at a size is compared with ours, which waits for
    the GPU), no bias (its bias is not added in our order), bf16 out, multiples of 16."""
    (m, k), n = xq.shape, weight.shape[0]
    return (
        VENDOR and m >= VENDOR_MIN_ROWS and bias is None and dtype == torch.bfloat16
        and xq.is_cuda and capability(xq.device)[0] == 9 and k % 16 == 0 and n % 16 == 0
        and not torch.cuda.is_current_stream_capturing()
    )  # fmt: skip


def vendor_fp8_linear(xq, xs, weight, weight_scale) -> torch.Tensor:
    """The product by torch._scaled_mm with per-row and per-channel scales."""
    return torch._scaled_mm(
        xq, weight.t(), scale_a=xs.view(-1, 1), scale_b=weight_scale.view(1, -1),
        out_dtype=torch.bfloat16, use_fast_accum=False,
    )  # fmt: skip
