"""Tensor parallelism: a Llama-3-70B-shaped model over two GPUs, and Llama-3-8B over one
GPU against two, in one run.

Random bf16 checkpoints (std 0.02, norms 1) in HF format (config.json, safetensors
shards of ~4 GB, tokenizer.json), written to --ckpt-dir: a 70B checkpoint is 141 GB,
more than the lent two-GPU machine's disk, so the default is a tmpfs the script mounts
(its memory is the page cache the ranks read from). Each case runs in a child process
that serves the way an omnid instance does: omni.instance.engine_loader.start_ranks starts the
other ranks (NCCL between GPUs, gloo for rank 0's step messages), rank 0 runs the
Engine. Measured per case:

1. cold start: process start to the first token of a one-token request, the model loaded
   from the checkpoint and the engine serving before its warm-up is done (as omnid's
   instances do); then the warm-up is finished before anything else is timed;
2. decode at batch 1: a 128-token prompt, 128 new tokens (greedy, no EOS), tok/s after
   the first token, best of 3; its fraction of the floor: every weight byte (less the
   embedding table, of which a token reads one row) and its K/V read once per token,
   spread over the ranks' GPUs, at the copy bandwidth measured on each;
3. throughput at batch 64: that many 128-token prompts, 128 new tokens each, at once.

A case "dsv3:4:ep" is DeepSeek-V3's shape instead (256 experts, top-8, its real widths,
block-FP8 weights as it ships them, cut to --layers layers: the first three dense), its
routed experts shared out whole over the ranks (expert parallelism), attention split by
heads; its floor counts each rank's share of a token's bytes (attention, the dense and
shared MLPs, its eight experts, the lm head). --name names the result file (the MoE
issue's is moe-<device>).

Prints a table, writes bench/results/tp-<device>.json. --small: tiny shapes on the CPU
(gloo), to check the harness (the DeepSeek case in bf16 there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import engine_bench as eb  # noqa: E402
from bench.moe_bench import moonlight_config, prompts  # noqa: E402
from bench.overcommit_bench import tensor_shapes  # noqa: E402
from bench.results_io import write_result  # noqa: E402

# NVLink multicast stays off (the lent machines' rule; harmless elsewhere)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
SAFE_ENV["NVSHMEM_DISABLE_NVLS"] = "1"
SHARD_BYTES = 4 << 30


def llama3_config(size: str) -> dict:
    """An HF config.json of Llama-3's shape: engine_bench's 8B (or its tiny one), or 70B:
    the 8B's with 70B's widths and depth (the same vocabulary, 8 KV heads, no EOS)."""
    cfg = eb.llama3_8b_config(size == "tiny")
    if size == "70b":
        cfg.update(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64)
        cfg.update(intermediate_size=28672)
    return cfg


def deepseek_v3_config(layers: int, small: bool) -> dict:
    """DeepSeek-V3's config.json shape (its widths, 256 experts, top-8 of 8 groups' best 4,
    one shared expert, the first three layers dense), `layers` deep; or a tiny one."""
    cfg = moonlight_config(small)
    if not small:
        cfg.update(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048)
        cfg.update(n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1)
        cfg.update(n_group=8, topk_group=4, routed_scaling_factor=2.5, q_lora_rank=1536)
        cfg.update(num_attention_heads=128, num_key_value_heads=128, vocab_size=129280)
        cfg.update(first_k_dense_replace=3, rope_theta=10000.0, max_position_embeddings=4096)
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    cfg["num_hidden_layers"] = layers if not small else 2
    return cfg


def write_deepseek_checkpoint(root: Path, cfg: dict, seed: int) -> tuple[Path, dict]:
    """moe_bench's random tensors of `cfg` (block-FP8 where its config says so, as
    moe_bench.stored makes them), one expert's tensors apart as the Hub ships them, in
    safetensors shards of about SHARD_BYTES, with a tokenizer: its path and what was
    written."""
    from safetensors.torch import save_file

    from bench.moe_bench import random_tensor, stored
    from bench.moe_bench import tensor_shapes as moe_shapes
    from omni.testing.checkpoints import text_tokenizer

    t0 = time.perf_counter()
    path = root / f"deepseek-{cfg['num_hidden_layers']}-{seed}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    weights = "fp8" if "quantization_config" in cfg else "bf16"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shard, size, files = {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, files
        if shard:
            files += 1
            save_file(shard, str(path / f"model-{files:05d}.safetensors"), {"format": "pt"})
            shard, size = {}, 0

    for name, shape in moe_shapes(cfg).items():
        t = random_tensor(name, shape, seed, dev, dtype)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix, inter = name.rsplit("experts.", 1)[0], shape[1] // 2
            parts = {}
            for e in range(shape[0]):
                if name.endswith("gate_up_proj"):
                    parts[f"{prefix}experts.{e}.gate_proj.weight"] = t[e, :inter]
                    parts[f"{prefix}experts.{e}.up_proj.weight"] = t[e, inter:]
                else:
                    parts[f"{prefix}experts.{e}.down_proj.weight"] = t[e]
        else:
            parts = {name: t}
        for part_name, part in parts.items():
            for key, value in stored(part_name, part, weights).items():
                shard[key] = value.contiguous().cpu()
                size += shard[key].numel() * shard[key].element_size()
            if size >= SHARD_BYTES:
                flush()
        del t, parts
    flush()
    (path / "config.json").write_text(json.dumps(cfg))
    text_tokenizer(path, cfg["vocab_size"])
    return path, {"files": files, "write_s": round(time.perf_counter() - t0, 1)}


def deepseek_bytes_per_token(cfg: dict, context: int) -> int:
    """moe_bench's batch-1 step bytes: one byte a weight where the checkpoint is FP8 (the
    lm head's bf16 counted at two), two where bf16; the latent K/V at two."""
    from bench.moe_bench import kv_bytes_per_token, step_bytes

    fp8 = "quantization_config" in cfg
    weights = step_bytes(cfg, 1 if fp8 else 2, 1, 0)["weights"]
    if fp8:
        weights += cfg["vocab_size"] * cfg["hidden_size"]  # the lm head stays bf16
    return weights + kv_bytes_per_token(cfg, 2) * context


