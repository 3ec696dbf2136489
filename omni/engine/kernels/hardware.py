"""Facts about the GPU that kernels size their launches by."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device: how many programs run at once."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability: asked once, not on every launch."""
    return torch.cuda.get_device_capability(device)
