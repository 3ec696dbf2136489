"""Catalog entries from a spec: the config's keys, by name, as the admin API's load, the
persisted catalog and the scheduler's placements give them. Its own module: omnid and
its admin routes both make entries from specs.
"""

from __future__ import annotations

from omni.model_spec import HANDLER_KEYS

from .catalog import (
    CatalogError,
    ModelEntry,
    handler_from,
    limits_from,
    placement_from,
    tool_parser_from,
)

SPEC_KEYS = {
    "path",
    "gpu",
    "quota",
    "permits",
    "cold",
    "memory",
    "cpus",
    "pids",
    "tmp",
    "io",
    "drain",
    "version",
    "tool_parser",
    "tensor_parallel",
    "parallel",
    "quantization",
    "kv_cache_dtype",
    "speculative",
    "kv_host_cache",
    "kv_disk_cache",
    "runtime",
    *HANDLER_KEYS,
}


def entry_from_spec(name, spec: dict, origin: str = "admin") -> ModelEntry:
    """A catalog entry from an admin request's fields (the config's keys, by name)."""
    extra = set(spec) - SPEC_KEYS - {"name"}
    if extra:
        raise CatalogError(f"unknown parameter {sorted(extra)[0]!r}")
    path = spec.get("path")
    if not isinstance(path, str) or not path:
        raise CatalogError("'path' is required")
    version = spec.get("version", "")
    if not isinstance(version, str) or len(version) > 64:
        raise CatalogError("'version' must be a string of at most 64 characters")
    limits = limits_from(spec, "model")
    placement = placement_from(spec, "model", None)
    if "model" in dict(placement.speculative):
        raise CatalogError(
            "speculative.model: names a draft among the config's [[models]]; here, give "
            "the draft checkpoint's 'path'"
        )
    tool_parser = tool_parser_from(spec, "model")
    handler = handler_from(spec, "model")
    return ModelEntry.from_path(
        name, path, origin, limits, placement, version, tool_parser, handler
    )
