"""omnid's `POST /v1/run/{model}`: a plain JSON body, as one infer request to a handler
model (omni/api/run_json.py says how values map to its tensors).

The request takes the path every inference request takes (`Node.admission`: a permit,
the queue, 429/503 with Retry-After). The model's tensors are read from its instance's
metadata first (no permit), so a body that does not fit them is refused before it
queues. The handler's HandlerError is a 400 with its message.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from omni.api import oip, run_json
from omni.api.errors import json_response
from omni.api.transcriptions import malformed

from .transcription_routes import call, handler_metadata

if TYPE_CHECKING:
    from .omnid import Node


async def run(node: Node, request: web.Request) -> web.Response:
    """One JSON body, through the model's admission, answered as `{"result": ...}`."""
    inst, declared = await handler_metadata(
        node,
        request,
        request.match_info["model"],
        lambda inst: run_json.not_a_handler(inst.name, inst.entry.kind),
    )
    body = await request.read()  # (within the app's client_max_size: a 413 past it)
    signature = run_json.signature(declared)
    infer_body, headers = run_json.infer_request(body, signature)
    sole = next(iter(signature.inputs)) if len(signature.inputs) == 1 else None
    t_admit = time.monotonic()
    async with node.admission(inst, t_admit + node.request_timeout_s, request["omni_ticket"]):
        node.metrics.observe_admission(inst.name, time.monotonic() - t_admit)
        path = f"/v2/models/{inst.name}/infer"
        answer = await call(inst, "POST", path, infer_body, headers, refused_param=sole)
    try:
        decoded = oip.decode_response(answer.body, answer.headers)
    except oip.OipError as exc:
        raise malformed(f"answer ({exc.message})") from None
    return json_response(run_json.result(decoded, signature))
