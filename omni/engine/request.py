"""A request as the engine takes it, what it streams back, and the state of one of its
sequences while it runs: the data the engine loop, output assembly and the speculative
step share (a leaf module: it imports none of them)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .grammar import Constraint
from .sampling import SamplingParams
from .sequence import Sequence
from .stops import StopMatcher
from .tokenizer import StreamDecoder

# (token, its logprob, [(alternative id, logprob), ...])
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # per token, when the request asked
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    index: int = 0  # which of the request's n sequences
    # the K/V of the prompt's first blocks, [layers, blocks, block, heads, dim] each, on the
    # host: what a request with `export_blocks` hands to a decode instance (last output)
    kv: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    principal: str = ""  # prefix-cache scope: tenant and session
    request_id: int = field(default_factory=itertools.count().__next__)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # disaggregated serving (kv_transfer.py): a prefill instance exports the K/V of the
    # prompt's first `export_blocks` blocks when the request ends; a decode instance starts
    # from `kv_import`, those blocks' K/V, and reports the prefill side's cache hits
    export_blocks: int = 0
    kv_import: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    prior_cached_tokens: int | None = None


Emit = Callable[[StepOutput], None]


@dataclass
class Active:
    """One running sequence of a request: how its tokens become text, where they go."""

    request: GenerationRequest
    emit: Emit
    seq: Sequence
    decoder: StreamDecoder
    stops: StopMatcher
    generator: torch.Generator
    eos: set[int]
    constraint: Constraint | None = None  # its grammar, for structured output
    index: int = 0  # of the request's n sequences
    forks: int = 0  # sequences still to start from this one's prompt (n - 1, then 0)
    delivered: int = 0  # tokens streamed (the sequence may hold one more, on the GPU)
    logprob: TokenLogprob | None = None  # of the newest token

    @property
    def picks_on_device(self) -> bool:
        """Whether the (grammar-masked) argmax on the device is this sequence's token."""
        params = self.request.params
        return params.greedy and not params.shaped and params.logprobs is None

    def history(self) -> tuple[list[int], list[int]]:
        """(prompt, output so far): what sampling's penalties look at."""
        seq = self.seq
        return seq.token_ids[: seq.num_prompt_tokens], seq.token_ids[seq.num_prompt_tokens :]

    def held_back(self, generated: int) -> set[int]:
        """The tokens that may not come next after `generated` output tokens: min_tokens
        holds back the end; under a grammar, the grammar decides it."""
        early = generated < self.request.params.min_tokens and self.constraint is None
        return self.eos if early else set()

    def output(self, text: str, tokens: list[int], reason: str | None = None) -> StepOutput:
        seq = self.seq
        wanted = self.request.params.logprobs is not None and tokens and self.logprob
        return StepOutput(
            text,
            tokens,
            reason is not None,
            reason,
            seq.num_prompt_tokens,
            self.delivered,
            seq.num_cached_tokens
            if self.request.prior_cached_tokens is None
            else self.request.prior_cached_tokens,
            [self.logprob] if wanted else None,
            index=self.index,
        )


def logprob_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """(token, its logprob, the `top` most likely with theirs) of one row of the model's
    logits, before any shaping or mask."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    alternatives = (
        list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
        if best is not None
        else []
    )
    return token, float(logprobs[token]), alternatives
