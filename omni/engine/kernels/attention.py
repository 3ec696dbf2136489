"""Paged attention over the KV cache: prefill/extend (varlen, causal) and decode (split-KV).

Queries of several sequences are packed along the token axis: sequence b owns
rows cu_seqlens_q[b]:cu_seqlens_q[b+1], which are its *last* tokens, so each
attends to its cached prefix plus the new tokens up to itself. The new tokens'
K/V are already in the cache (rope_and_cache writes them first).

Decode (one query per sequence) splits each sequence's context across programs
and merges the partial results by their log-sum-exp (the last of a sequence's programs
to finish does, arrivals.py); the query heads that share a KV head are packed into one
tile, so the dot products run on tensor cores.

An FP8 cache (e4m3) holds each value divided by its KV head's scale (kv_scales:
[2, kv_heads] fp32, K's then V's; kv_cache.py): the kernels read it in the model's dtype
and fold the scales into the logits' scale and the output. Decode in a bf16 model reads
it in fp16 instead, in which e4m3 values are exact: the conversion is one instruction a
pair where bf16 takes three (faster on the H100 at Llama-3-8B's heads, from 16 to 400
sequences). The query goes to fp16
too (exact for |q| in fp16's normal range; clamped to its max), and so do the
probabilities (finer than bf16). The kernel is still bound by its work per token rather
than its bytes over an e4m3 cache (README).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters, arrive_last
from .e4m3 import FP8
from .hardware import sm_count
from .pdl import pdl_options, prefetch_l2, wait_for_inputs
from .rows import empty_rows

NEG_INF = tl.constexpr(-1.0e30)  # finite: a fully masked row gives 0, not NaN
F16_MAX = tl.constexpr(65504.0)
PREFILL_BLOCK_M = 64  # queries a prefill program takes


def paged_attention_ref(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, kv_scales=None
):
    """q: [tokens, q_heads, dim]; caches: [blocks, block_size, kv_heads, dim], values
    times `kv_scales` [2, kv_heads] where given (an FP8 cache).

    One sequence at a time, so a row's result never depends on its batch. The query
    heads that share a KV head are one matrix against it (as the GPU kernels pack them),
    not copies of K and V per query head as torch's SDPA makes: on SmolLM2 at 32
    sequences this takes a CPU decode step's attention from 195 to 100 ms (of 510-600)."""
    out = torch.empty_like(q)
    block_size, kv_heads, dim = k_cache.shape[1:]
    lens, starts = seq_lens.tolist(), cu_seqlens_q.tolist()
    # every sequence's blocks in one gather per cache, then a slice each: two gathers
    # per sequence cost about as much as its attention
    counts = [-(-length // block_size) for length in lens]
    ids = [i for row, c in zip(block_tables.tolist(), counts, strict=False) for i in row[:c]]
    ids = torch.tensor(ids, dtype=torch.long, device=k_cache.device)
    k_all = k_cache.index_select(0, ids).flatten(0, 1).float()  # [blocks * size, kv, d]
    v_all = v_cache.index_select(0, ids).flatten(0, 1).float()
    if kv_scales is not None:
        k_scale, v_scale = (scales.float()[None, :, None] for scales in kv_scales)
        k_all, v_all = k_all * k_scale, v_all * v_scale
    first = 0  # the sequence's first row in k_all and v_all
    for b, length in enumerate(lens):
        qs, qe = starts[b], starts[b + 1]
        n = qe - qs
        k, v = k_all[first : first + length], v_all[first : first + length]  # [L, kv, d]
        first += counts[b] * block_size
        # [kv, n * group, d]: KV head j's query heads, token by token
        grouped = (
            q[qs:qe].float().view(n, kv_heads, -1, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
        )
        logits = torch.bmm(grouped, k.permute(1, 2, 0)) * scale  # [kv, n * group, L]
        if n > 1:  # causal: token t (at position length - n + t) sees keys up to itself
            q_pos = torch.arange(length - n, length, device=q.device)
            q_pos = q_pos.repeat_interleave(grouped.shape[1] // n)
            keys = torch.arange(length, device=q.device)
            logits.masked_fill_(keys[None, :] > q_pos[:, None], float("-inf"))
        attn = torch.bmm(torch.softmax(logits, dim=-1), v.transpose(0, 1))  # [kv, n * g, d]
        out[qs:qe] = attn.view(kv_heads, n, -1, dim).transpose(0, 1).reshape(n, -1, dim).to(q.dtype)
    return out


# Triton compiles a variant of a kernel for each class of its integer arguments (1, a
# multiple of 16, other) and of its pointers' alignment, at the first step that meets it:
# seconds of stall mid-serving. The block-table width and split stride vary with the
# batch, and a mixed step hands the prefill kernel its rows of the tables and lengths
# (a slice, aligned or not); none of them is worth specializing on: scalar loads and
# strides.
ANY_BATCH = ["max_blocks", "block_tables_ptr", "seq_lens_ptr"]


@triton.jit
def _head_scales(kv_scale_ptr, kh, n_kv_heads, scale, KV_FP8: tl.constexpr):
    """(the logits' scale, V's scale) of KV head kh: an FP8 cache's K scale folds into
    the former; a cache in the model's dtype has none (1: the bits of no scale at all)."""
    if KV_FP8:
        qk_scale = scale * tl.load(kv_scale_ptr + kh)
        v_scale = tl.load(kv_scale_ptr + n_kv_heads + kh)
    else:
        qk_scale = scale
        v_scale = 1.0
    return qk_scale, v_scale


@triton.jit(do_not_specialize=[*ANY_BATCH, "cu_q_ptr", "work_ptr", "counts_ptr"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scale_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_q_ptr,
    work_ptr,
    counts_ptr,
    scale,
    max_blocks,
    n_q_heads,
    n_kv_heads,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    w = tl.program_id(0)  # an entry of the work list: (row, query block)
    h = tl.program_id(1)
    if w < tl.load(counts_ptr + 1):
        b = tl.load(work_ptr + 2 * w)
        m_block = tl.load(work_ptr + 2 * w + 1)
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        length = tl.load(seq_lens_ptr + b)
        first_pos = length - q_len
        kh = h // GROUP
        qk_scale, v_scale = _head_scales(kv_scale_ptr, kh, n_kv_heads, scale, KV_FP8)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, DIM)
        offs_n = tl.arange(0, BLOCK_SIZE)
        row_ok = offs_m < q_len
        q_rows = (q_start + offs_m) * n_q_heads + h
        q = tl.load(
            q_ptr + q_rows[:, None] * DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0
        )
        q_pos = first_pos + offs_m
        m_i = tl.full((BLOCK_M,), NEG_INF, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, DIM), tl.float32)
        hi = tl.minimum(length, first_pos + (m_block + 1) * BLOCK_M)  # causal bound
        for start in range(0, hi, BLOCK_SIZE):
            block = tl.load(block_tables_ptr + b * max_blocks + start // BLOCK_SIZE)
            rows = (block * BLOCK_SIZE + offs_n) * n_kv_heads + kh
            k = tl.load(k_cache_ptr + rows[:, None] * DIM + offs_d[None, :]).to(q.dtype)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            key_pos = start + offs_n
            visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < length)
            s = tl.where(visible, s, NEG_INF)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            p = tl.where(visible, p, 0.0)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + rows[:, None] * DIM + offs_d[None, :]).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        if KV_FP8:
            out = out * v_scale
        tl.store(
            out_ptr + q_rows[:, None] * DIM + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


def _scales_or_any(kv_scales: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor:
    """The scales' pointer, or (no FP8 cache: never read) any tensor in its place; an FP8
    cache without its scales would read as values off by them, so it is refused."""
    if kv_scales is None:
        if cache.dtype == FP8:
            raise ValueError("an FP8 KV cache needs its kv_scales")
        return cache
    return kv_scales


def prefill_work(q_lens: Iterable[int], first_row: int = 0, block_m: int = PREFILL_BLOCK_M):
    """The prefill kernel's work list: (row, query block) for every block of `block_m`
    queries of every row (sequence), rows counted from `first_row`. Its programs take
    their work from it, so their grid is its length, or any bound on it (a CUDA graph's),
    whatever the batch's shape."""
    return [(row, m) for row, n in enumerate(q_lens, first_row) for m in range(-(-n // block_m))]


def paged_prefill(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    scale,
    work: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    block_m: int = PREFILL_BLOCK_M,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
):
    """Rows of `q` that are prompt chunks (see the module's docstring), through `work`
    ([entries, 2] int32, prefill_work's list on the device: the grid's size) of which
    the first `counts[1]` (a device tensor) are real; without them, every row's
    (built here, which waits for the device). `out`: where to write ([tokens, q_heads,
    dim], contiguous), else a new tensor. `kv_scales`: an FP8 cache's (module docstring)."""
    _, n_q, dim = q.shape
    n_kv, block_size = k_cache.shape[2], k_cache.shape[1]
    if work is None:
        cu = cu_seqlens_q.tolist()
        entries = prefill_work((e - s for s, e in itertools.pairwise(cu)), 0, block_m)
        work = torch.tensor(entries, dtype=torch.int32, device=q.device).view(-1, 2)
        counts = torch.tensor([0, len(entries)], dtype=torch.int32, device=q.device)
    if out is None:
        out = empty_rows(q.shape[0], n_q * dim, q.dtype, q.device).view(q.shape)  # feeds o
    if not work.shape[0]:
        return out
    _prefill_kernel[(work.shape[0], n_q)](
        q.contiguous(),
        k_cache,
        v_cache,
        _scales_or_any(kv_scales, k_cache),
        out,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        work,
        counts,
        scale,
        block_tables.shape[1],
        n_q,
        n_kv,
        GROUP=n_q // n_kv,
        DIM=dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        KV_FP8=kv_scales is not None,
    )
    return out


# Decode splits. A sequence's context is cut into splits by its own length alone (at most
# MAX_SPLITS; a short one into a tile each, at least MIN_SPLIT_TILES splits from there, a
# long one into runs of MIN_SPLIT_TILES tiles of DECODE_TILE tokens), each split's
# partial result is kept apart and the merge combines them in a fixed order (split 0 first)
# in whichever program of the sequence's KV head finishes last (on the H100, as fast as
# the same merge in a kernel of its own, or faster, from 1 to 512 sequences; same bits).
# How many programs share the splits is then free to follow the batch (few sequences: many
# programs, so a long context is read by the whole GPU) without changing a single bit
# of any sequence's output: batch invariance.
MAX_SPLITS = 16
MIN_SPLIT_TILES = 4
DECODE_TILE = 64  # tokens per loop step: several pages' loads in flight at once
# Launch options. Warps may change the bits (not per batch: every program runs the same way)
SPLIT_LAUNCH = {"num_warps": 4, "num_stages": 2}


@triton.jit
def _split_layout(length, TILE: tl.constexpr, MAX_S: tl.constexpr, MIN_TILES: tl.constexpr):
    """(tiles per split, number of splits) of a context of `length` tokens: a tile per
    split up to MIN_TILES tiles, then MIN_TILES splits, then splits of MIN_TILES tiles."""
    n_tiles = tl.cdiv(length, TILE)
    wanted = tl.maximum(tl.minimum(n_tiles, MIN_TILES), tl.cdiv(n_tiles, MIN_TILES))
    per = tl.cdiv(n_tiles, tl.minimum(MAX_S, wanted))
    return per, tl.cdiv(n_tiles, per)


@triton.jit(do_not_specialize=[*ANY_BATCH, "counts_ptr", "split_stride"])  # see _prefill_kernel
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scale_ptr,
    part_ptr,
    lse_ptr,
    out_ptr,
    arrivals_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    counts_ptr,
    scale,
    max_blocks,
    n_q_heads,
    n_kv_heads,
    split_stride,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    MAX_S: tl.constexpr,
    MIN_TILES: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    qk_scale, v_scale = _head_scales(kv_scale_ptr, kh, n_kv_heads, scale, KV_FP8)
    programs = tl.num_programs(2)
    # Before the wait (PDL): the step's counts, lengths and block tables, which the rope
    # kernel right before does not write (pdl.py), and this program's first tile of K and V
    # asked into L2 (the rope kernel may be writing the new token's: L2 sees its writes).
    live = b < tl.load(counts_ptr)  # rows past the step's decodes: a graph's padding
    length = tl.load(seq_lens_ptr + b, mask=live, other=1)
    per, n_splits = _split_layout(length, TILE, MAX_S, MIN_TILES)
    n_splits = tl.where(live, n_splits, 0)
    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, DIM)
    offs_t = tl.arange(0, TILE)
    if PDL:
        first = tl.program_id(2) * per * TILE + offs_t
        ahead = (first < length) & (tl.program_id(2) < n_splits)
        block = tl.load(
            block_tables_ptr + b * max_blocks + first // BLOCK_SIZE, mask=ahead, other=0
        )
        lines = (block * BLOCK_SIZE + first % BLOCK_SIZE) * n_kv_heads + kh
        halves = tl.arange(0, 2) * (DIM // 2)  # a row's two halves: 128-byte lines at bf16
        prefetch_l2(k_cache_ptr + lines[:, None] * DIM + halves[None, :])
        prefetch_l2(v_cache_ptr + lines[:, None] * DIM + halves[None, :])
    wait_for_inputs(PDL)
    head_ok = offs_g < GROUP
    heads = kh * GROUP + offs_g
    q = tl.load(
        q_ptr + (b * n_q_heads + heads)[:, None] * DIM + offs_d[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
    if KV_FP8:  # noqa: SIM102 (a constexpr, then the dtype: both resolved at compile time)
        if q.dtype == tl.bfloat16:  # K, V and the products in fp16 (module docstring)
            q = tl.clamp(q.to(tl.float32), -F16_MAX, F16_MAX).to(tl.float16)
    for split in range(tl.program_id(2), n_splits, programs):
        m_i = tl.full((BLOCK_H,), NEG_INF, tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, DIM), tl.float32)
        for t in range(split * per, tl.minimum((split + 1) * per, tl.cdiv(length, TILE))):
            pos = t * TILE + offs_t
            visible = pos < length
            block = tl.load(
                block_tables_ptr + b * max_blocks + pos // BLOCK_SIZE, mask=visible, other=0
            )
            rows = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * n_kv_heads + kh
            k = tl.load(
                k_cache_ptr + rows[:, None] * DIM + offs_d[None, :],
                mask=visible[:, None],
                other=0.0,
            ).to(q.dtype)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(visible[None, :], s, NEG_INF)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.where(visible[None, :], tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_cache_ptr + rows[:, None] * DIM + offs_d[None, :],
                mask=visible[:, None],
                other=0.0,
            ).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        part = acc / tl.maximum(l_i, 1e-30)[:, None]
        if KV_FP8:
            part = part * v_scale
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), NEG_INF)
        slot = (b * n_q_heads + heads) * split_stride + split
        tl.store(part_ptr + slot[:, None] * DIM + offs_d[None, :], part, mask=head_ok[:, None])
        tl.store(lse_ptr + slot, lse, mask=head_ok)
    last = arrive_last(arrivals_ptr + b * n_kv_heads + kh, programs)
    if last & (n_splits > 0):  # (no splits: a graph's padding, whose output is left be)
        rows = b * n_q_heads + heads
        _merge_splits(part_ptr, lse_ptr, out_ptr, rows, head_ok, n_splits, split_stride, DIM, MAX_S)


@triton.jit
def _merge_splits(
    part_ptr, lse_ptr, out_ptr, rows, head_ok, n_splits, split_stride, DIM: tl.constexpr,
    MAX_S: tl.constexpr, MERGE_UNROLL: tl.constexpr = 4,
):  # fmt: skip
    """out[rows] = the splits' partial outputs, each weighted by its share of the softmax's
    mass (exp of its log-sum-exp), added in split order. The splits were written by other
    programs: read past L1."""
    offs_s = tl.arange(0, MAX_S)
    offs_d = tl.arange(0, DIM)
    lse_rows = lse_ptr + rows * split_stride
    lse = tl.load(
        lse_rows[:, None] + offs_s[None, :],
        mask=head_ok[:, None] & (offs_s[None, :] < n_splits),
        other=NEG_INF,
        cache_modifier=".cg",
    )
    top = tl.max(lse, axis=1)
    acc = tl.zeros((rows.shape[0], DIM), tl.float32)
    total = tl.zeros((rows.shape[0],), tl.float32)
    for first in range(0, n_splits, MERGE_UNROLL):
        for u in tl.static_range(MERGE_UNROLL):  # these splits' loads go out together
            s = first + u
            real = rows * 0 + s < n_splits
            ok = head_ok & real
            lse_s = tl.load(lse_rows + s, mask=ok, other=NEG_INF, cache_modifier=".cg")
            w = tl.where(real, tl.exp(lse_s - top), 0.0)
            part = tl.load(
                part_ptr + (rows * split_stride + s)[:, None] * DIM + offs_d[None, :],
                mask=ok[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            acc += part * w[:, None]
            total += w
    out = acc / total[:, None]
    tl.store(
        out_ptr + rows[:, None] * DIM + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None],
    )


def max_decode_splits(length: int) -> int:
    """The most splits any context of at most `length` tokens is cut into."""
    tiles = -(-length // DECODE_TILE)
    return min(MAX_SPLITS, max(min(tiles, MIN_SPLIT_TILES), -(-tiles // MIN_SPLIT_TILES)))


def decode_programs(pairs: int, device: torch.device) -> int:
    """Programs per (sequence, KV head): about four per SM in all, a power of two. In the
    H100 sweep (decode-attention-h100.json) this is the best count or within 11% of it."""
    if device.type != "cuda":
        return 1
    want = -(-4 * sm_count(device) // pairs)
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


def paged_decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    programs: int | None = None,
    out: torch.Tensor | None = None,
    rows: int | None = None,
    counts: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
):
    """q: [tokens, q_heads, dim]; its first `rows` (default: all) are sequences' one new
    token each (already in the cache), of which the first `counts[0]` (a device tensor;
    default: all `rows`) are real: a CUDA graph launches for the most a step can have.
    `programs` per (sequence, KV head) changes the speed only, never the output. `out`:
    where to write (like q, contiguous; other rows untouched), else a new tensor.
    `kv_scales`: an FP8 cache's (module docstring)."""
    tokens, n_q, dim = q.shape
    batch = tokens if rows is None else rows
    n_kv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = n_q // n_kv
    if counts is None:
        counts = torch.full((1,), batch, dtype=torch.int32, device=q.device)
    programs = programs or decode_programs(batch * n_kv, q.device)
    stride = max_decode_splits(block_tables.shape[1] * block_size)
    part = torch.empty(batch, n_q, stride, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, n_q, stride, dtype=torch.float32, device=q.device)
    layout = {"TILE": DECODE_TILE, "MAX_S": MAX_SPLITS, "MIN_TILES": MIN_SPLIT_TILES}
    if out is None:
        out = empty_rows(tokens, n_q * dim, q.dtype, q.device).view(tokens, n_q, dim)  # feeds o
    _decode_split_kernel[(batch, n_kv, programs)](
        q.contiguous(),
        k_cache,
        v_cache,
        _scales_or_any(kv_scales, k_cache),
        part,
        lse,
        out,
        arrival_counters(q.device, batch * n_kv),
        block_tables,
        seq_lens,
        counts,
        scale,
        block_tables.shape[1],
        n_q,
        n_kv,
        stride,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        DIM=dim,
        BLOCK_SIZE=block_size,
        KV_FP8=kv_scales is not None,
        **SPLIT_LAUNCH,
        **layout,
        **pdl_options(q.device),
    )
    return out
