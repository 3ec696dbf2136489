"""MLA's per-token inputs on their way to attention (kernels/mla.py): the query's and the
latent key's rope, and each token's cache row [latent | rotated rope key].

`mla_rope_and_cache` is a kernel of its own: rope.py's writes K and V of one width at one
row stride, where a latent row is two widths (latent, rope) in one row, and the latent's
RMS norm (kv_a_layernorm) is applied on its way. The model's GPU path launches it with the
query's absorbing product (head_matmul.py) as one kernel, `mla_query_and_cache`: two
independent jobs of the same inputs, a launch's start and end fewer a layer.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .head_matmul import head_matmul_args, head_matmul_program, head_matmul_ref
from .pdl import pdl_options, wait_for_inputs
from .rope import rope_and_cache_ref


def mla_rope_and_cache_ref(
    q_rope, latent, k_rope, positions, inv_freq, cache, slot_mapping, norm=None, eps=1e-6
) -> torch.Tensor:
    """Returns q_rope [tokens, heads, rope] rotated; writes each token's [latent | rotated
    k_rope] row into `cache` [blocks, block_size, 1, latent + rope] at its slot (-1:
    nowhere). Rotate-half layout (deepseek_v3.py permutes the checkpoint's interleaved
    rope rows into it at load). `norm`: the latent's RMS norm weight (kv_a_layernorm),
    applied to the latent on its way (as norm.rms_norm_ref, in the latent's dtype)."""
    if norm is not None:
        xf = latent.float()
        latent = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm.float()).to(
            latent.dtype
        )
    width = latent.shape[-1]
    rope_part, latent_part = cache[..., width:], cache[..., :width]  # views: writes land
    return rope_and_cache_ref(
        q_rope, k_rope[:, None], latent[:, None], positions, inv_freq,
        rope_part, latent_part, slot_mapping,
    )  # fmt: skip


ROPE_HEADS = 8  # query heads a rope program rotates: one angle computation serves them all


