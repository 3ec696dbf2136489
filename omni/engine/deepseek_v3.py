"""DeepSeek-V3 (and Kimi K2, Moonlight: the same architecture) in one readable file.

Two parts differ from the Llama family (llama.py), whose norms, dense MLP and linear
layers it uses as they are:
- Multi-head latent attention: each token's K and V come from one compressed latent
  (kv_lora_rank wide) plus one rope key shared by the heads, and that row is all the
  paged cache holds (kv_cache.KVLayout: one head, no V). kv_b_proj is absorbed into the
  query and the output, and attention runs over the cache rows as they are (kernels/mla.py
  says why): on the GPU for every row, one Triton launch a layer that reads no value back
  to the host (CUDA graphs hold it); on the CPU for decode rows, while prefill expands
  the latents through kv_b_proj (HF's form, which the CPU tests hold it to).
- DeepSeekMoE: sigmoid routing limited to the best groups of experts, a score bias that
  steers the choice but not the weights (kernels/grouped_router.py, beside its torch
  reference), shared experts every token takes, and dense MLPs in the first
  `first_k_dense_replace` layers. The routed experts' sums are moe.py's.

Module names follow the HF checkpoints, so a state dict loads as it is, but for the
stacked experts and fused gate/up projections. Multi-token-prediction layers (index >=
num_hidden_layers) are dropped at load. The Hub's block-FP8 and INT4 checkpoints load as
they ship (quant_weights.py): their projections run quantized (W8A16/W4A16 Triton kernels
on the GPU) but kv_b_proj, which is dequantized at load. The routed experts stay
quantized on the CPU, stacked as stored (QuantizedExperts: the fused MoE decodes their
tiles in registers); on a GPU they are dequantized at load until those kernels pass
their GPU test. One device: the CPU (torch references) or one GPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from . import safetensors_reader
from .checkpoint import Checkpoint, CheckpointError
from .kernels import ops
from .kernels.prewarm import prewarm_triton
from .kernels.wq import FP8
from .kv_cache import KVLayout
from .layers import Linear, RMSNorm
from .llama import MLP, assign_state
from .moe import Experts, MoEConfig, local_ids, stack_experts
from .quant_weights import (
    EXPERT_STACKS,
    FP8_BLOCK,
    INT4_GROUP,
    TENSORS,
    WeightScheme,
    cast_state,
    dequantize_linear,
    dequantize_where,
    gpu_problem,
    is_quantized,
    permute_rows,
    quantize_modules,
    stack_experts_quantized,
    stack_linears,
    weight_scheme,
)
from .tensor_parallel import (
    all_gather_last,
    all_reduce,
    check_splits,
    embed,
    rank,
    rank_rows,
    shard_state,
)

SUPPORTED_MODEL_TYPES = {"deepseek_v3", "kimi_k2"}


@dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int  # the latent's width
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe: MoEConfig  # its dense_layers: the first first_k_dense_replace
    shared_intermediate: int  # the shared experts' MLP (moe_intermediate x n_shared)
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True  # the checkpoint's rope dims in pairs (permuted at load)
    max_position: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "deepseek_v3"
    tp: int = 1
    quantization: str | None = None  # (read by llama.projection; the checkpoint's is in load)
    kv_cache_dtype: str | None = None

    @property
    def shared_expert_count(self) -> int:
        """The shared MLP as experts of the routed width (what folding stacks)."""
        return self.shared_intermediate // self.moe.intermediate

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> DeepseekV3Config:
        c, path = ckpt.config, ckpt.path / "config.json"
        model_type = c.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(f"{path}: model_type {model_type!r} is not DeepSeek-V3's")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        try:
            layers = int(c["num_hidden_layers"])
            dense = int(c.get("first_k_dense_replace") or 0)
            moe_inter = int(c["moe_intermediate_size"])
            return cls(
                vocab_size=int(c["vocab_size"]),
                hidden_size=int(c["hidden_size"]),
                intermediate_size=int(c["intermediate_size"]),
                num_layers=layers,
                num_heads=int(c["num_attention_heads"]),
                q_lora_rank=c.get("q_lora_rank"),
                kv_lora_rank=int(c["kv_lora_rank"]),
                qk_nope_head_dim=int(c["qk_nope_head_dim"]),
                qk_rope_head_dim=int(c["qk_rope_head_dim"]),
                v_head_dim=int(c["v_head_dim"]),
                moe=MoEConfig(
                    experts=int(c["n_routed_experts"]),
                    per_token=int(c["num_experts_per_tok"]),
                    intermediate=moe_inter,
                    renormalize=bool(c.get("norm_topk_prob", True)),
                    dense_layers=frozenset(range(min(dense, layers))),
                ),
                shared_intermediate=moe_inter * int(c.get("n_shared_experts") or 0),
                n_group=int(c.get("n_group") or 1),
                topk_group=int(c.get("topk_group") or 1),
                routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=float(c.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                rope_scaling=rope if rope_kind(rope) != "default" else None,
                rope_interleave=bool(c.get("rope_interleave", True)),
                max_position=int(c.get("max_position_embeddings", 4096)),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                attention_bias=bool(c.get("attention_bias", False)),
                model_type=model_type,
            )
        except KeyError as exc:
            raise CheckpointError(f"{path}: missing key {exc}") from None


def rope_kind(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type")) or "default"


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_parameters(cfg: DeepseekV3Config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of the rope dims, the factor the rotated q and k are scaled
    by): plain rope, or YaRN's blend of interpolated and original frequencies."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    kind = rope_kind(cfg.rope_scaling)
    if kind == "default":
        return inv_freq, 1.0
    if kind != "yarn":
        raise CheckpointError(f"rope_scaling type {kind!r} not supported for DeepSeek-V3")
    s = cfg.rope_scaling
    factor, old_ctx = float(s["factor"]), s["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the rope dim that turns `rotations` in old_ctx
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention = yarn_mscale(factor)
    return inv_freq, float(attention)


def softmax_scale(cfg: DeepseekV3Config) -> float:
    """1/sqrt(q.k width), times YaRN's mscale_all_dim correction squared where set."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling or {}
    if s.get("mscale_all_dim"):
        scale *= yarn_mscale(float(s["factor"]), s["mscale_all_dim"]) ** 2
    return scale


