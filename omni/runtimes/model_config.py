"""The small settings file a model directory may hold: `omni-model.toml`.

Its one key that every runtime reads is `weights`: "directory" (the default: the weights
are files in the model directory) or "package" (the weights the runtime's PyPI package
ships, so a model needs no files of its own). A runtime may read more keys; its module
docstring lists them.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

CONFIG_NAME = "omni-model.toml"
WEIGHT_SOURCES = ("directory", "package")
GPU_DTYPES = ("float32", "float16", "bfloat16")


def read_model_config(model_dir: Path) -> dict:
    """The directory's settings, or an empty table where it has no settings file."""
    path = Path(model_dir) / CONFIG_NAME
    if not path.is_file():
        return {}
    with path.open("rb") as f:
        config = tomllib.load(f)
    source = config.get("weights", "directory")
    if source not in WEIGHT_SOURCES:
        raise ValueError(f"{path}: weights = {source!r}, expected one of {WEIGHT_SOURCES}")
    return config


def weights_from_package(model_dir: Path) -> bool:
    """Whether the model uses the weights its runtime's package ships."""
    return read_model_config(model_dir).get("weights", "directory") == "package"


def gpu_dtype(model_dir: Path, device: str) -> str:
    """The torch dtype (its name) a runtime that reads `gpu_dtype` runs its model in:
    that key's value on a GPU ("float32", the default, "float16" or "bfloat16": half
    precision halves the weights and the activations a batch holds, which is what the
    model costs the node's GPU budget), float32 on the CPU, whose half kernels are slow."""
    name = read_model_config(model_dir).get("gpu_dtype", "float32")
    if name not in GPU_DTYPES:
        where = Path(model_dir) / CONFIG_NAME
        raise ValueError(f"{where}: gpu_dtype = {name!r}, expected one of {GPU_DTYPES}")
    return name if device.startswith("cuda") else "float32"
