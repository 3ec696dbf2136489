"""Import a llama.cpp GGUF checkpoint once as a standard HF directory.

Why: the embedded default text model ships as a GGUF file. Converting it into
config.json + safetensors + tokenizer.json lets it go through the same loader
as any user's Llama or Qwen directory, with no special path for the default.
Only what the default needs is supported: the `llama` architecture with a
GPT-2 style byte-level BPE vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp pre-tokenizer names we can express with `tokenizers` pre-tokenizers.
PRE_TOKENIZERS = {"default", "gpt2", "smollm"}
CONTROL_TOKEN = 3

ProgressFn = Callable[[int, int], None]


class GGUFImportError(ValueError):
    """The GGUF file is not one this importer can turn into an HF directory."""


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its HF Llama name."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise GGUFImportError(f"unknown tensor {gguf_name!r}")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order.

    llama.cpp interleaves each head's rotary pairs (x0, x_d/2, x1, ...); HF's
    rotate-half RoPE keeps the two halves apart, so rows go back per head.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_config(reader: gguf.GGUFReader, has_lm_head: bool) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"architecture {arch!r} is not supported (only 'llama')")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "head_dim": hidden // n_heads,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
        "hidden_act": "silu",
        "tie_word_embeddings": not has_lm_head,
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    return {k: v for k, v in config.items() if v is not None}


def hf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """Rebuild the byte-level BPE tokenizer that the GGUF file describes."""
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise GGUFImportError(f"tokenizer model {model!r} is not supported (only 'gpt2')")
    if pre not in PRE_TOKENIZERS:
        raise GGUFImportError(f"pre-tokenizer {pre!r} is not supported ({sorted(PRE_TOKENIZERS)})")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits are split one by one before the GPT-2 regex
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == CONTROL_TOKEN
        ]
    )
    return tokenizer


def tokenizer_config(reader: gguf.GGUFReader, config: dict) -> dict:
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def name(key: str) -> str | None:
        idx = config.get(key)
        return None if idx is None else tokens[idx]

    out = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "pad_token": name("pad_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return {k: v for k, v in out.items() if v is not None}


def import_gguf(gguf_path: Path, out_dir: Path, progress: ProgressFn | None = None) -> Path:
    """Write `out_dir` as an HF checkpoint directory, atomically: a crash leaves no half."""
    reader = gguf.GGUFReader(str(gguf_path))
    names = [t.name for t in reader.tensors]
    config = hf_config(reader, has_lm_head="output.weight" in names)
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(reader.tensors):
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.name.endswith("attn_q.weight"):
            weight = unpermute_rope_rows(weight, n_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = unpermute_rope_rows(weight, n_kv)
        tensors[hf_tensor_name(tensor.name)] = np.ascontiguousarray(weight)
        if progress:
            progress(i + 1, len(reader.tensors))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_tokenizer(reader).save(str(tmp / "tokenizer.json"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(reader, config), indent=2)
        )
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)  # sandboxed instances read it as another uid
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # another process finished the same import first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
