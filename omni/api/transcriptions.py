"""OpenAI's `POST /v1/audio/transcriptions`, over a speech-recognition handler model.

Which models transcribe is read from the tensors a `runtime = "python"` model declares
(its Open Inference Protocol metadata), so a new runtime needs no registration:

- an input `audio`, BYTES of shape [1] (or [-1]): the uploaded file, passed on unread;
- any other input is one of OPTIONAL_INPUTS, of one element: the form's `language`,
  `prompt` (BYTES) or `temperature` (FP32/FP64), "" or 0 when the form has none;
- an output `text`, BYTES [1]: the transcript. Read where declared: `duration`
  (FP32/FP64 [1], seconds of audio), `language` (BYTES [1]) and `segments` (BYTES [1],
  a JSON list of {"start", "end", "text"} objects). Other outputs are not asked for.

Any other model (OMNI's LLMs and embedding models, other handlers) is a 400 that says
so. An upload becomes one infer request; the answer becomes OpenAI's `json`, `text` or
`verbose_json` response. The file is decoded by the model alone, inside its sandbox: a
file it cannot read is its HandlerError, a 400 with its message. Without sampling in a
model (no `temperature` input), the form's temperature is checked and ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import orjson
from aiohttp import web

from . import oip
from .errors import ApiError, json_response
from .multipart_form import Part, parse_form, read_bounded

PATH = "/v1/audio/transcriptions"
MAX_FILE_BYTES = 25 << 20  # OpenAI's limit on an uploaded file (25 MB)
MAX_BODY_BYTES = MAX_FILE_BYTES + (1 << 20)  # the file, the other fields and framing
MAX_PROMPT_BYTES = 16 << 10
MAX_LANGUAGE_CHARS = 32
FORMATS = ("json", "text", "verbose_json")
ONE = ((1,), (-1,))  # shapes of a one-element tensor, as a model may declare them
OPTIONAL_INPUTS = {"language": ("BYTES",), "prompt": ("BYTES",), "temperature": ("FP32", "FP64")}
OPTIONAL_OUTPUTS = {"duration": ("FP32", "FP64"), "language": ("BYTES",), "segments": ("BYTES",)}


@dataclass(frozen=True)
class Upload:
    """The form's fields, checked."""

    model: str
    file: bytes
    response_format: str = "json"
    language: str = ""
    prompt: str = ""
    temperature: float = 0.0


@dataclass(frozen=True)
class Signature:
    """A transcription model's tensors: its inputs' datatypes, the outputs to ask for."""

    inputs: dict[str, str]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Transcript:
    """What the model answered."""

    text: str
    duration: float | None = None
    language: str | None = None
    segments: list[dict] = field(default_factory=list)


# ---- the upload ------------------------------------------------------------------


async def read_upload(request: web.Request) -> tuple[bytes, Upload]:
    """The body (within MAX_BODY_BYTES) and its checked form."""
    body = await read_bounded(request, MAX_BODY_BYTES)
    fields = await parse_form(body, request.headers.get("Content-Type"))
    return body, parse_upload(fields)


def parse_upload(fields: Mapping[str, Part]) -> Upload:
    """The form's fields as an Upload, or the 400 (413: the file) that says what is wrong."""
    file = fields.get("file")
    if file is None:
        raise invalid("Missing required parameter: 'file'.", "file")
    if len(file.data) > MAX_FILE_BYTES:
        raise ApiError(
            413,
            f"The file is {len(file.data)} bytes, past the limit of {MAX_FILE_BYTES}.",
            param="file",
            code="file_too_large",
        )
    model = fields["model"].text("model").strip() if "model" in fields else ""
    if not model:
        raise invalid("Missing required parameter: 'model'.", "model")
    if "stream" in fields and fields["stream"].text("stream").strip().lower() == "true":
        raise invalid("Streaming transcriptions are not supported here.", "stream")
    return Upload(
        model=model,
        file=file.data,
        response_format=response_format(fields),
        language=text_field(fields, "language", MAX_LANGUAGE_CHARS),
        prompt=text_field(fields, "prompt", MAX_PROMPT_BYTES),
        temperature=temperature(fields),
    )


def invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def response_format(fields: Mapping[str, Part]) -> str:
    value = fields["response_format"].text("response_format") if "response_format" in fields else ""
    value = value.strip() or "json"
    if value not in FORMATS:
        raise invalid(
            f"response_format '{value[:32]}' is not supported; use one of {', '.join(FORMATS)}.",
            "response_format",
        )
    return value


def text_field(fields: Mapping[str, Part], name: str, limit: int) -> str:
    value = fields[name].text(name).strip() if name in fields else ""
    if len(value) > limit:
        raise invalid(f"'{name}' is longer than {limit} characters.", name)
    return value


def temperature(fields: Mapping[str, Part]) -> float:
    text = fields["temperature"].text("temperature").strip() if "temperature" in fields else ""
    try:
        value = float(text) if text else 0.0
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise invalid("'temperature' must be a number from 0 to 1.", "temperature")
    return value


