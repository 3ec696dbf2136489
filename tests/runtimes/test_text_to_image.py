"""The text-to-image runtime on a tiny random Stable Diffusion pipeline made from configs
(tiny_diffusion.py). Random weights draw noise, so the tests check what the runtime owes:
a PNG of the size asked for, the pipeline's own image for the same seed, no dependence on
batch-mates, and bad requests refused alone."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from PIL import Image

from omni.instance.handler import HandlerError, set_gpu_done_callback
from omni.runtimes.model_config import CONFIG_NAME
from omni.runtimes.text_to_image import TextToImage, own_side

from .conftest import served
from .tiny_diffusion import SIDE, STEPS, save_tiny_pipeline

WIDTH, HEIGHT = 32, 24  # the model's configured size
GUIDANCE = 5.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    settings = f"steps = {STEPS}\nguidance = {GUIDANCE}\nwidth = {WIDTH}\nheight = {HEIGHT}\n"
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny-sd"), settings)


@pytest.fixture(scope="module")
def painter(model_dir: Path) -> TextToImage:
    handler = TextToImage()
    handler.load(model_dir, "cpu")
    return handler


def request(prompt: str, seed: int = 0, width: int = 0, height: int = 0) -> dict:
    text = np.empty(1, dtype=object)
    text[0] = prompt.encode()
    return {
        "prompt": text,
        "width": np.array([width], np.int32),
        "height": np.array([height], np.int32),
        "seed": np.array([seed], np.int64),
    }


def pixels(result: dict) -> np.ndarray:
    data = result["image"][0]
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_the_png_has_the_configured_size_or_the_one_asked_for(painter):
    assert pixels(served(painter, [request("a red square")])[0]).shape == (HEIGHT, WIDTH, 3)
    asked = served(painter, [request("a red square", width=40, height=16)])[0]
    assert pixels(asked).shape == (16, 40, 3)


def test_without_a_configured_size_the_pipelines_own_is_drawn(model_dir):
    assert own_side(StableDiffusionPipeline.from_pretrained(model_dir)) == SIDE


def test_an_image_is_the_pipelines_own_for_the_same_seed(painter, model_dir):
    pipe = StableDiffusionPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    for prompt, seed in (("a red square", 7), ("a blue circle", 123)):
        bare = pipe(
            prompt,
            width=WIDTH,
            height=HEIGHT,
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE,
            generator=torch.Generator().manual_seed(seed),
        ).images[0]
        got = pixels(served(painter, [request(prompt, seed)])[0])
        assert np.array_equal(got, np.asarray(bare))


def test_an_image_does_not_depend_on_its_batch_mates(painter):
    batch = [
        request("a red square", 1),
        request("a blue circle", 2, width=16, height=16),
        request("a red square", 3),
        request("a green line", 1),
    ]
    alone = [pixels(served(painter, [r])[0]) for r in batch]
    together = [pixels(result) for result in served(painter, batch)]
    for one, other in zip(alone, together, strict=True):
        assert one.shape == other.shape
        assert np.abs(one.astype(int) - other.astype(int)).max() <= 1  # (float rounding)
    assert not np.array_equal(alone[0], alone[2])  # another seed, another image
    assert not np.array_equal(alone[0], alone[3])  # another prompt, another image


def test_the_vae_decodes_a_batchs_images_one_at_a_time(painter, model_dir):
    """Decoding is a batch's largest working memory: one image at a time, unless the
    model's settings say otherwise."""
    rows: list[int] = []
    hook = painter.pipe.vae.decoder.register_forward_hook(lambda _m, x, _y: rows.append(len(x[0])))
    try:
        served(painter, [request("a red square", seed) for seed in range(3)])
    finally:
        hook.remove()
    assert rows == [1, 1, 1]
    settings = (model_dir / CONFIG_NAME).read_text()
    try:
        (model_dir / CONFIG_NAME).write_text(settings + "vae_slicing = false\n")
        together = TextToImage()
        together.load(model_dir, "cpu")
        assert not together.pipe.vae.use_slicing
        (model_dir / CONFIG_NAME).write_text(settings + 'vae_slicing = "no"\n')
        with pytest.raises(ValueError, match="vae_slicing = 'no'"):
            TextToImage().load(model_dir, "cpu")
    finally:
        (model_dir / CONFIG_NAME).write_text(settings)


def test_each_denoising_step_is_a_point_to_yield_the_gpu_at(painter):
    """gpu_step() after each step, in the batch's GPU phase: a hotter model's request on
    the GPU goes first there (the worker's gate; here a counter)."""
    steps = []
    set_gpu_done_callback(lambda: None, gate=lambda: steps.append(True))
    try:
        served(painter, [request("a red square"), request("a blue circle")])
    finally:
        set_gpu_done_callback(None)
    assert len(steps) == STEPS


def test_the_gpu_work_is_marked_done_before_the_png_encoding(painter):
    calls = []
    set_gpu_done_callback(lambda: calls.append(True))
    try:
        served(painter, [request("a red square"), request("a blue circle")])
    finally:
        set_gpu_done_callback(None)
    assert calls == [True]


def test_bad_requests_are_refused_alone(painter):
    with pytest.raises(HandlerError, match="prompt"):
        served(painter, [request(" ")])
    with pytest.raises(HandlerError, match="width"):
        served(painter, [request("a red square", width=30)])
    with pytest.raises(HandlerError, match="height"):
        served(painter, [request("a red square", height=4096)])
    with pytest.raises(HandlerError, match="seed"):
        served(painter, [request("a red square", seed=-1)])
    results = painter.infer([request(""), request("a red square", 5)])
    assert isinstance(results[0], HandlerError) and "prompt" in str(results[0])
    assert np.array_equal(
        pixels(results[1]), pixels(served(painter, [request("a red square", 5)])[0])
    )


def test_its_weights_are_every_model_of_the_pipeline(painter):
    """The pipeline is not a torch module: the handler names its models' tensors (text
    encoder, denoiser, VAE) for the worker to declare read-only on a GPU."""
    models = [m for m in painter.pipe.components.values() if isinstance(m, torch.nn.Module)]
    assert len(models) == 3
    want = {t.data_ptr() for m in models for t in [*m.parameters(), *m.buffers()]}
    assert {t.data_ptr() for t in painter.weights()} == want
