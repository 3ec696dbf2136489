"""Text generation engine: one worker thread runs continuous batching; asyncio callers stream.

Requests join and leave between steps. Each step runs one mixed batch (decodes
and prefill chunks) through the model over the paged KV cache, samples one
token for every sequence that reached its end, and streams text deltas.

Greedy steps overlap with the host: step N+1 is launched before step N's tokens
are read back (its inputs come from N's tokens on the device), so scheduling,
preparing and streaming happen while the GPU computes. The host waits on a
blocking event, asleep rather than spinning.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from omni.cudashim.kv_pool import KVPool

from . import kv_transfer
from .block_manager import BlockManager
from .grammar import Constraint, Grammars, GrammarSpec
from .kernels import builds
from .kv_tiers import DiskTier, HostTier
from .llama import LlamaForCausalLM
from .model_runner import ModelRunner
from .proposers import Proposer, draft_bytes_per_block, make_proposer
from .sampling import SamplingParams, make_generator, probabilities, sample, shape
from .scheduler import Batch, Scheduler
from .sequence import PLACEHOLDER, Sequence, Status
from .speculative import AdaptiveK, SpecConfig, SpecStats, accept_greedy, accept_sampled
from .step import Prepared, Previous
from .stops import StopMatcher
from .tokenizer import StreamDecoder, TextTokenizer
from .tp_runner import LeaderRunner

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
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # per token: (id, logprob, [(alternative id, logprob), ...]) when the request asked
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
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
class _InFlight:
    """A launched step whose greedy tokens are still on their way to the host."""

    seqs: list[Sequence]  # the sampling ones, in row order
    on_device: torch.Tensor  # [rows] int64: the next step's inputs
    on_host: torch.Tensor  # the same, copied without waiting
    ready: torch.cuda.Event | None  # recorded after the copy (None on the CPU)

    def tokens(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # a blocking-sync event: the thread sleeps
        return self.on_host.tolist()


@dataclass
class _Active:
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
    logprob: tuple[int, float, list[tuple[int, float]]] | None = None  # of the newest token

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
        self.speculative = speculative  # speculative.py; None: off
        self.spec_stats = SpecStats()
        self._spec_k: dict[int, AdaptiveK] = {}  # seq_id -> its k
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
        self.proposer: Proposer | None = None
        if speculative is not None:
            self.proposer = make_proposer(
                speculative,
                draft,
                self.runner,
                self.scheduler.blocks,
                self.scheduler.max_batch_tokens,
            )
        self._in_flight: _InFlight | None = None
        # a step launched by the last one, right after its pick (grammar steps)
        self._launched: tuple[Batch, torch.Tensor] | None = None
        # requests, batches of idle-time work (lists), or None: shut down
        self._inbox: queue.Queue[tuple[GenerationRequest, Emit] | list | None] = queue.Queue()
        self._idle_work: collections.deque[Callable[[], None]] = collections.deque()
        self._active: dict[int, _Active] = {}
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
            **(self.spec_stats.as_dict() if self.speculative else {}),
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
                self._in_flight = self._launched = None
                for state in list(self._active.values()):
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

    def _start(self, request: GenerationRequest, emit: Emit, seq: Sequence, index: int):
        """The engine's state for one of the request's sequences; the i-th of n draws from
        seed + i (the first is what n=1 with that seed gives)."""
        params = request.params
        seed = None if params.seed is None else params.seed + index
        state = _Active(
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
        self._active[seq.seq_id] = state
        return state

    def _drop_cancelled(self) -> None:
        for state in list(self._active.values()):
            if state.request.cancelled.is_set():
                self._finish(state, state.output("", [], "abort"))

    def _finish(self, state: _Active, out: StepOutput) -> None:
        n = state.request.export_blocks
        if n and out.finish_reason in ("stop", "length"):  # (its prompt is computed)
            out.kv = self.runner.export_blocks(state.seq.block_table[:n])
        self.scheduler.finish(state.seq)  # frees its blocks at once
        self._active.pop(state.seq.seq_id, None)
        self._spec_k.pop(state.seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.release(state.seq.seq_id)
        state.emit(out)

    def _step(self) -> None:
        self._enter_pool()  # (before the scheduler looks for cached prefixes)
        if self._launched is not None:  # launched by the last step, right after its pick
            batch, logits = self._launched
            self._launched = None
        else:
            batch = self.scheduler.schedule()
            if batch is None:
                self._land()
                return
            if self._speculates(batch) and self._speculative_step(batch):
                return
            logits = self._launch(batch)
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        if any(self._constraint(s) for s in sampling):
            # A grammar's mask needs the last step's token accepted first. While the GPU
            # runs this step's model, the grammar thread accepts the tokens that landed
            # and fills the masks; meanwhile this one schedules the next step and streams
            # the tokens (the device's mask lets no refused token through: one would end
            # its request, after it was streamed). Then mask and pick, and launch the
            # next step at once (its inputs are this step's picks, on the device).
            landed = self._take_landed()
            masking = self._advance_grammars(landed, sampling)
            pipelined = all(self._on_device(s) for s in sampling) and not self._may_propose(batch)
            if pipelined:  # the next step, ready before this one's pick
                self.scheduler.update(batch, {s.seq_id: PLACEHOLDER for s in sampling})
                after = self.scheduler.schedule()
                rows = {s.seq_id: i for i, s in enumerate(sampling)}
                inputs = self.runner.prepare_inputs(after, rows) if after is not None else None
                self._deliver_all(landed)
            refused = self._mask_grammars(logits, masking)
            step = self._launch_greedy(logits, sampling)
            if pipelined:
                self._in_flight = step
                if after is not None:
                    self._launched = after, self._launch(after, inputs)
                self._end_grammars(landed, refused)
                return
            self._deliver_landed(landed, refused)
        else:
            step = self._launch_greedy(logits, sampling)
            self._land()  # the last step's tokens, while the GPU runs this one
            # (not while the next step may speculate: its proposals need these tokens)
            if all(self._on_device(s) for s in sampling) and not self._may_propose(batch):
                self.scheduler.update(batch, {s.seq_id: PLACEHOLDER for s in sampling})
                self._in_flight = step
                return
        tokens = step.tokens()
        new_tokens, forking = {}, []
        for row, seq in enumerate(sampling):
            state = self._active.get(seq.seq_id)
            if state is None:
                continue  # finished by the last step's tokens
            new_tokens[seq.seq_id] = self._sample(state, logits[row], tokens[row])
            if state.forks:
                forking.append((state, row))
        self.scheduler.update(batch, new_tokens)
        children = [
            (child, self._sample(child, logits[row], tokens[row]))
            for state, row in forking
            for child in self._fork(state)
        ]
        for child, token in children:
            child.seq.token_ids.append(token)
        landed = [(self._active[seq_id], token) for seq_id, token in new_tokens.items()]
        self._deliver_accepted(landed + children)

    # ------------------------------------------------------------ speculative decoding

    def _speculates(self, batch: Batch) -> bool:
        """Whether `batch` may be a speculative step: decodes only, few enough of them,
        every newest token on the host (then the step after a step of such a batch
        waits for its tokens, rather than be launched ahead with them on the device)."""
        spec = self.speculative
        if spec is None or len(batch.seqs) > spec.max_batch:
            return False
        for seq in batch.seqs:
            state = self._active.get(seq.seq_id)
            if seq.is_prefilling or state is None:
                return False
            if state.forks or seq.token_ids[-1] == PLACEHOLDER:
                return False
        return True

    def _may_propose(self, batch: Batch) -> bool:
        """Whether the step after `batch` (its sequences one token on) may propose: then
        it waits for this step's tokens rather than be launched ahead of them."""
        if not self._speculates(batch):
            return False
        k = self.speculative.k
        return any(
            self._spec_k[s.seq_id].k_at(s.num_generated + 1) if s.seq_id in self._spec_k else k
            for s in batch.seqs
        )

    def _proposals(self, batch: Batch) -> list[list[int]]:
        """Each sequence's proposed tokens, within its max_tokens, the context, and the
        free blocks (reserved here, before a draft writes its K/V there)."""
        spec, ks = self.speculative, []
        for seq in batch.seqs:
            k = self._spec_k.setdefault(seq.seq_id, AdaptiveK(spec.k)).k_at(seq.num_generated)
            room = min(seq.max_tokens - seq.num_generated, self.max_context - len(seq.token_ids))
            k = max(0, min(k, room - 1))
            if k and not self.scheduler.blocks.reserve(seq, len(seq.token_ids) + k):
                k = 0
            ks.append(k)
        out = self.proposer.propose(batch.seqs, ks)
        for i, seq in enumerate(batch.seqs):
            constraint = self._constraint(seq)
            if out[i] and constraint is not None:  # only what its grammar allows can be kept
                out[i] = out[i][: constraint.valid_prefix(out[i])]
        return out

    def _speculative_step(self, batch: Batch) -> bool:
        """Run `batch` as a verify step: each sequence's newest token and its proposals,
        one row each; keep what the target model agrees with, stream it. False: nothing
        was proposed (the caller runs a plain step)."""
        proposals = self._proposals(batch)
        if not any(proposals):
            return False
        if self.before_step is not None:
            self.before_step()
        pairs = list(zip(batch.seqs, proposals, strict=True))
        rows = [[seq.token_ids[-1], *guess] for seq, guess in pairs]
        self._restore_blocks()
        logits = self.runner.run_rows(batch.seqs, rows)
        self.proposer.observe(batch.seqs, [len(r) for r in rows])
        self._mask_greedy_rows(logits, pairs)
        picks = logits.argmax(-1).tolist()  # (rows needing no more: only these travel)
        stats, first = self.spec_stats, 0
        stats.steps += 1
        for seq, guess in pairs:
            state = self._active.get(seq.seq_id)
            span, first = slice(first, first + len(guess) + 1), first + len(guess) + 1
            if state is None:
                continue
            generated = seq.num_generated
            mine = None if self._device_pick(state) else logits[span].float().cpu()
            tokens = self._verify(state, mine, picks[span], guess)
            accepted = len(tokens) - 1
            self._spec_k[seq.seq_id].update(len(guess), accepted, generated)
            stats.rows += 1
            stats.proposed += len(guess)
            stats.accepted += accepted
            stats.emitted += len(tokens)
            self.scheduler.advance(seq, tokens)
            for i, token in enumerate(tokens):
                if state.request.params.logprobs is not None:
                    state.logprob = self._logprob(mine[i], token, state.request.params.logprobs)
                if state.constraint is not None:
                    state.constraint.accept(token)  # (its row was masked: it is allowed)
                self._deliver(state, token)
                if seq.seq_id not in self._active:
                    break  # finished (EOS, a stop, max_tokens): the rest is dropped
                if state.constraint is not None and state.constraint.done:
                    self._finish(state, state.output(state.stops.flush(), [], "stop"))
                    break
        return True

    def _mask_greedy_rows(self, logits: torch.Tensor, pairs) -> None:
        """Mask, on the device, the verify rows of the greedy sequences under a grammar
        (each for its place after the proposals before it), as plain decoding masks its
        rows: their argmax is then their pick."""
        bitmask, rows, first = None, [], 0
        for seq, guess in pairs:
            state = self._active.get(seq.seq_id)
            if state is not None and state.constraint is not None and self._device_pick(state):
                if bitmask is None:
                    bitmask = self.grammars._bitmask_rows(len(logits))
                state.constraint.fill_along(bitmask, first, guess)
                rows.extend(range(first, first + len(guess) + 1))
            first += len(guess) + 1
        if rows:
            self.grammars.apply_masks(logits, bitmask, rows)

    def _verify(
        self, state: _Active, logits: torch.Tensor | None, picks: list[int], guess: list[int]
    ) -> list[int]:
        """The tokens one sequence's verify rows emit: the target's picks (greedy) or
        rejection sampling, each row shaped as plain decoding would shape it there.
        `picks`: each row's argmax (all a plain greedy request needs, `logits` None)."""
        if logits is None:
            return accept_greedy(picks, guess)
        params, seq = state.request.params, state.seq
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        output = seq.token_ids[seq.num_prompt_tokens :]
        if state.constraint is not None:  # each row masked where the grammar is there
            logits = state.constraint.mask_along(logits.clone(), guess)
        rows = []
        for i in range(len(guess) + 1):
            so_far = output + guess[:i]
            # min_tokens holds back the end; under a grammar, the grammar decides it
            early = len(so_far) < params.min_tokens and state.constraint is None
            rows.append(shape(logits[i], params, prompt, so_far, state.eos if early else set()))
        if params.greedy:
            return accept_greedy([int(r.argmax()) for r in rows], guess)
        return accept_sampled([probabilities(r, params) for r in rows], guess, state.generator)

    @staticmethod
    def _logprob(logits: torch.Tensor, token: int, top: int):
        """(token, its logprob, the `top` most likely with theirs) of one row of the
        model's logits, before any shaping or mask."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        best = torch.topk(logprobs, top) if top else None
        alternatives = (
            list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
            if best is not None
            else []
        )
        return token, float(logprobs[token]), alternatives

    def _launch(self, batch: Batch, inputs: Prepared | None = None) -> torch.Tensor:
        """Run `batch`'s model step (not waiting for the GPU); a decoding sequence's newest
        token, if still on the device, comes from the step in flight. `inputs`: prepared
        ahead."""
        if self.before_step is not None:
            self.before_step()
        previous = self._in_flight
        rows = {s.seq_id: i for i, s in enumerate(previous.seqs)} if previous else {}
        self._restore_blocks()
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

    def _fork(self, parent: _Active) -> list[_Active]:
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

    def _constraint(self, seq: Sequence) -> Constraint | None:
        state = self._active.get(seq.seq_id)
        return state.constraint if state is not None else None

    def _advance_grammars(self, landed: list[tuple[_Active, int]], sampling: list[Sequence]):
        """Start the grammar thread on the landed tokens and this step's masks: the rows
        whose grammar is applied on the device (their pick is the argmax), less those
        whose landed token ends their grammar."""
        accepting = [(state, token) for state, token in landed if state.constraint is not None]
        ending = {s.seq.seq_id for s, token in accepting if token in self.grammars.stop_ids}
        rows, filling = [], []
        for row, seq in enumerate(sampling):
            state = self._active.get(seq.seq_id)
            if state is None or state.constraint is None or state.constraint.done:
                continue
            if self._device_pick(state) and seq.seq_id not in ending:
                rows.append(row)
                filling.append(state.constraint)
        return accepting, self.grammars.advance_and_fill(
            [s.constraint for s, _ in accepting],
            [t for _, t in accepting],
            len(sampling),
            rows,
            filling,
        )

    def _mask_grammars(self, logits: torch.Tensor, masking) -> set[int]:
        """Wait for the grammar thread; mask its rows of `logits` on the device (one copy,
        xgrammar's kernel). Returns the sequences whose landed token was refused."""
        accepting, job = masking
        accepted, bitmask, rows = job.result()
        if bitmask is not None:
            self.grammars.apply_masks(logits, bitmask, rows)
        return {s.seq.seq_id for (s, _), ok in zip(accepting, accepted, strict=True) if not ok}

    def _accept(self, landed: list[tuple[_Active, int]]) -> set[int]:
        """Advance the grammars by their new tokens (in one batch); returns the sequences
        whose token its grammar refused."""
        pairs = [(state, token) for state, token in landed if state.constraint is not None]
        if not pairs:
            return set()
        accepted = self.grammars.accept([s.constraint for s, _ in pairs], [t for _, t in pairs])
        return {s.seq.seq_id for (s, _), ok in zip(pairs, accepted, strict=True) if not ok}

    def _end_grammars(self, landed: list[tuple[_Active, int]], refused: set[int]) -> None:
        """After delivery: fail the requests whose token their grammar refused; finish
        those whose grammar is complete (its end token is EOS, which finished them
        already, unless EOS is ignored)."""
        for state, token in landed:
            if state.constraint is None or state.seq.seq_id not in self._active:
                continue
            if state.seq.seq_id in refused:
                out = state.output("", [], "error")
                out.error = f"structured output: the grammar does not allow token {token} here"
                self._finish(state, out)
            elif state.constraint.done:
                self._finish(state, state.output(state.stops.flush(), [], "stop"))

    def _launch_greedy(self, logits: torch.Tensor, sampling: list[Sequence]) -> _InFlight:
        """Every row's argmax, on its way to the host without waiting for the GPU."""
        on_device = logits.argmax(-1) if sampling else logits.new_empty(0, dtype=torch.int64)
        if on_device.device.type != "cuda":
            return _InFlight(sampling, on_device, on_device, None)
        on_host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
        on_host.copy_(on_device, non_blocking=True)
        ready = torch.cuda.Event(blocking=True)
        ready.record()
        return _InFlight(sampling, on_device, on_host, ready)

    @staticmethod
    def _device_pick(state: _Active) -> bool:
        """Whether the (grammar-masked) argmax on the device is this sequence's token."""
        params = state.request.params
        return params.greedy and not params.shaped and params.logprobs is None

    def _on_device(self, seq: Sequence) -> bool:
        """Whether the argmax is all this sequence's sampling needs (no host work)."""
        state = self._active.get(seq.seq_id)
        if state is None:
            return True  # finished meanwhile: its row is dropped
        return self._device_pick(state) and not state.forks

    def _land(self) -> None:
        """Fill in and stream the tokens of the step in flight, if any."""
        self._deliver_accepted(self._take_landed())

    def _deliver_accepted(self, landed: list[tuple[_Active, int]]) -> None:
        """Advance the grammars by the new tokens, then stream those they accepted."""
        self._deliver_landed(landed, self._accept(landed))

    def _deliver_landed(self, landed: list[tuple[_Active, int]], refused: set[int]) -> None:
        """Stream the tokens their grammars accepted; then fail the refused requests and
        finish those whose grammar is complete."""
        self._deliver_all([(s, t) for s, t in landed if s.seq.seq_id not in refused])
        self._end_grammars(landed, refused)

    def _take_landed(self) -> list[tuple[_Active, int]]:
        """The tokens of the step in flight (waiting for them), filled in for their
        placeholders."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        landed = []
        for seq, token in zip(step.seqs, step.tokens(), strict=True):
            state = self._active.get(seq.seq_id)
            if state is None or seq.status is Status.FINISHED:
                continue
            seq.token_ids[-1] = token  # its placeholder: nothing was appended since
            landed.append((state, token))
        return landed

    def _deliver_all(self, landed: list[tuple[_Active, int]]) -> None:
        for state, token in landed:
            if state.seq.seq_id in self._active:
                self._deliver(state, token)

    def _sample(self, state: _Active, logits: torch.Tensor, greedy: int) -> int:
        params, seq = state.request.params, state.seq
        # the device's argmax: of the plain logits, or of the grammar-masked ones (a row
        # that also wants logprobs is not masked on the device: they are the model's own)
        if self._device_pick(state) or (
            params.greedy and not params.shaped and state.constraint is None
        ):
            token = greedy
        else:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            output = seq.token_ids[seq.num_prompt_tokens :]
            # min_tokens holds back the end; under a grammar, the grammar decides it
            early = len(output) < params.min_tokens and state.constraint is None
            banned = state.eos if early else frozenset()
            allowed = logits  # logprobs below stay the model's own, unmasked
            if state.constraint is not None:
                allowed = state.constraint.mask(logits.float().clone())
            token = sample(allowed, params, state.generator, prompt, output, banned)
        if params.logprobs is not None:  # of the model's distribution, before sampling
            state.logprob = self._logprob(logits, token, params.logprobs)
        return token

    def _deliver(self, state: _Active, token: int) -> None:
        """Stream the new token's text; finish on EOS, a stop string or max_tokens."""
        state.delivered += 1
        if token in state.eos:
            self._finish(state, state.output(state.stops.flush(), [token], "stop"))
            return
        text, hit_stop = state.stops.feed(state.decoder.push(token))
        if hit_stop:
            self._finish(state, state.output(text, [token], "stop"))
        elif state.delivered >= state.request.params.max_tokens:
            self._finish(state, state.output(text + state.stops.flush(), [token], "length"))
        else:
            state.emit(state.output(text, [token]))
