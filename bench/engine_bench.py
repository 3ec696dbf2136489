"""OMNI's engine against HF transformers `generate` on a Llama-3-8B-shaped checkpoint.

One run, one GPU, both sides on the same random bf16 checkpoint (HF safetensors shards,
config.json and a word-level tokenizer written under --ckpt-root, reused when present):

0. check: our greedy tokens for a few prompts against HF's; the match length of each, and
   at the first difference HF's logit gap between the two tokens (a near-tie is bf16 noise);
1. decode: batch-1 tok/s (128-token prompt, 256 new tokens, greedy, no EOS) and its
   fraction of the bandwidth floor (copy bandwidth measured here / weight bytes; also
   without the embedding table, of which a step reads one row);
2. offline: 1000 requests of a ShareGPT-like length mix (lognormal, fixed seed) and a
   512-in/256-out set at batch 128: output and total tok/s, ours and HF (the issue asks
   ours >= 6x HF on the fixed set; HF on the mix only with --hf-sharegpt), and for each
   set the bytes floor: the longest request's steps each read the weights, every decode
   step its K/V, at the measured copy bandwidth (no engine runs faster at bf16);
3. online: the instance's own HTTP server (omni.runtime.worker, OpenAI /v1/completions,
   streaming) at 3 Poisson request rates: TTFT and inter-token latency p50/p90/p99;
4. CPU seconds of the engine process (children included) per wall second in 2 and 3;
5. cold start: a fresh process from start to first token and to ready for the full batch
   (page cache warm), and the worker's start to ready.

Each side runs in its own child process (this script with --phase), so GPU memory, the KV
pool's sizing and the CPU accounting are the engine's alone. Prints a table and writes
bench/results/engine-<device>.json. --small: a tiny model on the CPU, a few requests, to
check the whole harness in a minute or two anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import queue
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from bench.overcommit_bench import hf_config, percentile, tensor_shapes  # noqa: E402
from bench.results_io import RESULTS, write_result  # noqa: E402
from bench.results_io import device as device_info  # noqa: E402
from omni.instance.settings import InstanceSettings  # noqa: E402
from omni.testing.checkpoints import save_word_level_tokenizer  # noqa: E402

PARTS = ("check", "decode", "offline", "online", "coldstart")
INTERNAL = {"phase", "phase_out", "deadline_at", "ckpt", "peer"}  # a child's own arguments
TIE = 0.05  # a first difference where HF's gap < TIE x its logits' std is a near-tie
CHECK_LENGTHS = (7, 64, 300, 1000, 17, 128, 511, 40)
MIN_PHASE_S = 15.0  # a phase is not started with less time than this left


def llama3_8b_config(small: bool) -> dict:
    """Llama-3-8B's shape (or a tiny one) as an HF config.json; no EOS: every request runs
    to its max_tokens on both sides."""
    if small:
        cfg = hf_config("llama", 256, 4, 4, 2, 512, tied=False)
        cfg.update(vocab_size=1024, max_position_embeddings=512)
    else:
        cfg = hf_config("llama", 4096, 32, 32, 8, 14336, tied=False)
        cfg.update(vocab_size=128256, max_position_embeddings=8192)
    cfg.update(rope_theta=500000.0, rms_norm_eps=1e-5)
    cfg.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return cfg


# ---------------------------------------------------------------- checkpoint on disk


def write_checkpoint(root: Path, cfg: dict, shards: int, seed: int) -> tuple[Path, float]:
    """Random bf16 weights (std 0.02, norms 1) as `shards` safetensors files with an index,
    as a real 8B checkpoint ships; generated on the GPU where there is one (seconds, not
    minutes), one tensor at a time. Reused when already complete."""
    tag = hashlib.sha1(json.dumps([cfg, shards, seed], sort_keys=True).encode()).hexdigest()
    path = root / f"llama-{tag[:10]}"
    if (path / ".complete").exists():
        return path, 0.0
    t0 = time.perf_counter()
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    names = tensor_shapes(cfg)
    total = sum(2 * math.prod(shape) for _, shape in names)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(shards)]
    done = 0
    for name, shape in names:  # contiguous runs of about total/shards bytes each
        groups[min(shards - 1, done * shards // total)].append((name, shape))
        done += 2 * math.prod(shape)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    weight_map = {}
    for i, group in enumerate(g for g in groups if g):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in group:
            size = 2 * math.prod(shape)
            header[name] = {
                "dtype": "BF16",
                "shape": shape,
                "data_offsets": [offset, offset + size],
            }
            offset += size
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with (path / file).open("wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in group:
                if name.endswith("norm.weight"):
                    t = torch.ones(shape, dtype=torch.bfloat16)
                else:
                    t = (torch.randn(shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
                f.write(t.cpu().view(torch.uint8).numpy())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_word_level_tokenizer(path / "tokenizer.json", cfg["vocab_size"])
    for f in path.iterdir():
        f.chmod(0o644)
    (path / ".complete").touch()
    return path, time.perf_counter() - t0


def weight_bytes(cfg: dict) -> dict:
    """All weights, and what one decode step reads of them: all but the embedding table,
    of which it reads one row per token."""
    total = sum(2 * math.prod(shape) for _, shape in tensor_shapes(cfg))
    embedding = 2 * cfg["vocab_size"] * cfg["hidden_size"]
    return {"total": total, "embedding": embedding, "read_per_decode_step": total - embedding}


def warm_page_cache(path: Path) -> dict:
    """Read every file once, so each load comes from the page cache, not the disk."""
    t0, n = time.perf_counter(), 0
    for f in sorted(path.iterdir()):
        with f.open("rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return {"bytes": n, "seconds": round(time.perf_counter() - t0, 2)}


def measure_bandwidth(nbytes: int, iters: int) -> dict:
    """Device copy bandwidth, bytes read plus written per second, of a big torch copy: the
    memory speed a decode step (weights streamed once) can at best run at."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync()
    seconds = time.perf_counter() - t0
    del src, dst
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "buffer_bytes": nbytes,
        "iters": iters,
        "seconds": round(seconds, 4),
        "bytes_per_s": 2 * nbytes * iters / seconds,
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- workloads


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int


@dataclass
class Rec:
    """One request's timeline: submit time and the time each of its tokens came out."""

    prompt_tokens: int
    submit: float = 0.0
    times: list[float] = field(default_factory=list)
    tokens: int = 0
    ids: list[int] = field(default_factory=list)
    reason: str | None = None
    error: str | None = None

    def record(self, out) -> bool:
        """Take one engine output (on the engine's thread); True when it is the last."""
        if out.token_ids:
            self.times.append(time.perf_counter())
            self.tokens += len(out.token_ids)
            self.ids.extend(out.token_ids)
        if out.finished:
            self.reason, self.error = out.finish_reason, out.error
        return out.finished


def random_prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def sharegpt_mix(n: int, seed: int, vocab: int, args, out_cap: int | None = None) -> list[Req]:
    """ShareGPT-like lengths: lognormal input and output lengths with the given means, each
    capped at --max-len; random token ids, so no two prompts share a cached prefix."""
    rng = np.random.default_rng(seed)

    def lengths(mean: float, cap: int) -> list[int]:
        mu = math.log(mean) - args.sigma**2 / 2  # the mean, before the cap, is `mean`
        return np.clip(np.rint(rng.lognormal(mu, args.sigma, n)), 4, cap).astype(int).tolist()

    ins = lengths(args.sharegpt_in_mean, args.max_len)
    outs = lengths(args.sharegpt_out_mean, min(args.max_len, out_cap or args.max_len))
    return [Req(random_prompt(rng, i, vocab), o) for i, o in zip(ins, outs, strict=True)]


