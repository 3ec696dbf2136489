"""omnid's `POST /v1/audio/transcriptions`: an upload, as one infer request to a
speech-recognition handler model (omni/api/transcriptions.py says which models are).

The request takes the path every inference request takes (`Node.admission`: a permit,
the queue, 429/503 with Retry-After). Whether the model transcribes is read from its
instance's metadata first (no permit), so any other model is refused before it queues.
The permit goes back as soon as the instance has answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web

from omni.api import oip, phased, transcriptions
from omni.api.errors import ApiError, unavailable
from omni.api.oip_http import OIP_RUNTIMES
from omni.api.proxy import upstream_failed
from omni.instance.settings import DEFAULT_MAX_OUTPUT_BYTES

if TYPE_CHECKING:
    from .instance import Instance
    from .omnid import Node

MAX_METADATA_BYTES = 1 << 20
MAX_ANSWER_BYTES = DEFAULT_MAX_OUTPUT_BYTES + (1 << 20)  # outputs, and the JSON around them


async def transcribe(node: Node, request: web.Request) -> web.Response:
    """One upload, through the model's admission, answered in OpenAI's form."""
    _body, upload = await transcriptions.read_upload(request)

    def refuse(inst: Instance) -> ApiError:
        return transcriptions.not_transcription(inst.name, f"it is {other_kind(inst)} model")

    inst, declared = await handler_metadata(node, request, upload.model, refuse)
    signature = transcriptions.signature(inst.name, declared)
    body, headers = transcriptions.infer_request(upload, signature)
    t_admit = time.monotonic()
    async with node.admission(inst, t_admit + node.request_timeout_s, request["omni_ticket"]):
        node.metrics.observe_admission(inst.name, time.monotonic() - t_admit)
        answer = await call(inst, "POST", f"/v2/models/{inst.name}/infer", body, headers)
    try:
        decoded = oip.decode_response(answer.body, answer.headers)
    except oip.OipError as exc:
        raise transcriptions.malformed(f"answer ({exc.message})") from None
    return transcriptions.response(upload, transcriptions.transcript(decoded))


def other_kind(inst: Instance) -> str:
    """What a model that is not a handler's is, for the error that refuses it."""
    return {"generate": "a text-generation", "embed": "an embedding"}.get(
        inst.entry.kind, "another"
    )


async def handler_metadata(
    node: Node, request: web.Request, name: str, refuse: Callable[[Instance], ApiError]
) -> tuple[Instance, object]:
    """The handler model `name` names, ready, and its declared tensors (its protocol
    metadata, read from the instance without a permit); `refuse` makes the error for a
    model that is not a handler's. What the routes for handler models share."""
    inst = node.get(name)
    request["omni_model"] = inst.name
    request["omni_version"] = inst.entry.version
    if inst.entry.runtime not in OIP_RUNTIMES:
        raise refuse(inst)
    if node.draining:
        raise unavailable("This node is draining; retry on another node.", 5)
    await node.wait_ready(inst)
    metadata = await call(inst, "GET", f"/v2/models/{inst.name}", limit=MAX_METADATA_BYTES)
    try:
        return inst, orjson.loads(metadata.body)
    except orjson.JSONDecodeError:
        raise transcriptions.malformed("metadata (not JSON)") from None


class Answer:
    """An instance's whole answer (200 only: any other status is raised as an ApiError)."""

    def __init__(self, body: bytes, headers: dict[str, str]):
        self.body, self.headers = body, headers


async def call(
    inst: Instance,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    limit: int = MAX_ANSWER_BYTES,
    refused_param: str | None = "file",
    on_gpu_done: Callable[[], None] | None = None,
) -> Answer:
    """The instance's answer to one request; its error (the protocol's) as an ApiError
    of the same status (a 400, the model's refusal, naming `refused_param`), and an
    instance that fails to answer as a 503. `on_gpu_done`: asks for the answer in phases
    (omni/api/phased.py) and runs at its GPU work's end, to hand the permit on."""
    if on_gpu_done is not None:
        headers = {**(headers or {}), phased.HEADER: "1"}
    try:
        async with inst.session.request(method, inst.url(path), data=body, headers=headers) as r:
            if r.content_type == phased.CONTENT_TYPE:
                await phased.read_mark(r)
                if on_gpu_done is not None:
                    on_gpu_done()
                _line, status, answer_headers, data = await phased.read_answer(r)
                if len(data) > limit:
                    raise transcriptions.malformed(f"answer (past {limit} bytes)")
            else:
                data = await read_limited(r, limit)
                status, answer_headers = r.status, dict(r.headers)
    except (aiohttp.ClientError, OSError, TimeoutError, phased.PhasedError):
        message = f"The instance of '{inst.name}' is unavailable; retry shortly."
        raise upstream_failed(message, inst.retry_after_s()) from None
    if status != 200:
        retry = inst.retry_after_s() if status == 503 else None
        param = refused_param if status == 400 else None  # (e.g. it could not read the file)
        raise ApiError(status, error_message(data, status), param=param, retry_after=retry)
    return Answer(data, answer_headers)


async def read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The answer's body; past `limit` bytes, the model's answer is refused (a 502)."""
    data = bytearray()
    async for chunk in resp.content.iter_any():
        data += chunk
        if len(data) > limit:
            raise transcriptions.malformed(f"answer (past {limit} bytes)")
    return bytes(data)


def error_message(data: bytes, status: int) -> str:
    """The protocol's `{"error": "..."}` message, or a plain one."""
    try:
        message = orjson.loads(data).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        message = None
    return message if isinstance(message, str) and message else f"The model failed ({status})."
