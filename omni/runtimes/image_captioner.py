"""Image captioning (image to text: a `VisionEncoderDecoderModel` such as ViT-GPT2, or
BLIP) through Hugging Face transformers' `AutoModelForImageTextToText`, the checkpoint's
image processor and tokenizer.

Input `image`: one PNG or JPEG file (BYTES [1], see images.py). Output `text`: the
caption (BYTES [1]).

The processor resizes every image to the encoder's one input size, and the requests of a
batch share one greedy `generate()` call: every caption starts from the same decoder
token, and a finished one is only padded while the others go on, so a request's caption
does not depend on its batch-mates (beyond float rounding, which could tip a near tie
between two tokens).

Weights: a model directory as transformers saves one (model, image processor and
tokenizer). Optional keys in omni-model.toml: `max_new_tokens` (the longest caption in
tokens, default 32), `max_pixels` (see images.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from omni.instance.handler import Answers, Handler, TensorSpec, each, together

from .images import max_pixels, read_image
from .model_config import read_model_config
from .tensors import bytes_tensor
from .token_steps import yielding

DEFAULT_MAX_NEW_TOKENS = 32


def caption(text: str) -> dict[str, np.ndarray]:
    return {"text": bytes_tensor(text.strip())}


class ImageCaptioner(Handler):
    inputs = (TensorSpec("image", "BYTES", (1,)),)
    outputs = (TensorSpec("text", "BYTES", (1,)),)
    max_batch_size = 16
    max_queue_delay_ms = 5.0

    def load(self, model_dir: Path, device: str) -> None:
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir)
        self.model.to(device).eval()
        self.device = device
        self.max_pixels = max_pixels(model_dir)
        limit = read_model_config(model_dir).get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        self.max_new_tokens = int(limit)

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        images = each(batch, partial(read_image, limit=self.max_pixels))
        texts = together(images, self.describe)  # the good images in one generate()
        return each(texts, caption)

    def describe(self, images: list[Image.Image]) -> list[str]:
        """Each image's caption, greedy."""
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            tokens = self.model.generate(
                pixel_values=pixels.to(self.device),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                num_beams=1,
                logits_processor=yielding(),
            )
        return self.tokenizer.batch_decode(tokens, skip_special_tokens=True)

    def unload(self) -> None:
        self.model = self.processor = self.tokenizer = None
