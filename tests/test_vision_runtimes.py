"""The three vision runtimes (image classification, object detection, image captioning)
served by a real omnid in its sandbox from tiny random checkpoints, an edge with an API key
in front, called with Triton's HTTP client (`tritonclient.http`): each answers through
the edge with its declared shapes and datatypes, as transformers run bare answers; a
file that is not a readable image, or a tensor of the wrong datatype, is a 400 naming the
field, and the instance goes on serving without a restart.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from edge.tenants import hash_key
from omni.runtimes.model_config import CONFIG_NAME
from tests.conftest import free_port, wait_until
from tests.nodes import Omnid

from .runtimes.test_image_captioner import bare_caption
from .runtimes.test_image_classifier import bare_scores
from .runtimes.test_object_detector import bare_objects
from .runtimes.vision import (
    OBJECTS,
    bad_files,
    encoded,
    photo,
    save_tiny_captioner,
    save_tiny_classifier,
    save_tiny_detector,
)

REPO = Path(__file__).resolve().parent.parent
KEY = "sk-vision-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
RUNTIMES = {  # name: handler, checkpoint writer, settings
    "classifier": ("image_classifier:ImageClassifier", save_tiny_classifier, ""),
    "detector": ("object_detector:ObjectDetector", save_tiny_detector, "threshold = 0.5\n"),
    "captioner": ("image_captioner:ImageCaptioner", save_tiny_captioner, "max_new_tokens = 6\n"),
}
OUTPUTS = {  # each output's datatype, and its shape where n objects were found
    "classifier": {"label": ("BYTES", [1]), "scores": ("FP32", [4])},
    "detector": {
        "boxes": ("FP32", ["n", 4]),
        "scores": ("FP32", ["n"]),
        "labels": ("BYTES", ["n"]),
    },
    "captioner": {"text": ("BYTES", [1])},
}
PNG = encoded(photo("astronaut"))
JPEG = encoded(photo("chelsea"), "JPEG")


@dataclass
class Stack:
    omnid: Omnid
    edge_port: int
    models: Path  # the model directories, one per runtime

    def client(self) -> triton_http.InferenceServerClient:
        return triton_http.InferenceServerClient(f"127.0.0.1:{self.edge_port}")

    def infer(self, model: str, file: bytes) -> triton_http.InferResult:
        return self.client().infer(model, [image_input(file)], headers=AUTH)


def image_input(file: bytes) -> triton_http.InferInput:
    tensor = triton_http.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([file], dtype=object), binary_data=True)
    return tensor


def write_models(root: Path) -> str:
    """Each runtime's tiny checkpoint under `root`, readable by every sandbox user; the
    catalog that serves them."""
    config = ""
    for name, (handler, save, settings) in RUNTIMES.items():
        model = root / name
        model.mkdir()
        save(model)
        (model / CONFIG_NAME).write_text(settings)
        config += (
            f'[[models]]\nname = "{name}"\npath = "{model}"\nruntime = "python"\n'
            f'handler = "omni.runtimes.{handler}"\n\n'
        )
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return config


def start_edge(tmp: Path, upstream: str) -> tuple[subprocess.Popen, int]:
    """The edge in front of `upstream`, one tenant holding KEY."""
    (tmp / "tenants.toml").write_text(
        f'[[tenants]]\nname = "vision"\nweight = 1\nkeys = ["{hash_key(KEY)}"]\n'
    )
    port, log = free_port(), tmp / "edge.log"
    argv = [sys.executable, "-m", "edge.server", "--port", str(port), "--dashboard", "off"]
    argv += ["--upstream", upstream, "--tenants", str(tmp / "tenants.toml")]
    edge = subprocess.Popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def ready() -> bool:
        if edge.poll() is not None:
            raise AssertionError(log.read_text())
        try:
            url = f"http://127.0.0.1:{port}/v2/health/ready"
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, 60, "the edge ready", interval_s=0.2)
    return edge, port


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("vision")
    models = Path(tempfile.mkdtemp(prefix="omni-vision-", dir="/tmp"))
    sandbox = "isolated" if os.geteuid() == 0 else "process"
    omnid = edge = None
    try:
        omnid = Omnid(tmp, write_models(models), "--sandbox", sandbox)
        omnid.wait_ready(list(RUNTIMES), timeout_s=300)
        edge, port = start_edge(tmp, omnid.base_url)
        yield Stack(omnid, port, models)
    finally:
        if edge is not None:
            edge.terminate()
            edge.wait(timeout=30)
        if omnid is not None:
            assert omnid.stop() == 0, omnid.log()
        shutil.rmtree(models)


def raw_infer(stack: Stack, model: str, file: bytes) -> httpx.Response:
    """The request tritonclient would send, posted as is: its response's headers show."""
    body, json_size = triton_http.InferenceServerClient.generate_request_body([image_input(file)])
    headers = {**AUTH, "Content-Type": "application/octet-stream"}
    headers["Inference-Header-Content-Length"] = str(json_size)
    url = f"http://127.0.0.1:{stack.edge_port}/v2/models/{model}/infer"
    return httpx.post(url, content=body, headers=headers, timeout=60)


