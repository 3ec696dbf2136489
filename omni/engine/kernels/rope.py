"""Rotary embedding of q and k, fused with writing k and v into the paged KV cache (and,
for Qwen3, with the per-head RMS norm of q and k before it: two kernels fewer a layer).

Cache layout (per layer): [num_blocks, block_size, kv_heads, head_dim]; token t
goes to slot `slot_mapping[t]` = block * block_size + offset (negative: skip).
Rotate-half convention, as in HF Llama.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rope_and_cache_ref(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, norms=None):
    """Returns rotated q; writes rotated k and v into the caches at their slots. `norms`:
    (q weight, k weight, eps) of a per-head RMS norm applied to q and k first."""
    if norms is not None:
        from .norm import rms_norm_ref

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
    flat_k[slot_mapping[keep]] = k_rot[keep]
    flat_v[slot_mapping[keep]] = v[keep]
    return q_out


@triton.jit
def _rotate_half_into(
    src_ptr, dst_ptr, mask, cos, sin, HALF: tl.constexpr, w_ptr, j, eps, NORM: tl.constexpr
):
    """dst[..., :HALF], dst[..., HALF:] = x1 cos - x2 sin, x2 cos + x1 sin (x = src; the
    pointers address a [heads, HALF] block of first halves). NORM: x is first each head's
    RMS norm times w_ptr's weights, rounded to the output type as the norm kernel's is."""
    x1 = tl.load(src_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (x1 * rstd[:, None] * w1).to(out_ty).to(tl.float32)
        x2 = (x2 * rstd[:, None] * w2).to(out_ty).to(tl.float32)
    tl.store(dst_ptr, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst_ptr + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


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
):
    """Program (token, group): HEADS query heads, or HEADS key/value heads after the
    query groups."""
    t = tl.program_id(0)
    group = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + j, mask=j < HALF, other=0.0)
    cos, sin = tl.cos(angle)[None, :], tl.sin(angle)[None, :]
    dim = 2 * HALF
    q_groups = tl.cdiv(n_q_heads, HEADS)
    if group < q_groups:
        h = group * HEADS + tl.arange(0, HEADS)
        mask = (h < n_q_heads)[:, None] & (j < HALF)[None, :]
        src = q_ptr + t * q_row + h[:, None] * dim + j[None, :]
        dst = q_out_ptr + (t * n_q_heads + h[:, None]) * dim + j[None, :]
        _rotate_half_into(src, dst, mask, cos, sin, HALF, q_norm_ptr, j, eps, NORM)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            h = (group - q_groups) * HEADS + tl.arange(0, HEADS)
            mask = (h < n_kv_heads)[:, None] & (j < HALF)[None, :]
            cached = (slot * n_kv_heads + h[:, None]) * dim + j[None, :]
            k_src = k_ptr + t * k_row + h[:, None] * dim + j[None, :]
            _rotate_half_into(
                k_src, k_cache_ptr + cached, mask, cos, sin, HALF, k_norm_ptr, j, eps, NORM
            )
            v_src = v_ptr + t * v_row + h[:, None] * dim + j[None, :]
            v_ty = v_cache_ptr.dtype.element_ty
            v1 = tl.load(v_src, mask=mask, other=0.0)
            v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
            tl.store(v_cache_ptr + cached, v1.to(v_ty), mask=mask)
            tl.store(v_cache_ptr + cached + HALF, v2.to(v_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim] with its heads packed in each row (any row stride, e.g. a
    view into the fused qkv projection's output): as is; otherwise a packed copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def rope_and_cache(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, norms=None):
    """q, k, v: [tokens, heads, head_dim], each row's heads packed; rows may be strided
    (views into one fused projection: no copies). `norms`: (q weight, k weight, eps) of a
    per-head RMS norm of q and k, applied in the same kernel."""
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
    )
    return q_out
