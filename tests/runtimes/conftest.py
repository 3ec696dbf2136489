"""Inputs the runtime tests make themselves: speech that espeak-ng says, silence, files."""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile

from omni.instance.handler import Handler, HandlerError, set_gpu_done_callback
from omni.instance.validate import check_inputs, check_outputs
from omni.runtimes.audio import SAMPLE_RATE, decode_audio
from omni.runtimes.model_config import CONFIG_NAME

MAX_RESPONSE_BYTES = 64 << 20


def served(handler: Handler, batch: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """`handler.infer` as the worker calls it: each request checked against the declared
    inputs before, each result against the declared outputs after. A request refused in
    its place (a HandlerError returned) raises its error, as one raised would."""
    for request in batch:
        check_inputs(request, handler.inputs)
    results = handler.infer(batch)
    assert isinstance(results, list) and len(results) == len(batch)
    for refused in (r for r in results if isinstance(r, HandlerError)):
        raise refused
    return [check_outputs(result, handler.outputs, MAX_RESPONSE_BYTES) for result in results]


def yield_points(handler: Handler, batch: list[dict[str, np.ndarray]]) -> tuple[list, int]:
    """`served`, counting the handler's gpu_step() calls in the batch's GPU phase (the
    worker's yield gate; here a counter)."""
    steps: list[bool] = []
    set_gpu_done_callback(lambda: None, gate=lambda: steps.append(True))
    try:
        return served(handler, batch), len(steps)
    finally:
        set_gpu_done_callback(None)


def as_request(**tensors: bytes) -> dict[str, np.ndarray]:
    """One request whose tensors each hold one bytes element (BYTES [1])."""
    request = {}
    for name, value in tensors.items():
        request[name] = np.empty(1, dtype=object)
        request[name][0] = value
    return request


def wav_bytes(samples: np.ndarray, rate: int = SAMPLE_RATE) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def spoken(text: str, tmp_path: Path, voice: str = "en-us") -> np.ndarray:
    """`text` as espeak-ng says it, 16 kHz mono float samples."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is missing (`make espeak-ng` installs it)")
    path = tmp_path / "spoken.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", "130", "-w", str(path), text], check=True)
    return decode_audio(path.read_bytes())


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * SAMPLE_RATE), np.float32)


@pytest.fixture
def package_weights(tmp_path: Path) -> Path:
    """A model directory that asks for the weights the runtime's package ships."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / CONFIG_NAME).write_text('weights = "package"\n')
    return model_dir
