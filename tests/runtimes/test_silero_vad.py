"""Silero VAD's runtime gives what the silero-vad package gives bare, on real speech."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from omni.runtimes.audio import SAMPLE_RATE
from omni.runtimes.silero_vad_runtime import SileroVAD, silero_vad  # the package itself

from .conftest import as_request, served, silence, spoken, wav_bytes

PAD_S = 1.5  # silence each side of the speech


@pytest.fixture(scope="module")
def vad(tmp_path_factory) -> SileroVAD:
    model_dir = tmp_path_factory.mktemp("silero")
    (model_dir / "omni-model.toml").write_text('weights = "package"\n')
    handler = SileroVAD()
    handler.load(model_dir, "cpu")
    return handler


@pytest.fixture
def padded_speech(tmp_path: Path) -> tuple[bytes, float]:
    """A 16 kHz WAV: silence, a spoken sentence, silence; and the sentence's length (s)."""
    speech = spoken("voice activity detection finds the speech in a recording", tmp_path)
    samples = np.concatenate([silence(PAD_S), speech, silence(PAD_S)])
    return wav_bytes(samples), speech.size / SAMPLE_RATE


def bare_segments(wav: bytes) -> np.ndarray:
    """The package's own use: its model and get_speech_timestamps on the file's samples."""
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == SAMPLE_RATE
    model = silero_vad.load_silero_vad()
    found = silero_vad.get_speech_timestamps(torch.from_numpy(samples), model)
    return np.array([[s["start"], s["end"]] for s in found], dtype=np.float64) / SAMPLE_RATE


def test_segments_equal_the_package_run_bare(vad, padded_speech):
    wav, _ = padded_speech
    [result] = served(vad, [as_request(audio=wav)])
    expected = bare_segments(wav)
    assert result["segments"].dtype == np.float32 and result["segments"].shape[1] == 2
    np.testing.assert_allclose(result["segments"], expected, rtol=0, atol=1e-6)


def test_segments_cover_the_speech_and_not_the_silence(vad, padded_speech):
    wav, spoken_s = padded_speech
    [result] = served(vad, [as_request(audio=wav)])
    segments = result["segments"]
    assert len(segments) >= 1
    slack = 0.1  # the model's 32 ms windows and the package's 30 ms padding
    assert segments[0, 0] >= PAD_S - slack
    assert segments[-1, 1] <= PAD_S + spoken_s + slack
    covered = float((segments[:, 1] - segments[:, 0]).sum())
    assert covered >= 0.7 * spoken_s  # pauses between words may fall outside


def test_silence_has_no_segments_and_batch_mates_change_nothing(vad, padded_speech):
    wav, _ = padded_speech
    quiet = as_request(audio=wav_bytes(silence(2.0)))
    [alone] = served(vad, [as_request(audio=wav)])
    together = served(vad, [quiet, as_request(audio=wav), quiet])
    assert together[0]["segments"].shape == (0, 2)
    np.testing.assert_array_equal(together[1]["segments"], alone["segments"])


def test_resamples_a_file_at_another_rate(vad, padded_speech):
    wav, _ = padded_speech
    samples, _ = soundfile.read(io.BytesIO(wav), dtype="float32")
    [native] = served(vad, [as_request(audio=wav)])
    [stereo_48k] = served(vad, [as_request(audio=resampled_stereo(samples))])
    # the same speech found within a window's length (32 ms)
    assert stereo_48k["segments"].shape == native["segments"].shape
    np.testing.assert_allclose(stereo_48k["segments"], native["segments"], atol=0.05)


def resampled_stereo(samples: np.ndarray) -> bytes:
    from scipy.signal import resample_poly

    at_48k = resample_poly(samples, 3, 1).astype(np.float32)
    return wav_bytes(np.stack([at_48k, at_48k], axis=1), rate=48_000)


def test_weights_in_the_model_directory_give_the_same_segments(vad, padded_speech, tmp_path):
    wav, _ = padded_speech
    model_dir = tmp_path / "own-weights"
    model_dir.mkdir()
    shipped = Path(silero_vad.__file__).parent / "data" / "silero_vad.jit"
    (model_dir / "silero_vad.jit").write_bytes(shipped.read_bytes())
    own = SileroVAD()
    own.load(model_dir, "cpu")
    [from_dir] = served(own, [as_request(audio=wav)])
    [from_package] = served(vad, [as_request(audio=wav)])
    np.testing.assert_array_equal(from_dir["segments"], from_package["segments"])
