"""FP8 linear layers at a few rows as a decode step runs them: the few-rows kernel against
the pointer kernel's tiles it replaced, and the quantizing kernels' one-read paths.

For each of Llama-3-8B's projections, 32 layers' worth of distinct weights (so each launch
reads its weights from HBM, past the 50 MB L2) are launched back to back in one CUDA graph,
as a decode step's layers are, under PDL where the GPU has it; the figure is the graph's
median replay over the launches. Beside them, the same with bf16 weights (tile_config's
tiles) and the weights' bytes at the copy rate (3.02 TB/s, engine-h100.json). Each
configuration's output is compared bit for bit with the replaced one's.

Also quantize_rows, 32 launches: in two passes of 1,024 (before) against one read of the
row. (silu_and_mul quantizing its own rows, one program a row, took 4.1 us against 3.0 for
the two kernels at 1 row: not kept.)
Prints a table and writes bench/results/fp8-few-rows-<gpu>.json.
"""

from __future__ import annotations

import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.engine_bench import device_tag
from bench.results_io import write_result
from omni.engine.fp8 import quantize_weight
from omni.engine.kernels import w8a8
from omni.engine.kernels.e4m3 import FP8, FP8_MAX
from omni.engine.kernels.matmul import launch_linear, tile_config
from omni.engine.kernels.pdl import pdl_options

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
COPY_BYTES_PER_S = 3.02e12  # the H100's measured copy rate (engine-h100.json)


def before_tiles(n: int) -> dict:
    """fp8_tiles' pointer-kernel tiles up to 16 rows before the few-rows kernel (at f8e5f2e)."""
    if n > 16384:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if n > 4096:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=8)
    return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, num_warps=8, num_stages=6)


def per_launch_us(launches, replays: int = 7) -> float:
    """Median µs per launch of one CUDA graph replaying all of `launches`."""
    for fn in launches:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(launches))
    return statistics.median(times)


def linear_rows(gen: torch.Generator) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
        wq, ws = quantize_weight(w)
        fp8_weights = [(wq.clone(), ws.clone()) for _ in range(LAYERS)]
        bf16_weights = [w.clone() for _ in range(LAYERS)]
        del w, wq, ws
        for m in (1, 4, 16):
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            xq, xs = w8a8.quantize_rows(x)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            figures, bits = {}, {}
            for side, cfg in (("before", before_tiles(n)), ("now", w8a8.fp8_tiles(m, n, k))):
                figures[side] = per_launch_us(
                    [
                        partial(w8a8.launch_fp8_linear, xq, xs, *w, None, out, cfg)
                        for w in fp8_weights
                    ]
                )
                w8a8.launch_fp8_linear(xq, xs, *fp8_weights[0], None, out, cfg)
                bits[side] = out.clone()
            bcfg = tile_config(m, n, 2)
            bf16 = per_launch_us(
                [partial(launch_linear, x, w, None, out, bcfg) for w in bf16_weights]
            )
            rows.append({
                "layer": name, "rows": m, "n": n, "k": k,
                "bytes_floor_us": round(n * k / COPY_BYTES_PER_S * 1e6, 2),
                "bf16_us": round(bf16, 2), "fp8_before_us": round(figures["before"], 2),
                "fp8_now_us": round(figures["now"], 2), "now_tiles": w8a8.fp8_tiles(m, n, k),
                "same_bits": torch.equal(bits["before"], bits["now"]),
            })  # fmt: skip
            print(
                f"{name:8} {m:>3} rows  floor {rows[-1]['bytes_floor_us']:6.1f}  bf16 {bf16:6.1f}"
                f"  fp8 before {figures['before']:6.1f}  now {figures['now']:6.1f} us"
                f"  same bits {rows[-1]['same_bits']}",
                flush=True,
            )
        del fp8_weights, bf16_weights
        torch.cuda.empty_cache()
    return rows


def quantize_rows_two_passes(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """quantize_rows before the one-read path: QUANT_BLOCK elements at a time, twice."""
    m, k = x.shape
    w8a8._quantize_rows_kernel[(m,)](
        x, q, scale, k, FMAX=FP8_MAX, BLOCK=w8a8.QUANT_BLOCK, WHOLE=False,
        **pdl_options(x.device),
    )  # fmt: skip


def quantize_figures(gen: torch.Generator) -> list[dict]:
    found = []
    for k in (4096, 14336):
        for m in (1, 16):
            xs = [torch.randn(m, k, generator=gen, device="cuda").bfloat16() for _ in range(LAYERS)]
            q = torch.empty(m, k, dtype=FP8, device="cuda")
            scale = torch.empty(m, device="cuda")
            two = per_launch_us([partial(quantize_rows_two_passes, x, q, scale) for x in xs])
            quantize_rows_two_passes(xs[0], q, scale)
            before = (q.clone(), scale.clone())
            one = per_launch_us([partial(w8a8.quantize_rows, x) for x in xs])
            now = w8a8.quantize_rows(xs[0])
            same = torch.equal(before[0].view(torch.uint8), now[0].view(torch.uint8)) and (
                torch.equal(before[1], now[1])
            )
            found.append({
                "what": "quantize_rows", "k": k, "rows": m, "two_passes_us": round(two, 2),
                "one_read_us": round(one, 2), "same_bits": same,
            })  # fmt: skip
            print(f"quantize_rows k={k:>5} {m:>3} rows  two passes {two:5.2f}  one read "
                  f"{one:5.2f} us  same bits {same}", flush=True)  # fmt: skip
    return found


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = linear_rows(gen)
    quant = quantize_figures(gen)
    per_layer = {}
    for m in (1, 4, 16):
        mine = [r for r in rows if r["rows"] == m]
        per_layer[m] = {
            key: round(sum(r[key] for r in mine), 1)
            for key in ("bytes_floor_us", "bf16_us", "fp8_before_us", "fp8_now_us")
        }
        print(f"{m:>3} rows, a layer's four projections: {per_layer[m]}")
    data = {
        "what": __doc__.split("\n\n")[0],
        "layers_per_graph": LAYERS,
        "copy_bytes_per_s": COPY_BYTES_PER_S,
        "linear": rows,
        "per_layer": per_layer,
        "quantize": quant,
    }
    print(f"wrote {write_result(f'fp8-few-rows-{device_tag()}', data)}")


if __name__ == "__main__":
    main()
