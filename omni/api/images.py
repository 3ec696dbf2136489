"""OpenAI's `POST /v1/images/generations`, over a text-to-image handler model.

Which models draw is read from the tensors a `runtime = "python"` model declares (its
Open Inference Protocol metadata), so a new runtime needs no registration:

- an input `prompt`, BYTES of shape [1] (or [-1]): the request's prompt;
- any other input is one of OPTIONAL_INPUTS, an integer of one element: `width` and
  `height` (the request's `size`, 0 when it has none: the model's own size) and `seed`
  (a fresh random one per image, so the n images of a request differ);
- an output `image`, BYTES [1]: a PNG file.

Any other model is a 400 that says so. A request for n images becomes n infer requests
(the instance batches them), sent under one permit; the answer is OpenAI's, each image as
`b64_json` (no image is stored, so `response_format: "url"` is refused). A model
without `width` and `height` inputs draws one size: a request that names a size is
refused rather than answered at another one.
"""

from __future__ import annotations

import base64
import re
import secrets
import struct
import time
from dataclasses import dataclass

import numpy as np
import orjson
from aiohttp import web

from . import oip
from .errors import ApiError, json_response
from .transcriptions import ONE, declared, malformed

PATH = "/v1/images/generations"
MAX_BODY_BYTES = 1 << 20  # JSON with a prompt of MAX_PROMPT_CHARS
MAX_PROMPT_CHARS = 32_000  # OpenAI's longest (gpt-image-1)
MAX_N = 10  # OpenAI's range of n: 1 to 10
MAX_SIDE = 4096
SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")
INTEGERS = ("INT32", "INT64", "UINT32", "UINT64")
OPTIONAL_INPUTS = {"width": INTEGERS, "height": INTEGERS, "seed": INTEGERS}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_SEED = 1 << 31


@dataclass(frozen=True)
class Generation:
    """The request's fields, checked; width and height 0: the model's own size."""

    model: str
    prompt: str
    n: int = 1
    width: int = 0
    height: int = 0


def invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


# ---- the request -----------------------------------------------------------------


def parse_request(body: bytes) -> Generation:
    """The JSON body as a Generation, or the 400 that names what is wrong."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ApiError(400, "The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The body must be a JSON object.", code="invalid_json")
    model = data.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid("Missing required parameter: 'model'.", "model")
    text, n = prompt(data.get("prompt")), count(data.get("n"))
    width, height = size(data.get("size"))
    check_format(data)
    return Generation(model.strip(), text, n, width, height)


def prompt(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid("'prompt' must be a non-empty string.", "prompt")
    if len(value) > MAX_PROMPT_CHARS:
        raise invalid(f"'prompt' is longer than {MAX_PROMPT_CHARS} characters.", "prompt")
    return value


def count(value: object) -> int:
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_N:
        raise invalid(f"'n' must be an integer from 1 to {MAX_N}.", "n")
    return value


def size(value: object) -> tuple[int, int]:
    """(width, height) of a "WxH" size; (0, 0) for none or "auto" (the model's size)."""
    if value is None or value == "auto":
        return 0, 0
    match = SIZE.fullmatch(value) if isinstance(value, str) else None
    sides = (int(match[1]), int(match[2])) if match else (0, 0)
    if not all(1 <= side <= MAX_SIDE for side in sides):
        shown = value[:32] if isinstance(value, str) else value
        raise invalid(
            f"'size' {shown!r} is not a size; use 'WIDTHxHEIGHT' (up to {MAX_SIDE}) or 'auto'.",
            "size",
        )
    return sides


def check_format(data: dict) -> None:
    """Only PNG, only as b64_json, and not streamed."""
    if data.get("response_format") not in (None, "b64_json"):
        raise invalid(
            "Only response_format 'b64_json' is served here: images are not stored for a URL.",
            "response_format",
        )
    if data.get("output_format") not in (None, "png"):
        raise invalid("Only output_format 'png' is served here.", "output_format")
    if data.get("stream"):
        raise invalid("Streaming image generation is not supported here.", "stream")


# ---- the model -------------------------------------------------------------------


def not_image_model(model: str, why: str) -> ApiError:
    return ApiError(
        400,
        f"Model '{model}' is not an image-generation model ({why}); "
        f"{PATH} needs one that takes a 'prompt' and answers an 'image'.",
        param="model",
        code="wrong_model_kind",
    )


def signature(model: str, metadata: object) -> dict[str, str]:
    """The model's inputs and their datatypes, if it draws (see above), else a 400."""
    inputs, outputs = declared(metadata, "inputs"), declared(metadata, "outputs")
    if inputs.get("prompt", (None, ()))[0] != "BYTES" or inputs["prompt"][1] not in ONE:
        raise not_image_model(model, "it has no 'prompt' input of one BYTES element")
    for name, (datatype, shape) in inputs.items():
        if name != "prompt" and (datatype not in OPTIONAL_INPUTS.get(name, ()) or shape not in ONE):
            raise not_image_model(model, f"its input '{name[:64]}' is not a request field")
    if outputs.get("image", (None, ()))[0] != "BYTES" or outputs["image"][1] not in ONE:
        raise not_image_model(model, "it has no 'image' output of one BYTES element")
    return {name: datatype for name, (datatype, _) in inputs.items()}


def infer_requests(generation: Generation, inputs: dict[str, str]) -> list[tuple[bytes, dict]]:
    """The request as n infer requests (bodies and headers), one per image."""
    if generation.width and not {"width", "height"} <= inputs.keys():
        raise invalid(
            f"Model '{generation.model}' draws images of one size; leave 'size' out.", "size"
        )
    requests = []
    for _ in range(generation.n):
        values = {
            "prompt": generation.prompt.encode(),
            "width": generation.width,
            "height": generation.height,
            "seed": secrets.randbelow(MAX_SEED),
        }
        tensors = {}
        for name, datatype in inputs.items():
            tensors[name] = np.empty(1, dtype=oip.DTYPES[datatype])
            tensors[name][0] = values[name]
        requests.append(oip.encode_request(tensors, ["image"]))
    return requests


# ---- the answer ------------------------------------------------------------------


def png(answer: oip.InferResponse, generation: Generation) -> bytes:
    """The model's image, checked to be a PNG of the size asked for (a handler is
    untrusted code)."""
    image = answer.outputs.get("image")
    if image is None or image.size != 1:
        raise malformed("answer, without its one 'image'")
    data = oip.as_bytes(image.reshape(-1)[0])
    # a PNG opens with its signature and its IHDR chunk: length, type, width, height
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        raise malformed("'image' (not a PNG file)")
    width, height = struct.unpack(">II", data[16:24])
    if generation.width and (width, height) != (generation.width, generation.height):
        raise malformed(f"'image' ({width}x{height}, not the size asked for)")
    return data


def response(images: list[bytes]) -> web.Response:
    """OpenAI's answer: every image as base64."""
    data = [{"b64_json": base64.b64encode(image).decode()} for image in images]
    return json_response({"created": int(time.time()), "data": data})
