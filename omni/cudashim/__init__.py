"""Python side of libomnicuda.so, the LD_PRELOAD CUDA allocation shim.

omnid builds the library (`build.library_path`), creates one control block per
instance (`ControlBlock.create`), starts the instance with `instance_env`, and
moves its memory with `swap_out` / `swap_in`.
"""

from __future__ import annotations

from pathlib import Path

from .build import ShimBuildError, library_path
from .control import ControlBlock, Mode, ShimResidency, SwapError, SwapResult

__all__ = [
    "ControlBlock",
    "Mode",
    "ShimBuildError",
    "ShimResidency",
    "SwapError",
    "SwapResult",
    "instance_env",
    "library_path",
    "swap_in",
    "swap_out",
]

DEFAULT_SWAP_TIMEOUT_S = 60.0


def instance_env(control: Path, library: Path | None = None) -> dict[str, str]:
    """Environment that puts a process under the shim, tied to its control block."""
    return {"LD_PRELOAD": str(library or library_path()), "OMNI_CUDA_CONTROL": str(control)}


def swap_out(block: ControlBlock, timeout_s: float = DEFAULT_SWAP_TIMEOUT_S) -> SwapResult:
    """Move all of an instance's GPU memory to host memory."""
    return block.move(ShimResidency.HOST, timeout_s)


def swap_in(block: ControlBlock, timeout_s: float = DEFAULT_SWAP_TIMEOUT_S) -> SwapResult:
    """Bring an instance's memory back to its GPU."""
    return block.move(ShimResidency.GPU, timeout_s)