def check_outputs_declared(model: str, result: triton_http.InferResult) -> None:
    n = None
    for name, (datatype, shape) in OUTPUTS[model].items():
        output = result.get_output(name)
        assert output["datatype"] == datatype, output
        n = output["shape"][0] if shape[0] == "n" and n is None else n
        assert output["shape"] == [n if d == "n" else d for d in shape], output


@pytest.mark.parametrize("model", RUNTIMES)
def test_each_runtime_answers_through_the_edge_as_run_bare(stack, model):
    response = raw_infer(stack, model, PNG)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    length = int(response.headers["inference-header-content-length"])
    result = triton_http.InferenceServerClient.parse_response_body(
        response.content, header_length=length
    )
    check_outputs_declared(model, result)
    checkpoint = stack.models / model
    if model == "classifier":
        np.testing.assert_allclose(
            result.as_numpy("scores"), bare_scores(checkpoint, PNG), atol=1e-5
        )
    elif model == "detector":
        bare = bare_objects(checkpoint, PNG, threshold=0.5)
        assert len(bare["scores"]) > 0
        np.testing.assert_allclose(result.as_numpy("boxes"), bare["boxes"].numpy(), atol=1e-3)
        np.testing.assert_allclose(result.as_numpy("scores"), bare["scores"].numpy(), atol=1e-5)
        assert list(result.as_numpy("labels")) == [OBJECTS[int(i)].encode() for i in bare["labels"]]
    else:
        assert result.as_numpy("text")[0].decode() == bare_caption(checkpoint, PNG)


@pytest.mark.parametrize("model", RUNTIMES)
def test_metadata_through_the_edge_lists_the_declared_tensors(stack, model):
    meta = stack.client().get_model_metadata(model, headers=AUTH)
    assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [1]}]
    assert [(t["name"], t["datatype"]) for t in meta["outputs"]] == [
        (name, datatype) for name, (datatype, _) in OUTPUTS[model].items()
    ]


def error_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return str(err.value.status()), err.value.message()


@pytest.mark.parametrize("model", RUNTIMES)
def test_a_bad_file_is_a_400_naming_the_image_and_the_instance_keeps_serving(stack, model):
    files = bad_files()
    for kind in ("truncated", "not an image"):
        status, message = error_of(lambda f=files[kind]: stack.infer(model, f))
        assert status == "400" and "image: " in message, (kind, status, message)
    result = stack.infer(model, JPEG)  # the next request: a 200
    check_outputs_declared(model, result)
    instance = stack.omnid.instances()[model]
    assert instance["state"] == "ready" and instance["restarts"] == 0, instance


@pytest.mark.parametrize("model", RUNTIMES)
def test_a_wrong_tensor_datatype_is_a_400(stack, model):
    wrong = triton_http.InferInput("image", [1], "FP32")
    wrong.set_data_from_numpy(np.zeros(1, np.float32))
    status, message = error_of(lambda: stack.client().infer(model, [wrong], headers=AUTH))
    assert status == "400" and "'image'" in message, message


def test_a_bad_file_among_concurrent_good_ones_fails_alone(stack):
    files = [PNG, bad_files()["truncated"], JPEG, PNG]
    with ThreadPoolExecutor(len(files)) as pool:
        outcomes = list(pool.map(lambda f: _outcome(stack, "classifier", f), files))
    good = [o for i, o in enumerate(outcomes) if i != 1]
    assert all(isinstance(o, np.ndarray) for o in good), outcomes
    np.testing.assert_allclose(good[0], good[2], atol=1e-5)  # the same file, the same scores
    assert isinstance(outcomes[1], InferenceServerException) and str(outcomes[1].status()) == "400"


def _outcome(stack: Stack, model: str, file: bytes) -> np.ndarray | InferenceServerException:
    try:
        return stack.infer(model, file).as_numpy("scores")
    except InferenceServerException as e:
        return e
