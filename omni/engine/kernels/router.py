"""The softmax top-k router of Mixtral and Qwen3-MoE: which experts each token takes,
and their weights.

`route_ref`/`router_ref` are the pure-torch definitions (as HF computes them), `route`
and `router` the Triton path: the router's product split over K into programs of their
own, and the choice, one program a token. A token's choice never depends on the other
tokens of its step. DeepSeek-V3's grouped sigmoid router is grouped_router.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from .matmul import linear
from .pdl import pdl_options, wait_for_inputs


def route_ref(router_logits: torch.Tensor, k: int, renormalize: bool):
    """(weights [tokens, k] in the logits' dtype, expert ids [tokens, k]): softmax over
    all experts in fp32, the top k, optionally rescaled to sum to 1 (as HF does)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


@triton.jit
def _route_kernel(
    parts_ptr,
    weights_ptr,
    ids_ptr,
    EXPERTS,
    PARTS: tl.constexpr,
    K: tl.constexpr,
    K_P: tl.constexpr,
    E_P: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token: its logits, the sum in fp32 of its PARTS partial rows in order rounded to
    the weights' dtype (one row: the logits as they are); the softmax over them in fp32,
    the top K (ties to the lower id), optionally rescaled to sum to 1."""
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, E_P)
    ok = offs < EXPERTS
    x = tl.zeros((E_P,), tl.float32)
    for part in tl.static_range(PARTS):  # unrolled: the loads go out together, then the adds
        row = parts_ptr + (t * PARTS + part) * EXPERTS
        x += tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
    x = x.to(weights_ptr.dtype.element_ty).to(tl.float32)  # as a linear layer's output
    x = tl.where(ok, x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(ok, p, 0.0)
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, K_P)
    top_w = tl.zeros((K_P,), tl.float32)
    top_i = tl.zeros((K_P,), tl.int64)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        at = tl.min(tl.where(p == best, offs, E_P), axis=0)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, at, top_i)
        p = tl.where(offs == at, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    keep = slots < K
    tl.store(weights_ptr + t * K + slots, top_w.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + t * K + slots, top_i, mask=keep)


def _route_parts(parts: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype):
    """The route kernel over parts [tokens, PARTS, experts]: (weights in `dtype`, ids)."""
    tokens, n_parts, experts = parts.shape
    weights = torch.empty(tokens, k, dtype=dtype, device=parts.device)
    ids = torch.empty(tokens, k, dtype=torch.int64, device=parts.device)
    if tokens:
        _route_kernel[(tokens,)](
            parts.contiguous(), weights, ids, experts, n_parts,
            K=k, K_P=triton.next_power_of_2(k), E_P=triton.next_power_of_2(experts),
            RENORMALIZE=renormalize, num_warps=1, **pdl_options(parts.device),
        )  # fmt: skip
    return weights, ids


def route(router_logits: torch.Tensor, k: int, renormalize: bool):
    """route_ref's choice in one kernel launch (of ~6 torch ones): each token's program
    reads only its own logits."""
    return _route_parts(router_logits.unsqueeze(1), k, renormalize, router_logits.dtype)


# The router's matrix-vector product at batch 1 reads 0.5 MB (Qwen3-30B-A3B) on 8 programs
# of the linear layer, each down all of K: ~5 us of latency on the H100. Here every
# ROUTER_CHUNK of K is a program of its own, and the route kernel adds the chunks' sums in
# order. Each row's sums are the same whatever the step's size (one tile shape for all):
# batch invariance holds, with other bits than the linear layer's. The pieces take
# ROUTER_PIECES_MAX fp32 values a token at most (16 KiB: 64 MiB for an 8,192-token prefill
# chunk of Qwen3-30B-A3B's shape at 8 KiB); a wider router (DeepSeek's 256 experts over
# 7,168 columns) keeps the linear layer, as does one of over 256 experts (a program holds
# its 128 columns of every expert's row at once: past 256 experts, over 64 KiB).
# (Routing in the last of a row tile's programs to finish, arrivals.py, instead of a
# kernel of its own was slower on the H100 at batch 1: 8.8 us a layer against 2.6 + 2.9
# without dependent launches, 265.9 against 277.9 tok/s with; its top-k ran over 16 rows.)
ROUTER_CHUNK = 128
ROUTER_BLOCK_M = 16
ROUTER_PIECES_MAX = 4096


@triton.jit(do_not_specialize=["M"])  # a step of a new size never waits for a build
def _router_parts_kernel(
    x_ptr,
    w_ptr,
    parts_ptr,
    M,
    K,
    EXPERTS,
    E_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """parts[row, c] = x[row, chunk c] @ w[:, chunk c].T in fp32, for BLOCK_M rows."""
    c = tl.program_id(1)
    ks = c * CHUNK + tl.arange(0, CHUNK)
    es = tl.arange(0, E_P)
    # the weights are no step's output: read before the wait (PDL), while the kernel before ends
    w = tl.load(
        w_ptr + es[None, :] * K + ks[:, None],
        mask=(es[None, :] < EXPERTS) & (ks[:, None] < K),
        other=0.0,
    )
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    x = tl.load(
        x_ptr + rows[:, None] * K + ks[None, :],
        mask=(rows[:, None] < M) & (ks[None, :] < K),
        other=0.0,
    )
    acc = tl.dot(x, w)
    parts = tl.cdiv(K, CHUNK)
    tl.store(
        parts_ptr + (rows[:, None] * parts + c) * EXPERTS + es[None, :],
        acc,
        mask=(rows[:, None] < M) & (es[None, :] < EXPERTS),
    )


def router(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool):
    """route(x @ weight.T, ...) with the router's product split over K (ROUTER_CHUNK):
    (weights [tokens, k] in x's dtype, expert ids [tokens, k])."""
    (m, hidden), experts = x.shape, weight.shape[0]
    n_parts = triton.cdiv(hidden, ROUTER_CHUNK)
    if experts > 256 or n_parts * experts > ROUTER_PIECES_MAX:
        return route(linear(x, weight), k, renormalize)
    parts = torch.empty(m, n_parts, experts, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, ROUTER_BLOCK_M), n_parts)
        _router_parts_kernel[grid](
            x.contiguous(), weight, parts, m, hidden, experts,
            E_P=max(16, triton.next_power_of_2(experts)), BLOCK_M=ROUTER_BLOCK_M,
            CHUNK=ROUTER_CHUNK, num_warps=4, **pdl_options(x.device),
        )  # fmt: skip
    return _route_parts(parts, k, renormalize, x.dtype)


def router_ref(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool):
    """The router as HF computes it: bf16 logits (x @ weight.T), then route_ref."""
    return route_ref(torch.nn.functional.linear(x, weight), k, renormalize)
