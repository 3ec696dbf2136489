"""OMNI's engine against HF transformers on a Qwen3-30B-A3B-shaped mixture of experts.

Random bf16 weights (std 0.02, norms 1), about 61 GB, made on the GPU in each side's own
process from one seed, tensor by tensor: both sides run the same numbers and nothing
goes to disk (the lent machine's disk holds 64 GB). Measured, each side in a child
process:

1. decode at batch 1: a 128-token prompt, 128 new tokens (greedy, no EOS), tok/s after
   the first token; and its fraction of the floor for the bytes a token actually reads
   (the 8 active experts of each layer, attention, norms, router, the lm head, one
   embedding row, its K/V) at the copy bandwidth measured here;
2. throughput at batch 64 and 256: that many 128-token prompts, 128 new tokens each,
   all submitted at once (HF: one padded generate call of the batch; 256 only with
   --hf-256, it is slow);

and ours against HF at batch 64 (the issue asks for at least 5x). --profile adds where a
batch-1 step's GPU time goes, kernel by kernel (in a child of its own, without dependent
launches; "batch1_profile"). Prints a table, writes bench/results/moe-<device>.json.
--small: a tiny shape on the CPU, to check the harness.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.engine_bench import Deadline, OursRunner, batch_run, measure_bandwidth  # noqa: E402
from bench.results_io import write_result  # noqa: E402


def qwen3_moe_config(small: bool) -> dict:
    """Qwen3-30B-A3B's shape as an HF config.json (or a tiny one); no EOS."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if small:
        cfg.update(hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
        cfg.update(num_key_value_heads=2, head_dim=32, moe_intermediate_size=64)
        cfg.update(num_experts=8, num_experts_per_tok=2, vocab_size=512)
        cfg.update(max_position_embeddings=512)
    return cfg


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF's parameter names and shapes, the experts stacked as transformers 5 keeps them."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, e, inter = cfg["head_dim"], cfg["num_experts"], cfg["moe_intermediate_size"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate.weight": (e, h),
            p + "mlp.experts.gate_up_proj": (e, 2 * inter, h),
            p + "mlp.experts.down_proj": (e, h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], seed: int, device: str, dtype) -> torch.Tensor:
    """The same values for the same name and seed, in any process: norms 1, the rest
    normal with std 0.02."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0, 0.02, generator=gen)


def active_bytes_per_token(cfg: dict, itemsize: int) -> int:
    """What a batch-1 decode step reads at least: each layer's attention projections,
    norms, router and its top-k experts, the final norm and lm head, one embedding row."""
    shapes = tensor_shapes(cfg)
    total = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        if "experts." in name:
            n = n // cfg["num_experts"] * cfg["num_experts_per_tok"]
        elif name == "model.embed_tokens.weight":
            n = shape[1]
        total += n * itemsize
    return total


def kv_bytes_per_token(cfg: dict, itemsize: int) -> int:
    heads_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    return 2 * cfg["num_hidden_layers"] * heads_dim * itemsize


# ---------------------------------------------------------------- the two sides


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


def build_ours(args, cfg: dict, device: str, dtype):
    """Our engine on the random weights, warmed up with its CUDA graphs: (engine, setup)."""
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.engine import Engine
    from omni.engine.llama import LlamaConfig, LlamaForCausalLM
    from tests.checkpoints import text_tokenizer

    t0 = time.perf_counter()
    state = {}
    for name, shape in tensor_shapes(cfg).items():
        t = random_tensor(name, shape, args.seed, device, dtype)
        if name.endswith("experts.gate_up_proj"):  # as the Hub ships them: one per expert
            prefix, inter = name.removesuffix("experts.gate_up_proj"), shape[1] // 2
            for e in range(shape[0]):
                state[f"{prefix}experts.{e}.gate_proj.weight"] = t[e, :inter]
                state[f"{prefix}experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("experts.down_proj")
            for e in range(shape[0]):
                state[f"{prefix}experts.{e}.down_proj.weight"] = t[e]
        else:
            state[name] = t
        del t
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = text_tokenizer(Path(tmp), cfg["vocab_size"])
        mcfg = LlamaConfig.from_checkpoint(Checkpoint(Path(tmp), cfg))
    model = LlamaForCausalLM.from_state(mcfg, state)
    del state
    engine = Engine(model, tokenizer, max_seqs=args.max_seqs)
    engine.warm_up(graphs=True)
    setup = {"build_and_warm_up_s": round(time.perf_counter() - t0, 1)}
    setup["kv_blocks"] = engine.stats()["kv_blocks_total"]
    return engine, setup


def ours(args, cfg: dict, device: str, dtype) -> dict:
    engine, setup = build_ours(args, cfg, device, dtype)
    runner = OursRunner(engine, Deadline(time.time() + args.timeout))

    def run(batch: int, new: int, seed: int) -> dict:
        return batch_run(runner, prompts(batch, args.prompt, cfg["vocab_size"], seed), new)

    result = {"setup": setup, "decode": [run(1, args.new, 100 + i) for i in range(3)]}
    result["throughput"] = [run(b, args.new, 200 + b) for b in (64, 256)]
    engine.shutdown()
    return result


def profile(args, cfg: dict, device: str, dtype) -> dict:
    """Where a batch-1 decode step's GPU time goes, kernel by kernel: profile_engine's
    top_kernels over one request's decode under the CUDA graphs, per kernel its launches
    and time per step. Run without dependent launches (OMNI_PDL=0, set by the parent): with
    them a kernel's time includes its wait for the one before."""
    from bench.diagnostics.profile_engine import top_kernels

    engine, _ = build_ours(args, cfg, device, dtype)
    runner = OursRunner(engine, Deadline(time.time() + args.timeout))
    prompt = prompts(1, args.prompt, cfg["vocab_size"], 300)
    runs: list[dict] = []

    def decode() -> None:
        runs.append(batch_run(runner, prompt, args.new))

    if device == "cuda":
        kernels = top_kernels(decode, 25)  # (a first run builds and caches, unprofiled)
    else:  # the harness check (--small): no kernels to profile
        decode()
        kernels = []
    engine.shutdown()
    steps = args.new - 1
    tok_s = runs[-1].get("decode_tok_s")
    return {
        "pdl": os.environ.get("OMNI_PDL", "1") != "0",
        "decode_tok_s": tok_s,
        "step_us": 1e6 / tok_s if tok_s else None,
        "kernels": [
            {
                "kernel": r["kernel"],
                "per_step": r["calls"] / steps,
                "us_per_step": r["cuda_us"] / steps,
                "share": r["share"],
            }
            for r in kernels
        ],
    }


