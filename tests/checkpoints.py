"""Models for tests and benchmarks: tiny real HF checkpoints, random ones of real shapes."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from omni.engine.checkpoint import Checkpoint
from omni.engine.llama import LlamaConfig, LlamaForCausalLM, rope_inv_freq
from omni.engine.tokenizer import TextTokenizer

LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position=8192,
)


def save_word_level_tokenizer(file: Path, vocab_size: int) -> Path:
    """A tokenizer.json whose words "t0".."t{n-1}" are the ids, split on whitespace: random
    weights need no real vocabulary, and the engine still streams text."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(file))
    return file


def text_tokenizer(directory: Path, vocab_size: int) -> TextTokenizer:
    """The engine's tokenizer over a word-level vocabulary written into `directory`."""
    save_word_level_tokenizer(directory / "tokenizer.json", vocab_size)
    return TextTokenizer(Checkpoint(directory, {}))


def random_llama(cfg: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """Random bf16 weights on the GPU (std 0.02, not the init's near-zero values)."""
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.inv_freq = rope_inv_freq(cfg).cuda()
    return model


def tiny_llama(path: Path) -> Path:
    """A random 2-layer Llama with a word-level tokenizer ("t0".."t95"), world-readable.
    No EOS token: it generates exactly max_tokens, so tests control how long it runs."""
    import transformers

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
    save_word_level_tokenizer(path / "tokenizer.json", cfg.vocab_size)
    for f in path.iterdir():  # transformers writes weights 0600; sandboxes read as other
        f.chmod(0o644)
    return path
