"""Programmatic dependent launch (Hopper on): a kernel's programs are let in while the
kernel before it in the stream is still finishing, and wait on the device (griddepcontrol)
until it is done before they touch anything.

A small batch's decode step is some 600 short kernels under one CUDA graph, and without
it each one's start waits for the last one's tail: the gaps it closes were a few percent
of batch-1 decode of the Qwen3-30B-A3B shape on the H100.

The rule every kernel launched with it keeps: `wait_for_inputs` before it reads or writes
anything the kernel right before it writes, on every path through the kernel, and only then
let the next one in. A kernel done then means every kernel before it done too, and when a
kernel starts, all but the one right before it are done: what those wrote (and the step's
inputs, copied before its first kernel: positions, lengths, block tables) may be read
before the wait, and weights may be, or be asked into L2. Letting the next kernel in before
this one's own wait (so that chains of kernels sit waiting) was slower (228 tok/s), and so
was asking L2 for all of the linear layer's weights before the wait (243 tok/s): both take
the SMs and memory from the kernel that runs. OMNI_PDL=0 turns it off.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .hardware import capability

PDL_ENABLED = os.environ.get("OMNI_PDL", "1") != "0"


def pdl_options(device: torch.device) -> dict:
    """A kernel's launch options: its PDL flag, and the launch attribute where it is on."""
    if device.type == "cuda" and PDL_ENABLED and capability(device)[0] >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible, then let the
    next kernel's programs in (they wait in turn)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for these addresses' 128-byte lines in L2, and wait for nothing."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip
