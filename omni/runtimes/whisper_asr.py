"""Speech recognition with a Whisper checkpoint, through Hugging Face transformers.

Input `audio`: one sound file (BYTES [1], see audio.py), at most 30 s (Whisper's window;
split longer recordings). Outputs `text`: the transcript (BYTES [1]); `duration`: the
clip's length in seconds (FP32 [1]).

The requests of a batch share one `generate()` call. Whisper pads every clip to the same
30 s of log-mel features, so batch-mates change no request's input, and greedy decoding
keeps each sequence's tokens its own: a result does not depend on its batch-mates (on
the CPU exactly; on a GPU in float16, kernels chosen by batch size may round differently,
which can, rarely, tip a near tie between two tokens).

Weights: a model directory as transformers saves one (`save_pretrained` of the model and
of its `WhisperProcessor`). No real Whisper weights ship on PyPI; to serve one, download
it yourself, e.g. `hf download openai/whisper-tiny --local-dir models/whisper-tiny`, and
point the catalog entry's model directory at it. Optional keys in omni-model.toml:
`language` (e.g. "en"; unset: detected per clip), `task` ("transcribe" or "translate"),
`max_new_tokens` (default 128).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import WhisperForConditionalGeneration, WhisperProcessor

from omni.instance.handler import Answers, Handler, HandlerError, TensorSpec, each, together

from .audio import SAMPLE_RATE, decode_audio
from .model_config import read_model_config
from .tensors import bytes_tensor, single_bytes
from .token_steps import yielding

MAX_SECONDS = 30.0  # Whisper's window: longer audio would be cut silently
PROMPT_TOKENS = 4  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>


def read_clip(request: dict[str, np.ndarray]) -> np.ndarray:
    """The request's audio, refused where Whisper would not hear all of it."""
    clip = decode_audio(single_bytes(request, "audio"))
    if clip.size / SAMPLE_RATE > MAX_SECONDS:
        raise HandlerError(f"audio: {clip.size / SAMPLE_RATE:.1f} s, at most 30 s")
    return clip


def generation_options(model_dir: Path) -> dict:
    """generate()'s keyword arguments, from the model's settings."""
    config = read_model_config(model_dir)
    options = {"max_new_tokens": int(config.get("max_new_tokens", 128)), "do_sample": False}
    for key in ("language", "task"):
        if key in config:
            options[key] = str(config[key])
    return options


def answer(text: str, clip: np.ndarray) -> dict[str, np.ndarray]:
    return {"text": bytes_tensor(text), "duration": np.array([clip.size / SAMPLE_RATE], np.float32)}


class WhisperASR(Handler):
    inputs = (TensorSpec("audio", "BYTES", (1,)),)
    outputs = (TensorSpec("text", "BYTES", (1,)), TensorSpec("duration", "FP32", (1,)))
    max_batch_size = 16
    max_queue_delay_ms = 5.0

    def load(self, model_dir: Path, device: str) -> None:
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        self.processor = WhisperProcessor.from_pretrained(model_dir)
        self.model = WhisperForConditionalGeneration.from_pretrained(model_dir)
        self.model.to(device, dtype).eval()
        self.device, self.dtype = device, dtype
        self.options = generation_options(model_dir)
        # room for the prompt (start, language, task, timestamps) in the decoder's positions
        room = self.model.config.max_target_positions - PROMPT_TOKENS
        self.options["max_new_tokens"] = min(self.options["max_new_tokens"], room)

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        clips = each(batch, read_clip)
        texts = together(clips, self.transcribe)  # the good clips at once
        return [
            text if isinstance(text, HandlerError) else answer(text, clip)
            for text, clip in zip(texts, clips, strict=True)
        ]

    def transcribe(self, clips: list[np.ndarray]) -> list[str]:
        """One transcript per 16 kHz mono clip, from one generate() call."""
        features = self.processor.feature_extractor(
            clips, sampling_rate=SAMPLE_RATE, return_tensors="pt"
        ).input_features.to(self.device, self.dtype)
        with torch.inference_mode():
            tokens = self.model.generate(features, logits_processor=yielding(), **self.options)
        texts = self.processor.batch_decode(tokens, skip_special_tokens=True)
        return [text.strip() for text in texts]

    def unload(self) -> None:
        self.model = self.processor = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