def fixed_set(args, vocab: int) -> list[Req]:
    rng = np.random.default_rng(args.seed + 2)
    return [
        Req(random_prompt(rng, args.fixed_in, vocab), args.fixed_out)
        for _ in range(args.fixed_requests)
    ]


def check_prompts(args, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed + 3)
    lengths = [min(n, args.max_len // 2) for n in CHECK_LENGTHS[: args.check_prompts]]
    return [random_prompt(rng, n, vocab) for n in lengths]


def last_token_at(recs: list[Rec]) -> float:
    return max(r.times[-1] for r in recs if r.times)


def throughput(recs: list[Rec]) -> dict:
    start, end = min(r.submit for r in recs), last_token_at(recs)
    out_tokens, in_tokens = sum(r.tokens for r in recs), sum(r.prompt_tokens for r in recs)
    wall = end - start
    return {
        "requests": len(recs),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (in_tokens + out_tokens) / wall,
    }


class JitBuilds:
    """Triton kernels built while it is open (compiled, or loaded from Triton's disk cache),
    from the engine's build log (omni/engine/kernels/builds.py). The step that needed one
    waited, so after the warm-up a timed part should list none; those it lists say which
    variants the warm-up missed."""

    def __enter__(self) -> JitBuilds:
        from omni.engine.kernels import builds

        self.log, self.hooked = builds.BUILDS, builds.install()
        self.start = (self.log.count, self.log.seconds)
        return self

    def __exit__(self, *exc) -> None:
        self.end = (self.log.count, self.log.seconds)
        self.kept = [b for b in self.log.since(self.start[0]) if b.seq <= self.end[0]]

    def result(self) -> dict:
        kept = self.kept
        kernels: dict[str, int] = {}
        for b in kept:
            kernels[b.kernel] = kernels.get(b.kernel, 0) + 1
        return {
            "hooked": self.hooked,
            "count": self.end[0] - self.start[0],
            "seconds": round(self.end[1] - self.start[1], 3),
            "kernels": kernels,  # of the last 64 builds at most
            "variants": [b.variant for b in kept[:20]],  # Triton's signature of each
        }


class CpuMeter:
    """CPU seconds a process (its live and reaped children included) spends per wall second
    over a window, and its busiest thread's share: near 1.0 there means a host-bound loop."""

    def __init__(self, pid: int | None = None):
        self.proc = psutil.Process(pid)

    def _sample(self) -> tuple[float, float, dict[int, float], dict[int, float]]:
        t = self.proc.cpu_times()
        own = t.user + t.system + t.children_user + t.children_system
        kids = {}
        for child in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                c = child.cpu_times()
                kids[child.pid] = c.user + c.system
        threads = {th.id: th.user_time + th.system_time for th in self.proc.threads()}
        return time.perf_counter(), own, kids, threads

    def __enter__(self) -> CpuMeter:
        self.start = self._sample()
        return self

    def __exit__(self, *exc) -> None:
        self.end = self._sample()

    def result(self) -> dict:
        (t0, own0, kids0, th0), (t1, own1, kids1, th1) = self.start, self.end
        wall = t1 - t0
        cpu = own1 - own0 + sum(v - kids0.get(k, 0.0) for k, v in kids1.items())
        busiest = max((v - th0.get(k, 0.0) for k, v in th1.items()), default=0.0)
        return {
            "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 3),
            "cpu_per_wall": round(cpu / wall, 3) if wall > 0 else None,
            "busiest_thread_cpu_per_wall": round(busiest / wall, 3) if wall > 0 else None,
        }


# ---------------------------------------------------------------- the two sides


class Deadline:
    """The whole run's wall-clock end, shared by the children: a part that cannot finish
    in time is cut short, and what ran before it is still written."""

    def __init__(self, at: float):
        self.at = at

    def left(self) -> float:
        return self.at - time.time()


class OursRunner:
    """Requests straight into an in-process Engine (no HTTP): what the engine itself does."""

    name = "ours"

    def __init__(self, engine, deadline: Deadline):
        self.engine, self.deadline = engine, deadline

    def timed(
        self, reqs: list[Req], concurrency: int | None = None, sync: bool = False
    ) -> list[Rec]:
        """All at once (the scheduler batches them), or at most `concurrency` in flight.
        `sync`: ask for logprobs, which keeps every step on the host (no overlap)."""
        from omni.engine.engine import GenerationRequest
        from omni.engine.sampling import SamplingParams

        recs = [Rec(len(r.prompt)) for r in reqs]
        done: queue.Queue[int] = queue.Queue()

        def emitter(i: int) -> Callable:
            def emit(out) -> None:  # on the engine's thread
                if recs[i].record(out):
                    done.put(i)

            return emit

        pending = iter(range(len(reqs)))

        def submit_next() -> None:
            i = next(pending, None)
            if i is None:
                return
            params = SamplingParams(
                max_tokens=reqs[i].max_tokens,
                temperature=0,
                ignore_eos=True,
                logprobs=0 if sync else None,
            )
            recs[i].submit = time.perf_counter()
            self.engine.submit(GenerationRequest(reqs[i].prompt, params), emitter(i))

        for _ in range(concurrency or len(reqs)):
            submit_next()
        for _ in reqs:
            try:
                i = done.get(timeout=max(1.0, self.deadline.left()))
            except queue.Empty:
                raise TimeoutError("out of time (--deadline) with requests in flight") from None
            if recs[i].reason == "error":
                raise RuntimeError(f"request {i} failed: {recs[i].error}")
            submit_next()
        return recs

    def greedy(self, prompts: list[list[int]], n: int) -> tuple[list[list[int]], None]:
        """The prompts among as many other requests (batched, decode graphs, overlap)."""
        rng = np.random.default_rng(17)
        vocab = self.engine.model.cfg.vocab_size
        others = [Req(random_prompt(rng, int(k), vocab), n) for k in rng.integers(5, 900, 60)]
        recs = self.timed([Req(p, n) for p in prompts] + others)
        return [r.ids for r in recs[: len(prompts)]], None

    def reference(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """The engine's plain path: one request at a time, no graphs, no overlap."""
        runner = self.engine.runner
        graphs, runner.graphs = runner.graphs, None
        try:
            return [self.timed([Req(p, n)], sync=True)[0].ids for p in prompts]
        finally:
            runner.graphs = graphs


class HfRunner:
    """HF transformers `generate`: its default dynamic cache and attention, batches padded
    on the left; greedy."""

    name = "hf"

    def __init__(self, path: Path, device: str, dtype: torch.dtype, batch: int):
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.device, self.batch = device, batch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, device_map=device
        ).eval()

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, n: int, **kw):
        with torch.inference_mode():
            return self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                **kw,
            )

    def timed(self, reqs: list[Req], concurrency: int | None = None) -> list[Rec]:
        """Batches of `concurrency` (else --fixed-batch), shortest prompts first; each batch
        runs to its longest output, and each request counts only its own tokens."""
        from transformers.generation.streamers import BaseStreamer

        class StepClock(BaseStreamer):
            def __init__(self):
                self.times: list[float] = []

            def put(self, value) -> None:  # gets tokens already on the host: after the step
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        batch = concurrency or self.batch
        order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt))
        recs: list[Rec] = [Rec(len(r.prompt)) for r in reqs]
        for start in range(0, len(order), batch):
            group = order[start : start + batch]
            width = max(len(reqs[i].prompt) for i in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for row, i in enumerate(group):
                p = reqs[i].prompt
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            clock, t0 = StepClock(), time.perf_counter()
            self._generate(ids, mask, max(reqs[i].max_tokens for i in group), streamer=clock)
            steps = clock.times[1:]  # the first put is the prompt
            for i in group:
                recs[i].submit, recs[i].times = t0, steps[: reqs[i].max_tokens]
                recs[i].tokens = len(recs[i].times)
        return recs

    def greedy(
        self, prompts: list[list[int]], n: int
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Each prompt alone (no padding): its tokens and the logits of every step."""
        tokens, logits = [], []
        for p in prompts:
            ids = torch.tensor([p])
            out = self._generate(
                ids, torch.ones_like(ids), n, output_logits=True, return_dict_in_generate=True
            )
            tokens.append(out.sequences[0, len(p) :].tolist())
            logits.append(torch.stack(out.logits)[:, 0].float().cpu())
        return tokens, logits


# ---------------------------------------------------------------- parts 0-2 (either side)


def part_check(runner, args, vocab: int, peer: dict | None) -> dict:
    """Greedy tokens of a few prompts; on HF's side, compared with ours (the peer phase):
    how many leading tokens match, and at the first difference whether HF's own logits
    make it a near-tie (bf16 noise on random weights) or a real disagreement."""
    prompts = check_prompts(args, vocab)
    tokens, logits = runner.greedy(prompts, args.check_tokens)
    out: dict = {"prompt_tokens": [len(p) for p in prompts], "tokens": tokens}
    if hasattr(runner, "reference"):
        reference = runner.reference(prompts, args.check_tokens)
        same = [a == b for a, b in zip(tokens, reference, strict=True)]
        out["reference"] = {
            "what": "each prompt alone on the engine's plain path (eager, no decode graphs, "
            "no overlap) vs among 60 other requests on the optimized path",
            "tokens": reference,
            "identical": same,
            "verdict": "PASS" if all(same) else "FAIL",
        }
    ours = (peer or {}).get("check", {}).get("tokens")
    if logits is None or not ours:
        return out
    per = []
    for o, h, lg in zip(ours, tokens, logits, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(o, h, strict=False)) if a != b), len(h))
        rec: dict = {"match": k, "of": len(h)}
        if k < len(h):
            gap, std = float(lg[k, h[k]] - lg[k, o[k]]), float(lg[k].std())
            ulp = bf16_ulp(float(lg[k, h[k]]))
            rec.update(hf_token=h[k], ours_token=o[k], hf_logit_gap=gap, hf_logit_std=std)
            rec.update(hf_logit_ulp=ulp, near_tie=gap <= max(TIE * std, 2 * ulp))
        per.append(rec)
    ok = all(r["match"] == r["of"] or r["near_tie"] for r in per)
    out["compared"] = {
        "per_prompt": per,
        "rule": f"PASS: every prompt matches all tokens or first differs at a near-tie "
        f"(HF's gap between the two tokens <= {TIE} x the std of its logits there, or <= 2 "
        "units in the last place of HF's bf16 logit: below what HF's own logits resolve)",
        "verdict": "PASS" if ok else "FAIL",
    }
    return out


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def part_decode(runner, args, vocab: int) -> dict:
    """Batch-1 decode tok/s: (tokens - 1) / (last token - first token), the prefill left
    out; the median of --decode-repeats runs, each a fresh prompt (no prefix-cache hit)."""
    rng = np.random.default_rng(args.seed + 4)
    runner.timed([Req(random_prompt(rng, args.decode_prompt, vocab), 8)])  # warm-up
    runs, ttfts = [], []
    with CpuMeter() as cpu:
        for _ in range(args.decode_repeats):
            prompt = random_prompt(rng, args.decode_prompt, vocab)
            (rec,) = runner.timed([Req(prompt, args.decode_tokens)])
            runs.append((rec.tokens - 1) / (rec.times[-1] - rec.times[0]))
            ttfts.append(rec.times[0] - rec.submit)
    return {
        "cpu": cpu.result(),
        "prompt_tokens": args.decode_prompt,
        "new_tokens": args.decode_tokens,
        "tok_s": statistics.median(runs),
        "runs_tok_s": runs,
        "ttft_s": statistics.median(ttfts),
    }


def batch_run(runner: OursRunner, prompts: list[list[int]], new: int) -> dict:
    """`prompts` submitted at once, `new` tokens each: wall, output tok/s, first token,
    and for one prompt the decode rate after its first token (moe_bench, tp_bench)."""
    recs = runner.timed([Req(p, new) for p in prompts])
    figures = throughput(recs)
    res = {"batch": len(prompts), "new_tokens": figures["output_tokens"]}
    res |= {"wall_s": figures["wall_s"], "output_tok_s": figures["output_tok_s"]}
    res["first_token_s"] = round(min(r.times[0] for r in recs) - recs[0].submit, 4)
    if len(recs) == 1 and new > 1:
        res["decode_tok_s"] = (new - 1) / (recs[0].times[-1] - recs[0].times[0])
    return res


class StepTimeline:
    """Where an offline run's time goes: each step's launch time and shape, recorded by
    wrapping the engine's ModelRunner.run. A launch returns at once and the one after
    waits for the step before it, so launch-to-launch is about a step's GPU time."""

    DECODE_BANDS = ((1, 16), (17, 64), (65, 128), (129, 256), (257, 512), (513, 4096))

    def __init__(self, engine):
        self.model_runner, self.steps = engine.runner, []

    def __enter__(self) -> StepTimeline:
        run = self.model_runner.run

        def timed_run(batch, *a, **kw):
            t0 = time.perf_counter()
            out = run(batch, *a, **kw)
            launch = time.perf_counter() - t0
            self.steps.append((t0, launch, len(batch.seqs), batch.total_tokens))
            return out

        self.model_runner.run = timed_run
        return self

    def __exit__(self, *exc) -> None:
        del self.model_runner.run  # the class's method again

    def summary(self, end: float) -> dict:
        """Decode-only steps by batch size and mixed (prefill) steps: count, seconds,
        ms per step and ms of host launch per step."""
        starts = [s[0] for s in self.steps] + [end]
        bands: dict[str, list] = {}
        for (t0, launch, seqs, tokens), t1 in zip(self.steps, starts[1:], strict=True):
            if tokens > seqs:
                key = "mixed"
            else:
                lo, hi = next(b for b in self.DECODE_BANDS if b[0] <= seqs <= b[1])
                key = f"decode b={lo}-{hi}"
            bands.setdefault(key, []).append((t1 - t0, launch))
        return {
            key: {
                "steps": len(v),
                "s": round(sum(d for d, _ in v), 3),
                "ms_per_step": round(1e3 * sum(d for d, _ in v) / len(v), 2),
                "launch_ms_per_step": round(1e3 * sum(la for _, la in v) / len(v), 2),
            }
            for key, v in bands.items()
        }


def workload(reqs: list[Req]) -> dict:
    """What any engine must do for these requests, whatever its kernels: the longest output
    is that many forward steps one after another (the first token comes from the prompt's
    step), and each decode step reads the K/V of every token before it."""
    return {
        "max_output": max(r.max_tokens for r in reqs),
        "decode_kv_token_reads": sum(
            (r.max_tokens - 1) * len(r.prompt) + r.max_tokens * (r.max_tokens - 1) // 2
            for r in reqs
        ),
        "prompt_tokens": sum(len(r.prompt) for r in reqs),
        # (query, key) pairs of the prompts' causal attention
        "prompt_attention_pairs": sum(len(r.prompt) * (len(r.prompt) + 1) // 2 for r in reqs),
    }


# Dense bf16 tensor-core peaks (FLOP/s) from the data sheets, by device name (first match)
DENSE_BF16_PEAK = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("A100", 312e12),
)


def dense_bf16_peak(device: str | None) -> float | None:
    return next((peak for name, peak in DENSE_BF16_PEAK if name in (device or "")), None)


def prompt_flops(work: dict, cfg: dict) -> float:
    """The prompts' matmul FLOPs: every layer's projections for each prompt token, and
    causal attention's two products over each prompt's (query, key) pairs."""
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv_dim = cfg["num_key_value_heads"] * head_dim
    per_layer = hidden * (2 * hidden + 2 * kv_dim) + 3 * hidden * cfg["intermediate_size"]
    linear = 2 * layers * per_layer * work["prompt_tokens"]
    attention = 4 * layers * hidden * work["prompt_attention_pairs"]
    return float(linear + attention)


def offline_floor(
    work: dict | None, prep: dict, output_tokens: int | None, wall_s: float | None = None
) -> dict | None:
    """A lower bound on an offline run's wall time from bytes alone, at the measured copy
    bandwidth: the longest request's steps each read the weights once, and every decode step
    reads its K/V (bf16). It leaves out all compute (prompts included), so no engine, ours or
    any other, can beat it at bf16 without speculative decoding. Beside it, the floor that
    adds the prompts' FLOPs at the device's dense bf16 peak; with `wall_s`, ours as a
    fraction of each."""
    bw = get(prep, "bandwidth", "bytes_per_s")
    weights = get(prep, "checkpoint", "weight_bytes", "read_per_decode_step")
    cfg = get(prep, "checkpoint", "config") or {}
    if not (work and bw and weights and output_tokens and cfg.get("num_hidden_layers")):
        return None
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    weights_s = work["max_output"] * weights / bw
    kv_s = work["decode_kv_token_reads"] * kv_per_token / bw
    floor = {
        "weights_s": round(weights_s, 3),
        "kv_s": round(kv_s, 3),
        "floor_s": round(weights_s + kv_s, 3),
        "ceiling_output_tok_s": round(output_tokens / (weights_s + kv_s), 1),
    }
    peak = dense_bf16_peak(get(prep, "bandwidth", "device"))
    if peak and "prompt_tokens" in work:
        flops = prompt_flops(work, cfg)
        floor |= {
            "dense_bf16_peak_flop_s": peak,
            "prompt_flops": flops,
            "prompt_s_at_peak": round(flops / peak, 3),
            "floor_with_prompts_s": round(weights_s + kv_s + flops / peak, 3),
        }
    if wall_s:
        floor["ours_fraction_of_floor"] = round(floor["floor_s"] / wall_s, 4)
        if "floor_with_prompts_s" in floor:
            floor["ours_fraction_of_floor_with_prompts"] = round(
                floor["floor_with_prompts_s"] / wall_s, 4
            )
    return floor


def part_offline(runner, args, vocab: int, deadline: Deadline) -> dict:
    """Throughput of the ShareGPT-like mix (ours: all submitted at once) and of the fixed
    set (at most --fixed-batch in flight), with the engine process's CPU per wall second."""
    sets = {
        "sharegpt": (sharegpt_mix(args.sharegpt_requests, args.seed, vocab, args), None),
        "fixed": (fixed_set(args, vocab), args.fixed_batch),
    }
    out = {}
    for name, (reqs, concurrency) in sets.items():
        if runner.name == "hf" and name == "sharegpt" and not args.hf_sharegpt:
            out[name] = {
                "skipped": "HF on the mix is slow (each padded batch runs to its "
                "longest output); --hf-sharegpt runs it"
            }
            continue
        if deadline.left() < 20:
            out[name] = {"skipped": "out of time (--deadline)"}
            continue
        timeline = StepTimeline(runner.engine) if runner.name == "ours" else None
        with CpuMeter() as cpu, timeline or contextlib.nullcontext(), JitBuilds() as jit:
            recs = runner.timed(reqs, concurrency)
        out[name] = throughput(recs) | {"batch": concurrency, "cpu": cpu.result()}
        out[name]["workload"] = workload(reqs)
        if timeline:
            out[name]["jit_builds"] = jit.result()
            out[name]["steps"] = timeline.summary(last_token_at(recs))
        print(f"[{runner.name}] offline {name}: {out[name]['output_tok_s']:.0f} output tok/s")
    return out


# ---------------------------------------------------------------- phases (child processes)


class PhaseOut:
    """A child's results, rewritten after every part, so a child killed at the deadline
    still hands back what it finished."""

    def __init__(self, path: Path, deadline: Deadline):
        self.path, self.deadline, self.data = path, deadline, {}

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def part(self, key: str, fn: Callable[[], dict], min_left: float = 10.0) -> None:
        if self.deadline.left() < min_left:
            self.data[key] = {"skipped": "out of time (--deadline)"}
        else:
            t0 = time.perf_counter()
            try:
                self.data[key] = fn()
            except Exception as exc:  # one part failing keeps the others' figures
                traceback.print_exc()
                self.data[key] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {key}: {time.perf_counter() - t0:.1f}s")
        self.save()


def engine_device() -> tuple[str, torch.dtype]:
    """What the worker picks: bf16 on the GPU, fp32 on the CPU."""
    return ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


def phase_prepare(args, out: PhaseOut) -> None:
    cfg = llama3_8b_config(args.small)
    path, write_s = write_checkpoint(Path(args.ckpt_root), cfg, args.shards, args.seed)
    size = weight_bytes(cfg)
    out.data["checkpoint"] = {"path": str(path), "config": cfg, "shards": args.shards}
    out.data["checkpoint"] |= {"write_s": round(write_s, 1), "weight_bytes": size}
    out.data["page_cache"] = warm_page_cache(path)
    print(f"checkpoint {path} ({size['total'] / 2**30:.2f} GiB, written in {write_s:.0f}s)")
    out.part("bandwidth", lambda: measure_bandwidth(args.bw_bytes, args.bw_iters))


def phase_ours(args, out: PhaseOut) -> None:
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.engine import Engine
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.tokenizer import TextTokenizer

    device, dtype = engine_device()
    t0 = time.perf_counter()
    ckpt = Checkpoint.open(args.ckpt)
    model = LlamaForCausalLM.load(ckpt, device, dtype)
    sync()
    t1 = time.perf_counter()
    engine = Engine(model, TextTokenizer(ckpt), max_seqs=args.max_seqs)
    engine.warm_up(graphs=True)  # steady state: no capture inside the timed parts
    t2 = time.perf_counter()
    out.data["setup"] = {"device": device, "dtype": str(dtype), "load_s": round(t1 - t0, 2)}
    out.data["setup"] |= {"warm_up_s": round(t2 - t1, 2), "stats": engine.stats()}
    out.data["setup"]["max_batch_tokens"] = engine.scheduler.max_batch_tokens
    out.data["setup"]["max_seqs"] = engine.scheduler.max_seqs
    print(f"[ours] loaded in {t1 - t0:.1f}s, warmed up in {t2 - t1:.1f}s")
    runner = OursRunner(engine, out.deadline)
    try:
        run_side(runner, args, out, model.cfg.vocab_size, None)
        out.data["preemptions"] = engine.scheduler.preemptions
        out.save()
    finally:
        engine.shutdown()


def phase_hf(args, out: PhaseOut) -> None:
    import transformers

    device, dtype = engine_device()
    t0 = time.perf_counter()
    runner = HfRunner(Path(args.ckpt), device, dtype, args.fixed_batch)
    sync()
    out.data["setup"] = {"device": device, "dtype": str(dtype)}
    out.data["setup"] |= {"load_s": round(time.perf_counter() - t0, 2)}
    out.data["setup"]["transformers"] = transformers.__version__
    out.data["setup"]["attn_implementation"] = runner.model.config._attn_implementation
    print(f"[hf] loaded in {out.data['setup']['load_s']:.1f}s")
    peer = json.loads(Path(args.peer).read_text()) if args.peer else None
    run_side(runner, args, out, runner.model.config.vocab_size, peer)


def run_side(runner, args, out: PhaseOut, vocab: int, peer: dict | None) -> None:
    parts = args.parts
    if "check" in parts:
        out.part("check", lambda: part_check(runner, args, vocab, peer))
    if "decode" in parts:
        out.part("decode", lambda: part_decode(runner, args, vocab))
    if "offline" in parts:
        out.part("offline", lambda: part_offline(runner, args, vocab, out.deadline), 20)


PHASES = {
    "prepare": phase_prepare,
    "ours": phase_ours,
    "hf": phase_hf,
}


def run_phase(args) -> None:
    """This process is a child: run one phase, its results to --phase-out."""
    out = PhaseOut(Path(args.phase_out), Deadline(args.deadline_at))
    PHASES[args.phase](args, out)
    out.save()


def run_child(phase: str, args, workdir: Path, deadline: Deadline, **extra: str) -> dict:
    """This script again with --phase: its own process, its own GPU memory. Killed at the
    deadline; what it saved by then comes back."""
    result = workdir / f"{phase}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
    argv += ["--phase", phase, "--phase-out", str(result), "--deadline-at", str(deadline.at)]
    for key, value in extra.items():
        argv += [f"--{key}", value]
    return run_process(argv, result, f"phase {phase}", deadline)


def real_weights_phase(workdir: Path, deadline: Deadline) -> dict:
    """bench/real_weights.py in its own process: the embedded SmolLM2 on our GPU path
    against HF transformers (greedy and logits), the correctness check on real weights."""
    name = f"real-weights-{device_tag()}"
    script = Path(__file__).resolve().parent / "real_weights.py"
    argv = [sys.executable, str(script), "--name", name, "--data-dir", str(workdir / "data")]
    return run_process(argv, RESULTS / f"{name}.json", "real weights", deadline)


def run_process(argv: list[str], result: Path, label: str, deadline: Deadline) -> dict:
    """Run `argv` (told its spawn time in OMNI_BENCH_T0), killed at the deadline; the JSON
    it wrote to `result` by then, with its wall time and exit status."""
    env = dict(os.environ, OMNI_BENCH_T0=str(time.time()))
    print(f"== {label}")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=env)
    try:
        proc.wait(timeout=max(1.0, deadline.left()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    data = json.loads(result.read_text()) if result.exists() else {}
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        data["error"] = f"{label} exited with {proc.returncode}"
    return data


# ---------------------------------------------------------------- part 3: online (HTTP)


class Worker:
    """One `python -m omni.instance.worker`: the instance process omnid would start (same
    engine, same OpenAI routes), here outside any sandbox, serving its Unix socket."""

    def __init__(self, ckpt: Path, workdir: Path):
        self.socket = Path(tempfile.mkdtemp(prefix="omni-eb-", dir="/tmp")) / "sock"
        self.log = workdir / "worker.log"
        argv = [sys.executable, "-m", "omni.instance.worker"]
        settings = InstanceSettings("bench", str(ckpt), str(self.socket))
        path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), **settings.to_env())
        self.started = time.perf_counter()
        self._out = self.log.open("w")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=self._out, stderr=subprocess.STDOUT
        )

    def session(self, timeout_s: float) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(self.socket), limit=0),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        )

    async def wait_ready(self, timeout_s: float) -> float:
        """Seconds from process start to /health answering 200 (weights loaded: it serves
        from then on, and warms up between requests)."""
        return await self._poll_health(timeout_s, lambda _health: True, "not ready")

    async def wait_warm(self, timeout_s: float) -> float:
        """Seconds from process start to the end of the warm-up it does between requests
        (/health's idle_work at 0): the timed rates start in steady state."""
        warm = self._poll_health(timeout_s, lambda h: not h.get("idle_work"), "still warming up")
        return await warm

    async def _poll_health(
        self, timeout_s: float, done: Callable[[dict], bool], failure: str
    ) -> float:
        """Seconds from process start to a /health answer (200) that `done` accepts."""
        deadline = time.perf_counter() + timeout_s
        async with self.session(5) as s:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited:\n{self.log.read_text()[-3000:]}")
                if (health := await self.health(s)) is not None and done(health):
                    return time.perf_counter() - self.started
                await asyncio.sleep(0.1)
        raise RuntimeError(
            f"worker {failure} after {timeout_s:.0f}s:\n{self.log.read_text()[-3000:]}"
        )

    @staticmethod
    async def health(s) -> dict | None:
        """The worker's /health answer, or None while it does not answer 200."""
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with s.get("http://worker/health") as r:
                if r.status == 200:
                    return await r.json()
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        shutil.rmtree(self.socket.parent, ignore_errors=True)


