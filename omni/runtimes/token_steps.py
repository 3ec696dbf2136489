"""transformers' generate() with a yield point at each decoded token (handler.gpu_step).

A batch's generate() call is one long GPU phase: a step for every token it writes. With
this processor in its logits processors, a hotter model of the GPU goes first between
two of those steps, as OMNI's own engine lets it between its steps (gpuyield.py).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from omni.instance.handler import gpu_step


class YieldEachToken(LogitsProcessor):
    """Leaves the scores as they are; waits while a hotter model serves."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        gpu_step()
        return scores


def yielding() -> LogitsProcessorList:
    """generate()'s `logits_processor`: the model's own processors run beside it."""
    return LogitsProcessorList([YieldEachToken()])
