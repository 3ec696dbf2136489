"""The image-captioning runtime on tiny random ViT-GPT2 (a VisionEncoderDecoderModel) and
BLIP checkpoints over a word-level tokenizer, against the same model run bare with
transformers, on scikit-image's photographs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from omni.instance.handler import HandlerError
from omni.instance.validate import TensorError
from omni.runtimes.image_captioner import ImageCaptioner
from omni.runtimes.model_config import CONFIG_NAME

from .conftest import as_request, served, yield_points
from .vision import (
    PHOTOS,
    WORDS,
    answered,
    bad_files,
    decoded,
    encoded,
    photo,
    save_tiny_blip,
    save_tiny_captioner,
)

MAX_NEW_TOKENS = 6
MAX_PIXELS = 80 * 80  # the photos are 80 pixels wide, at most as tall
FILES = {name: encoded(photo(name), "JPEG") for name in PHOTOS}
CHECKPOINTS = {"vit-gpt2": save_tiny_captioner, "blip": save_tiny_blip}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def model_dir(request, tmp_path_factory) -> Path:
    out = CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))
    (out / CONFIG_NAME).write_text(
        f"max_new_tokens = {MAX_NEW_TOKENS}\nmax_pixels = {MAX_PIXELS}\n"
    )
    return out


@pytest.fixture(scope="module")
def captioner(model_dir: Path) -> ImageCaptioner:
    handler = ImageCaptioner()
    handler.load(model_dir, "cpu")
    return handler


def bare_caption(model_dir: Path, file: bytes) -> str:
    """transformers' plain use, one image at a time, greedy."""
    processor = AutoImageProcessor.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    pixels = processor(images=decoded(file), return_tensors="pt").pixel_values
    with torch.no_grad():
        tokens = model.generate(pixels, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return tokenizer.decode(tokens[0], skip_special_tokens=True)


def test_captions_equal_the_model_run_bare(captioner, model_dir):
    results = served(captioner, [as_request(image=f) for f in FILES.values()])
    for file, result in zip(FILES.values(), results, strict=True):
        assert result["text"].dtype == object and result["text"].shape == (1,)
        text = result["text"][0].decode()
        assert text == bare_caption(model_dir, file)
        assert 0 < len(text.split()) <= MAX_NEW_TOKENS and set(text.split()) <= set(WORDS)
    assert len({r["text"][0] for r in results}) > 1  # the photos are told apart


def test_one_generate_per_batch_and_batch_mates_change_nothing(captioner, monkeypatch):
    calls = []
    generate = captioner.model.generate
    monkeypatch.setattr(captioner.model, "generate", lambda **kw: calls.append(1) or generate(**kw))
    together = served(captioner, [as_request(image=f) for f in FILES.values()][::-1])[::-1]
    assert len(calls) == 1
    for file, batched in zip(FILES.values(), together, strict=True):
        [alone] = served(captioner, [as_request(image=file)])
        assert batched["text"][0] == alone["text"][0]


def test_bad_files_fail_alone_naming_the_image(captioner):
    good = as_request(image=FILES["rocket"])
    [alone] = served(captioner, [good])
    too_large = encoded(photo("astronaut", width=81))
    bad = [*bad_files().values(), too_large]
    results = answered(captioner, [good, *(as_request(image=f) for f in bad), good])
    for refused in results[1:-1]:
        assert isinstance(refused, HandlerError) and str(refused).startswith("image: "), refused
    assert "at most 6400" in str(results[-2])
    assert results[0]["text"][0] == results[-1]["text"][0] == alone["text"][0]


def test_a_wrong_tensor_is_refused_before_the_handler(captioner):
    with pytest.raises(TensorError, match=r"unknown input 'picture'; this model takes \['image'\]"):
        served(captioner, [{"picture": np.array([b"a"], dtype=object)}])


def test_each_decoded_token_is_a_point_to_yield_the_gpu_at(captioner):
    """gpu_step() between the decoder's steps; the captions are those without it."""
    batch = [as_request(image=f) for f in FILES.values()]
    results, steps = yield_points(captioner, batch)
    assert steps >= 1
    assert [r["text"][0] for r in results] == [r["text"][0] for r in served(captioner, batch)]
