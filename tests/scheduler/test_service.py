"""The scheduler's inputs: its models file and the nodes' announcements."""

from __future__ import annotations

import pytest

from scheduler.service import CPU_BUDGET, cluster_nodes, load_models


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
