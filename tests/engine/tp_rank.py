"""One rank of a tensor-parallel test run, in its own process (spawned: kept light)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from omni.engine.block_manager import BlockManager
from omni.engine.checkpoint import Checkpoint
from omni.engine.llama import LlamaForCausalLM
from omni.engine.model_runner import ModelRunner
from omni.engine.scheduler import Batch
from omni.engine.sequence import Sequence


def greedy_steps(model, prompts: list[list[int]], steps: int):
    """Prompts prefilled in one mixed step, then greedy decode steps: (tokens per step,
    logits per step)."""
    runner = ModelRunner(model, block_size=16, num_blocks=32)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seqs = [Sequence(token_ids=list(p)) for p in prompts]
    for seq in seqs:
        blocks.allocate(seq)
    batch, tokens, logits = Batch(seqs, [len(p) for p in prompts]), [], []
    for _ in range(steps):
        out = runner.run(batch).float()
        chosen = [int(row.argmax()) for row in out]
        tokens.append(chosen)
        logits.append(out)
        for seq, n, token in zip(seqs, batch.num_tokens, chosen, strict=True):
            seq.num_computed += n
            seq.token_ids.append(token)
            blocks.append_slot(seq)
        batch = Batch(seqs, [1] * len(seqs))
    return tokens, logits


def run_rank(rank: int, tp: int, ckpt: str, prompts, steps: int, init_file: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    try:
        torch.set_num_threads(1)
        model = LlamaForCausalLM.load(Checkpoint.open(Path(ckpt)), tp=tp, tp_rank=rank)
        tokens, logits = greedy_steps(model, prompts, steps)
        if rank == 0:
            # (as numpy: a tensor would travel as a shared-memory handle, gone when this
            # process exits before the parent reads it)
            arrays = [x.numpy() for x in logits]
            out.put((tokens, arrays, model.model.embed_tokens.num_embeddings))
    finally:
        dist.destroy_process_group()


def serve_rank(rank: int, tp: int, ckpt: str, prompts, init_file: str, out) -> None:
    """Rank 0 serves `prompts` with an Engine (greedy, and one seeded sampled request);
    the other ranks follow its runner."""
    from omni.engine.engine import Engine
    from omni.engine.model_runner import ModelRunner
    from omni.engine.sampling import SamplingParams
    from omni.engine.tokenizer import TextTokenizer
    from omni.engine.tp_runner import follow

    from .runs import run_requests, tokens

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    try:
        torch.set_num_threads(1)
        checkpoint = Checkpoint.open(Path(ckpt))
        model = LlamaForCausalLM.load(checkpoint, tp=tp, tp_rank=rank)
        if rank:
            follow(ModelRunner(model, ENGINE["block_size"], ENGINE["num_blocks"]))
            return
        engine = Engine(model, TextTokenizer(checkpoint), **ENGINE)
        try:
            out.put(serve(engine, prompts, run_requests, tokens, SamplingParams))
        finally:
            engine.shutdown()
    finally:
        dist.destroy_process_group()


# small pool and step budget: chunked prompts, mixed steps, prefix-cache hits
ENGINE = {"block_size": 8, "num_blocks": 40, "max_batch_tokens": 24}


def serve(engine, prompts, run_requests, tokens, SamplingParams) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    results = run_requests(engine, prompts, greedy)
    results += run_requests(engine, prompts[:1], sampled)
    results += run_requests(engine, prompts[:1], greedy)  # its prefix is cached now
    return [tokens(r) for r in results]
