"""OpenAI's /v1/images/generations on omnid and through the edge, with the `openai` client
unchanged.

A real omnid serves a tiny random Stable Diffusion pipeline (tests/runtimes/
tiny_diffusion.py) with the text-to-image runtime, a handler that draws one size only, a
handler that is not an image model, and a tiny LLM; a real edge with an API key stands in
front (the stack of test_transcriptions.py).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from omni.api import images
from omni.api.errors import ApiError
from omni.testing.checkpoints import tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid
from tests.runtimes.tiny_diffusion import STEPS, save_tiny_pipeline
from tests.test_transcriptions import AUTH, ECHO, HANDLER, KEY, SANDBOX, start_edge, world_readable

PAINTER, FIXED, LLM = "painter", "fixed", "chat"
SIDE = 32  # the painter's configured size


def red_png(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), "red").save(buffer, format="PNG")
    return buffer.getvalue()


# third-party code sees only the shared base of packages (numpy, not PIL): its PNG is made here
FIXED_HANDLER = f"""
import numpy as np

from omni.instance.handler import Handler, TensorSpec

PNG = {red_png(8)!r}


class Fixed(Handler):
    \"\"\"Draws one size only: it takes no width or height.\"\"\"

    inputs = (TensorSpec("prompt", "BYTES", (1,)),)
    outputs = (TensorSpec("image", "BYTES", (1,)),)

    def infer(self, batch):
        image = np.empty(1, dtype=object)
        image[0] = PNG
        return [{{"image": image}} for _ in batch]
"""


@dataclass
class Stack:
    omnid: Omnid
    edge_url: str

    def url(self, where: str) -> str:
        return self.edge_url if where == "edge" else self.omnid.base_url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.edge_url + "/v1", api_key=KEY, max_retries=0)


def write_config(tmp: Path) -> str:
    settings = f"steps = {STEPS}\nwidth = {SIDE}\nheight = {SIDE}\nmax_side = 64\n"
    painter_dir = save_tiny_pipeline(tmp / "tiny-sd", settings)
    fixed_dir, echo_dir = tmp / "fixed", tmp / "echo"
    for directory, code in ((fixed_dir, FIXED_HANDLER), (echo_dir, HANDLER)):
        directory.mkdir()
        (directory / "handler.py").write_text(code)
    world_readable(tmp / "tiny-sd", fixed_dir, echo_dir)
    handler = "omni.runtimes.text_to_image:TextToImage"
    return (
        f'[[models]]\nname = "{PAINTER}"\npath = "{painter_dir}"\nruntime = "python"\n'
        f'handler = "{handler}"\npermits = 1\nmemory = "4GiB"\n\n'
        f'[[models]]\nname = "{FIXED}"\npath = "{fixed_dir}"\nruntime = "python"\n'
        f'handler = "handler.py:Fixed"\nmemory = "2GiB"\n\n'
        f'[[models]]\nname = "{ECHO}"\npath = "{echo_dir}"\nruntime = "python"\n'
        f'handler = "handler.py:Echo"\nmemory = "2GiB"\n\n'
        f'[[models]]\nname = "{LLM}"\npath = "{tiny_llama(tmp / LLM)}"\n'
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("images")
    omnid = Omnid(tmp, write_config(tmp), "--sandbox", SANDBOX)
    edge = None
    try:
        omnid.wait_ready([PAINTER, FIXED, ECHO, LLM], timeout_s=240)
        edge, edge_url = start_edge(tmp, omnid)
        yield Stack(omnid, edge_url)
    finally:
        if edge is not None:
            edge.terminate()
            edge.wait(timeout=30)
        assert omnid.stop() == 0, omnid.log()


def png_size(b64: str) -> tuple[int, int]:
    data = base64.b64decode(b64)
    assert data.startswith(images.PNG_SIGNATURE)
    return Image.open(io.BytesIO(data)).size


def post(stack: Stack, where: str, **fields) -> httpx.Response:
    return httpx.post(stack.url(where) + images.PATH, json=fields, headers=AUTH, timeout=120)


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---- what a client gets ------------------------------------------------------------


def test_the_openai_client_gets_a_png_of_the_models_size_through_the_edge(stack: Stack):
    result = stack.client().images.generate(
        model=PAINTER, prompt="a red square", response_format="b64_json"
    )
    assert result.created > 0 and len(result.data) == 1
    assert png_size(result.data[0].b64_json) == (SIDE, SIDE)


def test_the_permits_go_on_once_the_images_gpu_work_is_over(stack: Stack):
    """The painter marks its denoising's end (gpu_done): omnid's images route asks for
    phases, so each image's request is released early, before its PNG is encoded."""

    def released() -> int:
        batching = stack.omnid.instances()[PAINTER].get("batching") or {}
        return batching.get("batch_gpu_released_early") or 0

    before = released()
    stack.client().images.generate(model=PAINTER, prompt="a green dot", n=2)
    wait_until(lambda: released() >= before + 2, 30, "two early releases in the stats")


