"""A model runner split over ranks: rank 0 leads, the others follow.

Rank 0 runs the engine: scheduling, sampling, streaming. Its runner tells the other
ranks, in order, each thing it does with the model: a step (its host inputs, and the
last step's sampled tokens where the step's inputs take them from the device), a copy
of KV blocks (a fork), a piece of warm-up (CUDA graph captures must happen on all ranks
at once: their all-reduces are captured too), the end. The other ranks run `follow`:
the same calls on their shard, in the same order, so every collective meets its peers.
Messages go by `torch.distributed.broadcast_object_list` from rank 0, in the control
group (gloo: host to host); the previous step's tokens, which stay on the GPU, by a
broadcast in the model's group (NCCL on GPUs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .model_runner import ModelRunner
from .step import Prepared
from .tensor_parallel import control_group


def _tell(message: tuple) -> None:
    dist.broadcast_object_list([message], src=0, group=control_group())


def _hear() -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


class LeaderRunner(ModelRunner):
    """Rank 0's runner: each call also goes to the other ranks."""

    def run_inputs(
        self, inputs: Prepared, previous_tokens: torch.Tensor | None, all_logits: bool = False
    ) -> torch.Tensor:
        sends = inputs.placeholders is not None
        _tell(("run", inputs.host, all_logits, previous_tokens.shape[0] if sends else None))
        if sends:
            dist.broadcast(previous_tokens, src=0)
        return super().run_inputs(inputs, previous_tokens, all_logits)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            _tell(("copy", pairs))
        super().copy_blocks(pairs)

    def warm_up_tasks(self, max_seqs: int, max_batch_tokens: int, graphs: bool = True):
        tasks = super().warm_up_tasks(max_seqs, max_batch_tokens, graphs)

        def told(i: int, task):
            def run() -> None:
                _tell(("warm", max_seqs, max_batch_tokens, graphs, i))
                task()

            return run

        return [told(i, task) for i, task in enumerate(tasks)]

    def close(self) -> None:
        _tell(("stop",))


def follow(runner: ModelRunner) -> None:
    """Ranks > 0: do what rank 0's runner does, on this rank's shard, until it stops."""
    while True:
        kind, *args = _hear()
        if kind == "run":
            host, all_logits, previous_rows = args
            previous = None
            if previous_rows is not None:
                previous = torch.empty(previous_rows, dtype=torch.int64, device=runner.device)
                dist.broadcast(previous, src=0)
            runner.run_inputs(runner.upload(host), previous, all_logits)
        elif kind == "copy":
            runner.copy_blocks(args[0])
        elif kind == "warm":
            max_seqs, max_batch_tokens, graphs, i = args
            runner.warm_up_tasks(max_seqs, max_batch_tokens, graphs)[i]()
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown message from rank 0: {kind!r}")
