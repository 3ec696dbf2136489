"""Object detection with a DETR-style checkpoint (DETR, Conditional DETR, YOLOS...) through
Hugging Face transformers' `AutoModelForObjectDetection` and its image processor's
`post_process_object_detection`.

Input `image`: one PNG or JPEG file (BYTES [1], see images.py). Outputs `boxes`: each
object as [x1, y1, x2, y2] in the file's pixels (FP32 [n, 4]), `scores`: each one's
probability (FP32 [n]), `labels`: each one's class name (BYTES [n]); all empty where
nothing scores past the threshold.

These processors keep an image's aspect ratio, and pad the images of one call to the
largest: padding would change what the backbone's convolutions see at a smaller image's
edges. So the images of a batch are processed one by one, and those that come out the
same size run as one forward pass: a request's objects do not depend on its batch-mates,
beyond float rounding.

Weights: a model directory as transformers saves one (model and image processor).
Optional keys in omni-model.toml: `threshold` (the least score of an object kept,
default 0.5, as transformers' pipeline), `max_pixels` (see images.py), `gpu_dtype`
(model_config.py: DETR's batch of 8 images at 800x1066 holds about 2 GiB in float32).
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForObjectDetection, BatchFeature

from omni.instance.handler import Answers, Handler, TensorSpec, each, together

from .images import max_pixels, read_image
from .model_config import gpu_dtype, read_model_config

DEFAULT_THRESHOLD = 0.5


def same_size(features: list[BatchFeature]) -> list[list[int]]:
    """The indices of `features`, grouped by their pixel tensor's shape."""
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, feature in enumerate(features):
        groups[tuple(feature["pixel_values"].shape)].append(i)
    return list(groups.values())


def stacked(features: list[BatchFeature]) -> dict[str, torch.Tensor]:
    """Same-size processed images as one batch."""
    return {key: torch.cat([f[key] for f in features]) for key in features[0]}


class ObjectDetector(Handler):
    inputs = (TensorSpec("image", "BYTES", (1,)),)
    outputs = (
        TensorSpec("boxes", "FP32", (-1, 4)),
        TensorSpec("scores", "FP32", (-1,)),
        TensorSpec("labels", "BYTES", (-1,)),
    )
    max_batch_size = 8
    max_queue_delay_ms = 2.0

    def load(self, model_dir: Path, device: str) -> None:
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.model = AutoModelForObjectDetection.from_pretrained(model_dir)
        self.dtype = getattr(torch, gpu_dtype(model_dir, device))
        self.model.to(device, self.dtype).eval()
        self.device = device
        self.max_pixels = max_pixels(model_dir)
        self.threshold = float(read_model_config(model_dir).get("threshold", DEFAULT_THRESHOLD))
        self.id2label = self.model.config.id2label

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        images = each(batch, partial(read_image, limit=self.max_pixels))
        return together(images, self.detect)

    def detect(self, images: list[Image.Image]) -> list[dict[str, np.ndarray]]:
        """Each image's objects, one forward pass per size the processor makes."""
        features = [self.processor(images=image, return_tensors="pt") for image in images]
        found: list[dict[str, np.ndarray]] = [{} for _ in images]
        for group in same_size(features):
            batch = stacked([features[i] for i in group])
            with torch.inference_mode():
                outputs = self.model(**{k: self.to_model(v) for k, v in batch.items()})
            sizes = [images[i].size[::-1] for i in group]  # (height, width) each
            kept = self.processor.post_process_object_detection(
                outputs, threshold=self.threshold, target_sizes=sizes
            )
            for i, objects in zip(group, kept, strict=True):
                found[i] = self.answer(objects)
        return found

    def to_model(self, tensor: torch.Tensor) -> torch.Tensor:
        """A processed input on the model's device; pixels in its dtype (the mask stays)."""
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(self.device, dtype)

    def answer(self, objects: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """One image's outputs from what post-processing kept."""
        labels = np.empty(len(objects["labels"]), dtype=object)
        labels[:] = [self.id2label[int(i)].encode() for i in objects["labels"]]
        return {
            "boxes": objects["boxes"].float().cpu().numpy().reshape(-1, 4),
            "scores": objects["scores"].float().cpu().numpy(),
            "labels": labels,
        }

    def unload(self) -> None:
        self.model = self.processor = None
