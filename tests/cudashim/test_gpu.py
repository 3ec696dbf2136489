"""libomnicuda under PyTorch on a real GPU (device machine only).

Safety: every size comes from the card's real free memory, and everything
these tests allocate stays far below half of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni.cudashim import ControlBlock, Mode, ShimResidency, instance_env, swap_in, swap_out

pytestmark = pytest.mark.gpu

CHILD = Path(__file__).with_name("torch_child.py")
REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30


@pytest.fixture(scope="module")
def quota() -> int:
    import pynvml

    pynvml.nvmlInit()
    free = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free
    # at most 2 GiB, and a small fraction of what is free
    return min(2 * GiB, free // 16) // (1 << 20) * (1 << 20)


@contextlib.contextmanager
def child(
    tmp_path: Path, scenario: str, quota: int, mode: Mode
) -> Iterator[tuple[subprocess.Popen, ControlBlock]]:
    """The scenario's process under the shim, and its control block; on leaving, its
    stdin closed (a scenario waiting for the parent ends), and it must have exited 0."""
    block = ControlBlock.create(tmp_path / f"control-{scenario}-{mode.name}", quota, mode)
    env = {
        **os.environ,
        **instance_env(block.path),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), scenario, str(quota)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc, block
    finally:
        proc.stdin.close()
        proc.wait(60)
    assert proc.returncode == 0, proc.stderr.read()


def read(proc) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"child ended: {proc.stderr.read()}")
    return json.loads(line)


def step(proc) -> dict:
    """Let the child go on past where it waits for the parent, and read its next report."""
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return read(proc)


@pytest.mark.parametrize("mode", [Mode.MANAGED, Mode.PASSTHROUGH])
def test_pytorch_runs_correctly_within_its_quota(tmp_path, quota, mode):
    with child(tmp_path, "basics", quota, mode) as (proc, block):
        r = read(proc)
    stats = block.stats()
    assert r["gemm_err"] < 1e-1 and r["llama_err"] < 1e-3, r  # TF32 GEMM; fp32 model
    assert r["total"] == quota and r["free"] <= quota, r  # torch.cuda.mem_get_info
    assert r["free_with_x"] <= quota - quota // 4, r
    assert r["oom"] == "OutOfMemoryError", r  # past the quota, cleanly
    assert r["after_oom_ok"] is True, r  # and it keeps working once memory is freed
    assert r["nvml_total"] == quota, r  # NVML inside the instance shows the quota too
    assert stats["alloc_failures"] >= 1, stats


def test_swap_moves_the_memory_off_the_gpu_and_back(tmp_path, quota):
    """What the GPU itself observes. (NVML is no witness here: on this driver it does
    not attribute unified memory to the process, and UVM keeps its freed GPU chunks
    counted as used until another allocation needs them.)"""
    with child(tmp_path, "swap", quota, Mode.MANAGED) as (proc, block):
        ready = read(proc)
        out = swap_out(block, timeout_s=60)
        back = swap_in(block, timeout_s=60)
        noop = swap_in(block, timeout_s=60)  # already on the GPU: nothing to move
        r = step(proc)
        swap_out(block, timeout_s=60)
        swap_in(block, timeout_s=60)
        rewritten = step(proc)
        swap_out(block, timeout_s=60)
        swapped = step(proc)
    assert out.residency == ShimResidency.HOST and back.residency == ShimResidency.GPU
    assert out.bytes >= ready["bytes"]
    # Moving it costs bus time (no faster than 100 GB/s); a move to where it is, little.
    assert min(out.seconds, back.seconds) > ready["bytes"] / 100e9, (out, back)
    assert noop.seconds < min(out.seconds, back.seconds) / 3, (noop, out, back)
    # Swapped out, the GPU must fault every page back over the bus to read it.
    assert swapped["read_swapped_s"] > 5 * r["read_resident_s"], (swapped, r)
    assert r["checksum"] == ready["checksum"]  # the same data after the round trip
    # ... and what was written after it (pages whose host copy went stale) too
    assert rewritten["checksum"] == r["written"] != r["checksum"]
    # memory declared read-only (its host copy kept across the moves) is intact too
    assert ready["declared"] > 0 and rewritten["ro"] == ready["ro"]
    assert r["gemm_err"] < 1e-1 and r["llama_err"] < 1e-3


def test_an_engine_s_kv_pool_is_released_at_a_swap_out_not_copied(tmp_path, quota):
    """The KV cache comes from the shim's pool: the whole of it counts against the quota,
    but memory backs only the blocks the requests took; a swap-out releases that memory
    (nothing copied) once the idle engine has left the pool, and after the swap-in the
    engine backs what it takes again and answers as before, its cached prefixes
    forgotten (their K/V are gone)."""
    with child(tmp_path, "engine", quota, Mode.MANAGED) as (proc, block):
        ready = read(proc)
        before = block.stats()
        out = swap_out(block, timeout_s=60)
        between = block.stats()
        back = swap_in(block, timeout_s=60)
        r = step(proc)
        after = block.stats()
    assert ready["pool"] and before["pool_bytes"] >= ready["pool_bytes"] > quota / 2
    # two prompts of 64 tokens take a few blocks: one step of the pool's backing
    assert 0 < before["pool_mapped_bytes"] < before["pool_bytes"] / 4, before
    assert out.bytes <= before["used_bytes"] - before["pool_mapped_bytes"], (out, before)
    assert between["pool_mapped_bytes"] == 0
    assert between["used_bytes"] == before["used_bytes"] - before["pool_mapped_bytes"]
    assert after["pool_mapped_bytes"] == before["pool_mapped_bytes"]  # backed again
    assert back.bytes == out.bytes
    first = ready["first"]
    assert first["cached"] == [0, 0] and ready["again"]["cached"] == [32, 32]
    assert ready["again"]["tokens"] == first["tokens"]
    assert r["epoch"] == 1 and r["after"]["cached"] == [0, 0]  # nothing stale reused
    assert r["after"]["tokens"] == first["tokens"]
    assert r["again"]["cached"] == [32, 32] and r["again"]["tokens"] == first["tokens"]


def test_a_handler_s_weights_keep_their_host_copy_and_answer_the_same_after_a_swap(tmp_path, quota):
    """The worker declares a handler's weights (Handler.weights(): its model's parameters
    and buffers) read-only after load(): their whole pages are declared. Its trim before
    a swap-out frees the allocator's cache, and the shim counts that memory gone. The
    model answers the same after its memory went to the host and back."""
    with child(tmp_path, "handler", quota, Mode.MANAGED) as (proc, block):
        ready = read(proc)
        held = block.stats()["used_bytes"]
        trimmed = step(proc)
        left = block.stats()["used_bytes"]
        out = swap_out(block, timeout_s=60)
        back = swap_in(block, timeout_s=60)
        after = step(proc)
    assert out.residency == ShimResidency.HOST and back.residency == ShimResidency.GPU
    # whole 2 MiB pages of ViT-base-wide layers: most of the weights' bytes
    assert ready["declared"] >= 0.7 * ready["weight_bytes"], ready
    assert trimmed["freed"] > 0 and left <= held - trimmed["freed"], (held, left, trimmed)
    assert after["scores"] == ready["scores"]
