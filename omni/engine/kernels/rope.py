"""Rotary embedding of q and k, fused with writing k and v into the paged KV cache (and,
for Qwen3, with the per-head RMS norm of q and k before it: two kernels fewer a layer).

Cache layout (per layer): [num_blocks, block_size, kv_heads, head_dim]; token t
goes to slot `slot_mapping[t]` = block * block_size + offset (negative: skip).
Rotate-half convention, as in HF Llama. An FP8 cache (kv_cache.py) gets each rotated k
and each v rounded to the model's dtype, divided by its head's scale, saturated to
e4m3's range and rounded to e4m3: the reference's steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .e4m3 import FP8, FP8_MAX
from .norm import rms_norm_ref
from .pdl import pdl_options, wait_for_inputs

E4M3_MAX = tl.constexpr(FP8_MAX)


def rope_and_cache_ref(
    q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, norms=None, kv_scales=None
):
    """Returns rotated q; writes rotated k and v into the caches at their slots. `norms`:
    (q weight, k weight, eps) of a per-head RMS norm applied to q and k first;
    `kv_scales`: [2, kv_heads], an FP8 cache's."""
    if norms is not None:
        q_w, k_w, eps = norms
        q, k = rms_norm_ref(q, q_w, eps)[0], rms_norm_ref(k, k_w, eps)[0]
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def rotate(x):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    q_out, k_rot = rotate(q), rotate(k)
    keep = slot_mapping >= 0
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if kv_scales is not None:
        k_rot, v = (
            (x.float() / s.float()[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            for x, s in zip((k_rot, v), kv_scales, strict=True)
        )
    flat_k[slot_mapping[keep]] = k_rot[keep]
    flat_v[slot_mapping[keep]] = v[keep]
    return q_out


@triton.jit
def _to_cache(x, dst_ptr, scale, mask, SCALED: tl.constexpr):
    """Store x (in the model's dtype) at dst; SCALED: an FP8 cache's, divided by its head's
    `scale` ([heads, 1]) and saturated first."""
    if SCALED:
        x = tl.clamp(x.to(tl.float32) / scale, -E4M3_MAX, E4M3_MAX)
    tl.store(dst_ptr, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_half_into(
    src_ptr,
    dst_ptr,
    mask,
    cos,
    sin,
    HALF: tl.constexpr,
    w_ptr,
    j,
    eps,
    NORM: tl.constexpr,
    scale,
    SCALED: tl.constexpr,
):
    """dst[..., :HALF], dst[..., HALF:] = x1 cos - x2 sin, x2 cos + x1 sin (x = src; the
    pointers address a [heads, HALF] block of first halves), in src's dtype, then as
    _to_cache stores it. NORM: x is first each head's RMS norm times w_ptr's weights,
    rounded to src's dtype as the norm kernel's is."""
    x1 = tl.load(src_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = src_ptr.dtype.element_ty
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (x1 * rstd[:, None] * w1).to(ty).to(tl.float32)
        x2 = (x2 * rstd[:, None] * w2).to(ty).to(tl.float32)
    _to_cache((x1 * cos - x2 * sin).to(ty), dst_ptr, scale, mask, SCALED)
    _to_cache((x2 * cos + x1 * sin).to(ty), dst_ptr + HALF, scale, mask, SCALED)


HEADS = 8  # heads a program rotates: one angle computation serves them all


# A step's positions and slots are views into one packed host-to-device copy
# (ModelRunner.prepare), so their 16-byte alignment follows the step's token count; each
# program reads one of each, so a build per alignment would buy nothing.
@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])
def _rope_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    pos_ptr,
    inv_freq_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scale_ptr,
    slot_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    n_q_heads,
    n_kv_heads,
    q_row,
    k_row,
    v_row,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    NORM: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token, group): HEADS query heads, or HEADS key/value heads after the
    query groups."""
    t = tl.program_id(0)
    group = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    # the angles before the wait (PDL): the positions are the step's input, which the
    # projection right before does not write (pdl.py)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + j, mask=j < HALF, other=0.0)
    cos, sin = tl.cos(angle)[None, :], tl.sin(angle)[None, :]
    wait_for_inputs(PDL)
    dim = 2 * HALF
    q_groups = tl.cdiv(n_q_heads, HEADS)
    if group < q_groups:
        h = group * HEADS + tl.arange(0, HEADS)
        mask = (h < n_q_heads)[:, None] & (j < HALF)[None, :]
        src = q_ptr + t * q_row + h[:, None] * dim + j[None, :]
        dst = q_out_ptr + (t * n_q_heads + h[:, None]) * dim + j[None, :]
        _rotate_half_into(src, dst, mask, cos, sin, HALF, q_norm_ptr, j, eps, NORM, 1.0, False)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            h = (group - q_groups) * HEADS + tl.arange(0, HEADS)
            mask = (h < n_kv_heads)[:, None] & (j < HALF)[None, :]
            cached = (slot * n_kv_heads + h[:, None]) * dim + j[None, :]
            k_scale = 1.0
            v_scale = 1.0
            if KV_FP8:
                head_ok = h < n_kv_heads
                k_scale = tl.load(kv_scale_ptr + h, mask=head_ok, other=1.0)[:, None]
                v_scale = tl.load(kv_scale_ptr + n_kv_heads + h, mask=head_ok, other=1.0)[:, None]
            k_src = k_ptr + t * k_row + h[:, None] * dim + j[None, :]
            _rotate_half_into(
                k_src,
                k_cache_ptr + cached,
                mask,
                cos,
                sin,
                HALF,
                k_norm_ptr,
                j,
                eps,
                NORM,
                k_scale,
                KV_FP8,
            )
            v_src = v_ptr + t * v_row + h[:, None] * dim + j[None, :]
            v1 = tl.load(v_src, mask=mask, other=0.0)
            v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
            _to_cache(v1, v_cache_ptr + cached, v_scale, mask, KV_FP8)
            _to_cache(v2, v_cache_ptr + cached + HALF, v_scale, mask, KV_FP8)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim] with its heads packed in each row (any row stride, e.g. a
    view into the fused qkv projection's output): as is; otherwise a packed copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def rope_and_cache(
    q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, norms=None, kv_scales=None
):
    """q, k, v: [tokens, heads, head_dim], each row's heads packed; rows may be strided
    (views into one fused projection: no copies). `norms`: (q weight, k weight, eps) of a
    per-head RMS norm of q and k, applied in the same kernel. `kv_scales`: [2, kv_heads],
    an FP8 cache's (module docstring)."""
    if (kv_scales is not None) != (k_cache.dtype == FP8):
        raise ValueError("an FP8 KV cache, and only one, takes kv_scales")
    n_tokens, n_q, dim = q.shape
    n_kv = k.shape[1]
    q, k, v = _rows(q), _rows(k), _rows(v)
    q_out = torch.empty(n_tokens, n_q, dim, dtype=q.dtype, device=q.device)
    half = dim // 2
    groups = triton.cdiv(n_q, HEADS) + triton.cdiv(n_kv, HEADS)
    _rope_cache_kernel[(n_tokens, groups)](
        q,
        k,
        v,
        q_out,
        positions,
        inv_freq,
        k_cache,
        v_cache,
        inv_freq if kv_scales is None else kv_scales,  # (unread without KV_FP8)
        slot_mapping,
        norms[0] if norms else inv_freq,  # (unread without NORM)
        norms[1] if norms else inv_freq,
        norms[2] if norms else 0.0,
        n_q,
        n_kv,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        HEADS=HEADS,
        NORM=norms is not None,
        KV_FP8=kv_scales is not None,
        **pdl_options(q.device),
    )
    return q_out
