"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache: torch references.

A token's cache row in a layer is one "head" [latent (kv_lora_rank) | rotated rope key
(qk_rope_head_dim)], shared by every query head: a few hundred values where per-head K
and V would take tens of thousands. Per head h, kv_b_proj expands a latent c into
k_nope_h = W_uk[h] c and v_h = W_uv[h] c.

- Prefill (many queries a sequence) expands the context's latents and attends as usual:
  the expansion is paid once for many queries.
- Decode (one query a sequence) absorbs instead: q_nope_h . (W_uk[h] c) equals
  (W_uk[h]^T q_nope_h) . c, so the query moves into the latent space and attention runs
  over the cache rows as they are (one KV head of width latent + rope, values its latent
  part); the output W_uv[h] (sum_t p_t c_t) leaves it. `mla_decode_ref` is that attention,
  the slot for a FlashMLA-style kernel.

Rows and sequences are laid out as in attention.py (cu_seqlens_q, seq_lens, block tables).

The Triton kernels run the absorbed form for every row, prefill and extend too: a
sequence's new rows attend causally as attention.py's do, and `mla_attention_ref` is
what they compute. All query heads share the one latent "KV head", so a program takes a
tile of heads (of several rows where the heads are few) as the M of its tensor-core dots.
The grid comes from shapes alone (a program finds its sequence in cu_seqlens_q), so CUDA
graphs can capture it. A decode row's long context is split across programs and the
splits merged by log-sum-exp; where a split starts depends on the sequence's length alone,
so a row's bits never depend on its batch. The rows' rope and cache writes are
mla_rope.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from .hardware import sm_count
from .head_matmul import head_matmul_args
from .pdl import pdl_options, wait_for_inputs

NEG_INF = tl.constexpr(-1.0e30)  # finite: a fully masked row gives 0, not NaN


def context_rows(cache, block_tables, seq_lens) -> list[torch.Tensor]:
    """Each sequence's cached rows [length, latent + rope] in fp32, in one gather."""
    block_size = cache.shape[1]
    lens = seq_lens.tolist()
    counts = [-(-length // block_size) for length in lens]
    ids = [i for row, c in zip(block_tables.tolist(), counts, strict=False) for i in row[:c]]
    ids = torch.tensor(ids, dtype=torch.long, device=cache.device)
    rows = cache.index_select(0, ids).flatten(0, 1)[:, 0].float()
    out, first = [], 0
    for length, c in zip(lens, counts, strict=True):
        out.append(rows[first : first + length])
        first += c * block_size
    return out


def mla_prefill_ref(
    q, cache, kv_b_weight, block_tables, seq_lens, cu_seqlens_q, scale, nope_dim, v_dim
) -> torch.Tensor:
    """The expanded form, causal: q [tokens, heads, nope + rope] of the step's sequences
    (their last tokens), keys [W_uk c | k_rope] and values W_uv c of every context token.
    kv_b_weight: [heads * (nope + v), latent]. Returns [tokens, heads, v_dim]."""
    heads, width = q.shape[1], kv_b_weight.shape[1]
    out = q.new_empty(q.shape[0], heads, v_dim)
    starts = cu_seqlens_q.tolist()
    for b, rows in enumerate(context_rows(cache, block_tables, seq_lens)):
        qs, qe = starts[b], starts[b + 1]
        length, n = rows.shape[0], qe - qs
        latent, k_rope = rows[:, :width], rows[:, width:]
        kv = F.linear(latent, kv_b_weight.float()).view(length, heads, nope_dim + v_dim)
        k_nope, v = kv.split([nope_dim, v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, heads, -1)], dim=-1)
        logits = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k) * scale
        causal = torch.arange(length)[None, :] > torch.arange(length - n, length)[:, None]
        logits.masked_fill_(causal.to(logits.device), float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v).to(q.dtype)
    return out


def mla_decode_ref(q, cache, block_tables, seq_lens, scale, latent_dim) -> torch.Tensor:
    """The absorbed form: one query row a sequence, q [seqs, heads, latent + rope] (the
    nope part already in the latent space) against its context's cache rows; returns each
    head's probability-weighted latent [seqs, heads, latent_dim]."""
    out = q.new_empty(q.shape[0], q.shape[1], latent_dim)
    for b, rows in enumerate(context_rows(cache, block_tables, seq_lens)):
        probs = torch.softmax(q[b].float() @ rows.T * scale, dim=-1)  # [heads, length]
        out[b] = (probs @ rows[:, :latent_dim]).to(q.dtype)
    return out


