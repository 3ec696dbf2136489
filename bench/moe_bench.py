"""OMNI's engine against HF transformers on a mixture of experts of a published shape.

--shape qwen3-30b-a3b (the default): Qwen3-30B-A3B; --shape moonlight-16b-a3b:
Moonlight-16B-A3B, DeepSeek-V3's architecture (MLA attention, sigmoid-routed experts
beside shared ones, a dense first layer). Random bf16 weights (std 0.02, norms 1), made
on the GPU in each side's own process from one seed, tensor by tensor: both sides run
the same numbers and nothing goes to disk (the lent machine's disk holds 64 GB); each
side runs in a child process of its own, one after the other, so only one copy of the
weights (about 61 GB for Qwen3, 32 GB for Moonlight) is on the GPU at a time. Measured:

1. decode at batch 1: a 128-token prompt, 128 new tokens (greedy, no EOS), tok/s after
   the first token; and its fraction of the floor for the bytes a token actually reads
   (the top-k experts of each layer, the shared experts and dense MLPs, attention,
   norms, router, the lm head, one embedding row, its K/V) at the copy bandwidth
   measured here;
2. throughput at batch 64 and 256: that many 128-token prompts, 128 new tokens each,
   all submitted at once (HF: one padded generate call of the batch; 256 only with
   --hf-256, it is slow); ours also per decode step (the engine's step timeline), against
   the floor of the bytes a step reads: the distinct experts B tokens hit (E (1 - (1 -
   k/E)^B) a layer, routing uniform), every other weight once, each row's K/V;

and ours against HF at batch 64 (the issue asks for at least 5x), and the K/V bytes a
token against Llama-3-8B's (131,072). --profile adds where a batch-1 step's GPU time
goes, kernel by kernel (in a child of its own, without dependent launches;
"batch1_profile"). --quantized (DeepSeek-V3's architecture): batch-1 decode of the same
model with its weights as DeepSeek-V3 and Kimi K2.5 ship them, block-FP8 (every
projection of the layers) and INT4 by groups of 32 (the routed experts), each in a child
of its own, against bf16; with --profile, each one's batch-1 step too
("batch1_profile_fp8", "batch1_profile_int4"). Prints a table, writes
bench/results/moe-<device>.json (Qwen3) or moe-moonlight-<device>.json. --small: a tiny
shape on the CPU, to check the harness.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from bench.engine_bench import (  # noqa: E402
    Deadline,
    JitBuilds,
    OursRunner,
    StepTimeline,
    batch_run,
    measure_bandwidth,
)
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


def moonlight_config(small: bool) -> dict:
    """Moonlight-16B-A3B's shape (moonshotai's config.json, DeepSeek-V3's architecture) as
    an HF config (or a tiny one); no EOS."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 2048,
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "intermediate_size": 11264,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.446,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 163840,
        "rope_theta": 50000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if small:
        cfg.update(hidden_size=128, num_hidden_layers=2, intermediate_size=256)
        cfg.update(moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2)
        cfg.update(n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4)
        cfg.update(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
        cfg.update(vocab_size=512, max_position_embeddings=512)
    return cfg


SHAPES = {"qwen3-30b-a3b": qwen3_moe_config, "moonlight-16b-a3b": moonlight_config}
RESULT_NAMES = {"qwen3-30b-a3b": "moe", "moonlight-16b-a3b": "moe-moonlight"}
LLAMA3_8B_KV_BYTES = 2 * 8 * 128 * 32 * 2  # K and V, 8 KV heads of 128, 32 layers, bf16


def routed_experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg["n_routed_experts"]


def is_routed(name: str) -> bool:
    """Whether a tensor (HF name) holds the routed experts (not the shared ones)."""
    return ".mlp.experts." in name


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF's parameter (and score-bias buffer) names and shapes, the routed experts stacked
    as transformers 5 keeps them."""
    if cfg["model_type"] == "deepseek_v3":
        return deepseek_shapes(cfg)
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


def deepseek_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """tensor_shapes for DeepSeek-V3's architecture: MLA (q_proj or its low-rank pair,
    the latent's projection and norm, kv_b_proj), dense MLPs in the first
    first_k_dense_replace layers, routed and shared experts after."""
    h, heads, e = cfg["hidden_size"], cfg["num_attention_heads"], cfg["n_routed_experts"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    latent, q_rank, inter = cfg["kv_lora_rank"], cfg["q_lora_rank"], cfg["moe_intermediate_size"]
    shared = inter * cfg["n_shared_experts"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        a = p + "self_attn."
        if q_rank is None:
            shapes[a + "q_proj.weight"] = (heads * (nope + rope), h)
        else:
            shapes[a + "q_a_proj.weight"] = (q_rank, h)
            shapes[a + "q_a_layernorm.weight"] = (q_rank,)
            shapes[a + "q_b_proj.weight"] = (heads * (nope + rope), q_rank)
        shapes |= {
            a + "kv_a_proj_with_mqa.weight": (latent + rope, h),
            a + "kv_a_layernorm.weight": (latent,),
            a + "kv_b_proj.weight": (heads * (nope + v), latent),
            a + "o_proj.weight": (h, heads * v),
        }
        if i < cfg["first_k_dense_replace"]:
            mlp = {"mlp.": cfg["intermediate_size"]}
        else:
            mlp = {"mlp.shared_experts.": shared}
            shapes |= {
                p + "mlp.gate.weight": (e, h),
                p + "mlp.gate.e_score_correction_bias": (e,),
                p + "mlp.experts.gate_up_proj": (e, 2 * inter, h),
                p + "mlp.experts.down_proj": (e, h, inter),
            }
        for m, width in mlp.items():
            shapes |= {
                p + m + "gate_proj.weight": (width, h),
                p + m + "up_proj.weight": (width, h),
                p + m + "down_proj.weight": (h, width),
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


def distinct_experts(experts: int, k: int, tokens: int) -> float:
    """The experts a layer reads for `tokens` tokens of k distinct picks each, expected,
    routing uniform: each expert is missed by a token with probability 1 - k/E."""
    return experts * (1 - (1 - k / experts) ** tokens)


def step_bytes(cfg: dict, itemsize: int, batch: int, context: int) -> dict:
    """What a decode step of `batch` rows reads at least: every weight but the routed
    experts and the embedding once, the distinct experts the rows hit in each layer, one
    embedding row a row, and each row's K/V over `context` tokens."""
    e, k = routed_experts(cfg), cfg["num_experts_per_tok"]
    hit = distinct_experts(e, k, batch)
    weights = 0
    for name, shape in tensor_shapes(cfg).items():
        n = int(np.prod(shape))
        if is_routed(name):
            n = round(n / e * hit)
        elif name == "model.embed_tokens.weight":
            n = shape[1] * batch
        weights += n * itemsize
    kv = kv_bytes_per_token(cfg, itemsize) * context * batch
    return {"weights": weights, "kv": kv, "total": weights + kv, "experts_hit_per_layer": hit}


def active_bytes_per_token(cfg: dict, itemsize: int) -> int:
    """What a batch-1 decode step reads at least, but for its K/V: each layer's attention
    projections, norms, router, shared experts or dense MLP and its top-k experts, the
    final norm and lm head, one embedding row."""
    return step_bytes(cfg, itemsize, 1, 0)["weights"]


def kv_bytes_per_token(cfg: dict, itemsize: int) -> int:
    """A token's cache rows over all layers: K and V per KV head, or MLA's one latent and
    rope key."""
    layers = cfg["num_hidden_layers"]
    if cfg["model_type"] == "deepseek_v3":
        return (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * layers * itemsize
    heads_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    return 2 * layers * heads_dim * itemsize


# ---------------------------------------------------------------- the two sides

THROUGHPUT_BATCHES = (64, 256)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


# the projections DeepSeek-V3's FP8 checkpoints store in block FP8 (all in the layers)
FP8_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                   "o_proj", "gate_proj", "up_proj", "down_proj")  # fmt: skip


def stored(name: str, t: torch.Tensor, weights: str) -> dict[str, torch.Tensor]:
    """A tensor (HF name) as a checkpoint of `weights` stores it: "fp8", every projection
    of the layers in e4m3 with a scale a 128 x 128 block; "int4", the routed experts
    packed eight to an int32 with a bf16 scale a group of 32 (Kimi K2.5); else as it is.
    Random values of the bf16 weights' size (the speed does not depend on them)."""
    base, proj = name.removesuffix(".weight"), name.removesuffix(".weight").rsplit(".", 1)[-1]
    if weights == "bf16" or t.dim() != 2 or ".layers." not in name:
        return {name: t}
    n, k = t.shape
    if weights == "fp8" and proj in FP8_PROJECTIONS:
        scale = 0.02 / 64  # std 0.02 as about 64: well inside e4m3's range
        blocks = torch.full((-(-n // 128), -(-k // 128)), scale, device=t.device)
        return {
            name: (t.float() / scale).to(torch.float8_e4m3fn),
            base + ".weight_scale_inv": blocks,
        }
    if weights == "int4" and is_routed(name):
        packed = torch.randint(-(2**31), 2**31 - 1, (n, -(-k // 8)), dtype=torch.int32,
                               device=t.device)  # fmt: skip
        scale = torch.full((n, -(-k // 32)), 0.02 / 4, dtype=torch.bfloat16, device=t.device)
        shape = torch.tensor([n, k], dtype=torch.int64, device=t.device)
        return {base + ".weight_packed": packed, base + ".weight_scale": scale,
                base + ".weight_shape": shape}  # fmt: skip
    return {name: t}


def build_ours(args, cfg: dict, device: str, dtype, weights: str = "bf16"):
    """Our engine on the random weights, warmed up with its CUDA graphs: (engine, setup).
    `weights`: "fp8" or "int4" store them as stored() says (DeepSeek-V3's architecture)."""
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
    from omni.engine.engine import Engine
    from omni.engine.llama import LlamaConfig, LlamaForCausalLM
    from omni.engine.quant_weights import FP8_BLOCK, INT4_GROUP, WeightScheme
    from omni.testing.checkpoints import text_tokenizer

    deepseek = cfg["model_type"] == "deepseek_v3"
    config_class = DeepseekV3Config if deepseek else LlamaConfig
    model_class = DeepseekV3ForCausalLM if deepseek else LlamaForCausalLM
    scheme = {"fp8": WeightScheme(FP8_BLOCK), "int4": WeightScheme(INT4_GROUP)}.get(weights)

    t0 = time.perf_counter()
    state = {}
    for name, shape in tensor_shapes(cfg).items():
        t = random_tensor(name, shape, args.seed, device, dtype)
        if name.endswith("experts.gate_up_proj"):  # as the Hub ships them: one per expert
            prefix, inter = name.removesuffix("experts.gate_up_proj"), shape[1] // 2
            for e in range(shape[0]):
                gate, up = (
                    f"{prefix}experts.{e}.gate_proj.weight",
                    f"{prefix}experts.{e}.up_proj.weight",
                )
                state |= stored(gate, t[e, :inter], weights) | stored(up, t[e, inter:], weights)
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("experts.down_proj")
            for e in range(shape[0]):
                state |= stored(f"{prefix}experts.{e}.down_proj.weight", t[e], weights)
        else:
            state |= stored(name, t, weights)
        del t
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = text_tokenizer(Path(tmp), cfg["vocab_size"])
        mcfg = config_class.from_checkpoint(Checkpoint(Path(tmp), cfg))
    if scheme is None:
        model = model_class.from_state(mcfg, state)
    else:
        mcfg = dataclasses.replace(mcfg, quantization=scheme.kind)
        model = model_class.from_state(mcfg, state, "random", scheme)
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

    def timed_steps(batch: int) -> dict:
        """run() at `batch`, with its decode steps' rate at the full batch (the step
        timeline's band that holds it)."""
        with StepTimeline(engine) as timeline, JitBuilds() as jit:
            res = run(batch, args.new, 200 + batch)
        res["steps"] = steps = timeline.summary(time.perf_counter())
        res["jit_builds"] = jit.result()  # kernels the warm-up missed: their steps waited
        lo, hi = next(b for b in StepTimeline.DECODE_BANDS if b[0] <= batch <= b[1])
        band = steps.get(f"decode b={lo}-{hi}")
        res["decode_step_tok_s"] = 1e3 * batch / band["ms_per_step"] if band else None
        return res

    result = {"setup": setup, "decode": [run(1, args.new, 100 + i) for i in range(3)]}
    result["throughput"] = [timed_steps(b) for b in THROUGHPUT_BATCHES]
    engine.shutdown()
    return result


def quantized_decode(args, cfg: dict, device: str, dtype) -> dict:
    """Batch-1 decode (three runs) of the model in args.weights (stored())."""
    engine, setup = build_ours(args, cfg, device, dtype, args.weights)
    runner = OursRunner(engine, Deadline(time.time() + args.timeout))
    runs = [batch_run(runner, prompts(1, args.prompt, cfg["vocab_size"], 100 + i), args.new)
            for i in range(3)]  # fmt: skip
    engine.shutdown()
    return {"weights": args.weights, "setup": setup, "decode": runs}


def profile(args, cfg: dict, device: str, dtype) -> dict:
    """Where a batch-1 decode step's GPU time goes, kernel by kernel: profile_engine's
    top_kernels over one request's decode under the CUDA graphs, per kernel its launches
    and time per step. Run without dependent launches (OMNI_PDL=0, set by the parent): with
    them a kernel's time includes its wait for the one before."""
    from bench.diagnostics.profile_engine import top_kernels

    engine, _ = build_ours(args, cfg, device, dtype, args.weights)
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
    steps = args.new - 1
    tok_s = runs[-1].get("decode_tok_s")
    result = {
        "pdl": os.environ.get("OMNI_PDL", "1") != "0",
        "decode_tok_s": tok_s,
        "step_us": 1e6 / tok_s if tok_s else None,
        "kernels": per_step(kernels, steps),
        "batches": {},
    }
    for batch in args.profile_batches if device == "cuda" else []:
        result["batches"][str(batch)] = batch_profile(engine, batch, args.prompt + args.new // 2)
    engine.shutdown()
    return result


def per_step(kernels: list[dict], steps: int) -> list[dict]:
    return [
        {
            "kernel": r["kernel"],
            "per_step": r["calls"] / steps,
            "us_per_step": r["cuda_us"] / steps,
            "share": r["share"],
        }
        for r in kernels
    ]


def batch_profile(engine, batch: int, context: int) -> dict:
    """One decode step of `batch` sequences at `context` tokens each, as the engine runs
    it (its CUDA graph where one holds the batch): its GPU time, and by kernel."""
    from bench.diagnostics.profile_engine import cuda_ms, decode_batch, top_kernels

    runner = engine.runner
    step = decode_batch(runner, batch, context)
    inputs = runner.prepare_inputs(step, {})

    def run() -> None:
        runner.run_inputs(inputs, None)

    repeats = 20
    ms = cuda_ms(run, repeats)
    kernels = top_kernels(lambda: [run() for _ in range(repeats)], 25)
    return {"context": context, "step_ms": ms, "kernels": per_step(kernels, repeats)}


def hf(args, cfg: dict, device: str, dtype) -> dict:
    import transformers

    t0 = time.perf_counter()
    arch = "DeepseekV3" if cfg["model_type"] == "deepseek_v3" else "Qwen3Moe"
    config_class = getattr(transformers, arch + "Config")
    config = config_class(**{k: v for k, v in cfg.items() if k != "architectures"})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:  # built where it runs, in its dtype (never twice in memory), then overwritten
        with torch.device(device):
            model = getattr(transformers, arch + "ForCausalLM")(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():  # (DeepSeek-V3's score bias is a buffer)
        params = dict(model.named_parameters()) | dict(model.named_buffers())
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
    argv += ["--shape", args.shape, "--seed", str(args.seed), "--prompt", str(args.prompt)]
    argv += ["--new", str(args.new)]
    argv += ["--max-seqs", str(args.max_seqs)] + (["--small"] if args.small else [])
    argv += ["--hf-256"] if args.hf_256 else []
    argv += ["--profile-batches", ",".join(map(str, args.profile_batches))]
    argv += ["--weights", args.weights]
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
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
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
    ap.add_argument(
        "--profile-batches",
        type=lambda s: [int(b) for b in s.split(",") if b],
        default=[],
        help="with --profile: decode steps of these batch sizes too, kernel by kernel",
    )
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument(
        "--quantized", action="store_true", help="also batch-1 decode in block-FP8 and INT4"
    )
    ap.add_argument("--weights", choices=("bf16", "fp8", "int4"), default="bf16")
    ap.add_argument("--phase", choices=("ours", "hf", "profile", "quantized"))
    ap.add_argument("--phase-out")
    args = ap.parse_args()
    cfg = SHAPES[args.shape](args.small)
    on_gpu = torch.cuda.is_available() and not args.small
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    if args.phase:
        side = {"ours": ours, "hf": hf, "profile": profile, "quantized": quantized_decode}
        side = side[args.phase]
        Path(args.phase_out).write_text(json.dumps(side(args, cfg, device, dtype)))
        return

    itemsize = torch.empty(0, dtype=dtype).element_size()
    bw = measure_bandwidth(1 << (31 if on_gpu else 26), 50 if on_gpu else 5)
    quantized_profiles: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"ours": child("ours", args, Path(tmp) / "ours.json")}
        if not args.no_hf:
            sides["hf"] = child("hf", args, Path(tmp) / "hf.json")
        if args.profile:
            prof = child("profile", args, Path(tmp) / "profile.json", {"OMNI_PDL": "0"})
        if args.quantized and cfg["model_type"] == "deepseek_v3":
            for weights in ("fp8", "int4"):
                quant_args = argparse.Namespace(**{**vars(args), "weights": weights})
                out = Path(tmp) / f"{weights}.json"
                sides[f"ours-{weights}"] = child("quantized", quant_args, out)
                if args.profile:  # its batch-1 step too
                    quant_args.profile_batches = []
                    out = Path(tmp) / f"profile-{weights}.json"
                    quantized_profiles[weights] = child(
                        "profile", quant_args, out, {"OMNI_PDL": "0"}
                    )
    # the floors: the bytes of a step at batch 1, 64 and 256, K/V at the run's mean context
    context = args.prompt + args.new // 2
    weights = active_bytes_per_token(cfg, itemsize)
    kv = kv_bytes_per_token(cfg, itemsize) * context
    floor_tok_s = bw["bytes_per_s"] / (weights + kv)
    ours_b1 = best(sides["ours"].get("decode", []), "decode_tok_s")
    kv_token = kv_bytes_per_token(cfg, itemsize)
    summary = {
        "floor": {
            "bandwidth_bytes_per_s": bw["bytes_per_s"],
            "active_weight_bytes_per_token": weights,
            "kv_bytes_per_token_at_mean_context": kv,
            "floor_tok_s": floor_tok_s,
            "ours_fraction_of_floor": ours_b1 / floor_tok_s if ours_b1 else None,
            "batches": batch_floors(cfg, itemsize, context, bw, sides["ours"]),
        },
        "kv_bytes_per_token": kv_token,
        "kv_bytes_per_token_vs_llama3_8b": kv_token / LLAMA3_8B_KV_BYTES,
    }
    tp = {
        s: {r["batch"]: r["output_tok_s"] for r in d.get("throughput", [])}
        for s, d in sides.items()
    }
    if "hf" in tp and 64 in tp["hf"] and 64 in tp.get("ours", {}):
        summary["ours_vs_hf_at_64"] = tp["ours"][64] / tp["hf"][64]
    name = RESULT_NAMES[args.shape] + ("-small" if args.small else "-" + device_name())
    data = {"config": cfg, "args": vars(args), "bandwidth": bw, "sides": sides} | summary
    if args.profile:
        data["batch1_profile"] = prof
        for w, p in quantized_profiles.items():
            data[f"batch1_profile_{w}"] = p
    quantized = {
        w: best(sides[f"ours-{w}"].get("decode", []), "decode_tok_s")
        for w in ("fp8", "int4")
        if f"ours-{w}" in sides
    }
    if quantized:
        data["quantized_batch1"] = {"bf16": ours_b1, **quantized} | {
            f"{w}_vs_bf16": v / ours_b1 for w, v in quantized.items() if v and ours_b1
        }
    path = write_result(name, data)

    hf_b1 = best(sides.get("hf", {}).get("decode", []), "decode_tok_s")
    print(
        f"\ncopy bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s; a token reads {weights / 1e9:.2f} GB"
    )
    print(f"{'':30s} {'ours':>10s} {'HF':>10s}")
    print(f"{'decode b=1 tok/s':30s} {fmt(ours_b1):>10s} {fmt(hf_b1):>10s}")
    frac = summary["floor"]["ours_fraction_of_floor"]
    print(f"  floor {floor_tok_s:.0f} tok/s; ours at {fmt(frac and 100 * frac)}%")
    for b in THROUGHPUT_BATCHES:
        ours_b, hf_b = fmt(tp["ours"].get(b)), fmt(tp.get("hf", {}).get(b))
        print(f"{f'batch {b} out tok/s':30s} {ours_b:>10s} {hf_b:>10s}")
        f = summary["floor"]["batches"][b]
        print(
            f"  decode steps {fmt(f['ours_decode_step_tok_s'])} tok/s; floor"
            f" {f['floor_tok_s']:.0f} ({f['experts_hit_per_layer']:.1f} experts a layer,"
            f" {f['step_bytes'] / 1e9:.2f} GB a step); ours at"
            f" {fmt(f['ours_fraction'] and 100 * f['ours_fraction'])}%"
        )
    print(
        f"K/V a token {kv_token} bytes: {summary['kv_bytes_per_token_vs_llama3_8b']:.3f}x"
        f" Llama-3-8B's {LLAMA3_8B_KV_BYTES}"
    )
    if "ours_vs_hf_at_64" in summary:
        print(f"ours / HF at batch 64: {summary['ours_vs_hf_at_64']:.2f}x")
    for w, v in quantized.items():
        ratio = f" ({v / ours_b1:.2f}x bf16)" if v and ours_b1 else ""
        print(f"{f'decode b=1 tok/s, {w}':30s} {fmt(v):>10s}{ratio}")
    for s, d in sides.items():
        if "error" in d:
            print(f"{s}: {d['error']}")
    if args.profile and "kernels" in prof:
        print_kernels(f"batch-1 step without dependent launches: {fmt(prof['step_us'])} us",
                      prof["kernels"][:12])  # fmt: skip
        for b, p in prof.get("batches", {}).items():
            title = f"batch-{b} decode step at {p['context']} tokens: {p['step_ms']:.2f} ms"
            print_kernels(title, p["kernels"][:15])
    for w, p in quantized_profiles.items():
        if "kernels" not in p:
            print(f"\nprofile, {w}: {p.get('error')}")
            continue
        title = f"batch-1 step in {w}, without dependent launches: {fmt(p['step_us'])} us"
        print_kernels(title, p["kernels"][:12])
    print(f"wrote {path}")


def print_kernels(title: str, kernels: list[dict]) -> None:
    """A profile's kernels (per_step's rows) under `title`: time and launches a step."""
    print(f"\n{title}, of which")
    for r in kernels:
        print(f"{r['us_per_step']:9.1f} us {r['per_step']:6.1f}x  {r['kernel'][:70]}")


def batch_floors(cfg: dict, itemsize: int, context: int, bw: dict, ours: dict) -> dict:
    """Per throughput batch: the bytes a decode step reads (step_bytes), the rate their
    copy at the measured bandwidth allows, and ours (its decode steps) against it."""
    runs = {r["batch"]: r for r in ours.get("throughput", [])}
    floors = {}
    for b in THROUGHPUT_BATCHES:
        need = step_bytes(cfg, itemsize, b, context)
        floor = b * bw["bytes_per_s"] / need["total"]
        got = runs.get(b, {}).get("decode_step_tok_s")
        floors[b] = {
            "step_bytes": need["total"],
            "weight_bytes": need["weights"],
            "kv_bytes": need["kv"],
            "experts_hit_per_layer": need["experts_hit_per_layer"],
            "floor_tok_s": floor,
            "ours_decode_step_tok_s": got,
            "ours_fraction": got / floor if got else None,
        }
    return floors


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def device_name() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return "h100" if "H100" in name else "h200" if "H200" in name else name.split()[-1].lower()


if __name__ == "__main__":
    main()
