"""The engine's error for a checkpoint it cannot serve (a leaf: the checkpoint reader,
the safetensors reader and every model file raise it)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file."""
