"""One mixture-of-experts layer's experts (kernels/moe.py's fused_moe) at decode batch
sizes, against the bytes they must read: a diagnostic for the MoE-speed work, not a
benchmark with a target.

For Moonlight-16B-A3B's and Qwen3-30B-A3B's expert shapes, random bf16 weights and a
uniform random top-k routing, each batch size's layer time under a CUDA graph (eight
layers a replay, two weight sets taking turns so that L2 holds no layer's experts), the
share of each kernel, and the rate at which it reads its distinct experts' weights,
against the card's copy bandwidth. Variants of the tiles (sub_blocks, the columns a
program takes, warps, stages) run on the same inputs; each says whether its outputs are
the default's bit for bit. `--weights fp8,int4`: the same with the experts stored as
DeepSeek-V3 (block FP8) and Kimi K2.5 (INT4, groups of 32) ship them, through
fused_moe_quantized, against the bytes of that format. Prints a table, writes
bench/results/moe-layer-<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.diagnostics.profile_engine import cuda_ms, top_kernels
from bench.engine_bench import device_tag, measure_bandwidth
from bench.results_io import write_result
from omni.engine.cuda_graphs import capture_graph
from omni.engine.kernels import moe

# (experts, top-k, hidden, intermediate) as the published configs give them
SHAPES = {"moonlight-16b-a3b": (64, 6, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768)}
LAYERS = 8  # launches a graph replay; weights alternate between two sets
# name: (sub_blocks override or None, tile overrides)
VARIANTS = {
    "default": (None, {}),
    "one block a program": (1, {}),
    "two blocks a program": (2, {}),
    "four blocks a program": (4, {}),
    "128 columns": (None, {"BLOCK_N": 128}),
    "32 columns": (None, {"BLOCK_N": 32}),
    "4 stages": (None, {"num_stages": 4}),
    "8 warps and 128 columns": (None, {"BLOCK_N": 128, "num_warps": 8}),
    "quantized: 3 stages": (None, {"QUANT_STAGES": 3}),
}
FP8_SCALE = 0.02 / 64  # one scale a 128 x 128 block: random weights of std ~0.02 in e4m3
INT4_GROUP = 32


def inputs(shape: tuple[int, int, int, int], tokens: int, seed: int):
    experts, k, hidden, _ = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=gen, device="cuda")
    top, ids = scores.topk(k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).to(torch.bfloat16)
    return x, weights, ids


def int4_stacks(shape: tuple[int, int, int, int], gen: torch.Generator) -> tuple:
    """Random packed INT4 stacks (the speed does not depend on the values) and scales."""
    experts, _, hidden, inter = shape

    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        words = torch.randint(
            -(2**31), 2**31 - 1, (experts, n, k // 8), generator=gen, dtype=torch.int32,
            device="cuda",
        )  # fmt: skip
        return words, torch.full((experts, n, k // INT4_GROUP), 0.005, device="cuda").bfloat16()

    return (*stack(2 * inter, hidden), *stack(hidden, inter), (1, INT4_GROUP))


def fp8_stacks(gate_up: torch.Tensor, down: torch.Tensor) -> tuple:
    """The stacks in e4m3 with one scale a 128 x 128 block."""
    experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2

    def blocks(rows: int, cols: int) -> torch.Tensor:
        return torch.full((experts, rows, -(-cols // 128)), FP8_SCALE, device="cuda")

    e4m3 = [(w / FP8_SCALE).to(torch.float8_e4m3fn) for w in (gate_up, down)]
    gate_up_scale = blocks(2 * -(-inter // 128), hidden)
    return (e4m3[0], gate_up_scale, e4m3[1], blocks(-(-hidden // 128), inter), (128, 128))


def weight_sets(shape: tuple[int, int, int, int], weights: str = "bf16") -> list[tuple]:
    """Two sets of the layer's expert stacks, as fused_moe takes them (bf16) or as
    fused_moe_quantized does (fp8, int4: the stacks, their scales and the block)."""
    experts, _, hidden, inter = shape
    sets = []
    for s in range(2):
        gen = torch.Generator(device="cuda").manual_seed(100 + s)
        if weights == "int4":
            sets.append(int4_stacks(shape, gen))
            continue
        gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda")
        down = torch.randn(experts, hidden, inter, generator=gen, device="cuda")
        gate_up, down = gate_up * hidden**-0.5, down * inter**-0.5
        if weights == "fp8":
            sets.append(fp8_stacks(gate_up, down))
        else:
            sets.append((gate_up.to(torch.bfloat16), down.to(torch.bfloat16)))
    return sets


def expert_bytes(shape: tuple[int, int, int, int], weights: str) -> float:
    """The bytes one expert's three matrices take in `weights` (scales included)."""
    _, _, hidden, inter = shape
    values = 3 * inter * hidden
    if weights == "int4":
        return values / 2 + values / INT4_GROUP * 2
    if weights == "fp8":
        return values + -(-values // (128 * 128)) * 4
    return values * 2


def run_layer(x, stacks: tuple, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if len(stacks) == 2:
        return moe.fused_moe(x, *stacks, weights, ids)
    return moe.fused_moe_quantized(x, *stacks[:4], weights, ids, stacks[4])


class Variant:
    """moe's tiles and sub_blocks as a variant sets them, while the block runs."""

    def __init__(self, sub: int | None, tiles: dict):
        self.sub, self.tiles = sub, tiles

    def __enter__(self) -> None:
        self.saved = dict(moe.MOE_TILES), moe.sub_blocks, moe.QUANT_STAGES
        tiles = dict(self.tiles)
        moe.QUANT_STAGES = tiles.pop("QUANT_STAGES", moe.QUANT_STAGES)
        moe.MOE_TILES.update(tiles)
        if self.sub is not None:
            moe.sub_blocks = lambda slots, experts: self.sub

    def __exit__(self, *exc) -> None:
        moe.MOE_TILES.clear()
        moe.MOE_TILES.update(self.saved[0])
        moe.sub_blocks, moe.QUANT_STAGES = self.saved[1], self.saved[2]


def measure(shape, sets, tokens: int, variant: Variant, reference, weight_format: str):
    x, weights, ids = inputs(shape, tokens, seed=tokens)
    with variant:
        out = run_layer(x, sets[0], weights, ids)

        def layers() -> None:
            for i in range(LAYERS):
                run_layer(x, sets[i % 2], weights, ids)

        graph, _ = capture_graph(layers, None)
    layer_us = cuda_ms(graph.replay, 20) * 1e3 / LAYERS
    kernels = top_kernels(lambda: [graph.replay() for _ in range(5)], 8)
    hit = int(torch.unique(ids).numel())
    weight_bytes = hit * expert_bytes(shape, weight_format)
    return {
        "tokens": tokens,
        "layer_us": round(layer_us, 2),
        "experts_hit": hit,
        "weight_bytes": weight_bytes,
        "weight_read_bytes_per_s": weight_bytes / (layer_us * 1e-6),
        "kernels": [
            {"kernel": r["kernel"][:60], "us_per_layer": round(r["cuda_us"] / 5 / LAYERS, 2)}
            for r in kernels
        ],
        "bits_equal_to_default": None if reference is None else bool(torch.equal(out, reference)),
    }, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,8,64,128,256,512")
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if "quantized" not in v))
    ap.add_argument("--weights", default="bf16", help="comma-separated: bf16, fp8, int4")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    bw = measure_bandwidth(1 << 31, 50)
    results: dict = {"bandwidth": bw, "shapes": {}}
    for name, weight_format in (
        (n, w) for n in args.shapes.split(",") for w in args.weights.split(",")
    ):
        shape = SHAPES[name]
        sets = weight_sets(shape, weight_format)
        rows: dict = {}
        for n in tokens:
            reference = None
            for vname in args.variants.split(","):
                sub, tiles = VARIANTS[vname]
                variant = Variant(sub, tiles)
                r, out = measure(shape, sets, n, variant, reference, weight_format)
                reference = out if reference is None else reference
                r["of_copy_bandwidth"] = r["weight_read_bytes_per_s"] / bw["bytes_per_s"]
                rows.setdefault(vname, []).append(r)
                same = {None: "", True: "same bits", False: "OTHER BITS"}[
                    r["bits_equal_to_default"]
                ]
                top = ", ".join(f"{k['kernel'][:24]} {k['us_per_layer']}" for k in r["kernels"][:4])
                print(
                    f"{name} {weight_format} {n:>4} tok {vname:>24}: {r['layer_us']:8.1f} us"
                    f" {r['of_copy_bandwidth']:6.1%} of copy bw ({r['experts_hit']} experts)"
                    f" {same}  [{top}]",
                    flush=True,
                )
        key = name if weight_format == "bf16" else f"{name} {weight_format}"
        results["shapes"][key] = {"shape": shape, "weights": weight_format, "variants": rows}
        del sets
        torch.cuda.empty_cache()
    write_result(f"moe-layer-{device_tag()}", results)


if __name__ == "__main__":
    main()
