"""GPU memory overcommit: 13 models whose quotas sum to 4x the budget, a Zipf request mix.

Three runs, each a fresh omnid over the same random checkpoints and request sequence
(closed loop: `--concurrency` clients; or open loop: `--rate` Poisson arrivals per second):
- overcommit: every model, all cold; omnid swaps them in on demand;
- baseline-fit: only the models that fit the budget (most popular first); the rest 404;
- single: the hottest model alone, replaying its arrivals from the overcommit run, so its
  p99 is the reference for the hot model's p99 under overcommit;
- overcommit-noyield (on request): overcommit with `gpu_yield = 0`, colder instances not
  holding back their steps while a hotter one serves: what the yielding is worth.
Reports requests/s, hot/cold latency, swap-ins (from the admin API's swap_history) and the
GPU busy fraction (NVML). Writes bench/results/overcommit-<name>.json. `--smoke`: three
tiny CPU models, no GPU keys, for checking the harness anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import torch  # noqa: E402

from bench.results_io import write_result  # noqa: E402
from omni.model_spec import parse_size  # noqa: E402
from omni.paths import admin_socket  # noqa: E402
from omni.testing.checkpoints import save_word_level_tokenizer  # noqa: E402

GIB = 1 << 30


def hf_config(kind: str, h: int, layers: int, heads: int, kv: int, inter: int, tied: bool) -> dict:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]
    return {
        "architectures": [arch],
        "model_type": kind,
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "vocab_size": 32000,
        "tie_word_embeddings": tied,
        "rope_theta": 1e6 if kind == "qwen2" else 1e4,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",  # no eos_token_id: every request runs to max_tokens
    }


# Real 0.5-1B shapes (head_dim a power of two, as the Triton kernels want), 32k vocab:
# Llama ~443M params (0.83 GiB bf16); Qwen2 ~590M with q/k/v biases, tied (1.10 GiB).
SHAPES = {
    "llama": hf_config("llama", 1024, 24, 16, 8, 4096, tied=False),
    "qwen2": hf_config("qwen2", 1536, 16, 12, 2, 6144, tied=True),
}
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512)
TINY.update(num_key_value_heads=2, vocab_size=2048)  # --smoke: a few MB each


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The HF tensor names and shapes omni's Llama loader expects for config `c`."""
    h, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    hd = h // heads
    q, kv, inter = heads * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    attn = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q)}
    mlp = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(f"{p}{k}_layernorm.weight", (h,)) for k in ("input", "post_attention")]
        out += [(f"{p}self_attn.{k}_proj.weight", shape) for k, shape in attn.items()]
        out += [(f"{p}mlp.{k}_proj.weight", shape) for k, shape in mlp.items()]
        if c["model_type"] == "qwen2":  # q/k/v biases
            out += [(f"{p}self_attn.{k}_proj.bias", attn[k][:1]) for k in "qkv"]
    out.append(("model.norm.weight", (h,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (vocab, h)))
    return out


def weights_bytes(c: dict) -> int:
    return sum(2 * math.prod(shape) for _, shape in tensor_shapes(c))


def write_weights(path: Path, c: dict, seed: int) -> None:
    """A bf16 safetensors file written one tensor at a time: memory stays at one tensor."""
    header, offset = {}, 0
    for name, shape in tensor_shapes(c):
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    gen = torch.Generator().manual_seed(seed)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in tensor_shapes(c):
            norm = name.endswith("norm.weight")
            t = torch.ones(shape) if norm else torch.randn(shape, generator=gen) * 0.02
            f.write(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    tmp.rename(path)


def make_models(root: Path, n: int, tiny: bool) -> list[tuple[str, Path, dict]]:
    """m00..m{n-1}, Llama and Qwen2 shapes alternating, each in its own directory; one weights
    file per shape, hard-linked into each (random weights: sharing them changes nothing)."""
    shared = root / ("tiny" if tiny else "real") / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    files = []
    for i, base in enumerate(SHAPES.values()):
        cfg = {**base, **(TINY if tiny else {})}
        tag = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]
        weights = shared / f"{cfg['model_type']}-{tag}.safetensors"
        tok = shared / f"tokenizer-{cfg['vocab_size']}.json"
        if not weights.exists():
            t0 = time.monotonic()
            write_weights(weights, cfg, seed=i)
            size, took = weights.stat().st_size / GIB, time.monotonic() - t0
            print(f"wrote {weights} ({size:.2f} GiB, {took:.0f}s)")
        if not tok.exists():
            save_word_level_tokenizer(tok, cfg["vocab_size"])
        files.append((cfg, weights, tok))
    out = []
    for i in range(n):
        cfg, weights, tok = files[i % len(files)]
        d = shared.parent / f"m{i:02d}"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        shutil.copyfile(tok, d / "tokenizer.json")
        link = d / "model.safetensors"
        if not (link.exists() and os.path.samefile(link, weights)):
            link.unlink(missing_ok=True)
            os.link(weights, link)
        out.append((d.name, d, cfg))
    return out


def zipf_stream(n: int, s: float, vocab: int, length: int, seed: int) -> Iterator[tuple[int, str]]:
    """(model rank, prompt) pairs; rank 0 is the hottest. The same seed, the same sequence."""
    rng = random.Random(seed)
    weights = [(k + 1) ** -s for k in range(n)]
    while True:
        m = rng.choices(range(n), weights)[0]
        yield m, " ".join(f"t{rng.randrange(1, vocab)}" for _ in range(length))


def poisson_arrivals(stream: Iterator[tuple[int, str]], rate: float, seconds: float, seed: int):
    """Open-loop arrivals: `rate` requests/s on average (exponential gaps) for `seconds`,
    each with its (model, prompt) from `stream`; the records replay() sends."""
    rng, at, out = random.Random(seed), 0.0, []
    while (at := at + rng.expovariate(rate)) < seconds:
        m, prompt = next(stream)
        out.append({"model": m, "prompt": prompt, "start": at})
    return out


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no data (a run may have no cold or no swap-in figures)."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


class BusySampler:
    """Mean NVML GPU utilisation, sampled every 100 ms in a thread; None without NVML."""

    def __init__(self, index: int):
        self.samples: list[int] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(index), pynvml
        except Exception:  # no library, no driver, no GPU: the figure is null
            self._handle = None

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)

    def __enter__(self) -> BusySampler:
        if self._handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._handle is not None:
            self._thread.join()

    @property
    def fraction(self) -> float | None:
        return sum(self.samples) / len(self.samples) / 100 if self.samples else None


