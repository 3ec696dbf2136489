"""Models for tests and benchmarks: tiny real HF checkpoints, random ones of real shapes."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
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


SMALL_LLAMA = LlamaConfig(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position=2048,
)


def small_random_llama(directory: Path) -> tuple[LlamaForCausalLM, TextTokenizer]:
    """SMALL_LLAMA with random weights on the GPU, and a word-level tokenizer for it: the
    GPU twins of the CPU engine tests that need a model, not a real one."""
    return random_llama(SMALL_LLAMA), text_tokenizer(directory, SMALL_LLAMA.vocab_size)


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


@contextlib.contextmanager
def readable_tiny_llama(prefix: str) -> Iterator[Path]:
    """tiny_llama in a fresh directory under /tmp that a sandboxed instance's own uid can
    reach (pytest's tmp_path is root's alone), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        root.chmod(0o755)
        model = tiny_llama(root / "m")
        for path in (model, *model.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield model
    finally:
        shutil.rmtree(root, ignore_errors=True)


def eagle3_head(path: Path, target: LlamaConfig, draft_vocab: int, seed: int = 0) -> Path:
    """A random EAGLE-3 head for `target` in the published format (config.json with
    `draft_vocab_size`; fc, midlayer.*, norm, lm_head, d2t, t2d), its draft vocabulary a
    random subset of the target's."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, heads, kv = target.hidden_size, target.num_heads, target.num_kv_heads
    hd, inter = target.head_dim, target.intermediate_size

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    kept = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.input_layernorm.weight": 1 + w(h),
        "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": 1 + w(h),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": kept - torch.arange(draft_vocab),  # target id = draft id + d2t[draft id]
        "t2d": t2d,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    for f in path.iterdir():
        f.chmod(0o644)
    return path


def pruned_llama(src: Path, dst: Path, keep: list[int]) -> Path:
    """A checkpoint of `src`'s model with only the layers `keep` (a weaker draft of it:
    the same tokenizer, proposals it gets wrong often)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = len(keep)
    (dst / "config.json").write_text(json.dumps(config))
    state = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i not in keep:
                continue
            name = name.replace(f"model.layers.{i}.", f"model.layers.{keep.index(i)}.")
        state[name] = tensor
    save_file(state, str(dst / "model.safetensors"))
    return dst
