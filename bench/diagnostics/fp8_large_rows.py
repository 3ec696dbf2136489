"""FP8 projections at 16 to 8,192 rows: our W8A8 kernels against torch._scaled_mm, which
fp8_linear hands products past VENDOR_MIN_ROWS on Hopper (omni/engine/kernels/w8a8.py).

For each of Llama-3-8B's projections and row count: our kernels (fp8_tiles' choice),
torch._scaled_mm with our per-row and per-channel scales (CUTLASS on Hopper), and with
one scale a tensor (cuBLASLt), quantized rows given; and whether torch's row-wise output
has our bits. Each figure is the median replay of a CUDA graph of 8 launches over 8 copies
of the weight (past the 50 MB L2). Prints a table and writes
bench/results/fp8-large-rows-<gpu>.json.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.diagnostics.fp8_few_rows import SHAPES, per_launch_us
from bench.engine_bench import device_tag
from bench.results_io import write_result
from omni.engine.fp8 import quantize_weight
from omni.engine.kernels import w8a8

ROWS = (16, 128, 256, 400, 512, 1024, 2048, 8192)
COPIES = 8


def tensorwise(xq, w, one):
    return torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    one = torch.ones((), device="cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
        wq, ws = quantize_weight(w)
        weights = [(wq.clone(), ws.clone()) for _ in range(COPIES)]
        del w
        x = torch.randn(max(ROWS), k, generator=gen, device="cuda").bfloat16()
        x[:, 3] *= 30  # an outlier column, as activations have
        xq_all, xs_all = w8a8.quantize_rows(x)
        for m in ROWS:
            xq, xs = xq_all[:m], xs_all[:m]
            ours_fn = partial(w8a8.our_fp8_linear, xq, xs, bias=None, dtype=torch.bfloat16)
            ours = per_launch_us([partial(ours_fn, *wp) for wp in weights])
            rowwise = per_launch_us(
                [partial(w8a8.vendor_fp8_linear, xq, xs, *wp) for wp in weights]
            )
            per_tensor = per_launch_us([partial(tensorwise, xq, wp[0], one) for wp in weights])
            same = torch.equal(ours_fn(*weights[0]), w8a8.vendor_fp8_linear(xq, xs, *weights[0]))
            rows.append({
                "layer": name, "rows": m, "n": n, "k": k, "ours_us": round(ours, 2),
                "scaled_mm_rowwise_us": round(rowwise, 2),
                "scaled_mm_per_tensor_us": round(per_tensor, 2), "rowwise_same_bits": same,
            })  # fmt: skip
            print(
                f"{name:8} {m:>5} rows  ours {ours:8.1f}  torch row-wise {rowwise:8.1f}  "
                f"per-tensor {per_tensor:8.1f} us  row-wise has our bits: {same}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    per_layer = {
        m: {
            key: round(sum(r[key] for r in rows if r["rows"] == m), 1)
            for key in ("ours_us", "scaled_mm_rowwise_us", "scaled_mm_per_tensor_us")
        }
        for m in ROWS
    }
    for m, figures in per_layer.items():
        print(f"{m:>5} rows, a layer's four projections: {figures}")
    data = {
        "what": __doc__.split("\n\n")[0],
        "vendor_min_rows": w8a8.VENDOR_MIN_ROWS,
        "rows": rows,
        "per_layer": per_layer,
        "all_rowwise_same_bits": all(r["rowwise_same_bits"] for r in rows),
    }
    print(f"wrote {write_result(f'fp8-large-rows-{device_tag()}', data)}")


if __name__ == "__main__":
    main()
