"""KV beyond the GPU pool and disaggregated prefill, under an agentic trace.

The trace: `--sessions` conversations of `--turns` turns each, all open at once, each
turn sent when the session's last answer is in (closed loop), `--concurrency` requests
served at a time (the others queue, so sessions interleave and evict each other's KV). A session's
first prompt is `--first` random tokens; each later turn repeats the whole conversation
(prompt and answer) and adds `--grow` new tokens, so prompts grow from 8k to 32k tokens
by default; answers are `--out` tokens. Each session is its own principal, as with
x-session-affinity. The model is Llama-3-8B's shape with random bf16 weights (engine_bench's
checkpoint, its context raised to 64k); the engines run in this process.

(a) Tiers, one GPU: the same trace on an engine whose GPU pool holds `--pool-gib` of KV
    (fewer tokens than the sessions keep), alone; with a host tier of `--host-gib`; and
    with a small host tier over a disk tier (`--disk-gib`, under --disk-dir).
(b) Disaggregation, two GPUs: two colocated engines (a session stays on one, by its index)
    against one prefill engine on GPU 0 and one decode engine on GPU 1, the prompt's K/V
    handed through a file on /dev/shm (kv_transfer.py, as omnid does). Skipped, and said
    so in the result, with fewer than two GPUs.

Per run: the input-token cache hit ratio (cached prompt tokens over all prompt tokens),
time to first token p50/p90, inter-token latency p50/p99, requests per second. Prints a
table, writes bench/results/kv-<device>.json. --small: a tiny shape on the CPU, to check
the harness.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import engine_bench as eb  # noqa: E402
from bench.results_io import write_result  # noqa: E402
from omni.engine import kv_transfer  # noqa: E402
from omni.engine.engine import Engine, GenerationRequest  # noqa: E402
from omni.engine.sampling import SamplingParams  # noqa: E402

GIB = 1 << 30


@dataclass
class Rec:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int = 0
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between streamed tokens
    handoff_s: float = 0.0  # (b) the prefill side's compute and the K/V's move


def new_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


class Colocated:
    """Engines that each serve whole requests; a session stays on one (affinity)."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines

    async def serve(self, rec: Rec, prompt: list[int], params: SamplingParams) -> list[int]:
        engine = self.engines[rec.session % len(self.engines)]
        return await stream(engine, GenerationRequest(prompt, params, f"s{rec.session}"), rec)


class Disaggregated:
    """A prefill engine and a decode engine, the prompt's blocks handed over on /dev/shm."""

    def __init__(self, prefill: Engine, decode: Engine, shm: Path):
        self.prefill, self.decode, self.shm = prefill, decode, shm

    async def serve(self, rec: Rec, prompt: list[int], params: SamplingParams) -> list[int]:
        who = f"s{rec.session}"
        t0 = time.perf_counter()
        request = GenerationRequest(prompt, params, who)
        handoff = await self.prefill.prefill_handoff(prompt, who)
        if handoff is not None:
            path = kv_transfer.handoff_path(self.shm, uuid.uuid4().hex)
            await asyncio.to_thread(kv_transfer.write, path, handoff)
            moved = await asyncio.to_thread(kv_transfer.read, path)
            path.unlink()
            request.kv_import, request.prior_cached_tokens = moved.payloads(), moved.cached_tokens
        rec.handoff_s = time.perf_counter() - t0
        tokens = await stream(self.decode, request, rec, t0)
        return tokens


async def stream(engine: Engine, request: GenerationRequest, rec: Rec, t0: float | None = None):
    t0 = time.perf_counter() if t0 is None else t0
    tokens, last = [], None
    async for out in engine.stream(request):
        now = time.perf_counter()
        if out.token_ids:
            if not tokens:
                rec.ttft_s = now - t0
            elif last is not None:
                rec.gaps_s.append(now - last)
            last = now
            tokens += out.token_ids
        if out.finished:
            assert out.finish_reason != "error", out.error
            rec.cached_tokens = out.cached_tokens
    return tokens


async def run_trace(server, args, vocab: int) -> tuple[list[Rec], float]:
    params = SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(args.concurrency)
    recs: list[Rec] = []

    async def session(i: int) -> None:
        rng = np.random.default_rng(1000 + i)  # the same trace for every run
        prompt = new_tokens(rng, args.first, vocab)
        for turn in range(args.turns):  # every session is open; its turns queue for a slot
            rec = Rec(i, turn, len(prompt))
            async with gate:
                answer = await server.serve(rec, prompt, params)
            recs.append(rec)
            prompt = prompt + answer + new_tokens(rng, args.grow, vocab)

    t0 = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(args.sessions)))
    return recs, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary(recs: list[Rec], wall_s: float) -> dict:
    gaps = [g for r in recs for g in r.gaps_s]
    ttft = [r.ttft_s for r in recs]
    return {
        "requests": len(recs),
        "prompt_tokens": sum(r.prompt_tokens for r in recs),
        "cached_tokens": sum(r.cached_tokens for r in recs),
        "hit_ratio": sum(r.cached_tokens for r in recs) / sum(r.prompt_tokens for r in recs),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "itl_p50_s": pct(gaps, 50),
        "itl_p99_s": pct(gaps, 99),
        "handoff_p50_s": statistics.median(r.handoff_s for r in recs),
        "wall_s": wall_s,
        "requests_per_s": len(recs) / wall_s,
        "raw": [vars(r) | {"gaps_s": [round(g, 5) for g in r.gaps_s]} for r in recs],
    }


