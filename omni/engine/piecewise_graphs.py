"""CUDA graphs for steps that are not decode-only: prompt chunks, alone or beside decodes.

A decode step is one graph (cuda_graphs.py), but attention's launch in a mixed step
depends on its sequences (how many, the longest query), which a graph cannot hold. The
rest of a layer works token by token: per token-count bucket, the work from one layer's
attention output to the next layer's queries (o proj, the norms, the MLP, q/k/v, rope
and the cache write) is captured as one graph, and attention runs eagerly between two
replays: 33 replays and 32 attention launches a step instead of ~400 launches, whose
host time (30-50 ms on the H100 host) made a mixed step of a few hundred tokens take
three times its GPU time.

The step's tokens are padded to the bucket: padding tokens write no K/V (slot -1), skip
attention (it runs on the real tokens only), and their rows of the token-wise layers are
dropped; each row of those kernels depends on its own input only, so no real token's
result changes by a bit (the engine's batch invariance).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

# Up to 1,024 tokens: from there a step's GPU time (~27 ms on the H100) outlasts its eager
# launches, and padding would add compute-bound rows.
BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024)


class PiecewiseGraphs:
    def __init__(self, model, k_cache: torch.Tensor, v_cache: torch.Tensor):
        self.model, self.k_cache, self.v_cache = model, k_cache, v_cache
        cfg, dev, size = model.cfg, k_cache.device, BUCKETS[-1]
        dtype = model.lm_head.weight.dtype
        self.ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slots = torch.full((size,), -1, dtype=torch.int64, device=dev)
        # what passes between pieces: one buffer each, shared by every layer and bucket
        self.queries = torch.zeros(size, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.attended = torch.zeros_like(self.queries)
        self.residual = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros_like(self.residual)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.steps = 0  # run through the graphs

    @staticmethod
    def bucket(n: int) -> int | None:
        return next((b for b in BUCKETS if b >= n), None)

    def captured(self, n: int) -> bool:
        """Whether a step of n tokens has its bucket's graphs. A bucket is captured by the
        engine's warm-up (idle time), never by a step: its 33 captures take a fraction of
        a second, which the step's eager launches (tens of ms) do not."""
        return self.bucket(n) in self.graphs

    def run(self, ids: torch.Tensor, step) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a step whose bucket is captured (a view
        into a buffer the next step overwrites)."""
        n = ids.shape[0]
        b = self.bucket(n)
        self.steps += 1
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(step.positions)
        self.slots[:n].copy_(step.slot_mapping)
        self.slots[n:b].fill_(-1)
        pieces = self.graphs[b]
        for layer, piece in zip(self.model.model.layers, pieces, strict=False):
            piece.replay()  # up to this layer's queries
            layer.self_attn.attend(
                self.queries[:n], step, self.k_cache, self.v_cache, out=self.attended[:n]
            )
        pieces[-1].replay()  # the last layer's end and the final norm
        return self.hidden[:n]

    def capture(self, b: int) -> None:
        if b in self.graphs:
            return
        pieces = self._pieces(b)
        # the warm-up below runs for real: slots a past step left here are live K/V
        self.slots[:b].fill_(-1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: compiles the kernels for these shapes
            for piece in pieces:
                piece()
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for piece in pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                piece()  # its temporaries go back to the pool: the next piece reuses them
            graphs.append(graph)
        self.graphs[b] = graphs

    def _pieces(self, b: int) -> list:
        """The bucket's pieces, each a function of the static buffers."""
        model, layers = self.model, self.model.model.layers
        step = SimpleNamespace(positions=self.positions[:b], slot_mapping=self.slots[:b])
        caches = (self.k_cache, self.v_cache, model.inv_freq)

        def first() -> None:
            x = model.model.embed_tokens(self.ids[:b])
            self._keep(b, *layers[0].query(x, None, step, *caches))

        def between(i: int):
            def piece() -> None:
                x, residual = layers[i - 1].finish(self.attended[:b], self.residual[:b])
                self._keep(b, *layers[i].query(x, residual, step, *caches))

            return piece

        def last() -> None:
            x, residual = layers[-1].finish(self.attended[:b], self.residual[:b])
            hidden, _ = model.model.norm(x, residual)
            self.hidden[:b].copy_(hidden)

        return [first, *(between(i) for i in range(1, len(layers))), last]

    def _keep(self, b: int, queries: torch.Tensor, residual: torch.Tensor) -> None:
        self.queries[:b].copy_(queries)
        self.residual[:b].copy_(residual)
