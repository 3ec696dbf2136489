"""`POST /v1/run/{model}`: plain JSON in and out for a handler model (`runtime = "python"`),
as Workers AI's `POST /ai/run/{model}` takes it, for callers who do not want tensors.

The body is a JSON object whose keys are the model's declared input names (its Open
Inference Protocol metadata), each one required; it becomes one infer request. The
answer is `{"result": {output_name: value, ...}}`, every output the model gives.

Values, both ways (one rule for inputs and outputs):

- A tensor is a value nested in lists, one level per declared dimension, its lengths
  those declared (-1: any length, the same for every list at that level). A tensor of
  one element may be its single value instead, where the shape allows one (every
  dimension 1 or -1): `{"text": "hi"}` for `text` BYTES [1]. An output declared with
  every dimension 1 is answered as its single value; any other output as nested lists
  of its actual shape (an empty result is `[]`).
- Numbers: JSON numbers of the datatype's kind (integers for INT/UINT, within the
  type's range; any number for FP, within its range; true/false for BOOL). An output's
  NaN or infinity is answered as null (JSON has neither).
- BYTES elements: a BYTES tensor named `audio`, `image`, `video` or `file`
  (BINARY_NAMES: binary by its name, as omni/runtimes/ declares them) holds base64
  strings. Any other BYTES tensor holds strings of UTF-8 text; in an answer, an element
  that is not UTF-8 is `{"base64": "..."}`, and a request may give any BYTES element so.

What does not fit is a 400 naming the input (`param`); a model that is not a handler
model is a 400 naming the route that serves it.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np

from . import oip
from .errors import ApiError, json_object
from .transcriptions import declared

PATH = "/v1/run/{model}"
BINARY_NAMES = frozenset({"audio", "image", "video", "file"})
OTHER_ROUTES = {"generate": "/v1/chat/completions", "embed": "/v1/embeddings"}

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Signature:
    """A handler model's declared tensors by name: (datatype, shape)."""

    inputs: dict[str, tuple[str, Shape]]
    outputs: dict[str, tuple[str, Shape]]


def signature(metadata: object) -> Signature:
    return Signature(declared(metadata, "inputs"), declared(metadata, "outputs"))


def not_a_handler(model: str, kind: str | None) -> ApiError:
    """The 400 for an LLM or embedding model, which has its own OpenAI route."""
    route = OTHER_ROUTES.get(kind or "", "its OpenAI routes under /v1")
    return ApiError(
        400,
        f"Model '{model}' is not a handler model; {PATH} runs handler models "
        f'(runtime = "python"). Use {route}.',
        param="model",
        code="wrong_model_kind",
    )


