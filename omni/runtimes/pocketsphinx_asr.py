"""Speech recognition with CMU PocketSphinx and the US English model its wheel ships.

Input `audio`: one sound file (BYTES [1], see audio.py). Outputs `text`: the words
heard, lower case (BYTES [1]); `duration`: the clip's length in seconds (FP32 [1]). Those
tensors make it a transcription model: OpenAI's /v1/audio/transcriptions serves it
(omni/api/transcriptions.py has the rule). The decoder keeps state through an
utterance, so the requests of a batch are decoded one after another: no request's words
depend on another's.

Weights: `weights = "package"` in omni-model.toml takes the model in the `pocketsphinx`
wheel (acoustic model, trigram language model, pronouncing dictionary). Otherwise the
model directory holds its own, named by the keys `hmm` (acoustic model directory), `lm`
and `dict`, relative to the directory (defaults: "en-us", "en-us.lm.bin",
"cmudict-en-us.dict", the wheel's own layout).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pocketsphinx import Decoder, get_model_path

from omni.instance.handler import Answers, Handler, TensorSpec, each

from .audio import SAMPLE_RATE, decode_audio, to_int16
from .model_config import read_model_config, weights_from_package
from .tensors import bytes_tensor, single_bytes

DITHER_LEVEL, DITHER_SEED = 1e-3, 0
MODEL_FILES = {"hmm": "en-us", "lm": "en-us.lm.bin", "dict": "cmudict-en-us.dict"}


def model_files(model_dir: Path) -> dict[str, str]:
    """The acoustic model, language model and dictionary paths the decoder is given."""
    if weights_from_package(model_dir):
        root = Path(get_model_path()) / "en-us"
        return {key: str(root / name) for key, name in MODEL_FILES.items()}
    config = read_model_config(model_dir)
    paths = {key: Path(model_dir) / config.get(key, name) for key, name in MODEL_FILES.items()}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(f"pocketsphinx model files missing: {', '.join(missing)}")
    return {key: str(p) for key, p in paths.items()}


def dithered(samples: np.ndarray) -> np.ndarray:
    """The samples plus faint noise (-60 dB). Digital silence (runs of exact zeros, as
    synthesized or edited audio has) derails PocketSphinx's energy features; its own
    `dither` option draws from one random stream across utterances, which would make a
    result depend on what ran before, so the noise here is the same for every clip."""
    noise = np.random.default_rng(DITHER_SEED).standard_normal(samples.size)
    return samples + (DITHER_LEVEL * noise).astype(np.float32)


def transcribe(decoder: Decoder, samples: np.ndarray) -> str:
    """The best hypothesis for one utterance of 16 kHz mono samples."""
    decoder.start_utt()
    decoder.process_raw(to_int16(dithered(samples)).tobytes(), full_utt=True)
    decoder.end_utt()
    hypothesis = decoder.hyp()
    return hypothesis.hypstr if hypothesis is not None else ""


class PocketsphinxASR(Handler):
    inputs = (TensorSpec("audio", "BYTES", (1,)),)
    outputs = (TensorSpec("text", "BYTES", (1,)), TensorSpec("duration", "FP32", (1,)))
    max_batch_size = 8  # decoded one by one; batching only saves the queue's round trips

    def load(self, model_dir: Path, device: str) -> None:
        # CPU only: PocketSphinx has no GPU code.
        self.decoder = Decoder(
            **model_files(model_dir), samprate=float(SAMPLE_RATE), loglevel="FATAL"
        )

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        clips = each(batch, lambda request: decode_audio(single_bytes(request, "audio")))
        return each(
            clips,
            lambda clip: {
                "text": bytes_tensor(transcribe(self.decoder, clip)),
                "duration": np.array([clip.size / SAMPLE_RATE], np.float32),
            },
        )

    def unload(self) -> None:
        self.decoder = None
