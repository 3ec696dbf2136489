"""Telling libomnicuda which GPU memory is never written again (a model's weights).

The shim keeps the host copy of such memory across swaps: a swap-out drops the GPU
copy instead of copying it back (native/omnicuda/swap.c, move_all). Only whole
2 MiB pages inside a tensor are declared: a page a weight shares with memory that is
written (a small tensor beside it, an activation later) would fault on every write.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a handler's worker imports this without torch)
    import torch

log = logging.getLogger(__name__)

PAGE = 2 << 20


def page_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """(start, size) of the whole pages the GPU tensors cover, merged."""
    spans = sorted(
        {(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.is_cuda}
    )
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out = []
    for start, end in merged:
        first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        if last > first:
            out.append((first, last - first))
    return out


def declare_read_only(tensors: Iterable[torch.Tensor]) -> int:
    """Declare the tensors' whole pages read-only to the shim, if it is loaded (and log
    how much); returns the bytes declared (0 without the shim)."""
    declare = getattr(ctypes.CDLL(None), "omni_read_only", None)
    if declare is None:
        return 0
    declare.argtypes, declare.restype = [ctypes.c_uint64, ctypes.c_uint64], ctypes.c_int
    total = 0
    for start, size in page_ranges(tensors):
        if declare(start, size) != 0:
            break  # the shim's table is full: the rest moves as any memory does
        total += size
    if total:
        log.info("%.2f GiB of weights declared read-only", total / 2**30)
    return total
