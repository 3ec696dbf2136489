"""What a speculative verify step costs against a decode step, and the speedup that follows.

On a Llama-3-8B-shaped model (engine_bench's random bf16 checkpoint), at batch 1, 8 and
32 with a 512-token context each: the time of a verify step of k + 1 rows per sequence
(model_runner.run_rows, through the decode CUDA graphs, as the engine runs it), k = 0
(a plain decode step) to 8; the median of `--iters` steps, each timed alone.

Then the speedup at acceptance rate a (each proposal kept with probability a, so a step
yields (1 - a^(k+1)) / (1 - a) tokens): tokens per step times the decode step's time over
the verify step's, at the rates bench/spec_acceptance.py measured on real text (SmolLM2;
acceptance does not depend on the hardware), for the k that serves each best. And the
cost at zero acceptance: speculation.AdaptiveK's pauses leave a verify step (k = 1) at
a fraction of the steps; the overhead is that fraction times what k = 1 costs more.

The model proposers cost time of their own: a call of each (its catch-up of the target's
newest token, then k - 1 draft steps) at each k and batch, for a random EAGLE-3 head of
the published format for this shape (draft vocabulary 32,000) and a random draft model
of Llama-3.2-1B's shape. No trained head or draft for this random target exists, so their
speedups are modelled at assumed acceptance rates (labelled so), with the proposal's time
added to the verify step's.

Prints a table and writes bench/results/spec-<device>.json. --small: a tiny shape on
the CPU, to check the harness.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import engine_bench as eb  # noqa: E402
from bench.results_io import write_result  # noqa: E402

BATCHES = (1, 8, 32)
KS = range(0, 9)
CONTEXT = 512


def step_times(runner, batch: int, iters: int) -> dict[int, float]:
    """Median seconds of a verify step at each k for `batch` sequences of CONTEXT tokens."""
    from omni.engine.block_manager import BlockManager
    from omni.engine.scheduler import Batch
    from omni.engine.sequence import Sequence

    blocks = BlockManager(runner.num_blocks, runner.block_size)
    gen = torch.Generator().manual_seed(batch)
    vocab = runner.model.cfg.vocab_size
    seqs = []
    for _ in range(batch):
        seq = Sequence(token_ids=torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist())
        blocks.allocate(seq)
        seqs.append(seq)
    runner.run(Batch(seqs, [CONTEXT - 1] * batch))  # the prompts' K/V, but for the newest
    for seq in seqs:
        seq.num_computed = CONTEXT - 1
        blocks.reserve(seq, CONTEXT + max(KS))
    out = {}
    for k in KS:
        rows = [[seq.token_ids[-1]] + [7] * k for seq in seqs]
        for _ in range(3):  # capture and warm
            runner.run_rows(seqs, rows)
        eb.sync()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            runner.run_rows(seqs, rows)
            eb.sync()
            times.append(time.perf_counter() - t0)
        out[k] = statistics.median(times)
    for seq in seqs:
        blocks.free(seq)
    return out


def propose_times(proposer, runner, blocks, batch: int, iters: int) -> dict[int, float]:
    """Median seconds of one proposer call at each k >= 1 for `batch` sequences of
    CONTEXT tokens, in the steady state: each call first catches up one new token of
    the target's (as after a verify step that accepted nothing)."""
    from omni.engine.sequence import Sequence

    gen = torch.Generator().manual_seed(100 + batch)
    vocab = runner.model.cfg.vocab_size
    seqs = []
    for _ in range(batch):
        seq = Sequence(token_ids=torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist())
        blocks.allocate(seq)
        blocks.reserve(seq, CONTEXT + 2 * (max(KS) + 1) * (iters + 8))
        seq.num_computed = CONTEXT - 1
        seqs.append(seq)
    proposer.propose(seqs, [1] * batch)  # the prompts
    out = {}
    for k in KS:
        if not k:
            continue
        times = []
        for i in range(iters + 3):
            for seq in seqs:  # the target moved one token on
                seq.token_ids.append(int(torch.randint(0, vocab, (1,), generator=gen)))
                seq.num_computed += 1
            eb.sync()
            t0 = time.perf_counter()
            proposer.propose(seqs, [k] * batch)  # (ends on its one wait for the tokens)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        out[k] = statistics.median(times)
    for seq in seqs:
        proposer.release(seq.seq_id)
        blocks.free(seq)
    return out


