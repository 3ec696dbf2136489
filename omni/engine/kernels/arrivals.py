"""The last program of a group to finish does the group's closing work in the same kernel
(a split decode's merge), where it was a kernel of its own.

A batch-1 decode step is hundreds of short kernels, and each start waits for the end of the
kernel before (with dependent launches too: `pdl.wait_for_inputs`), so a kernel fewer is a
wait fewer. Each group counts its finished programs in an int32 of a per-device buffer that
starts at zero; the program that brings the count to the group's size sets it back to zero
(for the next kernel, or the next replay of a CUDA graph) and goes on with every other
program's writes visible. Kernels of one device share the buffer: they run one after the
other on the engine's stream, and each counts only after its wait for the one before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_COUNTERS = 1 << 16  # 256 KiB: a decode step of 8,192 sequences over 8 KV heads
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, groups: int) -> torch.Tensor:
    """At least `groups` zeroed counters on `device`: made (or grown) on the first step
    that needs them, which is never inside a CUDA graph's capture (cuda_graphs.capture_graph
    runs each step once before it captures it)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < groups:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{groups} arrival counters first needed inside a capture")
        size = max(MIN_COUNTERS, triton.next_power_of_2(groups))
        counters = _COUNTERS[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counters


@triton.jit
def arrive_last(counter_ptr, group_size):
    """Whether this program is the last of its group's `group_size` to get here. Called by
    every program of the group once, after its writes; the last then sees them all if it
    reads them past L1 (`cache_modifier=".cg"`). Triton lets one thread do the atomic after
    a barrier of the program's threads and hands its result to all: the acquire-release
    at GPU scope orders every thread's writes before it."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == group_size - 1
    if last:
        tl.store(counter_ptr, 0)
    tl.debug_barrier()
    return last
