"""The image-classification runtime on a tiny random ViT (and a ResNet), against the same
model run bare with transformers, on scikit-image's photographs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoImageProcessor,
    AutoModelForImageClassification,
    ConvNextImageProcessor,
    ResNetConfig,
    ResNetForImageClassification,
)

from omni.instance.handler import HandlerError
from omni.instance.validate import TensorError
from omni.runtimes.image_classifier import ImageClassifier
from omni.runtimes.model_config import CONFIG_NAME

from .conftest import as_request, served
from .vision import (
    CLASSES,
    PHOTOS,
    answered,
    bad_files,
    decoded,
    encoded,
    labelled,
    photo,
    save_tiny_classifier,
)

MAX_PIXELS = 80 * 80  # the photos are 80 pixels wide, at most as tall


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = save_tiny_classifier(tmp_path_factory.mktemp("tiny-vit"))
    (out / CONFIG_NAME).write_text(f"max_pixels = {MAX_PIXELS}\n")
    return out


@pytest.fixture(scope="module")
def classifier(model_dir: Path) -> ImageClassifier:
    handler = ImageClassifier()
    handler.load(model_dir, "cpu")
    return handler


def bare_scores(model_dir: Path, file: bytes) -> np.ndarray:
    """transformers' plain use, one image at a time."""
    processor = AutoImageProcessor.from_pretrained(model_dir)
    model = AutoModelForImageClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(**processor(images=decoded(file), return_tensors="pt")).logits
    return logits.softmax(dim=-1)[0].numpy()


FORMATS = {"astronaut": "PNG", "chelsea": "JPEG", "coffee": "PNG", "rocket": "JPEG"}
FILES = {name: encoded(photo(name), FORMATS[name]) for name in PHOTOS}


def test_scores_equal_the_model_run_bare_and_label_is_the_best(classifier, model_dir):
    results = served(classifier, [as_request(image=f) for f in FILES.values()])
    for file, result in zip(FILES.values(), results, strict=True):
        assert result["scores"].dtype == np.float32 and result["scores"].shape == (len(CLASSES),)
        assert result["label"].dtype == object and result["label"].shape == (1,)
        np.testing.assert_allclose(result["scores"], bare_scores(model_dir, file), atol=1e-5)
        assert result["label"][0].decode() == CLASSES[int(result["scores"].argmax())]
    spread = np.ptp([r["scores"] for r in results], axis=0)
    assert spread.max() > 0.05  # the photos are told apart


def test_one_forward_pass_per_batch_and_batch_mates_change_nothing(classifier):
    calls = []
    hook = classifier.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        together = served(classifier, [as_request(image=f) for f in FILES.values()][::-1])[::-1]
    finally:
        hook.remove()
    assert len(calls) == 1
    for file, batched in zip(FILES.values(), together, strict=True):
        [alone] = served(classifier, [as_request(image=file)])
        np.testing.assert_allclose(batched["scores"], alone["scores"], atol=1e-5)


def test_bad_files_fail_alone_naming_the_image(classifier):
    good = as_request(image=FILES["astronaut"])
    [alone] = served(classifier, [good])
    too_large = encoded(photo("astronaut", width=81))
    bad = [*bad_files().values(), too_large]
    results = answered(classifier, [good, *(as_request(image=f) for f in bad), good])
    for refused in results[1:-1]:
        assert isinstance(refused, HandlerError) and str(refused).startswith("image: "), refused
    assert "at most 6400" in str(results[-2])
    for result in (results[0], results[-1]):
        np.testing.assert_allclose(result["scores"], alone["scores"], atol=1e-5)


def test_a_wrong_tensor_is_refused_before_the_handler(classifier):
    with pytest.raises(TensorError, match="'image' has dtype float32, not BYTES"):
        served(classifier, [{"image": np.zeros(1, np.float32)}])


def test_a_resnet_with_its_own_processor_scores_as_run_bare(tmp_path):
    """A convolutional checkpoint: resized and centre-cropped by ConvNeXt's processor."""
    config = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], **labelled(CLASSES)
    )
    torch.manual_seed(0)
    ResNetForImageClassification(config).save_pretrained(tmp_path)
    ConvNextImageProcessor(size={"shortest_edge": 32}).save_pretrained(tmp_path)
    handler = ImageClassifier()
    handler.load(tmp_path, "cpu")
    results = served(handler, [as_request(image=f) for f in FILES.values()])
    for file, result in zip(FILES.values(), results, strict=True):
        np.testing.assert_allclose(result["scores"], bare_scores(tmp_path, file), atol=1e-5)


def test_its_weights_are_its_model_s_parameters_and_buffers(classifier):
    """What the worker declares read-only on a GPU (Handler.weights()'s default: the torch
    modules among the handler's attributes)."""
    model = classifier.model
    want = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert want and {t.data_ptr() for t in classifier.weights()} == want
