"""A tiny Stable Diffusion pipeline made at test time from configs (no download): a
UNet, a VAE, a CLIP text encoder and its tokenizer, a DDIM scheduler, saved with
`save_pretrained` as a model directory for the text-to-image runtime."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from omni.runtimes.model_config import CONFIG_NAME

SIDE = 32  # the pipeline's own size: a 16x16 latent (the VAE halves each side)
STEPS = 2


def tiny_tokenizer(out: Path) -> CLIPTokenizer:
    """CLIP's byte-level BPE with no merges (every character a token, and each also as a
    word's end), from a vocab.json and merges.txt written here."""
    alphabet = sorted(ByteLevel.alphabet())
    tokens = [*alphabet, *(ch + "</w>" for ch in alphabet), "<|startoftext|>", "<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(tokens)}))
    (out / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(
        vocab=str(out / "vocab.json"), merges=str(out / "merges.txt"), model_max_length=16
    )


def tiny_pipeline(files: Path) -> StableDiffusionPipeline:
    tokenizer = tiny_tokenizer(files)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=SIDE // 2,
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=SIDE,
    )
    text_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        projection_dim=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=16,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(text_config),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def save_tiny_pipeline(out: Path, settings: str = f"steps = {STEPS}\n") -> Path:
    """The pipeline as a model directory, with `settings` as its omni-model.toml."""
    tiny_pipeline(out / "tokenizer-files").save_pretrained(out / "model")
    (out / "model" / CONFIG_NAME).write_text(settings)
    return out / "model"
