"""PocketSphinx's runtime hears a sentence espeak-ng says, with the wheel's real model."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni.instance.handler import HandlerError
from omni.runtimes.pocketsphinx_asr import PocketsphinxASR

from .conftest import as_request, served, silence, spoken, wav_bytes

SENTENCE = "hello world this is a test of speech recognition"


@pytest.fixture(scope="module")
def asr(tmp_path_factory) -> PocketsphinxASR:
    model_dir = tmp_path_factory.mktemp("pocketsphinx")
    (model_dir / "omni-model.toml").write_text('weights = "package"\n')
    handler = PocketsphinxASR()
    handler.load(model_dir, "cpu")
    return handler


def transcript(result: dict) -> str:
    return result["text"][0].decode()


def test_transcribes_most_words_of_a_spoken_sentence(asr, tmp_path: Path):
    # the Klatt voice: espeak-ng's default one is far from any speaker the model knows
    speech = spoken(SENTENCE, tmp_path, voice="en-us+klatt")
    [result] = served(asr, [as_request(audio=wav_bytes(speech))])
    heard = set(transcript(result).split())
    assert sum(word in heard for word in SENTENCE.split()) >= 6, transcript(result)


def test_a_result_does_not_depend_on_its_batch_mates(asr, tmp_path: Path):
    speech = as_request(audio=wav_bytes(spoken("good morning", tmp_path)))
    quiet = as_request(audio=wav_bytes(silence(1.0)))
    [alone] = served(asr, [speech])
    together = served(asr, [quiet, speech])
    assert transcript(together[1]) == transcript(alone)
    assert transcript(together[0]) == ""


def test_a_file_that_is_not_audio_is_a_bad_request(asr):
    with pytest.raises(HandlerError, match="audio"):
        served(asr, [as_request(audio=b"not a sound file")])


def test_a_model_directory_in_the_wheels_layout_is_read(asr, tmp_path: Path):
    from pocketsphinx import get_model_path

    model_dir = tmp_path / "own-model"
    model_dir.mkdir()
    for name in ("en-us", "en-us.lm.bin", "cmudict-en-us.dict"):
        (model_dir / name).symlink_to(Path(get_model_path()) / "en-us" / name)
    own = PocketsphinxASR()
    own.load(model_dir, "cpu")
    request = as_request(audio=wav_bytes(spoken("good morning", tmp_path)))
    assert transcript(served(own, [request])[0]) == transcript(served(asr, [request])[0])


def test_a_model_directory_missing_files_says_which(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"en-us\.lm\.bin"):
        PocketsphinxASR().load(tmp_path, "cpu")


def test_an_empty_sound_file_is_a_bad_request(asr):
    with pytest.raises(HandlerError, match="no samples"):
        served(asr, [as_request(audio=wav_bytes(silence(0.0)))])
