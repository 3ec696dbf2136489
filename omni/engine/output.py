"""Output assembly: a step's logits and tokens become each request's streamed text.

A greedy step's picks travel to the host while the next step runs (`InFlight`); when
they land, each fills its sequence's placeholder. Tokens of sequences under a grammar
are checked by it first (in one batch), and a refused one fails its request instead of
being streamed. Streaming a token decodes its text, matches stop strings, and finishes
the sequence on EOS, a stop or max_tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .grammar import Constraint, Grammars
from .request import Active, StepOutput, logprob_of
from .sampling import sample
from .sequence import Sequence, Status

Landed = list[tuple[Active, int]]  # (sequence's state, its new token)


@dataclass
class InFlight:
    """A launched step whose greedy tokens are still on their way to the host."""

    seqs: list[Sequence]  # the sampling ones, in row order
    on_device: torch.Tensor  # [rows] int64: the next step's inputs
    on_host: torch.Tensor  # the same, copied without waiting
    ready: torch.cuda.Event | None  # recorded after the copy (None on the CPU)

    def tokens(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # a blocking-sync event: the thread sleeps
        return self.on_host.tolist()


def launch_greedy(logits: torch.Tensor, sampling: list[Sequence]) -> InFlight:
    """Every row's argmax, on its way to the host without waiting for the GPU."""
    on_device = logits.argmax(-1) if sampling else logits.new_empty(0, dtype=torch.int64)
    if on_device.device.type != "cuda":
        return InFlight(sampling, on_device, on_device, None)
    on_host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
    on_host.copy_(on_device, non_blocking=True)
    ready = torch.cuda.Event(blocking=True)
    ready.record()
    return InFlight(sampling, on_device, on_host, ready)


