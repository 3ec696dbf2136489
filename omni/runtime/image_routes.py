"""omnid's `POST /v1/images/generations`: a prompt, as n infer requests to a text-to-image
handler model (omni/api/images.py says which models are).

The request takes the path every inference request takes (`Node.admission`: a permit,
the queue, 429/503 with Retry-After), once for its n images: they go to the instance
together, which batches them. The permit goes on once every image's GPU work is over
(the handler's gpu_done), and the edge's too, answered in phases (omni/api/phased.py),
while the PNGs are encoded. Whether the model draws is read from its instance's
metadata first (no permit), so any other model is refused before it queues.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from aiohttp import web

from omni.api import images, oip, phased
from omni.api.errors import ApiError
from omni.api.multipart_form import read_bounded
from omni.api.transcriptions import malformed

from .transcription_routes import Answer, call, handler_metadata, other_kind

if TYPE_CHECKING:
    from .instance import Instance
    from .omnid import Node


async def generate(node: Node, request: web.Request) -> web.Response:
    """One request's images, through the model's admission, answered in OpenAI's form."""
    generation = images.parse_request(await read_bounded(request, images.MAX_BODY_BYTES))

    def refuse(inst: Instance) -> ApiError:
        return images.not_image_model(inst.name, f"it is {other_kind(inst)} model")

    inst, declared = await handler_metadata(node, request, generation.model, refuse)
    requests = images.infer_requests(generation, images.signature(inst.name, declared))
    gpu_done = asyncio.Event()  # every image's GPU work over: the permit goes on

    async def work() -> web.Response:
        t_admit = time.monotonic()
        deadline = t_admit + node.request_timeout_s
        async with node.admission(inst, deadline, request["omni_ticket"]) as release:
            node.metrics.observe_admission(inst.name, time.monotonic() - t_admit)
            left = len(requests)

            def drawn() -> None:
                nonlocal left
                left -= 1
                if left == 0:
                    release()
                    gpu_done.set()

            answers = await asyncio.gather(
                *(draw(inst, body, headers, drawn) for body, headers in requests)
            )
        return images.response([png(answer, generation) for answer in answers])

    return await phased.answer(request, work(), gpu_done)


async def draw(inst: Instance, body: bytes, headers: dict, drawn=None) -> Answer:
    """One image's infer request; the model's refusal (a 400) names the request's field
    its message starts with (a handler's "width: ..." is the size's fault)."""
    path = f"/v2/models/{inst.name}/infer"
    try:
        return await call(
            inst, "POST", path, body, headers, refused_param="prompt", on_gpu_done=drawn
        )
    except ApiError as exc:
        if exc.status == 400 and exc.message.startswith(("width", "height")):
            exc.param = "size"
        raise


def png(answer: Answer, generation: images.Generation) -> bytes:
    try:
        decoded = oip.decode_response(answer.body, answer.headers)
    except oip.OipError as exc:
        raise malformed(f"answer ({exc.message})") from None
    return images.png(decoded, generation)
