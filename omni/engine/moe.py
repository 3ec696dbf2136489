"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts.

The block replaces a decoder layer's dense MLP; attention, norms, the KV cache, batching
and sampling stay the Llama family's (llama.py). Experts are stacked at load: one
[experts, 2 x intermediate, hidden] gate/up tensor and one [experts, hidden,
intermediate] down tensor, the layout a grouped matmul reads.

The experts' sums are `ops.fused_moe` (kernels/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .checkpoint import CheckpointError
from .kernels import ops
from .kernels.router import route_ref
from .layers import Linear
from .tensor_parallel import rank


@dataclass(frozen=True)
class MoEConfig:
    experts: int
    per_token: int  # top-k
    intermediate: int  # each expert's
    renormalize: bool  # the top-k weights rescaled to sum to 1
    dense_layers: frozenset[int] = frozenset()  # layers that keep a dense MLP
    expert_parallel: int = 1  # ranks the experts are shared out over (each holds a run)

    @property
    def local_experts(self) -> int:
        """The experts one rank holds: all of them, or its share under expert parallelism."""
        return self.experts // self.expert_parallel


# per family: the router's and each expert's gate, up and down names in the checkpoint
CHECKPOINT_NAMES = {
    "mixtral": (
        "block_sparse_moe.gate",
        "block_sparse_moe.experts.{e}.w1",
        "block_sparse_moe.experts.{e}.w3",
        "block_sparse_moe.experts.{e}.w2",
    ),
    "qwen3_moe": (
        "mlp.gate",
        "mlp.experts.{e}.gate_proj",
        "mlp.experts.{e}.up_proj",
        "mlp.experts.{e}.down_proj",
    ),
}
CHECKPOINT_NAMES["deepseek_v3"] = CHECKPOINT_NAMES["qwen3_moe"]  # (deepseek_v3.py)


def moe_config(model_type: str, c: dict) -> MoEConfig | None:
    """The MoE part of an HF config.json, or None for a dense model."""
    if model_type == "mixtral":
        return MoEConfig(
            experts=int(c["num_local_experts"]),
            per_token=int(c["num_experts_per_tok"]),
            intermediate=int(c["intermediate_size"]),
            renormalize=True,
        )
    if model_type == "qwen3_moe":
        layers, step = int(c["num_hidden_layers"]), int(c.get("decoder_sparse_step") or 1)
        dense = set(c.get("mlp_only_layers") or ()) | {
            i for i in range(layers) if (i + 1) % step != 0
        }
        return MoEConfig(  # transformers 5 writes num_local_experts, the Hub's num_experts
            experts=int(c["num_experts"] if "num_experts" in c else c["num_local_experts"]),
            per_token=int(c["num_experts_per_tok"]),
            intermediate=int(c["moe_intermediate_size"]),
            renormalize=bool(c.get("norm_topk_prob", False)),
            dense_layers=frozenset(dense),
        )
    return None


route = route_ref  # the definition (kernels/router.py); the GPU path runs ops.router


class Experts(nn.Module):
    def __init__(self, moe: MoEConfig, hidden: int, device=None):
        super().__init__()
        e, inter = moe.local_experts, moe.intermediate
        self.gate_up = nn.Parameter(torch.empty(e, 2 * inter, hidden, device=device))
        self.down = nn.Parameter(torch.empty(e, hidden, inter, device=device))


class SparseMoE(nn.Module):
    """A decoder layer's MLP as routed experts."""

    def __init__(self, moe: MoEConfig, hidden: int, device=None):
        super().__init__()
        self.moe = moe
        self.gate = Linear(hidden, moe.experts, bias=False, device=device)  # the router's weight
        self.experts = Experts(moe, hidden, device)

    def forward(self, x: torch.Tensor, summed: bool = True) -> torch.Tensor:
        """[tokens, hidden]; `summed=False`: each token's k weighted expert outputs [tokens,
        k, hidden] in fp32, which the next RMS norm adds up (one kernel fewer a layer)."""
        kernels = ops(x.device)
        weights, ids = kernels.router(x, self.gate.weight, self.moe.per_token, self.moe.renormalize)
        experts, partial = self.experts, self.moe.expert_parallel > 1
        if partial:  # this rank's experts only; the layer's all-reduce adds the others'
            ids = local_ids(ids, rank() * self.moe.local_experts, self.moe.local_experts)
        return kernels.fused_moe(x, experts.gate_up, experts.down, weights, ids, partial, summed)


def local_ids(ids: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Routed expert ids as indexes into a rank's run of `n` experts from `first`; `n` (no
    expert of this rank's) for the others, whose slots then add nothing here."""
    local = ids - first
    return torch.where((local >= 0) & (local < n), local, n)


def stack_experts(state: dict, model_type: str, moe: MoEConfig, layers: int, path) -> None:
    """Rename each MoE layer's router and stack its experts' tensors (in place), one layer
    at a time; CheckpointError names a missing one."""
    router, gate, up, down = CHECKPOINT_NAMES[model_type]

    def take(name: str) -> torch.Tensor:
        try:
            return state.pop(name + ".weight")
        except KeyError:
            raise CheckpointError(f"{path}: missing tensors ['{name}.weight']") from None

    for i in range(layers):
        if i in moe.dense_layers:
            continue
        prefix = f"model.layers.{i}."
        state[prefix + "mlp.gate.weight"] = take(prefix + router)
        pairs = [
            torch.cat([take(prefix + gate.format(e=e)), take(prefix + up.format(e=e))])
            for e in range(moe.local_experts)
        ]
        state[prefix + "mlp.experts.gate_up"] = torch.stack(pairs)
        del pairs
        downs = [take(prefix + down.format(e=e)) for e in range(moe.local_experts)]
        state[prefix + "mlp.experts.down"] = torch.stack(downs)
