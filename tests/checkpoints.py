"""Tiny real HF-format checkpoints for tests that run whole nodes."""

from __future__ import annotations

from pathlib import Path

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers


def tiny_llama(path: Path) -> Path:
    """A random 2-layer Llama with a word-level tokenizer ("t0".."t95"), world-readable.
    No EOS token: it generates exactly max_tokens, so tests control how long it runs."""
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    for f in path.iterdir():  # transformers writes weights 0600; sandboxes read as other
        f.chmod(0o644)
    return path
