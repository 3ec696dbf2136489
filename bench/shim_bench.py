"""libomnicuda on a real GPU: swap bandwidth, allocation overhead, managed-memory slowdown.

Each configuration runs in its own process (the shim is loaded with LD_PRELOAD):
  swap    swap-out / swap-in of 1 and 4 GiB of PyTorch tensors (GB/s, timed by the shim)
  alloc   cudaMalloc+cudaFree pairs: no shim, shim passthrough, shim managed
  gemm    bf16 8192^3 matmul: plain memory vs managed memory
  decode  batch-1 decode of a 1.1B-parameter Llama shape (random bf16) on our engine:
          plain vs managed memory
Safety: sizes are checked against the card's free memory; the largest process
asks for under 8 GiB, far below half of what an H100 has free.
Writes bench/results/shim-<name>.json (default name: h100).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 1 << 30
CHILD_QUOTA = 8 * GiB


# ------------------------------------------------------------------ children


def cudart() -> ctypes.CDLL:
    """The libcudart that torch loaded (so calls go where torch's do)."""
    import torch

    torch.cuda.init()
    maps = Path("/proc/self/maps").read_text().splitlines()
    for line in maps:
        if "libcudart" in line:
            return ctypes.CDLL(line.split()[-1])
    raise RuntimeError("libcudart not loaded")


def child_alloc() -> dict:
    rt = cudart()
    ptr = ctypes.c_void_p()
    size = ctypes.c_size_t(1 << 20)
    for _ in range(200):  # warm up
        rt.cudaMalloc(ctypes.byref(ptr), size)
        rt.cudaFree(ptr)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            assert rt.cudaMalloc(ctypes.byref(ptr), size) == 0
            rt.cudaFree(ptr)
        samples.append((time.perf_counter() - t0) / 2000 * 1e6)
    return {"us_per_pair": samples}


def child_gemm() -> dict:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            a @ b
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 20)
    return {"ms_per_gemm": samples, "tflops": 2 * 8192**3 / (min(samples) / 1e3) / 1e12}


def child_decode() -> dict:
    import torch

    from omni.engine.llama import LlamaConfig
    from omni.engine.model_runner import ModelRunner, SoloSequence
    from omni.testing.checkpoints import random_llama

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        head_dim=64,
        rope_theta=10000.0,
        max_position=2048,
    )
    model = random_llama(cfg)
    runner = ModelRunner(model, num_blocks=64)
    samples = []
    for _ in range(4):
        solo = SoloSequence(runner)
        logits = solo.extend(list(range(16)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(128):
            logits = solo.extend([int(logits.argmax())])
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / 128 * 1e3)
    return {"ms_per_token": samples[1:]}  # the first round warms up


def child_swap(size: int) -> None:
    """Hold `size` bytes of tensors; the parent swaps them; report their checksum."""
    import torch

    x = torch.ones(size // 2, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    intact = not bool((x != 1).any().item())  # compared in place: a copy might not fit
    print(json.dumps({"intact": intact}), flush=True)


# -------------------------------------------------------------------- parent


def run_child(kind: str, shim: str | None, tmp: Path, extra: list[str] | None = None):
    from omni.cudashim import ControlBlock, Mode, instance_env

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    block = None
    if shim:
        block = ControlBlock.create(
            tmp / f"ctl-{kind}-{shim}",
            CHILD_QUOTA,
            Mode.MANAGED if shim == "managed" else Mode.PASSTHROUGH,
        )
        env.update(instance_env(block.path))
    argv = [sys.executable, __file__, "--child", kind, *(extra or [])]
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ), block


def measure(kind: str, shim: str | None, tmp: Path) -> dict:
    proc, _ = run_child(kind, shim, tmp)
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} ({shim}) failed")
    return json.loads(out.strip().splitlines()[-1])


def measure_swap(size: int, tmp: Path, rounds: int = 3) -> dict:
    from omni.cudashim import swap_in, swap_out

    proc, block = run_child("swap", "managed", tmp, ["--size", str(size)])
    assert json.loads(proc.stdout.readline())["ready"]
    result: dict = {"bytes": size, "out_s": [], "in_s": [], "out_wall_s": [], "in_wall_s": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = swap_out(block, timeout_s=120)
        t1 = time.perf_counter()
        back = swap_in(block, timeout_s=120)
        t2 = time.perf_counter()
        result["out_s"].append(out.seconds)
        result["in_s"].append(back.seconds)
        result["out_wall_s"].append(t1 - t0)
        result["in_wall_s"].append(t2 - t1)
        result["moved_bytes"] = out.bytes
    proc.stdin.write("done\n")
    proc.stdin.flush()
    result["data_intact"] = json.loads(proc.stdout.readline())["intact"]
    proc.wait(60)
    return result


def check_safety() -> int:
    import pynvml

    pynvml.nvmlInit()
    free = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free
    if free // 2 < CHILD_QUOTA:
        raise SystemExit(f"only {free / GiB:.1f} GiB free: refusing to run")
    return free


def main(name: str) -> None:
    from bench.results_io import write_result

    free = check_safety()
    tmp = Path(tempfile.mkdtemp(prefix="omni-shim-bench-"))
    raw: dict = {"free_bytes_at_start": free}
    raw["swap"] = {f"{s // GiB}GiB": measure_swap(s, tmp) for s in (GiB, 4 * GiB)}
    raw["alloc"] = {m or "none": measure("alloc", m, tmp) for m in (None, "passthrough", "managed")}
    raw["gemm"] = {m or "none": measure("gemm", m, tmp) for m in (None, "managed")}
    raw["decode"] = {m or "none": measure("decode", m, tmp) for m in (None, "managed")}

    med = statistics.median
    summary = {}
    for label, r in raw["swap"].items():
        summary[f"swap_out_{label}_GBps"] = r["moved_bytes"] / med(r["out_s"]) / 1e9
        summary[f"swap_in_{label}_GBps"] = r["moved_bytes"] / med(r["in_s"]) / 1e9
        summary[f"swap_{label}_data_intact"] = r["data_intact"]
    base = med(raw["alloc"]["none"]["us_per_pair"])
    for m in ("passthrough", "managed"):
        summary[f"alloc_overhead_{m}_us"] = med(raw["alloc"][m]["us_per_pair"]) - base
    summary["alloc_none_us"] = base
    g0, g1 = (min(raw["gemm"][m]["ms_per_gemm"]) for m in ("none", "managed"))
    summary["gemm_slowdown_pct"] = (g1 / g0 - 1) * 100
    d0, d1 = (med(raw["decode"][m]["ms_per_token"]) for m in ("none", "managed"))
    summary["decode_slowdown_pct"] = (d1 / d0 - 1) * 100
    summary["decode_ms_per_token_plain"], summary["decode_ms_per_token_managed"] = d0, d1

    print(f"{'measure':<36}{'value':>14}")
    for key, value in summary.items():
        print(f"{key:<36}{value:>14.3f}" if isinstance(value, float) else f"{key:<36}{value!s:>14}")
    path = write_result(
        f"shim-{name}",
        {"raw": raw, "summary": summary, "target": "GEMM and decode slowdown under 3%"},
    )
    print("wrote", path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", choices=["alloc", "gemm", "decode", "swap"])
    parser.add_argument("--size", type=int, default=GiB)
    parser.add_argument("--name", default="h100")
    args = parser.parse_args()
    if args.child == "swap":
        child_swap(args.size)
    elif args.child:
        print(
            json.dumps(
                {"alloc": child_alloc, "gemm": child_gemm, "decode": child_decode}[args.child]()
            ),
            flush=True,
        )
    else:
        main(args.name)