class LatentAttention(nn.Module):
    """Multi-head latent attention over the paged latent cache."""

    def __init__(self, cfg: DeepseekV3Config, layer: int, device=None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        heads, qk_dim = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * qk_dim, bias=False, device=device)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=bias, device=device)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, device)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk_dim, bias=False, device=device)
        latent_and_rope = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.kv_a_proj_with_mqa = Linear(hidden, latent_and_rope, bias=bias, device=device)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, device)
        kv_b_width = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, kv_b_width, bias=False, device=device)
        self.o_proj = Linear(heads * cfg.v_head_dim, hidden, bias=bias, device=device)
        self.scale = softmax_scale(cfg)
        self.rope_factor = rope_parameters(cfg)[1]  # YaRN's scale of the rotated parts

    def fuse_inputs(self, device=None) -> None:
        """One Linear for the two projections of x, q's first (q_proj or q_a_proj) and the
        latent's (kv_a_proj_with_mqa), stacked along their outputs (fuse_latent_inputs):
        one launch where two each waited out a launch's latency at decode sizes."""
        cfg, first = self.cfg, first_q_projection(self.cfg)
        width = getattr(self, first).out_features + self.kv_a_proj_with_mqa.out_features
        self.q_kv_a_proj = Linear(cfg.hidden_size, width, bias=False, device=device)
        delattr(self, first)
        del self.kv_a_proj_with_mqa

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [tokens, heads * (nope + rope)], [latent | rope key] [tokens, latent + rope]),
        each possibly a view with strided rows."""
        cfg = self.cfg
        if hasattr(self, "q_kv_a_proj"):
            fused, width = self.q_kv_a_proj(x), cfg.kv_lora_rank + cfg.qk_rope_head_dim
            first, kv = fused.split([fused.shape[-1] - width, width], dim=-1)
        else:
            first = (self.q_proj if cfg.q_lora_rank is None else self.q_a_proj)(x)
            kv = self.kv_a_proj_with_mqa(x)
        if cfg.q_lora_rank is None:
            return first, kv
        return self.q_b_proj(self.q_a_layernorm(first)), kv

    def forward(self, x: torch.Tensor, step, cache: torch.Tensor, inv_freq) -> torch.Tensor:
        """x [tokens, hidden] -> [tokens, hidden]; the tokens' latent rows go to this
        layer's `cache` [blocks, block_size, 1, latent + rope] on the way."""
        cfg, n, kernels = self.cfg, x.shape[0], ops(x.device)
        nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q, kv = self.inputs(x)
        q = q.view(n, cfg.num_heads, nope + rope)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        latent, k_rope = kv.split([cfg.kv_lora_rank, rope], dim=-1)
        if self.rope_factor != 1.0:  # rotation is linear: scaling before it is the same
            q_rope, k_rope = q_rope * self.rope_factor, k_rope * self.rope_factor
        norm = self.kv_a_layernorm  # applied on the latent's way to the cache
        to_cache = (latent, k_rope, step.positions, inv_freq, cache, step.slot_mapping)
        if kernels.mla_prefill is None:  # the GPU: every row absorbed, in one launch
            # (the latent query and the rope/cache rows one launch before it, the heads'
            # values out through kv_b_proj's V part in the one that merges the splits)
            w_uk, w_uv = self.absorbing_weights()
            q_latent, q_rope = kernels.mla_query_and_cache(
                q_nope, w_uk, q_rope, *to_cache, norm.weight, norm.eps
            )
            values = kernels.mla_attention(
                q_latent,
                cache,
                step.block_tables,
                step.seq_lens,
                step.cu_seqlens_q,
                self.scale,
                cfg.kv_lora_rank,
                q_rope=q_rope,
                w_uv=w_uv,
            )
            return all_reduce(self.o_proj(values.reshape(n, -1)), cfg.tp)
        q_rope = kernels.mla_rope_and_cache(q_rope, *to_cache, norm.weight, norm.eps)
        out = x.new_empty(n, cfg.num_heads, cfg.v_head_dim)
        d = step.num_decodes  # the first d rows: one a decoding sequence
        if d:
            out[:d] = self.absorbed(q_nope[:d], q_rope[:d], step, cache)
        if d < step.seq_lens.shape[0]:
            out[d:] = self.expanded(torch.cat([q_nope[d:], q_rope[d:]], dim=-1), step, cache)
        return all_reduce(self.o_proj(out.view(n, -1)), cfg.tp)

    def expanded(self, q: torch.Tensor, step, cache: torch.Tensor) -> torch.Tensor:
        """The prefilling sequences (those after the decoding ones) in the expanded form."""
        d, cfg = step.num_decodes, self.cfg
        return ops(q.device).mla_prefill(
            q,
            cache,
            self.kv_b_proj.weight,
            step.block_tables[d:],
            step.seq_lens[d:],
            step.cu_seqlens_q[d:] - d,
            self.scale,
            cfg.qk_nope_head_dim,
            cfg.v_head_dim,
        )

    def absorbed(self, q_nope, q_rope, step, cache: torch.Tensor) -> torch.Tensor:
        """The decoding sequences' rows, absorbed: attention over their cache rows in the
        latent space."""
        cfg, d = self.cfg, q_nope.shape[0]
        attended = ops(q_nope.device).mla_decode(
            self.to_latent(q_nope, q_rope),
            cache,
            step.block_tables[:d],
            step.seq_lens[:d],
            self.scale,
            cfg.kv_lora_rank,
        )
        return self.from_latent(attended)

    def absorbing_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's K and V parts, each head's [nope or v, latent]."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(cfg.num_heads, -1, cfg.kv_lora_rank)
        return w.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)

    def latent_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope in the latent space through kv_b_proj's K part: [rows, heads, latent]."""
        return ops(q_nope.device).head_matmul(q_nope, self.absorbing_weights()[0])

    def to_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """The absorbed query [rows, heads, latent + rope]: latent_query beside the
        rotated q_rope."""
        return torch.cat([self.latent_query(q_nope), q_rope], dim=-1)

    def from_latent(self, attended: torch.Tensor) -> torch.Tensor:
        """Each head's attended latent [rows, heads, latent] out through kv_b_proj's V
        part: [rows, heads, v]."""
        w_uv = self.absorbing_weights()[1]
        return ops(attended.device).head_matmul(attended, w_uv, transpose=True)


