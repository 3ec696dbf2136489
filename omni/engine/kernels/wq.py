"""Weight-only quantized linear layers as the Hub's big checkpoints ship them.

Two formats (quant_weights.py reads them from a checkpoint's `quantization_config`):
- block FP8 (DeepSeek-V3, Kimi K2): e4m3 weights [N, K], one fp32 `scale_inv` per
  block of rows x columns (128 x 128), the real weight = e4m3 value * its block's scale;
- INT4 by groups (compressed-tensors "pack-quantized", Kimi K2.5): signed 4-bit values
  stored as nibbles q + 8, eight to an int32 from the lowest bits up along K, one scale
  per row per group of K (32), the real weight = q * scale.

The kernels read the weights as stored and dequantize each tile in registers before an
fp32-accumulated `tl.dot` with the activations (W8A16, W4A16): a decode step reads a
quarter (INT4) or half (FP8) of bf16's bytes. The e4m3 bytes are decoded by the GPU's
fp8 conversion where it has one (compute capability 8.9 on), else with integer ops, so
the FP8 kernel runs from compute capability 8.0. The references dequantize the whole
weight and multiply; the dequantizers here are the formats' definitions. Tiles are a
first cut, not tuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .hardware import capability
from .matmul import linear_ref
from .pdl import pdl_options, wait_for_inputs

FP8 = torch.float8_e4m3fn
INT4_PER_WORD = 8  # nibbles in an int32
INT4_OFFSET = 8  # stored nibble = q + 8, q in [-8, 7]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values (any integer dtype, [..., K] in [-8, 7]) as int32 words [..., ceil(K/8)]:
    value i of a row in bits 4*(i % 8) of word i // 8, as q + 8; K padded with zeros."""
    k = q.shape[-1]
    pad = -k % INT4_PER_WORD
    nibbles = torch.nn.functional.pad(q.to(torch.int64) + INT4_OFFSET, (0, pad))
    nibbles = nibbles.view(*q.shape[:-1], -1, INT4_PER_WORD)
    shifts = torch.arange(INT4_PER_WORD, device=q.device) * 4
    words = (nibbles << shifts).sum(dim=-1)  # < 2^32: the top nibble may set the sign bit
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """pack_int4's inverse: int8 values [..., k] in [-8, 7]."""
    shifts = torch.arange(INT4_PER_WORD, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # (arithmetic shift, then the nibble)
    q = nibbles.flatten(-2)[..., :k] - INT4_OFFSET
    return q.to(torch.int8)


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int
) -> torch.Tensor:
    """The real weight [N, in_features] in fp32: q * its group's scale."""
    q = unpack_int4(packed, in_features).float()
    return q * scale.float().repeat_interleave(group_size, dim=-1)[..., :in_features]


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """The real weight [N, K] in fp32: each e4m3 value times its block's scale."""
    n, k = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    return weight.float() * s.repeat_interleave(block[1], dim=-1)[..., :k]


def block_fp8_linear_ref(x, weight, scale_inv, bias=None, block=(128, 128)) -> torch.Tensor:
    """x [..., K] @ the dequantized weight.T (+ bias), as the dense linear computes it."""
    return linear_ref(x, dequantize_block_fp8(weight, scale_inv, block).to(x.dtype), bias)


def int4_linear_ref(x, packed, scale, bias=None, group_size=32) -> torch.Tensor:
    """x [..., K] @ the dequantized weight.T (+ bias), as the dense linear computes it."""
    w = dequantize_int4(packed, scale, x.shape[-1], group_size)
    return linear_ref(x, w.to(x.dtype), bias)


@triton.jit
def e4m3_to_f32(bits, HW: tl.constexpr = False):
    """e4m3fn bytes (uint8) as fp32, exact. HW (compute capability 8.9 on: fp8_in_hardware)
    through the GPU's fp8 conversion, a few instructions for what takes a dozen integer
    ops; else by integer ops, (8 + mantissa) * 2^(exp - 10), or mantissa * 2^-9 where the
    exponent is 0 (subnormal). NaN bytes are not expected."""
    if HW:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b = bits.to(tl.int32)
    exp = (b >> 3) & 0xF
    mant = (b & 7).to(tl.float32)
    pow2 = ((exp + 117) << 23).to(tl.float32, bitcast=True)  # 2^(exp - 10), biased by 127
    mag = tl.where(exp == 0, mant * 0.001953125, (mant + 8.0) * pow2)
    return tl.where((b & 0x80) != 0, -mag, mag)


def fp8_in_hardware(device: torch.device) -> bool:
    """Whether the GPU converts e4m3 itself (Ada and Hopper on); the interpreter does not."""
    return device.type == "cuda" and capability(device) >= (8, 9)