# ---- the model -------------------------------------------------------------------


def not_transcription(model: str, why: str) -> ApiError:
    return ApiError(
        400,
        f"Model '{model}' is not a speech-recognition model ({why}); "
        f"{PATH} needs one that takes an 'audio' file and answers its 'text'.",
        param="model",
        code="wrong_model_kind",
    )


def declared(metadata: object, key: str) -> dict[str, tuple[str, tuple]]:
    """A model's declared tensors by name: (datatype, shape)."""
    specs = metadata.get(key) if isinstance(metadata, dict) else None
    out = {}
    for spec in specs if isinstance(specs, list) else []:
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            shape = tuple(spec["shape"]) if isinstance(spec.get("shape"), list) else ()
            out[spec["name"]] = (spec.get("datatype"), shape)
    return out


def signature(model: str, metadata: object) -> Signature:
    """The model's tensors, if it is a transcription model (see above), else a 400."""
    inputs, outputs = declared(metadata, "inputs"), declared(metadata, "outputs")
    if inputs.get("audio", (None, ()))[0] != "BYTES" or inputs["audio"][1] not in ONE:
        raise not_transcription(model, "it has no 'audio' input of one BYTES element")
    for name, (datatype, shape) in inputs.items():
        if name != "audio" and (datatype not in OPTIONAL_INPUTS.get(name, ()) or shape not in ONE):
            raise not_transcription(model, f"its input '{name[:64]}' is not a form field")
    if outputs.get("text", (None, ()))[0] != "BYTES":
        raise not_transcription(model, "it has no BYTES 'text' output")
    optional = [n for n, (d, s) in outputs.items() if d in OPTIONAL_OUTPUTS.get(n, ()) and s in ONE]
    return Signature({n: d for n, (d, _) in inputs.items()}, ("text", *optional))


def one_element(value: object, datatype: str) -> np.ndarray:
    array = np.empty(1, dtype=oip.DTYPES[datatype])
    array[0] = value
    return array


def infer_request(upload: Upload, sig: Signature) -> tuple[bytes, dict[str, str]]:
    """The upload as the model's infer request: its body and headers."""
    values = {
        "audio": upload.file,
        "language": upload.language.encode(),
        "prompt": upload.prompt.encode(),
        "temperature": upload.temperature,
    }
    inputs = {name: one_element(values[name], datatype) for name, datatype in sig.inputs.items()}
    return oip.encode_request(inputs, sig.outputs)


# ---- the answer ------------------------------------------------------------------


def malformed(what: str) -> ApiError:
    return ApiError(502, f"The model answered a malformed {what}.", code="bad_model_output")


def texts(array: np.ndarray) -> str:
    return " ".join(oip.as_bytes(item).decode(errors="replace") for item in array.reshape(-1))


def transcript(answer: oip.InferResponse) -> Transcript:
    """The model's outputs, checked (a handler is untrusted code)."""
    outputs = answer.outputs
    if "text" not in outputs:
        raise malformed("answer, without its 'text'")
    duration = None
    if "duration" in outputs and outputs["duration"].size == 1:
        duration = float(outputs["duration"].reshape(-1)[0])
        duration = duration if math.isfinite(duration) and duration >= 0 else None
    language = (texts(outputs["language"]) or None) if "language" in outputs else None
    segments = parse_segments(texts(outputs["segments"])) if "segments" in outputs else []
    return Transcript(texts(outputs["text"]).strip(), duration, language, segments)


def parse_segments(data: str) -> list[dict]:
    """The model's segments (a JSON list of {"start", "end", "text"}), numbered."""
    try:
        items = orjson.loads(data) if data.strip() else []
    except orjson.JSONDecodeError:
        raise malformed("'segments' (not JSON)") from None
    if not isinstance(items, list):
        raise malformed("'segments' (not a list)")
    segments = []
    for i, item in enumerate(items):
        times = [item.get(k) for k in ("start", "end")] if isinstance(item, dict) else [None]
        if not all(isinstance(t, int | float) and not isinstance(t, bool) for t in times):
            raise malformed(f"segment {i} (no start and end seconds)")
        text = item.get("text", "")
        if not isinstance(text, str):
            raise malformed(f"segment {i} (its text is not a string)")
        segments.append({"id": i, "start": float(times[0]), "end": float(times[1]), "text": text})
    return segments


def response(upload: Upload, result: Transcript) -> web.Response:
    """OpenAI's answer in the format the upload asked for."""
    if upload.response_format == "text":
        return web.Response(text=result.text + "\n", content_type="text/plain")
    usage = {}
    if result.duration is not None:  # OpenAI bills audio by the second
        usage = {"usage": {"type": "duration", "seconds": math.ceil(result.duration)}}
    if upload.response_format == "json":
        return json_response({"text": result.text, **usage})
    return json_response(
        {
            "task": "transcribe",
            "language": result.language or upload.language or None,
            "duration": result.duration,
            "text": result.text,
            "segments": result.segments,
            **usage,
        }
    )
