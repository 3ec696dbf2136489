"""The experts of a mixture-of-experts layer over a step's tokens.

`fused_moe_ref` is the pure-torch definition the CPU path runs (and, until the Triton
kernel lands, the GPU path): each token's output is the sum, in fp32 and in the order of
its top-k slots, of its experts' outputs times their routing weights, so it never
depends on which other tokens share the step.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def fused_moe_ref(x, gate_up, down, weights, ids) -> torch.Tensor:
    """sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), e = ids[t, j].

    x [tokens, hidden]; gate_up [experts, 2I, hidden]; down [experts, hidden, I]. Tokens are
    grouped by expert (one matmul per expert that has any), each (token, slot) result kept
    apart, then summed per token in slot order in fp32."""
    tokens, k = ids.shape
    slots = torch.zeros(tokens * k, x.shape[-1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        rows = order[start : start + n]
        start += n
        h = x[rows // k] @ gate_up[expert].T
        gate, up = h.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(x.dtype)
        slots[rows] = (act @ down[expert].T).float()
    slots = slots.view(tokens, k, -1) * weights.float().unsqueeze(-1)
    return slots.sum(dim=1).to(x.dtype)
