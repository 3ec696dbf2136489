"""Tiny random vision checkpoints, written at test time from transformers' own config
classes (nothing downloaded), small real photographs from scikit-image to feed them, and
the files a vision runtime must refuse.

Each writer saves what the runtime loads: the model, its image processor, and for the
captioners (ViT-GPT2, BLIP) a word-level tokenizer. Weights are seeded, so a checkpoint's
answers are the same on every run.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from skimage import data
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    BlipConfig,
    BlipForConditionalGeneration,
    BlipImageProcessor,
    DetrConfig,
    DetrForObjectDetection,
    DetrImageProcessor,
    GPT2Config,
    PreTrainedTokenizerFast,
    ResNetConfig,
    VisionEncoderDecoderConfig,
    VisionEncoderDecoderModel,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
)

from omni.instance.handler import Handler, HandlerError
from omni.instance.validate import check_inputs, check_outputs

from .conftest import MAX_RESPONSE_BYTES

CLASSES = ("cat", "astronaut", "coffee", "rocket")
OBJECTS = ("person", "cat", "cup")
SPECIALS = ("[PAD]", "[BOS]", "[EOS]", "[UNK]")
CAPTION_WORDS = """a an the man woman astronaut cat dog sits on in with of red blue white flag
suit space photo coffee cup saucer coins rocket launch pad sky grass table"""
WORDS = SPECIALS + tuple(CAPTION_WORDS.split())
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")  # skimage.data's colour photographs


def labelled(names: tuple[str, ...]) -> dict:
    return {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}


def save_tiny_classifier(out: Path) -> Path:
    """A ViT of two layers over 32x32 images, four classes."""
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        initializer_range=0.2,  # wide enough that different photos score differently
        **labelled(CLASSES),
    )
    torch.manual_seed(0)
    ViTForImageClassification(config).save_pretrained(out)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(out)
    return out


def save_tiny_detector(out: Path) -> Path:
    """DETR over a two-stage ResNet of transformers' own (no timm), eight queries, three
    classes; images resized to 64 pixels on the short side."""
    backbone = ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        out_features=["stage2"],
    )
    config = DetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=backbone,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_queries=8,
        init_std=0.5,
        **labelled(OBJECTS),
    )
    torch.manual_seed(0)
    DetrForObjectDetection(config).save_pretrained(out)
    DetrImageProcessor(size={"shortest_edge": 64, "longest_edge": 96}).save_pretrained(out)
    return out


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Whole words of a small vocabulary, joined by spaces when decoded."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    pad, bos, eos, unk = SPECIALS
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk
    )


def save_tiny_captioner(out: Path) -> Path:
    """A ViT encoder and a GPT-2 decoder of one layer each, over the word tokenizer."""
    encoder = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        initializer_range=0.5,
    )
    decoder = GPT2Config(
        vocab_size=len(WORDS),
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        initializer_range=0.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.pad_token_id, config.decoder_start_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(0)
    VisionEncoderDecoderModel(config=config).save_pretrained(out)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(out)
    word_tokenizer().save_pretrained(out)
    return out


def save_tiny_blip(out: Path) -> Path:
    """BLIP's captioner, one layer of each tower, over the word tokenizer."""
    pad, bos, eos = 0, 1, 2
    text = dict(
        vocab_size=len(WORDS),
        hidden_size=32,
        encoder_hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos,
        sep_token_id=eos,
    )
    vision = dict(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    config = BlipConfig(text_config=text, vision_config=vision, projection_dim=32)
    BlipForConditionalGeneration(config).save_pretrained(out)
    BlipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(out)
    word_tokenizer().save_pretrained(out)
    return out


def photo(name: str, width: int = 80) -> np.ndarray:
    """One of scikit-image's photographs, `width` pixels wide, its aspect kept."""
    image = Image.fromarray(getattr(data, name)())
    height = round(image.height * width / image.width)
    return np.asarray(image.resize((width, height), Image.Resampling.BILINEAR))


def encoded(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def decoded(file: bytes) -> Image.Image:
    """The file as a model run bare is given it."""
    return Image.open(io.BytesIO(file)).convert("RGB")


def png_claiming(width: int, height: int) -> bytes:
    """A PNG that says it is `width` x `height` and ends a few bytes into its pixels."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 9))


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bad_files() -> dict[str, bytes]:
    """Files a vision runtime refuses, by what is wrong with them."""
    png = encoded(photo("astronaut"))
    return {
        "truncated": png[: len(png) // 2],
        "not an image": b"%PDF-1.4 not an image at all",
        "cut after its header": png_claiming(64, 64),
        "gif": gif(),
    }


def gif() -> bytes:
    """A real image, of a format the runtimes do not take."""
    buffer = io.BytesIO()
    Image.fromarray(photo("chelsea")).save(buffer, format="GIF")
    return buffer.getvalue()


def answered(handler: Handler, batch: list[dict[str, np.ndarray]]) -> list:
    """One infer() call as the worker makes it: each request's checked outputs, or the
    HandlerError returned in its place."""
    for request in batch:
        check_inputs(request, handler.inputs)
    results = handler.infer(batch)
    assert isinstance(results, list) and len(results) == len(batch)
    return [
        r if isinstance(r, HandlerError) else check_outputs(r, handler.outputs, MAX_RESPONSE_BYTES)
        for r in results
    ]
