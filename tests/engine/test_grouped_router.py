"""DeepSeek-V3's grouped router kernels (kernels/grouped_router.py) against
moe.grouped_router_ref, on fresh random inputs: the same experts, the same weights to
fp32 rounding, and a token's bits the same alone and in a batch.

No GPU: Triton's interpreter at small hidden sizes. A token whose choice a last-bit
change of its logits could flip (two of its deciding scores within 1e-5: torch.topk
promises no order among ties, and the kernels' fp32 sums are not the reference's) is
left out of the comparison; with random inputs that is about one token in 10^5.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import pytest
import torch

from omni.engine import kernels
from omni.engine.kernels.grouped_router import grouped_router, grouped_router_ref, part_width

# (the package's name `grouped_router` is the function: kernels/__init__.py)
grouped_router_module = importlib.import_module("omni.engine.kernels.grouped_router")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32  # the router's input; its weights fp32
SCALE = 2.5


class Shape(NamedTuple):
    experts: int
    k: int
    groups: int
    top_groups: int
    hidden: int


# (experts, k, groups, top groups, hidden): Moonlight's and DeepSeek-V3's routers, at a
# hidden size of a few parts in the interpreter; a wider one whose parts are 256 columns
# (part_width); Kimi-K2's 384 experts in one group
SHAPES = {
    "moonlight": Shape(64, 6, 1, 1, 2048 if GPU else 300),
    "deepseek_v3": Shape(256, 8, 8, 4, 7168 if GPU else 200),
    "wide_parts": Shape(256, 8, 8, 4, 1100),
    "kimi_k2": Shape(384, 8, 1, 1, 7168 if GPU else 130),
}


def router_inputs(shape: Shape, tokens: int, seed=None):
    experts, hidden = shape.experts, shape.hidden
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(seed) if seed is not None else gen.seed()  # fresh inputs every run
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(DTYPE)
    weight = torch.randn(experts, hidden, generator=gen, device=DEVICE) * hidden**-0.5
    bias = torch.randn(experts, generator=gen, device=DEVICE) * 0.1
    return x, weight, bias


def clear_choice(x, weight, bias, k, groups, top_groups, margin=1e-5):
    """Tokens whose deciding scores, in fp64, are all more than `margin` apart: the
    top_groups-th and the next group score, and the k + 1 best shifted scores within
    the chosen groups (their order is the slots')."""
    scores = (x.double() @ weight.double().T).sigmoid()
    shifted = (scores + bias.double()).view(len(x), groups, -1)
    group_scores = shifted.topk(2, dim=-1).values.sum(dim=-1)
    gaps = [torch.full((len(x),), float("inf"), dtype=torch.float64, device=x.device)]
    ranked = group_scores.sort(dim=-1, descending=True).values
    if top_groups < groups:
        gaps.append(ranked[:, top_groups - 1] - ranked[:, top_groups])
    chosen = group_scores.topk(top_groups, dim=-1).indices
    best = shifted.gather(1, chosen[..., None].expand(-1, -1, shifted.shape[-1]))
    best = best.flatten(1).topk(k + 1, dim=-1).values
    gaps.append(-best.diff(dim=-1).max(dim=-1).values)
    return torch.stack(gaps).min(dim=0).values > margin


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    ("name", "tokens"),
    [("moonlight", 1), ("moonlight", 16), ("deepseek_v3", 1), ("deepseek_v3", 16),
     ("wide_parts", 5), ("kimi_k2", 5)],
)  # fmt: skip
def test_the_kernels_choose_what_the_reference_chooses(name, tokens, renormalize):
    shape = SHAPES[name]
    k, groups, top_groups = shape.k, shape.groups, shape.top_groups
    for _ in range(10):  # fresh inputs until most tokens are clear of near ties (rare,
        x, weight, bias = router_inputs(shape, tokens)  # not never: 1 of 5, or of 1, was)
        clear = clear_choice(x, weight, bias, k, groups, top_groups)
        if clear.float().mean() >= 0.5:
            break
    assert clear.float().mean() >= 0.5
    args = (k, groups, top_groups, renormalize, SCALE)
    weights, ids = grouped_router(x, weight, bias, *args)
    want_w, want_ids = grouped_router_ref(x, weight, bias, *args)
    assert weights.dtype == torch.float32 and ids.dtype == want_ids.dtype
    assert weights.shape == ids.shape == (tokens, k)
    assert torch.equal(ids[clear], want_ids[clear])
    torch.testing.assert_close(weights[clear], want_w[clear], rtol=1e-6, atol=0)


