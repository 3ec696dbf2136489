"""Language identification with py3langid and the model its wheel ships: a naive Bayes
classifier over byte n-grams, trained on 139 languages (BSD-3-Clause).

Input `text`: one UTF-8 string (BYTES [1]). Outputs `label`: the most likely language's
ISO 639 code (BYTES [1]), and `scores`: every language's probability (FP32 [n], in the
order of the identifier's `labels`; py3langid's own calibrated softmax). Each text is
scored alone, so a request's answer never depends on its batch-mates.

Weights: `weights = "package"` in omni-model.toml takes the model in the `py3langid`
wheel; otherwise the model directory holds a `model.npz.xz` of its own (py3langid's
format, as its training pipeline writes it). Optional key: `languages`, the ISO 639
codes to choose among (default: every language the model knows).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from py3langid.langid import MODEL_FILE as PACKAGE_MODEL
from py3langid.langid import LanguageIdentifier

from omni.instance.handler import Answers, Handler, TensorSpec, each

from .model_config import read_model_config, weights_from_package
from .tensors import bytes_tensor, single_text

MODEL_FILE = "model.npz.xz"


def load_identifier(model_dir: Path) -> LanguageIdentifier:
    """The identifier, giving probabilities, over the languages the settings name."""
    if weights_from_package(model_dir):
        identifier = LanguageIdentifier.from_model_file(PACKAGE_MODEL, norm_probs=True)
    else:
        path = Path(model_dir) / MODEL_FILE
        if not path.is_file():
            raise FileNotFoundError(f'{path}: no py3langid model (or set weights = "package")')
        identifier = LanguageIdentifier.from_modelpath(path, norm_probs=True)
    languages = read_model_config(model_dir).get("languages")
    if languages is not None:
        identifier.set_languages([str(code) for code in languages])
    return identifier


def language_scores(identifier: LanguageIdentifier, text: str) -> np.ndarray:
    """Each language's probability for `text`, in the order of `identifier.labels`."""
    ranked = dict(identifier.rank(text))
    return np.array([ranked[label] for label in identifier.labels], dtype=np.float32)


class LanguageID(Handler):
    inputs = (TensorSpec("text", "BYTES", (1,)),)
    outputs = (TensorSpec("label", "BYTES", (1,)), TensorSpec("scores", "FP32", (-1,)))
    max_batch_size = 32  # scored one by one; batching only saves the queue's round trips

    def load(self, model_dir: Path, device: str) -> None:
        # CPU only: a sparse lookup and one small matrix product per text.
        self.identifier = load_identifier(model_dir)
        self.labels = self.identifier.labels

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        texts = each(batch, lambda request: single_text(request, "text"))
        return each(texts, self.identify)

    def identify(self, text: str) -> dict[str, np.ndarray]:
        """One text's outputs: the best language and every language's probability."""
        scores = language_scores(self.identifier, text)
        return {"label": bytes_tensor(self.labels[int(scores.argmax())]), "scores": scores}

    def unload(self) -> None:
        self.identifier = None
