"""DeepSeek-V3's grouped sigmoid router: its torch definition (grouped_router_ref, as HF
computes it) and the same choice in two kernel launches.

The reference's torch ops (an fp32 linear, a sigmoid, three top-k's and the gathers around
them) are some ten launches a layer, its top-k's the dearest of them at batch 1. Here the
fp32 logits are summed in parts over the hidden size, as router.py's are, and one program
a token makes the whole choice from its parts: sigmoid, bias, group scores, the best groups
and the top k. A token's bits never depend on the step's other tokens, and nothing waits
on the host, so CUDA graphs hold it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from .pdl import pdl_options, wait_for_inputs


def grouped_router_ref(
    x,
    weight,
    bias,
    k: int,
    groups: int,
    top_groups: int,
    renormalize: bool,
    scale: float,
    shared: int = 0,
):
    """DeepSeek-V3's router, in fp32 as HF runs it: (weights [tokens, k] fp32, expert ids
    [tokens, k]). Sigmoid scores; `bias` (e_score_correction_bias) shifts them for the
    choice only: the `top_groups` of `groups` expert groups whose two best shifted scores
    sum highest, then the k best shifted scores within those. The weights are the chosen
    experts' unshifted scores, rescaled to sum to 1 on request, times `scale`. `shared`:
    that many more slots a token, the shared experts stacked after the routed ones (ids
    experts, experts + 1, ...), each of weight 1."""
    scores = F.linear(x.float(), weight.float()).sigmoid()
    tokens, experts = scores.shape
    shifted = (scores + bias.float()).view(tokens, groups, experts // groups)
    group_scores = shifted.topk(2, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(top_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    shifted = shifted.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)
    ids = shifted.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scale
    if shared:
        always = torch.arange(experts, experts + shared, device=ids.device).expand(tokens, -1)
        ids = torch.cat([ids, always], dim=1)
        weights = torch.cat([weights, weights.new_ones(tokens, shared)], dim=1)
    return weights, ids


# A parts program holds a TILE of the fp32 weights, BLOCK_E experts' rows over PART_K
# columns, and runs it down ROWS tokens, one at a time: each token's logit parts are
# its own product with the tile, summed along the row in one fixed order, whatever else
# the step holds. (No tl.dot: in fp32 it rounds to TF32 unless told "ieee", and the
# interpreter's numpy product sums a row by its place in the tile.) PART_K grows, by
# powers of two from 128, until a token has at most PIECES_MAX parts (8 KiB: 64 MiB for
# an 8,192-token chunk), and the tile's experts shrink as it grows: the programs a
# token's product spreads over stay hidden * experts / TILE (448 for DeepSeek-V3's).
# A program runs rows_per_program() tokens, one after the other: few enough that a
# decode step's tokens spread over many programs (64 of them in a row made the kernel a
# batch-64 step's slowest but the experts'), and up to ROWS_MAX so that a long prefill
# reads each tile from L2 rarely. Each token's sum is the same whichever program runs it.
TILE = 4096
PIECES_MAX = 2048
ROWS_MAX = 64


def rows_per_program(m: int) -> int:
    return min(ROWS_MAX, max(1, m // 32))


def part_width(hidden: int, experts: int) -> int:
    """PART_K: the columns of a part, from the router's shape alone (never the step's)."""
    width = 128
    while triton.cdiv(hidden, width) * experts > PIECES_MAX and width < TILE:
        width *= 2
    return width


@triton.jit(do_not_specialize=["M", "ROWS"])  # a step of a new size never waits for a build
def _grouped_parts_kernel(
    x_ptr,
    w_ptr,
    parts_ptr,
    M,
    ROWS,
    HIDDEN,
    EXPERTS,
    PARTS,
    BLOCK_E: tl.constexpr,
    PART_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """parts[row, p, e] = sum over part p's columns of x[row] * w[e] in fp32, for BLOCK_E
    experts and the rows of one block of ROWS."""
    p, e0 = tl.program_id(1), tl.program_id(2) * BLOCK_E
    es = e0 + tl.arange(0, BLOCK_E)
    ks = p * PART_K + tl.arange(0, PART_K)
    k_ok = ks < HIDDEN
    # the weights are no step's output: read before the wait (PDL), while the kernel before ends
    w = tl.load(
        w_ptr + es[:, None] * HIDDEN + ks[None, :],
        mask=(es[:, None] < EXPERTS) & k_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    wait_for_inputs(PDL)
    first = tl.program_id(0).to(tl.int64) * ROWS  # (row offsets in int64)
    for row in range(first, tl.minimum(first + ROWS, M)):
        x = tl.load(x_ptr + row * HIDDEN + ks, mask=k_ok, other=0.0)
        part = tl.sum(x.to(tl.float32)[None, :] * w, axis=1)
        tl.store(parts_ptr + (row * PARTS + p) * EXPERTS + es, part,
                 mask=es < EXPERTS)  # fmt: skip


@triton.jit
def _scores(parts_ptr, t, eids, ok, EXPERTS, PARTS: tl.constexpr):
    """sigmoid(logits) at experts `eids`: the token's parts summed in fp32, in order."""
    logits = tl.zeros(eids.shape, tl.float32)
    for p in tl.static_range(PARTS):  # unrolled: the loads go out together, then the adds
        row = parts_ptr + (t * PARTS + p).to(tl.int64) * EXPERTS
        logits += tl.load(row + eids, mask=ok, other=0.0)
    return tl.sigmoid(logits)


