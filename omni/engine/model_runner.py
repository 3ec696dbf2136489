"""Runs a scheduled batch through the model over the paged KV cache.

Owns the cache pool (sized from the memory the instance is given) and turns a
Batch into the flat tensors the kernels take: token ids, positions, cache
slots, block tables, sequence lengths, query offsets.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed

from .block_manager import BlockManager
from .cuda_graphs import BUCKETS, DecodeGraphs
from .kernels.attention import prefill_work
from .kernels.rows import empty_rows
from .kv_cache import assign_scales, cache_dtype, kv_layout
from .kv_tiers import PinnedBlocks
from .llama import LlamaForCausalLM
from .mixed_graphs import BUCKETS as MIXED_BUCKETS
from .mixed_graphs import MixedGraphs
from .scheduler import Batch
from .sequence import PLACEHOLDER, Sequence
from .step import HostInputs, Prepared, Previous, StepInputs

if TYPE_CHECKING:
    from omni.cudashim.kv_pool import KVPool

# Step sizes (tokens) whose kernels warm_up compiles: one of each tile class of the linear
# kernels (<= 16, <= 64, <= 128, <= 256, <= 1024, <= 4096, wider) and of Triton's integer
# specializations (1, multiples of 16, others); max_batch_tokens, the usual prefill step,
# joins them. A first request of a new size would otherwise wait seconds for the compiler.
WARM_STEP_TOKENS = (1, 7, 16, 40, 48, 100, 128, 200, 256, 300, 512, 1100, 2048, 4100)
# decode graphs captured at warm-up even when the rest are left to their first step: a
# capture stalls the requests in flight, and small batches come first and often
ALWAYS_CAPTURED = 16
# the shim's pool is backed in steps of at least this much of each layer's K (and V): the
# driver's mapping granularity on the GPUs we run
POOL_STEP_BYTES = 2 << 20
CPU_CACHE_BYTES = 1 << 30  # default KV pool without a GPU; OMNI_KV_CACHE_BYTES overrides
GPU_CACHE_FRACTION = 0.85  # of the memory left after the weights


def block_tables(tables: list[list[int]]) -> np.ndarray:
    """Rows' block tables as one int32 array, each row zero-padded to the widest."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for row, table in zip(out, tables, strict=True):
        row[: len(table)] = table
    return out