async def stream_completion(session: aiohttp.ClientSession, req: Req) -> Rec:
    """One streaming /v1/completions request (token-id prompt, greedy): the arrival time
    of each text chunk, one per token with this tokenizer."""
    rec = Rec(len(req.prompt), submit=time.perf_counter())
    body = {"model": "bench", "prompt": req.prompt, "max_tokens": req.max_tokens}
    body |= {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post("http://worker/v1/completions", json=body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return rec
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now, chunk = time.perf_counter(), json.loads(line[6:])
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        rec.times.append(now)
                    rec.reason = choice.get("finish_reason") or rec.reason
                rec.tokens = (chunk.get("usage") or {}).get("completion_tokens", rec.tokens)
    except (aiohttp.ClientError, TimeoutError) as exc:
        rec.error = type(exc).__name__
    return rec


async def replay(session: aiohttp.ClientSession, reqs: list[Req], at: list[float]) -> list[Rec]:
    """Open loop: request i sent at at[i] seconds from now, whatever came back before."""
    t0 = time.perf_counter()

    async def one(req: Req, offset: float) -> Rec:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        return await stream_completion(session, req)

    return list(await asyncio.gather(*(one(r, a) for r, a in zip(reqs, at, strict=True))))


def latency_summary(recs: list[Rec], window_s: float) -> dict:
    """TTFT per request; inter-token latency as every gap between two chunks of one
    request, pooled (vLLM's definition); percentiles nearest-rank."""
    ok = [r for r in recs if not r.error and r.times]
    ttft = [r.times[0] - r.submit for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.times, r.times[1:], strict=False)]

    def pct(values: list[float]) -> dict:
        return {
            f"p{p}_ms": round(1e3 * v, 2) if (v := percentile(values, p)) is not None else None
            for p in (50, 90, 99)
        }

    end = max((r.times[-1] for r in ok), default=0.0) - min((r.submit for r in recs), default=0.0)
    return {
        "requests": len(recs),
        "ok": len(ok),
        "errors": sorted({r.error for r in recs if r.error})[:5],
        "arrival_window_s": round(window_s, 2),
        "wall_s": round(end, 2),
        "output_tok_s": sum(r.tokens or len(r.times) for r in ok) / end if end > 0 else None,
        "ttft": pct(ttft),
        "itl": pct(itl),
        "ttft_mean_ms": round(1e3 * statistics.fmean(ttft), 2) if ttft else None,
        "itl_mean_ms": round(1e3 * statistics.fmean(itl), 2) if itl else None,
    }


async def worker_builds(s) -> int | None:
    """The worker's count of Triton kernel builds so far (/health), if it reports one."""
    return (await Worker.health(s) or {}).get("kernel_builds")


async def part_online(args, ckpt: Path, vocab: int, workdir: Path, deadline: Deadline) -> dict:
    """Part 3 (and 4's online half): a fresh worker, a short warm-up, then each rate's
    Poisson arrivals over --online-seconds with the mix's lengths (outputs capped at
    --online-max-output); CPU of the worker process per wall second over each window."""
    worker = Worker(ckpt, workdir)
    out: dict = {"server": "omni.instance.worker on a Unix socket (no omnid proxy hop)"}
    try:
        out["start_to_ready_s"] = round(await worker.wait_ready(max(1.0, deadline.left())), 2)
        async with worker.session(max(30.0, deadline.left())) as s:
            rng = np.random.default_rng(args.seed + 6)
            rec = await stream_completion(s, Req(random_prompt(rng, args.decode_prompt, vocab), 4))
            if rec.error:
                raise RuntimeError(f"first request failed: {rec.error}")
            out["start_to_first_token_s"] = round(rec.times[0] - worker.started, 2)
            out["start_to_warm_s"] = round(await worker.wait_warm(max(1.0, deadline.left())), 2)
            warm = [Req(random_prompt(rng, args.decode_prompt, vocab), 16) for _ in range(8)]
            await replay(s, warm, [0.0] * len(warm))
            out["rates"] = {}
            for k, rate in enumerate(args.rates):
                key = f"{rate:g}"
                if deadline.left() < args.online_seconds + 15:
                    out["rates"][key] = {"skipped": "out of time (--deadline)"}
                    continue
                arr = np.random.default_rng(args.seed + 10 + k)
                at = np.cumsum(arr.exponential(1 / rate, int(rate * args.online_seconds * 3) + 8))
                at = at[at < args.online_seconds].tolist()
                reqs = sharegpt_mix(
                    len(at), args.seed + 20 + k, vocab, args, args.online_max_output
                )
                builds = await worker_builds(s)
                with CpuMeter(worker.proc.pid) as cpu:
                    recs = await replay(s, reqs, at)
                res = latency_summary(recs, args.online_seconds) | {"cpu": cpu.result()}
                if builds is not None and (after := await worker_builds(s)) is not None:
                    res["kernel_builds"] = after - builds  # Triton builds requests waited for
                out["rates"][key] = res
                print(
                    f"[online] {rate:g} req/s: {res['ok']}/{res['requests']} ok, TTFT p50 "
                    f"{res['ttft']['p50_ms']} ms, ITL p50 {res['itl']['p50_ms']} ms"
                )
    finally:
        worker.stop()
    return out


# ---------------------------------------------------------------- results


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def get(d: dict, *keys: str):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def assemble(args, phases: dict) -> dict:
    """The result file: per part, ours and HF side by side, ratios and the targets."""
    prep, ours, hf = phases.get("prepare", {}), phases.get("ours", {}), phases.get("hf", {})
    bw = get(prep, "bandwidth", "bytes_per_s")
    wb = get(prep, "checkpoint", "weight_bytes") or {}
    ours_tok = get(ours, "decode", "tok_s")
    floor = {
        "bandwidth_bytes_per_s": bw,
        "weight_bytes": wb.get("total"),
        "bytes_read_per_step": wb.get("read_per_decode_step"),
        "floor_tok_s": ratio(bw, wb.get("total")),
        "floor_tok_s_excluding_embedding": ratio(bw, wb.get("read_per_decode_step")),
    }
    floor["ours_fraction_of_floor"] = ratio(ours_tok, floor["floor_tok_s"])
    floor["ours_fraction_of_floor_excluding_embedding"] = ratio(
        ours_tok, floor["floor_tok_s_excluding_embedding"]
    )
    fixed = ratio(
        get(ours, "offline", "fixed", "output_tok_s"), get(hf, "offline", "fixed", "output_tok_s")
    )
    online = phases.get("online", {})
    return {
        "config": {k: v for k, v in vars(args).items() if k not in INTERNAL},
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "checkpoint": prep.get("checkpoint"),
        "page_cache": prep.get("page_cache"),
        "bandwidth": prep.get("bandwidth"),
        "setup": {"ours": ours.get("setup"), "hf": hf.get("setup")},
        "check": {
            "prompt_tokens": get(ours, "check", "prompt_tokens"),
            "ours_tokens": get(ours, "check", "tokens"),
            "hf_tokens": get(hf, "check", "tokens"),
            # Random weights: logits nearly flat, so this greedy comparison is not judged;
            # "verdict" is the real-weight check's (bench/real_weights.py).
            "random_weights": get(hf, "check", "compared") or "n/a (not compared)",
            "verdict": get(phases, "real_weights", "verdict") or "n/a (not run)",
            "reference": get(ours, "check", "reference"),
            "real_weights": {
                k: phases.get("real_weights", {}).get(k)
                for k in (
                    "verdict",
                    "rule",
                    "fp32_greedy_identical",
                    "bf16_greedy",
                    "max_logit_err_vs_hf_fp32",
                    "error",
                )
            },
            "vs_baseline_file": vs_baseline(get(ours, "check", "tokens"), args.small),
        },
        "decode": {
            "ours": ours.get("decode"),
            "hf": hf.get("decode"),
            "ours_vs_hf": ratio(ours_tok, get(hf, "decode", "tok_s")),
            "bandwidth_floor": floor,
        },
        "offline": {
            "ours": ours.get("offline"),
            "hf": hf.get("offline"),
            "ours_vs_hf_fixed": fixed,
            "target_fixed_ours_ge_6x_hf": target(fixed, 6.0, args.small),
            "ours_preemptions": ours.get("preemptions"),
            "bytes_floor": {
                name: offline_floor(
                    get(ours, "offline", name, "workload"),
                    prep,
                    get(ours, "offline", name, "output_tokens"),
                    get(ours, "offline", name, "wall_s"),
                )
                for name in ("sharegpt", "fixed")
            },
        },
        "online": online,
        "cpu_per_wall": {
            "offline": {k: get(v, "cpu") for k, v in (ours.get("offline") or {}).items()},
            "online": {k: get(v, "cpu") for k, v in (online.get("rates") or {}).items()},
        },
        "cold_start": {
            **(phases.get("coldstart") or {}),
            "worker_start_to_ready_s": online.get("start_to_ready_s"),
            "worker_start_to_first_token_s": online.get("start_to_first_token_s"),
            "worker_start_to_warm_s": online.get("start_to_warm_s"),
        },
        "phase_wall_s": {k: v.get("wall_s") for k, v in phases.items() if isinstance(v, dict)},
        "errors": notes(phases, "error"),
        "skipped": notes(phases, "skipped"),
    }


def vs_baseline(tokens: list[list[int]] | None, small: bool) -> dict | None:
    """Our tokens against those of the first bench run (engine-h100-baseline.json, the
    engine as the engine issue left it, same checkpoint seed): leading tokens that match.
    Informational: a kernel that rounds differently moves near-ties on random weights."""
    path = REPO / "bench" / "results" / "engine-h100-baseline.json"
    if small or not tokens or not path.exists():
        return None
    base = json.loads(path.read_text())
    theirs = get(base, "check", "ours_tokens") or []
    match = [
        next((i for i, (a, b) in enumerate(zip(o, t, strict=False)) if a != b), len(t))
        for o, t in zip(tokens, theirs, strict=False)
    ]
    return {"file": path.name, "commit": base.get("commit"), "leading_match": match}


def target(value: float | None, at_least: float, small: bool) -> str:
    """The issue's bar; only an 8B-shaped run on the GPU is judged."""
    if value is None or small:
        return "n/a" + (" (--small)" if small else "")
    return "PASS" if value >= at_least else "FAIL"


def notes(phases: dict, key: str) -> dict:
    """Every "error" (or "skipped") entry in the phases' results, by where it is."""
    out = {}

    def walk(d, path: str) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                if k == key and isinstance(v, str):
                    out[path or k] = v
                else:
                    walk(v, f"{path}.{k}" if path else k)

    walk(phases, "")
    return out


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(res: dict, args) -> None:
    dec, off = res["decode"], res["offline"]
    fl = dec["bandwidth_floor"]
    bw = fl["bandwidth_bytes_per_s"]
    gib = fl["weight_bytes"] and fl["weight_bytes"] / 2**30
    print(f"\ncopy bandwidth {fmt(bw and bw / 1e9)} GB/s; weights {fmt(gib, '.2f')} GiB")
    print(f"{'':34}{'ours':>12}{'HF':>12}{'ours/HF':>10}")

    def row(label: str, a, b, r=None, spec: str = ".1f") -> None:
        print(f"{label:34}{fmt(a, spec):>12}{fmt(b, spec):>12}{fmt(r, '.2f'):>10}")

    row("decode b=1 tok/s", get(dec, "ours", "tok_s"), get(dec, "hf", "tok_s"), dec["ours_vs_hf"])
    print(
        f"{'  of the bandwidth floor':34}{fmt(fl['ours_fraction_of_floor'], '.1%'):>12}"
        f"   (floor {fmt(fl['floor_tok_s'])} tok/s; excl. embedding "
        f"{fmt(fl['ours_fraction_of_floor_excluding_embedding'], '.1%')})"
    )
    row("decode b=1 CPU s/wall s", get(dec, "ours", "cpu", "cpu_per_wall"), None, spec=".2f")
    labels = {
        "sharegpt": f"{args.sharegpt_requests} ShareGPT-like",
        "fixed": f"{args.fixed_in}/{args.fixed_out} at b={args.fixed_batch}",
    }
    for name, label in labels.items():
        a, b = get(off, "ours", name) or {}, get(off, "hf", name) or {}
        for key, what in (("output_tok_s", "out tok/s"), ("total_tok_s", "total tok/s")):
            row(f"{label} {what}", a.get(key), b.get(key), ratio(a.get(key), b.get(key)))
        cpu = (get(a, "cpu", "cpu_per_wall"), get(b, "cpu", "cpu_per_wall"))
        row(f"{label} CPU s/wall s", *cpu, spec=".2f")
        if floor := get(off, "bytes_floor", name):
            print(
                f"    no engine beats {floor['ceiling_output_tok_s']:.0f} out tok/s here (bytes "
                f"alone: weights {floor['weights_s']:.2f} s + K/V {floor['kv_s']:.2f} s)"
            )
            if "ours_fraction_of_floor" in floor:
                with_prompts = floor.get("ours_fraction_of_floor_with_prompts")
                print(
                    f"    ours at {floor['ours_fraction_of_floor']:.1%} of that floor"
                    + (
                        f", {with_prompts:.1%} of the floor with the prompts at the dense "
                        f"bf16 peak (+{floor['prompt_s_at_peak']:.2f} s)"
                        if with_prompts
                        else ""
                    )
                )
        if (jit := a.get("jit_builds")) and jit["count"]:
            print(
                f"    ours built {jit['count']} Triton kernels during the run "
                f"({jit['seconds']:.2f} s): {jit['kernels']}"
            )
        for band, st in (a.get("steps") or {}).items():
            print(
                f"    ours, {band:16} {st['steps']:5d} steps {st['s']:7.2f} s "
                f"{st['ms_per_step']:7.2f} ms/step"
            )
    print(f"fixed set, ours >= 6x HF: {off['target_fixed_ours_ge_6x_hf']}")
    rates = get(res, "online", "rates") or {}
    if rates:
        print(
            f"\n{'online req/s':>12}{'ok/sent':>10}{'TTFT p50/p90/p99 ms':>26}"
            f"{'ITL p50/p90/p99 ms':>24}{'out tok/s':>11}{'CPU/wall':>9}{'builds':>7}"
        )
        for rate, r in rates.items():
            if "ttft" not in r:
                print(f"{rate:>12}  {r}")
                continue
            ttft = "/".join(fmt(r["ttft"][f"p{p}_ms"], ".0f") for p in (50, 90, 99))
            itl = "/".join(fmt(r["itl"][f"p{p}_ms"]) for p in (50, 90, 99))
            print(
                f"{rate:>12}{r['ok']:>5}/{r['requests']:<4}{ttft:>26}{itl:>24}"
                f"{fmt(r['output_tok_s'], '.0f'):>11}{fmt(r['cpu']['cpu_per_wall'], '.2f'):>9}"
                f"{fmt(r.get('kernel_builds'), 'd'):>7}"
            )
    cold = res["cold_start"]
    marks = cold.get("cold_start_s") or {}
    print(
        f"\ncold start (s from process start): first token {fmt(marks.get('first_token'), '.2f')}, "
        f"ready for the full batch {fmt(marks.get('ready_full_batch'), '.2f')}, full batch's "
        f"first tokens {fmt(marks.get('full_batch_first_tokens'), '.2f')}; worker ready "
        f"{fmt(cold.get('worker_start_to_ready_s'), '.2f')}, first token "
        f"{fmt(cold.get('worker_start_to_first_token_s'), '.2f')}, warmed up "
        f"{fmt(cold.get('worker_start_to_warm_s'), '.2f')}"
    )
    check = res["check"]
    random = check["random_weights"] if isinstance(check["random_weights"], dict) else {}
    matches = ", ".join(f"{r['match']}/{r['of']}" for r in random.get("per_prompt", []))
    print(f"greedy vs HF on random weights (flat logits: not judged), leading equal: {matches}")
    ref = check.get("reference") or {}
    print(f"greedy, optimized vs the plain path: {ref.get('identical')}: {ref.get('verdict')}")
    real = check.get("real_weights") or {}
    print(
        f"real weights (SmolLM2-135M) vs HF: fp32 greedy identical "
        f"{real.get('fp32_greedy_identical')}/8, bf16 greedy {real.get('bf16_greedy')}, "
        f"logit errors {real.get('max_logit_err_vs_hf_fp32')}: {real.get('verdict')}"
    )
    base = check.get("vs_baseline_file") or {}
    if base:
        print(
            f"greedy vs {base['file']} ({base['commit']}), leading equal: {base['leading_match']}"
        )
    for kind in ("skipped", "errors"):
        for where, msg in res[kind].items():
            print(f"  {kind}: {where}: {msg}")


# ---------------------------------------------------------------- main


def device_tag() -> str:
    """h100, h200, ... from nvidia-smi's GPU name (no CUDA context here); else cpu."""
    for gpu in device_info().get("gpus", []):
        name = gpu.split(",")[0]
        if m := re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name):
            return m.group(1).lower()
        return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return "cpu"