def block_bytes(model, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.cfg
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def make_engine(model, tok, args, pool_bytes: int, **tiers) -> Engine:
    dtype = torch.float32 if args.small else torch.bfloat16
    engine = Engine(model, tok, num_blocks=pool_bytes // block_bytes(model, 16, dtype), **tiers)
    engine.warm_up()
    return engine


def part_tiers(model, tok, args, vocab: int) -> dict:
    pool = int(args.pool_gib * GIB)
    runs = {
        "pool only": {},
        "pool + host": {"host_cache_bytes": int(args.host_gib * GIB)},
        "pool + host + disk": {
            "host_cache_bytes": int(args.disk_host_gib * GIB),
            "disk_cache_bytes": int(args.disk_gib * GIB),
            "disk_cache_dir": tempfile.mkdtemp(prefix="omni-kv-", dir=args.disk_dir),
        },
    }
    out = {}
    for name, tiers in runs.items():
        engine = make_engine(model, tok, args, pool, **tiers)
        try:
            recs, wall = asyncio.run(run_trace(Colocated([engine]), args, vocab))
            out[name] = summary(recs, wall) | {"engine": engine.stats()}
        finally:
            engine.shutdown()
            del engine
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        print(f"  {name}: done in {wall:.1f}s", flush=True)
    return out


def part_disaggregated(ckpt, args, vocab: int) -> dict:
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.tokenizer import TextTokenizer

    if not args.small and torch.cuda.device_count() < 2:
        return {"skipped": f"needs two GPUs; this machine has {torch.cuda.device_count()}"}
    devices = ["cpu", "cpu"] if args.small else ["cuda:0", "cuda:1"]
    dtype = torch.float32 if args.small else torch.bfloat16
    models = [LlamaForCausalLM.load(ckpt, d, dtype) for d in devices]
    tok = TextTokenizer(ckpt)
    pool = int(args.pool_gib * GIB)
    out = {}
    shm = Path(tempfile.mkdtemp(prefix="omni-handoff-", dir="/dev/shm"))
    for name in ("colocated x2", "1 prefill + 1 decode"):
        engines = []
        for model, device in zip(models, devices, strict=True):
            with torch.cuda.device(device) if device.startswith("cuda") else nullcontext():
                engines.append(make_engine(model, tok, args, pool))
        server = (
            Colocated(engines) if name.startswith("colocated") else Disaggregated(*engines, shm)
        )
        try:
            recs, wall = asyncio.run(run_trace(server, args, vocab))
            out[name] = summary(recs, wall)
        finally:
            for engine in engines:
                engine.shutdown()
        print(f"  {name}: done in {wall:.1f}s", flush=True)
    return out


def print_table(res: dict) -> None:
    print(
        f"\n{'run':<24}{'hit ratio':>10}{'TTFT p50':>10}{'TTFT p90':>10}"
        f"{'ITL p50':>10}{'ITL p99':>10}{'req/s':>8}"
    )
    for part in ("tiers", "disaggregated"):
        for name, r in res.get(part, {}).items():
            if not isinstance(r, dict):
                print(f"{name:<24}{r}")
                continue
            print(
                f"{name:<24}{r['hit_ratio']:>10.1%}{r['ttft_p50_s']:>9.3f}s{r['ttft_p90_s']:>9.3f}s"
                f"{r['itl_p50_s'] * 1e3:>8.1f}ms{r['itl_p99_s'] * 1e3:>8.1f}ms"
                f"{r['requests_per_s']:>8.2f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--parts", default="tiers,disaggregated")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--first", type=int, default=8192)
    ap.add_argument("--grow", type=int, default=8192)
    ap.add_argument("--out", type=int, default=32)
    ap.add_argument("--pool-gib", type=float, default=6.0)  # 48k tokens: under 2 x 32k
    ap.add_argument("--host-gib", type=float, default=24.0)
    ap.add_argument("--disk-host-gib", type=float, default=2.0)
    ap.add_argument("--disk-gib", type=float, default=24.0)
    ap.add_argument("--disk-dir", default="/tmp")
    ap.add_argument("--ckpt-root", default="/tmp/omni-engine-bench")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if args.small:
        args.first, args.grow, args.out, args.sessions = 40, 24, 4, 3
        args.pool_gib, args.host_gib = 1 / 1024, 4 / 1024  # 16 blocks; 64
        args.disk_host_gib, args.disk_gib = 0.15 / 1024, 4 / 1024  # 2 blocks; 64
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.tokenizer import TextTokenizer

    cfg = eb.llama3_8b_config(args.small)
    if not args.small:
        cfg["max_position_embeddings"] = 65536
    path, _ = eb.write_checkpoint(Path(args.ckpt_root), cfg, 4, 0)
    ckpt = Checkpoint.open(path)
    vocab = cfg["vocab_size"]
    res: dict = {"config": {k: v for k, v in vars(args).items()}}
    if "tiers" in args.parts:
        device, dtype = ("cpu", torch.float32) if args.small else eb.engine_device()
        model = LlamaForCausalLM.load(ckpt, device, dtype)
        res["tiers"] = part_tiers(model, TextTokenizer(ckpt), args, vocab)
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if "disaggregated" in args.parts:
        res["disaggregated"] = part_disaggregated(ckpt, args, vocab)
    print_table(res)
    gpus = torch.cuda.device_count()
    if gpus:
        gpu = torch.cuda.get_device_name(0).lower()
        kind = next((k for k in ("h100", "h200") if k in gpu), "gpu")
    name = args.name or (f"kv-{kind}x{gpus}" if gpus else "kv-cpu")
    print("wrote", write_result(name, res))


if __name__ == "__main__":
    main()
