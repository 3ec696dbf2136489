"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) in one readable file.

Module names follow the HF checkpoints, so a state dict loads as it is. The
paged KV cache and the step's metadata (positions, slots, block tables) come
from the model runner; on CUDA the layers run the Triton kernels, elsewhere
their pure-torch references: one switch, `kernels.ops`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from . import safetensors_reader
from .checkpoint import Checkpoint, CheckpointError
from .fp8 import (
    METHODS,
    Fp8Linear,
    check_device,
    checkpoint_quantization,
    normalize_scales,
    quantize_projections,
)
from .kernels import ops, paged_attention_ref, paged_decode, paged_prefill
from .kernels.prewarm import prewarm_triton
from .kernels.rows import empty_rows
from .kv_cache import check_kv_cache_dtype
from .layers import Linear, RMSNorm
from .moe import MoEConfig, SparseMoE, moe_config, stack_experts
from .tensor_parallel import (
    all_gather_last,
    all_reduce,
    embed,
    rank_rows,
    shard_config,
    shard_state,
)

# Hub FP8 checkpoints' calibrated static scales (of the projections' inputs and outputs,
# and of the KV cache): the engine quantizes activations per token and bounds the cache's
# values from the weights (kv_cache.py), so it reads neither.
STATIC_SCALES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    rope_scaling: dict | None = None
    model_type: str = "llama"
    moe: MoEConfig | None = None  # routed experts in place of the dense MLP (moe.py)
    tp: int = 1  # ranks the model is split over; heads and widths are then one rank's
    quantization: str | None = None  # "fp8": the projections' weights in e4m3 (fp8.py)
    kv_cache_dtype: str | None = None  # "fp8": the KV cache in e4m3 (kv_cache.py)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> LlamaConfig:
        c = ckpt.config
        model_type = c.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{ckpt.path / 'config.json'}: model_type {model_type!r} not supported "
                f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs
        # have `rope_theta` and `rope_scaling` at the top level.
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            return cls(
                vocab_size=int(c["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(c["intermediate_size"]),
                num_layers=int(c["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=float(c.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                max_position=int(c.get("max_position_embeddings", 4096)),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                attention_bias=bool(c.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                rope_scaling=rope or None,
                model_type=model_type,
                moe=moe_config(model_type, c),
                quantization=checkpoint_quantization(c, ckpt.path / "config.json"),
            )
        except KeyError as exc:
            raise CheckpointError(f"{ckpt.path / 'config.json'}: missing key {exc}") from None


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Rotary frequencies, with Llama 3.1's frequency-dependent scaling when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(medium, blended, scaled)
    elif kind not in (None, "default"):
        raise CheckpointError(f"rope_scaling type {kind!r} not supported")
    return inv_freq.float()


def paged_attention(
    q, k_cache, v_cache, step, scale: float, out=None, kv_scales=None
) -> torch.Tensor:
    """Decoding sequences through the decode kernel, the rest through the prefill one,
    each writing its rows of one output (`out`, contiguous, or a new tensor). The grids
    follow the step's shapes (num_decodes rows, the work list's entries), the kernels
    the real counts in `step.counts`: a CUDA graph's static step may hold more.

    Which kernel a token meets depends on its own sequence only (never on its batch
    neighbours), so a request computes the same numbers alone or among others.
    `kv_scales`: an FP8 cache's (kv_cache.py).
    """
    if q.device.type != "cuda":
        attended = paged_attention_ref(
            q,
            k_cache,
            v_cache,
            step.block_tables,
            step.seq_lens,
            step.cu_seqlens_q,
            scale,
            kv_scales,
        )
        return attended if out is None else out.copy_(attended)
    if out is None:
        n, n_q, dim = q.shape
        out = empty_rows(n, n_q * dim, q.dtype, q.device).view(n, n_q, dim)  # feeds o
    if step.num_decodes:
        paged_decode(
            q,
            k_cache,
            v_cache,
            step.block_tables,
            step.seq_lens,
            scale,
            out=out,
            rows=step.num_decodes,
            counts=step.counts,
            kv_scales=kv_scales,
        )
    if step.work.shape[0]:
        paged_prefill(
            q,
            k_cache,
            v_cache,
            step.block_tables,
            step.seq_lens,
            step.cu_seqlens_q,
            scale,
            work=step.work,
            counts=step.counts,
            out=out,
            kv_scales=kv_scales,
        )
    return out


def projection(cfg: LlamaConfig, in_features: int, out_features: int, bias: bool, device):
    """A layer's projection: FP8 (fp8.py) in a quantized model, else the dtype's Linear."""
    kind = Fp8Linear if cfg.quantization == "fp8" else Linear
    return kind(in_features, out_features, bias=bias, device=device)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, device=None, in_features: int | None = None):
        """`in_features`: the width of its input, if not the hidden size (EAGLE-3's layer
        reads an embedding and a feature side by side)."""
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.q_dim, self.kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul: one launch and one pass over x instead of three (the
        # checkpoint's q_proj/k_proj/v_proj are stacked at load, see fuse_projections).
        self.qkv_proj = projection(
            cfg,
            in_features or cfg.hidden_size,
            self.q_dim + 2 * self.kv_dim,
            cfg.attention_bias,
            device,
        )
        self.o_proj = projection(cfg, self.q_dim, cfg.hidden_size, False, device)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device)
        # an FP8 cache's scales per KV head, [2, kv_heads]: set with the cache (kv_cache.py)
        self.kv_scales: torch.Tensor | None = None

    def query(self, x: torch.Tensor, step, k_cache, v_cache, inv_freq) -> torch.Tensor:
        """This layer's queries [tokens, heads, dim], rotated; the tokens' K/V go to the
        cache on the way (slot -1: nowhere)."""
        cfg, n = self.cfg, x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)  # views into the fused output
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        norms = None  # Qwen3's per-head norms of q and k, in the rope kernel
        if cfg.qk_norm:
            norms = (self.q_norm.weight, self.k_norm.weight, cfg.rms_norm_eps)
        kc, vc = k_cache[self.layer], v_cache[self.layer]
        return ops(x.device).rope_and_cache(
            q, k, v, step.positions, inv_freq, kc, vc, step.slot_mapping, norms, self.kv_scales
        )

    def attend(self, q: torch.Tensor, step, k_cache, v_cache, out=None) -> torch.Tensor:
        """Attention over the paged cache: [tokens, heads, dim] (into `out`, if given)."""
        kc, vc = k_cache[self.layer], v_cache[self.layer]
        return paged_attention(q, kc, vc, step, self.cfg.head_dim**-0.5, out, self.kv_scales)

    def forward(self, x: torch.Tensor, step, k_cache, v_cache, inv_freq) -> torch.Tensor:
        out = self.attend(self.query(x, step, k_cache, v_cache, inv_freq), step, k_cache, v_cache)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, device=None):
        super().__init__()
        # gate and up in one matmul, then one kernel for silu(gate) * up
        width = 2 * cfg.intermediate_size
        self.gate_up_proj = projection(cfg, cfg.hidden_size, width, False, device)
        self.down_proj = projection(cfg, cfg.intermediate_size, cfg.hidden_size, False, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops(x.device).silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, device=None):
        super().__init__()
        fp8 = cfg.quantization == "fp8"  # (dense models only: the MLP's gate/up is FP8 too)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, fp8)
        self.self_attn = Attention(cfg, layer, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, fp8)
        if cfg.moe is not None and layer not in cfg.moe.dense_layers:
            self.mlp: nn.Module = SparseMoE(cfg.moe, cfg.hidden_size, device)
        else:
            self.mlp = MLP(cfg, device)

    def forward(self, x, residual, step, k_cache, v_cache, inv_freq):
        """(x, residual) in and out: each norm also adds the residual, in one kernel."""
        q, residual = self.query(x, residual, step, k_cache, v_cache, inv_freq)
        return self.finish(self.self_attn.attend(q, step, k_cache, v_cache), residual)

    def query(self, x, residual, step, k_cache, v_cache, inv_freq):
        """The layer up to attention: (its queries, the residual)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        return self.self_attn.query(h, step, k_cache, v_cache, inv_freq), residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor):
        """The layer from attention's output on: (x, residual). Token by token: no step
        metadata. Split over ranks, o_proj and the MLP's outputs are summed across them."""
        tp = self.self_attn.cfg.tp
        h = all_reduce(self.self_attn.o_proj(attended.reshape(attended.shape[0], -1)), tp)
        h, residual = self.post_attention_layernorm(h, residual)
        if tp == 1 and isinstance(self.mlp, SparseMoE):  # the next norm adds up its slots
            return self.mlp(h, summed=False), residual
        return all_reduce(self.mlp(h), tp), residual


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig, device=None):
        super().__init__()
        # given its weight, Embedding skips its own init, which on the meta device imports
        # torch._dynamo (seconds of a cold start); elsewhere the same init, done here
        rows = cfg.vocab_size // cfg.tp  # split over ranks: this rank's share of the vocab
        weight = torch.empty(rows, cfg.hidden_size, device=device)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, device=None):
        """`device="meta"`: the structure only, for a checkpoint's tensors to fill (passed
        down rather than a `torch.device` context, which imports torch._dynamo: seconds
        of a cold start)."""
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, device)
        rows = cfg.vocab_size // cfg.tp
        self.lm_head = Linear(cfg.hidden_size, rows, bias=False, device=device)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.taps = None  # eagle3.HiddenTaps: inner hidden states an EAGLE-3 head reads

    @torch.inference_mode()
    def hidden_states(self, input_ids, step, k_cache, v_cache) -> torch.Tensor:
        """Final hidden states of `input_ids` (flat, several sequences), per the step."""
        x, residual = self.embed(input_ids), None
        for i, layer in enumerate(self.model.layers):
            if self.taps is not None:
                self.taps.record(i, x, residual)
            x, residual = layer(x, residual, step, k_cache, v_cache, self.inv_freq)
        x, _ = self.model.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (split over ranks: tensor_parallel.embed)."""
        return embed(self.model.embed_tokens, input_ids, self.cfg.tp)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last(self.lm_head(hidden).float(), self.cfg.tp)

    @classmethod
    def load(
        cls,
        ckpt: Checkpoint,
        device="cpu",
        dtype=torch.float32,
        tp: int = 1,
        tp_rank: int = 0,
        experts: bool = False,
        quantization: str | None = None,
        reference: bool = False,
        kv_cache_dtype: str | None = None,
    ) -> LlamaForCausalLM:
        """The checkpoint's model on `device` (with `tp`, rank `tp_rank`'s shard of it:
        tensor_parallel.py; `experts`: a mixture of experts' experts shared out whole);
        on CUDA, Triton's set-up runs meanwhile. `quantization` ("fp8"): quantize a
        checkpoint's projections at load (a Hub FP8 checkpoint is FP8 anyway);
        `kv_cache_dtype` ("fp8"): the model runner's KV cache in e4m3 (kv_cache.py). FP8
        needs its GPU kernels, or `reference`: the CPU's definition of the math (fp8.py)."""
        cfg = LlamaConfig.from_checkpoint(ckpt)
        if quantization is not None and quantization not in METHODS:
            raise CheckpointError(f"quantization {quantization!r} is not one of {list(METHODS)}")
        check_kv_cache_dtype(kv_cache_dtype)
        cfg = dataclasses.replace(
            cfg, quantization=quantization or cfg.quantization, kv_cache_dtype=kv_cache_dtype
        )
        if kv_cache_dtype:
            check_device(device, reference)
        if cfg.quantization:
            if cfg.moe is not None or tp > 1:
                raise CheckpointError("FP8 is for dense models on one GPU so far")
            check_device(device, reference)
        sharded = shard_config(cfg, tp, experts)  # (an odd split fails before any load)
        n_experts = cfg.moe.experts if experts else 0
        warming = prewarm_triton() if torch.device(device).type == "cuda" else None
        if tp == 1:
            state = ckpt.load_tensors(device, dtype, together=fused_groups(cfg))
        else:  # a file at a time, only this rank's rows: its shard and one file's at most
            state, rows = {}, rank_rows(tp_rank, tp, n_experts)
            for path in ckpt.shard_files():
                part = safetensors_reader.load_tensors([path], device, dtype, rows=rows)
                shard_state(part, tp_rank, tp, n_experts, rows_read=True)
                state.update(part)
        model = cls.from_state(sharded, state, ckpt.path)
        if warming:
            warming.join()
        if cfg.quantization and torch.device(device).type == "cuda":
            # hand quantizing's scratch back to the driver: the KV pool is sized from what
            # the GPU reports free, and the smaller weights are to leave it more room
            del state
            torch.cuda.empty_cache()
        return model

    @classmethod
    def from_state(cls, cfg: LlamaConfig, state: dict, source="state") -> LlamaForCausalLM:
        """The model on a checkpoint's tensors (HF names; taken over, not copied, but for
        the fused projections); CheckpointError names what is missing or misshapen."""
        model = cls(cfg, device="meta")
        for name in [n for n in state if n.endswith(STATIC_SCALES)]:
            del state[name]  # activations are quantized per token on the fly
        if cfg.quantization:
            normalize_scales(state)  # (a Hub FP8 checkpoint's, before they are fused)
        fuse_projections(state, cfg, source)
        if cfg.quantization:
            quantize_projections(state)
        if cfg.moe is not None:
            stack_experts(state, cfg.model_type, cfg.moe, cfg.num_layers, source)
        if cfg.tie_embeddings:
            state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
        assign_state(model, state, source, skipped=("rotary_emb",))  # HF's rotary caches
        model.inv_freq = rope_inv_freq(cfg).to(state["lm_head.weight"].device)
        return model.eval()


