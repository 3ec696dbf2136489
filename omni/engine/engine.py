"""Text generation engine: one worker thread runs continuous batching; asyncio callers stream.

Requests join and leave between steps. Each step runs one mixed batch (decodes
and prefill chunks) through the model over the paged KV cache, samples one
token for every sequence that reached its end, and streams text deltas.

Greedy steps overlap with the host: step N+1 is launched before step N's tokens
are read back (its inputs come from N's tokens on the device), so scheduling,
preparing and streaming happen while the GPU computes. The host waits on a
blocking event, asleep rather than spinning.

Here are the loop and the public API; how tokens become streamed text is output.py's,
the speculative verify step speculative.py's, a request's data request.py's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

import torch

from omni.cudashim.kv_pool import KVPool

from . import kv_transfer
from .block_manager import BlockManager
from .grammar import Grammars, GrammarSpec
from .kernels import builds
from .kv_tiers import DiskTier, HostTier
from .llama import LlamaForCausalLM
from .model_runner import ModelRunner
from .output import Outputs, launch_greedy
from .proposers import Proposer, draft_bytes_per_block, make_proposer
from .request import Active, Emit, GenerationRequest, StepOutput
from .sampling import SamplingParams, make_generator
from .scheduler import Batch, Scheduler
from .sequence import PLACEHOLDER, Sequence
from .speculative import SpecConfig, SpeculativeStep
from .step import Prepared, Previous
from .stops import StopMatcher
from .tokenizer import TextTokenizer
from .tp_runner import LeaderRunner

__all__ = ["Emit", "Engine", "GenerationRequest", "StepOutput"]

log = logging.getLogger(__name__)


class Engine:
    """Owns the model, its KV cache and the worker thread."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: TextTokenizer,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_tokens: int | None = None,
        max_seqs: int | None = None,
        before_step: Callable[[], None] | None = None,
        speculative: SpecConfig | None = None,
        draft=None,
        host_cache_bytes: int = 0,
        disk_cache_bytes: int = 0,
        disk_cache_dir: str | None = None,
    ):
        """`draft`: the weights `speculative` drafts with (proposers.load_draft's).
        `host_cache_bytes`: a host-memory tier for evicted prefix blocks (kv_tiers.py).
        `disk_cache_bytes`: a disk tier under it for the blocks it drops, in
        `disk_cache_dir` (this engine's alone: the *.kv files there are deleted)."""
        self.model = model
        self.before_step = before_step  # e.g. yield the GPU to a hotter instance
        self.tokenizer = tokenizer
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.max_context = model.cfg.max_position
        # split over ranks (tensor_parallel.py), this is rank 0: its runner leads the others
        runner = LeaderRunner if model.cfg.tp > 1 else ModelRunner
        # a draft's cache takes as many blocks as the target's, from the same memory
        draft_bytes = draft_bytes_per_block(speculative, draft, block_size)
        # on one GPU under the shim, the KV cache comes from its pool (kv_pool.py)
        pool = KVPool.open(model.lm_head.weight.device) if model.cfg.tp == 1 else None
        self.runner = runner(
            model, block_size, num_blocks, companion_bytes_per_block=draft_bytes, kv_pool=pool
        )
        self._in_pool = False  # between the pool's enter and leave (_enter_pool)
        self._pool_epoch = self.runner.kv_pool.epoch() if self.runner.kv_pool else 0
        on_gpu = self.runner.device.type == "cuda"
        if on_gpu:
            builds.install()  # count (and, once warm, log) the steps that wait for Triton
        if host_cache_bytes > 0 and model.cfg.tp > 1:
            raise ValueError("a host KV tier is for a model on one GPU so far")
        if disk_cache_bytes > 0 and host_cache_bytes <= 0:
            raise ValueError("a disk KV tier sits under the host tier: set host_cache_bytes too")
        if disk_cache_bytes > 0 and not disk_cache_dir:
            raise ValueError("a disk KV tier needs its directory (disk_cache_dir)")
        disk = DiskTier(disk_cache_dir, disk_cache_bytes) if disk_cache_bytes > 0 else None
        self.tier = HostTier(host_cache_bytes, disk) if host_cache_bytes > 0 else None
        grow = self.runner.back_blocks if self.runner.kv_pool else None
        blocks = BlockManager(self.runner.num_blocks, block_size, self.tier, grow)
        blocks.read_block = self.runner.read_block
        if self.tier is not None:
            self.tier.recycle = self.runner.recycle
        self.scheduler = Scheduler(
            blocks,
            max_batch_tokens or (8192 if on_gpu else 512),
            max_seqs=max_seqs or (512 if on_gpu else 256),
        )
        self.outputs = Outputs(lambda: self.grammars, self._finish)
        self.proposer: Proposer | None = None
        self.speculation: SpeculativeStep | None = None  # speculative.py; None: off
        if speculative is not None:
            self.proposer = make_proposer(
                speculative,
                draft,
                self.runner,
                self.scheduler.blocks,
                self.scheduler.max_batch_tokens,
            )
            self.speculation = SpeculativeStep(
                speculative,
                self.proposer,
                self.scheduler,
                self.runner,
                self.outputs,
                self.max_context,
            )
        # a step launched by the last one, right after its pick (grammar steps)
        self._launched: tuple[Batch, torch.Tensor] | None = None
        # requests, batches of idle-time work (lists), or None: shut down
        self._inbox: queue.Queue[tuple[GenerationRequest, Emit] | list | None] = queue.Queue()
        self._idle_work: collections.deque[Callable[[], None]] = collections.deque()
        self._thread = threading.Thread(target=self._run, name="omni-engine", daemon=True)
        self._thread.start()

    def warm_up(self, graphs: bool = False, when_idle: bool = False) -> None:
        """Compile (or load from Triton's disk cache) the kernels any step needs, and
        capture the graphs of steps that are not decode-only, before the first
        request; with `graphs`, capture every decode graph too (otherwise each is
        captured the first time its batch size comes up, keeping start-up short).

        `when_idle`: return at once and let the engine thread do it in pieces while no
        request is running, so a server can take requests straight after loading (the
        first one waits for one piece at most, a fraction of a second)."""
        sched = self.scheduler
        drafting = []  # a draft's own steps, after the model's
        if self.proposer is not None:
            drafting = self.proposer.warm_up_tasks(sched.max_batch_tokens, graphs)
        if self.tier is not None:  # and the host tier's pinned buffers
            drafting += self.runner.pinned_slab_tasks(self.tier.budget_bytes)
        if when_idle:
            self.when_idle(
                self.runner.warm_up_tasks(sched.max_seqs, sched.max_batch_tokens, graphs) + drafting
            )
        else:
            tasks = self.runner.warm_up_tasks(sched.max_seqs, sched.max_batch_tokens, graphs)
            for task in tasks + drafting:
                try:
                    task()
                except torch.OutOfMemoryError:  # a step this quota cannot hold: not warmed
                    log.warning("warm-up step skipped: out of GPU memory", exc_info=True)
                    torch.cuda.empty_cache()
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)
            builds.mark_warm()

    def when_idle(self, tasks: list[Callable[[], None]]) -> None:
        """Run `tasks` on the engine thread, one at a time, whenever it has no request."""
        if tasks:
            self._inbox.put(list(tasks))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.runner.block_size

    def memory_bytes(self) -> int:
        """What the model holds: weights and the KV-cache pool (a draft's too)."""
        return self.runner.memory_bytes() + (self.proposer.memory_bytes() if self.proposer else 0)

    def stats(self) -> dict:
        """A snapshot for health checks and tests (read without the worker's lock)."""
        sched = self.scheduler
        return {
            "kv_blocks_total": self.runner.num_blocks,
            "kv_blocks_free": sched.blocks.num_free,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            # prompt tokens admitted and not yet computed: what a router weighs prefill by
            "queued_prompt_tokens": sum(
                s.num_uncomputed
                for s in [*sched.waiting.sequences(), *list(sched.running)]
                if s.is_prefilling
            ),
            "idle_work": len(self._idle_work),
            "kernel_builds": builds.BUILDS.count,  # Triton builds so far, warm-up included
            **(self.speculation.stats.as_dict() if self.speculation else {}),
            **(self.tier.stats_dict() if self.tier else {}),
        }

    @property
    def grammars(self) -> Grammars:
        """Structured output's grammars, built at the first request that needs them."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.model.cfg.vocab_size)
            return self._grammars

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` now (cached for the request's own use); GrammarError if it
        cannot be. Called before submitting, off the engine's thread."""
        self.grammars.compile(spec)

    def submit(self, request: GenerationRequest, emit: Emit) -> None:
        self._inbox.put((request, emit))

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=5)
        if self.tier is not None:
            self.tier.close()  # the disk tier's files

    async def prefill_handoff(
        self, prompt: list[int], principal: str
    ) -> kv_transfer.Handoff | None:
        """Disaggregated serving's first half (kv_transfer.py): compute the prompt's full
        blocks short of the one with its last token, and their K/V for a decode instance
        (None: too short to be worth moving; the decode instance computes it)."""
        size = self.runner.block_size
        blocks = (len(prompt) - 1) // size
        if blocks == 0:
            return None
        cut = prompt[: blocks * size]
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        request = GenerationRequest(cut, first, principal, export_blocks=blocks)
        last = None
        async for out in self.stream(request):
            last = out
        if last is None or last.kv is None:
            raise RuntimeError(f"prefill failed: {last.error if last else 'no output'}")
        return kv_transfer.Handoff(principal, cut, last.cached_tokens, *last.kv)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        """Yield the request's outputs (of all its n sequences) until each has finished,
        or one failed; leaving early (client gone) cancels it."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()

        def emit(out: StepOutput) -> None:
            with contextlib.suppress(RuntimeError):  # loop already closed: nobody listens
                loop.call_soon_threadsafe(outputs.put_nowait, out)

        self.submit(request, emit)
        running = request.params.n
        try:
            while True:
                out = await outputs.get()
                yield out
                running -= out.finished
                if running == 0 or out.finish_reason == "error":
                    return
        finally:
            request.cancelled.set()

    # ------------------------------------------------------------ worker thread

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            try:
                if not self._admit_new():
                    self.runner.close()
                    return
                self._drop_cancelled()
                self._step()
            except Exception as exc:  # fail the requests in flight, keep serving
                log.exception("engine step failed")
                self.outputs.in_flight = self._launched = None
                for state in list(self.outputs.active.values()):
                    self._finish(state, StepOutput("", [], True, "error", error=str(exc)))

    def _admit_new(self) -> bool:
        """Take new requests; when idle, do a piece of idle-time work or wait for a
        request. False: shut down."""
        while True:
            idle = not self.scheduler.has_work()
            wait = idle and not self._idle_work
            if wait:
                self._leave_pool()
            try:
                item = self._inbox.get(block=wait)
            except queue.Empty:
                if idle:  # and work to do meanwhile
                    self._do_idle_work()
                    continue
                return True
            if item is None:
                return False
            if isinstance(item, list):
                self._idle_work.extend(item)
            else:
                self._admit(*item)

    def _enter_pool(self) -> None:
        """Before GPU work: wait while a swap-out has the KV pool away, and forget the
        prefixes cached in it if one took its contents since the last time."""
        pool = self.runner.kv_pool
        if pool is None or self._in_pool:
            return
        pool.enter()
        self._in_pool = True
        epoch = pool.epoch()
        if epoch != self._pool_epoch:
            self._pool_epoch = epoch
            self.scheduler.blocks.forget_contents()

    def _leave_pool(self) -> None:
        """Idle: a swap-out may take the KV pool (once the steps queued so far are done)."""
        if self._in_pool:
            self.runner.kv_pool.leave()
            self._in_pool = False

    def _do_idle_work(self) -> None:
        self._enter_pool()
        task = self._idle_work.popleft()
        try:
            task()
        except Exception:  # a warm-up piece: the step that needs it compiles it instead
            log.exception("idle-time work failed")
        if not self._idle_work:
            builds.mark_warm()

    def _admit(self, request: GenerationRequest, emit: Emit) -> None:
        params = request.params
        seq = Sequence(
            token_ids=list(request.prompt_ids),
            principal=request.principal,
            max_tokens=params.max_tokens,
            imported=request.kv_import,
        )
        request.kv_import = []  # (the sequence lets go of them once they are in its blocks)
        if not self.scheduler.fits(seq):
            emit(
                StepOutput(
                    "",
                    [],
                    True,
                    "error",
                    len(seq.token_ids),
                    error=(
                        f"prompt ({len(seq.token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                        f"exceed this instance's KV cache ({self.kv_capacity_tokens} tokens)"
                    ),
                )
            )
            return
        try:
            state = self._start(request, emit, seq, 0)
        except Exception as exc:  # its grammar's set-up, say: that request fails, not hangs
            log.exception("request %d could not start", request.request_id)
            emit(StepOutput("", [], True, "error", len(seq.token_ids), error=str(exc)))
            return
        state.forks = params.n - 1  # forked once the prompt is computed, sharing its KV
        self.scheduler.add(seq)

    def _start(self, request: GenerationRequest, emit: Emit, seq: Sequence, index: int) -> Active:
        """The engine's state for one of the request's sequences; the i-th of n draws from
        seed + i (the first is what n=1 with that seed gives)."""
        params = request.params
        seed = None if params.seed is None else params.seed + index
        state = Active(
            request,
            emit,
            seq,
            self.tokenizer.stream_decoder(),
            StopMatcher(params.stop),
            make_generator(seed),
            (set() if params.ignore_eos else set(self.tokenizer.eos_ids))
            | set(params.stop_token_ids),
            self.grammars.constraint(params.grammar) if params.grammar else None,
            index,
        )
        self.outputs.active[seq.seq_id] = state
        return state

    def _drop_cancelled(self) -> None:
        for state in list(self.outputs.active.values()):
            if state.request.cancelled.is_set():
                self._finish(state, state.output("", [], "abort"))

    def _finish(self, state: Active, out: StepOutput) -> None:
        """End the sequence: its blocks freed at once, its last output emitted."""
        n = state.request.export_blocks
        if n and out.finish_reason in ("stop", "length"):  # (its prompt is computed)
            out.kv = self.runner.export_blocks(state.seq.block_table[:n])
        self.scheduler.finish(state.seq)
        self.outputs.active.pop(state.seq.seq_id, None)
        if self.speculation is not None:
            self.speculation.forget(state.seq.seq_id)
        state.emit(out)

    def _step(self) -> None:
        self._enter_pool()  # (before the scheduler looks for cached prefixes)
        outputs = self.outputs
        if self._launched is not None:  # launched by the last step, right after its pick
            batch, logits = self._launched
            self._launched = None
        else:
            batch = self.scheduler.schedule()
            if batch is None:
                outputs.land_in_flight()
                return
            if self._speculates(batch) and self.speculation.run(batch, self._before_launch):
                return
            logits = self._launch(batch)
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        if any(outputs.constraint(s) for s in sampling):
            # A grammar's mask needs the last step's token accepted first. While the GPU
            # runs this step's model, the grammar thread accepts the tokens that landed
            # and fills the masks; meanwhile this one schedules the next step and streams
            # the tokens (the device's mask lets no refused token through: one would end
            # its request, after it was streamed). Then mask and pick, and launch the
            # next step at once (its inputs are this step's picks, on the device).
            landed = outputs.take_in_flight()
            masking = outputs.advance_grammars(landed, sampling)
            pipelined = all(outputs.on_device(s) for s in sampling) and not self._may_propose(batch)
            if pipelined:  # the next step, ready before this one's pick
                self.scheduler.update(batch, {s.seq_id: PLACEHOLDER for s in sampling})
                after = self.scheduler.schedule()
                rows = {s.seq_id: i for i, s in enumerate(sampling)}
                inputs = self.runner.prepare_inputs(after, rows) if after is not None else None
                outputs.stream_tokens(landed)
            refused = outputs.mask_grammars(logits, masking)
            step = launch_greedy(logits, sampling)
            if pipelined:
                outputs.in_flight = step
                if after is not None:
                    self._launched = after, self._launch(after, inputs)
                outputs.end_grammars(landed, refused)
                return
            outputs.stream_checked(landed, refused)
        else:
            step = launch_greedy(logits, sampling)
            outputs.land_in_flight()  # the last step's tokens, while the GPU runs this one
            # (not while the next step may speculate: its proposals need these tokens)
            if all(outputs.on_device(s) for s in sampling) and not self._may_propose(batch):
                self.scheduler.update(batch, {s.seq_id: PLACEHOLDER for s in sampling})
                outputs.in_flight = step
                return
        tokens = step.tokens()
        new_tokens, forking = {}, []
        for row, seq in enumerate(sampling):
            state = outputs.active.get(seq.seq_id)
            if state is None:
                continue  # finished by the last step's tokens
            new_tokens[seq.seq_id] = outputs.sample(state, logits[row], tokens[row])
            if state.forks:
                forking.append((state, row))
        self.scheduler.update(batch, new_tokens)
        children = [
            (child, outputs.sample(child, logits[row], tokens[row]))
            for state, row in forking
            for child in self._fork(state)
        ]
        for child, token in children:
            child.seq.token_ids.append(token)
        landed = [(outputs.active[seq_id], token) for seq_id, token in new_tokens.items()]
        outputs.check_and_stream(landed + children)

    def _speculates(self, batch: Batch) -> bool:
        return self.speculation is not None and self.speculation.speculates(batch)

    def _may_propose(self, batch: Batch) -> bool:
        return self.speculation is not None and self.speculation.may_propose(batch)

    def _before_launch(self) -> None:
        """Before any step of the model: yield to a hotter instance if asked, and copy in
        the blocks the host tier gave back."""
        if self.before_step is not None:
            self.before_step()
        self._restore_blocks()

    def _launch(self, batch: Batch, inputs: Prepared | None = None) -> torch.Tensor:
        """Run `batch`'s model step (not waiting for the GPU); a decoding sequence's newest
        token, if still on the device, comes from the step in flight. `inputs`: prepared
        ahead."""
        self._before_launch()
        previous = self.outputs.in_flight
        rows = {s.seq_id: i for i, s in enumerate(previous.seqs)} if previous else {}
        logits = self.runner.run(
            batch, previous=Previous(previous.on_device, rows) if previous else None, inputs=inputs
        )
        if self.proposer is not None:  # (an EAGLE head keeps the step's features)
            self.proposer.observe(batch.seqs, batch.num_tokens)
        return logits

    def _restore_blocks(self) -> None:
        """Blocks the host tier gave back since the last step: their K/V copied in first."""
        blocks = self.scheduler.blocks
        if blocks.restores:
            self.runner.write_blocks(blocks.restores)
            for _, payload in blocks.restores:  # (the copies back are issued)
                self.runner.recycle(payload)
            blocks.restores = []

    def _fork(self, parent: Active) -> list[Active]:
        """The request's other sequences, started on the parent's computed prompt: its
        full KV blocks shared, the partial last one copied (each writes its own token
        there next)."""
        n, parent.forks = parent.forks, 0
        prompt = parent.seq.token_ids[: parent.seq.num_prompt_tokens]
        children = []
        for index in range(1, n + 1):
            seq = Sequence(list(prompt), parent.seq.principal, max_tokens=parent.seq.max_tokens)
            copies = self.scheduler.fork(parent.seq, seq)
            self.runner.copy_blocks(copies)
            children.append(self._start(parent.request, parent.emit, seq, index))
        return children