def kv_bytes_per_block(model, block_size: int) -> int:
    """What one block of `model`'s KV cache takes (K and V, every layer)."""
    cfg = model.cfg
    # an FP8 cache: half the bytes a token, twice the tokens (kv_cache.py)
    dtype = cache_dtype(cfg.kv_cache_dtype, model.lm_head.weight.dtype)
    return cfg.num_layers * block_size * kv_layout(model).elements * dtype.itemsize


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache. On the CPU, pages of an anonymous mapping (which read as zero) that
    are taken only as they are written: the pool holds what requests wrote, not its whole
    size, and an engine starts without zeroing it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # keeps the mapping
    return pages.view(dtype).view(shape)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int = 16,
        num_blocks: int | None = None,
        companion_bytes_per_block: int = 0,
        graphs: bool = True,
        kv_pool: KVPool | None = None,
    ):
        """`companion_bytes_per_block`: another cache that holds as many blocks (a draft
        model's, indexed by the same block tables) shares the memory the pool is sized
        from. `graphs`: CUDA graphs for its steps (where the device has them). `kv_pool`:
        the shim's pool to take the cache from, so that a swap-out releases it instead
        of copying it (omni/cudashim/kv_pool.py); `self.kv_pool` is None unless it did."""
        self.model = model
        self.block_size = block_size
        self.device = model.lm_head.weight.device
        cfg = model.cfg
        dtype = cache_dtype(cfg.kv_cache_dtype, model.lm_head.weight.dtype)
        assign_scales(model, cfg.kv_cache_dtype)
        per_block = kv_bytes_per_block(model, block_size) + companion_bytes_per_block
        self.num_blocks = num_blocks or max(1, self._cache_bytes() // per_block)
        if cfg.tp > 1:  # every rank holds the same blocks: the fewest any can
            n = torch.tensor([self.num_blocks], device=self.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
            self.num_blocks = int(n)
        layout = kv_layout(model)
        shape = (cfg.num_layers, self.num_blocks, block_size, layout.heads, layout.dim)
        self.kv_pool = kv_pool
        self.k_cache, self.v_cache = self._allocate_cache(shape, dtype, layout.values)
        # decode steps replay one CUDA graph, other steps of up to 1,024 tokens another
        # (OMNI_CUDA_GRAPHS=0: neither)
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None
        # read_block's buffers (GPU): slabs pinned on first use, or at warm-up
        cuda = self.device.type == "cuda"
        self._pinned = PinnedBlocks(self.block_shape, self.kv_dtype) if cuda else None
        if graphs and self.device.type == "cuda" and os.environ.get("OMNI_CUDA_GRAPHS", "1") != "0":
            max_tokens = min(cfg.max_position, self.num_blocks * block_size)
            max_blocks = -(-max_tokens // block_size)
            self.graphs = DecodeGraphs(model, self.k_cache, self.v_cache, max_blocks)
            self.mixed = MixedGraphs(model, self.k_cache, self.v_cache, max_blocks)

    def _allocate_cache(
        self, shape: tuple[int, ...], dtype: torch.dtype, values: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V caches: from the shim's pool where it gives one, else tensors.
        Without `values` (kv_cache.KVLayout) V is zero-width: what copies a block's K and
        V then moves K alone."""
        shapes = (shape, shape if values else (*shape[:-1], 0))
        sizes = [math.prod(s) * dtype.itemsize for s in shapes]
        raw = self.kv_pool.allocate(sum(sizes), self.device) if self.kv_pool else None
        if raw is None:
            self.kv_pool = None
            return tuple(zeroed(s, dtype, self.device) for s in shapes)
        # each layer's K, then each layer's V, is a run of all the blocks: (the run's
        # offset in the pool, one block's bytes in it)
        layers, blocks = shape[0], shape[1]
        runs = [(at, size // layers) for at, size in zip((0, sizes[0]), sizes, strict=True) if size]
        self._strips = [(at + i * run, run // blocks) for at, run in runs for i in range(layers)]
        self._pool_step = max(1, -(-POOL_STEP_BYTES // self._strips[0][1]))
        self._backed, self._backed_epoch = 0, self.kv_pool.epoch()
        parts = raw.split(sizes)
        k, v = (p.view(dtype).view(s) for p, s in zip(parts, shapes, strict=True))
        return k, v

    def back_blocks(self, n: int) -> int:
        """Back at least the first `n` blocks of the shim's pool with memory (every
        layer's K and V, in steps of POOL_STEP_BYTES) and return how many are backed: the
        block manager's `grow`. A swap-out since the last call released them all."""
        epoch = self.kv_pool.epoch()
        if epoch != self._backed_epoch:
            self._backed, self._backed_epoch = 0, epoch
        if n <= self._backed:
            return self._backed
        n = min(self.num_blocks, -(-n // self._pool_step) * self._pool_step)
        for offset, per_block in self._strips:
            start = offset + self._backed * per_block
            self.kv_pool.map(start, (n - self._backed) * per_block, self.device)
        self._backed = n
        return n

    def _cache_bytes(self) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)  # the quota, under the shim
            return int(free * GPU_CACHE_FRACTION)
        if env := os.environ.get("OMNI_KV_CACHE_BYTES"):
            return int(env)
        limit = int(os.environ.get("OMNI_MEMORY_LIMIT_BYTES", "0"))
        return min(CPU_CACHE_BYTES, limit // 4) if limit else CPU_CACHE_BYTES

    def memory_bytes(self) -> int:
        """What this runner holds: its model's weights (its shard) and the KV-cache pool."""
        tensors = {t.data_ptr(): t for t in self.model.state_dict().values()}  # tied once
        weights = sum(t.numel() * t.element_size() for t in tensors.values())
        return weights + self.k_cache.nbytes + self.v_cache.nbytes

    def read_block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's K and V (every layer) in host memory, for the host tier (kv_tiers.py):
        copied in stream order, before any later step writes the block again (on a GPU,
        into pinned buffers that `recycle` takes back)."""
        if self.device.type != "cuda":
            return self.k_cache[:, block].clone(), self.v_cache[:, block].clone()
        out = self._pinned.get()
        for dst, cache in zip(out, (self.k_cache, self.v_cache), strict=True):
            dst.copy_(cache[:, block], non_blocking=True)
        return out

    def pinned_slab_tasks(self, budget_bytes: int) -> list[Callable[[], None]]:
        """Work that pins the host tier's buffers up front (`budget_bytes` of blocks),
        one slab a task; none on the CPU."""
        if self._pinned is None or budget_bytes <= 0:
            return []
        per_block = self.k_cache[:, 0].nbytes + self.v_cache[:, 0].nbytes
        slabs = -(-budget_bytes // per_block) // PinnedBlocks.SLAB_BLOCKS + 1
        return [self._pinned.add_slab] * slabs

    def recycle(self, payload: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A buffer of read_block's the tier is done with (its last copy issued)."""
        if self._pinned is not None:
            self._pinned.put(payload)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's K (or V) over every layer: [layers, block, heads, dim]."""
        return (self.k_cache.shape[0], *self.k_cache.shape[2:])

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.k_cache.dtype

    def export_blocks(self, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of `blocks`, each [layers, blocks, block, heads, dim] in host memory,
        for another instance (kv_transfer.py); waits for the copy."""
        index = torch.tensor(blocks, device=self.device)
        out = []
        for cache in (self.k_cache, self.v_cache):
            raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # FP8
            out.append(raw.index_select(1, index).cpu().view(cache.dtype))
        return out[0], out[1]

    def write_blocks(self, restores: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Copy K/V back from the host tier into their new blocks (before the step that
        reads them: stream order)."""
        for block, (k, v) in restores:
            self.k_cache[:, block].copy_(k, non_blocking=True)
            self.v_cache[:, block].copy_(v, non_blocking=True)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer: a forked sequence's own
        copy of a shared partial block, made before the step that writes into it."""
        if pairs:
            src, dst = (torch.tensor(side, device=self.device) for side in zip(*pairs, strict=True))
            for cache in (self.k_cache, self.v_cache):
                raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # FP8
                raw[:, dst] = raw[:, src]

    def warm_up_tasks(
        self, max_seqs: int, max_batch_tokens: int, graphs: bool = True
    ) -> list[Callable[[], None]]:
        """The warm-up in pieces of a fraction of a second each, for an engine to run
        between requests: one per step-size class whose kernels it compiles (or loads
        from Triton's disk cache) and, with `graphs`, one per decode graph a step of at
        most `max_seqs` sequences can need (without, those of up to ALWAYS_CAPTURED
        sequences, and each larger one at its first step); one per bucket of the
        mixed-step graphs in any case. The CPU path has nothing to compile."""
        if self.device.type != "cuda":
            return []
        sizes = sorted({n for n in WARM_STEP_TOKENS if n < max_batch_tokens} | {max_batch_tokens})
        tasks: list[Callable[[], None]] = [partial(self._warm_step, n, max_seqs) for n in sizes]
        if self.graphs:
            for b in BUCKETS:  # up to the bucket that pads `max_seqs`
                if not graphs and b > ALWAYS_CAPTURED:
                    break
                tasks.append(partial(self._capture, b))
                if b >= max_seqs:
                    break
        if self.mixed:  # always: a step never captures these itself (mixed_graphs)
            tasks += [partial(self._capture_mixed, b) for b in MIXED_BUCKETS]
        return tasks

    def warm_up(self, max_seqs: int, max_batch_tokens: int, graphs: bool = True) -> None:
        """All of warm_up_tasks, before the first request."""
        for task in self.warm_up_tasks(max_seqs, max_batch_tokens, graphs):
            task()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _warm_step(self, n: int, max_seqs: int) -> None:
        """A prefill step of n tokens that writes nothing to the cache (slots -1). Its
        block table covers the n tokens (all block 0): attention reads a block id for
        every 16 of them, and one read past a narrower table (n over the model's context,
        or no graphs) faulted the GPU (CUDA error 700, which no later call survives)."""
        width = max(self.graphs.tables.shape[1] if self.graphs else 1, -(-n // self.block_size))
        work = prefill_work([n])
        i32 = {"dtype": torch.int32, "device": self.device}
        step = StepInputs(
            positions=torch.arange(n, device=self.device),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(1, width, **i32),
            seq_lens=torch.tensor([n], **i32),
            cu_seqlens_q=torch.tensor([0, n], **i32),
            num_decodes=0,
            counts=torch.tensor([0, len(work)], **i32),
            work=torch.tensor(work, **i32),
        )
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        hidden = self.model.hidden_states(ids, step, self.k_cache, self.v_cache)
        self.model.logits(hidden[: min(n, max_seqs)])  # the lm head at as many rows

    @torch.inference_mode()
    def _capture(self, bucket: int) -> None:
        self.graphs.capture(bucket)

    @torch.inference_mode()
    def _capture_mixed(self, bucket: int) -> None:
        self.mixed.capture(bucket)

    def prepare(
        self, batch: Batch, previous: Previous | None = None
    ) -> tuple[torch.Tensor, StepInputs]:
        """The step's flat inputs, in two host-to-device copies from pinned memory (they do
        not wait for the GPU). A decoding sequence whose newest token is still a
        PLACEHOLDER takes it from `previous`, the last step's tokens on the device."""
        inputs = self.prepare_inputs(batch, previous.rows if previous else {})
        return self.with_placeholders(inputs, previous.tokens if previous else None)

    def prepare_inputs(self, batch: Batch, previous_rows: dict[int, int]) -> Prepared:
        """prepare() up to the placeholders, which `previous_rows` locate (seq_id -> row of
        the last step's tokens): those tokens need not exist yet (launched later)."""
        seqs, counts = batch.seqs, batch.num_tokens
        num_decodes = sum(not seq.is_prefilling for seq in seqs)
        if any(seq.is_prefilling for seq in seqs[:num_decodes]):
            raise ValueError("a batch lists its decoding sequences first")
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        fill_at: list[int] = []  # token indexes whose id is a PLACEHOLDER
        fill_rows: list[int] = []  # ... and the row of `previous` that holds it
        for seq, n in zip(seqs, counts, strict=True):  # per sequence, not per token
            start, table = seq.num_computed, seq.block_table
            if n == 1:
                token = seq.token_ids[start]
                if token == PLACEHOLDER:
                    if seq.seq_id not in previous_rows:
                        raise ValueError(f"sequence {seq.seq_id}: newest token unknown")
                    fill_at.append(len(ids))
                    fill_rows.append(previous_rows[seq.seq_id])
                ids.append(token)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, start + n)
                ids.extend(seq.token_ids[start : start + n])
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            seq_lens.append(start + n)
        # sampled rows (each sampling sequence's last token) and the placeholders' sources
        # travel in the same copies: indexing with host lists would copy synchronously
        # (a wait for the step in flight)
        ends = np.cumsum(counts)
        sample_at = [int(ends[i]) - 1 for i in range(len(seqs)) if batch.samples(i)]
        tables = block_tables([s.block_table for s in seqs])
        work = np.asarray(prefill_work(counts[num_decodes:], num_decodes), dtype=np.int32)
        longs = [ids, positions, slots, sample_at, fill_at, fill_rows]
        ints = [seq_lens, np.concatenate(([0], ends)), tables.ravel()]
        ints += [[num_decodes, len(work)], work.ravel()]
        return self.upload(HostInputs.pack(longs, ints, tables.shape, num_decodes))

    def prepare_rows(self, seqs: list[Sequence], tokens: list[list[int]]) -> Prepared:
        """A decode step of several rows per sequence (speculative.py's verify step):
        `tokens[i]` continues seqs[i] from its first uncomputed position (its newest
        token, then proposed ones, whose blocks are reserved). Each row is a decode row
        of its own length, computed exactly as decoding that position alone would be,
        and every row samples."""
        bs = self.block_size
        ids, positions, slots, seq_lens, table_rows = [], [], [], [], []
        for seq, row_tokens in zip(seqs, tokens, strict=True):
            start, table = seq.num_computed, seq.block_table
            for i, token in enumerate(row_tokens):
                pos = start + i
                ids.append(token)
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
                seq_lens.append(pos + 1)
                table_rows.append(table)
        rows, tables = len(ids), block_tables(table_rows)
        longs = [ids, positions, slots, list(range(rows)), [], []]
        ints = [seq_lens, list(range(rows + 1)), tables.ravel(), [rows, 0], []]
        return self.upload(HostInputs.pack(longs, ints, tables.shape, rows))

    @torch.inference_mode()
    def run_rows(self, seqs: list[Sequence], tokens: list[list[int]]) -> torch.Tensor:
        """Logits of every row of prepare_rows' step, in order."""
        return self.run_inputs(self.prepare_rows(seqs, tokens), None)

    def upload(self, host: HostInputs) -> Prepared:
        """The host inputs on the device, in two copies from pinned memory (they do not
        wait for the GPU)."""
        ids_d, positions_d, slots_d, sample_d, at_d, rows_d = self._to_device(
            host.longs, host.long_sizes
        )
        seq_lens_d, cu_d, tables_d, counts_d, work_d = self._to_device(host.ints, host.int_sizes)
        step = StepInputs(
            positions=positions_d,
            slot_mapping=slots_d,
            block_tables=tables_d.view(host.rows, host.width),
            seq_lens=seq_lens_d,
            cu_seqlens_q=cu_d,
            num_decodes=host.num_decodes,
            counts=counts_d,
            work=work_d.view(-1, 2),
            sample_at=sample_d,
        )
        has_placeholders = host.long_sizes[4] > 0
        return Prepared(ids_d, step, (at_d, rows_d) if has_placeholders else None, host)

    @staticmethod
    def with_placeholders(
        inputs: Prepared, previous_tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor, StepInputs]:
        """The inputs with the placeholders taken from the last step's tokens on the
        device (queued after the step that makes them)."""
        if inputs.placeholders is not None:
            at, rows = inputs.placeholders
            inputs.ids[at] = previous_tokens[rows]
        return inputs.ids, inputs.step

    def _to_device(self, flat: np.ndarray, sizes: list[int]) -> list[torch.Tensor]:
        """The parts of `flat`, in one copy from pinned memory (it does not wait for the
        GPU)."""
        host = torch.from_numpy(flat)
        if self.device.type == "cuda":
            host = host.pin_memory().to(self.device, non_blocking=True)
        return list(host.split(sizes))

    @torch.inference_mode()
    def run(
        self,
        batch: Batch,
        all_logits: bool = False,
        previous: Previous | None = None,
        inputs: Prepared | None = None,
    ) -> torch.Tensor:
        """Logits of each sampling sequence's last token (or of every token). Launches the
        step and returns without waiting for the GPU. `inputs`: prepared ahead."""
        if inputs is None:
            inputs = self.prepare_inputs(batch, previous.rows if previous else {})
        return self.run_inputs(inputs, previous.tokens if previous else None, all_logits)

    @torch.inference_mode()
    def run_inputs(
        self, inputs: Prepared, previous_tokens: torch.Tensor | None, all_logits: bool = False
    ) -> torch.Tensor:
        """run() on prepared inputs: the batch itself is not needed."""
        ids, step = self.with_placeholders(inputs, previous_tokens)
        if (
            self.graphs
            and step.decode_only
            and not all_logits
            and self.graphs.bucket(step.seq_lens.shape[0])
        ):
            return self.graphs.run(ids, step)  # every decoding sequence samples
        if self.mixed and not all_logits and self.mixed.fits(step, len(ids)):
            hidden = self.mixed.run(ids, step)
        else:
            hidden = self.model.hidden_states(ids, step, self.k_cache, self.v_cache)
        if not all_logits:
            rows = empty_rows(len(step.sample_at), hidden.shape[1], hidden.dtype, hidden.device)
            hidden = torch.index_select(hidden, 0, step.sample_at, out=rows)  # feeds the lm head
        return self.model.logits(hidden)

    def close(self) -> None:
        """Done (the engine shuts down); split over ranks, the others stop too."""


class SoloSequence:
    """One sequence run directly, outside the scheduler: for tests and benchmarks."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self.seq = Sequence(token_ids=[])

    def extend(
        self, tokens: list[int], chunk: int | None = None, all_logits: bool = False
    ) -> torch.Tensor:
        """Append `tokens` and compute them (in chunks of `chunk`); logits of the last one,
        or of every new token."""
        seq = self.seq
        for token in tokens:
            seq.token_ids.append(token)
            if len(seq.token_ids) == 1:
                self.blocks.allocate(seq)
            else:
                self.blocks.append_slot(seq)
        outs = []
        while seq.num_uncomputed:
            n = min(seq.num_uncomputed, chunk or seq.num_uncomputed)
            outs.append(self.runner.run(Batch([seq], [n]), all_logits=True))
            seq.num_computed += n
        logits = torch.cat(outs)
        return logits if all_logits else logits[-1]