def assign_state(
    module: nn.Module, state: dict[str, torch.Tensor], source, skipped: tuple[str, ...] = ()
) -> None:
    """Give `module` the tensors of `state` (taken over, not copied); CheckpointError
    names what is missing, unexpected (but for names containing one of `skipped`) or
    misshapen."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{source}: missing tensors {missing[:5]}")
    extra = [k for k in state if k not in expected and not any(p in k for p in skipped)]
    if extra:
        raise CheckpointError(f"{source}: unexpected tensors {sorted(extra)[:5]}")
    for name, param in expected.items():
        if state[name].shape != param.shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                f"config says {tuple(param.shape)}"
            )
    module.load_state_dict({k: state[k] for k in expected}, assign=True)


FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fused_groups(cfg: LlamaConfig) -> list[list[str]]:
    """The checkpoint tensors each fused projection stacks, in order: read back to back,
    they are fused without a copy."""
    return [
        [f"model.layers.{i}.{part}.{kind}" for part in parts]
        for i in range(cfg.num_layers)
        for parts in FUSED.values()
        for kind in ("weight", "bias")
    ]


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(tensors), as a view when they already lie back to back in one storage."""
    first = tensors[0]
    at = first.data_ptr()
    adjacent = all(t.is_contiguous() for t in tensors)
    for t in tensors:
        adjacent = adjacent and t.data_ptr() == at
        at += t.numel() * t.element_size()
    if adjacent and len({t.untyped_storage().data_ptr() for t in tensors}) == 1:
        shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
        return first.as_strided(shape, torch.empty(shape, device="meta").stride())
    return torch.cat(tensors)


def fuse_projections(state: dict[str, torch.Tensor], cfg: LlamaConfig, path) -> None:
    """Stack each layer's q/k/v and gate/up tensors of a checkpoint into the fused
    projections the model runs, in place, one layer at a time (the parts are freed as
    they go: loading never holds a layer's weights twice)."""
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias", "weight_scale"):
                names = [f"{prefix}{part}.{kind}" for part in parts]
                present = [n for n in names if n in state]
                if not present:
                    continue
                if len(present) < len(names):
                    missing = next(n for n in names if n not in state)
                    raise CheckpointError(f"{path}: missing tensors ['{missing}']")
                tensors = [state.pop(n) for n in names]
                widths = {t.shape[1:] for t in tensors}
                if len(widths) > 1:
                    shapes = ", ".join(
                        f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors, strict=True)
                    )
                    raise CheckpointError(f"{path}: tensors of unequal width: {shapes}")
                state[f"{prefix}{fused}.{kind}"] = _stacked(tensors)
                del tensors