def hf(args, cfg: dict, device: str, dtype) -> dict:
    import transformers

    t0 = time.perf_counter()
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:  # built where it runs, in its dtype (never twice in memory), then overwritten
        with torch.device(device):
            model = transformers.Qwen3MoeForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, shape in tensor_shapes(cfg).items():
            params[name].copy_(random_tensor(name, shape, args.seed, device, dtype))
    setup = {
        "build_s": round(time.perf_counter() - t0, 1),
        "transformers": transformers.__version__,
    }
    setup["experts_implementation"] = getattr(config, "_experts_implementation", None)

    def run(batch: int, new: int, seed: int) -> dict:
        ids = torch.tensor(prompts(batch, args.prompt, cfg["vocab_size"], seed), device=device)
        kw = dict(
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, **kw)  # the first token's cost apart
            torch.cuda.synchronize() if device == "cuda" else None
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kw)
            torch.cuda.synchronize() if device == "cuda" else None
            t2 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            torch.cuda.synchronize() if device == "cuda" else None
            t3 = time.perf_counter()
        tokens = (out.shape[1] - ids.shape[1]) * batch
        res = {"batch": batch, "new_tokens": tokens, "wall_s": round(t3 - t2, 3)}
        res["output_tok_s"] = tokens / (t3 - t2)
        if batch == 1:
            res["decode_tok_s"] = (new - 1) / max(1e-9, (t3 - t2) - (t2 - t1))
        return res

    result = {"setup": setup, "decode": [run(1, args.new, 100)]}
    result["throughput"] = [run(64, args.new, 264)]
    if args.hf_256:
        result["throughput"].append(run(256, args.new, 456))
    return result


# ---------------------------------------------------------------- parent


def child(side: str, args, out: Path, env: dict | None = None) -> dict:
    argv = [sys.executable, __file__, "--phase", side, "--phase-out", str(out)]
    argv += ["--seed", str(args.seed), "--prompt", str(args.prompt), "--new", str(args.new)]
    argv += ["--max-seqs", str(args.max_seqs)] + (["--small"] if args.small else [])
    argv += ["--hf-256"] if args.hf_256 else []
    t0 = time.perf_counter()
    proc = subprocess.run(argv, timeout=args.timeout, env=os.environ | (env or {}))
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit {proc.returncode}", "wall_s": round(time.perf_counter() - t0, 1)}
    return json.loads(out.read_text()) | {"wall_s": round(time.perf_counter() - t0, 1)}