class Router(nn.Module):
    """The router's weights and its choice-only score bias, kept in fp32 as HF keeps them."""

    def __init__(self, cfg: DeepseekV3Config, device=None):
        super().__init__()
        self.cfg, experts = cfg, cfg.moe.experts
        self.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size, device=device))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, device=device))

    def forward(self, x: torch.Tensor, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k + shared] fp32, expert ids [tokens, k + shared]): `shared`
        slots of the shared experts where they are stacked after the routed ones."""
        cfg = self.cfg
        return ops(x.device).grouped_router(
            x,
            self.weight,
            self.e_score_correction_bias,
            cfg.moe.per_token,
            cfg.n_group,
            cfg.topk_group,
            cfg.moe.renormalize,
            cfg.routed_scaling_factor,
            shared,
        )


class QuantizedExperts(nn.Module):
    """The routed experts as the checkpoint stores them, stacked (EXPERT_STACKS, in
    kernels/moe.py fused_moe_quantized's layouts): block-FP8 e4m3 or packed INT4, fp32
    scales. `block`: FP8's (rows, columns) a scale, INT4's (1, group)."""

    def __init__(self, cfg: DeepseekV3Config, scheme: WeightScheme, device=None):
        super().__init__()
        e, inter, hidden = cfg.moe.local_experts, cfg.moe.intermediate, cfg.hidden_size
        fp8 = scheme.kind == FP8_BLOCK
        self.block = scheme.block if fp8 else (1, scheme.group_size)
        rows, cols = self.block

        def stack(n: int, k: int, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
            if fp8:
                w = torch.empty(e, n * parts, k, dtype=FP8, device=device)
            else:
                w = torch.empty(e, n * parts, -(-k // 8), dtype=torch.int32, device=device)
            return w, torch.empty(e, -(-n // rows) * parts, -(-k // cols), device=device)

        tensors = (*stack(inter, hidden, parts=2), *stack(hidden, inter))
        for name, t in zip(EXPERT_STACKS, tensors, strict=True):
            self.register_buffer(name, t)

    def forward(self, x, weights, ids, summed: bool = True, partial: bool = False, shared=0):
        stacks = (self.gate_up, self.gate_up_scale, self.down, self.down_scale)
        return ops(x.device).fused_moe_quantized(
            x, *stacks, weights, ids, self.block, partial=partial, summed=summed, shared=shared
        )


class DeepseekMoE(nn.Module):
    """Routed experts plus the shared experts every token takes: an MLP of their own, or,
    folded (fold_shared_experts), experts stacked after the routed ones that the router
    gives every token, so that one pair of MoE launches runs both (two linear launches,
    an add and a SiLU fewer a layer, each latency-bound at decode sizes)."""

    def __init__(self, cfg: DeepseekV3Config, device=None):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg, device)
        self.experts = Experts(cfg.moe, cfg.hidden_size, device)
        self.shared = 0  # shared experts stacked in self.experts
        self.shared_experts = None
        if cfg.shared_intermediate:
            shared = dataclasses.replace(cfg, intermediate_size=cfg.shared_intermediate)
            self.shared_experts = MLP(shared, device)

    def fold_shared(self, device=None, scheme: WeightScheme | None = None) -> None:
        """Take the shared experts into the routed stacks (fold_shared_experts' layout, or
        with `scheme` split_shared_experts', stacked quantized)."""
        self.shared = self.cfg.shared_expert_count
        moe = dataclasses.replace(self.cfg.moe, experts=self.cfg.moe.experts + self.shared)
        if scheme is None:
            self.experts = Experts(moe, self.cfg.hidden_size, device)
        else:
            self.experts = QuantizedExperts(dataclasses.replace(self.cfg, moe=moe), scheme, device)
        self.shared_experts = None

    def forward(self, x: torch.Tensor, summed: bool = True) -> torch.Tensor:
        """[tokens, hidden]; `summed=False`, where no shared MLP of its own remains: each
        token's weighted expert outputs [tokens, slots, hidden] in fp32, which the next
        RMS norm adds up (kernels/norm.py; one launch fewer a layer)."""
        weights, ids = self.gate(x, self.shared)
        experts, summed = self.experts, summed or self.shared_experts is not None
        moe, partial = self.cfg.moe, self.cfg.moe.expert_parallel > 1
        if partial:  # this rank's experts only; the layer's all-reduce adds the others'
            ids = local_ids(ids, rank() * moe.local_experts, moe.local_experts)
        if isinstance(experts, QuantizedExperts):
            out = experts(x, weights, ids, summed, partial, self.shared)
        else:
            out = ops(x.device).fused_moe(
                x, experts.gate_up, experts.down, weights, ids, partial, summed, self.shared
            )
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, layer: int, device=None):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.self_attn = LatentAttention(cfg, layer, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        dense = layer in cfg.moe.dense_layers
        self.mlp: nn.Module = MLP(cfg, device) if dense else DeepseekMoE(cfg, device)

    def forward(self, x, residual, step, k_cache, inv_freq):
        """(x, residual) in and out: each norm also adds the residual, in one kernel."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, step, k_cache[self.layer], inv_freq)
        h, residual = self.post_attention_layernorm(h, residual)
        tp = self.self_attn.cfg.tp
        if tp == 1 and isinstance(self.mlp, DeepseekMoE):  # the next norm adds up its slots
            return self.mlp(h, summed=False), residual
        return all_reduce(self.mlp(h), tp), residual


class Backbone(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, device=None):
        super().__init__()
        rows = cfg.vocab_size // cfg.tp  # split over ranks: this rank's share of the vocab
        weight = torch.empty(rows, cfg.hidden_size, device=device)
        if weight.device.type != "meta":  # (llama.Backbone says why it is made so)
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, device=None):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, device)
        rows = cfg.vocab_size // cfg.tp
        self.lm_head = Linear(cfg.hidden_size, rows, bias=False, device=device)
        self.register_buffer("inv_freq", rope_parameters(cfg)[0], persistent=False)
        self.taps = None  # eagle3.HiddenTaps: hidden states a draft head reads (MTP's)

    @property
    def kv_layout(self) -> KVLayout:
        """A token's cache row a layer: its latent and rope key, one head, no V."""
        return KVLayout(1, self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim, values=False)

    @torch.inference_mode()
    def hidden_states(self, input_ids, step, k_cache, v_cache) -> torch.Tensor:
        """Final hidden states of `input_ids` (flat, several sequences), per the step.
        `v_cache` is the runner's zero-width one: MLA keeps no V."""
        x, residual = embed(self.model.embed_tokens, input_ids, self.cfg.tp), None
        for i, layer in enumerate(self.model.layers):
            if self.taps is not None:
                self.taps.record(i, x, residual)
            x, residual = layer(x, residual, step, k_cache, self.inv_freq)
        x, _ = self.model.norm(x, residual)
        if self.taps is not None:  # what the output head reads (an MTP head's feature)
            self.taps.record(len(self.model.layers), x, None)
        return x

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
    ) -> DeepseekV3ForCausalLM:
        """The checkpoint's model on `device` (LlamaForCausalLM.load's arguments; what
        DeepSeek-V3 has no support for yet is refused by name)."""
        scheme = weight_scheme(ckpt.config, ckpt.path / "config.json")  # (or its refusal)
        refused = {
            # quantizing a bf16 checkpoint at load; a quantized checkpoint's own scheme loads
            "quantization at load": quantization is not None,
            "FP8 KV cache": kv_cache_dtype is not None,
            # (INT4's weight_shape is no tensor to cut in rows or columns)
            "INT4 over several ranks": tp > 1 and bool(scheme) and scheme.kind == INT4_GROUP,
        }
        if unsupported := [name for name, asked in refused.items() if asked]:
            raise CheckpointError(f"{ckpt.path}: no {', '.join(unsupported)} for DeepSeek-V3 yet")
        cuda = torch.device(device).type == "cuda"
        gpu = torch.cuda.get_device_capability(device) if cuda else None
        if scheme and gpu and (problem := gpu_problem(scheme, gpu)):  # W8A16/W4A16's least
            raise CheckpointError(f"{ckpt.path}: {problem}")
        cfg = DeepseekV3Config.from_checkpoint(ckpt)
        sharded = shard_config(cfg, tp, experts)  # (an odd split fails before any load)
        warming = prewarm_triton() if cuda else None
        read_dtype = dtype if scheme is None else None  # (the reader would cast fp32 scales)
        if tp == 1:
            state = ckpt.load_tensors(device, read_dtype)
        else:  # a file at a time, only this rank's rows (llama.py's load does the same)
            n_experts = cfg.moe.experts if experts else 0
            state, rows = {}, rank_rows(tp_rank, tp, n_experts)
            for path in ckpt.shard_files():
                part = safetensors_reader.load_tensors([path], device, read_dtype, rows=rows)
                shard_state(part, tp_rank, tp, n_experts, rows_read=True)
                state.update(part)
        if scheme is None:
            model = cls.from_state(sharded, state, ckpt.path)
        else:
            cast_state(state, dtype)
            sharded = dataclasses.replace(sharded, quantization=scheme.kind)
            model = cls.from_state(sharded, state, ckpt.path, scheme)
        if warming:
            warming.join()
        return model

    @classmethod
    def from_state(
        cls, cfg: DeepseekV3Config, state: dict, source="state", scheme: WeightScheme | None = None
    ):
        """The model on a checkpoint's tensors (HF names), quantized ones by `scheme`;
        CheckpointError names what is missing or misshapen."""
        model = cls(cfg, device="meta")
        drop_prediction_layers(state, cfg.num_layers)
        dtype = _model_dtype(state)
        dequantize_where(state, scheme, dtype, keep=runs_quantized)
        split = split_shared_experts(state, cfg, scheme)
        fuse_gate_up(state, cfg, scheme, dtype)
        quantized = stack_quantized_experts(state, cfg, scheme, dtype, source, split)
        dense_moe = dataclasses.replace(cfg.moe, dense_layers=cfg.moe.dense_layers | quantized)
        stack_experts(state, "deepseek_v3", dense_moe, cfg.num_layers, source)
        folded = fold_shared_experts(state, dense_moe, cfg)
        if cfg.rope_interleave:
            permute_rope_rows(state, cfg, scheme, dtype)
        fused_inputs = fuse_latent_inputs(state, cfg, scheme, dtype)
        for i in range(cfg.num_layers):  # the router in fp32, as HF keeps it
            for name in ("weight", "e_score_correction_bias"):
                key = f"model.layers.{i}.mlp.gate.{name}"
                if key in state:
                    state[key] = state[key].float()
        if cfg.tie_embeddings:
            state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
        for i in fused_inputs:  # (before quantize_modules: a fused FP8 pair stays FP8)
            model.model.layers[i].self_attn.fuse_inputs(device="meta")
        quantize_modules(model, state, scheme)
        for i in quantized:
            model.model.layers[i].mlp.experts = QuantizedExperts(cfg, scheme, device="meta")
        for i in split:
            model.model.layers[i].mlp.fold_shared(device="meta", scheme=scheme)
        for i in folded:
            model.model.layers[i].mlp.fold_shared(device="meta")
        assign_state(model, state, source, skipped=("rotary_emb",))
        model.inv_freq = rope_parameters(cfg)[0].to(state["lm_head.weight"].device)
        return model.eval()


def shard_config(cfg: DeepseekV3Config, tp: int, experts: bool = False) -> DeepseekV3Config:
    """One rank's shard of `cfg` over `tp` ranks (tensor_parallel.py): the heads, the
    dense and shared MLPs' widths and the vocabulary split; the routed experts shared out
    whole (`experts`: expert parallelism) or each split by its width. The latent and its
    cache are every rank's whole."""
    if tp == 1:
        return cfg
    need = {
        "attention heads": cfg.num_heads,
        "intermediate size": cfg.intermediate_size,
        "shared experts' width": cfg.shared_intermediate,
        "vocabulary": cfg.vocab_size,
    }
    if experts:
        need["experts"] = cfg.moe.experts
    else:
        need["experts' intermediate size"] = cfg.moe.intermediate
    check_splits(need, tp)
    if experts:
        moe = dataclasses.replace(cfg.moe, expert_parallel=tp)
    else:
        moe = dataclasses.replace(cfg.moe, intermediate=cfg.moe.intermediate // tp)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        intermediate_size=cfg.intermediate_size // tp,
        shared_intermediate=cfg.shared_intermediate // tp,
        moe=moe,
        tp=tp,
    )


def first_q_projection(cfg: DeepseekV3Config) -> str:
    """The projection of x that q starts from: q_proj, or the low-rank q_a_proj."""
    return "q_proj" if cfg.q_lora_rank is None else "q_a_proj"


def fuse_latent_inputs(
    state: dict, cfg: DeepseekV3Config, scheme: WeightScheme | None, dtype
) -> frozenset[int]:
    """Stack each layer's first q projection and kv_a_proj_with_mqa into q_kv_a_proj
    (LatentAttention.fuse_inputs) where both are plain, or both quantized with FP8's row
    blocks lining up, and neither has a bias: the layers fused."""
    fused = set()
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}.self_attn."
        parts = [prefix + first_q_projection(cfg), prefix + "kv_a_proj_with_mqa"]
        kinds = {is_quantized(state, p, scheme) for p in parts}
        plain = kinds == {False} and all(f"{p}.weight" in state for p in parts)
        if len(kinds) != 1 or any(f"{p}.bias" in state for p in parts):
            continue
        if not plain:
            if kinds != {True} or scheme is None:
                continue
            if scheme.kind == FP8_BLOCK and state[f"{parts[0]}.weight"].shape[0] % scheme.block[0]:
                continue
        stack_linears(state, parts, prefix + "q_kv_a_proj", scheme, dtype)
        fused.add(i)
    return frozenset(fused)


