"""CUDA graphs for decode steps: one replay instead of hundreds of kernel launches.

A graph is captured for each batch-size bucket the first time the bucket is needed
(or by ModelRunner.warm_up), and replayed from static input buffers. It ends with
the lm head, so a step's logits come out of the one replay. Padding rows write
nowhere (cache slot -1) and their outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .step import StepInputs


def capture_graph(forward: Callable[[], torch.Tensor], pool) -> tuple:
    """(graph, its output): `forward` run once on a side stream first (which compiles its
    kernels for these shapes: its writes must be harmless), then captured into a graph
    whose memory comes from `pool`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph, output


BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, k_cache, v_cache, max_blocks_per_seq: int):
        self.model, self.k_cache, self.v_cache = model, k_cache, v_cache
        dev, size = k_cache.device, BUCKETS[-1]
        self.ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slots = torch.full((size,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=dev)
        self.cu = torch.arange(size + 1, dtype=torch.int32, device=dev)
        # per bucket (decodes, prefill work entries): every row decodes, padding too (it
        # reads a context of length 1); held here, as the graphs read them in place
        self.counts = torch.tensor([[b, 0] for b in BUCKETS], dtype=torch.int32, device=dev)
        self.no_work = torch.zeros(0, 2, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def bucket(n: int) -> int | None:
        return next((b for b in BUCKETS if b >= n), None)

    def run(self, ids: torch.Tensor, step) -> torch.Tensor:
        """Logits (fp32) of a decode step of n <= the largest bucket sequences."""
        n = ids.shape[0]
        b = self.bucket(n)
        self.capture(b)  # before the inputs go in: its warm-up run writes no K/V
        width = step.block_tables.shape[1]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(step.positions)
        self.slots[:n].copy_(step.slot_mapping)
        self.slots[n:b].fill_(-1)
        self.tables[:n, :width].copy_(step.block_tables)
        self.seq_lens[:n].copy_(step.seq_lens)
        self.seq_lens[n:b].fill_(1)
        # padding reads its one token's block: block 0, never one a past step left (the
        # shim's KV pool backs only the blocks in use, and block 0 always)
        self.tables[n:b, 0].zero_()
        self.graphs[b].replay()
        return self.outputs[b][:n]

    def _static_step(self, b: int):
        return StepInputs(
            positions=self.positions[:b],
            slot_mapping=self.slots[:b],
            block_tables=self.tables[:b],
            seq_lens=self.seq_lens[:b],
            cu_seqlens_q=self.cu[: b + 1],
            num_decodes=b,
            counts=self.counts[BUCKETS.index(b)],
            work=self.no_work,
        )

    def capture(self, b: int) -> None:
        if b in self.graphs:
            return
        step = self._static_step(b)
        # the warm-up below runs for real: slots a past step left here are live K/V, and
        # the blocks their tables name may be backed no more (kv_pool.py): each row reads
        # one token of block 0
        self.slots[:b].fill_(-1)
        self.seq_lens[:b].fill_(1)
        self.tables[:b, 0].zero_()
        self.graphs[b], self.outputs[b] = capture_graph(lambda: self._forward(b, step), self.pool)

    def _forward(self, b: int, step) -> torch.Tensor:
        hidden = self.model.hidden_states(self.ids[:b], step, self.k_cache, self.v_cache)
        return self.model.logits(hidden)
