"""FP8 against bf16 on a Llama-3-8B-shaped model, one run, each side in its own process.

The random bf16 checkpoint of engine_bench (std 0.02, 4 shards) is served three times by
the engine: as loaded (bf16), with its projections quantized at load (`quantization=
"fp8"`: W8A8, fp8.py), and that with the KV cache in e4m3 too (`kv_cache_dtype="fp8"`,
kv_cache.py). The pieces are engine_bench's, and so are the prompts:

1. decode at batch 1: a 128-token prompt, 256 new tokens, tok/s after the first token,
   the median of 3 runs (engine_bench.part_decode);
2. the ShareGPT-like mix: 1,000 requests at once, output tok/s (engine_bench.part_offline);
3. the KV pool: the tokens the engine's blocks hold, sized from the memory left after
   its weights, and its bytes. The FP8 cache's own gain is fp8_kv against fp8 (the same
   weights), in tokens per byte of pool: each side reads the free memory in its own
   process, which moves by a block or two from run to run (at 0b466bf the two pools held
   2.00x the tokens; at 9eb5451 1.99993x, one 2 MiB block less of free memory).

It prints a table and writes bench/results/fp8-<device>.json. With --small, it runs a tiny
shape on the CPU through the FP8 reference, to check the harness.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from bench import engine_bench as eb  # noqa: E402
from bench.results_io import write_result  # noqa: E402

SIDES = {  # name: (quantization, kv_cache_dtype)
    "bf16": (None, None),
    "fp8": ("fp8", None),
    "fp8_kv": ("fp8", "fp8"),
}


def side(args, ckpt: Path, quantization: str | None, kv_cache_dtype: str | None) -> dict:
    """One engine on the checkpoint: load, warm up, then the timed parts."""
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.engine import Engine
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.tokenizer import TextTokenizer

    device, dtype = eb.engine_device()
    t0 = time.perf_counter()
    model = LlamaForCausalLM.load(
        Checkpoint.open(ckpt), device, dtype, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype, reference=device == "cpu",
    )  # fmt: skip
    eb.sync()
    t1 = time.perf_counter()
    engine = Engine(model, TextTokenizer(Checkpoint.open(ckpt)))
    engine.warm_up(graphs=True)
    out = {"load_s": round(t1 - t0, 2), "warm_up_s": round(time.perf_counter() - t1, 2)}
    out["kv_blocks"] = engine.stats()["kv_blocks_total"]
    out["kv_tokens"] = engine.kv_capacity_tokens
    caches = (engine.runner.k_cache, engine.runner.v_cache)
    out["kv_pool_bytes"] = sum(c.numel() * c.element_size() for c in caches)
    out["weight_bytes"] = sum(
        t.numel() * t.element_size()
        for t in {t.data_ptr(): t for t in model.state_dict().values()}.values()
    )
    bench_args = eb.parse_args(["--small"] if args.small else [])
    deadline = eb.Deadline(time.time() + args.timeout)
    runner = eb.OursRunner(engine, deadline)
    try:
        out["decode"] = eb.part_decode(runner, bench_args, model.cfg.vocab_size)
        offline = eb.part_offline(runner, bench_args, model.cfg.vocab_size, deadline)
        out["sharegpt"] = offline["sharegpt"]
    finally:
        engine.shutdown()
    return out


def child(args, name: str, ckpt: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "out.json"
        argv = [sys.executable, __file__, "--side", name, "--ckpt", str(ckpt)]
        argv += ["--out", str(result), "--timeout", str(args.timeout)]
        argv += ["--small"] if args.small else []
        t0 = time.perf_counter()
        try:
            code = subprocess.run(argv, timeout=args.timeout + 120).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code != 0 or not result.exists():
            return {"error": f"exit {code}", "wall_s": round(time.perf_counter() - t0, 1)}
        return json.loads(result.read_text()) | {"wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--timeout", type=float, default=240, help="seconds for each side's parts")
    ap.add_argument("--ckpt-root", default="/tmp/omni-engine-bench")
    ap.add_argument("--side", choices=list(SIDES))
    ap.add_argument("--ckpt")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.small:
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.side:
        result = side(args, Path(args.ckpt), *SIDES[args.side])
        Path(args.out).write_text(json.dumps(result))
        return
    cfg = eb.llama3_8b_config(args.small)
    ckpt, written_s = eb.write_checkpoint(Path(args.ckpt_root), cfg, 4, 0)
    sides = {name: child(args, name, ckpt) for name in SIDES}

    def fig(d: dict, *keys):
        for k in keys:
            d = d.get(k, {}) if isinstance(d, dict) else {}
        return d if isinstance(d, int | float) else None

    def ratio(a, b):
        return b / a if a and b else None

    summary = {}
    for label, keys in (("decode_b1_tok_s", ("decode", "tok_s")),
                        ("sharegpt_out_tok_s", ("sharegpt", "output_tok_s")),
                        ("kv_tokens", ("kv_tokens",))):  # fmt: skip
        row = {name: fig(d, *keys) for name, d in sides.items()}
        row |= {f"{name}/bf16": ratio(row["bf16"], row[name]) for name in ("fp8", "fp8_kv")}
        summary[label] = row
    best = max(
        summary["decode_b1_tok_s"]["fp8/bf16"] or 0, summary["decode_b1_tok_s"]["fp8_kv/bf16"] or 0
    )
    summary["kv_tokens"]["fp8_kv/fp8"] = ratio(
        summary["kv_tokens"]["fp8"], summary["kv_tokens"]["fp8_kv"]
    )
    per_byte = {
        name: d["kv_tokens"] / d["kv_pool_bytes"]
        for name, d in sides.items()
        if d.get("kv_tokens") and d.get("kv_pool_bytes")
    }
    summary["kv_tokens_per_gib"] = {name: v * 2**30 for name, v in per_byte.items()}
    kv_gain = ratio(per_byte.get("fp8"), per_byte.get("fp8_kv"))
    summary["kv_tokens_per_gib"]["fp8_kv/fp8"] = kv_gain
    sharegpt = summary["sharegpt_out_tok_s"]
    targets = {
        "decode_b1 >= 1.7x bf16": best >= 1.7,
        "sharegpt >= 13,000 out tok/s": max(sharegpt["fp8"] or 0, sharegpt["fp8_kv"] or 0) >= 13000,
        "fp8 kv cache holds >= 2x the tokens a pool byte (same weights)": (kv_gain or 0) >= 2,
    }
    device = "small" if args.small else eb.device_tag()
    data = {"config": cfg, "checkpoint_write_s": round(written_s, 1), "sides": sides}
    path = write_result(f"fp8-{device}", data | {"summary": summary, "targets": targets})
    names = [*SIDES, "fp8/bf16", "fp8_kv/bf16"]
    print(f"\n{'':22}" + "".join(f"{n:>13}" for n in names))
    for label, row in summary.items():
        cells = (row.get(n) for n in names)
        print(f"{label:22}" + "".join(f"{c:>13.2f}" if c else f"{'-':>13}" for c in cells))
    print(f"{'fp8 kv cache: tokens a pool byte x':34}{kv_gain or 0:>7.4f}")
    for what, ok in targets.items():
        print(f"  {what}: {'met' if ok else 'NOT met'}")
    for name, d in sides.items():
        if "error" in d:
            print(f"  {name}: {d['error']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
