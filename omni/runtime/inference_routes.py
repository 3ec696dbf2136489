"""omnid's inference endpoint (TCP): the OpenAI-compatible routes, relayed to the model's
instance, `/v1/models`, `/healthz` and Prometheus `/metrics`.

Every inference request goes through `InferenceRoutes.infer`, which counts it (metrics,
and load telemetry when a cluster takes it) and hands it to its API's handler: the
OpenAI-style `route` here, or the transcription, image, run and Open Inference Protocol
routes of their own modules.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from omni.api import images, run_json, transcriptions
from omni.api.errors import ApiError, json_response, unavailable
from omni.api.proxy import CLIENT_CLOSED, OUTCOME, relay
from omni.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse_request,
)
from omni.engine import kv_transfer

from . import disaggregated, image_routes, oip_routes, run_routes, transcription_routes
from .metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from .instance import Instance
    from .omnid import Node

# endpoint -> (schema, model kind that serves it)
ENDPOINTS = {
    "/v1/chat/completions": (ChatCompletionRequest, "generate"),
    "/v1/completions": (CompletionRequest, "generate"),
    "/v1/embeddings": (EmbeddingRequest, "embed"),
}


@dataclass
class Ticket:
    """One request's turn at its instance, as admission() saw it."""

    queue_s: float = 0.0  # waiting for a permit
    held_s: float = 0.0  # holding it: until the whole answer was sent
    usage: dict | None = None  # the response's usage, when it reported one


def failure(inst: Instance) -> dict:
    """A failed instance's reason, for the model list."""
    return {"error": inst.failure} if inst.failure is not None else {}


def usage_tokens(usage: dict | None) -> tuple[int, int]:
    """(prompt, completion) tokens of a response's usage; 0 for what it does not report."""

    def count(key: str) -> int:
        value = (usage or {}).get(key)
        return value if isinstance(value, int) and value > 0 else 0

    return count("prompt_tokens"), count("completion_tokens")


class InferenceRoutes:
    """The inference endpoint's handlers, over the node whose instances answer them."""

    def __init__(self, node: Node):
        self.node = node

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        for path in (*ENDPOINTS, transcriptions.PATH, images.PATH, run_json.PATH):
            app.router.add_post(path, self.infer)
        oip_routes.add_routes(app, self.node, self.infer)  # /v2: the Open Inference Protocol

    async def models(self, _request: web.Request) -> web.Response:
        """The node's models, as the edge reads them to route and queue."""
        node = self.node
        # `permits`: the instance's concurrency, which the edge queues fairly for; `load`:
        # what it weighs a node by (prompt tokens queued, KV blocks in use)
        entries = {
            name: {
                "permits": inst.entry.placement.permits,
                "state": str(inst.state),
                **failure(inst),
                "load": inst.load(),
            }
            for name, inst in node.instances.items()
            if inst.entry.placement.serves is None  # (a side of a disaggregated model)
        }
        for name in {i.entry.placement.serves for i in node.instances.values()} - {None}:
            entries[name] = disaggregated.listing(node.instances, name)
        data = [
            {"id": name, "object": "model", "created": node.started, "owned_by": "omni", **entry}
            for name, entry in sorted(entries.items())
        ]
        return json_response({"object": "list", "data": data})

    async def infer(self, request: web.Request) -> web.StreamResponse:
        """Every inference request, of any API: counted here, whatever its outcome."""
        t0 = time.monotonic()
        status = 500  # an unexpected error: the middleware answers 500
        ticket = request["omni_ticket"] = Ticket()
        try:
            resp = await self._dispatch(request)
            status = request.get(OUTCOME, resp.status)  # a stream cut short is not a 200
            return resp
        except ApiError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:  # the client left: 499 unless it had the whole answer
            status = request.get(OUTCOME, CLIENT_CLOSED)
            raise
        finally:
            self._observe(request, ticket, status, t0)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        """The handler of the API the request's path belongs to."""
        node = self.node
        if request.path.startswith("/v2/"):
            return await oip_routes.infer(node, request)
        if request.path == transcriptions.PATH:
            return await transcription_routes.transcribe(node, request)
        if request.path == images.PATH:
            return await image_routes.generate(node, request)
        if request.match_info.route.resource.canonical == run_json.PATH:
            return await run_routes.run(node, request)
        return await self.route(request)

    def _observe(self, request: web.Request, ticket: Ticket, status: int, t0: float) -> None:
        """A finished request in the metrics, and in the load telemetry when a cluster
        takes it."""
        node = self.node
        model = request.get("omni_model", "-")  # "-": no body read, or no such model
        # the route's pattern, not the path: /v2's paths name the model (and version)
        endpoint = request.match_info.route.resource.canonical
        node.metrics.observe_request(model, endpoint, status, time.monotonic() - t0)
        if node.load is not None and "omni_model" in request:
            prompt, completion = usage_tokens(ticket.usage)
            node.load.record_request(
                request["omni_model"],
                wall_s=ticket.held_s,
                queue_s=ticket.queue_s,
                prompt_tokens=prompt,
                completion_tokens=completion,
                status=status,
                version=request.get("omni_version", ""),
                origin=request.headers.get("x-omni-origin", ""),
            )

    async def route(self, request: web.Request) -> web.StreamResponse:
        """An OpenAI-style request (ENDPOINTS): checked against its schema and its model's
        kind, then relayed to the model's instance (both sides, for a disaggregated one)."""
        node = self.node
        schema, kind = ENDPOINTS[request.path]
        body = await request.read()
        req = parse_request(schema, body)
        ticket: Ticket = request["omni_ticket"]

        def on_usage(usage: dict) -> None:
            node.metrics.observe_usage(req.model, usage)
            ticket.usage = usage

        if node.draining:
            raise unavailable("This node is draining; retry on another node.", 5)
        if disaggregated.sides(node.instances, req.model) and kind == "generate":
            request["omni_model"] = req.model
            return await disaggregated.serve(node, request, body, req.model, on_usage)
        inst = node.get(req.model)
        request["omni_model"] = req.model
        request["omni_version"] = inst.entry.version
        if inst.entry.kind != kind:
            raise ApiError(
                400,
                f"Model '{req.model}' does not serve {request.path}.",
                param="model",
                code="wrong_model_kind",
            )
        await node.wait_ready(inst)
        return await self._relay(request, inst, body, ticket, on_usage)

    async def _relay(
        self,
        request: web.Request,
        inst: Instance,
        body: bytes,
        ticket: Ticket,
        on_usage: Callable[[dict], None],
    ) -> web.StreamResponse:
        """The request to its ready instance, under one of its permits (and, on a GPU, its
        memory resident) until the whole answer is sent."""
        node = self.node
        t_admit = time.monotonic()
        async with node.admission(inst, t_admit + node.request_timeout_s, ticket):
            node.metrics.observe_admission(inst.name, time.monotonic() - t_admit)
            return await relay(
                request,
                inst.session,
                inst.url(request.path),
                body,
                upstream_name=f"instance of '{inst.name}'",
                retry_after_s=inst.retry_after_s(),
                drop_headers=kv_transfer.HEADERS,  # omnid's alone to give
                on_usage=on_usage,
            )

    async def healthz(self, _request: web.Request) -> web.Response:
        """Ok while the node takes requests; 503 while it drains."""
        if self.node.draining:
            return json_response({"status": "draining"}, 503)
        return json_response({"status": "ok"})

    async def metrics(self, _request: web.Request) -> web.Response:
        """Prometheus metrics, rendered off the event loop: it reads the shim's control blocks
        and NVML."""
        body = await asyncio.to_thread(self.node.metrics.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