def mla_attention_ref(
    q, cache, block_tables, seq_lens, cu_seqlens_q, scale, latent_dim
) -> torch.Tensor:
    """The absorbed form for any rows a sequence, causal (mla_decode_ref where each has
    one): q [tokens, heads, latent + rope], sequence b's rows cu_seqlens_q[b]:[b + 1]
    its last tokens; returns [tokens, heads, latent_dim]."""
    out = q.new_empty(q.shape[0], q.shape[1], latent_dim)
    starts = cu_seqlens_q.tolist()
    for b, rows in enumerate(context_rows(cache, block_tables, seq_lens)):
        qs, qe = starts[b], starts[b + 1]
        length, n = rows.shape[0], qe - qs
        logits = torch.einsum("qhd,kd->hqk", q[qs:qe].float(), rows) * scale
        keys = torch.arange(length, device=q.device)
        logits.masked_fill_(keys[None, :] >= keys[length - n :, None] + 1, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[qs:qe] = torch.einsum("hqk,kd->qhd", probs, rows[:, :latent_dim]).to(q.dtype)
    return out


# A program's tile: TILE_M (query row, head) pairs, all heads of a row where they fit, else
# TILE_M of them, so a decode row fills the tile where a model has 32 heads or more (and
# two rows of a prompt share it at 16 heads: tensor-core dots want M >= 16; a decode step's
# sequences have a row each, and take tiles of one row). BLOCK_N context rows a
# loop step. Decode: a context splits into runs of at least MIN_SPLIT_TILES steps, at most
# MAX_SPLITS runs (the split layout depends on the sequence's length alone). On an H100
# this tile beat 64-row tiles and 8 warps for decode at 16 and 128 heads; the accumulator
# [32, 512] in fp32 still fills the registers (a few spills).
TILE_M = 32
MAX_SPLITS = 16
MIN_SPLIT_TILES = 2
# (BLOCK_N, launch options) by the inputs' element size, the same for every batch (bits
# per row fixed): fp32 tiles take twice the shared memory
STEPS = {
    2: (64, {"num_warps": 4, "num_stages": 2}),
    4: (32, {"num_warps": 4, "num_stages": 1}),
}
# Where a step has fewer row tiles than the GPU has SMs (decode at small batches), each
# tile's values are cut into up to MAX_VALUE_SPLITS column slices, one program each: all
# compute the same scores (the same dots, the same bits) and each sums its slice of the
# latent, so more SMs share a short step and an accumulator takes fewer registers. The
# count follows the grid, never a row's bits (tests/engine/test_mla_kernels.py).
MAX_VALUE_SPLITS = 4
MERGE_HEADS = 16  # a merge program's heads: 16 x latent 512 fp32 sums fit its registers
# batch-dependent arguments not worth a build each (attention.py's ANY_BATCH says why);
# split_stride is 1 where a step's tables are short (prompts of up to 128 tokens), a
# variant the warm-up never built: the first such step waited for its build
ANY_BATCH = ["block_tables_ptr", "seq_lens_ptr", "cu_q_ptr", "max_blocks", "n_seqs"]
ANY_BATCH += ["split_stride"]


@triton.jit
def _tile_owner(cu_q_ptr, n_seqs, w, ROWS: tl.constexpr):
    """(sequence, its row tile) of program w. Sequence b's tiles are numbered from
    cu_q[b] // ROWS + b: room for its ceil(rows / ROWS) tiles (and a spare, which exits),
    in a grid of tokens // ROWS + sequences programs whatever the rows' split. A binary
    search for the last sequence whose first number is <= w."""
    lo = w * 0
    hi = lo + n_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        before = tl.load(cu_q_ptr + mid) // ROWS + mid <= w
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid - 1)
    return lo, w - (tl.load(cu_q_ptr + lo) // ROWS + lo)


@triton.jit
def _split_layout(
    length, n_rows, BLOCK_N: tl.constexpr, MAX_S: tl.constexpr, MIN_TILES: tl.constexpr
):
    """(context steps per split, splits) of a sequence: a decode row's context (one row)
    in runs of at least MIN_TILES steps, at most MAX_S runs; several rows, one run."""
    n_tiles = tl.cdiv(length, BLOCK_N)
    per = tl.where(n_rows == 1, tl.maximum(MIN_TILES, tl.cdiv(n_tiles, MAX_S)), n_tiles)
    per = tl.maximum(per, 1)
    return per, tl.cdiv(n_tiles, per)


@triton.jit(do_not_specialize=ANY_BATCH)
def _mla_kernel(
    q_ptr, qr_ptr, cache_ptr, out_ptr, part_ptr, lse_ptr, block_tables_ptr, seq_lens_ptr,
    cu_q_ptr, scale, n_seqs, max_blocks, n_heads, q_row, q_head, qr_row, qr_head,
    cache_block, cache_row, split_stride,
    LATENT: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_S: tl.constexpr, MIN_TILES: tl.constexpr,
    VALUE_SPLITS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (row tile, head group x value slice, split program): ROWS rows x BLOCK_H
    heads of one sequence against its context, the latent and rope parts as two tiles
    (latent + rope is no power of two), values the latent tile itself or (VALUE_SPLITS >
    1) its slice. A one-split result goes to `out`; a decode row's splits go to part/lse
    for _mla_merge_kernel."""
    wait_for_inputs(PDL)
    b, tile = _tile_owner(cu_q_ptr, n_seqs, tl.program_id(0), ROWS)
    group = tl.program_id(1) // VALUE_SPLITS
    offs_v = (tl.program_id(1) % VALUE_SPLITS) * (LATENT // VALUE_SPLITS) + tl.arange(
        0, LATENT // VALUE_SPLITS
    )
    q_start = tl.load(cu_q_ptr + b)
    n_rows = tl.load(cu_q_ptr + b + 1) - q_start
    if tile * ROWS < n_rows:
        length = tl.load(seq_lens_ptr + b)
        per, n_splits = _split_layout(length, n_rows, BLOCK_N, MAX_S, MIN_TILES)
        offs_m = tl.arange(0, ROWS * BLOCK_H)
        row = tile * ROWS + offs_m // BLOCK_H
        head = group * BLOCK_H + offs_m % BLOCK_H
        ok = (row < n_rows) & (head < n_heads)
        offs_d = tl.arange(0, LATENT)
        offs_r = tl.arange(0, ROPE_P2)
        offs_n = tl.arange(0, BLOCK_N)
        rope_ok = (offs_r < ROPE)[None, :]
        q_at = (q_ptr + (q_start + row) * q_row + head * q_head)[:, None]
        qr_at = (qr_ptr + (q_start + row) * qr_row + head * qr_head)[:, None]
        q_lat = tl.load(q_at + offs_d[None, :], mask=ok[:, None], other=0.0)
        q_rope = tl.load(qr_at + offs_r[None, :], mask=ok[:, None] & rope_ok, other=0.0)
        q_pos = length - n_rows + row
        hi = tl.minimum(length, length - n_rows + (tile + 1) * ROWS)  # the tile's last row + 1
        for split in range(tl.program_id(2), n_splits, tl.num_programs(2)):
            m_i = tl.full((ROWS * BLOCK_H,), NEG_INF, tl.float32)
            l_i = tl.zeros((ROWS * BLOCK_H,), tl.float32)
            acc = tl.zeros((ROWS * BLOCK_H, LATENT // VALUE_SPLITS), tl.float32)
            for t in range(split * per, tl.minimum((split + 1) * per, tl.cdiv(hi, BLOCK_N))):
                pos = t * BLOCK_N + offs_n
                real = pos < hi
                block = tl.load(
                    block_tables_ptr + b * max_blocks + pos // BLOCK_SIZE, mask=real, other=0
                )
                at = cache_ptr + block.to(tl.int64) * cache_block + (pos % BLOCK_SIZE) * cache_row
                kv = tl.load(at[:, None] + offs_d[None, :], mask=real[:, None], other=0.0)
                kv = kv.to(q_lat.dtype)
                k_rope = tl.load(
                    at[:, None] + LATENT + offs_r[None, :], mask=real[:, None] & rope_ok, other=0.0
                ).to(q_lat.dtype)
                s = tl.dot(q_lat, tl.trans(kv)) + tl.dot(q_rope, tl.trans(k_rope))
                visible = real[None, :] & (pos[None, :] <= q_pos[:, None])
                s = tl.where(visible, s * scale, NEG_INF)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if VALUE_SPLITS == 1:
                    v = kv
                else:  # the slice again, from the cache the tile's load just filled
                    v = tl.load(at[:, None] + offs_v[None, :], mask=real[:, None], other=0.0)
                    v = v.to(q_lat.dtype)
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), v)
                m_i = m_new
            result = acc / tl.maximum(l_i, 1e-30)[:, None]
            if n_splits == 1:
                out_rows = (q_start + row) * n_heads + head
                tl.store(
                    out_ptr + out_rows[:, None] * LATENT + offs_v[None, :],
                    result.to(out_ptr.dtype.element_ty),
                    mask=ok[:, None],
                )
            else:
                slot = (b * n_heads + head) * split_stride + split
                tl.store(
                    part_ptr + slot[:, None] * LATENT + offs_v[None, :], result, mask=ok[:, None]
                )
                lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), NEG_INF)
                if tl.program_id(1) % VALUE_SPLITS == 0:  # every slice's is the same
                    tl.store(lse_ptr + slot, lse, mask=ok)


@triton.jit(do_not_specialize=ANY_BATCH)
def _mla_merge_kernel(
    part_ptr, lse_ptr, out_ptr, seq_lens_ptr, cu_q_ptr, n_heads, split_stride,
    LATENT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_S: tl.constexpr, MIN_TILES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (sequence, head group): a split decode row's output, its splits' partial
    results each weighted by its share of the softmax's mass, added in split order."""
    b = tl.program_id(0)
    wait_for_inputs(PDL)
    q_start = tl.load(cu_q_ptr + b)
    n_rows = tl.load(cu_q_ptr + b + 1) - q_start
    length = tl.load(seq_lens_ptr + b)
    _, n_splits = _split_layout(length, n_rows, BLOCK_N, MAX_S, MIN_TILES)
    if (n_rows == 1) & (n_splits > 1):
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = head < n_heads
        offs_d = tl.arange(0, LATENT)
        slots = (b * n_heads + head) * split_stride
        splits = tl.where(ok, n_splits, 0)
        top = _split_top(lse_ptr, slots, splits, MAX_S)
        merged = _merged(part_ptr, lse_ptr, slots, splits, n_splits, top, offs_d, LATENT)
        out_rows = q_start * n_heads + head
        tl.store(
            out_ptr + out_rows[:, None] * LATENT + offs_d[None, :],
            merged.to(out_ptr.dtype.element_ty),
            mask=ok[:, None],
        )


@triton.jit
def _split_top(lse_ptr, slots, n_splits, MAX_S: tl.constexpr):
    """Each row's largest split log-sum-exp (its first split's at `slots`, n_splits of
    them; none: NEG_INF)."""
    offs_s = tl.arange(0, MAX_S)
    lse = tl.load(
        lse_ptr + slots[:, None] + offs_s[None, :],
        mask=offs_s[None, :] < n_splits[:, None],
        other=NEG_INF,
    )
    return tl.max(lse, axis=1)


@triton.jit
def _merged(part_ptr, lse_ptr, slots, n_splits, most, top, cols, LATENT: tl.constexpr):
    """Each row's splits' partial results at columns `cols`, each weighted by its share
    of the softmax's mass (top: _split_top's), added in split order, in fp32: the merge
    of _mla_merge_kernel and of _mla_values_kernel alike, so their bits are one. A row
    of no splits (n_splits 0) gives what its caller drops; `most`: the largest n_splits."""
    sums = tl.zeros((slots.shape[0], cols.shape[0]), tl.float32)
    total = tl.zeros((slots.shape[0],), tl.float32)
    for split in range(0, most):
        has = split < n_splits
        w = tl.exp(tl.load(lse_ptr + slots + split, mask=has, other=NEG_INF) - top)
        part = tl.load(
            part_ptr + (slots + split)[:, None] * LATENT + cols[None, :],
            mask=has[:, None] & (cols < LATENT)[None, :],
            other=0.0,
        )
        sums += part * w[:, None]
        total += w
    return sums / total[:, None]


@triton.jit
def _row_sequences(cu_q_ptr, n_seqs, rows):
    """Each row's sequence: the last b whose first row cu_q[b] is <= the row (a binary
    search a row; sequences without rows never hold one)."""
    lo = rows * 0
    hi = lo + n_seqs - 1
    while tl.max(hi - lo, axis=0) > 0:
        mid = (lo + hi + 1) // 2
        before = tl.load(cu_q_ptr + mid) <= rows
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["rows", "n_seqs", "split_stride", "seq_lens_ptr", "cu_q_ptr"])
def _mla_values_kernel(
    out_ptr, part_ptr, lse_ptr, w_ptr, v_ptr, seq_lens_ptr, cu_q_ptr, rows, n_seqs,
    split_stride, w_head, w_k, w_n, N,
    HEADS: tl.constexpr, LATENT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CONTEXT_N: tl.constexpr,
    MAX_S: tl.constexpr, MIN_TILES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (head, row block, column block): v[rows, h, cols] = attended[rows, h] @
    W_uv[h].T, head_matmul's program, where a split decode row's attended latent is its
    splits' merge (_mla_merge_kernel's sums, rounded as it stores them) instead of a row
    of `out`: the merge's launch folded into the product's, the same bits."""
    h = tl.program_id(0)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_at = w_ptr + h.to(tl.int64) * w_head
    wait_for_inputs(PDL)
    real = m < rows
    b = _row_sequences(cu_q_ptr, n_seqs, m)
    n_rows = tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b)
    _, n_splits = _split_layout(tl.load(seq_lens_ptr + b), n_rows, CONTEXT_N, MAX_S, MIN_TILES)
    merged = real & (n_rows == 1) & (n_splits > 1)
    n_splits = tl.where(merged, n_splits, 0)
    most = tl.max(n_splits, axis=0)
    slots = (b * HEADS + h).to(tl.int64) * split_stride
    top = _split_top(lse_ptr, slots, n_splits, MAX_S)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, LATENT, BLOCK_K):
        k = k0 + ks
        k_ok = (k < LATENT)[None, :]
        x = tl.load(
            out_ptr + (m[:, None].to(tl.int64) * HEADS + h) * LATENT + k[None, :],
            mask=(real & ~merged)[:, None] & k_ok,
            other=0.0,
        )
        if most > 0:  # the merge kernel's sums of the split rows (_merged)
            sums = _merged(part_ptr, lse_ptr, slots, n_splits, most, top, k, LATENT)
            x = tl.where(merged[:, None], sums.to(x.dtype), x)
        w_tile = tl.load(
            w_at + k[:, None] * w_k + n[None, :] * w_n,
            mask=(k[:, None] < LATENT) & (n[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(x, w_tile.to(x.dtype), acc)
    v = v_ptr + (m[:, None].to(tl.int64) * HEADS + h) * N + n[None, :]
    tl.store(v, acc.to(v_ptr.dtype.element_ty), mask=real[:, None] & (n[None, :] < N))


def max_mla_splits(length: int, block_n: int) -> int:
    """The most splits a decode row's context of at most `length` tokens is cut into."""
    tiles = -(-length // block_n)
    return min(MAX_SPLITS, -(-tiles // MIN_SPLIT_TILES))


def _split_programs(tiles: int, device: torch.device) -> int:
    """Programs sharing a tile's splits: about four per SM in all, a power of two; the
    count moves where splits are computed, never their bits."""
    if device.type != "cuda":
        return 1
    want = -(-4 * sm_count(device) // tiles)
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


def _value_splits(tiles: int, latent_dim: int, device: torch.device) -> int:
    """Value slices a tile's programs take: MAX_VALUE_SPLITS where the tiles' slices
    still fit the SMs, else none (mla-decode-h200.json: four faster at batch 1, two
    slower than none, any slower from 64 rows)."""
    if device.type != "cuda":
        return 1
    splits = min(MAX_VALUE_SPLITS, max(1, latent_dim // 64))
    return splits if tiles * splits <= sm_count(device) else 1


def mla_attention(
    q,
    cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    scale,
    latent_dim,
    programs=None,
    q_rope=None,
    value_splits=None,
    w_uv=None,
) -> torch.Tensor:
    """mla_attention_ref on the GPU: q [tokens, heads, latent + rope], or its latent part
    with `q_rope` [tokens, heads, rope] apart (no copy to join them); rows and heads may be
    strided, each head's values packed. cache [blocks, block_size, 1, latent + rope];
    returns [tokens, heads, latent_dim] in q's dtype. The launch reads shapes only (no
    wait for the device): a CUDA graph can hold it. `programs` per row tile share a decode
    row's splits (default: by the GPU's size) and `value_splits` the slices of a tile's
    values (default: by how many SMs the tiles leave idle); they change the speed, never
    the output. `w_uv` [heads, v, latent]: the output goes on through it, as
    head_matmul(out, w_uv, transpose=True) would take it ([tokens, heads, v], the same
    bits), the splits' merge done in that product's launch."""
    if q_rope is None:
        q, q_rope = q[..., :latent_dim], q[..., latent_dim:]
    tokens, heads, _ = q.shape
    rope = q_rope.shape[-1]
    if q.shape[-1] != latent_dim or q_rope.shape[:2] != q.shape[:2]:
        raise ValueError("q's latent part must be latent_dim wide, beside q_rope's rows")
    if latent_dim < 16 or latent_dim & (latent_dim - 1) or q.stride(2) != 1:
        raise ValueError("the latent width must be a power of two >= 16, q's values packed")
    if q_rope.stride(2) != 1:
        raise ValueError("q_rope's values must be packed")
    block_h = min(TILE_M, max(16, triton.next_power_of_2(heads)))
    rows, groups = TILE_M // block_h, triton.cdiv(heads, block_h)
    if tokens <= cu_seqlens_q.shape[0] - 1:  # decode: a row a sequence, no tile to share
        rows = 1  # (faster at 16 heads, the same bits: mla_decode.py)
    n_seqs, block_size = cu_seqlens_q.shape[0] - 1, cache.shape[1]
    out = torch.empty(tokens, heads, latent_dim, dtype=q.dtype, device=q.device)
    if not n_seqs or not tokens:
        return out if w_uv is None else head_matmul_args(out, w_uv, True)[0]
    block_n, launch = STEPS[q.element_size()]
    stride = max_mla_splits(block_tables.shape[1] * block_size, block_n)
    part = torch.empty(n_seqs, heads, stride, latent_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(n_seqs, heads, stride, dtype=torch.float32, device=q.device)
    tiles = tokens // rows + n_seqs
    if stride == 1:
        programs = 1
    programs = programs or _split_programs(tiles * groups, q.device)
    value_splits = value_splits or _value_splits(tiles * groups, latent_dim, q.device)
    if value_splits & (value_splits - 1) or latent_dim // value_splits < 16:
        raise ValueError("value_splits must be a power of two leaving slices >= 16 wide")
    layout = {"BLOCK_N": block_n, "MAX_S": MAX_SPLITS, "MIN_TILES": MIN_SPLIT_TILES}
    pdl = pdl_options(q.device)
    _mla_kernel[(tiles, groups * value_splits, programs)](
        q, q_rope, cache, out, part, lse, block_tables, seq_lens, cu_seqlens_q,
        scale, n_seqs, block_tables.shape[1], heads, q.stride(0), q.stride(1),
        q_rope.stride(0), q_rope.stride(1), cache.stride(0), cache.stride(1), stride,
        LATENT=latent_dim, ROPE=rope, ROPE_P2=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=block_size, BLOCK_H=block_h, ROWS=rows, VALUE_SPLITS=value_splits,
        **layout, **pdl, **launch,
    )  # fmt: skip
    if w_uv is not None:
        return _values(out, part, lse, w_uv, seq_lens, cu_seqlens_q, stride, layout, pdl)
    if stride > 1:
        _mla_merge_kernel[(n_seqs, triton.cdiv(heads, MERGE_HEADS))](
            part, lse, out, seq_lens, cu_seqlens_q, heads, stride,
            LATENT=latent_dim, BLOCK_H=MERGE_HEADS, **layout, **pdl,
        )  # fmt: skip
    return out


def _values(out, part, lse, w_uv, seq_lens, cu_seqlens_q, stride, layout, pdl) -> torch.Tensor:
    """mla_attention's `w_uv` product, its split rows merged on the way (_mla_values_kernel)."""
    _, heads, latent = out.shape
    if w_uv.shape[0] != heads or w_uv.shape[2] != latent:
        raise ValueError("w_uv must be [heads, v, latent]")
    values, grid, args, launch = head_matmul_args(out, w_uv, True)
    x, w, v, rows, _, _, w_head, w_k, w_n, _, n = args
    _mla_values_kernel[grid](
        x, part, lse, w, v, seq_lens, cu_seqlens_q, rows, cu_seqlens_q.shape[0] - 1, stride,
        w_head, w_k, w_n, n, **launch, LATENT=latent, CONTEXT_N=layout["BLOCK_N"],
        MAX_S=layout["MAX_S"], MIN_TILES=layout["MIN_TILES"], **pdl,
    )  # fmt: skip
    return values