def free_gpu_bytes(index: int) -> int | None:
    """Free memory on the GPU, from NVML, else torch in a child (no CUDA context kept here)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)
    except Exception:
        code = f"import torch; print(torch.cuda.mem_get_info({index})[0])"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        return int(out.stdout) if out.returncode == 0 and out.stdout.strip().isdigit() else None


class Omnid:
    """One omnid process with its own config, port and short runtime dir (Unix path limit)."""

    def __init__(self, config: str, workdir: Path, sandbox: str):
        self.workdir = workdir
        (workdir / "omnid.toml").write_text(config)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.runtime = Path(tempfile.mkdtemp(prefix="omni-", dir="/tmp")) / "run"
        argv = [sys.executable, "-m", "omni.runtime.omnid", "--config", str(workdir / "omnid.toml")]
        argv += ["--port", str(self.port), "--runtime-dir", str(self.runtime)]
        argv += ["--data-dir", str(workdir / "data"), "--no-defaults", "--sandbox", sandbox]
        self.log = workdir / "omnid.log"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._out, stderr=subprocess.STDOUT)

    async def instances(self) -> list[dict]:
        conn = aiohttp.UnixConnector(path=str(admin_socket(self.runtime)))
        async with (
            aiohttp.ClientSession(connector=conn) as s,
            s.get("http://omnid/v1/instances") as r,
        ):
            return (await r.json())["instances"]

    async def dashboard(self) -> dict:
        """omnid's dashboard snapshot (what its live page shows), from the admin socket."""
        conn = aiohttp.UnixConnector(path=str(admin_socket(self.runtime)))
        async with (
            aiohttp.ClientSession(connector=conn) as s,
            s.get("http://omnid/v1/dashboard") as r,
        ):
            return await r.json()

    async def record_dashboard(self, into: list[dict], every_s: float = 1.0) -> None:
        """Append a dashboard snapshot every `every_s` until cancelled
        (bench/diagnostics/dashboard_shot.py renders the page from them)."""
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
                into.append(await self.dashboard())
            await asyncio.sleep(every_s)

    async def wait_ready(self, names: list[str], timeout_s: float) -> None:
        """Every instance ready, and settled resident or swapped where omnid reports residency."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"omnid exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}"
                )
            with contextlib.suppress(aiohttp.ClientError, OSError, KeyError, ValueError):
                inst = {i["name"]: i for i in await self.instances()}
                failed = [
                    f"{n}: {inst[n]['failure']}" for n in names if inst.get(n, {}).get("failure")
                ]
                if failed:  # a crash loop omnid gave up on: its exit and last output
                    raise RuntimeError("instances failed to start:\n" + "\n".join(failed))
                if all(
                    inst.get(n, {}).get("state") == "ready"
                    and inst[n].get("residency", "resident") in ("resident", "swapped")
                    for n in names
                ):
                    return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"instances not ready in {timeout_s}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        shutil.rmtree(self.runtime.parent, ignore_errors=True)


def config_toml(
    entries: list[tuple[str, Path, dict]], args, budget: int, cold: bool, gpu_yield: float | None
) -> str:
    """omnid's config; --smoke leaves out every GPU key (CPU instances, today's loader)."""
    lines: list[str] = []
    if not args.smoke:
        lines += [f"swap_timeout = {args.swap_timeout}", f"request_timeout = {args.timeout}"]
        if gpu_yield is not None:
            lines.append(f"gpu_yield = {gpu_yield}")
        lines += ["", "[[gpus]]", f"index = {args.gpu}", f"budget = {budget}", ""]
    for name, path, _ in entries:
        lines += ["[[models]]", f'name = "{name}"', f"path = {json.dumps(str(path))}"]
        if not args.smoke:
            lines += ['runtime = "omni"', f"gpu = {args.gpu}", f'quota = "{args.quota}"']
            lines += [f"permits = {args.permits}", f"cold = {str(cold).lower()}"]
        lines.append("")
    return "\n".join(lines)


class Load:
    """The load generator against one omnid; every record keeps its prompt for replay."""

    def __init__(self, session: aiohttp.ClientSession, port: int, names: list[str], args):
        self.session, self.names, self.args = session, names, args
        self.url = f"http://127.0.0.1:{port}/v1/completions"

    async def complete(self, m: int, prompt: str, t0: float) -> dict:
        start, tokens = time.monotonic(), 0
        body = {"model": self.names[m], "prompt": prompt, "temperature": 0}
        body["max_tokens"] = self.args.max_tokens
        try:
            async with self.session.post(self.url, json=body) as r:
                status: int | str = r.status
                data = await r.read()
            with contextlib.suppress(ValueError, AttributeError):
                tokens = json.loads(data).get("usage", {}).get("completion_tokens", 0)
        except TimeoutError:
            status = "timeout"
        except aiohttp.ClientError as exc:
            status = type(exc).__name__
        latency = time.monotonic() - start
        rec = {"model": m, "start": start - t0, "latency": latency, "status": status}
        return rec | {"tokens": tokens, "prompt": prompt}

    async def closed_loop(self, stream: Iterator[tuple[int, str]], seconds: float) -> list[dict]:
        """`concurrency` clients, each sending its next request when its last one returns."""
        t0, recs = time.monotonic(), []

        async def client() -> None:
            while time.monotonic() < t0 + seconds:
                recs.append(await self.complete(*next(stream), t0))

        await asyncio.gather(*(client() for _ in range(self.args.concurrency)))
        return recs

    async def replay(self, arrivals: list[dict]) -> list[dict]:
        """Open loop: each recorded request sent at its recorded offset from the window start."""
        t0 = time.monotonic()

        async def at(rec: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + rec["start"] - time.monotonic()))
            return await self.complete(rec["model"], rec["prompt"], t0)

        return list(await asyncio.gather(*(at(r) for r in arrivals)))


def summarize(recs: list[dict], before: list[dict], after: list[dict], since: float, args) -> dict:
    """Throughput, latency by group, and swap-ins in the window (counters and swap_history)."""
    ok = [r for r in recs if r["status"] == 200]
    elapsed = max((r["start"] + r["latency"] for r in recs), default=0.0) or 1e-9

    def lat(select) -> dict:
        vals = [r["latency"] for r in ok if select(r["model"])]
        return {"n": len(vals), "p50_s": percentile(vals, 50), "p99_s": percentile(vals, 99)}

    hist = [h for i in after for h in i.get("swap_history") or []]

    def swap_stats(direction: str) -> dict:
        swaps = [h for h in hist if h.get("direction") == direction and h.get("at", 0) >= since]
        secs = [h["seconds"] for h in swaps if "seconds" in h]
        per_gib = [h["seconds"] * 1e3 / (h["bytes"] / GIB) for h in swaps if h.get("bytes")]
        key = f"swaps_{direction}"
        count = sum(i.get(key, 0) for i in after) - sum(i.get(key, 0) for i in before)
        return {
            "count": count,
            "p50_s": percentile(secs, 50),
            "p99_s": percentile(secs, 99),
            "ms_per_gib_p50": percentile(per_gib, 50),
            "ms_per_gib_p99": percentile(per_gib, 99),
            "history_count": len(swaps),  # < count: omnid's history is bounded
            "seconds": secs,
            "bytes": [h.get("bytes") for h in swaps],
        }

    return {
        "requests": len(recs),
        "ok": len(ok),
        "status_counts": dict(Counter(str(r["status"]) for r in recs)),
        "elapsed_s": elapsed,
        "requests_per_s": len(ok) / elapsed,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
        "latency": {
            "hot": lat(lambda m: m < args.hot),
            "cold": lat(lambda m: m >= args.hot),
            "top1": lat(lambda m: m == 0),
            "per_model": {f"m{k:02d}": lat(lambda m, k=k: m == k) for k in range(args.models)},
        },
        "swap_in": swap_stats("in"),
        # (bytes: what the shim copied; the KV pool it releases is not among them)
        "swap_out": swap_stats("out"),
    }


def swap_overlap(recs: list[dict], instances: list[dict], window_unix: float) -> dict:
    """m00's latency split by whether any swap (in or out, of any model) ran during the
    request: tells swap interference apart from sharing the GPU's compute."""
    swaps = [
        (h["at"] - h["seconds"] - window_unix, h["at"] - window_unix)
        for i in instances
        for h in i.get("swap_history") or []
        if h.get("at", 0) >= window_unix
    ]

    def overlaps(r: dict) -> bool:
        return any(a < r["start"] + r["latency"] and b > r["start"] for a, b in swaps)

    top = [r for r in recs if r["model"] == 0 and r["status"] == 200]
    out = {}
    for label, group in (("during_swaps", True), ("no_swap", False)):
        vals = [r["latency"] for r in top if overlaps(r) == group]
        out[label] = {"n": len(vals), "p50_s": percentile(vals, 50), "p99_s": percentile(vals, 99)}
    return out


