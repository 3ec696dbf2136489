"""Which model class serves a checkpoint: by its config's architecture or model_type.

Every class here has the same `load(ckpt, device, dtype, ...)` and serves the engine
the same way (`hidden_states`, `logits`, `cfg`; a KV layout of its own where it declares
one, kv_cache.KVLayout).
"""

from __future__ import annotations

from .checkpoint import Checkpoint
from .deepseek_v3 import DeepseekV3ForCausalLM
from .llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type] = {"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}
# Kimi K2's config names DeepseekV3ForCausalLM too, but its own model_type
MODEL_TYPES: dict[str, type] = {
    "deepseek_v3": DeepseekV3ForCausalLM,
    "kimi_k2": DeepseekV3ForCausalLM,
}


def model_class(ckpt: Checkpoint) -> type:
    """The class whose `load` reads `ckpt`: LlamaForCausalLM (the Llama family, Mistral,
    Qwen2/3, Mixtral, Qwen3-MoE) unless the architecture or model_type names another."""
    named = ARCHITECTURES.get(ckpt.architecture) or MODEL_TYPES.get(ckpt.config.get("model_type"))
    return named or LlamaForCausalLM


def load_model(ckpt: Checkpoint, *args, **kwargs):
    """`ckpt`'s model, through its class's `load` (same arguments)."""
    return model_class(ckpt).load(ckpt, *args, **kwargs)
