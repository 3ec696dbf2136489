"""Voice-activity detection with Silero VAD, the TorchScript model its PyPI package ships.

Input `audio`: one sound file (BYTES [1], see audio.py). Output `segments`: where speech
is, as [start, end] in seconds (FP32 [n, 2]), from the package's own
`get_speech_timestamps` with its default thresholds. The model is recurrent and is reset
for each file, so the requests of a batch run one after another.

Runs on torch alone (no onnxruntime), on the CPU: the model is about 2 MB and runs a
32 ms window per step, which a GPU does not speed up.

Weights: `weights = "package"` in omni-model.toml takes the `silero_vad.jit` in the
`silero-vad` wheel; otherwise the model directory holds a `silero_vad.jit` of its own.
Optional keys: `threshold` (speech probability, default 0.5), `min_speech_ms` (250),
`min_silence_ms` (100), `speech_pad_ms` (30).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import torch

from omni.instance.handler import Answers, Handler, TensorSpec, each

from .audio import SAMPLE_RATE, decode_audio
from .model_config import read_model_config, weights_from_package
from .tensors import single_bytes

MODEL_FILE = "silero_vad.jit"

# silero_vad sets torch to one thread when imported: keep the process's own setting.
_threads = torch.get_num_threads()
silero_vad = importlib.import_module("silero_vad")
torch.set_num_threads(_threads)


def load_model(model_dir: Path) -> torch.jit.ScriptModule:
    if weights_from_package(model_dir):
        return silero_vad.load_silero_vad()
    path = Path(model_dir) / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f'{path}: no Silero VAD model (or set weights = "package")')
    return silero_vad.utils_vad.init_jit_model(str(path))


def detection_options(model_dir: Path) -> dict:
    """get_speech_timestamps' keyword arguments, from the model's settings."""
    config = read_model_config(model_dir)
    return {
        "threshold": float(config.get("threshold", 0.5)),
        "min_speech_duration_ms": int(config.get("min_speech_ms", 250)),
        "min_silence_duration_ms": int(config.get("min_silence_ms", 100)),
        "speech_pad_ms": int(config.get("speech_pad_ms", 30)),
    }


def speech_segments(model, samples: np.ndarray, options: dict) -> np.ndarray:
    """[start, end] seconds of each stretch of speech in 16 kHz mono samples."""
    found = silero_vad.get_speech_timestamps(
        torch.from_numpy(samples), model, sampling_rate=SAMPLE_RATE, **options
    )
    bounds = [(s["start"], s["end"]) for s in found]  # in samples: exact, not rounded
    return (np.array(bounds, dtype=np.float64).reshape(-1, 2) / SAMPLE_RATE).astype(np.float32)


class SileroVAD(Handler):
    inputs = (TensorSpec("audio", "BYTES", (1,)),)
    outputs = (TensorSpec("segments", "FP32", (-1, 2)),)
    max_batch_size = 8  # run one by one; batching only saves the queue's round trips

    def load(self, model_dir: Path, device: str) -> None:
        self.model = load_model(model_dir)
        self.options = detection_options(model_dir)

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        clips = each(batch, lambda request: decode_audio(single_bytes(request, "audio")))
        return each(clips, self.segments)

    def segments(self, clip: np.ndarray) -> dict[str, np.ndarray]:
        return {"segments": speech_segments(self.model, clip, self.options)}

    def unload(self) -> None:
        self.model = None