class Outputs:
    """The running sequences' states, the step in flight, and how tokens reach callers.
    `finish` ends a sequence (the engine frees its blocks) and emits its last output."""

    def __init__(
        self, grammars: Callable[[], Grammars], finish: Callable[[Active, StepOutput], None]
    ):
        self.active: dict[int, Active] = {}  # seq_id -> its state
        self.in_flight: InFlight | None = None
        self.grammars = grammars  # built at the first request that needs them
        self.finish = finish

    def constraint(self, seq: Sequence) -> Constraint | None:
        state = self.active.get(seq.seq_id)
        return state.constraint if state is not None else None

    def on_device(self, seq: Sequence) -> bool:
        """Whether the argmax is all this sequence's sampling needs (no host work)."""
        state = self.active.get(seq.seq_id)
        if state is None:
            return True  # finished meanwhile: its row is dropped
        return state.picks_on_device and not state.forks

    # ------------------------------------------------------------ landing tokens

    def take_in_flight(self) -> Landed:
        """The tokens of the step in flight (waiting for them), filled in for their
        placeholders."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return []
        landed = []
        for seq, token in zip(step.seqs, step.tokens(), strict=True):
            state = self.active.get(seq.seq_id)
            if state is None or seq.status is Status.FINISHED:
                continue
            seq.token_ids[-1] = token  # its placeholder: nothing was appended since
            landed.append((state, token))
        return landed

    def land_in_flight(self) -> None:
        """Fill in and stream the tokens of the step in flight, if any."""
        self.check_and_stream(self.take_in_flight())

    def check_and_stream(self, landed: Landed) -> None:
        """Advance the grammars by the new tokens, then stream those they accepted."""
        self.stream_checked(landed, self._refused(landed))

    def stream_checked(self, landed: Landed, refused: set[int]) -> None:
        """Stream the tokens their grammars accepted (`refused`: the sequences whose token
        was not); then fail the refused requests and finish those whose grammar is
        complete."""
        self.stream_tokens([(s, t) for s, t in landed if s.seq.seq_id not in refused])
        self.end_grammars(landed, refused)

    def stream_tokens(self, landed: Landed) -> None:
        """Stream each token of a sequence still running."""
        for state, token in landed:
            if state.seq.seq_id in self.active:
                self.stream_token(state, token)

    def stream_token(self, state: Active, token: int) -> None:
        """Stream the new token's text; finish on EOS, a stop string or max_tokens."""
        state.delivered += 1
        if token in state.eos:
            self.finish(state, state.output(state.stops.flush(), [token], "stop"))
            return
        text, hit_stop = state.stops.feed(state.decoder.push(token))
        if hit_stop:
            self.finish(state, state.output(text, [token], "stop"))
        elif state.delivered >= state.request.params.max_tokens:
            self.finish(state, state.output(text + state.stops.flush(), [token], "length"))
        else:
            state.emit(state.output(text, [token]))

    def sample(self, state: Active, logits: torch.Tensor, greedy: int) -> int:
        """The sequence's next token from its row of logits (`greedy`: the device's argmax,
        all a plain greedy pick needs)."""
        params = state.request.params
        # the device's argmax: of the plain logits, or of the grammar-masked ones (a row
        # that also wants logprobs is not masked on the device: they are the model's own)
        if state.picks_on_device or (
            params.greedy and not params.shaped and state.constraint is None
        ):
            token = greedy
        else:
            prompt, output = state.history()
            banned = state.held_back(len(output))
            allowed = logits  # logprobs below stay the model's own, unmasked
            if state.constraint is not None:
                allowed = state.constraint.mask(logits.float().clone())
            token = sample(allowed, params, state.generator, prompt, output, banned)
        if params.logprobs is not None:  # of the model's distribution, before sampling
            state.logprob = logprob_of(logits, token, params.logprobs)
        return token

    # ------------------------------------------------------------ grammars

    def advance_grammars(self, landed: Landed, sampling: list[Sequence]):
        """Start the grammar thread on the landed tokens and this step's masks: the rows
        whose grammar is applied on the device (their pick is the argmax), less those
        whose landed token ends their grammar."""
        grammars = self.grammars()
        accepting = [(state, token) for state, token in landed if state.constraint is not None]
        ending = {s.seq.seq_id for s, token in accepting if token in grammars.stop_ids}
        rows, filling = [], []
        for row, seq in enumerate(sampling):
            state = self.active.get(seq.seq_id)
            if state is None or state.constraint is None or state.constraint.done:
                continue
            if state.picks_on_device and seq.seq_id not in ending:
                rows.append(row)
                filling.append(state.constraint)
        return accepting, grammars.advance_and_fill(
            [s.constraint for s, _ in accepting],
            [t for _, t in accepting],
            len(sampling),
            rows,
            filling,
        )

    def mask_grammars(self, logits: torch.Tensor, masking) -> set[int]:
        """Wait for the grammar thread; mask its rows of `logits` on the device (one copy,
        xgrammar's kernel). Returns the sequences whose landed token was refused."""
        accepting, job = masking
        accepted, bitmask, rows = job.result()
        if bitmask is not None:
            self.grammars().apply_masks(logits, bitmask, rows)
        return {s.seq.seq_id for (s, _), ok in zip(accepting, accepted, strict=True) if not ok}

    def _refused(self, landed: Landed) -> set[int]:
        """Advance the grammars by their new tokens (in one batch); returns the sequences
        whose token its grammar refused."""
        pairs = [(state, token) for state, token in landed if state.constraint is not None]
        if not pairs:
            return set()
        accepted = self.grammars().accept([s.constraint for s, _ in pairs], [t for _, t in pairs])
        return {s.seq.seq_id for (s, _), ok in zip(pairs, accepted, strict=True) if not ok}

    def end_grammars(self, landed: Landed, refused: set[int]) -> None:
        """After streaming: fail the requests whose token their grammar refused; finish
        those whose grammar is complete (its end token is EOS, which finished them
        already, unless EOS is ignored)."""
        for state, token in landed:
            if state.constraint is None or state.seq.seq_id not in self.active:
                continue
            if state.seq.seq_id in refused:
                out = state.output("", [], "error")
                out.error = f"structured output: the grammar does not allow token {token} here"
                self.finish(state, out)
            elif state.constraint.done:
                self.finish(state, state.output(state.stops.flush(), [], "stop"))