def best(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if key in r]
    return max(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--hf-256", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument(
        "--profile", action="store_true", help="also a batch-1 step's kernels (profiler)"
    )
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--phase", choices=("ours", "hf", "profile"))
    ap.add_argument("--phase-out")
    args = ap.parse_args()
    cfg = qwen3_moe_config(args.small)
    on_gpu = torch.cuda.is_available() and not args.small
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    if args.phase:
        side = {"ours": ours, "hf": hf, "profile": profile}[args.phase]
        Path(args.phase_out).write_text(json.dumps(side(args, cfg, device, dtype)))
        return

    itemsize = torch.empty(0, dtype=dtype).element_size()
    bw = measure_bandwidth(1 << (31 if on_gpu else 26), 50 if on_gpu else 5)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"ours": child("ours", args, Path(tmp) / "ours.json")}
        if not args.no_hf:
            sides["hf"] = child("hf", args, Path(tmp) / "hf.json")
        if args.profile:
            prof = child("profile", args, Path(tmp) / "profile.json", {"OMNI_PDL": "0"})
    # the floor: bytes of a batch-1 step, K/V at the run's mean context included
    weights = active_bytes_per_token(cfg, itemsize)
    kv = kv_bytes_per_token(cfg, itemsize) * (args.prompt + args.new // 2)
    floor_tok_s = bw["bytes_per_s"] / (weights + kv)
    ours_b1 = best(sides["ours"].get("decode", []), "decode_tok_s")
    summary = {
        "floor": {
            "bandwidth_bytes_per_s": bw["bytes_per_s"],
            "active_weight_bytes_per_token": weights,
            "kv_bytes_per_token_at_mean_context": kv,
            "floor_tok_s": floor_tok_s,
            "ours_fraction_of_floor": ours_b1 / floor_tok_s if ours_b1 else None,
        }
    }
    tp = {
        s: {r["batch"]: r["output_tok_s"] for r in d.get("throughput", [])}
        for s, d in sides.items()
    }
    if "hf" in tp and 64 in tp["hf"] and 64 in tp.get("ours", {}):
        summary["ours_vs_hf_at_64"] = tp["ours"][64] / tp["hf"][64]
    name = "moe-small" if args.small else "moe-" + device_name()
    data = {"config": cfg, "args": vars(args), "bandwidth": bw, "sides": sides} | summary
    if args.profile:
        data["batch1_profile"] = prof
    path = write_result(name, data)

    hf_b1 = best(sides.get("hf", {}).get("decode", []), "decode_tok_s")
    print(
        f"\ncopy bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s; a token reads {weights / 1e9:.2f} GB"
    )
    print(f"{'':30s} {'ours':>10s} {'HF':>10s}")
    print(f"{'decode b=1 tok/s':30s} {fmt(ours_b1):>10s} {fmt(hf_b1):>10s}")
    frac = summary["floor"]["ours_fraction_of_floor"]
    print(f"  floor {floor_tok_s:.0f} tok/s; ours at {fmt(frac and 100 * frac)}%")
    for b in (64, 256):
        ours_b, hf_b = fmt(tp["ours"].get(b)), fmt(tp.get("hf", {}).get(b))
        print(f"{f'batch {b} out tok/s':30s} {ours_b:>10s} {hf_b:>10s}")
    if "ours_vs_hf_at_64" in summary:
        print(f"ours / HF at batch 64: {summary['ours_vs_hf_at_64']:.2f}x")
    for s, d in sides.items():
        if "error" in d:
            print(f"{s}: {d['error']}")
    if args.profile and "kernels" in prof:
        print(f"\nbatch-1 step without dependent launches: {fmt(prof['step_us'])} us, of which")
        for r in prof["kernels"][:12]:
            print(f"{r['us_per_step']:9.1f} us {r['per_step']:6.1f}x  {r['kernel'][:70]}")
    print(f"wrote {path}")


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def device_name() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return "h100" if "H100" in name else "h200" if "H200" in name else name.split()[-1].lower()


if __name__ == "__main__":
    main()