def fold_shared_experts(state: dict, moe, cfg: DeepseekV3Config) -> frozenset[int]:
    """Stack each MoE layer's shared experts after its routed ones (their `n` experts of
    the routed width: gate/up rows [gate_j; up_j], down's columns j), where the routed
    experts are stacked plain (moe: not in its dense layers) and the shared MLP's two
    weights are plain tensors of the stacks' dtype: the layers folded."""
    inter, n = cfg.moe.intermediate, cfg.shared_expert_count
    folded = set()
    if cfg.moe.expert_parallel > 1:  # (each rank's run of experts: not for DeepSeek yet)
        return frozenset()
    for i in range(cfg.num_layers) if n else ():
        prefix = f"model.layers.{i}.mlp."
        names = [f"{prefix}shared_experts.{p}_proj.weight" for p in ("gate_up", "down")]
        stacks = [f"{prefix}experts.{p}" for p in ("gate_up", "down")]
        if i in moe.dense_layers or not all(k in state for k in names + stacks):
            continue
        gate_up, down = (state[k] for k in names)
        if gate_up.dtype != state[stacks[0]].dtype or down.dtype != state[stacks[1]].dtype:
            continue
        hidden = gate_up.shape[-1]
        gate, up = gate_up.view(2, n, inter, hidden).unbind(0)
        shared_gate_up = torch.cat([gate, up], dim=1)
        shared_down = down.view(hidden, n, inter).permute(1, 0, 2)
        for name, extra in zip(stacks, (shared_gate_up, shared_down), strict=True):
            state[name] = torch.cat([state[name], extra.to(state[name].device)])
        for name in names:
            del state[name]
        folded.add(i)
    return frozenset(folded)


