"""The language-identification runtime gives what py3langid gives bare, on real sentences,
with the model its wheel ships."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import py3langid
import pytest
from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier

from omni.instance.handler import HandlerError
from omni.runtimes.language_id import LanguageID
from omni.runtimes.model_config import CONFIG_NAME

from .conftest import as_request, served

SENTENCES = {
    "en": "The weather is lovely today, so we are going for a long walk in the park.",
    "fr": "Le temps est magnifique aujourd'hui, alors nous allons nous promener au parc.",
    "de": "Das Wetter ist heute herrlich, also machen wir einen langen Spaziergang im Park.",
    "es": "Hoy hace un tiempo estupendo, así que vamos a dar un largo paseo por el parque.",
    "it": "Oggi il tempo è bellissimo, quindi andiamo a fare una lunga passeggiata nel parco.",
    "nl": "Het weer is vandaag prachtig, dus we gaan een lange wandeling maken in het park.",
    "ru": "Сегодня прекрасная погода, поэтому мы идём на долгую прогулку в парк.",
    "ja": "今日はとても良い天気なので、公園を長い時間散歩するつもりです。",
}


def load(model_dir: Path) -> LanguageID:
    handler = LanguageID()
    handler.load(model_dir, "cpu")
    return handler


@pytest.fixture(scope="module")
def langid(tmp_path_factory) -> LanguageID:
    model_dir = tmp_path_factory.mktemp("langid")
    (model_dir / CONFIG_NAME).write_text('weights = "package"\n')
    return load(model_dir)


def requests(texts) -> list[dict]:
    return [as_request(text=t.encode()) for t in texts]


@functools.cache
def bare_identifier() -> LanguageIdentifier:
    """py3langid's documented way to probabilities: an identifier with norm_probs."""
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def bare_probabilities(text: str) -> dict[str, float]:
    return dict(bare_identifier().rank(text))


def test_labels_and_scores_equal_the_package_run_bare(langid):
    results = served(langid, requests(SENTENCES.values()))
    for (language, text), result in zip(SENTENCES.items(), results, strict=True):
        label = result["label"][0].decode()
        assert label == language == py3langid.classify(text)[0]
        assert result["scores"].dtype == np.float32
        assert result["scores"].shape == (len(langid.labels),)
        bare = bare_probabilities(text)
        expected = np.array([bare[code] for code in langid.labels], dtype=np.float32)
        np.testing.assert_allclose(result["scores"], expected, atol=1e-6)
        assert result["scores"].sum() == pytest.approx(1.0, abs=1e-4)


def test_answers_do_not_depend_on_batch_mates(langid):
    texts = list(SENTENCES.values())
    alone = [served(langid, requests([t]))[0] for t in texts]
    together = served(langid, requests(texts[::-1]))[::-1]
    for one, batched in zip(alone, together, strict=True):
        assert batched["label"][0] == one["label"][0]
        np.testing.assert_array_equal(batched["scores"], one["scores"])


def test_languages_key_restricts_the_choice(tmp_path):
    (tmp_path / CONFIG_NAME).write_text('weights = "package"\nlanguages = ["de", "nl"]\n')
    handler = load(tmp_path)
    assert handler.labels == ["de", "nl"]
    [result] = served(handler, requests([SENTENCES["de"]]))
    assert result["label"][0] == b"de" and result["scores"].shape == (2,)


def test_a_model_file_of_its_own_is_read_from_the_directory(tmp_path, langid):
    shutil.copy(MODEL_DIR / MODEL_FILE, tmp_path / "model.npz.xz")
    [result] = served(load(tmp_path), requests([SENTENCES["fr"]]))
    [expected] = served(langid, requests([SENTENCES["fr"]]))
    assert result["label"][0] == b"fr"
    np.testing.assert_array_equal(result["scores"], expected["scores"])


def test_a_directory_without_a_model_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no py3langid model"):
        load(tmp_path)


def test_text_that_is_not_utf8_is_a_bad_request(langid):
    with pytest.raises(HandlerError, match="UTF-8"):
        served(langid, [as_request(text=b"\xff\xfe bad")])


def test_a_bad_text_fails_alone_in_its_batch(langid):
    bad, good = as_request(text=b"\xff\xfe bad"), requests([SENTENCES["it"]])[0]
    refused, answered = langid.infer([bad, good])
    assert isinstance(refused, HandlerError) and "UTF-8" in str(refused)
    assert answered["label"][0] == b"it"
