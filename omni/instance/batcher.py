"""Dynamic batching of a handler's requests.

Concurrent requests queue; one loop takes up to `max_batch_size` of them, waiting at most
`max_queue_delay_s` after the first for more, and runs them as one `infer()` call in a
worker thread, so the event loop keeps answering health checks. A request whose client
left (its task cancelled) is dropped before it runs. Each request gets its own outcome:
its outputs, or the error that concerns it.

A request's outcome never depends on its batch-mates. A handler fails one request by
returning a HandlerError in its place (a 400 for it alone), and an output unlike its
declaration fails its request alone (a 500). When infer() fails as a whole for several
requests (it raised, a HandlerError or anything else, or returned a wrong number of
results), nothing says which request caused it, so each is run again alone, in a call
of its own under its own timeout, and gets that call's outcome: the bad request fails,
the others are answered. This costs a bad batch one call per request; a handler spares
that by returning its refusals in place rather than raising them.

One batch at a time does GPU work. A handler that marks its GPU work's end
(handler.gpu_done) lets the next batch start then, in a second thread, while its own
CPU work (encoding, resizing) finishes: the seeds' CPU-GPU split, inside the instance as
at omnid and the edge. Without the mark, batches run one after another.

A batch that runs past `infer_timeout_s` cannot be taken back from its thread: its
requests get 504, the batcher is marked hung (the instance's health then fails, and omnid
restarts it), and what comes after gets 503 at once instead of waiting behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .handler import HandlerError, set_gpu_done_callback

log = logging.getLogger("omni.batcher")

Tensors = dict[str, np.ndarray]
Infer = Callable[[list[Tensors]], list[Tensors | HandlerError]]
# one request's outputs as the handler returned them -> checked outputs (raises TensorError)
CheckOutputs = Callable[[object], Tensors]


class InferError(Exception):
    """A request that failed; `status` is the HTTP status its caller gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def refusal(error: HandlerError) -> str:
    """The message a refused request's caller gets."""
    return (str(error) or "the model refused the request")[:1000]


class _WrongResults(Exception):
    """infer() did not return one result per request (raised by the worker, never the
    handler: a handler's own exceptions are its failures)."""


@dataclass
class _Pending:
    inputs: Tensors
    future: asyncio.Future
    queued_at: float
    on_gpu_done: Callable[[], None] | None = None  # its batch's GPU work is over (handler.py)


class _GpuTurn:
    """A batch's turn on the GPU, given back once: at its GPU work's end or its own."""

    def __init__(self, lock: asyncio.Lock):
        self._lock = lock
        self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self._lock.release()


PHASE_WEIGHT = 0.2  # of the latest infer() call in the phases' moving averages


@dataclass
class Phases:
    """How long infer() calls take on the GPU and after it (moving averages, seconds):
    the model's predicted ETA, for omnid and the edge's queue estimates."""

    gpu_s: float | None = None
    cpu_s: float | None = None
    released_early: int = 0  # requests whose GPU phase ended before their answer

    def record(self, gpu_s: float, cpu_s: float) -> None:
        if self.gpu_s is None or self.cpu_s is None:
            self.gpu_s, self.cpu_s = gpu_s, cpu_s
            return
        self.gpu_s += PHASE_WEIGHT * (gpu_s - self.gpu_s)
        self.cpu_s += PHASE_WEIGHT * (cpu_s - self.cpu_s)

    def to_json(self) -> dict:
        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000, 3)

        return {
            "batch_gpu_phase_ms": ms(self.gpu_s),
            "batch_cpu_phase_ms": ms(self.cpu_s),
            "batch_gpu_released_early": self.released_early,
        }


