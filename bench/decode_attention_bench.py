"""Paged decode attention (one layer, Llama-3-8B heads) against torch's fused SDPA.

For each batch size and context length: our split-KV kernel over a shuffled paged
cache, and `scaled_dot_product_attention` (its flash/cuDNN kernels) over the same
K/V laid out contiguously, which is the ceiling a paged kernel aims at. Both as
time per call and as the KV bytes read per second (the bound is the card's copy
bandwidth), and our kernel at each number of programs per (sequence, KV head), the
count decode_programs picks by batch size (each count must give the same bits). Timed
as CUDA-graph replays, as the engine's decode steps run.
Writes bench/results/decode-attention-<name>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from bench.engine_bench import measure_bandwidth  # noqa: E402
from bench.results_io import write_result  # noqa: E402
from omni.engine.kernels.attention import decode_programs, paged_decode  # noqa: E402

N_Q, N_KV, DIM, PAGE = 32, 8, 128, 16
BATCHES = (1, 4, 16, 64, 128, 512)
CONTEXTS = (128, 512, 2048, 8192)
MAX_TOKENS = 1 << 20  # per case: 4 GiB of one layer's K and V


def case(batch: int, ctx: int, gen: torch.Generator) -> dict:
    pages = batch * (-(-ctx // PAGE))
    k_cache = torch.randn(pages, PAGE, N_KV, DIM, generator=gen, device="cuda").bfloat16()
    v_cache = torch.randn(pages, PAGE, N_KV, DIM, generator=gen, device="cuda").bfloat16()
    order = torch.randperm(pages, generator=gen, device="cuda").int()
    table = order.view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, N_Q, DIM, generator=gen, device="cuda").bfloat16()
    scale = DIM**-0.5
    # the same K/V, contiguous per sequence: [batch, kv heads, ctx, dim]
    k = k_cache[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    v = v_cache[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)  # [batch, q heads, 1, dim]

    def ours():
        return paged_decode(q, k_cache, v_cache, table, lens, scale)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, scale=scale, enable_gqa=True
        )

    err = (ours().float() - sdpa().squeeze(2).float()).abs().max().item()
    kv_bytes = 2 * batch * ctx * N_KV * DIM * 2
    rec = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes, "max_abs_diff": err}
    rec["programs_per_head"] = decode_programs(batch * N_KV, q.device)
    for label, fn in (("ours", ours), ("sdpa", sdpa)):
        ms = triton.testing.do_bench_cudagraph(fn, rep=50)  # the kernels, not the launches
        rec[f"{label}_us"] = round(ms * 1000, 1)
        rec[f"{label}_gb_s"] = round(kv_bytes / ms / 1e6, 1)
    rec["ours_vs_sdpa"] = round(rec["ours_us"] / rec["sdpa_us"], 3)
    # every program count gives the same bits; the engine picks one by the batch size
    counts = (1, 2, 4, 8, 16)
    outs = [paged_decode(q, k_cache, v_cache, table, lens, scale, programs=n) for n in counts]
    rec["programs_identical"] = all(torch.equal(o, outs[0]) for o in outs)
    rec["ours_us_by_programs"] = {
        n: round(
            triton.testing.do_bench_cudagraph(
                lambda n=n: paged_decode(q, k_cache, v_cache, table, lens, scale, programs=n),
                rep=20,
            )
            * 1000,
            1,
        )
        for n in counts
    }
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", default="h100")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = measure_bandwidth(1 << 30, 50)["bytes_per_s"]  # read + written, 1 GiB
    rows = []
    print(
        f"{'batch':>5} {'ctx':>5} {'progs':>5} {'ours us':>8} {'sdpa us':>8} "
        f"{'ours GB/s':>9} {'sdpa GB/s':>9} {'ratio':>6}  ours us at 1/2/4/8/16 programs"
    )
    for batch in BATCHES:
        for ctx in CONTEXTS:
            if batch * ctx > MAX_TOKENS:
                continue
            r = case(batch, ctx, gen)
            rows.append(r)
            print(
                f"{batch:5d} {ctx:5d} {r['programs_per_head']:5d} {r['ours_us']:8.1f} "
                f"{r['sdpa_us']:8.1f} {r['ours_gb_s']:9.0f} {r['sdpa_gb_s']:9.0f} "
                f"{r['ours_vs_sdpa']:6.2f}  "
                + "/".join(f"{us:.1f}" for us in r["ours_us_by_programs"].values())
                + ("" if r["programs_identical"] else "  PROGRAM COUNTS DIFFER")
            )
            torch.cuda.empty_cache()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    path = write_result(
        f"decode-attention-{args.name}",
        {
            "copy_bandwidth_bytes_s": bandwidth,
            "heads": [N_Q, N_KV, DIM],
            "page": PAGE,
            "cases": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
