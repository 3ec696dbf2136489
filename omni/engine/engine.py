"""Text generation engine: one worker thread runs the model, asyncio callers stream results.

The skeleton runs requests one at a time with a contiguous KV cache; the
interface (submit a request, receive per-token outputs, cancel) is the one the
batching scheduler keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from .llama import LlamaForCausalLM
from .sampling import SamplingParams, make_generator, sample
from .stops import StopMatcher
from .tokenizer import TextTokenizer

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: int = field(default_factory=itertools.count().__next__)
    cancelled: threading.Event = field(default_factory=threading.Event)


Emit = Callable[[StepOutput], None]


class Engine:
    """Owns the model and its worker thread."""

    def __init__(self, model: LlamaForCausalLM, tokenizer: TextTokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.max_context = model.cfg.max_position
        self._queue: queue.Queue[tuple[GenerationRequest, Emit] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="omni-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, emit: Emit) -> None:
        self._queue.put((request, emit))

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        """Yield the request's outputs; leaving early (client gone) cancels it."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()

        def emit(out: StepOutput) -> None:
            with contextlib.suppress(RuntimeError):  # loop already closed: nobody listens
                loop.call_soon_threadsafe(outputs.put_nowait, out)

        self.submit(request, emit)
        try:
            while True:
                out = await outputs.get()
                yield out
                if out.finished:
                    return
        finally:
            request.cancelled.set()

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while (item := self._queue.get()) is not None:
            request, emit = item
            try:
                self._generate(request, emit)
            except Exception as exc:  # report, keep serving others
                log.exception("generation failed")
                emit(StepOutput("", [], True, "error", error=str(exc)))

    def _generate(self, req: GenerationRequest, emit: Emit) -> None:
        params, n_prompt = req.params, len(req.prompt_ids)
        if req.cancelled.is_set():
            emit(StepOutput("", [], True, "abort", n_prompt))
            return
        device = self.model.lm_head.weight.device
        cache = self.model.new_cache(n_prompt + min(params.max_tokens, 256))
        logits = self.model(torch.tensor(req.prompt_ids, device=device), cache)[-1]
        generator = make_generator(params.seed)
        decoder = self.tokenizer.stream_decoder()
        stops = StopMatcher(params.stop)
        eos = set() if params.ignore_eos else self.tokenizer.eos_ids
        for produced in range(1, params.max_tokens + 1):
            if req.cancelled.is_set():
                emit(StepOutput("", [], True, "abort", n_prompt, produced - 1))
                return
            token = sample(logits, params, generator)
            if token in eos:
                emit(StepOutput(stops.flush(), [token], True, "stop", n_prompt, produced))
                return
            text, hit_stop = stops.feed(decoder.push(token))
            if hit_stop:
                emit(StepOutput(text, [token], True, "stop", n_prompt, produced))
                return
            if produced == params.max_tokens:
                emit(StepOutput(text + stops.flush(), [token], True, "length", n_prompt, produced))
                return
            emit(StepOutput(text, [token], False, None, n_prompt, produced))
            logits = self.model(torch.tensor([token], device=device), cache)[-1]
