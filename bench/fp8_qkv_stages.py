"""FP8 fused q/k/v at few rows (Llama-3-8B: 6,144 x 4,096): 3 pipeline stages (before
89c6dc3) against 8 (fp8_tiles now), the weights rotated over copies past the H100's
50 MB L2 so they come from HBM as in a decode step; the two outputs' bits compared.
Prints a line per row count and writes bench/results/fp8-qkv-stages-<gpu>.json."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import device_tag
from bench.results_io import write_result
from omni.engine.fp8 import quantize_weight
from omni.engine.kernels import w8a8

N, K = 6144, 4096
REPS = 40  # launches per CUDA graph; each replay's time over REPS is one figure


def per_launch_us(fn) -> list[float]:
    """µs per launch over 5 replays of a graph of REPS launches."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / REPS)
    return times


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = int(200e6 // (N * K)) + 1
    weights = [
        quantize_weight((torch.randn(N, K, generator=gen, device="cuda") * K**-0.5).bfloat16())
        for _ in range(copies)
    ]
    rows = {}
    for m in (1, 4, 16):
        xq, xs = w8a8.quantize_rows(torch.randn(m, K, generator=gen, device="cuda").bfloat16())
        out = torch.empty(m, N, dtype=torch.bfloat16, device="cuda")
        times, bits = {}, {}
        for stages in (3, 8):
            cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=stages)
            turn = iter(range(1 << 30))

            def launch(cfg=cfg, turn=turn, out=out, xq=xq, xs=xs):
                wq, ws = weights[next(turn) % copies]
                w8a8.launch_fp8_linear(xq, xs, wq, ws, None, out, cfg)

            times[stages] = per_launch_us(launch)
            w8a8.launch_fp8_linear(xq, xs, *weights[0], None, out, cfg)
            bits[stages] = out.clone()
        same = torch.equal(bits[3], bits[8])
        rows[m] = {"us_3_stages": times[3], "us_8_stages": times[8], "same_bits": same}
        print(f"{m:>3} rows: 3 stages {min(times[3]):.1f} us, 8 stages {min(times[8]):.1f} us, "
              f"same bits {same}")  # fmt: skip
    data = {"shape": {"n": N, "k": K}, "weight_copies": copies, "rows": rows}
    print(f"wrote {write_result(f'fp8-qkv-stages-{device_tag()}', data)}")


if __name__ == "__main__":
    main()