@triton.jit
def int4_values(w_ptr, rows, N, K, W_ROW, k0, BLOCK_K: tl.constexpr):
    """The INT4 values q [BLOCK_K, rows] (fp32) from K index k0 of words [N, ceil(K/8)]
    (rows W_ROW words apart): each word loaded once, its eight values shifted out in
    registers (loading a word once a value, eight times over, was many times slower).
    Each 4-bit v becomes a float without the integer conversion (a fraction of the
    float units' rate): v in the low mantissa bits of 2**23 is 2**23 + v exactly, and
    2**23 + 8 less is v - 8, the same value."""
    words_at = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # (8: INT4_PER_WORD)
    ok = (rows[None, :] < N) & (words_at[:, None] < tl.cdiv(K, 8))
    words = tl.load(w_ptr + rows[None, :] * W_ROW + words_at[:, None], mask=ok, other=0)
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    values = (words[:, None, :] >> shifts) & 0xF  # [words, 8, rows]: word j's value i is k 8j + i
    floats = (values | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2**23 + INT4_OFFSET
    return tl.reshape(floats, (BLOCK_K, rows.shape[0]))


@triton.jit
def group_scaled(w, s_ptr, scale_rows, rows, N, K, k0, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """w [BLOCK_K, rows] (from K index k0) times each (row, group of GROUP columns)'s
    scale, at s_ptr + scale_rows[row] + group: each scale read once and broadcast over its
    group (GROUP a power of two dividing BLOCK_K)."""
    groups: tl.constexpr = BLOCK_K // GROUP
    cols = k0 // GROUP + tl.arange(0, groups)
    ok = (rows[None, :] < N) & (cols[:, None] < tl.cdiv(K, GROUP))
    s = tl.load(s_ptr + scale_rows[None, :] + cols[:, None], mask=ok, other=0.0)
    grouped = tl.reshape(w, (groups, GROUP, rows.shape[0])) * s.to(tl.float32)[:, None, :]
    return tl.reshape(grouped, (BLOCK_K, rows.shape[0]))


@triton.jit
def _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, HAS_BIAS: tl.constexpr):
    """Both kernels' epilogue: the bias added in fp32, the tile stored in out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


@triton.jit(do_not_specialize=["M"])  # M follows the step's size
def _block_fp8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    s_stride,
    HAS_BIAS: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the scale block's columns: one scale per weight row a step
    HW_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    wait_for_inputs(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        ks = k * BLOCK_K + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * K + ks[None, :],
            mask=(offs_m[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        bits = tl.load(
            w_ptr + offs_n[None, :] * K + ks[:, None],
            mask=(offs_n[None, :] < N) & (ks[:, None] < K),
            other=0,
        )
        s = tl.load(s_ptr + (offs_n // SCALE_ROWS) * s_stride + k, mask=offs_n < N, other=0.0)
        w = e4m3_to_f32(bits, HW_FP8) * s.to(tl.float32)[None, :]
        acc = tl.dot(x, w.to(x.dtype), acc)
    _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])  # M follows the step's size
def _int4_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    w_stride,
    s_stride,
    HAS_BIAS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    wait_for_inputs(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        ks = k * BLOCK_K + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * K + ks[None, :],
            mask=(offs_m[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        q = int4_values(w_ptr, offs_n, N, K, w_stride, k * BLOCK_K, BLOCK_K)
        w = group_scaled(q, s_ptr, offs_n * s_stride, offs_n, N, K, k * BLOCK_K, GROUP, BLOCK_K)
        w = tl.where((offs_n[None, :] < N) & (ks[:, None] < K), w, 0.0)
        acc = tl.dot(x, w.to(x.dtype), acc)
    _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, HAS_BIAS)


def _tiles(m: int) -> dict:
    """Tiles by rows: narrow for decode steps, wider for prefill (untuned)."""
    return dict(BLOCK_M=16 if m <= 16 else 64, BLOCK_N=64, num_warps=4)


def _launch(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, tuple, dict]:
    """What both products start from: x as contiguous rows, the output, grid and tiles."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, cfg = x2.shape[0], _tiles(x2.shape[0])
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    return x2, out, grid, cfg


def block_fp8_linear(x, weight, scale_inv, bias=None, block=(128, 128)) -> torch.Tensor:
    """block_fp8_linear_ref's product on the GPU: x [..., K] (bf16/fp32), weight [N, K]
    e4m3, scale_inv [ceil(N/block[0]), ceil(K/block[1])]; block[1] a power of two >= 16."""
    x2, out, grid, cfg = _launch(x, weight.shape[0])
    (m, k), n = x2.shape, out.shape[1]
    if m:
        _block_fp8_kernel[grid](
            x2, weight.view(torch.uint8), scale_inv, bias if bias is not None else scale_inv,
            out, m, n, k, scale_inv.stride(0), HAS_BIAS=bias is not None,
            SCALE_ROWS=block[0], BLOCK_K=block[1], HW_FP8=fp8_in_hardware(x.device), **cfg,
            **pdl_options(x.device),
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def int4_linear(x, packed, scale, bias=None, group_size=32) -> torch.Tensor:
    """int4_linear_ref's product on the GPU: x [..., K] (bf16/fp32), packed [N, ceil(K/8)]
    int32, scale [N, ceil(K/group_size)]."""
    if group_size < 8 or group_size & (group_size - 1):
        raise ValueError(f"INT4 groups must be a power of two from 8, not {group_size}")
    x2, out, grid, cfg = _launch(x, packed.shape[0])
    (m, k), n = x2.shape, out.shape[1]
    if m:
        _int4_kernel[grid](
            x2, packed, scale, bias if bias is not None else scale, out, m, n, k,
            packed.stride(0), scale.stride(0), HAS_BIAS=bias is not None, GROUP=group_size,
            BLOCK_K=max(64, group_size), **cfg, **pdl_options(x.device),
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