@triton.jit
def _key(value, index):
    """An int64 that orders as (value, then the lower index first): fp32 bits made to
    order as signed integers, above 2**31 - 1 - index (the lower index the higher)."""
    bits = value.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (bits.to(tl.int64) << 32) + (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _key_value(key):
    """The fp32 value a key was made from."""
    bits = (key >> 32).to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _key_index(key):
    """The index a key was made from."""
    return 0x7FFFFFFF - (key - ((key >> 32) << 32))


@triton.jit
def _group_scores(keys, MIN_KEY):
    """Each group's (row's) two best shifted scores added, from their keys [groups, size]."""
    best = tl.max(keys, axis=1)
    second = tl.max(tl.where(keys == best[:, None], MIN_KEY, keys), axis=1)
    return _key_value(best) + _key_value(second)


@triton.jit
def _best_groups(group_scores, gs, MIN_KEY, GROUPS: tl.constexpr, TOP_GROUPS: tl.constexpr):
    """Whether each group is one of the TOP_GROUPS best (ties: the lower group)."""
    keys = _key(tl.where(gs < GROUPS, group_scores, float("-inf")), gs)
    chosen = gs < 0
    for _ in tl.static_range(TOP_GROUPS):
        best = tl.max(keys, axis=0)
        chosen = chosen | (keys == best)
        keys = tl.where(keys == best, MIN_KEY, keys)
    return chosen


@triton.jit
def _grouped_route_kernel(
    parts_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    scale,
    EXPERTS,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    PARTS: tl.constexpr,
    GROUPS_P: tl.constexpr,
    GROUP_P: tl.constexpr,
    TOP_GROUPS: tl.constexpr,
    K: tl.constexpr,
    K_P: tl.constexpr,
    SHARED: tl.constexpr,
    SHARED_P: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token's choice from its logit parts: sigmoid scores, shifted by the bias; the
    TOP_GROUPS groups whose two best shifted scores add up highest; the K best shifted
    scores within them (ties to the lower id), weighted by their unshifted scores,
    rescaled to sum to 1 on request, times `scale`; then SHARED slots of the shared
    experts (ids EXPERTS on), each of weight 1."""
    g = tl.arange(0, GROUPS_P)[:, None]
    j = tl.arange(0, GROUP_P)[None, :]
    ok = (g < GROUPS) & (j < GROUP)
    eids = tl.where(ok, g * GROUP + j, 0)
    bias = tl.load(bias_ptr + eids, mask=ok, other=0.0).to(tl.float32)  # no step's output
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    shifted = tl.where(ok, _scores(parts_ptr, t, eids, ok, EXPERTS, PARTS) + bias, float("-inf"))
    keys = _key(shifted, tl.where(ok, eids, 0x7FFFFFFF))
    # padding's key, below every expert's
    min_key = _key(tl.full((), float("-inf"), tl.float32), tl.full((), 0x7FFFFFFF, tl.int32))
    if TOP_GROUPS < GROUPS:
        group_scores = _group_scores(keys, min_key)
        chosen = _best_groups(group_scores, tl.arange(0, GROUPS_P), min_key, GROUPS, TOP_GROUPS)
        keys = tl.where(chosen[:, None], keys, min_key)
    slots = tl.arange(0, K_P)
    top = tl.zeros((K_P,), tl.int64)
    for s in tl.static_range(K):
        best = tl.max(tl.max(keys, axis=1), axis=0)
        top = tl.where(slots == s, _key_index(best), top)
        keys = tl.where(keys == best, min_key, keys)
    keep = slots < K
    weights = _scores(parts_ptr, t, top, keep, EXPERTS, PARTS)  # the chosen's own bits
    weights = tl.where(keep, weights, 0.0)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    row = t.to(tl.int64) * (K + SHARED)
    tl.store(weights_ptr + row + slots, weights * scale, mask=keep)
    tl.store(ids_ptr + row + slots, top, mask=keep)
    if SHARED > 0:
        js = tl.arange(0, SHARED_P)
        always = js < SHARED
        tl.store(weights_ptr + row + K + js, tl.full((SHARED_P,), 1.0, tl.float32), mask=always)
        tl.store(ids_ptr + row + K + js, (EXPERTS + js).to(tl.int64), mask=always)


def grouped_router(
    x,
    weight,
    bias,
    k: int,
    groups: int,
    top_groups: int,
    renormalize: bool,
    scale: float,
    shared: int = 0,
):
    """grouped_router_ref's choice and weights, in two launches: the fp32 logits in
    parts over the hidden size, then each token's choice in a program of its own.
    (weights [tokens, k + shared] fp32, expert ids [tokens, k + shared] int64: `shared`
    slots of the shared experts after the routed ones.)"""
    (m, hidden), experts = x.shape, weight.shape[0]
    width = part_width(hidden, experts)
    n_parts, block_e = triton.cdiv(hidden, width), TILE // width
    parts = torch.empty(m, n_parts, experts, dtype=torch.float32, device=x.device)
    weights = torch.empty(m, k + shared, dtype=torch.float32, device=x.device)
    ids = torch.empty(m, k + shared, dtype=torch.int64, device=x.device)
    if not m:
        return weights, ids
    pdl = pdl_options(x.device)
    rows = rows_per_program(m)
    grid = (triton.cdiv(m, rows), n_parts, triton.cdiv(experts, block_e))
    _grouped_parts_kernel[grid](
        x.contiguous(), weight.contiguous(), parts, m, rows, hidden, experts, n_parts,
        BLOCK_E=block_e, PART_K=width, num_warps=4, **pdl,
    )  # fmt: skip
    group = experts // groups
    _grouped_route_kernel[(m,)](
        parts, bias.contiguous(), weights, ids, float(scale), experts, groups, group,
        PARTS=n_parts, GROUPS_P=triton.next_power_of_2(groups),
        GROUP_P=triton.next_power_of_2(group), TOP_GROUPS=top_groups, K=k,
        K_P=triton.next_power_of_2(k), SHARED=shared,
        SHARED_P=max(1, triton.next_power_of_2(shared)), RENORMALIZE=renormalize,
        num_warps=1, **pdl,
    )  # fmt: skip
    return weights, ids
