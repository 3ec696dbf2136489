"""Submitting requests straight to an Engine and collecting what it streams back; steps
straight through a ModelRunner."""

from __future__ import annotations

import queue

from omni.engine.block_manager import BlockManager
from omni.engine.engine import Engine, GenerationRequest, StepOutput
from omni.engine.model_runner import ModelRunner
from omni.engine.sampling import SamplingParams
from omni.engine.scheduler import Batch
from omni.engine.sequence import Sequence


def run_requests(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, timeout_s: float = 120
) -> list[list[StepOutput]]:
    """Submit all prompts at once (so they batch); each one's outputs, in order, to the end."""
    queues = [queue.Queue() for _ in prompts]
    for prompt, q in zip(prompts, queues, strict=True):
        engine.submit(GenerationRequest(prompt, params), q.put)
    results = []
    for q in queues:
        steps = [q.get(timeout=timeout_s)]
        while not steps[-1].finished:
            steps.append(q.get(timeout=timeout_s))
        results.append(steps)
    return results


def tokens(steps: list[StepOutput]) -> list[int]:
    return [t for s in steps for t in s.token_ids]


def greedy_steps(model, prompts: list[list[int]], steps: int, forced=None):
    """Prompts prefilled in one step, then decode steps on a ModelRunner: (tokens fed
    back per step, logits per step). The tokens are each step's argmax, or `forced`'s
    (another run's, to compare logits along the same path)."""
    runner = ModelRunner(model, block_size=16, num_blocks=32)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seqs = [Sequence(token_ids=list(p)) for p in prompts]
    for seq in seqs:
        blocks.allocate(seq)
    batch, fed, logits = Batch(seqs, [len(p) for p in prompts]), [], []
    for _ in range(steps):
        out = runner.run(batch).float().cpu()
        chosen = forced[len(fed)] if forced else [int(row.argmax()) for row in out]
        fed.append(chosen)
        logits.append(out)
        for seq, n, token in zip(seqs, batch.num_tokens, chosen, strict=True):
            seq.num_computed += n
            seq.token_ids.append(token)
            blocks.append_slot(seq)
        batch = Batch(seqs, [1] * len(seqs))
    return fed, logits
