"""Load a local HF-format checkpoint directory: config, safetensors shards, tokenizer.

Every model OMNI serves, the embedded defaults included, comes through here, so
errors name the file and the problem instead of failing deep inside a model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CheckpointError

if TYPE_CHECKING:  # torch loads with the tensors: omnid reads checkpoints without it
    import torch

CAUSAL_LM_SUFFIX = "ForCausalLM"
ENCODER_ARCHITECTURES = {"BertModel", "BertForMaskedLM"}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint directory."""

    path: Path
    config: dict

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory")
        config = _read_json(path / "config.json")
        ckpt = cls(path, config)
        ckpt.shard_files()  # fail now, not at first request
        if not (path / "tokenizer.json").is_file():
            raise CheckpointError(f"{path / 'tokenizer.json'}: missing")
        ckpt.kind  # noqa: B018 - validates the architecture
        return ckpt

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        if not archs:
            raise CheckpointError(f"{self.path / 'config.json'}: no 'architectures' entry")
        return archs[0]

    @property
    def kind(self) -> str:
        """'generate' for causal LMs, 'embed' for encoders."""
        arch = self.architecture
        if arch.endswith(CAUSAL_LM_SUFFIX):
            return "generate"
        if arch in ENCODER_ARCHITECTURES:
            return "embed"
        raise CheckpointError(f"{self.path / 'config.json'}: architecture {arch!r} not supported")

    def json(self, name: str, required: bool = False) -> dict:
        path = self.path / name
        if not path.exists() and not required:
            return {}
        return _read_json(path)

    def shard_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: no 'weight_map'")
            files = [self.path / name for name in sorted(set(weight_map.values()))]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: missing (listed in the shard index)")
        return files

    def load_tensors(
        self,
        device: torch.device | str,
        dtype: torch.dtype,
        together: Sequence[Sequence[str]] = (),
    ) -> dict[str, torch.Tensor]:
        """All tensors on `device`, floating ones cast to `dtype`: through pinned chunked
        reads on CUDA, memory-mapped elsewhere (see safetensors_reader); each group in
        `together` back to back in one allocation."""
        from . import safetensors_reader  # (with torch: not at import, for omnid's sake)

        return safetensors_reader.load_tensors(self.shard_files(), device, dtype, together)