@triton.jit
def _rope_cache_program(
    t, group, q_ptr, latent_ptr, k_ptr, q_out_ptr, pos_ptr, inv_freq_ptr, cache_ptr,
    slot_ptr, norm_ptr, eps, n_heads, q_row, q_head, latent_row, k_row, cache_row,
    LATENT: tl.constexpr, LATENT_P2: tl.constexpr, HALF: tl.constexpr,
    HALF_P2: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Token t's group: HEADS query heads' rope parts rotated, or (the last group) the
    token's cache row: its latent (NORM: RMS-normed, rounded to its dtype), then its rope
    key rotated."""
    j = tl.arange(0, HALF_P2)
    half_ok = j < HALF
    # the angles before the wait (PDL): positions are the step's input (pdl.py)
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(
        inv_freq_ptr + j, mask=half_ok, other=0.0
    ).to(tl.float32)
    cos, sin = tl.cos(angle), tl.sin(angle)
    wait_for_inputs(PDL)
    if group < tl.cdiv(n_heads, HEADS):
        h = group * HEADS + tl.arange(0, HEADS)
        mask = (h < n_heads)[:, None] & half_ok[None, :]
        src = q_ptr + t * q_row + h[:, None] * q_head + j[None, :]
        dst = q_out_ptr + (t * n_heads + h[:, None]) * (2 * HALF) + j[None, :]
        _rotate_half(src, dst, mask, cos[None, :], sin[None, :], HALF)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            row = cache_ptr + slot.to(tl.int64) * cache_row
            d = tl.arange(0, LATENT_P2)
            value = tl.load(latent_ptr + t * latent_row + d, mask=d < LATENT, other=0.0)
            if NORM:  # rms_norm's math: fp32, rounded to the latent's dtype
                x = value.to(tl.float32)
                w = tl.load(norm_ptr + d, mask=d < LATENT, other=0.0).to(tl.float32)
                rstd = tl.rsqrt(tl.sum(x * x, axis=0) / LATENT + eps)
                value = (x * rstd * w).to(latent_ptr.dtype.element_ty)
            tl.store(row + d, value.to(cache_ptr.dtype.element_ty), mask=d < LATENT)
            _rotate_half(k_ptr + t * k_row + j, row + LATENT + j, half_ok, cos, sin, HALF)


# positions and slots are views into the step's packed inputs (rope.py says why)
@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])
def _mla_rope_cache_kernel(
    q_ptr, latent_ptr, k_ptr, q_out_ptr, pos_ptr, inv_freq_ptr, cache_ptr, slot_ptr,
    norm_ptr, eps, n_heads, q_row, q_head, latent_row, k_row, cache_row,
    LATENT: tl.constexpr, LATENT_P2: tl.constexpr, HALF: tl.constexpr,
    HALF_P2: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (token, group): _rope_cache_program's."""
    _rope_cache_program(
        tl.program_id(0), tl.program_id(1), q_ptr, latent_ptr, k_ptr, q_out_ptr, pos_ptr,
        inv_freq_ptr, cache_ptr, slot_ptr, norm_ptr, eps, n_heads, q_row, q_head,
        latent_row, k_row, cache_row, LATENT, LATENT_P2, HALF, HALF_P2, HEADS, NORM, PDL,
    )  # fmt: skip


@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr", "rows", "x_row", "x_head", "products"])
def _mla_query_kernel(
    x_ptr, w_ptr, lat_ptr, rows, x_row, x_head, w_head, w_k, w_n, K, N, products,
    q_ptr, latent_ptr, k_ptr, q_out_ptr, pos_ptr, inv_freq_ptr, cache_ptr, slot_ptr,
    norm_ptr, eps, q_row, q_head, latent_row, k_row, cache_row,
    HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUPS: tl.constexpr, ROPE_H: tl.constexpr,
    LATENT: tl.constexpr, LATENT_P2: tl.constexpr, HALF: tl.constexpr,
    HALF_P2: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The first `products` programs: head_matmul's (the query's nope part into the latent
    space, by head, then row block, then column block); the rest: _mla_rope_cache_kernel's
    (by token, then group). Two independent jobs on one step's inputs in one launch, each
    program's work and bits those of its own kernel."""
    w = tl.program_id(0)
    if w < products:
        blocks = tl.cdiv(rows, BLOCK_M)
        head_matmul_program(
            w % HEADS, (w // HEADS) % blocks, w // HEADS // blocks, x_ptr, w_ptr, lat_ptr,
            rows, x_row, x_head, w_head, w_k, w_n, K, N, HEADS, BLOCK_M, BLOCK_N, BLOCK_K,
            PDL,
        )  # fmt: skip
    else:
        r = w - products
        _rope_cache_program(
            r // GROUPS, r % GROUPS, q_ptr, latent_ptr, k_ptr, q_out_ptr, pos_ptr,
            inv_freq_ptr, cache_ptr, slot_ptr, norm_ptr, eps, HEADS, q_row, q_head,
            latent_row, k_row, cache_row, LATENT, LATENT_P2, HALF, HALF_P2, ROPE_H, NORM, PDL,
        )  # fmt: skip


@triton.jit
def _rotate_half(src_ptr, dst_ptr, mask, cos, sin, HALF: tl.constexpr):
    """dst's halves = x1 cos - x2 sin, x2 cos + x1 sin (x = src, the pointers at its first
    half), in fp32, rounded to src's dtype (as the reference), stored in dst's."""
    x1 = tl.load(src_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = src_ptr.dtype.element_ty
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr, (x1 * cos - x2 * sin).to(ty).to(out_ty), mask=mask)
    tl.store(dst_ptr + HALF, (x2 * cos + x1 * sin).to(ty).to(out_ty), mask=mask)


def mla_rope_and_cache(
    q_rope, latent, k_rope, positions, inv_freq, cache, slot_mapping, norm=None, eps=1e-6
) -> torch.Tensor:
    """mla_rope_and_cache_ref on the GPU, in one launch (the latent's norm too: a launch
    of its own fewer a layer): q_rope [tokens, heads, rope], latent [tokens, latent],
    k_rope [tokens, rope] may be views with strided rows (each head's values packed).
    Returns the rotated q_rope, packed."""
    tokens, heads, rope = q_rope.shape
    width = latent.shape[1]
    if q_rope.stride(2) != 1 or latent.stride(1) != 1 or k_rope.stride(1) != 1:
        raise ValueError("each head's values must be packed")
    q_out = torch.empty(tokens, heads, rope, dtype=q_rope.dtype, device=q_rope.device)
    if not tokens:
        return q_out
    half = rope // 2
    _mla_rope_cache_kernel[(tokens, triton.cdiv(heads, ROPE_HEADS) + 1)](
        q_rope, latent, k_rope, q_out, positions, inv_freq, cache, slot_mapping,
        latent if norm is None else norm, eps,
        heads, q_rope.stride(0), q_rope.stride(1), latent.stride(0), k_rope.stride(0),
        cache.stride(1),
        LATENT=width, LATENT_P2=triton.next_power_of_2(width), HALF=half,
        HALF_P2=triton.next_power_of_2(half), HEADS=ROPE_HEADS, NORM=norm is not None,
        **pdl_options(q_rope.device),
    )  # fmt: skip
    return q_out


def mla_query_and_cache_ref(
    q_nope, w_uk, q_rope, latent, k_rope, positions, inv_freq, cache, slot_mapping,
    norm=None, eps=1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(head_matmul_ref(q_nope, w_uk), mla_rope_and_cache_ref(the rest)): the absorbed
    query's two parts, the cache rows written."""
    rotated = mla_rope_and_cache_ref(
        q_rope, latent, k_rope, positions, inv_freq, cache, slot_mapping, norm, eps
    )
    return head_matmul_ref(q_nope, w_uk), rotated


def mla_query_and_cache(
    q_nope, w_uk, q_rope, latent, k_rope, positions, inv_freq, cache, slot_mapping,
    norm=None, eps=1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """head_matmul(q_nope, w_uk) and mla_rope_and_cache(the rest) in one launch (a decode
    step's layer waits out one kernel's start and end fewer): (the latent query [tokens,
    heads, latent], the rotated q_rope [tokens, heads, rope]), the same bits as the two
    launches'. The inputs as those functions take them."""
    tokens, heads, rope = q_rope.shape
    width = latent.shape[1]
    if q_rope.stride(2) != 1 or latent.stride(1) != 1 or k_rope.stride(1) != 1:
        raise ValueError("each head's values must be packed")
    if q_nope.shape[:2] != (tokens, heads):
        raise ValueError("q_nope and q_rope must hold the same tokens and heads")
    lat, grid, args, launch = head_matmul_args(q_nope, w_uk, False)
    q_out = torch.empty(tokens, heads, rope, dtype=q_rope.dtype, device=q_rope.device)
    if not tokens:
        return lat, q_out
    products, groups, half = math.prod(grid), triton.cdiv(heads, ROPE_HEADS) + 1, rope // 2
    _mla_query_kernel[(products + tokens * groups,)](
        *args, products, q_rope, latent, k_rope, q_out, positions, inv_freq, cache,
        slot_mapping, latent if norm is None else norm, eps, q_rope.stride(0),
        q_rope.stride(1), latent.stride(0), k_rope.stride(0), cache.stride(1),
        **launch, GROUPS=groups, ROPE_H=ROPE_HEADS, LATENT=width,
        LATENT_P2=triton.next_power_of_2(width), HALF=half,
        HALF_P2=triton.next_power_of_2(half), NORM=norm is not None, **pdl_options(q_rope.device),
    )  # fmt: skip
    return lat, q_out
