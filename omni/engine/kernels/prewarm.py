"""Triton's per-process set-up, started in a thread while the weights are read.

The first kernel a process compiles or loads from Triton's disk cache pays for set-up
that has nothing to do with the kernel: hashing Triton's own sources and its library
into the cache key, importing its compiler front ends. On the lent H100 host the cold
start's first step took 0.74 s before this (and before byte-compiled imports) and 0.11 s
after both (bench/coldstart_probe.py; bench/results/engine-h100.json at d94c88e and
fe5f7fd).
Running one tiny kernel's lookup in a thread takes it off the first request's path:
the hashing releases the GIL, so it overlaps the checkpoint's reads.
"""

from __future__ import annotations

import logging
import threading

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)


@triton.jit
def _copy_one(src_ptr, dst_ptr):
    tl.store(dst_ptr, tl.load(src_ptr))


def _lookup() -> None:
    try:  # compiled once per host, then found in Triton's cache like any other kernel
        _copy_one.warmup(torch.float32, torch.float32, grid=(1,))
    except Exception:  # only a head start: the first real kernel does the same work
        log.debug("Triton prewarm failed", exc_info=True)


def prewarm_triton() -> threading.Thread:
    """Start Triton's set-up in a daemon thread; join it before the first step (joining
    is optional: a kernel launched meanwhile only repeats part of the work)."""
    thread = threading.Thread(target=_lookup, name="omni-triton-prewarm", daemon=True)
    thread.start()
    return thread
