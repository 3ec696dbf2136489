"""Decoding an uploaded sound file into the 16 kHz mono float PCM speech models take.

Any format libsndfile reads (WAV, FLAC, OGG/Vorbis, MP3 with libsndfile 1.1+) at any rate
and channel count; channels are averaged, and the rate changed with a polyphase filter.
"""

from __future__ import annotations

import io
from math import gcd

import numpy as np
import soundfile
from scipy.signal import resample_poly

from omni.instance.handler import HandlerError

SAMPLE_RATE = 16_000


def decode_audio(data: bytes, rate: int = SAMPLE_RATE) -> np.ndarray:
    """The file's sound as float32 samples in [-1, 1] at `rate`, one channel."""
    try:
        samples, file_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, TypeError) as e:  # libsndfile errors are RuntimeErrors
        raise HandlerError(f"audio: not a sound file libsndfile can read ({e})") from e
    if samples.size == 0:
        raise HandlerError("audio: the file holds no samples")
    mono = samples.mean(axis=1)
    if file_rate != rate:
        common = gcd(rate, file_rate)
        mono = resample_poly(mono, rate // common, file_rate // common)
    return np.ascontiguousarray(mono, dtype=np.float32)


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples as 16-bit PCM (clipped), for decoders that read integers."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype(np.int16)
