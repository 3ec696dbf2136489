"""The node's model catalog: which models it serves and where their checkpoints are."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from omni.engine.checkpoint import Checkpoint

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class CatalogError(ValueError):
    """A catalog entry or config that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    kind: str  # "generate" | "embed"
    origin: str  # "default" | "config" | "admin"

    @classmethod
    def from_path(cls, name: str, path: str | Path, origin: str) -> ModelEntry:
        """Validate the name and the checkpoint now, so a bad entry never reaches an instance."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise CatalogError(
                f"model name {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
            )
        ckpt = Checkpoint.open(Path(path).resolve())  # CheckpointError names the file
        return cls(name, ckpt.path, ckpt.kind, origin)

    def to_json(self) -> dict:
        return {"name": self.name, "path": str(self.path), "kind": self.kind, "origin": self.origin}


@dataclass(frozen=True)
class NodeConfig:
    default_models: bool
    models: list[tuple[str, str]]  # (name, path)


def load_config(path: Path) -> NodeConfig:
    """Read omnid's TOML config; errors name the key and the problem."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"{path}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{path}: invalid TOML ({exc})") from None
    unknown = set(data) - {"default_models", "models"}
    if unknown:
        raise CatalogError(f"{path}: unknown key {sorted(unknown)[0]!r}")
    defaults = data.get("default_models", True)
    if not isinstance(defaults, bool):
        raise CatalogError(f"{path}: 'default_models' must be true or false")
    models = data.get("models", [])
    if not isinstance(models, list):
        raise CatalogError(f"{path}: 'models' must be an array of tables ([[models]])")
    out = []
    for i, item in enumerate(models):
        where = f"{path}: models[{i}]"
        if not isinstance(item, dict):
            raise CatalogError(f"{where}: must be a table")
        extra = set(item) - {"name", "path"}
        if extra:
            raise CatalogError(f"{where}: unknown key {sorted(extra)[0]!r}")
        for key in ("name", "path"):
            if not isinstance(item.get(key), str):
                raise CatalogError(f"{where}.{key}: required string")
        if any(item["name"] == name for name, _ in out):
            raise CatalogError(f"{where}.name: {item['name']!r} is already listed")
        out.append((item["name"], item["path"]))
    return NodeConfig(defaults, out)
