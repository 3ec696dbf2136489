"""Batch-invariant Triton linear vs cuBLAS (torch.nn.functional.linear) on Llama-3-8B shapes.

For each layer shape and row count M: time of both (CUDA events, median of
`triton.testing.do_bench`), and whether row 0 of the result is bit-identical
to the same row computed alone (M=1), the property the engine needs for a
request's output not to depend on its batch neighbours. Then whole-model decode
throughput (64 requests x 32 tokens through the engine) with each linear.
Writes bench/results/matmul-<name>.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from bench.results_io import write_result  # noqa: E402
from omni.engine import kernels  # noqa: E402
from omni.engine.kernels.matmul import linear, linear_ref  # noqa: E402

SHAPES = {  # name: (N, K) of Llama-3-8B's weights
    "q/o_proj": (4096, 4096),
    "k/v_proj": (1024, 4096),
    "gate/up": (14336, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
ROWS = (1, 8, 32, 64, 128, 512, 2048)


def gemm_table() -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        x_all = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
        alone = {f: f(x_all[:1], w) for f in (linear, linear_ref)}
        for m in ROWS:
            x = x_all[:m]
            rec = {"layer": name, "N": n, "K": k, "M": m}
            for label, f in (("ours", linear), ("cublas", linear_ref)):
                ms = triton.testing.do_bench(lambda f=f, x=x, w=w: f(x, w), warmup=10, rep=50)
                rec[f"{label}_us"] = round(ms * 1000, 1)
                rec[f"{label}_invariant"] = bool(torch.equal(f(x, w)[:1], alone[f]))
            rec["ours_vs_cublas"] = round(rec["ours_us"] / rec["cublas_us"], 3)
            rows.append(rec)
    return rows


def engine_decode(requests: int, new_tokens: int) -> list[dict]:
    """Tokens/s of the whole engine on an 8B shape with each linear, same prompts."""
    from omni.engine.engine import Engine
    from omni.engine.sampling import SamplingParams
    from omni.testing.checkpoints import LLAMA3_8B, random_llama, text_tokenizer
    from omni.testing.runs import run_requests, tokens

    cfg = LLAMA3_8B
    model = random_llama(cfg)
    tok = text_tokenizer(Path(tempfile.mkdtemp()), cfg.vocab_size)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (128,), generator=gen).tolist()] * requests
    prompts = [[i, *p[1:]] for i, p in enumerate(prompts)]  # distinct: no prefix-cache hits
    saved = kernels._KERNELS.linear
    out = []
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for label, f in (("ours", linear), ("cublas", linear_ref)):
        kernels._KERNELS.linear = f
        engine = Engine(model, tok, num_blocks=4096)
        try:
            run_requests(engine, prompts[:4], sampling, 600)  # warm-up: compile, graphs
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            results = run_requests(engine, prompts, sampling, 600)
            elapsed = time.perf_counter() - t0
        finally:
            engine.shutdown()
        produced = sum(len(tokens(r)) for r in results)
        out.append(
            {
                "linear": label,
                "requests": requests,
                "prompt_tokens": 128,
                "new_tokens": new_tokens,
                "seconds": round(elapsed, 3),
                "output_tokens_per_s": round(produced / elapsed, 1),
            }
        )
    kernels._KERNELS.linear = saved
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", default="h100")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    gemms = gemm_table()
    print(f"{'layer':10} {'M':>5} {'ours us':>9} {'cuBLAS us':>10} {'ratio':>6}  invariant")
    for r in gemms:
        print(
            f"{r['layer']:10} {r['M']:5} {r['ours_us']:9.1f} {r['cublas_us']:10.1f} "
            f"{r['ours_vs_cublas']:6.2f}  ours={r['ours_invariant']} "
            f"cublas={r['cublas_invariant']}"
        )
    decode = engine_decode(args.requests, args.new_tokens)
    print(f"\n{'linear':8} {'requests':>8} {'tokens/s':>10} {'seconds':>8}")
    for r in decode:
        print(
            f"{r['linear']:8} {r['requests']:8} {r['output_tokens_per_s']:10.1f} "
            f"{r['seconds']:8.2f}"
        )
    path = write_result(f"matmul-{args.name}", {"gemm": gemms, "engine_decode": decode})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