def test_shared_experts_take_the_last_slots_at_weight_one():
    """With `shared`, the routed slots as without, then ids experts, experts + 1, ... at
    weight 1, in the kernels and the reference alike."""
    shape = SHAPES["moonlight"]
    x, weight, bias = router_inputs(shape, 5)
    args = (shape.k, shape.groups, shape.top_groups, True, SCALE)
    alone_w, alone_ids = grouped_router(x, weight, bias, *args)
    for route in (grouped_router, grouped_router_ref):
        weights, ids = route(x, weight, bias, *args, 2)
        assert weights.shape == ids.shape == (5, shape.k + 2)
        assert ids[:, shape.k :].tolist() == [[shape.experts, shape.experts + 1]] * 5
        assert weights[:, shape.k :].eq(1).all()
    weights, ids = grouped_router(x, weight, bias, *args, 2)
    assert torch.equal(ids[:, : shape.k], alone_ids)
    assert torch.equal(weights[:, : shape.k], alone_w)


def test_ties_go_to_the_lower_group_and_expert():
    """Every score equal (zero weights and bias): the first top_groups groups, then their
    first k experts in order (torch.topk promises no order among ties; the kernel's, as
    moe.route's, is the lower index)."""
    shape = SHAPES["deepseek_v3"]
    x, weight, _ = router_inputs(shape, 1, seed=0)
    weight, bias = weight * 0, torch.zeros(shape.experts, device=DEVICE)
    groups = (shape.groups, shape.top_groups)
    weights, ids = grouped_router(x, weight, bias, 9, *groups, False, 1.0)
    assert ids.tolist() == [list(range(9))] and weights.tolist() == [[0.5] * 9]
    bias[40] = bias[100] = 1.0  # groups 1 and 3 first, then 0 and 2 (group 1's 32 on)
    weights, ids = grouped_router(x, weight, bias, 4, *groups, False, 1.0)
    assert ids.tolist() == [[40, 100, 0, 1]]


def test_the_parts_widen_to_keep_a_tokens_pieces_few():
    """A token's logit parts stay few (PIECES_MAX) as the router widens, the part width a
    power of two of at least 128 columns."""
    assert part_width(2048, 64) == 128  # Moonlight: 16 parts
    assert part_width(7168, 256) == 1024  # DeepSeek-V3: 7 parts
    assert part_width(1100, 256) == 256  # wide_parts: 5
    assert part_width(7168, 384) == 2048  # Kimi-K2: 4


@pytest.mark.parametrize("name", ["moonlight", "deepseek_v3"])
def test_a_tokens_choice_does_not_depend_on_its_batch(name, monkeypatch):
    """Bit for bit: a token's weights and ids alone and among others, the parts kernel's
    programs running 1 to 9 tokens each (in the interpreter: up to 6 of 20 tokens)."""
    if not GPU:
        monkeypatch.setattr(grouped_router_module, "rows_per_program", lambda m: max(1, m // 3))
    shape = SHAPES[name]
    x, weight, bias = router_inputs(shape, 300 if GPU else 20)
    args = (shape.k, shape.groups, shape.top_groups, True, SCALE)
    weights, ids = grouped_router(x, weight, bias, *args)
    assert grouped_router_module.rows_per_program(len(x)) > 1
    for rows in (slice(0, 1), slice(3, 13), slice(6, 20), slice(19, 20), slice(10, 110)):
        part_w, part_ids = grouped_router(x[rows], weight, bias, *args)
        assert torch.equal(part_ids, ids[rows]) and torch.equal(part_w, weights[rows]), rows


def test_an_empty_step_launches_nothing():
    shape = SHAPES["deepseek_v3"]
    x, weight, bias = router_inputs(shape, 0, seed=0)
    weights, ids = grouped_router(x, weight, bias, shape.k, 8, 4, True, SCALE)
    assert weights.shape == ids.shape == (0, shape.k)


def test_the_gpu_path_routes_with_the_kernels():
    gpu, cpu = kernels.ops(torch.device("cuda")), kernels.ops(torch.device("cpu"))
    assert gpu.grouped_router is grouped_router
    assert cpu.grouped_router is grouped_router_ref
