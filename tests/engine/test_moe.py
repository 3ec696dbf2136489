"""The mixture-of-experts pieces on their own: routing, the experts' reference sums
against a naive per-expert loop (as HF computes them), and the checkpoint's layout."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from omni.engine.checkpoint import CheckpointError
from omni.engine.kernels import fused_moe_ref, rms_norm_ref
from omni.engine.kernels.moe import align_by_expert, fused_moe, sub_blocks, sum_slots
from omni.engine.kernels.norm import rms_norm
from omni.engine.kernels.router import route as kernel_route
from omni.engine.kernels.router import router
from omni.engine.moe import MoEConfig, moe_config, route, stack_experts


def naive_moe(x, gate_up, down, weights, ids):
    """Expert by expert, as transformers' Mixtral does: each expert's tokens, their
    outputs times the routing weight, added into the result."""
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.where(ids == expert)
        if not len(token):
            continue
        gate, up = (x[token] @ gate_up[expert].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down[expert].T
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


@pytest.mark.parametrize(("tokens", "experts", "k"), [(37, 8, 2), (5, 6, 3), (1, 4, 1)])
def test_fused_moe_ref_sums_what_a_per_expert_loop_sums(tokens, experts, k):
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden, inter = 48, 40
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = route(logits, k, renormalize=True)
    want = naive_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(fused_moe_ref(x, gate_up, down, weights, ids), want)


def test_routing_keeps_the_top_k_and_renormalizes_on_request():
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 2], [2, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_qwen3_moe_layers_that_stay_dense():
    c = {
        "num_hidden_layers": 6,
        "decoder_sparse_step": 2,  # every second layer routed: 1, 3, 5
        "mlp_only_layers": [3],
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    moe = moe_config("qwen3_moe", c)
    assert moe.dense_layers == {0, 2, 3, 4}
    assert not moe.renormalize  # norm_topk_prob absent: HF's default, off
    assert moe_config("llama", c) is None


def test_stacking_names_a_missing_expert():
    moe = MoEConfig(experts=2, per_token=1, intermediate=4, renormalize=True)
    state = {"model.layers.0.block_sparse_moe.gate.weight": torch.zeros(2, 8)}
    for e in range(2):
        for name, shape in (("w1", (4, 8)), ("w3", (4, 8)), ("w2", (8, 4))):
            state[f"model.layers.0.block_sparse_moe.experts.{e}.{name}.weight"] = torch.zeros(shape)
    full = dict(state)
    stack_experts(full, "mixtral", moe, 1, "ckpt")
    assert full["model.layers.0.mlp.experts.gate_up"].shape == (2, 8, 8)
    assert full["model.layers.0.mlp.experts.down"].shape == (2, 8, 4)
    del state["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    with pytest.raises(CheckpointError, match=r"experts\.1\.w3\.weight"):
        stack_experts(state, "mixtral", moe, 1, "ckpt")


GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32


def moe_inputs(gen, tokens, experts, k, hidden, inter):
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(DTYPE)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=DEVICE)
               * hidden**-0.5).to(DTYPE)  # fmt: skip
    down = (torch.randn(experts, hidden, inter, generator=gen, device=DEVICE)
            * inter**-0.5).to(DTYPE)  # fmt: skip
    logits = torch.randn(tokens, experts, generator=gen, device=DEVICE).to(DTYPE)
    weights, ids = route(logits, k, renormalize=True)
    return x, gate_up, down, weights, ids


def test_align_by_expert_puts_every_slot_in_one_block_of_its_expert():
    ids = torch.tensor([[3, 0], [0, 2], [3, 1], [0, 3], [2, 0]], device=DEVICE)
    rows, block_expert = align_by_expert(ids, experts=5, block_m=4)
    slots = ids.numel()
    blocks = rows.view(-1, 4)
    seen = []
    for block, expert in zip(blocks.tolist(), block_expert.tolist(), strict=True):
        real = [r for r in block if r < slots]
        if expert >= 5:  # past the last group: nothing in it
            assert not real
            continue
        assert all(ids.reshape(-1)[r] == expert for r in real)
        seen += real
    assert sorted(seen) == list(range(slots))


def test_align_by_expert_gives_each_expert_its_fewest_blocks():
    """Random ids with some of another rank's (id == experts): each expert's slots fill
    ceil(count / block) blocks of its own, once each; the other rank's only blocks that
    no kernel runs."""
    gen = torch.Generator().manual_seed(3)
    experts, block = 20, 16
    ids = torch.randint(0, experts + 1, (300, 3), generator=gen).to(DEVICE)
    rows, block_expert = align_by_expert(ids, experts, block)
    flat = ids.reshape(-1).tolist()
    placed: dict[int, list[int]] = {}
    for members, expert in zip(rows.view(-1, block).tolist(), block_expert.tolist(), strict=True):
        real = [r for r in members if r < len(flat)]
        if expert >= experts:  # unused: the other rank's slots, or none
            assert all(flat[r] == experts for r in real)
            continue
        assert real and all(flat[r] == expert for r in real)
        placed.setdefault(expert, []).append(len(real))
    for expert in range(experts):
        count = flat.count(expert)
        assert sum(placed.get(expert, [])) == count
        assert len(placed.get(expert, [])) == -(-count // block)


# one-slot (3 tokens), then programs of 1, 2 and 4 blocks an expert (sub_blocks)
@pytest.mark.parametrize(
    ("tokens", "experts", "k"), [(3, 6, 3), (37, 8, 2), (60, 6, 2), (90, 4, 2)]
)
def test_fused_moe_kernel_against_the_reference(tokens, experts, k):
    gen = torch.Generator(device=DEVICE).manual_seed(tokens + experts)
    hidden, inter = (512, 384) if GPU else (64, 48)
    args = moe_inputs(gen, tokens, experts, k, hidden, inter)
    tol = {"atol": 3e-2, "rtol": 3e-2} if GPU else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(fused_moe(*args), fused_moe_ref(*args), **tol)


@pytest.mark.parametrize(("experts", "k", "renormalize"), [(128, 8, True), (6, 3, False)])
def test_route_kernel_picks_what_the_reference_picks(experts, k, renormalize):
    gen = torch.Generator(device=DEVICE).manual_seed(experts + k)
    logits = torch.randn(33, experts, generator=gen, device=DEVICE).to(DTYPE)
    weights, ids = kernel_route(logits, k, renormalize)
    want_w, want_ids = route(logits, k, renormalize)
    # bf16 logits tie often: then any of the tied experts is a right choice, so compare
    # the chosen experts' probabilities, not their ids
    probs = torch.softmax(logits.float(), dim=-1)
    got = probs.gather(1, ids).sort(dim=1).values
    want = probs.gather(1, want_ids).sort(dim=1).values
    assert torch.equal(got, want)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # k different experts
    torch.testing.assert_close(weights, want_w, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize(("experts", "k", "renormalize"), [(128, 8, True), (6, 3, False)])
def test_router_kernel_picks_the_top_experts(experts, k, renormalize):
    """The router split over K, summed by the route kernel: each token's experts are the
    k most probable (near-ties aside: the chosen ones' probabilities add up to the best
    k's), and its weights are route_ref's where the choice is the same."""
    gen = torch.Generator(device=DEVICE).manual_seed(experts + 5 * k)
    hidden = 300  # three chunks, the last one short
    x = torch.randn(33, hidden, generator=gen, device=DEVICE).to(DTYPE)
    w = (torch.randn(experts, hidden, generator=gen, device=DEVICE) / 4).to(DTYPE)
    weights, ids = router(x, w, k, renormalize)
    probs = torch.softmax(x.double() @ w.double().T, dim=-1)
    best = probs.topk(k, dim=-1).values.sum(dim=-1)
    assert torch.all(probs.gather(1, ids).sum(dim=-1) >= best - 1e-3)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # k different experts
    want_w, want_ids = route(x @ w.T, k, renormalize)
    same = (ids.sort(dim=1).values == want_ids.sort(dim=1).values).all(dim=1)
    assert same.float().mean() > 0.8
    got = weights.float().gather(1, ids.argsort(dim=1))[same]
    torch.testing.assert_close(got, want_w.float().gather(1, want_ids.argsort(dim=1))[same],
                               atol=2e-2, rtol=2e-2)  # fmt: skip


def test_a_wide_router_keeps_the_linear_layer():
    """Over 256 experts (or too many pieces a token): the linear layer, then the route
    kernel, bit for bit."""
    from omni.engine.kernels import linear

    gen = torch.Generator(device=DEVICE).manual_seed(8)
    x = torch.randn(5, 256, generator=gen, device=DEVICE).to(DTYPE)
    w = (torch.randn(300, 256, generator=gen, device=DEVICE) / 8).to(DTYPE)
    weights, ids = router(x, w, 4, True)
    want_w, want_ids = kernel_route(linear(x, w), 4, True)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


def test_router_rows_do_not_depend_on_the_batch():
    """Bit for bit: a token's routing alone and among others (one tile shape for all; in
    the interpreter, tokens that keep their place in the tile: test_kernels.INTERPRETER_ROWS)."""
    gen = torch.Generator(device=DEVICE).manual_seed(21)
    x = torch.randn(70, 512, generator=gen, device=DEVICE).to(DTYPE)
    w = (torch.randn(64, 512, generator=gen, device=DEVICE) / 8).to(DTYPE)
    weights, ids = router(x, w, 4, True)
    cuts = ((0, 1), (3, 20), (17, 70)) if GPU else ((0, 1), (16, 20), (32, 70))
    for rows in (slice(*cut) for cut in cuts):
        part_w, part_ids = router(x[rows], w, 4, True)
        assert torch.equal(part_ids, ids[rows]) and torch.equal(part_w, weights[rows]), rows


@pytest.mark.parametrize("tokens", [3, 40])  # one-slot, grouped
def test_the_norm_after_a_moe_layer_adds_its_slots_as_the_slot_sum_does(tokens):
    """fused_moe(summed=False) into the next RMS norm: the bits of the slot-sum kernel
    followed by the norm (one kernel fewer), normed output and residual both."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    hidden, inter = (512, 384) if GPU else (64, 48)
    x, gate_up, down, weights, ids = moe_inputs(gen, tokens, 8, 2, hidden, inter)
    slots = fused_moe(x, gate_up, down, weights, ids, summed=False)
    assert slots.shape == (tokens, 2, hidden) and slots.dtype == torch.float32
    residual = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(DTYPE)
    norm_weight = torch.rand(hidden, generator=gen, device=DEVICE).to(DTYPE) + 0.5
    out, new_residual = rms_norm(slots, norm_weight, 1e-6, residual)
    want, want_residual = rms_norm(sum_slots(slots, DTYPE), norm_weight, 1e-6, residual)
    assert torch.equal(out, want) and torch.equal(new_residual, want_residual)
    assert torch.equal(sum_slots(slots, DTYPE), fused_moe(x, gate_up, down, weights, ids))
    ref, ref_residual = rms_norm_ref(slots, norm_weight, 1e-6, residual)  # the CPU path's
    torch.testing.assert_close(ref, out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ref_residual, want_residual, atol=1e-2, rtol=1e-2)