async def admission_snapshot(session: aiohttp.ClientSession, port: int) -> dict:
    """omnid's admission-wait histogram per model (cumulative): count, sum, buckets."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        text = await resp.text()
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "omni_request_admission_seconds":
            continue
        for sample in family.samples:
            model = out.setdefault(sample.labels["model"], {"count": 0, "sum": 0.0, "le": {}})
            if sample.name.endswith("_count"):
                model["count"] = sample.value
            elif sample.name.endswith("_sum"):
                model["sum"] = sample.value
            elif sample.name.endswith("_bucket"):
                model["le"][sample.labels["le"]] = sample.value
    return out


def admission_window(before: dict, after: dict) -> dict:
    """Per model, within the window: mean wait before reaching the instance, and the
    share of requests that waited more than 50 ms (a swap-in, or a full permit queue)."""
    out = {}
    for model, a in after.items():
        b = before.get(model, {"count": 0, "sum": 0.0, "le": {}})
        n = a["count"] - b["count"]
        if n <= 0:
            continue
        quick = a["le"].get("0.05", 0) - b["le"].get("0.05", 0)
        out[model] = {
            "requests": int(n),
            "mean_wait_s": round((a["sum"] - b["sum"]) / n, 4),
            "waited_over_50ms": round(1 - quick / n, 3),
        }
    return out


async def run_one(label: str, served: list[int], entries, args, budget: int, arrivals=None):
    """A fresh omnid serving `served`: warm-up, then the window (closed loop, or a replay)."""
    names, vocab = [e[0] for e in entries], entries[0][2]["vocab_size"]
    workdir = Path(tempfile.mkdtemp(prefix=f"overcommit-{label}-"))
    gpu_yield = 0.0 if label == "overcommit-noyield" else args.gpu_yield
    cold = label.startswith("overcommit")
    config = config_toml([entries[i] for i in served], args, budget, cold, gpu_yield)
    omnid = Omnid(config, workdir, args.sandbox)
    timeout = aiohttp.ClientTimeout(total=args.timeout + args.swap_timeout + 60)
    snapshots: list[dict] = []  # the dashboard's, through the measured window
    recorder: asyncio.Task | None = None
    try:
        t0 = time.monotonic()
        await omnid.wait_ready([names[i] for i in served], args.ready_timeout)
        print(f"[{label}] {len(served)} instances ready in {time.monotonic() - t0:.0f}s")
        async with aiohttp.ClientSession(timeout=timeout) as session:
            load = Load(session, omnid.port, names, args)
            for i in served:  # one request each first: first-use costs stay out of the window
                await load.complete(i, "t1 t2 t3", 0.0)
            warm = zipf_stream(args.models, args.zipf, vocab, args.prompt_tokens, args.seed + 1)
            warm = (x for x in warm if x[0] in served)
            if args.rate:
                await load.replay(poisson_arrivals(warm, args.rate, args.warmup, args.seed + 1))
            else:
                await load.closed_loop(warm, args.warmup)
            before, since = await omnid.instances(), time.time()
            waits_before = await admission_snapshot(session, omnid.port)
            recorder = asyncio.create_task(omnid.record_dashboard(snapshots))
            with BusySampler(args.gpu) as busy:
                window_unix = time.time()  # requests' `start` counts from here (about)
                stream = zipf_stream(args.models, args.zipf, vocab, args.prompt_tokens, args.seed)
                if arrivals is None and args.rate:
                    arrivals = poisson_arrivals(stream, args.rate, args.duration, args.seed)
                if arrivals is None:
                    recs = await load.closed_loop(stream, args.duration)
                else:
                    recs = await load.replay(arrivals)
            recorder.cancel()
            after = await omnid.instances()
            waits = admission_window(waits_before, await admission_snapshot(session, omnid.port))
    finally:
        if recorder is not None:
            recorder.cancel()
        omnid.stop()
    if label == "overcommit" and snapshots:
        write_result(f"overcommit-{args.name}-dashboard", {"run": label, "snapshots": snapshots})
    result = summarize(recs, before, after, since, args)
    result.update(served=[names[i] for i in served], gpu_busy_fraction=busy.fraction)
    result["hot_vs_swaps"] = swap_overlap(recs, after, window_unix)
    result["records"] = [{k: r[k] for k in ("model", "start", "latency", "status")} for r in recs]
    result["instances"] = after
    result["admission"] = waits  # how much of the latency is waiting, not serving
    print(f"[{label}] {result['ok']}/{result['requests']} ok, {result['status_counts']}")
    shutil.rmtree(workdir, ignore_errors=True)
    return result, recs


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(runs: dict) -> None:
    heads = ["run", "req/s", "ok/sent", "hot p50/p99 s", "cold p50/p99 s", "m00 p99"]
    heads += ["swaps", "swap-in p50/p99 s", "ms/GiB", "swap-out p50/p99 s", "busy"]
    widths = [19, 7, 10, 15, 15, 8, 6, 18, 7, 19, 5]

    def row(cells: list[str]) -> str:
        return cells[0].ljust(widths[0]) + "".join(map(str.rjust, cells[1:], widths[1:]))

    print(row(heads))
    for label, run in runs.items():
        if "error" in run:
            print(f"{label:19}error: {run['error'].splitlines()[0][:100]}")
            continue
        hot, cold, top1 = (run["latency"][k] for k in ("hot", "cold", "top1"))
        sw = run["swap_in"]
        cells = [label, fmt(run["requests_per_s"], ".2f"), f"{run['ok']}/{run['requests']}"]
        cells += [f"{fmt(g['p50_s'])}/{fmt(g['p99_s'])}" for g in (hot, cold)]
        cells += [fmt(top1["p99_s"]), str(sw["count"]), f"{fmt(sw['p50_s'])}/{fmt(sw['p99_s'])}"]
        out = run.get("swap_out", {})
        cells += [fmt(sw["ms_per_gib_p50"], ".0f")]
        cells += [f"{fmt(out.get('p50_s'))}/{fmt(out.get('p99_s'))}"]
        cells += [fmt(run["gpu_busy_fraction"], ".2f")]
        print(row(cells))
    for label, run in runs.items():
        print(f"  {label}: statuses {run.get('status_counts')}")
        split = run.get("hot_vs_swaps")
        if split and split["during_swaps"]["n"]:
            d, q = split["during_swaps"], split["no_swap"]
            print(
                f"  {label}: m00 p50/p99 during a swap {fmt(d['p50_s'])}/{fmt(d['p99_s'])} s "
                f"(n={d['n']}), with none {fmt(q['p50_s'])}/{fmt(q['p99_s'])} s (n={q['n']})"
            )
        top = run.get("admission", {}).get("m00")
        if top:
            print(
                f"  {label}: m00 waited {top['mean_wait_s'] * 1e3:.0f} ms on average before "
                f"reaching its instance; {top['waited_over_50ms']:.0%} of its requests over 50 ms"
            )


def check_targets(runs: dict) -> dict:
    """The issue's two targets, each PASS, FAIL, or n/a where there is no figure to judge."""
    label = "overcommit" if "overcommit" in runs else "overcommit-noyield"
    hot = runs.get(label, {}).get("latency", {}).get("top1", {}).get("p99_s")
    ref = runs.get("single", {}).get("latency", {}).get("top1", {}).get("p99_s")
    swap = runs.get(label, {}).get("swap_in", {}).get("ms_per_gib_p50")
    cold = runs.get(label, {}).get("latency", {}).get("cold", {})
    hot_ok = "n/a" if not (hot and ref) else "PASS" if hot <= 1.10 * ref else "FAIL"
    swap_ok = "n/a" if swap is None else "PASS" if swap < 100 else "FAIL"
    p50, p99 = cold.get("p50_s"), cold.get("p99_s")
    cold_ok = "n/a" if p50 is None else "PASS" if p50 < 0.3 and p99 < 1.5 else "FAIL"
    print(f"m00 p99: {label} {fmt(hot)} s vs single {fmt(ref)} s (<= 1.10x): {hot_ok}")
    print(f"cold swap-in p50: {fmt(swap, '.1f')} ms/GiB (< 100): {swap_ok}")
    print(f"cold models p50 {fmt(p50)} s (< 0.3), p99 {fmt(p99)} s (< 1.5): {cold_ok}")
    return {
        "cold_p50_under_0.3_s_p99_under_1.5_s": {"p50_s": p50, "p99_s": p99, "verdict": cold_ok},
        "hot_p99_within_10pct_of_single": {
            "run": label,
            "overcommit_m00_p99_s": hot,
            "single_m00_p99_s": ref,
            "ratio": hot / ref if hot and ref else None,
            "verdict": hot_ok,
        },
        "swap_in_p50_under_100_ms_per_gib": {"p50_ms_per_gib": swap, "verdict": swap_ok},
    }