def split_shared_experts(
    state: dict, cfg: DeepseekV3Config, scheme: WeightScheme | None
) -> frozenset[int]:
    """Where a layer's routed experts and its shared MLP are all block FP8 and the
    routed width is whole blocks (of rows for gate and up, of columns for down): the
    shared MLP cut into `n` experts of the routed width, named as routed experts
    E..E+n-1 (their scales cut along), so that stack_quantized_experts stacks them after
    the routed ones and the router gives every token their slots (DeepseekMoE.fold_shared):
    fold_shared_experts' layout for quantized stacks. The layers split."""
    inter, n = cfg.moe.intermediate, cfg.shared_expert_count
    if scheme is None or scheme.kind != FP8_BLOCK or not n or cfg.moe.expert_parallel > 1:
        return frozenset()
    rows, cols = scheme.block
    if inter % rows or inter % cols:
        return frozenset()
    weight, scale = TENSORS[FP8_BLOCK][:2]
    split = set()
    for i in range(cfg.num_layers):
        mlp, e = f"model.layers.{i}.mlp.", cfg.moe.local_experts
        routed = [f"{mlp}experts.{j}.{p}_proj" for j in range(e) for p in ("gate", "up", "down")]
        shared = {p: f"{mlp}shared_experts.{p}_proj" for p in ("gate", "up", "down")}
        parts = routed + list(shared.values())
        if i in cfg.moe.dense_layers or not all(is_quantized(state, p, scheme) for p in parts):
            continue
        for p, name in shared.items():
            w, s = state.pop(f"{name}.{weight}"), state.pop(f"{name}.{scale}")
            dim = 1 if p == "down" else 0  # down's columns are the width; gate's, up's rows
            for j in range(n):
                out = f"{mlp}experts.{e + j}.{p}_proj"
                state[f"{out}.{weight}"] = w.narrow(dim, j * inter, inter).contiguous()
                blocks = inter // (cols if dim else rows)
                state[f"{out}.{scale}"] = s.narrow(dim, j * blocks, blocks).contiguous()
        split.add(i)
    return frozenset(split)