def invalid(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


# ---- the request -----------------------------------------------------------------


def parse_body(body: bytes) -> dict:
    return json_object(body, "Request body must be a JSON object of the model's inputs.")


def infer_request(body: bytes, sig: Signature) -> tuple[bytes, dict[str, str]]:
    """The body as the model's infer request (its body and headers), every output asked."""
    data = parse_body(body)
    for name in data:
        if name not in sig.inputs:
            takes = ", ".join(sig.inputs) or "none"
            shown = name[:64]
            raise invalid(f"Unrecognized input: '{shown}' (the model takes: {takes}).", shown)
    arrays = {}
    for name, (datatype, shape) in sig.inputs.items():
        if name not in data:
            raise invalid(f"Missing required parameter: '{name}'.", name)
        arrays[name] = to_tensor(name, data[name], datatype, shape)
    return oip.encode_request(arrays)


def to_tensor(name: str, value: object, datatype: str, shape: Shape) -> np.ndarray:
    """One input's value as its declared tensor."""
    if not isinstance(value, list) and len(shape) > 0 and all(d in (1, -1) for d in shape):
        actual, flat = (1,) * len(shape), [value]
    else:
        actual, flat = nested(name, value, shape)
    return elements(name, flat, datatype).reshape(actual)


def nested(name: str, value: object, declared_shape: Shape) -> tuple[Shape, list]:
    """The shape of `value`'s nested lists, checked against the declared one, and its
    elements in row-major order."""
    shape: list[int | None] = [None] * len(declared_shape)
    flat: list = []
    wanted = f"'{name}' must be nested lists of shape {list(declared_shape)} (-1: any length)"

    def walk(item: object, depth: int) -> None:
        if depth == len(declared_shape):
            if isinstance(item, list):
                raise invalid(f"{wanted}; it nests deeper.", name)
            flat.append(item)
            return
        if not isinstance(item, list):
            raise invalid(f"{wanted}; a value stands where a list of dimension {depth} is.", name)
        if declared_shape[depth] not in (-1, len(item)):
            raise invalid(f"{wanted}; dimension {depth} holds {len(item)}.", name)
        if shape[depth] is None:
            shape[depth] = len(item)
        elif len(item) != shape[depth]:
            raise invalid(f"{wanted}; the lists of dimension {depth} differ in length.", name)
        for sub in item:
            walk(sub, depth + 1)

    walk(value, 0)
    # a dimension under an empty list keeps its declared length (0 where any)
    sizes = zip(shape, declared_shape, strict=True)
    return tuple(d if d is not None else max(w, 0) for d, w in sizes), flat


def elements(name: str, flat: list, datatype: str) -> np.ndarray:
    """The elements, checked against and converted to the datatype."""
    if datatype == "BYTES":
        array = np.empty(len(flat), dtype=object)
        array[:] = [to_bytes(name, item) for item in flat]
        return array
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise invalid(f"'{name}' ({datatype}) takes true or false.", name)
        return np.array(flat, dtype=np.bool_)
    if oip.DTYPES[datatype].kind in "iu":
        return integers(name, flat, datatype)
    return floats(name, flat, datatype)


def integers(name: str, flat: list, datatype: str) -> np.ndarray:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        raise invalid(f"'{name}' ({datatype}) takes integers.", name)
    info = np.iinfo(oip.DTYPES[datatype])
    if not all(info.min <= v <= info.max for v in flat):
        raise invalid(f"'{name}' ({datatype}) takes {info.min} to {info.max}.", name)
    return np.array(flat, dtype=oip.DTYPES[datatype])


def floats(name: str, flat: list, datatype: str) -> np.ndarray:
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat):
        raise invalid(f"'{name}' ({datatype}) takes numbers.", name)
    limit = float(np.finfo(oip.DTYPES[datatype]).max)
    try:
        wide = np.array(flat, dtype=np.float64)
    except OverflowError:  # an integer past any float
        wide = np.array([np.inf])
    if not np.all(np.abs(wide) <= limit):
        raise invalid(f"'{name}' ({datatype}) takes numbers within ±{limit:.4g}.", name)
    return wide.astype(oip.DTYPES[datatype])


def to_bytes(name: str, item: object) -> bytes:
    """A BYTES element: base64 for a binary input, else UTF-8 text, or {"base64": ...}."""
    if isinstance(item, dict) and set(item) == {"base64"}:
        return from_base64(name, item["base64"])
    if not isinstance(item, str):
        raise invalid(f'\'{name}\' takes a string (or {{"base64": "..."}}).', name)
    return from_base64(name, item) if name in BINARY_NAMES else item.encode()


def from_base64(name: str, text: object) -> bytes:
    try:
        if not isinstance(text, str):
            raise ValueError
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"'{name}' is not valid base64.", name) from None


# ---- the answer ------------------------------------------------------------------


def result(answer: oip.InferResponse, sig: Signature) -> dict:
    """The model's outputs as `{"result": {...}}`."""
    out = {}
    for name, array in answer.outputs.items():
        shape = sig.outputs.get(name, (None, None))[1]
        out[name] = to_json(name, array, shape)
    return {"result": out}


def to_json(name: str, array: np.ndarray, shape: Shape | None) -> object:
    """One output as JSON values: its single value where every declared dimension is 1,
    else nested lists of its shape."""
    if array.dtype == object:
        items = np.empty(array.size, dtype=object)
        items[:] = [from_bytes(name, item) for item in array.reshape(-1)]
        array = items.reshape(array.shape)
    if shape is not None and all(d == 1 for d in shape) and array.size == 1:
        item = array.reshape(-1)[0]
        return item if array.dtype == object else item.item()
    return array.tolist()


def from_bytes(name: str, item: object) -> object:
    """A BYTES element as JSON: base64 for a binary output, else text where UTF-8."""
    data = oip.as_bytes(item)
    if name in BINARY_NAMES:
        return base64.b64encode(data).decode()
    try:
        return data.decode()
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode()}
