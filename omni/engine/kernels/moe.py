"""The experts of a mixture-of-experts layer over a step's tokens.

`fused_moe_ref` is the pure-torch definition the CPU path runs, `fused_moe` the Triton
one of the GPU path: each token's output is the sum, in fp32 and in the order of its
top-k slots, of its experts' outputs times their routing weights, so it never depends
on which other tokens share the step. The Triton path waits for nothing on the host, so
CUDA graphs hold it. `fused_moe_quantized` runs the same kernels on experts stored as
kernels/wq.py's block-FP8 or INT4 weights, each tile decoded in registers; its
reference dequantizes the stacks, then runs fused_moe_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from .pdl import pdl_options, wait_for_inputs
from .wq import (
    FP8,
    dequantize_block_fp8,
    dequantize_int4,
    e4m3_to_f32,
    fp8_in_hardware,
    group_scaled,
    int4_values,
)


def fused_moe_ref(
    x, gate_up, down, weights, ids, partial: bool = False, summed: bool = True, shared: int = 0
) -> torch.Tensor:
    """sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), e = ids[t, j].

    x [tokens, hidden]; gate_up [experts, 2I, hidden]; down [experts, hidden, I]. Tokens are
    grouped by expert (one matmul per expert that has any), each (token, slot) result kept
    apart, then summed per token in slot order in fp32. `partial`: an id equal to the
    number of experts is another rank's expert (moe.local_ids), its slot adds nothing.
    `summed=False`: the weighted slots [tokens, k, hidden] in fp32, for the next RMS norm
    to add up (kernels/norm.py). `shared`: the last experts every token takes (fused_moe's
    hint; the sums are the same)."""
    tokens, k = ids.shape
    slots = torch.zeros(tokens * k, x.shape[-1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    start = 0
    for expert, n in enumerate(counts):
        if not n or expert >= gate_up.shape[0]:
            continue
        rows = order[start : start + n]
        start += n
        h = x[rows // k] @ gate_up[expert].T
        gate, up = h.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(x.dtype)
        slots[rows] = (act @ down[expert].T).float()
    slots = slots.view(tokens, k, -1) * weights.float().unsqueeze(-1)
    return sum_slots_ref(slots, x.dtype) if summed else slots


def sum_slots_ref(slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A token's k weighted slot outputs [tokens, k, hidden] (fp32) summed, then cast."""
    return slots.sum(dim=1).to(dtype)


# The Triton path: tokens grouped by expert on the device, then two grouped matmuls.


