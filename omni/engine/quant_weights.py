"""Weight-only quantized linear layers, loaded from a checkpoint's own `quantization_config`.

DeepSeek-V3 and Kimi K2 ship block-scaled FP8 (`quant_method: fp8` with
`weight_block_size`), Kimi K2.5 INT4 by groups (compressed-tensors "pack-quantized");
kernels/wq.py defines both formats and computes with them. This module says which
scheme a config names (or why it is refused), holds the two layers, and prepares a
state dict's tensors (HF names) for them: which Linears are quantized is read from the
tensors present (`<name>.weight_scale_inv`, `<name>.weight_packed`), so a format's
`ignore` list needs no parsing. Routed experts stack quantized (stack_experts_quantized)
for kernels/moe.py's fused_moe_quantized. What a model cannot run quantized (MLA's
kv_b_proj, which attention reads as a matrix) is dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .checkpoint import CheckpointError
from .kernels import ops
from .kernels.wq import FP8, dequantize_block_fp8, dequantize_int4

FP8_BLOCK, INT4_GROUP = "fp8-block", "int4-group"
# the tensors of a quantized Linear, by scheme (the HF names after "<module>.")
TENSORS = {
    FP8_BLOCK: ("weight", "weight_scale_inv"),
    INT4_GROUP: ("weight_packed", "weight_scale", "weight_shape"),
}
MARKER = {FP8_BLOCK: "weight_scale_inv", INT4_GROUP: "weight_packed"}
MIN_CAPABILITY = (8, 0)  # W8A16 and W4A16: the weights are decoded in the kernel
W8A8_CAPABILITY = (8, 9)  # FP8 tensor cores (Ada, Hopper)


@dataclass(frozen=True)
class WeightScheme:
    """A checkpoint's quantized weights: the kind and its block or group shape."""

    kind: str  # FP8_BLOCK or INT4_GROUP
    block: tuple[int, int] = (128, 128)  # FP8: rows x columns sharing a scale
    group_size: int = 32  # INT4: columns sharing a scale


def scheme_of(config: dict) -> str | None:
    """The kind of a config's quantized weights: FP8_BLOCK, INT4_GROUP or None (no
    quantization_config); CheckpointError names what is not supported."""
    scheme = weight_scheme(config)
    return scheme.kind if scheme else None


