"""omnid's Open Inference Protocol (KServe v2) routes, relayed to handler instances.

An infer request takes the path a /v1 request takes (`Node.admission`: a permit, the
queue, 429/503 with Retry-After, the instance made resident on its GPU) and is relayed
to the instance's own `/v2/models/{name}/infer`, which decodes and checks its tensors.
Metadata and readiness come from the instance too, but take no permit: they must answer
while the model is busy. Only handler models (OIP_RUNTIMES) are under /v2; asking for
an LLM or embedding model there is a 404 that names its /v1 routes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from omni.api import phased
from omni.api.errors import ApiError, unavailable
from omni.api.oip_http import (
    OIP_RUNTIMES,
    add_model_routes,
    check_version,
    live,
    oip_error,
    server_metadata,
)
from omni.api.proxy import relay
from omni.engine import kv_transfer

from .instance import State

if TYPE_CHECKING:
    from .instance import Instance
    from .omnid import Node


def add_routes(app: web.Application, node: Node, counted_infer) -> None:
    """The server's routes, and each model's; `counted_infer` is omnid's infer handler
    (metrics and load telemetry around `infer` below)."""

    async def ready(_request: web.Request) -> web.Response:
        if node.draining:
            return oip_error(503, "This node is draining.", 5)
        return web.json_response({"ready": True})

    async def model_metadata(request: web.Request) -> web.StreamResponse:
        return await relay_query(node, request, "")

    async def model_ready(request: web.Request) -> web.StreamResponse:
        inst = oip_instance(node, request)
        if inst.state != State.READY:  # the protocol's "not ready" is a 4xx
            return oip_error(400, f"Model '{inst.name}' is {inst.state}.")
        return await relay_query(node, request, "/ready")

    app.router.add_get("/v2", server_metadata)
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
    add_model_routes(app, model_metadata, model_ready, counted_infer)


def oip_instance(node: Node, request: web.Request) -> Instance:
    """The handler instance the path names (a 404 for an unknown model, or one that
    does not speak the protocol)."""
    inst = node.get(request.match_info["name"])
    if inst.entry.runtime not in OIP_RUNTIMES:
        raise ApiError(
            404,
            f"Model '{inst.name}' does not serve the Open Inference Protocol; "
            "use its OpenAI routes under /v1.",
        )
    check_version(request, inst.entry.version)
    return inst


async def ready_instance(node: Node, request: web.Request) -> Instance:
    inst = oip_instance(node, request)
    if node.draining:
        raise unavailable("This node is draining; retry on another node.", 5)
    await node.wait_ready(inst)
    return inst


async def infer(node: Node, request: web.Request) -> web.StreamResponse:
    """One infer request, through the instance's admission, relayed to it."""
    inst = oip_instance(node, request)
    request["omni_model"] = inst.name
    request["omni_version"] = inst.entry.version
    body = await request.read()
    inst = await ready_instance(node, request)
    t_admit = time.monotonic()
    deadline = t_admit + node.request_timeout_s
    async with node.admission(inst, deadline, request["omni_ticket"]) as release:
        node.metrics.observe_admission(inst.name, time.monotonic() - t_admit)
        return await relay(
            request,
            inst.session,
            inst.url(f"/v2/models/{inst.name}/infer"),
            body,
            upstream_name=f"instance of '{inst.name}'",
            retry_after_s=inst.retry_after_s(),
            drop_headers=kv_transfer.HEADERS,
            extra_headers={phased.HEADER: "1"},  # its GPU work's end, to release early
            on_upstream_done=release,
            pass_phases=phased.asked(request.headers),  # the edge's: it releases too
        )


async def relay_query(node: Node, request: web.Request, suffix: str) -> web.StreamResponse:
    """A model's metadata or readiness, from its instance (no permit taken)."""
    inst = await ready_instance(node, request)
    return await relay(
        request,
        inst.session,
        inst.url(f"/v2/models/{inst.name}{suffix}"),
        None,
        upstream_name=f"instance of '{inst.name}'",
        retry_after_s=inst.retry_after_s(),
        drop_headers=kv_transfer.HEADERS,
    )