def drop_prediction_layers(state: dict, num_layers: int) -> None:
    """Remove the multi-token-prediction layers' tensors (layer index >= num_layers)."""
    for name in list(state):
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
            del state[name]


def runs_quantized(linear: str) -> bool:
    """Whether a quantized Linear (HF name) stays so: not kv_b_proj (MLA reads it as a
    matrix). (The routed experts stay so where a layer's all are: stack_quantized_experts.)"""
    return not linear.endswith("kv_b_proj")


def stack_quantized_experts(
    state: dict,
    cfg: DeepseekV3Config,
    scheme: WeightScheme | None,
    dtype,
    source,
    split: frozenset[int] = frozenset(),
) -> frozenset[int]:
    """Stack each MoE layer's routed experts as stored (QuantizedExperts) where all of
    them are quantized, else dequantize that layer's quantized ones for moe.stack_experts:
    the layers stacked quantized. In the `split` layers the shared experts follow
    (split_shared_experts)."""
    if scheme is None:
        return frozenset()
    done = set()
    for i in range(cfg.num_layers):
        if i in cfg.moe.dense_layers:
            continue
        prefix = f"model.layers.{i}.mlp.experts"
        parts = [
            tuple(f"{prefix}.{e}.{p}_proj" for p in ("gate", "up", "down"))
            for e in range(cfg.moe.local_experts + (cfg.shared_expert_count if i in split else 0))
        ]
        if stack_experts_quantized(state, parts, prefix, scheme, source):
            done.add(i)
        else:
            for linear in (p for expert in parts for p in expert):
                dequantize_linear(state, linear, scheme, dtype)
    return frozenset(done)


