"""One model over several ranks (GPUs, or CPU processes in tests): tensor parallelism.

Each rank holds a slice of every layer (Megatron's split):
- attention: its share of the query heads and of the KV heads (and of the KV cache),
  q/k/v column-parallel, o_proj row-parallel;
- MLP: its share of the intermediate width, gate/up column-parallel, down row-parallel
  (for mixtures of experts, every expert's intermediate width: each rank holds a slice of
  every expert, and the router is replicated);
- embedding and lm head: its share of the vocabulary.

With expert parallelism (`experts=True`, for mixtures of experts), each rank holds a run
of whole experts instead of a slice of every one: rank r the experts from r * E / tp. A
token's slots routed to other ranks' experts add nothing on this rank, and the all-reduce
after the layer adds every rank's part, as it adds the slices' partial sums under tensor
parallelism. Attention (and any dense MLP layer) is split as above either way.

A row-parallel layer's outputs are partial sums, added across ranks by an all-reduce
(`torch.distributed`: NCCL on GPUs, gloo on the CPU); the lm head's slices of the logits
are gathered. Norms, rope and sampling run replicated. On GPUs, the all-reduces are
captured in the CUDA graphs like any kernel; rank 0's per-step messages to the others
(tp_runner.py) go over a second, gloo group, host to host, so that telling the other
ranks what to run never waits for a GPU.

The sharded model's config (shard_config) says what one rank holds: its heads, KV heads,
intermediate widths, with `tp` the number of ranks; `vocab_size` stays the whole
vocabulary (embedding and lm head hold vocab_size // tp rows each).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist

from .checkpoint import CheckpointError


def check_splits(need: dict[str, int], tp: int) -> None:
    """CheckpointError naming each of a model's sizes (`need`: what, how many) that `tp`
    ranks cannot share evenly."""
    odd = [f"{what} ({n})" for what, n in need.items() if n % tp]
    if odd:
        raise CheckpointError(f"cannot split over {tp} ranks: {', '.join(odd)} not divisible")


def shard_config(cfg, tp: int, experts: bool = False):
    """The config of one rank's shard of `cfg` (a LlamaConfig) over `tp` ranks; `experts`:
    a mixture of experts shares its experts out (expert parallelism)."""
    if experts and cfg.moe is None:
        raise CheckpointError("expert parallelism needs a mixture of experts")
    if tp == 1:
        return cfg
    need = {
        "attention heads": cfg.num_heads,
        "KV heads": cfg.num_kv_heads,
        "intermediate size": cfg.intermediate_size,
        "vocabulary": cfg.vocab_size,
    }
    if experts:
        need["experts"] = cfg.moe.experts
    elif cfg.moe is not None:
        need["experts' intermediate size"] = cfg.moe.intermediate
    check_splits(need, tp)
    if experts:
        moe = dataclasses.replace(cfg.moe, expert_parallel=tp)
    else:
        moe = cfg.moe and dataclasses.replace(cfg.moe, intermediate=cfg.moe.intermediate // tp)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=cfg.num_kv_heads // tp,
        intermediate_size=cfg.intermediate_size // tp,
        moe=moe,
        tp=tp,
    )


# How each checkpoint tensor is split: by output rows ("rows"), by input columns ("cols");
# anything else (norms, routers) is replicated. Names as in HF checkpoints, per layer.
_SPLITS = (
    ("self_attn.q_proj.", "rows"),
    ("self_attn.q_b_proj.", "rows"),  # DeepSeek-V3's MLA: q's and kv_b's rows by head
    ("self_attn.kv_b_proj.", "rows"),
    ("self_attn.k_proj.", "rows"),
    ("self_attn.v_proj.", "rows"),
    ("self_attn.o_proj.weight", "cols"),
    ("mlp.gate_proj.", "rows"),
    ("mlp.up_proj.", "rows"),
    ("mlp.down_proj.weight", "cols"),
    (".gate_proj.weight", "rows"),  # qwen3_moe experts
    (".up_proj.weight", "rows"),
    (".down_proj.weight", "cols"),
    (".w1.weight", "rows"),  # mixtral experts: gate, up, down
    (".w3.weight", "rows"),
    (".w2.weight", "cols"),
    ("model.embed_tokens.weight", "rows"),
    ("lm_head.weight", "rows"),
)


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _split_of(name: str) -> str | None:
    """How a checkpoint tensor is split: "rows", "cols", or None (replicated)."""
    return next((how for key, how in _SPLITS if key in name), None)


def _owned(name: str, rank: int, tp: int, experts: int) -> int | None:
    """Under expert parallelism, this rank's index of the expert `name` belongs to (its
    runs of experts // tp), or None: another rank's."""
    per_rank = experts // tp
    e = int(_EXPERT.search(name).group(1)) - rank * per_rank
    return e if 0 <= e < per_rank else None


