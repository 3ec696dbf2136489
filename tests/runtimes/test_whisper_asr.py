"""Whisper's runtime on a tiny random checkpoint saved with transformers' own classes.

No real Whisper weights ship on PyPI, so the words cannot be checked here: the tests
check what the runtime itself owes, that a clip's transcript does not depend on its
batch-mates, that it is deterministic, and that over-long audio is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizer,
)

from omni.instance.handler import HandlerError
from omni.runtimes.whisper_asr import WhisperASR

from .conftest import as_request, served, wav_bytes, yield_points

SPECIAL_TOKENS = ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")


def tiny_tokenizer() -> WhisperTokenizer:
    """A byte-level BPE tokenizer with no merges, whose tokens are the printable ASCII
    characters: transcripts read as text, and no vocabulary file is downloaded."""
    printable = {chr(c) for c in range(33, 127)} | {"Ġ"}  # Ġ: byte-level BPE's space
    alphabet = sorted(ch for ch in ByteLevel.alphabet() if ch in printable)
    tokenizer = WhisperTokenizer(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    return tokenizer


def save_tiny_whisper(out: Path) -> None:
    tokenizer = tiny_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    ids = {"pad_token_id": end, "bos_token_id": end, "eos_token_id": end}
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_target_positions=16,
        init_std=1.0,  # wide weights: transcripts that differ from clip to clip
        decoder_start_token_id=start,
        **ids,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(decoder_start_token_id=start, **ids)
    model.save_pretrained(out)
    extractor = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(out)


@pytest.fixture(scope="module")
def asr(tmp_path_factory) -> WhisperASR:
    model_dir = tmp_path_factory.mktemp("tiny-whisper")
    save_tiny_whisper(model_dir)
    handler = WhisperASR()
    handler.load(model_dir, "cpu")
    return handler


def noise_clip(seconds: float, seed: int) -> dict[str, np.ndarray]:
    samples = np.random.default_rng(seed).standard_normal(int(seconds * 16_000)) * 0.1
    return as_request(audio=wav_bytes(samples.astype(np.float32)))


def texts(results: list[dict]) -> list[str]:
    return [r["text"][0].decode() for r in results]


def test_a_transcript_does_not_depend_on_its_batch_mates(asr):
    clips = [noise_clip(0.5, 1), noise_clip(2.0, 2), noise_clip(7.5, 3)]
    alone = [texts(served(asr, [clip]))[0] for clip in clips]
    assert texts(served(asr, clips)) == alone
    assert texts(served(asr, clips[::-1])) == alone[::-1]
    assert len(set(alone)) > 1  # the clips are told apart: the batch is not one answer


def test_the_same_clip_gives_the_same_transcript(asr):
    clip = noise_clip(1.0, 4)
    assert texts(served(asr, [clip])) == texts(served(asr, [clip]))
    assert texts(served(asr, [clip])) != [""]


def test_audio_longer_than_whisper_hears_is_refused(asr):
    with pytest.raises(HandlerError, match="30 s"):
        served(asr, [noise_clip(31.0, 5)])


def test_each_decoded_token_is_a_point_to_yield_the_gpu_at(asr):
    """gpu_step() between the decoder's steps; the transcripts are those without it."""
    clips = [noise_clip(1.0, seed) for seed in range(2)]
    results, steps = yield_points(asr, clips)
    assert steps >= 1
    assert texts(results) == texts(served(asr, clips))
