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
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .rope import rope_and_cache_ref


def mla_rope_and_cache_ref(
    q_rope, latent, k_rope, positions, inv_freq, cache, slot_mapping
) -> torch.Tensor:
    """Returns q_rope [tokens, heads, rope] rotated; writes each token's [latent | rotated
    k_rope] row into `cache` [blocks, block_size, 1, latent + rope] at its slot (-1:
    nowhere). Rotate-half layout (deepseek_v3.py permutes the checkpoint's interleaved
    rope rows into it at load)."""
    width = latent.shape[-1]
    rope_part, latent_part = cache[..., width:], cache[..., :width]  # views: writes land
    return rope_and_cache_ref(
        q_rope, k_rope[:, None], latent[:, None], positions, inv_freq,
        rope_part, latent_part, slot_mapping,
    )  # fmt: skip


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