async def main_async(args) -> int:
    quota = parse_size(args.quota)
    budget = int(args.models * quota / args.overcommit)
    fit = max(1, budget // quota)
    if not args.smoke:  # the GPU is shared: never manage more than half its free memory
        free = free_gpu_bytes(args.gpu)
        if free is None:
            print(f"refusing: cannot read GPU {args.gpu}'s free memory (NVML or torch)")
            return 2
        if args.models * quota > 0.5 * free:
            print(f"refusing: {args.models} x {args.quota} > half of {free / GIB:.1f} GiB free")
            return 2
        if max(weights_bytes(cfg) for cfg in SHAPES.values()) >= quota:
            print(f"refusing: the largest model's weights do not fit a {args.quota} quota")
            return 2
    entries = make_models(Path(args.models_dir), args.models, tiny=args.smoke)
    sizes = {name: weights_bytes(cfg) for name, _, cfg in entries}
    print(f"{args.models} models, quota {args.quota}, budget {budget / GIB:.2f} GiB, {fit} fit")
    config = dict(vars(args), quota_bytes=quota, budget_bytes=budget, fit=fit)
    config.update(weights_bytes=sizes, shapes={n: cfg for n, _, cfg in entries[:2]})
    runs: dict = {}
    raw: dict = {}
    plan = {
        "overcommit": range(args.models),
        "baseline-fit": range(fit),
        "single": [0],
        "overcommit-noyield": range(args.models),
    }
    for label in args.runs.split(","):
        served = plan[label]
        arrivals = None
        if label == "single":  # the hot model's share of the overcommit stream, same offsets
            first = raw.get("overcommit") or raw.get("overcommit-noyield", [])
            arrivals = [r for r in first if r["model"] == 0]
            if not arrivals:
                runs[label] = {"error": "no overcommit requests for m00 to replay"}
                continue
        try:
            runs[label], raw[label] = await run_one(
                label, list(served), entries, args, budget, arrivals
            )
        except Exception as exc:  # one failed run should not lose the others' figures
            runs[label] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{label}] failed: {runs[label]['error']}")
        # Written after every run: a run cut short by a time limit keeps the earlier ones.
        partial = {"config": config, "runs": runs, "targets": check_targets(runs)}
        write_result(f"overcommit-{args.name}", partial)
    print_table(runs)
    data = {"config": config, "runs": runs, "targets": check_targets(runs)}
    print("wrote", write_result(f"overcommit-{args.name}", data))
    return 1 if any("error" in r for r in runs.values()) else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", default="h100", help="result file: overcommit-<name>.json")
    ap.add_argument("--models-dir", default="/tmp/omni-overcommit-models", help="checkpoint cache")
    ap.add_argument("--models", type=int, default=13)
    ap.add_argument("--quota", default="2.5GiB", help="GPU memory quota per model")
    ap.add_argument("--overcommit", type=float, default=4.0, help="sum(quotas) / budget")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the model mix")
    ap.add_argument("--hot", type=int, default=3, help="top Zipf ranks reported as hot")
    ap.add_argument("--duration", type=float, default=60.0, help="measured window, seconds")
    ap.add_argument("--warmup", type=float, default=20.0, help="unmeasured load first, seconds")
    ap.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    ap.add_argument(
        "--rate", type=float, default=0.0, help="open loop instead: Poisson arrivals, req/s"
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--permits", type=int, default=16)
    ap.add_argument("--runs", default="overcommit,baseline-fit,single", help="which, in order")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--sandbox", default="auto", help="omnid's --sandbox mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--swap-timeout", type=float, default=30.0)
    ap.add_argument("--gpu-yield", type=float, help="omnid's gpu_yield (default: omnid's)")
    ap.add_argument("--request-timeout", dest="timeout", type=float, default=120.0)
    ap.add_argument("--smoke", action="store_true", help="3 tiny CPU models: checks the harness")
    args = ap.parse_args()
    unknown = set(args.runs.split(",")) - {
        "overcommit",
        "baseline-fit",
        "single",
        "overcommit-noyield",
    }
    if unknown:
        ap.error(f"--runs: unknown run {sorted(unknown)[0]!r}")
    if args.smoke:
        args.models, args.concurrency, args.duration, args.warmup = 3, 4, 10.0, 3.0
        args.sandbox, args.hot = "process", 1
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
