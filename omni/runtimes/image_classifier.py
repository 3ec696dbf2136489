"""Image classification (ViT, ResNet, ConvNeXt... checkpoints) through Hugging Face
transformers' `AutoModelForImageClassification` and the checkpoint's image processor.

Input `image`: one PNG or JPEG file (BYTES [1], see images.py). Outputs `label`: the most
likely class's name (BYTES [1]), and `scores`: every class's probability (FP32
[num_labels], in the order of the model's `id2label`; softmax, or a sigmoid per class for
multi-label models).

The processor resizes every image to the model's one input size, so the requests of a
batch are stacked without padding and run as one forward pass (normalization layers in
eval mode use their stored statistics): a request's scores do not depend on its
batch-mates, beyond float rounding.

Weights: a model directory as transformers saves one (model and image processor).
Optional keys in omni-model.toml: `max_pixels` (see images.py), `gpu_dtype`
(model_config.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageClassification

from omni.instance.handler import Answers, Handler, TensorSpec, each, together

from .images import max_pixels, read_image
from .model_config import gpu_dtype
from .tensors import bytes_tensor


class ImageClassifier(Handler):
    inputs = (TensorSpec("image", "BYTES", (1,)),)
    outputs = (TensorSpec("label", "BYTES", (1,)), TensorSpec("scores", "FP32", (-1,)))
    max_batch_size = 16
    max_queue_delay_ms = 2.0

    def load(self, model_dir: Path, device: str) -> None:
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.model = AutoModelForImageClassification.from_pretrained(model_dir)
        self.dtype = getattr(torch, gpu_dtype(model_dir, device))
        self.model.to(device, self.dtype).eval()
        self.device = device
        self.max_pixels = max_pixels(model_dir)
        config = self.model.config
        self.labels = [config.id2label[i] for i in range(config.num_labels)]
        self.multi_label = config.problem_type == "multi_label_classification"

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        images = each(batch, partial(read_image, limit=self.max_pixels))
        scores = together(images, self.classify)  # the good images in one forward pass
        return each(scores, self.labelled)

    def labelled(self, scores: np.ndarray) -> dict[str, np.ndarray]:
        """One image's outputs from its class probabilities."""
        return {"label": bytes_tensor(self.labels[int(scores.argmax())]), "scores": scores}

    def classify(self, images: list[Image.Image]) -> np.ndarray:
        """Each image's class probabilities, [len(images), num_labels]."""
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            logits = self.model(pixel_values=pixels.to(self.device, self.dtype)).logits.float()
        probs = logits.sigmoid() if self.multi_label else logits.softmax(dim=-1)
        return probs.cpu().numpy()

    def unload(self) -> None:
        self.model = self.processor = None
