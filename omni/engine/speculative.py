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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .output import Outputs
from .request import Active, logprob_of
from .sampling import probabilities, shape
from .sequence import PLACEHOLDER
from .spec_config import SpecConfig

if TYPE_CHECKING:
    from .model_runner import ModelRunner
    from .proposers import Proposer
    from .scheduler import Batch, Scheduler

__all__ = [
    "AdaptiveK",
    "SpecConfig",
    "SpecStats",
    "SpeculativeStep",
    "accept_greedy",
    "accept_sampled",
]


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


class SpeculativeStep:
    """The engine's verify steps: which batches may speculate, their proposals, and
    what of them each sequence keeps and streams (through the engine's `outputs`)."""

    def __init__(
        self,
        config: SpecConfig,
        proposer: Proposer,
        scheduler: Scheduler,
        runner: ModelRunner,
        outputs: Outputs,
        max_context: int,
    ):
        self.config = config
        self.proposer = proposer
        self.stats = SpecStats()
        self._scheduler, self._runner, self._outputs = scheduler, runner, outputs
        self._max_context = max_context
        self._k: dict[int, AdaptiveK] = {}  # seq_id -> its k

    def forget(self, seq_id: int) -> None:
        """The sequence has finished."""
        self._k.pop(seq_id, None)
        self.proposer.release(seq_id)

    def speculates(self, batch: Batch) -> bool:
        """Whether `batch` may be a speculative step: decodes only, few enough of them,
        every newest token on the host (then the step after a step of such a batch
        waits for its tokens, rather than be launched ahead with them on the device)."""
        if len(batch.seqs) > self.config.max_batch:
            return False
        for seq in batch.seqs:
            state = self._outputs.active.get(seq.seq_id)
            if seq.is_prefilling or state is None:
                return False
            if state.forks or seq.token_ids[-1] == PLACEHOLDER:
                return False
        return True

    def may_propose(self, batch: Batch) -> bool:
        """Whether the step after `batch` (its sequences one token on) may propose: then
        it waits for this step's tokens rather than be launched ahead of them."""
        if not self.speculates(batch):
            return False
        k = self.config.k
        return any(
            self._k[s.seq_id].k_at(s.num_generated + 1) if s.seq_id in self._k else k
            for s in batch.seqs
        )

    def run(self, batch: Batch, before_launch: Callable[[], None]) -> bool:
        """Run `batch` as a verify step: each sequence's newest token and its proposals,
        one row each; keep what the target model agrees with, stream it. False: nothing
        was proposed (the caller runs a plain step). `before_launch`: what the engine
        does before any step of the model."""
        proposals = self._proposals(batch)
        if not any(proposals):
            return False
        pairs = list(zip(batch.seqs, proposals, strict=True))
        rows = [[seq.token_ids[-1], *guess] for seq, guess in pairs]
        before_launch()
        logits = self._runner.run_rows(batch.seqs, rows)
        self.proposer.observe(batch.seqs, [len(r) for r in rows])
        self._mask_greedy_rows(logits, pairs)
        picks = logits.argmax(-1).tolist()  # (rows needing no more: only these travel)
        stats, first, outputs = self.stats, 0, self._outputs
        stats.steps += 1
        for seq, guess in pairs:
            state = outputs.active.get(seq.seq_id)
            span, first = slice(first, first + len(guess) + 1), first + len(guess) + 1
            if state is None:
                continue
            generated = seq.num_generated
            mine = None if state.picks_on_device else logits[span].float().cpu()
            tokens = self._verify(state, mine, picks[span], guess)
            accepted = len(tokens) - 1
            self._k[seq.seq_id].update(len(guess), accepted, generated)
            stats.rows += 1
            stats.proposed += len(guess)
            stats.accepted += accepted
            stats.emitted += len(tokens)
            self._scheduler.advance(seq, tokens)
            for i, token in enumerate(tokens):
                if state.request.params.logprobs is not None:
                    state.logprob = logprob_of(mine[i], token, state.request.params.logprobs)
                if state.constraint is not None:
                    state.constraint.accept(token)  # (its row was masked: it is allowed)
                outputs.stream_token(state, token)
                if seq.seq_id not in outputs.active:
                    break  # finished (EOS, a stop, max_tokens): the rest is dropped
                if state.constraint is not None and state.constraint.done:
                    outputs.finish(state, state.output(state.stops.flush(), [], "stop"))
                    break
        return True

    def _proposals(self, batch: Batch) -> list[list[int]]:
        """Each sequence's proposed tokens, within its max_tokens, the context, and the
        free blocks (reserved here, before a draft writes its K/V there)."""
        ks = []
        for seq in batch.seqs:
            k = self._k.setdefault(seq.seq_id, AdaptiveK(self.config.k)).k_at(seq.num_generated)
            room = min(seq.max_tokens - seq.num_generated, self._max_context - len(seq.token_ids))
            k = max(0, min(k, room - 1))
            if k and not self._scheduler.blocks.reserve(seq, len(seq.token_ids) + k):
                k = 0
            ks.append(k)
        out = self.proposer.propose(batch.seqs, ks)
        for i, seq in enumerate(batch.seqs):
            constraint = self._outputs.constraint(seq)
            if out[i] and constraint is not None:  # only what its grammar allows can be kept
                out[i] = out[i][: constraint.valid_prefix(out[i])]
        return out

    def _mask_greedy_rows(self, logits: torch.Tensor, pairs) -> None:
        """Mask, on the device, the verify rows of the greedy sequences under a grammar
        (each for its place after the proposals before it), as plain decoding masks its
        rows: their argmax is then their pick."""
        bitmask, rows, first = None, [], 0
        for seq, guess in pairs:
            state = self._outputs.active.get(seq.seq_id)
            if state is not None and state.constraint is not None and state.picks_on_device:
                if bitmask is None:
                    bitmask = self._outputs.grammars()._bitmask_rows(len(logits))
                state.constraint.fill_along(bitmask, first, guess)
                rows.extend(range(first, first + len(guess) + 1))
            first += len(guess) + 1
        if rows:
            self._outputs.grammars().apply_masks(logits, bitmask, rows)

    @staticmethod
    def _verify(
        state: Active, logits: torch.Tensor | None, picks: list[int], guess: list[int]
    ) -> list[int]:
        """The tokens one sequence's verify rows emit: the target's picks (greedy) or
        rejection sampling, each row shaped as plain decoding would shape it there.
        `picks`: each row's argmax (all a plain greedy request needs, `logits` None)."""
        if logits is None:
            return accept_greedy(picks, guess)
        params = state.request.params
        prompt, output = state.history()
        if state.constraint is not None:  # each row masked where the grammar is there
            logits = state.constraint.mask_along(logits.clone(), guess)
        rows = []
        for i in range(len(guess) + 1):
            so_far = output + guess[:i]
            rows.append(shape(logits[i], params, prompt, so_far, state.held_back(len(so_far))))
        if params.greedy:
            return accept_greedy([int(r.argmax()) for r in rows], guess)
        return accept_sampled([probabilities(r, params) for r in rows], guess, state.generator)
