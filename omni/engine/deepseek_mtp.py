"""DeepSeek-V3's multi-token-prediction module (MTP) as a speculative draft head.

A DeepSeek-V3 checkpoint ships one more decoder layer than the model runs: layer
`num_hidden_layers`, trained to predict the token after next (DeepSeek-V3 technical
report, section 2.2). At position t it projects the model's hidden state there, h_t
(the one the output head reads, after the final norm), together with the embedding of
token t + 1: x_t = eh_proj([enorm(embed(token t + 1)); hnorm(h_t)]), runs its decoder
layer (MLA and DeepSeekMoE, over a latent cache of its own) and predicts token t + 2
through its own final norm (`shared_head.norm`) and the model's output head. Drafting
further feeds that normed output back as the next h, as an EAGLE head feeds its own
(proposers.FeatureProposer).

Its tensors, `model.layers.{L}.`: `enorm`, `hnorm`, `eh_proj`, the decoder layer's
(`self_attn.*`, `mlp.*`, the two layer norms), `shared_head.norm`, and copies of the
embedding and output head (`embed_tokens`, `shared_head.head`), which are not read: the
model's own serve. The layer is built by DeepseekV3ForCausalLM.from_state as a one-layer
model (its rope permutation, fused projections, quantized or folded experts alike).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import safetensors_reader
from .checkpoint import Checkpoint, CheckpointError
from .deepseek_v3 import DecoderLayer, DeepseekV3Config, DeepseekV3ForCausalLM
from .eagle3 import HiddenTaps
from .layers import Linear, RMSNorm
from .llama import assign_state
from .quant_weights import cast_state, dequantize_linear, weight_scheme
from .spec_config import mtp_layers
from .tensor_parallel import embed


class MtpHead(nn.Module):
    """The MTP layer with its input projection and final norm; the model's embedding and
    output head are read through the model (not the head's weights)."""

    def __init__(self, cfg: DeepseekV3Config, layer: DecoderLayer, norm: RMSNorm, inv_freq):
        super().__init__()
        self.cfg = cfg  # num_layers = 1: the runner's cache holds the layer's latent rows
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, device="meta")
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, device="meta")
        self.eh_proj = Linear(2 * h, h, bias=False, device="meta")
        self.layer, self.norm = layer, norm
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._target: tuple[DeepseekV3ForCausalLM, ...] = ()  # (not a submodule)
        # as Eagle3Head's: a step's features, or the first rows of `feature_rows` (which a
        # CUDA graph reads in place); the sampled rows' outputs land in `hidden_rows`
        self.features: torch.Tensor | None = None
        self.feature_rows: torch.Tensor | None = None
        self.hidden_rows: torch.Tensor | None = None

    @property
    def kv_layout(self):
        """The model's latent row a token (its own cache: one layer of it)."""
        return self._target[0].kv_layout

    @property
    def lm_head(self) -> nn.Module:
        """The model's output head (the runner reads its dtype)."""
        return self._target[0].lm_head

    def static_rows(self, rows: int) -> None:
        """Allocate feature_rows and hidden_rows for steps of up to `rows` tokens."""
        w = self.eh_proj.weight
        self.feature_rows = torch.zeros(rows, self.cfg.hidden_size, dtype=w.dtype, device=w.device)
        self.hidden_rows = torch.zeros_like(self.feature_rows)

    def project(self, taps_rows: torch.Tensor) -> torch.Tensor:
        """The model's tapped last hidden states, kept as they are (copied: the taps'
        buffer is the next step's)."""
        return taps_rows.clone()

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, : self.cfg.vocab_size].argmax(-1)

    @torch.inference_mode()
    def hidden_states(self, ids, step, k_cache, v_cache) -> torch.Tensor:
        """The layer's output after its final norm (what the output head reads, and the
        next draft step's feature) at each token, from `self.features` there."""
        features = self.features
        if features is None:
            features = self.feature_rows[: ids.shape[0]]
        target = self._target[0]
        e = self.enorm(embed(target.model.embed_tokens, ids, 1))
        x = self.eh_proj(torch.cat([e, self.hnorm(features)], dim=-1))
        x, residual = self.layer(x, None, step, k_cache, self.inv_freq)
        return self.norm(x, residual)[0]  # (which adds up the MoE layer's slots)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the sampled rows (kept: the next step's features)."""
        self.hidden_rows[: hidden.shape[0]].copy_(hidden)
        return self._target[0].logits(hidden)


def load_mtp(target, path) -> tuple[MtpHead, HiddenTaps]:
    """The MTP head of the checkpoint at `path` (the target's own), on the target's device
    and dtype, and the taps of the target's last hidden state it reads (to be set as the
    target's `taps`; proposers.load_draft refuses a model split over ranks first).
    CheckpointError says why a model has none."""
    if not isinstance(target, DeepseekV3ForCausalLM):
        raise CheckpointError("speculative.method 'mtp': DeepSeek-V3's architecture only")
    ckpt = Checkpoint.open(path)
    if not mtp_layers(ckpt.config):
        raise CheckpointError(
            f"{ckpt.path}: no multi-token-prediction layer (num_nextn_predict_layers)"
        )
    cfg = target.cfg
    prefix = f"model.layers.{cfg.num_layers}."
    device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    scheme = weight_scheme(ckpt.config, ckpt.path / "config.json")
    state = _read_layer(ckpt, prefix, device, None if scheme else dtype)
    if scheme:
        cast_state(state, dtype)
    own = {}
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm"):
        if scheme:  # (eh_proj stored quantized: dense here, a launch at a step)
            dequantize_linear(state, prefix + name, scheme, dtype)
        key = f"{prefix}{name}.weight"
        if key not in state:
            raise CheckpointError(f"{ckpt.path}: missing tensor {key}")
        own[name] = state.pop(key)
    for copy in ("embed_tokens.weight", "shared_head.head.weight"):  # the model's serve
        state.pop(prefix + copy, None)
    layer = {f"model.layers.0.{k.removeprefix(prefix)}": v for k, v in state.items()}
    layer["model.embed_tokens.weight"] = target.model.embed_tokens.weight
    layer["lm_head.weight"] = target.lm_head.weight
    layer["model.norm.weight"] = own["shared_head.norm"]
    one = dataclasses.replace(
        cfg, num_layers=1, moe=dataclasses.replace(cfg.moe, dense_layers=frozenset())
    )
    if scheme:
        one = dataclasses.replace(one, quantization=scheme.kind)
    inner = DeepseekV3ForCausalLM.from_state(one, layer, ckpt.path, scheme)
    head = MtpHead(one, inner.model.layers[0], inner.model.norm, inner.inv_freq)
    for name in ("enorm", "hnorm", "eh_proj"):
        assign_state(getattr(head, name), {"weight": own[name]}, f"{ckpt.path}: {prefix}{name}")
    head._target = (target,)
    return head.eval(), HiddenTaps((cfg.num_layers,), cfg.hidden_size, dtype, device)


def _read_layer(ckpt: Checkpoint, prefix: str, device, dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under `prefix` only (the other layers' bytes unread)."""

    def rows(name: str, shape: tuple[int, ...]):
        return (0, shape[0]) if name.startswith(prefix) else None

    state = safetensors_reader.load_tensors(ckpt.shard_files(), device, dtype, rows=rows)
    return {k: v for k, v in state.items() if k.startswith(prefix)}
