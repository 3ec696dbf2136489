"""The experts of a mixture-of-experts layer over a step's tokens.

`fused_moe_ref` is the pure-torch definition the CPU path runs, `fused_moe` the Triton
one of the GPU path: each token's output is the sum, in fp32 and in the order of its
top-k slots, of its experts' outputs times their routing weights, so it never depends
on which other tokens share the step. The Triton path waits for nothing on the host, so
CUDA graphs hold it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F


def fused_moe_ref(x, gate_up, down, weights, ids) -> torch.Tensor:
    """sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), e = ids[t, j].

    x [tokens, hidden]; gate_up [experts, 2I, hidden]; down [experts, hidden, I]. Tokens are
    grouped by expert (one matmul per expert that has any), each (token, slot) result kept
    apart, then summed per token in slot order in fp32."""
    tokens, k = ids.shape
    slots = torch.zeros(tokens * k, x.shape[-1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        rows = order[start : start + n]
        start += n
        h = x[rows // k] @ gate_up[expert].T
        gate, up = h.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(x.dtype)
        slots[rows] = (act @ down[expert].T).float()
    slots = slots.view(tokens, k, -1) * weights.float().unsqueeze(-1)
    return slots.sum(dim=1).to(x.dtype)


# The Triton path: tokens grouped by expert on the device, then two grouped matmuls.


def align_by_expert(ids: torch.Tensor, experts: int, block_m: int):
    """Each (token, slot) of ids [tokens, k] grouped by expert, each group padded to whole
    blocks of block_m: (rows [blocks * block_m] with tokens * k as padding, the expert of
    each block [blocks], E where the block is unused). Torch ops on the device, sizes from
    the shapes alone: no wait for the GPU, so a CUDA graph can hold it."""
    slots = ids.numel()
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # (not bincount: its output size follows the largest id, a wait for the GPU)
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    # enough for any grouping: each expert that has slots adds at most one partial block
    blocks = (slots + block_m - 1) // block_m + min(slots, experts)
    rows = torch.full((blocks * block_m,), slots, dtype=torch.int64, device=ids.device)
    expert_of = flat[order]
    rank = torch.arange(slots, device=ids.device) - start[expert_of]
    rows[padded_end[expert_of] - padded[expert_of] + rank] = order
    block_start = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    return rows, block_expert  # block_expert == experts: past the last group


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    rows_ptr,
    block_expert_ptr,
    slots,
    K,
    INTER,
    EXPERTS,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """act[slot] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T) for a block of slots
    of expert e, BLOCK_N of the intermediate columns."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= EXPERTS:
        return
    rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < slots
    tokens = rows // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * 2 * INTER * K
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        ks = k * BLOCK_K + offs_k
        x = tl.load(
            x_ptr + tokens[:, None] * K + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        w_mask = (offs_n[None, :] < INTER) & (ks[:, None] < K)
        g = tl.load(w_base + offs_n[None, :] * K + ks[:, None], mask=w_mask, other=0.0)
        u = tl.load(w_base + (INTER + offs_n[None, :]) * K + ks[:, None], mask=w_mask, other=0.0)
        acc_g = tl.dot(x, g, acc_g)
        acc_u = tl.dot(x, u, acc_u)
    out_ty = act_ptr.dtype.element_ty
    gate = acc_g.to(out_ty).to(tl.float32)  # rounded as the reference's matmul output
    up = acc_u.to(out_ty).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    tl.store(
        act_ptr + rows[:, None] * INTER + offs_n[None, :],
        act.to(out_ty),
        mask=valid[:, None] & (offs_n[None, :] < INTER),
    )


@triton.jit
def _moe_down_kernel(
    act_ptr,
    w_ptr,
    weights_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    slots,
    HIDDEN,
    INTER,
    EXPERTS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[slot] = weight[slot] * (act[slot] @ down[e].T), fp32, for a block of slots of
    expert e and BLOCK_N of the hidden columns."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= EXPERTS:
        return
    rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < slots
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * HIDDEN * INTER
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(INTER, BLOCK_K)):
        ks = k * BLOCK_K + offs_k
        a = tl.load(
            act_ptr + rows[:, None] * INTER + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < INTER),
            other=0.0,
        )
        w = tl.load(
            w_base + offs_n[None, :] * INTER + ks[:, None],
            mask=(offs_n[None, :] < HIDDEN) & (ks[:, None] < INTER),
            other=0.0,
        )
        acc = tl.dot(a, w, acc)
    weight = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    tl.store(
        out_ptr + rows[:, None] * HIDDEN + offs_n[None, :],
        y,
        mask=valid[:, None] & (offs_n[None, :] < HIDDEN),
    )


# Tiles: one set for every size. A (token, slot) row chains its dot products over K in
# blocks of MOE_BLOCK_K whatever the step, so its bits do not follow the step's size.
# Tiles that follow the size, as the dense linear's do, changed the bits on the H100
# (16/16/2 warps at a few slots against 32/64/4 and 64/128/8 at more: the batch-invariance
# test failed), so the size classes wait for tiles proven to keep them.
# (BLOCK_K 128 with 4 stages made batch-1 decode slower on the H100 than 32: 10.8 ms a
# step against 8.6, .probe figures)
MOE_BLOCK_K = 32
MOE_TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}


def moe_tiles(slots: int) -> dict:
    """The tiles for a step of `slots` (token, slot) rows: the same for all, see above."""
    return MOE_TILES


def fused_moe(x, gate_up, down, weights, ids, tiles: dict | None = None) -> torch.Tensor:
    """fused_moe_ref's sums with the Triton kernels: tokens grouped by expert on the
    device (align_by_expert), the gate/up matmul with SiLU-and-mul, then the down matmul
    times the routing weight, per (token, slot); the k slots summed per token in fp32,
    in order. Each (token, slot) row is its own chain of dot products over K, whatever
    other rows share its block: a token's output does not depend on its neighbours.
    `tiles`: moe_tiles' keys, to override them (tests)."""
    tokens, k = ids.shape
    experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    slots = tokens * k
    t = dict(tiles or moe_tiles(slots))
    block_m, block_n = t.pop("BLOCK_M"), t.pop("BLOCK_N")
    rows, block_expert = align_by_expert(ids, experts, block_m)
    blocks = block_expert.shape[0]
    x = x.contiguous()
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, gate_up, act, rows, block_expert, slots, hidden, inter, experts,
        TOP_K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=MOE_BLOCK_K, **t,
    )  # fmt: skip
    out = torch.empty(slots, hidden, dtype=torch.float32, device=x.device)
    _moe_down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, down, weights.reshape(-1).contiguous(), out, rows, block_expert, slots,
        hidden, inter, experts, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=MOE_BLOCK_K, **t,
    )  # fmt: skip
    return out.view(tokens, k, hidden).sum(dim=1).to(x.dtype)