def shard_state(
    state: dict[str, torch.Tensor], rank: int, tp: int, experts: int = 0, rows_read: bool = False
) -> None:
    """Keep this rank's slice of every split tensor of a checkpoint's state (HF names), in
    place. Each slice is a copy: the whole tensor is freed (and the kernels want slices
    along the input columns contiguous). `experts`: the model's number of experts, shared
    out whole (expert parallelism): this rank keeps its run, renumbered from 0.
    `rows_read`: the state was read with rank_rows (row-split tensors hold their rows)."""
    if tp == 1:
        return
    if experts:  # all out first: a new name may be one still to be read (experts.36)
        moved = {n: state.pop(n) for n in [n for n in state if _EXPERT.search(n)]}
        for name, t in moved.items():
            e = _owned(name, rank, tp, experts)
            if e is not None:
                state[_EXPERT.sub(f".experts.{e}.", name, count=1)] = t
    for name in list(state):
        if experts and _EXPERT.search(name):
            continue
        how = _split_of(name)
        if how is None or (how == "rows" and rows_read):
            continue
        t = state[name]
        dim = 0 if how == "rows" else t.dim() - 1
        size = t.shape[dim] // tp
        state[name] = t.narrow(dim, rank * size, size).clone(memory_format=torch.contiguous_format)


def rank_rows(rank: int, tp: int, experts: int = 0):
    """What rank `rank` reads of each checkpoint tensor (safetensors_reader.RowSelect):
    its run of rows where a tensor is split by rows, nothing of other ranks' experts
    (expert parallelism), all of the rest (column slices are cut after the read). A rank
    then reads about its share of the file, not all of it."""

    def rows(name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
        if experts and _EXPERT.search(name):
            return None if _owned(name, rank, tp, experts) is None else (0, shape[0])
        if _split_of(name) == "rows":
            size = shape[0] // tp
            return (rank * size, size)
        return (0, shape[0])

    return rows


def all_reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    """The sum over the ranks of their partial `x` (in place); `x` itself at tp == 1."""
    if tp > 1:
        dist.all_reduce(x)
    return x


def embed(table: torch.nn.Embedding, input_ids: torch.Tensor, tp: int) -> torch.Tensor:
    """Token embeddings; split over ranks, each looks up the ids in its share of the
    vocabulary (zeros elsewhere) and the shares are summed."""
    if tp == 1:
        return table(input_ids)
    rows = table.num_embeddings
    local = input_ids - rank() * rows
    mine = (local >= 0) & (local < rows)
    x = table(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(table.weight.dtype)
    return all_reduce(x, tp)


def all_gather_last(x: torch.Tensor, tp: int) -> torch.Tensor:
    """The ranks' slices of `x`'s last dimension, concatenated in rank order."""
    if tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


_control: dist.ProcessGroup | None = None


def join(rank: int, tp: int, init_method: str, on_gpu: bool) -> None:
    """Join this process to the instance's `tp` ranks as `rank`: GPU `rank` of those it
    sees, NCCL between the GPUs (gloo on the CPU), and a gloo group for rank 0's messages."""
    global _control
    if on_gpu:
        torch.cuda.set_device(rank)
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp)
    _control = dist.new_group(backend="gloo") if on_gpu else dist.group.WORLD


def control_group() -> dist.ProcessGroup | None:
    """The group rank 0's step messages travel in (host memory, never a GPU)."""
    return _control


def leave() -> None:
    global _control
    if dist.is_initialized():
        dist.destroy_process_group()
    _control = None
