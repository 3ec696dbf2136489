"""The scheduler's inputs (its models file, the nodes' announcements, its flags) and its
one-instance-per-node rule."""

from __future__ import annotations

import pytest

from omni.runtime.omnid import entry_from_spec
from scheduler.__main__ import advertised_host, join_hostport, parse_hostport
from scheduler.autoscale import AutoscaleConfig
from scheduler.placement import ModelSpec, Placement, place
from scheduler.service import CPU_BUDGET, cluster_nodes, load_models, one_per_node


def test_a_models_file_with_a_missing_or_bad_key_names_it(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "a"\nquota = "2GiB"\n')
    with pytest.raises(ValueError, match=r"models\[0\]: missing 'path'"):
        load_models(path)
    path.write_text('[[models]]\nname = "a"\npath = "/m"\nquota = "lots"\n')
    with pytest.raises(ValueError, match=r"models\[0\]: .*lots"):
        load_models(path)
    path.write_text(
        '[[models]]\nname = "a"\npath = "/m"\nquota = "2GiB"\nreplicas = 3\n'
        'gpu_kinds = ["H100"]\nallowed_locations = ["fra"]\nspread = 2\n'
    )
    (model,) = load_models(path)
    assert model.spec.quota_bytes == 2 << 30 and model.spec.replicas == 3
    assert model.spec.gpu_kinds == {"H100"} and model.spec.spread == 2


def test_a_handler_s_model_tells_nodes_what_runs_it(tmp_path):
    path, model = tmp_path / "models.toml", tmp_path / "asr"
    model.mkdir()
    path.write_text(
        f'[[models]]\nname = "asr"\npath = "{model}"\nruntime = "python"\n'
        'handler = "omni.runtimes.pocketsphinx_asr:PocketsphinxASR"\n'
        'requirements = ["numpy==2.1.0"]\nmax_batch_size = 8\n'
        '[[models]]\nname = "llm"\npath = "/m/llm"\n'
    )
    asr, llm = load_models(path)
    spec = asr.node_spec(asr.base_version)
    assert spec == {
        "path": str(model),
        "version": "1",
        "runtime": "python",
        "handler": "omni.runtimes.pocketsphinx_asr:PocketsphinxASR",
        "requirements": ["numpy==2.1.0"],
        "max_batch_size": 8,
    }
    assert entry_from_spec("asr", spec).handler.handler.startswith("omni.runtimes.")
    assert llm.node_spec(llm.base_version) == {"path": "/m/llm", "version": "1"}
    path.write_text('[[models]]\nname = "a"\npath = "/m"\nhandler = "h.py:H"\n')
    with pytest.raises(ValueError, match=r"models\[0\]: handler needs runtime"):
        load_models(path)


def test_announced_nodes_become_placement_nodes():
    nodes = cluster_nodes(
        {
            "g": {"location": "fra", "gpus": [{"index": 0, "kind": "H100", "budget_bytes": 8}]},
            "c": {"location": "ams"},
        }
    )
    cpu, gpu = nodes  # sorted by id
    assert [(g.index, g.kind, g.budget_bytes) for g in gpu.gpus] == [(0, "H100", 8)]
    assert gpu.location == "fra"
    assert [(g.index, g.kind, g.budget_bytes) for g in cpu.gpus] == [(-1, "cpu", CPU_BUDGET)]


def test_replicas_is_the_autoscalers_minimum_and_max_replicas_its_maximum(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(
        '[[models]]\nname = "a"\npath = "/m"\nreplicas = 2\nmax_replicas = 5\n'
        '[[models]]\nname = "b"\npath = "/m"\n'
    )
    a, b = load_models(path)
    assert a.autoscale_config(AutoscaleConfig()).min_replicas == 2
    assert a.autoscale_config(AutoscaleConfig()).max_replicas == 5
    assert b.max_replicas is None  # the autoscaler's own bound
    assert b.autoscale_config(AutoscaleConfig(max_replicas=9)).max_replicas == 9
    path.write_text('[[models]]\nname = "a"\npath = "/m"\nreplicas = 3\nmax_replicas = 2\n')
    with pytest.raises(ValueError, match=r"models\[0\]: max_replicas 2 is below replicas 3"):
        load_models(path)


def test_a_node_runs_one_instance_of_a_model_and_a_second_moves_to_another_node():
    gpu = {"kind": "H100", "budget_bytes": 4 << 30}
    records = {
        "a": {"location": "fra", "gpus": [{"index": i, **gpu} for i in range(2)]},
        "b": {"location": "fra", "gpus": [{"index": 0, **gpu}]},
        "c": {"location": "ams", "gpus": [{"index": 0, **gpu}]},
    }
    nodes = cluster_nodes(records)
    specs = [ModelSpec("m", 3 << 30, replicas=3), ModelSpec("x", 1 << 30, replicas=1)]
    current = [Placement("m", 0, "a", 0), Placement("m", 1, "a", 1)]  # two on node a
    result = place(nodes, specs, current)
    placements, unplaced = one_per_node(nodes, specs, result, current)
    on = {(p.model, p.node) for p in placements}
    assert sorted(node for model, node in on if model == "m") == ["a", "b", "c"]
    assert len(placements) == len(on) == 4 and unplaced == []
    # The one that stays on a is the one that ran there first.
    assert Placement("m", 0, "a", 0) in placements
    # A fourth replica of m: every node runs one already, so it is unplaced, saying why.
    specs[0].replicas = 4
    result = place(nodes, specs, placements)
    placements, unplaced = one_per_node(nodes, specs, result, placements)
    assert sorted(p.node for p in placements if p.model == "m") == ["a", "b", "c"]
    assert [(u.model, "one instance per node" in u.reason) for u in unplaced] == [("m", True)]


def test_the_advertised_telemetry_address():
    assert parse_hostport("[::1]:7701", "--x") == ("::1", 7701)
    with pytest.raises(ValueError, match="--x 'nope': expected HOST:PORT"):
        parse_hostport("nope", "--x")
    assert join_hostport("::1", 7701) == "[::1]:7701"
    assert advertised_host("10.1.2.3", "127.0.0.1") == "10.1.2.3"  # a specific address
    assert advertised_host("0.0.0.0", "127.0.0.1")  # some address of this host


def test_a_nodes_record_carries_its_gpu_budgets_as_placement_reads_them():
    """omnid's announcement of a GPU node, read back by the scheduler's view of nodes."""
    import argparse

    from omni.runtime.catalog import NodeConfig
    from omni.runtime.omnid import node_record
    from scheduler.service import cluster_nodes

    args = argparse.Namespace(
        node_id="n1", location="fra", advertise_url=None, host="10.0.0.1", port=8081
    )
    record = node_record(args, NodeConfig(gpus={1: 40 << 30, 0: 20 << 30}))
    assert record["url"] == "http://10.0.0.1:8081"
    (node,) = cluster_nodes({"n1": record})
    assert node.location == "fra"
    assert [(g.index, g.budget_bytes) for g in node.gpus] == [(0, 20 << 30), (1, 40 << 30)]


def test_a_model_over_two_gpus_is_written_for_its_node_as_omnid_reads_it(tmp_path):
    """`gpus = 2` in the models file: one node's two GPUs, written as omnid's `gpu` list,
    which its catalog reads as two ranks (tensor_parallel = 2) on those GPUs."""
    from omni.runtime.omnid import entry_from_spec
    from omni.testing.checkpoints import tiny_llama
    from scheduler.service import _placement_of

    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "big"\npath = "/m"\nquota = "3GiB"\ngpus = 2\n')
    (big,) = load_models(path)
    assert big.spec.gpus == 2
    gpu = {"kind": "H100", "budget_bytes": 4 << 30}
    records = {
        n: {"gpus": [{"index": i, **gpu} for i in range(k)]} for n, k in [("a", 1), ("b", 2)]
    }
    nodes = cluster_nodes(records)
    result = place(nodes, [big.spec])
    placements, unplaced = one_per_node(nodes, [big.spec], result, [])
    assert unplaced == [] and [(p.node, p.gpus) for p in placements] == [("b", (0, 1))]
    written = {"path": str(tiny_llama(tmp_path / "tiny")), "gpu": [0, 1], "quota": 3 << 30}
    assert _placement_of("big", "b", written) == placements[0]
    placement = entry_from_spec("big", written, "cluster").placement
    assert (placement.gpus, placement.tensor_parallel, placement.quota_bytes) == (
        (0, 1),
        2,
        3 << 30,
    )