def test_a_size_asked_for_is_the_size_drawn(stack: Stack):
    result = stack.client().images.generate(
        model=PAINTER, prompt="a red square", size="48x16", response_format="b64_json"
    )
    assert png_size(result.data[0].b64_json) == (48, 16)


def test_n_images_are_n_different_images(stack: Stack):
    result = stack.client().images.generate(model=PAINTER, prompt="a red square", n=2)
    assert len(result.data) == 2
    assert [png_size(image.b64_json) for image in result.data] == [(SIDE, SIDE)] * 2
    assert result.data[0].b64_json != result.data[1].b64_json  # a seed of its own each


def test_omnid_answers_alike_without_the_edge(stack: Stack):
    resp = post(stack, "omnid", model=PAINTER, prompt="a blue circle", n=3, size="16x24")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"created", "data"}
    assert [png_size(image["b64_json"]) for image in body["data"]] == [(16, 24)] * 3


def test_a_model_of_one_size_draws_it_when_no_size_is_asked(stack: Stack):
    result = stack.client().images.generate(model=FIXED, prompt="anything")
    assert png_size(result.data[0].b64_json) == (8, 8)


# ---- errors: OpenAI's bodies, never a 500 ----------------------------------------

WHERE = ["omnid", "edge"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": 7}, "prompt"),
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "size": "0x32"}, "size"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": images.MAX_N + 1}, "n"),
        ({"prompt": "x", "n": "2"}, "n"),
        ({"prompt": "x", "output_format": "jpeg"}, "output_format"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(stack, where, fields, param):
    assert error_of(post(stack, where, model=PAINTER, **fields), 400)["param"] == param


@pytest.mark.parametrize("where", WHERE)
def test_a_missing_model_is_a_400_and_an_unknown_one_a_404(stack: Stack, where: str):
    assert error_of(post(stack, where, prompt="x"), 400)["param"] == "model"
    assert error_of(post(stack, where, model="nope", prompt="x"), 404)["code"] == (
        "model_not_found"
    )


@pytest.mark.parametrize("where", WHERE)
def test_a_url_is_a_400_saying_only_b64_json_is_served(stack: Stack, where: str):
    error = error_of(post(stack, where, model=PAINTER, prompt="x", response_format="url"), 400)
    assert error["param"] == "response_format" and "b64_json" in error["message"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("model", [LLM, ECHO])
def test_a_model_that_does_not_draw_is_a_400_that_says_so(stack, where, model):
    error = error_of(post(stack, where, model=model, prompt="x"), 400)
    assert "not an image-generation model" in error["message"]
    assert error["param"] == "model" and error["code"] == "wrong_model_kind"


@pytest.mark.parametrize("where", WHERE)
def test_a_size_the_model_cannot_draw_is_a_400_naming_the_size(stack: Stack, where: str):
    error = error_of(post(stack, where, model=PAINTER, prompt="x", size="30x32"), 400)
    assert error["param"] == "size" and error["message"].startswith("width: 30"), error
    error = error_of(post(stack, where, model=FIXED, prompt="x", size="8x8"), 400)
    assert error["param"] == "size" and "one size" in error["message"]


def test_the_openai_client_raises_its_own_error_types(stack: Stack):
    client = stack.client()
    with pytest.raises(openai.BadRequestError, match="b64_json"):
        client.images.generate(model=PAINTER, prompt="x", response_format="url")
    with pytest.raises(openai.NotFoundError):
        client.images.generate(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="not an image-generation model"):
        client.images.generate(model=LLM, prompt="x")


# ---- the model's side, without a node ----------------------------------------------


def metadata(inputs: list[tuple], outputs: list[tuple]) -> dict:
    def specs(items):
        return [{"name": n, "datatype": d, "shape": list(s)} for n, d, s in items]

    return {"inputs": specs(inputs), "outputs": specs(outputs)}


def test_an_image_model_is_told_by_its_tensors():
    image = [("image", "BYTES", (1,))]
    drawn = metadata([("prompt", "BYTES", (1,)), ("seed", "INT64", (1,))], image)
    assert images.signature("m", drawn) == {"prompt": "BYTES", "seed": "INT64"}
    for inputs, outputs in (
        ([("text", "BYTES", (1,))], image),  # no prompt
        ([("prompt", "BYTES", (1,)), ("mask", "BYTES", (1,))], image),  # an unknown input
        ([("prompt", "BYTES", (1,)), ("seed", "FP32", (1,))], image),  # not an integer
        ([("prompt", "BYTES", (1,))], [("image", "UINT8", (-1, -1, 3))]),  # pixels, no file
    ):
        with pytest.raises(ApiError, match="not an image-generation model"):
            images.signature("m", metadata(inputs, outputs))