def write_checkpoint(root: Path, cfg: dict, seed: int) -> tuple[Path, dict]:
    """engine_bench's random checkpoint (bf16, std 0.02, norms 1; made on the GPU), in
    shards of about SHARD_BYTES: its path and what was written."""
    total = weight_bytes(cfg)
    path, seconds = eb.write_checkpoint(root, cfg, max(1, -(-total // SHARD_BYTES)), seed)
    return path, {"bytes": total, "write_s": round(seconds, 1)}


def weight_bytes(cfg: dict) -> int:
    return sum(2 * math.prod(shape) for _, shape in tensor_shapes(cfg))


# ---------------------------------------------------------------- one case, in a child


def serve_case(args, started: float) -> dict:
    """Rank 0 of `args.tp`: what an omnid instance runs (engine_loader.start_ranks), timed."""
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.engine import Engine
    from omni.engine.models import load_model
    from omni.engine.tokenizer import TextTokenizer
    from omni.instance.engine_loader import start_ranks

    on_gpu = torch.cuda.is_available() and not args.small
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    ckpt = Checkpoint.open(Path(args.ckpt))
    if args.tp > 1:
        start_ranks(ckpt, args.tp, on_gpu, args.experts)
    model = load_model(ckpt, device, dtype, tp=args.tp, experts=args.experts)
    loaded = time.perf_counter()
    engine = Engine(model, TextTokenizer(ckpt), max_seqs=args.max_seqs)
    engine.warm_up(when_idle=True)
    vocab = model.cfg.vocab_size

    runner = eb.OursRunner(engine, eb.Deadline(time.time() + args.timeout))

    def run(batch: int, new: int, seed: int) -> dict:
        return eb.batch_run(runner, prompts(batch, args.prompt, vocab, seed), new)

    run(1, 1, 1)  # the first token, the engine still warming up
    result = {
        "load_s": round(loaded - started, 2),  # from this process's start (imports included)
        "cold_start_to_first_token_s": round(time.time() - args.launched, 2),
    }
    t0 = time.perf_counter()
    # the rest of the warm-up (every decode graph too), on the engine thread where the idle
    # warm-up runs, before anything is timed; the event is set once all of it is done
    sched, done = engine.scheduler, threading.Event()
    tasks = engine.runner.warm_up_tasks(sched.max_seqs, sched.max_batch_tokens, graphs=True)
    engine.when_idle([*tasks, done.set])
    if not done.wait(600):
        raise RuntimeError("the warm-up did not end in 600 s")
    result["warm_up_rest_s"] = round(time.perf_counter() - t0, 1)
    result["kv_blocks"] = engine.stats()["kv_blocks_total"]
    result["decode"] = [run(1, args.new, 100 + i) for i in range(3)]
    result["throughput"] = [run(args.batch, args.new, 200)]
    engine.shutdown()
    return result


def child(args, case: dict, ckpt: Path, out: Path) -> dict:
    argv = [sys.executable, __file__, "--phase-out", str(out), "--ckpt", str(ckpt)]
    argv += ["--launched", repr(time.time())]  # wall clock: the child's cold start from here
    argv += ["--tp", str(case["tp"]), "--prompt", str(args.prompt), "--new", str(args.new)]
    argv += ["--batch", str(args.batch), "--max-seqs", str(args.max_seqs)]
    argv += ["--small"] if args.small else []
    argv += ["--experts"] if case.get("experts") else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, timeout=args.timeout, env=os.environ | SAFE_ENV)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    if code != 0 or not out.exists():
        return {"error": f"exit {code}", "wall_s": round(time.perf_counter() - t0, 1)}
    return json.loads(out.read_text()) | {"wall_s": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------- parent


def bytes_per_token(cfg: dict, context: int) -> int:
    """What a batch-1 decode step reads at least: every weight but the embedding table
    (one row of it), and the K/V of `context` tokens; bf16."""
    n = sum(math.prod(s) for k, s in tensor_shapes(cfg) if "embed_tokens" not in k)
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"]
    kv *= cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * (n + cfg["hidden_size"] + kv * context)


def mount_tmpfs(path: Path, gib: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(path):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={gib}g", "tmpfs", str(path)],
                       check=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--cases", default="70b:2,8b:1,8b:2", help="size:tp, comma-separated")
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/mnt/omni-tp-bench"))
    ap.add_argument("--tmpfs-gib", type=int, default=170)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-seqs", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--phase-out")
    ap.add_argument("--ckpt")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--launched", type=float)
    ap.add_argument("--experts", action="store_true", help="(a case's) expert parallelism")
    ap.add_argument("--layers", type=int, default=8, help="the DeepSeek-V3 case's depth")
    ap.add_argument("--name", help="the result file's name (default tp-<device>)")
    args = ap.parse_args()
    if args.phase_out:
        started = time.perf_counter()  # (before anything heavy is imported)
        Path(args.phase_out).write_text(json.dumps(serve_case(args, started)))
        return

    on_gpu = torch.cuda.is_available() and not args.small
    gpus = torch.cuda.device_count() if on_gpu else 0
    cases = []
    for item in args.cases.split(","):
        size, tp, *how = item.split(":")
        small = ("dsv3-tiny" if size == "dsv3" else "tiny") if args.small else size
        cases.append({"size": small, "tp": int(tp), "experts": how == ["ep"]})
    if on_gpu and max(c["tp"] for c in cases) > gpus:
        sys.exit(f"needs {max(c['tp'] for c in cases)} GPUs, sees {gpus}")
    bandwidth = []
    for i in range(gpus):
        with torch.cuda.device(i):
            bandwidth.append(eb.measure_bandwidth(1 << 31, 50))
    if not on_gpu:
        bandwidth.append(eb.measure_bandwidth(1 << 26, 5))
    bw = min(b["bytes_per_s"] for b in bandwidth)
    root = Path(tempfile.mkdtemp()) if args.small else args.ckpt_dir
    if on_gpu:
        mount_tmpfs(root, args.tmpfs_gib)
    results, written = [], {}
    try:
        for case in cases:
            deepseek = case["size"].startswith("dsv3")
            if deepseek:
                cfg = deepseek_v3_config(args.layers, args.small)
            else:
                cfg = llama3_config(case["size"])
            if case["size"] not in written:
                for other in list(written):  # one checkpoint in memory at a time
                    shutil.rmtree(written.pop(other)[0], ignore_errors=True)
                writer = write_deepseek_checkpoint if deepseek else write_checkpoint
                written[case["size"]] = writer(root, cfg, args.seed)
                print(f"wrote {case['size']}: {written[case['size']][1]}", flush=True)
            ckpt = written[case["size"]][0]
            with tempfile.TemporaryDirectory() as tmp:
                got = child(args, case, ckpt, Path(tmp) / "out.json")
            context = args.prompt + args.new // 2
            if deepseek:
                per_token = deepseek_bytes_per_token(cfg, context)
            else:
                per_token = bytes_per_token(cfg, context)
            floor = case["tp"] * bw / per_token  # each GPU reads its 1/tp share at once
            b1 = max((r.get("decode_tok_s", 0) for r in got.get("decode", [])), default=0)
            results.append(
                case | {"checkpoint": written[case["size"]][1], "bytes_per_token": per_token,
                        "floor_tok_s": floor, "fraction_of_floor": b1 / floor if b1 else None}
                | got
            )  # fmt: skip
            print(json.dumps(results[-1])[:400], flush=True)
    finally:
        if not args.keep:
            for path, _ in written.values():
                shutil.rmtree(path, ignore_errors=True)
    tag = eb.device_tag()
    name = "tp-small" if args.small else f"tp-{tag}x{gpus}" if gpus > 1 else f"tp-{tag}"
    name = args.name or name
    write_result(name, {"args": {k: str(v) for k, v in vars(args).items()},
                        "bandwidth": bandwidth, "cases": results})  # fmt: skip

    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s per GPU (the slowest of {len(bandwidth)})")
    print(f"{'case':<10}{'cold start':>12}{'b=1 tok/s':>11}{'floor':>9}{'of floor':>10}"
          f"{'b=' + str(args.batch) + ' tok/s':>14}")  # fmt: skip
    for r in results:
        b1 = max((d.get("decode_tok_s", 0) for d in r.get("decode", [])), default=0)
        thr = r.get("throughput", [{}])[0].get("output_tok_s", 0)
        frac = f"{r['fraction_of_floor']:.1%}" if r.get("fraction_of_floor") else "-"
        cold = r.get("cold_start_to_first_token_s", r.get("error", "-"))
        label = f"{r['size']} {'ep' if r.get('experts') else 'tp'}{r['tp']}"
        print(f"{label:<10}{cold!s:>12}{b1:>11.1f}"
              f"{r['floor_tok_s']:>9.1f}{frac:>10}{thr:>14.0f}")  # fmt: skip
    print(f"\nwrote bench/results/{name}.json")


if __name__ == "__main__":
    main()
