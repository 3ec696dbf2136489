"""omni-model.toml: where a runtime takes its weights from."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni.runtimes.model_config import CONFIG_NAME, read_model_config, weights_from_package


def test_a_directory_without_settings_holds_its_own_weights(tmp_path: Path):
    assert read_model_config(tmp_path) == {}
    assert not weights_from_package(tmp_path)


def test_package_weights_and_other_keys_are_read(tmp_path: Path):
    (tmp_path / CONFIG_NAME).write_text('weights = "package"\nthreshold = 0.6\n')
    assert weights_from_package(tmp_path)
    assert read_model_config(tmp_path)["threshold"] == 0.6


def test_an_unknown_weight_source_is_refused(tmp_path: Path):
    (tmp_path / CONFIG_NAME).write_text('weights = "hub"\n')
    with pytest.raises(ValueError, match="hub"):
        read_model_config(tmp_path)