def test_eagle_taps_after_a_moe_layer_record_the_summed_hidden_state():
    """An EAGLE-3 head's taps meet a MoE layer's unsummed slots: they record what the
    layer's summed output plus the residual is."""
    from omni.engine.eagle3 import HiddenTaps

    gen = torch.Generator(device=DEVICE).manual_seed(4)
    slots = torch.randn(5, 2, 64, generator=gen, device=DEVICE)
    residual = torch.randn(5, 64, generator=gen, device=DEVICE).to(DTYPE)
    taps, want = (HiddenTaps((3,), 64, DTYPE, DEVICE) for _ in range(2))
    for t in (taps, want):
        t.fit(8)
    taps.record(3, slots, residual)
    want.record(3, sum_slots(slots, DTYPE), residual)
    assert torch.equal(taps.buffer, want.buffer) and taps.buffer[:5].abs().sum() > 0


@pytest.mark.gpu
def test_fused_moe_rows_do_not_depend_on_the_batch():
    """Bit for bit: a token's output alone, among a few and among many (its experts'
    blocks then hold other tokens), on the one-slot path (1 and 7 tokens) and grouped,
    with programs of 1, 2 and 4 blocks an expert (40, 100 and 200 or more tokens)."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    x, gate_up, down, weights, ids = moe_inputs(gen, 1200, 8, 2, 1024, 512)
    full = fused_moe(x, gate_up, down, weights, ids)
    assert [sub_blocks(2 * n, 8) for n in (40, 100, 200)] == [1, 2, 4]
    for rows in (
        slice(0, 1),
        slice(5, 12),
        slice(40, 80),
        slice(300, 400),
        slice(100, 300),
        slice(200, 1000),
    ):
        part = fused_moe(x[rows], gate_up, down, weights[rows], ids[rows])
        assert torch.equal(part, full[rows]), rows


@pytest.mark.parametrize(("tokens", "experts", "k"), [(37, 8, 2), (3, 6, 3)])  # grouped, one-slot
def test_ranks_shares_of_the_experts_add_up_to_the_whole(tokens, experts, k):
    """Expert parallelism over 2 ranks: each rank's partial sum (its run of experts, the
    other slots adding nothing) plus the other's is the whole layer's, on the reference
    and the kernel; the kernel's partial sums are the reference's."""
    from omni.engine.moe import local_ids

    gen = torch.Generator(device=DEVICE).manual_seed(tokens * 7 + experts)
    hidden, inter = (512, 384) if GPU else (64, 48)
    x, gate_up, down, weights, ids = moe_inputs(gen, tokens, experts, k, hidden, inter)
    half = experts // 2
    tol = {"atol": 3e-2, "rtol": 3e-2} if GPU else {"atol": 1e-4, "rtol": 1e-4}
    for moe in (fused_moe_ref, fused_moe):
        parts = []
        for r in range(2):
            mine = slice(r * half, (r + 1) * half)
            local = local_ids(ids, r * half, half)
            assert ((local == half) == ((ids < r * half) | (ids >= (r + 1) * half))).all()
            args = (x, gate_up[mine], down[mine], weights, local)
            parts.append(moe(*args, partial=True))
            if moe is fused_moe:
                torch.testing.assert_close(parts[-1], fused_moe_ref(*args, partial=True), **tol)
        whole = fused_moe_ref(x, gate_up, down, weights, ids)
        torch.testing.assert_close(parts[0].float() + parts[1].float(), whole.float(), **tol)
