"""Text classification (sentiment, toxicity, topic...) with a sequence-classification
checkpoint, through Hugging Face transformers.

Input `text`: one UTF-8 string (BYTES [1]). Outputs `label`: the most likely class's
name (BYTES [1]), and `scores`: every class's probability (FP32 [num_labels], in the
order of the model's `id2label`; softmax, or a sigmoid per class for multi-label models
such as toxicity ones).

The requests of a batch are padded to the longest and run as one forward pass; the
attention mask keeps padding out of every real token's attention, so a request's scores
do not depend on its batch-mates (beyond float rounding, about 1e-6).

Weights: a model directory as transformers saves one (model and tokenizer). Optional key
in omni-model.toml: `max_length` (tokens kept of each text, default the tokenizer's limit
or 512).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from omni.instance.handler import Answers, Handler, TensorSpec, each, together

from .model_config import read_model_config
from .tensors import bytes_tensor, single_text

DEFAULT_MAX_LENGTH = 512


class TextClassifier(Handler):
    inputs = (TensorSpec("text", "BYTES", (1,)),)
    outputs = (TensorSpec("label", "BYTES", (1,)), TensorSpec("scores", "FP32", (-1,)))
    max_batch_size = 32
    max_queue_delay_ms = 2.0

    def load(self, model_dir: Path, device: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir)
        self.model.to(device).eval()
        self.device = device
        limit = min(self.tokenizer.model_max_length, DEFAULT_MAX_LENGTH)
        self.max_length = int(read_model_config(model_dir).get("max_length", limit))
        config = self.model.config
        self.labels = [config.id2label[i] for i in range(config.num_labels)]
        self.multi_label = config.problem_type == "multi_label_classification"

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        texts = each(batch, lambda request: single_text(request, "text"))
        scores = together(texts, self.classify)  # the good texts in one forward pass
        return each(scores, self.labelled)

    def labelled(self, scores: np.ndarray) -> dict[str, np.ndarray]:
        """One text's outputs from its class probabilities."""
        return {"label": bytes_tensor(self.labels[int(scores.argmax())]), "scores": scores}

    def classify(self, texts: list[str]) -> np.ndarray:
        """Each text's class probabilities, [len(texts), num_labels]."""
        encoded = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode():
            logits = self.model(**encoded).logits.float()
        probs = logits.sigmoid() if self.multi_label else logits.softmax(dim=-1)
        return probs.cpu().numpy()

    def unload(self) -> None:
        self.model = self.tokenizer = None