class Batcher:
    def __init__(
        self,
        infer: Infer,
        check_outputs: CheckOutputs,
        max_batch_size: int = 1,
        max_queue_delay_s: float = 0.0,
        infer_timeout_s: float = 60.0,
        split: bool = True,
        gate: Callable[[], None] | None = None,
    ):
        self._infer = infer
        self.gate = gate  # waits while a hotter model of the GPU serves (gpuyield.py)
        self._check = check_outputs
        self.max_batch_size = max(1, max_batch_size)
        self.max_queue_delay_s = max(0.0, max_queue_delay_s)
        self.infer_timeout_s = infer_timeout_s
        self.split = split  # False: a batch keeps the GPU turn, its requests their permits
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        # two threads: one batch's GPU work, the last one's CPU work after its gpu_done()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="omni-infer")
        self._gpu = asyncio.Lock()  # one batch in its GPU phase at a time
        self._batches: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self.hung: str | None = None  # why the instance must be restarted, once it must
        self.sizes: Counter[int] = Counter()  # requests per infer() call -> calls made
        self.failed = 0  # requests that got an error from the handler or its outputs
        self.rerun = 0  # requests run again alone, their batch's call having failed
        self.cancelled = 0  # requests dropped, their clients gone, before they ran
        self.phases = Phases()

    async def submit(
        self, inputs: Tensors, on_gpu_done: Callable[[], None] | None = None
    ) -> Tensors:
        """One request's outputs; raises InferError. Cancelling the caller drops it.
        `on_gpu_done` runs (on the loop) when the handler says its batch's GPU work is
        over, if it says so before the answer."""
        if self.hung:
            raise InferError(503, f"the model is being restarted: {self.hung}")
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="omni-batcher")
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(inputs, future, time.monotonic(), on_gpu_done))
        return await future  # a cancelled caller cancels the future: the loop skips it

    async def close(self) -> None:
        for task in [self._loop_task, *self._batches]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        """For the instance's /health (omnid shows them in /metrics and /v1/instances).
        Every infer() call counts, a failed one and a rerun alone too; a request that
        was run again is counted in each call that held it, and once in batch_failed
        if its own call failed."""
        return {
            "batch_runs": sum(self.sizes.values()),
            "batch_requests": sum(n * count for n, count in self.sizes.items()),
            "batch_sizes": {str(n): count for n, count in sorted(self.sizes.items())},
            "batch_failed": self.failed,
            "batch_cancelled": self.cancelled,
            "batch_rerun": self.rerun,
            "batch_queued": self._queue.qsize(),
            **self.phases.to_json(),
        }

    async def _run(self) -> None:
        while True:
            await self._gpu.acquire()  # the batch forms once the GPU is free: it grows
            turn = _GpuTurn(self._gpu)
            try:
                batch = await self._next_batch()
            except BaseException:
                turn.give_back()
                raise
            if not batch:
                turn.give_back()
                continue
            task = asyncio.create_task(self._run_batch(batch, turn))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)
            task.add_done_callback(lambda _task, turn=turn: turn.give_back())

    async def _next_batch(self) -> list[_Pending]:
        """The next requests to run: up to max_batch_size, those still wanted."""
        batch = [await self._queue.get()]
        deadline = batch[0].queued_at + self.max_queue_delay_s
        while len(batch) < self.max_batch_size:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            wait_s = deadline - time.monotonic()
            if wait_s <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), wait_s))
            except TimeoutError:
                break
        wanted = [p for p in batch if not p.future.done()]
        self.cancelled += len(batch) - len(wanted)
        return wanted

    async def _run_batch(self, batch: list[_Pending], turn: _GpuTurn | None = None) -> None:
        """One infer() call for `batch`; if it fails as a whole, each request alone.
        `turn` (the GPU's) is given back at the call's GPU work's end, if it marks it."""
        if self.hung:  # (a call of the requests run again alone hung)
            self._fail(batch, InferError(503, f"the model is being restarted: {self.hung}"))
            return
        try:
            results = await self._call(batch, turn)
        except InferError as error:
            if len(batch) == 1 or self.hung:
                self._fail(batch, error)
                return
            log.warning("infer() failed for %d requests (%s): each runs alone", len(batch), error)
            self.rerun += len(batch)
            for pending in batch:
                if not pending.future.done():
                    await self._run_batch([pending])
            return
        for pending, result in zip(batch, results, strict=True):
            if pending.future.done():
                continue
            if isinstance(result, InferError):
                self.failed += 1
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)

    async def _call(
        self, batch: list[_Pending], turn: _GpuTurn | None = None
    ) -> list[Tensors | InferError]:
        """`batch`'s infer() call in the worker thread, under the timeout: each request's
        checked outputs or error; raises InferError where the call fails as a whole."""
        self.sizes[len(batch)] += 1
        loop = asyncio.get_running_loop()
        inputs = [p.inputs for p in batch]

        def gpu_done() -> None:  # in the worker thread, from handler.gpu_done()
            if self.split:
                loop.call_soon_threadsafe(self._release_early, batch, turn)

        running = loop.run_in_executor(self._pool, self._infer_checked, inputs, gpu_done)
        try:
            return await asyncio.wait_for(asyncio.shield(running), self.infer_timeout_s)
        except TimeoutError:
            self.hung = f"infer() ran past its {self.infer_timeout_s:g} s timeout"
            log.error("handler hung: %s; the instance must be restarted", self.hung)
            self._fail_queued()
            raise InferError(504, f"the model did not answer: {self.hung}") from None
        except _WrongResults as exc:
            raise InferError(500, str(exc)) from None
        except HandlerError as exc:
            raise InferError(400, refusal(exc)) from None
        except Exception as exc:
            log.exception("handler's infer() raised")
            message = f"the model's infer() failed: {type(exc).__name__}: {exc}"
            raise InferError(500, message[:1000]) from None

    def _release_early(self, batch: list[_Pending], turn: _GpuTurn | None) -> None:
        if turn is not None:
            turn.give_back()
        for pending in batch:
            if pending.on_gpu_done is not None and not pending.future.done():
                self.phases.released_early += 1
                pending.on_gpu_done()

    def _infer_checked(
        self, inputs: list[Tensors], gpu_done: Callable[[], None]
    ) -> list[Tensors | InferError]:
        """In the worker thread, under the batch's timeout (checking a hostile result may
        take as long as it likes too): each request's checked outputs, or its error."""
        if self.gate is not None:
            self.gate()  # the batch's first GPU step, like an engine's each
        started, gpu_ended = time.monotonic(), None

        def mark() -> None:
            nonlocal gpu_ended
            gpu_ended = time.monotonic()
            gpu_done()

        set_gpu_done_callback(mark, self.gate)
        try:
            results = self._infer(inputs)
        finally:
            set_gpu_done_callback(None)
        ended = time.monotonic()
        split = gpu_ended if gpu_ended is not None else ended  # no mark: all GPU time
        self.phases.record(split - started, ended - split)
        if not isinstance(results, list) or len(results) != len(inputs):
            count = len(results) if isinstance(results, list) else type(results).__name__
            message = f"the model returned {count} results for {len(inputs)} requests"
            log.error("handler's infer(): %s", message)
            raise _WrongResults(message)
        return [self._check_one(result) for result in results]

    def _check_one(self, result: object) -> Tensors | InferError:
        """One request's checked outputs, or its error: its refusal (a HandlerError in its
        place) or its invalid output."""
        try:
            if isinstance(result, HandlerError):
                return InferError(400, refusal(result))
            return self._check(result)
        except Exception as exc:  # TensorError, or anything a hostile result raises
            log.error("handler's infer() returned an invalid output: %s", exc)
            return InferError(500, f"the model returned an invalid output: {exc}"[:1000])

    def _fail(self, batch: list[_Pending], error: InferError) -> None:
        for pending in batch:
            if not pending.future.done():
                self.failed += 1
                pending.future.set_exception(error)

    def _fail_queued(self) -> None:
        """After a hang: those waiting would wait behind it, so they fail now."""
        queued = []
        while not self._queue.empty():
            queued.append(self._queue.get_nowait())
        self._fail(queued, InferError(503, f"the model is being restarted: {self.hung}"))