def online_phase(args, ckpt: Path, vocab: int, workdir: Path, deadline: Deadline) -> dict:
    """Part 3 from this (the client's) process; the worker is the engine's process."""
    print("== online")
    t0 = time.perf_counter()
    try:
        out = asyncio.run(part_online(args, ckpt, vocab, workdir, deadline))
    except Exception as exc:
        traceback.print_exc()
        out = {"error": f"{type(exc).__name__}: {exc}"}
    return out | {"wall_s": round(time.perf_counter() - t0, 1)}


def coldstart_phase(args, ckpt: Path, workdir: Path, deadline: Deadline) -> dict:
    """Part 5: every checkpoint file read once more (page cache warm), then a fresh process
    that imports only what an instance imports (bench/coldstart_probe.py)."""
    cache = warm_page_cache(ckpt)
    result = workdir / "coldstart.json"
    argv = [sys.executable, "-m", "bench.coldstart_probe", str(ckpt), str(result)]
    argv += ["--batch", str(args.fixed_batch), "--prompt", str(args.fixed_in)]
    argv += ["--first-prompt", str(args.decode_prompt)]
    return run_process(argv, result, "cold start probe", deadline) | {"page_cache": cache}


def orchestrate(args) -> int:
    """Phases in order of value per second: the checkpoint and bandwidth, our side, HF's,
    the cold start, then the online rates (the longest). One that would start with less
    than MIN_PHASE_S left before --deadline is skipped; results are rewritten after each."""
    deadline = Deadline(time.time() + args.deadline)
    # Byte-compiled modules for the children, where site-packages has none (as on the lent
    # GPU host, whose environment also sets PYTHONDONTWRITEBYTECODE): else every process
    # compiles torch's sources again, seconds of each start (the probe's torch import: 4.44 s
    # without them, 2.03 s with them) that an installed host (pip writes .pyc files) never
    # pays. The first child writes them, under a prefix of ours; the cold start's result
    # says so.
    os.environ.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "omni-pyc"))
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    name = args.name or f"engine-{device_tag()}" + ("-small" if args.small else "")
    workdir = Path(tempfile.mkdtemp(prefix="engine-bench-"))
    phases: dict = {"prepare": run_child("prepare", args, workdir, deadline)}
    ckpt = get(phases["prepare"], "checkpoint", "path")
    if not ckpt:
        print("no checkpoint: stopping", phases["prepare"])
        write_result(name, assemble(args, phases))
        return 1
    vocab = phases["prepare"]["checkpoint"]["config"]["vocab_size"]
    sides = bool({"check", "decode", "offline"} & set(args.parts))
    peer = str(workdir / "ours.json")
    steps: list[tuple[str, bool, Callable[[], dict]]] = [
        ("ours", sides, lambda: run_child("ours", args, workdir, deadline, ckpt=ckpt)),
        (
            "hf",
            sides and not args.no_hf,
            lambda: run_child("hf", args, workdir, deadline, ckpt=ckpt, peer=peer),
        ),
        (
            "real_weights",
            "check" in args.parts and not args.small,
            lambda: real_weights_phase(workdir, deadline),
        ),
        (
            "coldstart",
            "coldstart" in args.parts,
            lambda: coldstart_phase(args, Path(ckpt), workdir, deadline),
        ),
        (
            "online",
            "online" in args.parts,
            lambda: online_phase(args, Path(ckpt), vocab, workdir, deadline),
        ),
    ]
    for key, wanted, run in steps:
        write_result(name, assemble(args, phases))
        if not wanted:
            continue
        if deadline.left() < MIN_PHASE_S:
            phases[key] = {"skipped": "out of time (--deadline)"}
        else:
            phases[key] = run()
    res = assemble(args, phases)
    print_table(res, args)
    print("wrote", write_result(name, res))
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if res["errors"] else 0


