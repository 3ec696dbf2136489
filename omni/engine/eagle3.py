"""EAGLE-3 draft heads (Li et al., 2025) in their published checkpoint format.

An EAGLE-3 head is one decoder layer that drafts from the target's own features: the
hidden states entering three of the target's layers (a low, a middle and a high one),
concatenated and projected by `fc` to one hidden width. At position t the layer reads
that feature with the embedding of token t + 1, attends over its own KV cache (one
layer's, paged like the target's), and its output predicts token t + 2 through its own
lm head over a smaller draft vocabulary (`d2t` maps a draft id to a target id). Further
draft tokens feed the layer's own output back as the feature.

Checkpoint (a directory): `config.json` (a Llama config: hidden_size, heads, rope...,
with `draft_vocab_size`, optionally `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`) and the tensors `fc`, `midlayer.*`
(`hidden_norm`, `input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`), `norm`, `lm_head`, `d2t` (and `t2d`, which drafting does not
need; `embed_tokens` where the head was trained with its own) in `*.safetensors` or
`pytorch_model.bin`. The proposer (proposers.py) runs it through a ModelRunner like any
model: `hidden_states` and `logits` are the interface it needs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from . import safetensors_reader
from .checkpoint import CheckpointError
from .kernels import ops
from .layers import Linear, RMSNorm
from .llama import (
    MLP,
    Attention,
    LlamaConfig,
    LlamaForCausalLM,
    assign_state,
    rope_inv_freq,
)


class HiddenTaps:
    """Where a target model leaves the hidden states entering some of its layers, for
    each token of its latest step: one static buffer, so a CUDA graph's replay writes
    there too. A reader queued on the stream right after the step reads that step's."""

    def __init__(self, layers: tuple[int, ...], hidden: int, dtype, device):
        self.layers = layers
        self.hidden = hidden
        self.buffer = torch.zeros(0, len(layers) * hidden, dtype=dtype, device=device)

    def fit(self, rows: int) -> None:
        """Room for steps of up to `rows` tokens (before any CUDA graph is captured: a
        graph writes where the buffer was then)."""
        if rows > self.buffer.shape[0]:
            b = self.buffer
            self.buffer = torch.zeros(rows, b.shape[1], dtype=b.dtype, device=b.device)

    def record(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Called by the model before `layer` (whose input is x + residual)."""
        if layer not in self.layers or x.shape[0] > self.buffer.shape[0]:
            return
        j, n = self.layers.index(layer), x.shape[0]
        out = self.buffer[:n, j * self.hidden : (j + 1) * self.hidden]
        if x.dim() == 3:  # a MoE layer's unsummed slots (kernels/norm.py)
            x = ops(x.device).sum_slots(x, residual.dtype)
        if residual is None:
            out.copy_(x)
        else:
            torch.add(x, residual, out=out)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose inputs EAGLE-3 heads are trained on, unless their config says."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: LlamaConfig, draft_vocab: int, target_hidden: int, taps: int, device):
        super().__init__()
        self.cfg = cfg  # num_layers = 1: the runner's cache holds one layer
        h = cfg.hidden_size
        self.fc = Linear(taps * target_hidden, h, bias=False, device=device)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, device)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device)
        self.self_attn = Attention(cfg, 0, device, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, device)
        self.mlp = MLP(cfg, device)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, device)
        self.lm_head = Linear(h, draft_vocab, bias=False, device=device)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64, device=device))
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.embed_tokens: nn.Embedding | None = None  # its own, where the checkpoint has one
        self._target: tuple[LlamaForCausalLM, ...] = ()  # (not a submodule: not its weights)
        # A step's features: `features`, or (None) the first rows of `feature_rows`, which
        # a CUDA graph of its decode steps reads in place; its sampled rows' outputs (the
        # next step's features) land in `hidden_rows` alike.
        self.features: torch.Tensor | None = None
        self.feature_rows: torch.Tensor | None = None
        self.hidden_rows: torch.Tensor | None = None

    def static_rows(self, rows: int) -> None:
        """Allocate feature_rows and hidden_rows for steps of up to `rows` tokens."""
        w = self.fc.weight
        self.feature_rows = torch.zeros(rows, self.cfg.hidden_size, dtype=w.dtype, device=w.device)
        self.hidden_rows = torch.zeros_like(self.feature_rows)

    def project(self, taps_rows: torch.Tensor) -> torch.Tensor:
        """The target's tapped rows [tokens, taps * hidden] as the layer's features."""
        return self.fc(taps_rows)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy draft token, as a target id."""
        draft = logits.argmax(-1)
        return draft + self.d2t[draft]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        return self._target[0].embed(ids)

    @torch.inference_mode()
    def hidden_states(self, ids, step, k_cache, v_cache) -> torch.Tensor:
        """The layer's output (before the final norm: it is the next draft step's
        feature) at each token, from `self.features` at the same tokens."""
        features = self.features
        if features is None:
            features = self.feature_rows[: ids.shape[0]]
        x = torch.cat([self.input_layernorm(self.embed(ids)), self.hidden_norm(features)], -1)
        attn = self.self_attn(x, step, k_cache, v_cache, self.inv_freq)
        h, residual = self.post_attention_layernorm(attn, features)
        return self.mlp(h) + residual

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the sampled rows (kept: the next step's features)."""
        self.hidden_rows[: hidden.shape[0]].copy_(hidden)
        return self.lm_head(self.norm(hidden)).float()


def load_eagle3(path: str | Path, target: LlamaForCausalLM) -> tuple[Eagle3Head, HiddenTaps]:
    """The head at `path`, on the target's device and dtype, and the taps it reads (to be
    set as the target's `taps`). CheckpointError names what does not fit the target."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path / 'config.json'}: missing (an EAGLE-3 head's directory)")
    config = json.loads((path / "config.json").read_text())
    device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    tcfg = target.cfg
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        cfg = dataclasses.replace(
            tcfg,
            vocab_size=tcfg.vocab_size,
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=1,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", tcfg.rms_norm_eps)),
            rope_theta=float(config.get("rope_theta", tcfg.rope_theta)),
            rope_scaling=config.get("rope_scaling") or tcfg.rope_scaling,
            attention_bias=False,
            qk_norm=False,
            moe=None,
            tp=1,
            quantization=None,
            kv_cache_dtype=None,
        )
        draft_vocab = int(config.get("draft_vocab_size") or config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: not an EAGLE-3 config ({exc})") from None
    if int(config.get("vocab_size", tcfg.vocab_size)) != tcfg.vocab_size:
        raise CheckpointError(
            f"{path}: an EAGLE-3 head for a vocabulary of {config['vocab_size']} tokens; "
            f"the model has {tcfg.vocab_size}"
        )
    target_hidden = int(config.get("target_hidden_size") or tcfg.hidden_size)
    if target_hidden != tcfg.hidden_size:
        raise CheckpointError(
            f"{path}: drafts from hidden states of width {target_hidden}; the model's are "
            f"{tcfg.hidden_size}"
        )
    layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) for i in layers) if layers else default_aux_layers(tcfg.num_layers)
    if any(not 0 <= i < tcfg.num_layers for i in layers):
        raise CheckpointError(f"{path}: taps layers {layers} of a {tcfg.num_layers}-layer model")
    state = _read_state(path, device, dtype)
    head = Eagle3Head(cfg, draft_vocab, target_hidden, len(layers), device="meta")
    own_embedding = state.pop("embed_tokens.weight", None)
    state.pop("t2d", None)
    renamed = {}
    for name, tensor in state.items():
        renamed[name.removeprefix("midlayer.")] = tensor
    attn = "self_attn."
    try:
        qkv = [renamed.pop(f"{attn}{p}_proj.weight") for p in "qkv"]
        renamed[f"{attn}qkv_proj.weight"] = torch.cat(qkv)
        gate_up = [renamed.pop(f"mlp.{p}_proj.weight") for p in ("gate", "up")]
        renamed["mlp.gate_up_proj.weight"] = torch.cat(gate_up)
    except KeyError as exc:
        raise CheckpointError(f"{path}: missing tensor midlayer.{exc.args[0]}") from None
    if "d2t" not in renamed:  # no draft vocabulary of its own: draft id = target id
        renamed["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64, device=device)
    renamed["d2t"] = renamed["d2t"].to(torch.int64)
    assign_state(head, renamed, path)
    head.inv_freq = rope_inv_freq(cfg).to(device)
    if own_embedding is not None:
        head.embed_tokens = nn.Embedding(*own_embedding.shape, _weight=own_embedding)
    head._target = (target,)
    return head.eval(), HiddenTaps(layers, tcfg.hidden_size, dtype, device)


def _read_state(path: Path, device, dtype) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        return safetensors_reader.load_tensors(files, device, dtype)
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise CheckpointError(f"{path}: no *.safetensors or pytorch_model.bin")
    state: dict[str, torch.Tensor] = {}
    for f in bins:  # tensors only: weights_only refuses any other pickled object
        for name, tensor in torch.load(f, map_location=device, weights_only=True).items():
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state
