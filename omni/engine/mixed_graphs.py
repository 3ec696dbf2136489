"""CUDA graphs for steps that are not decode-only: prompt chunks, alone or beside decodes.

A decode step is one graph per batch-size bucket (cuda_graphs.py). A mixed step is one
graph per token-count bucket, attention included. Attention's launch is the part that
depends on the batch: how many sequences decode, and how many blocks of queries each
prompt chunk has. Here the grids are sized for the most a bucket can hold, and the
kernels read the real counts from the device: decode rows past the step's decodes
and prefill work-list entries past its own do nothing. The graph never changes; only
its static inputs do. A step of any mix is then one replay and a few input copies,
where eager attention cost ~12 ms of host time a step on the H100 host (launches, for a
step whose GPU time was less).

The step's tokens are padded to the bucket: padding tokens write no K/V (slot -1), are
in no attention work, and their rows of the token-wise layers are dropped; each row of
those kernels depends on its own input only, so no real token's result changes by a
bit (the engine's batch invariance).
"""

from __future__ import annotations

import torch

from .cuda_graphs import capture_graph
from .kernels.attention import PREFILL_BLOCK_M
from .step import StepInputs

# Up to 1,024 tokens: from there a step's GPU time (~27 ms on the H100) outlasts its eager
# launches, and padding would add compute-bound rows.
BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
MAX_PROMPT_CHUNKS = 64  # a bucket's graph holds steps with at most this many prompt chunks


def work_capacity(bucket: int) -> int:
    """Prefill work-list entries a bucket's graph launches for: a block per PREFILL_BLOCK_M
    tokens, plus one partial block per prompt chunk."""
    return bucket // PREFILL_BLOCK_M + min(bucket, MAX_PROMPT_CHUNKS)


class MixedGraphs:
    def __init__(self, model, k_cache: torch.Tensor, v_cache: torch.Tensor, max_blocks: int):
        self.model, self.k_cache, self.v_cache = model, k_cache, v_cache
        dev, size = k_cache.device, BUCKETS[-1]
        i32 = {"dtype": torch.int32, "device": dev}
        self.ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slots = torch.full((size,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(size, max_blocks, **i32)
        self.seq_lens = torch.ones(size, **i32)
        self.cu = torch.zeros(size + 1, **i32)
        self.work = torch.zeros(work_capacity(size), 2, **i32)
        self.counts = torch.zeros(2, **i32)  # (decodes, work entries) of the step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.steps = 0  # run through the graphs

    @staticmethod
    def bucket(n: int) -> int | None:
        return next((b for b in BUCKETS if b >= n), None)

    def fits(self, step, n: int) -> bool:
        """Whether a step of n tokens has its bucket's graph, and few enough prompt
        chunks for it. A bucket is captured by the engine's warm-up (idle time), never by
        a step: a capture takes a fraction of a second, a step's eager launches ~10 ms."""
        b = self.bucket(n)
        return b in self.graphs and step.work.shape[0] <= work_capacity(b)

    def run(self, ids: torch.Tensor, step) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a step that fits (a view into the
        graph's output, which the next replay of its bucket overwrites)."""
        n, rows = ids.shape[0], step.seq_lens.shape[0]
        b = self.bucket(n)
        self.steps += 1
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(step.positions)
        self.slots[:n].copy_(step.slot_mapping)
        self.slots[n:b].fill_(-1)
        self.tables[:rows, : step.block_tables.shape[1]].copy_(step.block_tables)
        self.seq_lens[:rows].copy_(step.seq_lens)
        self.cu[: rows + 1].copy_(step.cu_seqlens_q)
        # the rows past the step's own are empty: a kernel whose grid covers every row
        # (MLA's) reads none of the blocks past steps left in their tables
        self.cu[rows + 1 : b + 1].fill_(n)
        self.work[: step.work.shape[0]].copy_(step.work)
        self.counts.copy_(step.counts)
        self.graphs[b].replay()
        return self.outputs[b][:n]

    def capture(self, b: int) -> None:
        if b in self.graphs:
            return
        step = StepInputs(
            positions=self.positions[:b],
            slot_mapping=self.slots[:b],
            block_tables=self.tables[:b],
            seq_lens=self.seq_lens[:b],
            cu_seqlens_q=self.cu[: b + 1],
            num_decodes=b,  # the grid: up to b decode rows; `counts` says how many are
            counts=self.counts,
            work=self.work[: work_capacity(b)],
        )
        # the warm-up below runs for real: slots a past step left here are live K/V, and
        # no attention work (counts 0, every row empty) reads what past steps left in the
        # tables
        self.slots[:b].fill_(-1)
        self.counts.zero_()
        self.cu[: b + 1].zero_()
        self.graphs[b], self.outputs[b] = capture_graph(lambda: self._forward(b, step), self.pool)

    def _forward(self, b: int, step) -> torch.Tensor:
        return self.model.hidden_states(self.ids[:b], step, self.k_cache, self.v_cache)