def model_proposers(model, runner, args) -> dict[str, dict[int, dict[int, float]]]:
    """propose_times of an EAGLE-3 head and a draft model, per batch."""
    from omni.engine.block_manager import BlockManager
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.eagle3 import load_eagle3
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.proposers import DraftProposer, FeatureProposer
    from omni.engine.spec_config import SpecConfig
    from omni.testing.checkpoints import eagle3_head

    root = Path(args.ckpt_root)
    head_dir = root / ("eagle3-small" if args.small else "eagle3-8b")
    if not (head_dir / "config.json").exists():
        eagle3_head(head_dir, model.cfg, draft_vocab=256 if args.small else 32000)
    head, taps = load_eagle3(head_dir, model)
    taps.fit(CONTEXT * max(BATCHES))
    model.taps = taps
    if args.small:
        draft_cfg = eb.hf_config("llama", 128, 2, 4, 2, 256, tied=True)
        draft_cfg.update(vocab_size=1024)
    else:  # Llama-3.2-1B's shape
        draft_cfg = eb.hf_config("llama", 2048, 16, 32, 8, 8192, tied=True)
        draft_cfg.update(vocab_size=128256, rope_theta=500000.0)
    draft_dir, _ = eb.write_checkpoint(root, draft_cfg, 1, 1)
    w = model.lm_head.weight
    draft = LlamaForCausalLM.load(Checkpoint.open(draft_dir), w.device, w.dtype)

    def spec(method: str) -> SpecConfig:
        return SpecConfig(method=method, k=max(KS), max_batch=max(BATCHES), path="/bench")

    out = {}
    try:
        for name, make in (
            ("eagle3", lambda b: FeatureProposer(spec("eagle3"), head, taps, runner, b)),
            ("draft-1b", lambda b: DraftProposer(spec("draft"), draft, runner, b)),
        ):
            blocks = BlockManager(runner.num_blocks, runner.block_size)
            proposer = make(blocks)
            out[name] = {b: propose_times(proposer, runner, blocks, b, args.iters) for b in BATCHES}
            del proposer
    finally:
        model.taps = None
    return out


