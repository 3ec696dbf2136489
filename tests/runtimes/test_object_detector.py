"""The object-detection runtime on a tiny random DETR (transformers' own ResNet backbone, no
timm), against the same model run bare with transformers, on scikit-image's photographs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, DetrForObjectDetection

from omni.instance.handler import HandlerError
from omni.instance.validate import TensorError
from omni.runtimes.model_config import CONFIG_NAME
from omni.runtimes.object_detector import DEFAULT_THRESHOLD, ObjectDetector

from .conftest import as_request, served
from .vision import (
    OBJECTS,
    PHOTOS,
    answered,
    bad_files,
    decoded,
    encoded,
    photo,
    save_tiny_detector,
)

MAX_PIXELS = 80 * 80  # the photos are 80 pixels wide, at most as tall
FILES = {name: encoded(photo(name)) for name in PHOTOS}  # 80x80 and three of 80x53


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_detector(tmp_path_factory.mktemp("tiny-detr"))


def detector(checkpoint: Path, settings: str, device: str = "cpu") -> ObjectDetector:
    (checkpoint / CONFIG_NAME).write_text(settings)
    handler = ObjectDetector()
    handler.load(checkpoint, device)
    return handler


@pytest.fixture(scope="module")
def default(checkpoint: Path) -> ObjectDetector:
    return detector(checkpoint, f"max_pixels = {MAX_PIXELS}\n")


def bare_objects(checkpoint: Path, file: bytes, threshold: float) -> dict:
    """transformers' plain use, one image at a time."""
    processor = AutoImageProcessor.from_pretrained(checkpoint)
    model = DetrForObjectDetection.from_pretrained(checkpoint).eval()
    image = decoded(file)
    with torch.no_grad():
        outputs = model(**processor(images=image, return_tensors="pt"))
    sizes = [(image.height, image.width)]
    [found] = processor.post_process_object_detection(outputs, threshold, target_sizes=sizes)
    return found


def assert_same_objects(result: dict, bare: dict) -> None:
    np.testing.assert_allclose(result["boxes"], bare["boxes"].numpy(), atol=1e-3)
    np.testing.assert_allclose(result["scores"], bare["scores"].numpy(), atol=1e-5)
    assert [label.decode() for label in result["labels"]] == [
        OBJECTS[int(i)] for i in bare["labels"]
    ]


def test_objects_equal_the_model_run_bare_in_pixels_of_the_file(default, checkpoint):
    results = served(default, [as_request(image=f) for f in FILES.values()])
    for file, result in zip(FILES.values(), results, strict=True):
        n = len(result["scores"])
        assert n > 0 and result["boxes"].shape == (n, 4) and result["labels"].shape == (n,)
        assert result["boxes"].dtype == result["scores"].dtype == np.float32
        assert result["labels"].dtype == object
        assert_same_objects(result, bare_objects(checkpoint, file, DEFAULT_THRESHOLD))
        x1, y1, x2, y2 = result["boxes"].T  # corners (a random DETR's may pass the edges)
        assert (x1 <= x2).all() and (y1 <= y2).all()


def test_the_threshold_setting_keeps_only_objects_scored_past_it(checkpoint):
    strict = detector(checkpoint, "threshold = 0.75\n")
    file = FILES["astronaut"]
    [result] = served(strict, [as_request(image=file)])
    everything = bare_objects(checkpoint, file, 0.0)
    assert 0 < len(result["scores"]) < len(everything["scores"])
    assert (result["scores"] > 0.75).all()
    assert_same_objects(result, bare_objects(checkpoint, file, 0.75))
    nothing = detector(checkpoint, "threshold = 1.0\n")
    [empty] = served(nothing, [as_request(image=file)])
    assert empty["boxes"].shape == (0, 4) and empty["scores"].shape == empty["labels"].shape == (0,)


def test_one_forward_pass_per_size_and_batch_mates_change_nothing(default):
    calls = []
    hook = default.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        together = served(default, [as_request(image=f) for f in FILES.values()][::-1])[::-1]
    finally:
        hook.remove()
    assert len(calls) == 2  # one of 80x80, three of 80x53
    for file, batched in zip(FILES.values(), together, strict=True):
        [alone] = served(default, [as_request(image=file)])
        np.testing.assert_allclose(batched["boxes"], alone["boxes"], atol=1e-4)
        np.testing.assert_allclose(batched["scores"], alone["scores"], atol=1e-5)
        np.testing.assert_array_equal(batched["labels"], alone["labels"])


def test_bad_files_fail_alone_naming_the_image(default):
    good = as_request(image=FILES["chelsea"])
    [alone] = served(default, [good])
    too_large = encoded(photo("astronaut", width=81))
    bad = [*bad_files().values(), too_large]
    results = answered(default, [good, *(as_request(image=f) for f in bad), good])
    for refused in results[1:-1]:
        assert isinstance(refused, HandlerError) and str(refused).startswith("image: "), refused
    assert "at most 6400" in str(results[-2])
    for result in (results[0], results[-1]):
        np.testing.assert_allclose(result["scores"], alone["scores"], atol=1e-5)


def test_a_wrong_tensor_is_refused_before_the_handler(default):
    with pytest.raises(TensorError, match="'image' has shape"):
        served(default, [{"image": np.array([b"a", b"b"], dtype=object)}])


def test_gpu_dtype_is_checked_and_the_cpu_keeps_float32(checkpoint):
    with pytest.raises(ValueError, match="gpu_dtype = 'float64', expected one of"):
        detector(checkpoint, 'gpu_dtype = "float64"\n')
    half = detector(checkpoint, 'gpu_dtype = "float16"\n')
    assert next(half.model.parameters()).dtype == torch.float32
    file = FILES["astronaut"]
    [result] = served(half, [as_request(image=file)])
    assert_same_objects(result, bare_objects(checkpoint, file, DEFAULT_THRESHOLD))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_on_the_gpu_finds_what_float32_finds(checkpoint, dtype):
    """Every query's score and box (threshold 0 keeps them all, in query order)."""
    full = detector(checkpoint, "threshold = 0.0\n", "cuda")
    half = detector(checkpoint, f'threshold = 0.0\ngpu_dtype = "{dtype}"\n', "cuda")
    assert next(half.model.parameters()).dtype == getattr(torch, dtype)
    for file in FILES.values():
        [want] = served(full, [as_request(image=file)])
        [got] = served(half, [as_request(image=file)])
        assert got["scores"].dtype == np.float32 and len(got["scores"]) == len(want["scores"])
        np.testing.assert_allclose(got["scores"], want["scores"], atol=3e-2)
        np.testing.assert_allclose(got["boxes"], want["boxes"], atol=1.5)