def weight_scheme(config: dict, path="config.json") -> WeightScheme | None:
    """The scheme of an HF config's `quantization_config`, with its parameters."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_scheme(q, path)
    if method == "compressed-tensors":
        return _int4_scheme(q, path)
    raise CheckpointError(
        f"{path}: quant_method {method!r} is not supported (block FP8 'fp8' and "
        "'compressed-tensors' pack-quantized INT4 are)"
    )


def _fp8_scheme(q: dict, path) -> WeightScheme:
    block = q.get("weight_block_size")
    if not block:
        raise CheckpointError(f"{path}: FP8 without weight_block_size is not block-scaled")
    bad = {
        "fmt": q.get("fmt", "e4m3") != "e4m3",
        "activation_scheme": q.get("activation_scheme", "dynamic") != "dynamic",
        "weight_block_size": len(block) != 2 or not all(_pow2(b, 16) for b in block),
    }
    if wrong := [f"{k} {q.get(k)!r}" for k, is_bad in bad.items() if is_bad]:
        raise CheckpointError(f"{path}: FP8 {', '.join(wrong)} not supported")
    return WeightScheme(FP8_BLOCK, block=(int(block[0]), int(block[1])))


def _int4_scheme(q: dict, path) -> WeightScheme:
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        raise CheckpointError(f"{path}: compressed-tensors config without config_groups")
    sizes = set()
    for group in groups:
        w = group.get("weights") or {}
        fmt = group.get("format") or q.get("format")
        bad = {
            "format": fmt != "pack-quantized",
            "num_bits": w.get("num_bits") != 4,
            "type": w.get("type") != "int",
            "symmetric": w.get("symmetric") is not True,
            "strategy": w.get("strategy") != "group",
            "group_size": not _pow2(w.get("group_size"), 8),
            "input_activations": bool(group.get("input_activations")),
            "dynamic": bool(w.get("dynamic")),
            "actorder": bool(w.get("actorder")),
        }
        if wrong := [k for k, is_bad in bad.items() if is_bad]:
            shown = ", ".join(f"{k} {w.get(k, group.get(k, fmt))!r}" for k in wrong)
            raise CheckpointError(
                f"{path}: compressed-tensors {shown} not supported (weight-only symmetric "
                "4-bit int by groups, pack-quantized)"
            )
        sizes.add(int(w["group_size"]))
    if len(sizes) > 1:
        raise CheckpointError(f"{path}: several INT4 group sizes {sorted(sizes)}")
    return WeightScheme(INT4_GROUP, group_size=sizes.pop())


def _pow2(v, least: int) -> bool:
    return isinstance(v, int) and v >= least and v & (v - 1) == 0


def gpu_problem(scheme: WeightScheme, capability: tuple[int, int], w8a8=False) -> str | None:
    """Why a GPU of this compute capability cannot run the scheme (None: it can). The
    kernels here are W8A16/W4A16 (from 8.0); FP8 activations (W8A8) would need 8.9."""
    need = W8A8_CAPABILITY if w8a8 and scheme.kind == FP8_BLOCK else MIN_CAPABILITY
    if tuple(capability) >= need:
        return None
    what = "W8A8" if need == W8A8_CAPABILITY else f"{scheme.kind} weight-only"
    return (
        f"{what} needs compute capability {need[0]}.{need[1]} or newer; this GPU has "
        f"{capability[0]}.{capability[1]}"
    )


class BlockFP8Linear(nn.Module):
    """A Linear whose weight is e4m3 with one scale per block (the HF names: `weight`,
    `weight_scale_inv`), multiplied by `ops(device).block_fp8_linear`."""

    def __init__(self, in_features, out_features, block=(128, 128), bias=False, device=None):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=FP8, device=device)
        )
        self.register_buffer("weight_scale_inv", torch.empty(rows, cols, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops(x.device).block_fp8_linear(
            x, self.weight, self.weight_scale_inv, self.bias, self.block
        )


class Int4Linear(nn.Module):
    """A Linear whose weight is packed int4 with one scale per group of inputs (the
    compressed-tensors names), multiplied by `ops(device).int4_linear`."""

    def __init__(self, in_features, out_features, group_size=32, bias=False, device=None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        words, groups = -(-in_features // 8), -(-in_features // group_size)
        i32 = {"dtype": torch.int32, "device": device}
        self.register_buffer("weight_packed", torch.empty(out_features, words, **i32))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, device=device))
        self.register_buffer("weight_shape", torch.empty(2, dtype=torch.int64, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops(x.device).int4_linear(
            x, self.weight_packed, self.weight_scale, self.bias, self.group_size
        )


def cast_state(state: dict, dtype: torch.dtype) -> None:
    """Floating tensors to `dtype` in place, but quantized weights as stored and their
    scales in fp32 (DeepSeek's scale_inv would lose bits in bf16)."""
    for name, t in state.items():
        if not t.is_floating_point() or t.dtype == FP8:
            continue
        scale = name.endswith(("weight_scale", "weight_scale_inv"))
        state[name] = t.float() if scale else t.to(dtype)


def is_quantized(state: dict, prefix: str, scheme: WeightScheme | None) -> bool:
    """Whether the Linear `prefix` ("model.layers.0.mlp.down_proj") is stored quantized."""
    return scheme is not None and f"{prefix}.{MARKER[scheme.kind]}" in state


def dequantize_linear(state: dict, prefix: str, scheme: WeightScheme, dtype) -> None:
    """Replace a quantized Linear's tensors by its dense `weight` in `dtype`, in place."""
    if not is_quantized(state, prefix, scheme):
        return
    t = {n: state.pop(f"{prefix}.{n}") for n in TENSORS[scheme.kind]}
    if scheme.kind == FP8_BLOCK:
        w = dequantize_block_fp8(t["weight"], t["weight_scale_inv"], scheme.block)
    else:
        in_features = int(t["weight_shape"][1])
        w = dequantize_int4(t["weight_packed"], t["weight_scale"], in_features, scheme.group_size)
    state[f"{prefix}.weight"] = w.to(dtype)


def dequantize_where(state: dict, scheme: WeightScheme | None, dtype, keep) -> None:
    """Dequantize every quantized Linear whose name `keep(name)` refuses."""
    if scheme is None:
        return
    suffix = "." + MARKER[scheme.kind]
    for name in [n for n in state if n.endswith(suffix)]:
        prefix = name.removesuffix(suffix)
        if not keep(prefix):
            dequantize_linear(state, prefix, scheme, dtype)


def stack_linears(state: dict, parts: list[str], into: str, scheme, dtype) -> None:
    """Stack the Linears `parts` along their outputs into one Linear `into` (weights only):
    quantized where all are and the blocks line up (FP8: every part but the last a whole
    number of row blocks), else dequantized."""
    quantized = all(is_quantized(state, p, scheme) for p in parts)
    if quantized and scheme.kind == FP8_BLOCK:
        rows = [state[f"{p}.weight"].shape[0] for p in parts[:-1]]
        quantized = all(r % scheme.block[0] == 0 for r in rows)
    if not quantized:
        for p in parts:
            dequantize_linear(state, p, scheme, dtype)
        state[f"{into}.weight"] = torch.cat([state.pop(f"{p}.weight") for p in parts])
        return
    for n in TENSORS[scheme.kind]:
        tensors = [state.pop(f"{p}.{n}") for p in parts]
        if n == "weight_shape":
            rows = sum(int(t[0]) for t in tensors)
            state[f"{into}.{n}"] = torch.tensor([rows, int(tensors[0][1])])
        else:
            state[f"{into}.{n}"] = torch.cat(tensors)


EXPERT_STACKS = ("gate_up", "gate_up_scale", "down", "down_scale")


def stack_experts_quantized(
    state: dict, experts: list[tuple[str, str, str]], into: str, scheme, path="state"
) -> bool:
    """Stack each expert's (gate, up, down) Linears, as stored, into `into`'s tensors
    EXPERT_STACKS (kernels/moe.py fused_moe_quantized's layouts: each expert's gate then
    up rows, their scales likewise); False, and `state` untouched, where any of them is
    not quantized. INT4's weight_shape is checked and dropped."""
    names = [p for parts in experts for p in parts]
    if not all(is_quantized(state, p, scheme) for p in names):
        return False
    weight, scale = TENSORS[scheme.kind][:2]
    if scheme.kind == INT4_GROUP:
        _check_expert_shapes(state, experts, path)
    gate_up, gate_up_scale, down, down_scale = [], [], [], []
    for gate, up, down_proj in experts:
        gate_up.append(torch.cat([state.pop(f"{gate}.{weight}"), state.pop(f"{up}.{weight}")]))
        gate_up_scale.append(torch.cat([state.pop(f"{gate}.{scale}"), state.pop(f"{up}.{scale}")]))
        down.append(state.pop(f"{down_proj}.{weight}"))
        down_scale.append(state.pop(f"{down_proj}.{scale}"))
    stacks = (gate_up, gate_up_scale, down, down_scale)
    for name, tensors in zip(EXPERT_STACKS, stacks, strict=True):
        state[f"{into}.{name}"] = torch.stack(tensors)
    return True


def _check_expert_shapes(state: dict, experts: list[tuple[str, str, str]], path) -> None:
    """Every INT4 expert's gate and up [I, hidden], its down [hidden, I] (weight_shape,
    which the packed words round up), then the weight_shape tensors dropped."""
    want = [int(v) for v in state[f"{experts[0][0]}.weight_shape"]]
    for parts in experts:
        for p, shape in zip(parts, (want, want, want[::-1]), strict=True):
            got = [int(v) for v in state.pop(f"{p}.weight_shape")]
            if got != shape:
                raise CheckpointError(f"{path}: {p} has weight_shape {got}, expected {shape}")


def permute_rows(state: dict, prefix: str, order: torch.Tensor, scheme, dtype) -> None:
    """Reorder a Linear's output rows (weight and bias): row i takes row order[i]. FP8
    rows move as they are where each stays in its scale block, else dequantized."""
    if is_quantized(state, prefix, scheme) and scheme.kind == FP8_BLOCK:
        home = torch.arange(len(order)) // scheme.block[0]
        if not torch.equal(order // scheme.block[0], home):
            dequantize_linear(state, prefix, scheme, dtype)
    if is_quantized(state, prefix, scheme):
        names = ("weight",) if scheme.kind == FP8_BLOCK else ("weight_packed", "weight_scale")
    else:
        names = ("weight",)
    for n in (*names, "bias"):
        if (name := f"{prefix}.{n}") in state:
            state[name] = state[name][order]


def quantize_modules(model: nn.Module, state: dict, scheme: WeightScheme | None) -> None:
    """Swap each Linear (nn.Linear) of `model` whose tensors `state` holds quantized for
    the scheme's layer, on the Linear's device."""
    if scheme is None:
        return
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not is_quantized(state, name, scheme):
            continue
        shape = (module.in_features, module.out_features)
        kw = {"bias": module.bias is not None, "device": module.weight.device}
        if scheme.kind == FP8_BLOCK:
            layer: nn.Module = BlockFP8Linear(*shape, block=scheme.block, **kw)
        else:
            layer = Int4Linear(*shape, group_size=scheme.group_size, **kw)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