def _model_dtype(state: dict) -> torch.dtype:
    embed = state.get("model.embed_tokens.weight")
    return embed.dtype if embed is not None else torch.float32


def fuse_gate_up(
    state: dict, cfg: DeepseekV3Config, scheme: WeightScheme | None = None, dtype=torch.float32
) -> None:
    """Stack each dense MLP's and shared experts' gate and up into the fused projection
    llama.MLP runs (its q/k/v counterpart, llama.fuse_projections, is not for MLA);
    quantized ones stay so where their blocks line up (quant_weights.stack_linears)."""
    for i in range(cfg.num_layers):
        for mlp in ("mlp.", "mlp.shared_experts."):
            prefix = f"model.layers.{i}.{mlp}"
            parts = [f"{prefix}gate_proj", f"{prefix}up_proj"]
            if all(f"{p}.weight" in state or is_quantized(state, p, scheme) for p in parts):
                stack_linears(state, parts, f"{prefix}gate_up_proj", scheme, dtype)


def permute_rope_rows(
    state: dict, cfg: DeepseekV3Config, scheme: WeightScheme | None = None, dtype=torch.float32
) -> None:
    """Reorder the rows that make q's and k's rope dims from the checkpoint's interleaved
    pairs (x0, x1), (x2, x3)... to the halves (x0, x2, ...; x1, x3, ...) the rotate-half
    rope pairs: the same rotation, and the same dot products, as HF's interleaved one."""
    rope, nope, latent = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    head = torch.cat([torch.arange(nope), nope + order])
    q_rows = (torch.arange(cfg.num_heads)[:, None] * (nope + rope) + head).flatten()
    kv_rows = torch.cat([torch.arange(latent), latent + order])
    q_name = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}.self_attn."
        for name, rows in ((q_name, q_rows), ("kv_a_proj_with_mqa", kv_rows)):
            linear = prefix + name
            if f"{linear}.weight" in state or is_quantized(state, linear, scheme):
                permute_rows(state, linear, rows, scheme, dtype)
