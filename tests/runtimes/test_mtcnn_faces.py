"""The MTCNN runtime finds the astronaut's face in scikit-image's portrait, as
facenet-pytorch's MTCNN does run bare, with the weights the facenet-pytorch wheel ships;
through the worker's batcher, a file that is not an image fails alone.

facenet-pytorch pins torch<2.3 and numpy<2, which it does not need for detection: as a
model's own environment would, it is installed with --no-deps into a folder of its own,
with the torchvision released with this torch, and that folder is put on the path. Where
that torchvision's compiled ops do not load (PyPI's CUDA build beside a CPU-only torch),
the runtime's plain-torch NMS stands in (test_torchvision_nms.py checks it), for the
served run and the bare one alike. The install takes about 6 s the first time.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from skimage import data

from omni.instance.batcher import Batcher, InferError
from omni.instance.validate import check_outputs

from .conftest import MAX_RESPONSE_BYTES, as_request, served

REPO = Path(__file__).resolve().parents[2]
FACENET = "facenet-pytorch==2.6.0"


def matching_torchvision() -> str:
    """torchvision is released in step with torch: 2.N pairs with 0.(N+15)."""
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return f"torchvision==0.{minor + 15}.*" if major == 2 else "torchvision"


def facenet_env() -> Path:
    """facenet-pytorch and torchvision, installed once per torch version under .cache."""
    env = REPO / ".cache" / "runtime-envs" / f"mtcnn-torch{torch.__version__}"
    if not (env / "facenet_pytorch").is_dir():
        install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
        install += ["--target", str(env), FACENET, matching_torchvision()]
        if subprocess.run(install, capture_output=True).returncode != 0:
            pytest.skip(f"could not install {FACENET} and torchvision (offline?)")
    return env


@pytest.fixture(scope="module")
def mtcnn_path():
    env = str(facenet_env())
    sys.path.insert(0, env)
    yield
    sys.path.remove(env)


@pytest.fixture(scope="module")
def faces(mtcnn_path, tmp_path_factory):
    from omni.runtimes.mtcnn_faces import MTCNNFaces

    model_dir = tmp_path_factory.mktemp("mtcnn")
    (model_dir / "omni-model.toml").write_text('weights = "package"\n')
    handler = MTCNNFaces()
    handler.load(model_dir, "cpu")
    return handler


def encoded(image: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=fmt)
    return buffer.getvalue()


def test_finds_the_face_as_mtcnn_run_bare(faces):
    from facenet_pytorch import MTCNN

    png = encoded(data.astronaut(), "PNG")
    [result] = served(faces, [as_request(image=png)])
    boxes, probs = MTCNN(keep_all=True).detect(Image.open(io.BytesIO(png)).convert("RGB"))
    np.testing.assert_allclose(result["boxes"], np.asarray(boxes, np.float32), atol=1e-3)
    np.testing.assert_allclose(result["probs"], np.asarray(probs, np.float32), atol=1e-6)
    [(x1, y1, x2, y2)] = result["boxes"]  # one face: Eileen Collins', upper middle
    assert probs[0] > 0.99 and 150 < x1 < x2 < 300 and 30 < y1 < y2 < 200


def test_no_face_gives_empty_outputs_and_batch_mates_change_nothing(faces):
    portrait = as_request(image=encoded(data.astronaut(), "JPEG"))
    coins = as_request(image=encoded(np.stack([data.coins()] * 3, axis=-1), "PNG"))
    [alone] = served(faces, [portrait])
    together = served(faces, [coins, portrait])
    assert together[0]["boxes"].shape == (0, 4) and together[0]["probs"].shape == (0,)
    np.testing.assert_array_equal(together[1]["boxes"], alone["boxes"])


def test_a_file_that_is_not_an_image_is_a_bad_request(faces):
    from omni.instance.handler import HandlerError

    with pytest.raises(HandlerError, match="image"):
        served(faces, [as_request(image=b"not an image")])


def batched(handler, requests: list[dict]) -> tuple[list, dict]:
    """The requests submitted together to the worker's batcher: each one's outputs or
    InferError, and the batcher's stats."""

    async def main():
        check = partial(check_outputs, specs=handler.outputs, max_bytes=MAX_RESPONSE_BYTES)
        batcher = Batcher(handler.infer, check, handler.max_batch_size)
        outcomes = await asyncio.gather(
            *(batcher.submit(r) for r in requests), return_exceptions=True
        )
        await batcher.close()
        return outcomes, batcher.stats()

    return asyncio.run(main())


def test_a_file_that_is_not_an_image_fails_alone_in_its_batch(faces):
    portrait = as_request(image=encoded(data.astronaut(), "PNG"))
    [alone] = served(faces, [portrait])
    (first, bad, last), stats = batched(faces, [portrait, as_request(image=b"GIF? no"), portrait])
    for result in (first, last):
        np.testing.assert_array_equal(result["boxes"], alone["boxes"])
        np.testing.assert_array_equal(result["probs"], alone["probs"])
    assert isinstance(bad, InferError) and bad.status == 400 and "image" in bad.message, bad
    assert stats["batch_sizes"] == {"3": 1} and stats["batch_failed"] == 1  # one call


def test_served_by_omnid_with_its_own_packages_as_run_bare(faces, tmp_path):
    """The handler in its sandbox under a real omnid, facenet-pytorch and torchvision its
    own packages (`--no-deps`: facenet-pytorch's metadata pins a torch of 2024), called
    with Triton's HTTP client: the same boxes as MTCNN run bare."""
    import tritonclient.http as httpclient
    from facenet_pytorch import MTCNN

    from ..nodes import Omnid

    model = tmp_path / "faces"
    model.mkdir()
    (model / "omni-model.toml").write_text('weights = "package"\n')
    for p in (tmp_path, model, *model.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    torchvision = matching_torchvision().replace(".*", ".0")
    config = (
        f'[[models]]\nname = "faces"\npath = "{model}"\nruntime = "python"\n'
        'handler = "omni.runtimes.mtcnn_faces:MTCNNFaces"\n'
        f'requirements = ["{FACENET} --no-deps", "{torchvision} --no-deps"]\n'
    )
    sandbox = "isolated" if os.geteuid() == 0 else "process"
    (tmp_path / "node").mkdir()
    node = Omnid(tmp_path / "node", config, "--sandbox", sandbox)
    try:
        node.wait_ready(["faces"], timeout_s=300)
        png = encoded(data.astronaut(), "PNG")
        image = httpclient.InferInput("image", [1], "BYTES")
        image.set_data_from_numpy(np.array([png], dtype=object), binary_data=True)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{node.port}")
        result = client.infer("faces", [image])
        boxes, probs = MTCNN(keep_all=True).detect(Image.open(io.BytesIO(png)).convert("RGB"))
        np.testing.assert_allclose(
            result.as_numpy("boxes"), np.asarray(boxes, np.float32), atol=1e-3
        )
        np.testing.assert_allclose(
            result.as_numpy("probs"), np.asarray(probs, np.float32), atol=1e-6
        )
        assert result.as_numpy("boxes").shape == (1, 4)
    finally:
        assert node.stop() == 0, node.log()
