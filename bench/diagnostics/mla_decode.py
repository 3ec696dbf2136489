"""MLA decode attention (kernels/mla.py) at decode batch sizes, with variants of its tile:
a diagnostic for the MLA-speed work, not a benchmark with a target.

Random latent caches (512 + 64 values a token), decode rows of Moonlight's 16 heads and
DeepSeek-V3's 128, contexts of 192 and 1,024 tokens; each variant's time per call under
a CUDA graph and whether its output is the default's bit for bit. Prints a table, writes
bench/results/mla-decode-<gpu>.json. `--values`: attention and the values product
together, the merge and the product in two launches or in one (mla_attention's w_uv),
into mla-values-<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.diagnostics.profile_engine import cuda_ms
from bench.engine_bench import device_tag
from bench.results_io import write_result
from omni.engine.cuda_graphs import capture_graph
from omni.engine.kernels import mla
from omni.engine.kernels.head_matmul import head_matmul

LATENT, ROPE, BLOCK = 512, 64, 16
CALLS = 8  # launches a graph replay, each over its own cache (L2 holds none of them)
# name: (kernels/mla.py constants to set, value_splits: None for the launch's own choice)
VARIANTS = {
    "default": ({}, None),
    "values whole": ({}, 1),
    "values in 2": ({}, 2),
    "values in 4": ({}, 4),
    "1 stage": ({"STEPS": (64, {"num_warps": 4, "num_stages": 1})}, None),
    "8 warps": ({"STEPS": (64, {"num_warps": 8, "num_stages": 2})}, None),
    "32 keys a step": ({"STEPS": (32, {"num_warps": 4, "num_stages": 2})}, None),
    "tile 16": ({"TILE_M": 16}, None),
    "1 tile a split": ({"MIN_SPLIT_TILES": 1}, None),
    "1 tile a split, 32 keys": (
        {"MIN_SPLIT_TILES": 1, "STEPS": (32, {"num_warps": 4, "num_stages": 2})},
        None,
    ),
}
# --values: attention and the values product (kv_b_proj's V part, 128 a head), the merge
# in the product's launch (mla_attention's w_uv) or not
VALUES = {"merge, then values": False, "values in the merge": True}
V_DIM = 128


def batch(seqs: int, context: int, heads: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-context // BLOCK)
    n_blocks = seqs * per_seq
    caches = [
        torch.randn(n_blocks, BLOCK, 1, LATENT + ROPE, generator=gen, device="cuda").to(
            torch.bfloat16
        )
        for _ in range(CALLS)
    ]
    order = torch.randperm(n_blocks, generator=gen, device="cuda").int()
    table = order.view(seqs, per_seq).contiguous()
    q = torch.randn(seqs, heads, LATENT + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
    lens = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
    cu = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
    return q, caches, table, lens, cu


class Variant:
    """Sets kernels/mla.py's constants for a block (STEPS: the bf16 entry), then restores."""

    def __init__(self, constants: dict, value_splits: int | None):
        self.constants, self.value_splits = constants, value_splits

    def __enter__(self) -> None:
        self.saved = {name: getattr(mla, name) for name in self.constants}
        for name, value in self.constants.items():
            setattr(mla, name, {**mla.STEPS, 2: value} if name == "STEPS" else value)

    def __exit__(self, *exc) -> None:
        for name, value in self.saved.items():
            setattr(mla, name, value)


def measure(inputs, variant: Variant, w_uv=None, fused=False) -> tuple[float, torch.Tensor]:
    """µs a call under a CUDA graph, and the first call's output. `w_uv` (--values): the
    values product too, in the merge's launch (`fused`) or after the merge."""
    q, caches, table, lens, cu = inputs
    scale = (128 + ROPE) ** -0.5
    with variant:
        kwargs = {"value_splits": variant.value_splits}

        def call(cache) -> torch.Tensor:
            if w_uv is not None and fused:
                return mla.mla_attention(q, cache, table, lens, cu, scale, LATENT, w_uv=w_uv)
            out = mla.mla_attention(q, cache, table, lens, cu, scale, LATENT, **kwargs)
            return out if w_uv is None else head_matmul(out, w_uv, transpose=True)

        out = call(caches[0])
        graph, _ = capture_graph(lambda: [call(cache) for cache in caches], None)
    return cuda_ms(graph.replay, 20) * 1e3 / CALLS, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1,64,256")
    ap.add_argument("--contexts", default="192,1024")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--values", action="store_true", help="the values product too (VALUES)")
    args = ap.parse_args()
    runs = {name: (Variant(*v), False) for name, v in VARIANTS.items()}
    if args.values:
        runs = {name: (Variant({}, None), fused) for name, fused in VALUES.items()}
    rows = []
    for heads in (int(h) for h in args.heads.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            for seqs in (int(s) for s in args.seqs.split(",")):
                inputs = batch(seqs, context, heads, seed=seqs + context)
                w_uv = None
                if args.values:
                    w_uv = torch.randn(heads, V_DIM, LATENT, device="cuda") * LATENT**-0.5
                    w_uv = w_uv.to(torch.bfloat16)
                kv_bytes = seqs * context * (LATENT + ROPE) * 2
                reference = None
                for name, (variant, fused) in runs.items():
                    us, out = measure(inputs, variant, w_uv, fused)
                    same = None if reference is None else bool(torch.equal(out, reference))
                    reference = out if reference is None else reference
                    rows.append(
                        {"heads": heads, "context": context, "seqs": seqs, "variant": name,
                         "us": round(us, 2), "kv_bytes": kv_bytes,
                         "bits_equal_to_default": same}
                    )  # fmt: skip
                    flag = {None: "", True: "same bits", False: "OTHER BITS"}[same]
                    print(
                        f"{heads:>3} heads {context:>5} ctx {seqs:>4} seqs {name:>22}:"
                        f" {us:8.2f} us ({kv_bytes / us / 1e3:7.1f} GB/s of K/V) {flag}",
                        flush=True,
                    )
                del inputs
    name = "mla-values" if args.values else "mla-decode"
    write_result(f"{name}-{device_tag()}", {"rows": rows})


if __name__ == "__main__":
    main()