def tokens_per_step(a: float, k: int) -> float:
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def zero_acceptance_share(steps: int = 10000) -> float:
    """The share of steps that verify when nothing is ever accepted (each step, verify or
    not, then yields one token)."""
    from omni.engine.speculative import AdaptiveK

    k, verifying = AdaptiveK(8), 0
    for generated in range(steps):
        if proposed := k.k_at(generated):
            verifying += 1
            k.update(proposed, 0, generated)
    return verifying / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ckpt-root", default="/tmp/omni-engine-bench")
    args = ap.parse_args()
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.model_runner import ModelRunner

    cfg = eb.llama3_8b_config(args.small)
    ckpt, _ = eb.write_checkpoint(Path(args.ckpt_root), cfg, 4, 0)
    device, dtype = ("cpu", torch.float32) if args.small else eb.engine_device()
    model = LlamaForCausalLM.load(Checkpoint.open(ckpt), device, dtype)
    if args.small:
        args.iters = 5
    extra = 2 * (max(KS) + 1) * (args.iters + 8)  # the proposers' runs grow each sequence
    runner = ModelRunner(model, num_blocks=(max(BATCHES) * (CONTEXT + extra + 16)) // 16 + 8)
    times = {b: step_times(runner, b, args.iters) for b in BATCHES}
    proposing = model_proposers(model, runner, args)

    measured = REPO / "bench" / "results" / "spec-acceptance-cpu.json"
    rates = {}
    if measured.exists():
        for name, f in json.loads(measured.read_text())["figures"].items():
            kind = name.split(" k=")[0]
            rates[kind] = max(rates.get(kind, 0.0), f["acceptance"])
    rates |= {"a=0.5": 0.5, "a=0.7": 0.7}
    speedups = {}
    for b, t in times.items():
        for kind, a in rates.items():
            best = max((tokens_per_step(a, k) * t[0] / t[k], k) for k in KS if k)
            speedups[f"batch {b} {kind}"] = {"acceptance": a, "speedup": best[0], "k": best[1]}
    assumed = (0.5, 0.7, 0.8)  # no trained proposer for a random target: assumed rates
    for name, per_batch in proposing.items():
        for b, t in times.items():
            p = per_batch[b]
            for a in assumed:
                best = max((tokens_per_step(a, k) * t[0] / (t[k] + p[k]), k) for k in KS if k)
                speedups[f"batch {b} {name} assumed a={a}"] = {
                    "acceptance": a,
                    "speedup": best[0],
                    "k": best[1],
                    "assumed": True,
                }
    share = zero_acceptance_share()
    overhead = {b: share * (t[1] / t[0] - 1) for b, t in times.items()}
    overhead_with = {
        name: {b: share * ((times[b][1] + p[b][1]) / times[b][0] - 1) for b in BATCHES}
        for name, p in proposing.items()
    }

    print(f"{'verify / decode step':22}" + "".join(f"{'k=' + str(k):>8}" for k in KS))
    for b, t in times.items():
        print(f"{'batch ' + str(b):22}" + "".join(f"{t[k] / t[0]:>8.3f}" for k in KS))
    print(f"{'decode step, ms':22}" + "".join(f"{times[b][0] * 1e3:>8.2f}" for b in BATCHES))
    for name, per_batch in proposing.items():
        print(f"\n{name + ' call / decode':22}" + "".join(f"{'k=' + str(k):>8}" for k in KS if k))
        for b, p in per_batch.items():
            row = "".join(f"{p[k] / times[b][0]:>8.3f}" for k in KS if k)
            print(f"{'batch ' + str(b):22}" + row)
    print(f"\n{'speedup':34}{'acceptance':>11}{'best k':>7}{'x':>7}")
    for name, s in speedups.items():
        print(f"{name:34}{s['acceptance']:>11.3f}{s['k']:>7}{s['speedup']:>7.2f}")
    print(f"\nzero acceptance: verify steps at {share:.3f} of steps; overhead " +
          ", ".join(f"batch {b} {o * 100:.2f}%" for b, o in overhead.items()))  # fmt: skip
    for name, o in overhead_with.items():
        print(f"  with {name}: " + ", ".join(f"batch {b} {v * 100:.2f}%" for b, v in o.items()))
    tag = "small" if args.small else eb.device_tag()
    data = {
        "config": cfg,
        "context": CONTEXT,
        "step_s": {str(b): {str(k): v for k, v in t.items()} for b, t in times.items()},
        "acceptance_from": str(measured.relative_to(REPO)) if measured.exists() else None,
        "speedups": speedups,
        "propose_s": {
            n: {str(b): {str(k): v for k, v in t.items()} for b, t in p.items()}
            for n, p in proposing.items()
        },
        "zero_acceptance": {
            "verify_share": share,
            "overhead": overhead,
            "overhead_with": overhead_with,
        },
        "targets": {
            "zero-acceptance overhead <= 3%": all(
                o <= 0.03
                for o in [
                    *overhead.values(),
                    *(v for w in overhead_with.values() for v in w.values()),
                ]
            )
        },
    }
    print(f"wrote {write_result(f'spec-{tag}', data)}")


if __name__ == "__main__":
    main()