@triton.jit(do_not_specialize=["slots"])  # (sizes: a step of a new size never waits for a build)
def _rank_kernel(ids_ptr, counts_ptr, ranks_ptr, slots, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Each (token, slot) its place among its expert's: counts[e] taken and raised by one,
    atomically (which slot comes first follows the GPU's timing: only the groups' members
    count, as no row's bits depend on its place in a block)."""
    wait_for_inputs(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < slots
    expert = tl.load(ids_ptr + i, mask=ok, other=0)
    tl.store(ranks_ptr + i, tl.atomic_add(counts_ptr + expert, 1, mask=ok), mask=ok)


@triton.jit(do_not_specialize=["slots", "blocks"])
def _place_kernel(
    ids_ptr,
    counts_ptr,
    ranks_ptr,
    rows_ptr,
    block_expert_ptr,
    slots,
    blocks,
    GROUPS,
    BLOCK_M: tl.constexpr,
    E_P: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """For CHUNK slots: each one's row, its group's first row plus its rank; for CHUNK
    rows: padding (`slots`) where a group's slots end before its last block does, and
    at each block's first row the block's group (GROUPS or more: past the last group)."""
    wait_for_inputs(PDL)
    es = tl.arange(0, E_P)
    counts = tl.load(counts_ptr + es, mask=es < GROUPS, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = i < slots
    expert = tl.load(ids_ptr + i, mask=ok, other=0)
    rank = tl.load(ranks_ptr + i, mask=ok, other=0)
    first = tl.sum(tl.where(es[None, :] == expert[:, None], start[None, :], 0), axis=1)
    tl.store(rows_ptr + first + rank, i, mask=ok)
    in_rows = i < blocks * BLOCK_M
    group = tl.sum((end[None, :] <= i[:, None]).to(tl.int32), axis=1)
    mine = es[None, :] == group[:, None]
    used = i - tl.sum(tl.where(mine, start[None, :], 0), axis=1)
    pad = used >= tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
    tl.store(rows_ptr + i, slots, mask=in_rows & pad)
    tl.store(block_expert_ptr + i // BLOCK_M, group, mask=in_rows & (i % BLOCK_M == 0))


def align_by_expert(ids: torch.Tensor, experts: int, block_m: int):
    """Each (token, slot) of ids [tokens, k] grouped by expert, each group padded to whole
    blocks of block_m: (rows [blocks * block_m] with tokens * k as padding, the expert of
    each block [blocks], E or more where the block is unused). Three launches (a count's
    reset, the ranks, the places), sizes from the shapes alone: no wait for the GPU, so a
    CUDA graph holds it. Ids equal to E (another rank's experts) form a last group whose
    blocks are unused."""
    slots = ids.numel()
    groups = experts + 1
    # enough for any grouping: each expert that has slots adds at most one partial block
    blocks = (slots + block_m - 1) // block_m + min(slots, groups)
    counts = torch.zeros(groups, dtype=torch.int32, device=ids.device)
    ranks = torch.empty(slots, dtype=torch.int32, device=ids.device)
    rows = torch.empty(blocks * block_m, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int64, device=ids.device)
    if not slots:
        return rows, block_expert.fill_(groups)
    flat = ids.reshape(-1).contiguous()
    pdl = pdl_options(ids.device)
    _rank_kernel[(triton.cdiv(slots, 1024),)](flat, counts, ranks, slots, BLOCK=1024, **pdl)
    e_p = triton.next_power_of_2(groups)
    chunk = max(16, 16384 // e_p)  # the [chunk, E_P] compares: 64 values a thread
    grid = (triton.cdiv(max(slots, blocks * block_m), chunk),)
    _place_kernel[grid](
        flat, counts, ranks, rows, block_expert, slots, blocks, groups, BLOCK_M=block_m,
        E_P=e_p, CHUNK=chunk, num_warps=8, **pdl,
    )  # fmt: skip
    return rows, block_expert  # block_expert >= experts: past the last group


@triton.jit
def _block_rows(rows_ptr, block, slots, BLOCK_M: tl.constexpr, ONE_SLOT: tl.constexpr):
    """(The (token, slot) rows of a block, `slots` (no row) for its unused places; which
    of them are rows.)"""
    offs = tl.arange(0, BLOCK_M)
    if ONE_SLOT:
        rows = tl.where(offs == 0, block, slots).to(tl.int64)
    else:
        rows = tl.load(rows_ptr + block * BLOCK_M + offs)
    return rows, rows < slots


# What _weight_tile reads (QUANT): the dense stack, or one stored as kernels/wq.py's formats
DENSE, BLOCK_FP8, INT4 = 0, 1, 2
_DENSE, _BLOCK_FP8 = tl.constexpr(DENSE), tl.constexpr(BLOCK_FP8)  # (a kernel reads these)


@triton.jit
def _weight_tile(
    w_ptr,
    s_ptr,
    rows,
    ks,
    N,
    K,
    W_ROW,
    S_ROW,
    k0,
    QUANT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    HW_FP8: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The tile W[rows, ks].T [BLOCK_K, BLOCK_N] of one expert's weight W [N, K]: as
    stored (DENSE), or decoded in registers to fp32, each value times the scale of its
    SCALE_ROWS x SCALE_COLS block (scales [ceil(N/SCALE_ROWS), ceil(K/SCALE_COLS)], rows
    S_ROW apart): BLOCK_FP8 e4m3 bytes [N, K]; INT4 int32 words [N, ceil(K/8)], value i
    in bits 4*(i % 8) of word i // 8 as q + 8 (SCALE_ROWS 1: a scale per row and group).
    Zero outside [N, K]. The tile depends on the weights alone, never on the tokens."""
    mask = (rows[None, :] < N) & (ks[:, None] < K)
    if QUANT == _DENSE:
        w = tl.load(w_ptr + rows[None, :] * W_ROW + ks[:, None], mask=mask, other=0.0)
    else:
        if QUANT == _BLOCK_FP8:
            bits = tl.load(w_ptr + rows[None, :] * W_ROW + ks[:, None], mask=mask, other=0)
            w = e4m3_to_f32(bits, HW_FP8)
        else:
            w = int4_values(w_ptr, rows, N, K, W_ROW, k0, BLOCK_K)
        scale_rows = (rows // SCALE_ROWS) * S_ROW
        if SCALE_COLS >= BLOCK_K:  # one scale column for the whole tile (k0: its first)
            s = tl.load(s_ptr + scale_rows + k0 // SCALE_COLS, mask=rows < N, other=0.0)
            w = w * s.to(tl.float32)[None, :]
        elif (BLOCK_K % SCALE_COLS == 0) & (SCALE_COLS & (SCALE_COLS - 1) == 0):
            w = group_scaled(w, s_ptr, scale_rows, rows, N, K, k0, SCALE_COLS, BLOCK_K)
        else:
            scale_cols = ks[:, None] // SCALE_COLS
            s = tl.load(s_ptr + scale_rows[None, :] + scale_cols, mask=mask, other=0.0)
            w = w * s.to(tl.float32)
        if QUANT != _BLOCK_FP8:  # a ragged K's last word holds values past K
            w = tl.where(mask, w, 0.0)
    return w


@triton.jit
def _x_tile(x_ptr, rows, valid, ks, K, TOP_K: tl.constexpr):
    """The rows' tokens' inputs x[row // TOP_K, ks] [BLOCK_M, BLOCK_K] (zero where invalid);
    TOP_K 1: the rows' own (the activations down reads)."""
    tokens = rows // TOP_K
    return tl.load(
        x_ptr + tokens[:, None] * K + ks[None, :],
        mask=valid[:, None] & (ks[None, :] < K),
        other=0.0,
    )


@triton.jit
def _store_act(act_ptr, rows, valid, offs_n, acc_g, acc_u, INTER):
    """act[row, offs_n] = silu(gate) * up, each rounded first as the reference's matmul
    output."""
    out_ty = act_ptr.dtype.element_ty
    gate = acc_g.to(out_ty).to(tl.float32)
    up = acc_u.to(out_ty).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    tl.store(
        act_ptr + rows[:, None] * INTER + offs_n[None, :],
        act.to(out_ty),
        mask=valid[:, None] & (offs_n[None, :] < INTER),
    )


@triton.jit(do_not_specialize=["slots"])
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    act_ptr,
    rows_ptr,
    block_expert_ptr,
    slots,
    K,
    INTER,
    EXPERTS,
    W_EXPERT,
    W_ROW,
    S_EXPERT,
    S_ROW,
    S_UP,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB: tl.constexpr,
    ONE_SLOT: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    HW_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """act[slot] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T) for SUB blocks of
    BLOCK_M slots of expert e, BLOCK_N of the intermediate columns: each weight tile is
    read once for the SUB blocks, and each block takes its own dot products, the same
    whatever SUB is. ONE_SLOT: block b is slot b alone (its expert: the ids, flat), no
    grouping at all. QUANT: the weights as _weight_tile reads them; up's rows start INTER
    rows (W_ROW apart) and its scales S_UP after gate's."""
    wait_for_inputs(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= EXPERTS:
        return
    rows0, valid0 = _block_rows(rows_ptr, block * SUB, slots, BLOCK_M, ONE_SLOT)
    acc_g0 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u0 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if SUB >= 2:
        rows1, valid1 = _block_rows(rows_ptr, block * SUB + 1, slots, BLOCK_M, ONE_SLOT)
        acc_g1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if SUB >= 4:
        rows2, valid2 = _block_rows(rows_ptr, block * SUB + 2, slots, BLOCK_M, ONE_SLOT)
        rows3, valid3 = _block_rows(rows_ptr, block * SUB + 3, slots, BLOCK_M, ONE_SLOT)
        acc_g2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_g3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + expert.to(tl.int64) * W_EXPERT
    s_gate = s_ptr + expert.to(tl.int64) * S_EXPERT
    w_up, s_up = w_gate + INTER * W_ROW, s_gate + S_UP
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        ks = k * BLOCK_K + offs_k
        x0 = _x_tile(x_ptr, rows0, valid0, ks, K, TOP_K)
        g = _weight_tile(w_gate, s_gate, offs_n, ks, INTER, K, W_ROW, S_ROW, k * BLOCK_K,
                         QUANT, SCALE_ROWS, SCALE_COLS, HW_FP8, BLOCK_K).to(x0.dtype)  # fmt: skip
        u = _weight_tile(w_up, s_up, offs_n, ks, INTER, K, W_ROW, S_ROW, k * BLOCK_K,
                         QUANT, SCALE_ROWS, SCALE_COLS, HW_FP8, BLOCK_K).to(x0.dtype)  # fmt: skip
        acc_g0 = tl.dot(x0, g, acc_g0)
        acc_u0 = tl.dot(x0, u, acc_u0)
        if SUB >= 2:
            x1 = _x_tile(x_ptr, rows1, valid1, ks, K, TOP_K)
            acc_g1 = tl.dot(x1, g, acc_g1)
            acc_u1 = tl.dot(x1, u, acc_u1)
        if SUB >= 4:
            x2 = _x_tile(x_ptr, rows2, valid2, ks, K, TOP_K)
            x3 = _x_tile(x_ptr, rows3, valid3, ks, K, TOP_K)
            acc_g2 = tl.dot(x2, g, acc_g2)
            acc_u2 = tl.dot(x2, u, acc_u2)
            acc_g3 = tl.dot(x3, g, acc_g3)
            acc_u3 = tl.dot(x3, u, acc_u3)
    _store_act(act_ptr, rows0, valid0, offs_n, acc_g0, acc_u0, INTER)
    if SUB >= 2:
        _store_act(act_ptr, rows1, valid1, offs_n, acc_g1, acc_u1, INTER)
    if SUB >= 4:
        _store_act(act_ptr, rows2, valid2, offs_n, acc_g2, acc_u2, INTER)
        _store_act(act_ptr, rows3, valid3, offs_n, acc_g3, acc_u3, INTER)


@triton.jit
def _store_down(out_ptr, weights_ptr, rows, valid, offs_n, acc, HIDDEN, out_ty):
    """out[row, offs_n] = the row's routing weight times its output, rounded first to
    `out_ty` as the reference's matmul output; fp32."""
    weight = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(out_ty).to(tl.float32) * weight[:, None]
    tl.store(
        out_ptr + rows[:, None] * HIDDEN + offs_n[None, :],
        y,
        mask=valid[:, None] & (offs_n[None, :] < HIDDEN),
    )


@triton.jit(do_not_specialize=["slots"])
def _moe_down_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    weights_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    slots,
    HIDDEN,
    INTER,
    EXPERTS,
    W_EXPERT,
    W_ROW,
    S_EXPERT,
    S_ROW,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB: tl.constexpr,
    ONE_SLOT: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    HW_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[slot] = weight[slot] * (act[slot] @ down[e].T), fp32, for SUB blocks of BLOCK_M
    slots of expert e (each weight tile read once for them, each block its own dot
    products) and BLOCK_N of the hidden columns (QUANT: the weights as _weight_tile reads
    them)."""
    # Before the wait (PDL): the kernel right before is gate/up, and the routing and the
    # grouping were done before it (pdl.py): this block's expert and rows are read while
    # gate/up ends. (Asking L2 for its first two weight tiles there too was slower at
    # batch 1 on an H100.)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= EXPERTS:
        wait_for_inputs(PDL)
        return
    rows0, valid0 = _block_rows(rows_ptr, block * SUB, slots, BLOCK_M, ONE_SLOT)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if SUB >= 2:
        rows1, valid1 = _block_rows(rows_ptr, block * SUB + 1, slots, BLOCK_M, ONE_SLOT)
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if SUB >= 4:
        rows2, valid2 = _block_rows(rows_ptr, block * SUB + 2, slots, BLOCK_M, ONE_SLOT)
        rows3, valid3 = _block_rows(rows_ptr, block * SUB + 3, slots, BLOCK_M, ONE_SLOT)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * W_EXPERT
    s_base = s_ptr + expert.to(tl.int64) * S_EXPERT
    wait_for_inputs(PDL)
    for k in range(0, tl.cdiv(INTER, BLOCK_K)):
        ks = k * BLOCK_K + offs_k
        a0 = _x_tile(act_ptr, rows0, valid0, ks, INTER, 1)
        w = _weight_tile(w_base, s_base, offs_n, ks, HIDDEN, INTER, W_ROW, S_ROW, k * BLOCK_K,
                         QUANT, SCALE_ROWS, SCALE_COLS, HW_FP8, BLOCK_K).to(a0.dtype)  # fmt: skip
        acc0 = tl.dot(a0, w, acc0)
        if SUB >= 2:
            acc1 = tl.dot(_x_tile(act_ptr, rows1, valid1, ks, INTER, 1), w, acc1)
        if SUB >= 4:
            acc2 = tl.dot(_x_tile(act_ptr, rows2, valid2, ks, INTER, 1), w, acc2)
            acc3 = tl.dot(_x_tile(act_ptr, rows3, valid3, ks, INTER, 1), w, acc3)
    out_ty = act_ptr.dtype.element_ty
    _store_down(out_ptr, weights_ptr, rows0, valid0, offs_n, acc0, HIDDEN, out_ty)
    if SUB >= 2:
        _store_down(out_ptr, weights_ptr, rows1, valid1, offs_n, acc1, HIDDEN, out_ty)
    if SUB >= 4:
        _store_down(out_ptr, weights_ptr, rows2, valid2, offs_n, acc2, HIDDEN, out_ty)
        _store_down(out_ptr, weights_ptr, rows3, valid3, offs_n, acc3, HIDDEN, out_ty)


# Tiles: one dot shape for every size, 16 rows by MOE_BLOCK_K of K: a (token, slot) row
# chains its dot products over K the same whatever the step, so its bits do not follow
# the step's size. Wider dots that follow the size, as the dense linear's tiles do,
# changed the bits (the batch-invariance test failed); what follows the size instead is
# how many 16-row blocks of one expert a program takes (sub_blocks), each with its own
# dots. The columns, warps and stages below measured fastest in the engine and keep the
# bits (diagnostics/moe_layer.py compares the variants).
MOE_BLOCK_K = 128
MOE_TILES = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# Quantized stacks' stages: their decoded tiles and scales took 287 KiB of shared memory
# at 3 stages (INT4 in groups of 32, when each value loaded its own word), more than the
# H100's; not retuned since INT4 words load once each (bench/diagnostics/moe_layer.py
# --weights times variants of it)
QUANT_STAGES = 2


# Up to this many (token, slot) rows a step gives each its own block, with no grouping
# (three more launches a layer, dear at batch 1): the rows are computed as in a shared
# block, bit for bit. Beyond, slots share their experts' weight
# reads. (Which one a step takes follows its size; no row's bits do.)
ONE_SLOT_MAX = 64


def sub_blocks(slots: int, experts: int) -> int:
    """How many MOE_TILES row blocks of one expert a program takes (1, 2 or 4): enough
    for the rows an expert gets on average, so that its weight tiles are read once, not
    once per block. Only the reads follow it: each block's dot products are the same."""
    mean = slots / experts
    return 1 if mean <= 12 else 2 if mean <= 28 else 4


def fused_moe(
    x, gate_up, down, weights, ids, partial: bool = False, summed: bool = True, shared: int = 0
) -> torch.Tensor:
    """fused_moe_ref's sums with the Triton kernels: tokens grouped by expert on the
    device (align_by_expert), the gate/up matmul with SiLU-and-mul, then the down matmul
    times the routing weight, per (token, slot); the k slots summed per token in fp32,
    in order. Each (token, slot) row is its own chain of dot products over K, whatever
    other rows share its block: a token's output does not depend on its neighbours.
    `partial`: ids equal to the number of experts are other ranks' (no block runs them;
    their slots stay zero). `summed=False`: the slots, unsummed (as fused_moe_ref).
    `shared`: the stacks' last experts are shared ones that every token takes; the blocks
    a program takes (sub_blocks) then follow the routed experts' rows alone."""
    stacks = _stack_args(gate_up, None, None, gate_up.shape[1] // 2), _stack_args(down)
    return _moe(x, gate_up.shape, stacks, weights, ids, partial, summed, shared)


def fused_moe_quantized(
    x,
    gate_up,
    gate_up_scale,
    down,
    down_scale,
    weights,
    ids,
    block,
    partial=False,
    summed=True,
    shared: int = 0,
) -> torch.Tensor:
    """fused_moe_quantized_ref's sums with fused_moe's kernels, each weight tile decoded
    in registers (W8A16, W4A16; fp32 accumulation, the same chains of dot products).

    The stacks as kernels/wq.py's formats store each expert's weights, by their dtype:
    block FP8, gate_up e4m3 [experts, 2I, hidden], down [experts, hidden, I], fp32 scales
    a `block` (rows, columns) each, [experts, 2 ceil(I/rows), ceil(hidden/columns)] (gate's
    scale rows, then up's: a ragged I keeps each part's blocks) and [experts,
    ceil(hidden/rows), ceil(I/columns)]; INT4, gate_up int32 [experts, 2I, ceil(hidden/8)],
    down [experts, hidden, ceil(I/8)], scales [experts, rows, ceil(K/group)] (any float
    dtype), `block` (1, group). Ragged edges are masked: no shape need divide a block.
    `shared`: fused_moe's."""
    inter = gate_up.shape[1] // 2
    shape = (gate_up.shape[0], 2 * inter, x.shape[-1])
    stacks = (
        _stack_args(gate_up, gate_up_scale, block, inter),
        _stack_args(down, down_scale, block),
    )
    return _moe(x, shape, stacks, weights, ids, partial, summed, shared)


def fused_moe_quantized_ref(
    x,
    gate_up,
    gate_up_scale,
    down,
    down_scale,
    weights,
    ids,
    block,
    partial=False,
    summed=True,
    shared: int = 0,
) -> torch.Tensor:
    """fused_moe_ref over the stacks dequantized (in fp32, then x's dtype)."""
    inter = gate_up.shape[1] // 2
    dense_gate_up = dequantize_experts(gate_up, gate_up_scale, block, x.shape[-1], parts=2)
    dense_down = dequantize_experts(down, down_scale, block, inter)
    return fused_moe_ref(
        x, dense_gate_up.to(x.dtype), dense_down.to(x.dtype), weights, ids, partial, summed, shared
    )


def dequantize_experts(w, scale, block, k: int, parts: int = 1) -> torch.Tensor:
    """A quantized stack (fused_moe_quantized's layouts) as its real weights [experts, N,
    k] in fp32; `parts` stacked along N, each with its own scale rows (gate_up: 2)."""
    if w.dtype == torch.int32:
        return dequantize_int4(w, scale, k, block[1])
    pieces = zip(w.chunk(parts, dim=1), scale.chunk(parts, dim=1), strict=True)
    return torch.cat([dequantize_block_fp8(p, s, block) for p, s in pieces], dim=1)


def _stack_args(w, scale=None, block=None, inter=None) -> dict:
    """A stack's kernel arguments: the weights (e4m3 as bytes), the scales (the weights
    where none), their strides, _weight_tile's QUANT and block; S_UP, where `inter` says
    the stack is gate/up, the offset of up's scales."""
    quant = DENSE if scale is None else BLOCK_FP8 if w.dtype == FP8 else INT4
    if quant == INT4 and w.dtype != torch.int32:
        raise ValueError(f"quantized experts are e4m3 or packed int32, not {w.dtype}")
    if quant != DENSE and (w.stride(-1) != 1 or scale.stride(-1) != 1):
        raise ValueError("quantized expert stacks need contiguous rows")
    s = w if scale is None else scale
    rows, cols = (1, 1) if block is None else block
    args = {
        "w": w.view(torch.uint8) if quant == BLOCK_FP8 else w,
        "s": s,
        "W_EXPERT": w.stride(0),
        "W_ROW": w.stride(1),
        "S_EXPERT": s.stride(0) if scale is not None else 0,
        "S_ROW": s.stride(1) if scale is not None else 0,
        "QUANT": quant,
        "SCALE_ROWS": rows,
        "SCALE_COLS": cols,
        "HW_FP8": quant == BLOCK_FP8 and fp8_in_hardware(w.device),
    }
    if inter is not None:
        args["S_UP"] = triton.cdiv(inter, rows) * args["S_ROW"]
    return args


def _moe(x, shape, stacks, weights, ids, partial: bool, summed: bool, shared: int = 0):
    """fused_moe's launches over `stacks` (_stack_args: gate_up's, down's); `shape` the
    dense gate_up's [experts, 2I, hidden]."""
    tokens, k = ids.shape
    experts, two_inter, hidden = shape
    inter = two_inter // 2
    slots = tokens * k
    t = dict(MOE_TILES)
    block_m, block_n = t.pop("BLOCK_M"), t.pop("BLOCK_N")
    t |= pdl_options(x.device)
    one_slot = slots <= ONE_SLOT_MAX
    sub = 1 if one_slot else sub_blocks(slots - tokens * shared, experts - shared)
    if one_slot:  # a block per slot: its expert's weights are read once per slot
        rows, block_expert = ids, ids.reshape(-1)  # (rows: unread)
    else:
        rows, block_expert = align_by_expert(ids, experts, block_m * sub)
    blocks = block_expert.shape[0]
    x = x.contiguous()
    gate_up, down = ({**a} for a in stacks)
    if gate_up["QUANT"] != DENSE:
        t["num_stages"] = QUANT_STAGES
    gu_w, gu_s, down_w, down_s = gate_up.pop("w"), gate_up.pop("s"), down.pop("w"), down.pop("s")
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, gu_w, gu_s, act, rows, block_expert, slots, hidden, inter, experts, TOP_K=k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=MOE_BLOCK_K, SUB=sub, ONE_SLOT=one_slot,
        **gate_up, **t,
    )  # fmt: skip
    out = (torch.zeros if partial else torch.empty)(
        slots, hidden, dtype=torch.float32, device=x.device
    )
    _moe_down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, down_w, down_s, weights.reshape(-1).contiguous(), out, rows, block_expert,
        slots, hidden, inter, experts, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=MOE_BLOCK_K, SUB=sub, ONE_SLOT=one_slot, **down, **t,
    )  # fmt: skip
    out = out.view(tokens, k, hidden)
    return sum_slots(out, x.dtype) if summed else out


@triton.jit
def add_slots(slots_ptr, t, offs, mask, HIDDEN, K: tl.constexpr, BLOCK: tl.constexpr):
    """slots[t, 0] + ... + slots[t, K - 1] at columns `offs`, in fp32 and in that order: the
    one sum of a token's slots, the slot-sum kernel's and the RMS norm's (norm.py)."""
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):  # unrolled: the K loads go out together, then the adds
        acc += tl.load(slots_ptr + (t * K + j) * HIDDEN + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _sum_slots_kernel(
    slots_ptr, out_ptr, HIDDEN, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """out[t] = slots[t, 0] + ... + slots[t, K - 1] in fp32, in that order, then cast."""
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < HIDDEN
    acc = add_slots(slots_ptr, t, offs, ok, HIDDEN, K, BLOCK)
    tl.store(out_ptr + t * HIDDEN + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_slots(slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A token's k weighted slot outputs [tokens, k, hidden] (fp32) summed in slot order
    and cast, in one kernel (torch's sum and cast were two, ~5 us a layer at batch 1)."""
    tokens, k, hidden = slots.shape
    out = torch.empty(tokens, hidden, dtype=dtype, device=slots.device)
    block = 1024
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, block))](
        slots, out, hidden, K=k, BLOCK=block, **pdl_options(slots.device)
    )
    return out
