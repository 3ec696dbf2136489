"""Submitting requests straight to an Engine and collecting what it streams back."""

from __future__ import annotations

import queue

from omni.engine.engine import Engine, GenerationRequest, StepOutput
from omni.engine.sampling import SamplingParams


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
