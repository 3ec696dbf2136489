"""One rank of a tensor-parallel test run, in its own process (spawned: kept light)."""

from __future__ import annotations

from pathlib import Path

import torch

from omni.engine.checkpoint import Checkpoint
from omni.engine.llama import LlamaForCausalLM
from omni.engine.model_runner import ModelRunner
from omni.engine.models import load_model
from omni.engine.sampling import SamplingParams
from omni.engine.tensor_parallel import join, leave
from omni.testing.runs import greedy_steps, run_requests, tokens


def run_rank(
    rank: int, tp: int, ckpt: str, prompts, steps: int, experts: bool, init_file: str, out
) -> None:
    join(rank, tp, f"file://{init_file}", on_gpu=False)
    try:
        torch.set_num_threads(1)
        ckpt = Checkpoint.open(Path(ckpt))
        model = load_model(ckpt, tp=tp, tp_rank=rank, experts=experts)  # (by architecture)
        tokens, logits = greedy_steps(model, prompts, steps)
        if rank == 0:
            # (as numpy: a tensor would travel as a shared-memory handle, gone when this
            # process exits before the parent reads it)
            arrays = [x.numpy() for x in logits]
            moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
            held = moe[0].experts.gate_up.shape[:2] if moe else None  # the first MoE layer's
            out.put((tokens, arrays, model.model.embed_tokens.num_embeddings, held))
    finally:
        leave()


def serve_rank(rank: int, tp: int, ckpt: str, prompts, init_file: str, out) -> None:
    """Rank 0 serves `prompts` with an Engine (greedy, and one seeded sampled request);
    the other ranks follow its runner."""
    from omni.engine.engine import Engine
    from omni.engine.tokenizer import TextTokenizer
    from omni.engine.tp_runner import follow

    join(rank, tp, f"file://{init_file}", on_gpu=False)
    try:
        torch.set_num_threads(1)
        checkpoint = Checkpoint.open(Path(ckpt))
        model = LlamaForCausalLM.load(checkpoint, tp=tp, tp_rank=rank)
        if rank:
            follow(ModelRunner(model, ENGINE["block_size"], ENGINE["num_blocks"]))
            return
        engine = Engine(model, TextTokenizer(checkpoint), **ENGINE)
        try:
            out.put(serve(engine, prompts))
        finally:
            engine.shutdown()
    finally:
        leave()


# small pool and step budget: chunked prompts, mixed steps, prefix-cache hits
ENGINE = {"block_size": 8, "num_blocks": 40, "max_batch_tokens": 24}


def serve(engine, prompts) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    results = run_requests(engine, prompts, greedy)
    results += run_requests(engine, prompts[:1], sampled)
    results += run_requests(engine, prompts[:1], greedy)  # its prefix is cached now
    return [tokens(r) for r in results]


def gpu_rank(rank: int, tp: int, ckpt: str, prompts, steps: int, forced, init_file: str, out):
    """On GPU `rank` (NCCL between the GPUs), bf16: the greedy steps along `forced`'s
    tokens (rank 0 puts its logits), then an Engine with CUDA graphs (all-reduces captured)
    serving `prompts` (rank 0 puts what `serve` returns)."""
    from omni.engine.engine import Engine
    from omni.engine.tokenizer import TextTokenizer
    from omni.engine.tp_runner import follow

    join(rank, tp, f"file://{init_file}", on_gpu=True)
    try:
        checkpoint = Checkpoint.open(Path(ckpt))
        model = LlamaForCausalLM.load(checkpoint, f"cuda:{rank}", torch.bfloat16, tp, rank)
        _, logits = greedy_steps(model, prompts, steps, forced)
        if rank:
            follow(ModelRunner(model, ENGINE["block_size"], ENGINE["num_blocks"]))
            return
        engine = Engine(model, TextTokenizer(checkpoint), **ENGINE)
        try:
            engine.warm_up(graphs=True)
            out.put(([x.numpy() for x in logits], serve(engine, prompts)))
        finally:
            engine.shutdown()
    finally:
        leave()