SMALL = dict(
    shards=2,
    decode_prompt=32,
    decode_tokens=48,
    decode_repeats=2,
    sharegpt_requests=24,
    sharegpt_in_mean=40,
    sharegpt_out_mean=24,
    max_len=128,
    fixed_requests=8,
    fixed_in=64,
    fixed_out=32,
    fixed_batch=8,
    rates=[4.0, 8.0, 16.0],
    online_seconds=3.0,
    online_max_output=32,
    check_prompts=3,
    check_tokens=12,
    bw_bytes=64 << 20,
    bw_iters=5,
    deadline=300.0,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model on the CPU, few requests")
    ap.add_argument("--name", help="result file bench/results/<name>.json (engine-<device>)")
    ap.add_argument(
        "--parts",
        type=lambda s: s.split(","),
        default=list(PARTS),
        help=f"comma-separated, of {','.join(PARTS)}",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the HF side")
    ap.add_argument("--hf-sharegpt", action="store_true", help="HF on the ShareGPT mix too")
    ap.add_argument("--ckpt-root", default="/tmp/omni-engine-bench", help="checkpoint cache")
    ap.add_argument("--shards", type=int, default=4, help="safetensors files (Llama-3-8B: 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--deadline",
        type=float,
        default=540.0,
        help="seconds for the whole run: later parts are skipped, results kept",
    )
    ap.add_argument("--bw-bytes", type=int, default=2 << 30, help="copy buffer for bandwidth")
    ap.add_argument("--bw-iters", type=int, default=50)
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--decode-repeats", type=int, default=3)
    ap.add_argument("--sharegpt-requests", type=int, default=1000)
    ap.add_argument("--sharegpt-in-mean", type=float, default=200.0)
    ap.add_argument("--sharegpt-out-mean", type=float, default=180.0)
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of both lengths")
    ap.add_argument("--max-len", type=int, default=2048, help="cap of each length")
    ap.add_argument("--fixed-requests", type=int, default=128)
    ap.add_argument("--fixed-in", type=int, default=512)
    ap.add_argument("--fixed-out", type=int, default=256)
    ap.add_argument("--fixed-batch", type=int, default=128)
    ap.add_argument(
        "--max-seqs", type=int, default=None, help="the engine's batch limit (default: its own)"
    )
    ap.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[2.0, 4.0, 8.0],
        help="online Poisson rates, req/s",
    )
    ap.add_argument("--online-seconds", type=float, default=20.0, help="arrivals per rate")
    ap.add_argument("--online-max-output", type=int, default=512, help="online output cap")
    # internal: a child process runs one phase
    ap.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    known, _ = ap.parse_known_args(argv)
    if known.small:
        ap.set_defaults(**SMALL)
    args = ap.parse_args(argv)
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}")
    return args


def main() -> None:
    args = parse_args()
    if args.small:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, also for the children and worker
    if args.phase:
        run_phase(args)
        return
    sys.exit(orchestrate(args))


if __name__ == "__main__":
    main()
