"""How much one process's swap slows another process's GPU steps, and through which path.

A "hot" process runs decode-like steps (a chain of bf16 matmuls over ~0.4 GiB of
weights at batch 8, one small host-to-device copy and one sync each) and times
every step, alone and while a second process moves 2 GiB between GPU and host:
- uvm: the second process runs under libomnicuda and is swapped out and in
  (cudaMemPrefetchAsync of unified memory), as omnid swaps an idle instance;
- copy: the second process copies a plain 2 GiB device buffer to pinned host
  memory and back (cudaMemcpy over the copy engines), no unified memory at all.
The hot process runs with plain device memory and again under the shim (its own
memory unified, never moved), as omnid runs every instance. Writes
bench/results/swap-interference-<name>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 1 << 30
MOVE_BYTES = 2 * GIB


def hot_role(seconds: float) -> None:
    """Time decode-like steps for `seconds`; print their durations (s) as one JSON line."""
    import torch

    layers = [torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(48)]
    x0 = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(8)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # go
    times, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        x = x0 + ids.to("cuda", non_blocking=True)[:, None]
        for w in layers:
            x = (x @ w.T)[:, :1024] * 0.01
        x.sum().item()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times}), flush=True)


def mover_role(kind: str) -> None:
    """Hold 2 GiB on the GPU; `copy` also moves it to host and back until stdin closes."""
    import threading

    import torch

    buf = torch.ones(MOVE_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print(json.dumps({"ready": True}), flush=True)
    if kind == "uvm":  # omnid's side moves it, through the control block
        sys.stdin.read()
        return
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        host.copy_(buf)
        buf.copy_(host)
        torch.cuda.synchronize()


def spawn(role: str, arg: str, block_path: Path | None):
    from omni.cudashim import instance_env

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if block_path is not None:
        env.update(instance_env(block_path))
    argv = [sys.executable, __file__, "--role", role, "--arg", arg]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{role} child failed to start ({proc.wait()})")
    return proc


def percentile(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def scenario(hot_managed: bool, mover: str, seconds: float, tmp: Path) -> dict:
    from omni.cudashim import ControlBlock, Mode, swap_in, swap_out

    blocks = []

    def block(name: str) -> Path:
        b = ControlBlock.create(tmp / f"{name}-{len(blocks)}", 8 * GIB, Mode.MANAGED)
        blocks.append(b)
        return b.path

    hot = spawn("hot", str(seconds), block("hot") if hot_managed else None)
    other, swaps = None, []
    if mover != "none":
        other = spawn("mover", mover, block("mover") if mover == "uvm" else None)
    hot.stdin.write("go\n")
    hot.stdin.flush()
    if mover == "uvm":
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            swaps.append(swap_out(blocks[-1], 30).seconds)
            swaps.append(swap_in(blocks[-1], 30).seconds)
    times = json.loads(hot.stdout.readline())["times"]
    for p in (hot, other):
        if p is not None:
            p.stdin.close()
            p.wait(60)
    for b in blocks:
        b.close()
    return {
        "hot_memory": "unified (shim)" if hot_managed else "device",
        "mover": mover,
        "steps": len(times),
        "step_p50_ms": percentile(times, 50) * 1e3,
        "step_p99_ms": percentile(times, 99) * 1e3,
        "step_max_ms": max(times) * 1e3,
        "swap_mean_ms": sum(swaps) / len(swaps) * 1e3 if swaps else None,
        "swaps": len(swaps),
        "times_ms": [round(t * 1e3, 4) for t in times],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", default="h100")
    ap.add_argument("--seconds", type=float, default=6.0, help="per scenario")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--arg", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "hot":
        return hot_role(float(args.arg))
    if args.role == "mover":
        return mover_role(args.arg)

    from bench.results_io import write_result

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for hot_managed in (False, True):
            for mover in ("none", "uvm", "copy"):
                runs.append(scenario(hot_managed, mover, args.seconds, Path(tmp)))
                r = runs[-1]
                print(
                    f"hot {r['hot_memory']:15} mover {mover:5} steps {r['steps']:6} "
                    f"p50 {r['step_p50_ms']:.3f} ms  p99 {r['step_p99_ms']:.3f} ms  "
                    f"max {r['step_max_ms']:.1f} ms  swaps {r['swaps']}",
                    flush=True,
                )
    print("wrote", write_result(f"swap-interference-{args.name}", {"runs": runs}))


if __name__ == "__main__":
    main()
