"""Why an e4m3 KV cache does not halve decode attention's time: where the time goes.

Paged decode attention (one layer, Llama-3-8B's heads, 16-token pages, shuffled) at the
ShareGPT mix's step shapes, timed as CUDA-graph replays:
1. by side: K and V each in fp16 or e4m3, with an fp16 query (so an fp16 cache needs no
   conversion at all, and each e4m3 side adds only its own): if the kernel were bound by
   its bytes, each e4m3 side would take a quarter off the time;
2. by launch settings (tile, tiles a split, warps, stages) over a bf16 and an e4m3 cache,
   the best of each against the engine's.
Prints two tables and writes bench/results/fp8-attention-<gpu>.json.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.decode_attention_bench import DIM, N_KV, N_Q, PAGE
from bench.engine_bench import device_tag, measure_bandwidth
from bench.results_io import write_result
from omni.engine.kernels import attention
from omni.engine.kernels.e4m3 import FP8

SHAPES = ((400, 450), (128, 640), (16, 1500))  # (sequences, context): big, mid, tail steps
SIDES = (
    ("fp16", "fp16"),
    ("e4m3", "fp16"),
    ("fp16", "e4m3"),
    ("e4m3", "e4m3"),
)
# tile, tiles a split, warps, stages; the engine's first
LAUNCHES = [(64, 4, 4, 2)] + [
    c for c in itertools.product((64, 128), (2, 4, 8), (4, 8), (2, 3)) if c != (64, 4, 4, 2)
]


def cache(pages: int, dtype: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(pages, PAGE, N_KV, DIM, generator=gen, device="cuda").half()
    return x.to(FP8) if dtype == "e4m3" else x


def paged(batch: int, ctx: int, gen: torch.Generator) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(pages, a shuffled block table, every sequence's length) for batch x ctx."""
    pages = batch * -(-ctx // PAGE)
    table = torch.randperm(pages, generator=gen, device="cuda").int().view(batch, -1)
    return pages, table, torch.full((batch,), ctx, dtype=torch.int32, device="cuda")


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1000


def sides(batch: int, ctx: int, gen: torch.Generator) -> list[dict]:
    pages, table, lens = paged(batch, ctx, gen)
    q = torch.randn(batch, N_Q, DIM, generator=gen, device="cuda").half()
    scales = torch.ones(2, N_KV, device="cuda")
    rows = []
    for k_type, v_type in SIDES:
        k, v = cache(pages, k_type, gen), cache(pages, v_type, gen)
        us = timed(lambda k=k, v=v: attention.paged_decode(q, k, v, table, lens, DIM**-0.5,
                                                           kv_scales=scales))  # fmt: skip
        nbytes = batch * ctx * N_KV * DIM * (k.element_size() + v.element_size())
        rows.append({"batch": batch, "context": ctx, "k": k_type, "v": v_type, "kv_bytes": nbytes,
                     "us": round(us, 1), "gb_s": round(nbytes / us / 1e3)})  # fmt: skip
    return rows


def launches(batch: int, ctx: int, gen: torch.Generator) -> list[dict]:
    pages, table, lens = paged(batch, ctx, gen)
    q = torch.randn(batch, N_Q, DIM, generator=gen, device="cuda").bfloat16()
    engine = (attention.DECODE_TILE, attention.MIN_SPLIT_TILES, dict(attention.SPLIT_LAUNCH))
    rows = []
    for kv in ("bf16", "e4m3"):
        k, v = (torch.randn(pages, PAGE, N_KV, DIM, generator=gen, device="cuda") for _ in "kv")
        scales = None
        if kv == "e4m3":
            scales = torch.full((2, N_KV), 1 / 64, device="cuda")
            k, v = (k * 64).to(FP8), (v * 64).to(FP8)
        else:
            k, v = k.bfloat16(), v.bfloat16()
        times = {}
        try:
            for tile, split_tiles, warps, stages in LAUNCHES:
                attention.DECODE_TILE, attention.MIN_SPLIT_TILES = tile, split_tiles
                attention.SPLIT_LAUNCH = {"num_warps": warps, "num_stages": stages}
                key = f"{tile}/{split_tiles}/w{warps}/s{stages}"
                times[key] = round(timed(lambda k=k, v=v, s=scales: attention.paged_decode(
                    q, k, v, table, lens, DIM**-0.5, kv_scales=s)), 1)  # fmt: skip
        finally:
            attention.DECODE_TILE, attention.MIN_SPLIT_TILES = engine[0], engine[1]
            attention.SPLIT_LAUNCH = engine[2]
        first = next(iter(times))
        best = min(times, key=times.get)
        rows.append({"batch": batch, "context": ctx, "kv": kv, "engine": first,
                     "engine_us": times[first], "best": best, "best_us": times[best],
                     "us": times})  # fmt: skip
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = measure_bandwidth(1 << 30, 50)["bytes_per_s"]
    by_side = [r for b, c in SHAPES for r in sides(b, c, gen)]
    print(f"{'seqs':>5} {'ctx':>5} {'K':>5} {'V':>5} {'us':>7} {'GB/s':>6}")
    for r in by_side:
        print(
            f"{r['batch']:5d} {r['context']:5d} {r['k']:>5} {r['v']:>5} "
            f"{r['us']:7.1f} {r['gb_s']:6d}"
        )
    by_launch = [r for b, c in SHAPES for r in launches(b, c, gen)]
    print(f"\n{'seqs':>5} {'ctx':>5} {'cache':>5} {'engine us':>10} {'best us':>8}  best launch")
    for r in by_launch:
        print(f"{r['batch']:5d} {r['context']:5d} {r['kv']:>5} {r['engine_us']:10.1f} "
              f"{r['best_us']:8.1f}  {r['best']}")  # fmt: skip
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    path = write_result(
        f"fp8-attention-{device_tag()}",
        {
            "copy_bandwidth_bytes_s": bandwidth,
            "heads": [N_Q, N_KV, DIM],
            "page": PAGE,
            "launch_key": "tile/tiles a split/warps/stages",
            "by_side": by_side,
            "by_launch": by_launch,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
