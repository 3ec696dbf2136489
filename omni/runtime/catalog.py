"""The node's model catalog: which models it serves and where their checkpoints are."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from omni.engine.checkpoint import Checkpoint
from omni.isolation.sandbox import Limits

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class CatalogError(ValueError):
    """A catalog entry or config that cannot be used; the message says which and why."""


DEFAULT_LIMITS = Limits(memory_bytes=8 << 30, pids=512)
SIZE_UNITS = {
    "": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
}
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value) -> int:
    """Bytes from an integer or a string such as '4GiB' or '512M'."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str) and (m := SIZE_RE.match(value)):
        unit = SIZE_UNITS.get(m.group(2).lower())
        if unit is not None and float(m.group(1)) > 0:
            return int(float(m.group(1)) * unit)
    raise ValueError(f"{value!r} is not a size (e.g. 4GiB, 512MiB or a byte count)")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    kind: str  # "generate" | "embed"
    origin: str  # "default" | "config" | "admin"
    limits: Limits = DEFAULT_LIMITS

    @classmethod
    def from_path(
        cls, name: str, path: str | Path, origin: str, limits: Limits = DEFAULT_LIMITS
    ) -> ModelEntry:
        """Validate the name and the checkpoint now, so a bad entry never reaches an instance."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise CatalogError(
                f"model name {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
            )
        ckpt = Checkpoint.open(Path(path).resolve())  # CheckpointError names the file
        return cls(name, ckpt.path, ckpt.kind, origin, limits)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "kind": self.kind,
            "origin": self.origin,
            "memory_bytes": self.limits.memory_bytes,
            "cpus": self.limits.cpu_cores,
            "pids": self.limits.pids,
        }


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: str
    limits: Limits = DEFAULT_LIMITS


@dataclass(frozen=True)
class NodeConfig:
    default_models: bool
    models: list[ModelConfig]


MODEL_KEYS = {"name", "path", "memory", "cpus", "pids"}


def _limits(item: dict, where: str) -> Limits:
    memory, cpus, pids = DEFAULT_LIMITS.memory_bytes, None, DEFAULT_LIMITS.pids
    if "memory" in item:
        try:
            memory = parse_size(item["memory"])
        except ValueError as exc:
            raise CatalogError(f"{where}.memory: {exc}") from None
    if "cpus" in item:
        cpus = item["cpus"]
        if isinstance(cpus, bool) or not isinstance(cpus, int | float) or cpus <= 0:
            raise CatalogError(f"{where}.cpus: must be a positive number of cores")
        cpus = float(cpus)
    if "pids" in item:
        pids = item["pids"]
        if isinstance(pids, bool) or not isinstance(pids, int) or pids < 8:
            raise CatalogError(f"{where}.pids: must be an integer of at least 8")
    return Limits(memory_bytes=memory, cpu_cores=cpus, pids=pids)


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
    out: list[ModelConfig] = []
    for i, item in enumerate(models):
        where = f"{path}: models[{i}]"
        if not isinstance(item, dict):
            raise CatalogError(f"{where}: must be a table")
        extra = set(item) - MODEL_KEYS
        if extra:
            raise CatalogError(f"{where}: unknown key {sorted(extra)[0]!r}")
        for key in ("name", "path"):
            if not isinstance(item.get(key), str):
                raise CatalogError(f"{where}.{key}: required string")
        if any(m.name == item["name"] for m in out):
            raise CatalogError(f"{where}.name: {item['name']!r} is already listed")
        out.append(ModelConfig(item["name"], item["path"], _limits(item, where)))
    return NodeConfig(defaults, out)
