"""Placement: constraints always hold, unplaceable replicas say why, re-placing moves little,
and small hand-made cases use the optimal number of GPUs."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.placement import (
    Gpu,
    ModelSpec,
    Node,
    Placement,
    PlacementResult,
    place,
)

G = 1 << 30


def node(
    node_id: str,
    location: str = "a",
    n: int = 1,
    kind: str = "H100",
    budget: float = 10,
    ratio: float = 1.0,
    memory: float = 80,
) -> Node:
    """A node of `n` alike GPUs; sizes in GiB."""
    gpus = tuple(Gpu(node_id, i, kind, int(memory * G), int(budget * G), ratio) for i in range(n))
    return Node(node_id, location, gpus)


def model(name: str, quota: float, replicas: int = 1, **kw) -> ModelSpec:
    return ModelSpec(name, int(quota * G), replicas, **kw)


def check(nodes: list[Node], models: list[ModelSpec], res: PlacementResult) -> None:
    """Everything a result must satisfy, checked from the inputs alone."""
    gpus = {(n.id, g.index): (n, g) for n in nodes for g in n.gpus}
    specs = {m.name: m for m in models}
    used: Counter = Counter()
    on: defaultdict = defaultdict(list)
    for p in res.placements:
        spec = specs[p.model]
        assert len(p.gpus or (p.gpu,)) == spec.gpus, p  # all on p.node, by the keys below
        assert not p.gpus or p.gpus[0] == p.gpu, p
        for index in p.gpus or (p.gpu,):
            n, g = gpus[p.node, index]
            used[p.node, index] += spec.quota_bytes
            on[p.node, index].append(p.model)
            assert spec.quota_bytes <= g.budget_bytes, p
            assert not spec.gpu_kinds or g.kind in spec.gpu_kinds, p
            assert g.memory_bytes >= spec.min_gpu_memory, p
            assert not spec.allowed_locations or n.location in spec.allowed_locations, p
            assert n.location not in spec.denied_locations, p
    for key, total in used.items():
        assert total <= int(gpus[key][1].budget_bytes * gpus[key][1].overcommit), key
        assert len(on[key]) == len(set(on[key])), f"two replicas of one model on {key}"
    replicas: defaultdict = defaultdict(list)
    for p in res.placements:
        replicas[p.model].append(p.replica)
    for u in res.unplaced:
        replicas[u.model].append(u.replica)
        assert u.reason
    for m in models:
        assert sorted(replicas[m.name]) == list(range(m.replicas)), m.name
    assert res.gpus_used == len(used)
    assert res.lower_bound <= res.gpus_used
    for m in models:
        placed = [gpus[p.node, p.gpu][0].location for p in res.placements if p.model == m.name]
        if m.name not in res.spread_short:
            ok_locations = {
                n.location
                for n in nodes
                if any(m.matches(g, n.location) and m.quota_bytes <= g.budget_bytes for g in n.gpus)
            }
            assert len(set(placed)) >= min(m.spread, len(placed), len(ok_locations)), m.name


def where(res: PlacementResult) -> dict[str, set[tuple[str, int]]]:
    out: defaultdict = defaultdict(set)
    for p in res.placements:
        out[p.model].add((p.node, p.gpu))
    return out


# -- constraints -------------------------------------------------------------------------------


def test_gpu_kind_and_min_memory():
    nodes = [
        node("h", kind="H100", memory=80),
        node("a", kind="A100", memory=40),
        node("l", kind="L4", memory=24),
    ]
    models = [
        model("needs-h100", 1, gpu_kinds={"H100"}),
        model("big-memory", 1, min_gpu_memory=30 * G),
        model("l4-or-a100", 1, replicas=2, gpu_kinds={"L4", "A100"}),
    ]
    res = place(nodes, models)
    check(nodes, models, res)
    on = where(res)
    assert on["needs-h100"] == {("h", 0)}
    assert on["big-memory"] <= {("h", 0), ("a", 0)}
    assert on["l4-or-a100"] == {("a", 0), ("l", 0)}


def test_allowed_and_denied_locations():
    nodes = [node("eu1", "eu"), node("us1", "us"), node("ap1", "ap")]
    models = [
        model("eu-only", 1, allowed_locations={"eu"}),
        model("not-us", 1, replicas=2, denied_locations={"us"}),
        model("eu-but-denied", 1, allowed_locations={"eu"}, denied_locations={"eu"}),
    ]
    res = place(nodes, models)
    check(nodes, models, res)
    on = where(res)
    assert on["eu-only"] == {("eu1", 0)}
    assert on["not-us"] == {("eu1", 0), ("ap1", 0)}
    assert [u.model for u in res.unplaced] == ["eu-but-denied"]
    assert "no GPU matches" in res.unplaced[0].reason


def test_overcommit_capacity_and_budget():
    """Quotas may sum to budget * ratio, but one quota must fit in the budget."""
    nodes = [node("n", budget=10, ratio=2.0)]
    models = [model(f"m{i}", 6) for i in range(4)] + [model("huge", 12)]
    res = place(nodes, models)
    check(nodes, models, res)
    assert len(res.placements) == 3  # 18 of 20 GiB
    reasons = {u.model: u.reason for u in res.unplaced}
    assert "exceeds the budget" in reasons["huge"]
    assert "free" in reasons[next(m for m in reasons if m != "huge")]


def test_replicas_never_share_a_gpu():
    nodes = [node("n", n=4, budget=100)]
    res = place(nodes, [model("m", 1, replicas=5)])
    check(nodes, [model("m", 1, replicas=5)], res)
    assert len(where(res)["m"]) == 4
    assert len(res.unplaced) == 1
    assert "only 4 eligible GPUs" in res.unplaced[0].reason


def test_spread_across_locations():
    """Spread beats packing: replicas go to new locations though one GPU has room for all."""
    nodes = [node("a1", "a", n=3, budget=40), node("b1", "b"), node("c1", "c")]
    models = [model("filler", 1), model("m", 2, replicas=3, spread=3)]
    res = place(nodes, models)
    check(nodes, models, res)
    assert {p.node for p in res.placements if p.model == "m"} == {"a1", "b1", "c1"}
    assert res.spread_short == []


def test_spread_limited_by_allowed_locations_and_capacity():
    nodes = [node("a1", "a", n=3), node("b1", "b"), node("c1", "c", budget=1)]
    models = [
        model("two-places", 1, replicas=3, spread=3, allowed_locations={"a", "b"}),
        model("no-room-in-c", 2, replicas=3, spread=3),
    ]
    res = place(nodes, models)
    check(nodes, models, res)
    assert {p.node for p in res.placements if p.model == "two-places"} == {"a1", "b1"}
    assert res.spread_short == []  # c's budget is too small: two locations is all it can get
    squeezed = [node("a1", "a", n=3), node("b1", "b", budget=2), node("c1", "c", budget=2)]
    models = [model("b-filler", 2, allowed_locations={"b", "c"}, replicas=2), model("m", 1, 3)]
    models[1].spread = 3
    res = place(squeezed, models)
    check(squeezed, models, res)
    assert res.spread_short == ["m"]  # b and c are full: all of m in a, and it says so


# -- packing quality -----------------------------------------------------------------------------


def test_optimal_on_a_classic_case():
    nodes = [node("n", n=4, budget=10)]
    models = [model(f"m{q}-{i}", q) for i, q in enumerate([6, 4, 4, 3, 3])]
    res = place(nodes, models)
    check(nodes, models, res)
    assert res.gpus_used == res.lower_bound == 2


def test_largest_gpus_opened_first():
    nodes = [node("small", n=4, kind="L4", budget=20, memory=24), node("big", budget=70)]
    models = [model("a", 30), model("b", 20), model("c", 10), model("d", 10)]
    res = place(nodes, models)
    check(nodes, models, res)
    assert res.gpus_used == res.lower_bound == 1


def test_pinned_models_do_not_lose_their_gpus_to_the_bulk():
    """L4-only models placed first: unconstrained ones fill what they leave, not vice versa."""
    nodes = [node("l4", n=2, kind="L4", budget=20, memory=24), node("h", budget=60)]
    models = [
        model("bulk-big", 50),
        model("bulk-small", 8),
        model("l4-a", 12, gpu_kinds={"L4"}),
        model("l4-b", 8, gpu_kinds={"L4"}),
    ]
    res = place(nodes, models)
    check(nodes, models, res)
    assert res.gpus_used == 2


def test_lower_bound_counts_replicas_and_pinned_demand():
    nodes = [node("n", n=8, budget=100)]
    res = place(nodes, [model("m", 1, replicas=5)])
    assert res.gpus_used == res.lower_bound == 5
    nodes = [node("l4", n=4, kind="L4", budget=10, memory=24), node("h", n=2, budget=100)]
    models = [model("pinned", 8, replicas=3, gpu_kinds={"L4"}), model("free", 50)]
    res = place(nodes, models)
    check(nodes, models, res)
    assert res.gpus_used == res.lower_bound == 4  # three L4s (pinned) and one H100


# -- re-placing ----------------------------------------------------------------------------------


def cluster() -> tuple[list[Node], list[ModelSpec]]:
    nodes = [node(f"n{i}", "abc"[i % 3], n=4, budget=20, ratio=1.5) for i in range(6)]
    models = [model(f"m{i}", 0.5 + (i * 7 % 13), replicas=1 + i % 3, spread=2) for i in range(20)]
    return nodes, models


def test_same_inputs_move_nothing():
    nodes, models = cluster()
    first = place(nodes, models)
    check(nodes, models, first)
    again = place(nodes, models, first.placements)
    assert again.placements == first.placements
    assert (again.moves, again.started, again.stopped) == (0, 0, 0)


def test_small_demand_change_keeps_everything_else():
    nodes, models = cluster()
    first = place(nodes, models)
    models[3].replicas += 1
    models[7].replicas -= 1
    models[11].replicas = 0
    res = place(nodes, models, first.placements)
    check(nodes, models, res)
    assert res.moves == 0
    assert res.started == 1
    assert res.stopped == 1 + first_count(first, "m11")
    before, after = where(first), where(res)
    for m in models:
        if m.name not in ("m3", "m7", "m11"):
            assert after[m.name] == before[m.name]
    assert before["m3"] < after["m3"] and after["m7"] < before["m7"]


def first_count(res: PlacementResult, name: str) -> int:
    return sum(p.model == name for p in res.placements)


def test_surplus_dropped_from_the_least_filled_gpu():
    nodes = [node("n", n=2, budget=10)]
    current = [Placement("m", 0, "n", 0), Placement("other", 0, "n", 0), Placement("m", 1, "n", 1)]
    models = [model("m", 2, replicas=1), model("other", 5)]
    res = place(nodes, models, current)
    check(nodes, models, res)
    assert where(res)["m"] == {("n", 0)}
    assert res.gpus_used == 1
    assert (res.moves, res.stopped) == (0, 1)


def test_invalid_placements_move():
    nodes = [node("eu1", "eu", n=2), node("us1", "us", n=2)]
    models = [model("m", 2, replicas=2), model("k", 2)]
    current = [Placement("m", 0, "eu1", 0), Placement("m", 1, "gone", 0)]
    current.append(Placement("k", 0, "us1", 1))
    models[1].denied_locations = frozenset({"us"})
    res = place(nodes, models, current)
    check(nodes, models, res)
    assert ("eu1", 0) in where(res)["m"]
    assert where(res)["k"] <= {("eu1", 0), ("eu1", 1)}
    assert res.moves == 2 and res.started == res.stopped == 0


def test_shrunk_budget_moves_the_largest_instance():
    nodes = [node("n", n=2, budget=10)]
    current = [Placement(name, 0, "n", 0) for name in ("big", "s1", "s2")]
    models = [model("big", 6), model("s1", 2), model("s2", 2)]
    res = place(nodes, models, current)
    assert res.moves == 0
    shrunk = Gpu("n", 0, "H100", 80 * G, 7 * G)
    nodes = [Node("n", "a", (shrunk, nodes[0].gpus[1]))]
    res = place(nodes, models, current)
    check(nodes, models, res)
    assert where(res)["big"] == {("n", 1)} and res.moves == 1


def test_consolidation_within_a_move_budget():
    nodes = [node("n", n=3, budget=10)]
    current = [Placement("a", 0, "n", 0), Placement("b", 0, "n", 1), Placement("c", 0, "n", 2)]
    models = [model("a", 6), model("b", 2), model("c", 2)]
    res = place(nodes, models, current)
    assert res.gpus_used == 3 and res.moves == 0
    res = place(nodes, models, current, move_budget=1)
    check(nodes, models, res)
    assert res.gpus_used == 2 and res.moves == 1
    res = place(nodes, models, current, move_budget=2)
    check(nodes, models, res)
    assert res.gpus_used == 1 and res.moves == 2


def test_consolidation_keeps_spread():
    nodes = [node("a1", "a", budget=10), node("b1", "b", budget=10)]
    current = [Placement("m", 0, "a1", 0), Placement("m", 1, "b1", 0), Placement("x", 0, "a1", 0)]
    models = [model("m", 1, replicas=2, spread=2), model("x", 1)]
    res = place(nodes, models, current, move_budget=10)
    check(nodes, models, res)
    assert res.moves == 0 and res.gpus_used == 2


# -- every result is valid -----------------------------------------------------------------------


@st.composite
def scenarios(draw):
    kinds, locations = ["H100", "A100", "L4"], ["a", "b", "c"]
    nodes = []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(kinds))
        budget = draw(st.integers(4, 40))
        gpus = tuple(
            Gpu(f"n{i}", j, kind, {"H100": 80, "A100": 40, "L4": 24}[kind] * G, budget * G, r)
            for j, r in enumerate(draw(st.lists(st.sampled_from([1.0, 1.5, 2.0]), max_size=4)))
        )
        nodes.append(Node(f"n{i}", draw(st.sampled_from(locations)), gpus))
    models = []
    for i in range(draw(st.integers(1, 10))):
        spec = model(f"m{i}", draw(st.integers(1, 30)), replicas=draw(st.integers(0, 4)))
        spec.gpu_kinds = frozenset(draw(st.sets(st.sampled_from(kinds), max_size=2)))
        spec.min_gpu_memory = draw(st.sampled_from([0, 0, 30 * G]))
        spec.allowed_locations = frozenset(draw(st.sets(st.sampled_from(locations), max_size=2)))
        spec.denied_locations = frozenset(draw(st.sets(st.sampled_from(locations), max_size=1)))
        spec.spread = draw(st.integers(1, 3))
        spec.demand = draw(st.dictionaries(st.sampled_from(locations), st.sampled_from([0, 1, 5])))
        models.append(spec)
    return nodes, models, draw(st.integers(0, 5)), draw(st.randoms(use_true_random=False))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_result_is_valid(scenario):
    nodes, models, budget, rng = scenario
    first = place(nodes, models)
    check(nodes, models, first)
    again = place(nodes, models, first.placements, move_budget=budget)
    check(nodes, models, again)
    if budget == 0:
        assert again.moves == 0
    # A demand change, a lost node and stale placements: still valid.
    for spec in models:
        spec.replicas = max(0, spec.replicas + rng.choice((-1, 0, 1)))
    survivors = nodes[1:] if rng.random() < 0.5 else nodes
    current = [*again.placements, Placement("unknown", 0, "n0", 0), Placement("m0", 9, "x", 3)]
    res = place(survivors, models, current, move_budget=budget)
    check(survivors, models, res)
    assert res.moves <= len(current)


def test_a_model_spreads_once_a_second_location_joins():
    """Placed while only one location had nodes, a spread-2 model moves one replica to the
    new location when it joins: one move, not a re-placement."""
    east = [Node(f"e{i}", "east", [Gpu(f"e{i}", 0, "h100", 80 * G, 80 * G, 1.0)]) for i in range(2)]
    west = [Node("w0", "west", [Gpu("w0", 0, "h100", 80 * G, 80 * G, 1.0)])]
    spec = ModelSpec("m", 10 * G, replicas=2, spread=2)
    first = place(east, [spec])
    assert {p.node for p in first.placements} == {"e0", "e1"}
    second = place(east + west, [spec], first.placements)
    nodes = {p.node for p in second.placements}
    assert "w0" in nodes and len(nodes & {"e0", "e1"}) == 1
    assert second.moves == 1 and not second.spread_short


def test_new_replicas_go_where_the_demand_is_short_of_them():
    """Demand weighs locations: replicas split in proportion to it, room allowing, and a
    model with demand in one location runs there though another location comes first."""
    nodes = [node(f"a{i}", "a") for i in range(3)] + [node(f"b{i}", "b") for i in range(3)]
    plain = place(nodes, [model("m", 4)])
    assert {p.node[0] for p in plain.placements} == {"a"}  # without demand: the first pool
    near_b = place(nodes, [model("m", 4, demand={"b": 10.0})])
    assert {p.node[0] for p in near_b.placements} == {"b"}
    split = place(nodes, [model("m", 4, replicas=3, demand={"a": 1.0, "b": 2.0})])
    assert Counter(p.node[0] for p in split.placements) == {"b": 2, "a": 1}
    # Spread still comes first: two replicas, two locations, though all demand is in b.
    spread = place(nodes, [model("m", 4, replicas=2, spread=2, demand={"b": 1.0})])
    assert Counter(p.node[0] for p in spread.placements) == {"a": 1, "b": 1}
    # b full: the demand's replicas go elsewhere rather than nowhere.
    full = [node("a0", "a"), node("b0", "b", budget=2)]
    res = place(full, [model("m", 4, demand={"b": 1.0})])
    assert [p.node for p in res.placements] == ["a0"]
    # Consolidation does not pack a new replica away from its demand: "other" runs in a
    # with room to spare, m still starts in b.
    two = [node("a0", "a"), node("b0", "b")]
    running = [Placement("other", 0, "a0", 0)]
    specs = [model("other", 4), model("m", 4, demand={"b": 1.0})]
    res = place(two, specs, running)
    assert sorted((p.model, p.node) for p in res.placements) == [("m", "b0"), ("other", "a0")]
    packed = place(two, [specs[0], model("m", 4)], running)  # without demand: packed
    assert sorted((p.model, p.node) for p in packed.placements) == [("m", "a0"), ("other", "a0")]
    # What runs stays: demand moving to b starts nothing and moves nothing.
    again = place(nodes, [model("m", 4, demand={"b": 10.0})], plain.placements)
    assert again.placements == plain.placements and again.moves == 0
    with pytest.raises(ValueError, match="demand"):
        model("m", 4, demand={"b": -1.0})


def test_a_multi_gpu_model_takes_gpus_of_one_node():
    """A model over 2 GPUs (tensor parallelism) goes to a node with two GPUs of room, the
    one-GPU models fill the room left, and a re-placement keeps it where it is."""
    nodes = [node("one", n=1), node("two", n=2), node("three", n=3, kind="L4")]
    models = [model("big", 8, gpus=2, gpu_kinds={"H100"}), model("s1", 2), model("s2", 4)]
    res = place(nodes, models)
    check(nodes, models, res)
    big = [p for p in res.placements if p.model == "big"]
    assert [(p.node, p.gpus) for p in big] == [("two", (0, 1))]
    assert res.gpus_used <= 4
    again = place(nodes, models, res.placements)
    check(nodes, models, again)
    assert again.moves == again.started == again.stopped == 0
    assert [p for p in again.placements if p.model == "big"] == big


def test_a_multi_gpu_model_that_fits_no_node_says_why():
    nodes = [node("a", n=1), node("b", n=1)]  # two GPUs, but not of one node
    models = [model("big", 8, gpus=2), model("small", 2)]
    res = place(nodes, models)
    check(nodes, models, res)
    assert [(u.model, u.replica) for u in res.unplaced] == [("big", 0)]
    assert "no node has 2 eligible GPUs" in res.unplaced[0].reason
    assert [p.model for p in res.placements] == ["small"]


def test_multi_gpu_replicas_take_distinct_gpus_and_a_lost_gpu_moves_one():
    nodes = [node("n", n=4, budget=10)]
    models = [model("big", 6, replicas=2, gpus=2)]
    res = place(nodes, models)
    check(nodes, models, res)
    held = [set(p.gpus) for p in res.placements]
    assert len(held) == 2 and not held[0] & held[1]
    smaller = [node("n", n=3, budget=10)]  # GPU 3 is gone: one replica loses a GPU
    lost = next(p for p in res.placements if 3 in p.gpus)
    kept = next(p for p in res.placements if 3 not in p.gpus)
    again = place(smaller, models, res.placements)
    check(smaller, models, again)
    assert again.placements == [kept]  # the other stays; no node has 2 GPUs of room left
    assert [(u.model, u.replica) for u in again.unplaced] == [("big", lost.replica)]
