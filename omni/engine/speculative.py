"""Speculative decoding: guess a sequence's next k tokens cheaply, check them in one step.

A decode step reads every weight to produce one token per sequence; at small batches
that read is the whole cost, so the target model can score k + 1 positions of a
sequence (its newest token and k proposed ones) in about the time of one. The step is
a decode step of k + 1 rows per sequence (model_runner.run_rows): each row is computed
exactly as plain decoding computes that position (the kernels are batch-invariant), so
at temperature 0 the accepted tokens are bit for bit what plain decoding would have
produced, and above it rejection sampling keeps the target's distribution exactly.

Proposers (`speculative = {method = ..., k = ...}` in a model's config):
- "ngram": the tokens that followed the newest n-gram's latest earlier occurrence in the
  sequence itself (prompt and output); no weights. It pays where outputs repeat their
  input: summaries quoting a text, code edits, JSON that echoes given values.

Per sequence, k follows its acceptance (AdaptiveK), and the engine speculates only for
batches of at most `max_batch` decoding sequences: larger batches are compute-bound,
and k more rows per sequence would cost what they save.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec_config import SpecConfig

__all__ = ["AdaptiveK", "SpecConfig", "SpecStats", "accept_greedy", "accept_sampled"]


def ngram_proposal(tokens: list[int], k: int, n_max: int = 4, n_min: int = 1) -> list[int]:
    """Up to k tokens: what followed the latest earlier occurrence of the sequence's last
    n tokens, for the longest n from n_max down to n_min that occurs; [] if none does."""
    if k <= 0:
        return []
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


class AdaptiveK:
    """A sequence's k: one more after a step that accepted all it proposed, back to what
    was accepted plus one after a step that did not (at least 1, at most `k_max`). After
    steps in a row that accept nothing, it stops proposing for a while, longer after each
    (2, 4, ... up to MAX_PAUSE tokens): where the guesses keep missing, speculation costs
    next to nothing. Pauses are counted in the sequence's generated tokens, so a step that
    does not speculate (a large batch, a step launched ahead) still counts."""

    MAX_PAUSE = 64

    def __init__(self, k_max: int):
        self.k_max = k_max
        self._k = k_max
        self._misses = 0  # steps in a row that accepted nothing
        self._resume_at = 0  # generated tokens from which it proposes again

    def k_at(self, generated: int) -> int:
        """The tokens to propose at a step after `generated` tokens (0: paused)."""
        return self._k if generated >= self._resume_at else 0

    def update(self, proposed: int, accepted: int, generated: int) -> None:
        """After a step that started at `generated` tokens."""
        if proposed == 0:
            return
        if accepted == 0:
            self._misses += 1
            if self._misses > 1:
                self._resume_at = generated + 1 + min(self.MAX_PAUSE, 2**self._misses)
        else:
            self._misses = 0
        if accepted == proposed:
            self._k = min(self.k_max, self._k + 1)
        else:
            self._k = max(1, accepted + 1)


def accept_greedy(picks: list[int], proposed: list[int]) -> list[int]:
    """The tokens a greedy step emits: `picks[i]` is the target's pick at row i (after
    the newest token and proposed[:i]); proposals are accepted while they equal the
    target's picks, then the target's own pick follows (len = accepted + 1)."""
    out = []
    for pick, guess in zip(picks, proposed, strict=False):
        out.append(pick)
        if pick != guess:
            return out
    out.append(picks[len(proposed)])
    return out


def accept_sampled(
    probs: list[torch.Tensor],
    proposed: list[int],
    generator: torch.Generator,
    draft_probs: list[torch.Tensor] | None = None,
) -> list[int]:
    """Rejection sampling (Leviathan et al. / Chen et al.): proposal i is kept with
    probability min(1, p(x) / q(x)) under the target's distribution `probs[i]`; at the
    first rejection a token is drawn from (p - q)+, renormalized, and the step ends; if
    all are kept, one more is drawn from the last row. `draft_probs`: the proposer's q
    per proposal (None: a deterministic proposer, q = 1 at its token). Each emitted
    token is then distributed exactly as the target's own draw."""
    out = []
    for i, guess in enumerate(proposed):
        p = probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i][guess])
        if float(torch.rand((), generator=generator)) * q_x < float(p[guess]):
            out.append(guess)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[guess] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p is q (or all on guess): nothing else to draw
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(proposed)], 1, generator=generator)))
    return out


@dataclass
class SpecStats:
    """Counters since the engine started (engine.stats(), and omnid's /metrics)."""

    steps: int = 0  # speculative steps
    rows: int = 0  # sequences in them
    proposed: int = 0  # tokens proposed
    accepted: int = 0  # ... of which accepted
    emitted: int = 0  # tokens the steps produced (accepted + one per sequence)

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_steps": self.steps,
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_tokens_per_step": self.emitted / self.rows if self.rows else 0.0,
        }
