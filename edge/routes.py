"""The edge's HTTP routes: each request is read and checked here, its tenant
authenticated and rate-checked, and made into a Call for edge/forwarding.py, which queues
it for a permit and sends it to a node. The state the handlers share (the node set,
admission, metrics, async jobs) lives in one EdgeRoutes, which `add_to(app)` registers
with the app's startup and cleanup (the client session, admission's polls, the etcd
followers)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

import aiohttp
import orjson
from aiohttp import web

from omni.api import images, phased, run_json, transcriptions
from omni.api.errors import ApiError, json_object, json_response
from omni.api.multipart_form import read_bounded
from omni.api.oip_http import add_model_routes, live, oip_error, server_metadata
from omni.api.proxy import OUTCOME, relay, relay_headers

from .admission import (
    BYTES_PER_TOKEN,
    Admission,
    deadline_from,
    estimate_cost,
    text_bytes,
)
from .async_jobs import AsyncJobs
from .forwarding import Call, Forwarder, Send, any_node
from .metrics import CONTENT_TYPE, EdgeMetrics
from .nodes import Node, NodeSet
from .tenants import Tenant, Tenants

log = logging.getLogger("omni-edge")

# Set by the edge itself (from the caller's credentials), never taken from a client.
TRUSTED_HEADERS = frozenset({"x-omni-tenant", "x-omni-origin"})
# x-omni-origin: this edge's location, so nodes count where their demand comes from and
# the scheduler places replicas near it.
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
FORWARDED = TRUSTED_HEADERS | {"traceparent"}  # set by the edge on every relayed request
AFFINITY_HEADER = "x-session-affinity"
ASYNC_HEADER = "x-omni-async"
SESSION = web.AppKey("session", aiohttp.ClientSession)
FOLLOWER = web.AppKey("follower", asyncio.Task)
MAP_FOLLOWER = web.AppKey("map_follower", asyncio.Task)
# What an Open Inference Protocol request costs in the fair queues and rate limits, in
# place of tokens: its tensors say nothing of its work, so each request counts one.
OIP_COST = 1.0


def check_inference_body(body: bytes) -> dict:
    data = json_object(body)
    model = data.get("model")
    if model is not None and not isinstance(model, str):  # present, of the wrong type
        raise ApiError(
            400, "Invalid type for 'model': expected a string.", param="model", code="invalid_value"
        )
    if not model:
        raise ApiError(
            400, "Missing required parameter: 'model'.", param="model", code="invalid_value"
        )
    return data


def estimate_prompt_tokens(data: dict) -> int:
    """About how many prompt tokens a request brings, for routing by prefill load: the
    size of its prompt, input or messages' contents, whatever their shape (no tokenizer
    at the edge, and an odd body must not fail here)."""
    text = data.get("prompt") or data.get("input") or ""
    if isinstance(data.get("messages"), list):
        text = [m.get("content") for m in data["messages"] if isinstance(m, dict)]
    return text_bytes(text) // BYTES_PER_TOKEN


def trace_header(incoming: str | None) -> str:
    """W3C traceparent for the hop to the node: the caller's trace with the edge's own
    span, or a new trace when the caller sent none (or a malformed one)."""
    parts = (incoming or "").strip().lower().split("-")
    span = secrets.token_hex(8)
    if (
        len(parts) == 4
        and parts[0] == "00"
        and len(parts[1]) == 32
        and len(parts[3]) == 2
        and all(c in "0123456789abcdef" for c in parts[1] + parts[3])
        and parts[1] != "0" * 32
    ):
        return f"00-{parts[1]}-{span}-{parts[3]}"
    return f"00-{secrets.token_hex(16)}-{span}-01"


class EdgeRoutes:
    """The edge's handlers and the state they share."""

    def __init__(
        self,
        upstream: str | list[str],
        max_body: int,
        tenants: Tenants | None = None,
        queueing: str = "fair",
        max_queued: int = 1024,
        early_release: bool = True,
        deadlines: dict[str, float] | None = None,
        etcd: str | None = None,
        location: str | None = None,
    ):
        """`upstream`: the nodes' (omnid's) inference endpoints; `max_queued`: requests a
        model's queue holds before shedding; `early_release=False` holds each permit until
        the client has read the whole answer (the baseline early release is measured
        against); `deadlines`: default deadline (ms) per model, "*" for the others; `etcd`:
        HOST:PORT of the cluster's etcd, whose announced nodes join the static ones;
        `location`: where this edge is, to read its distance to each node's location from
        the latency map."""
        self.max_body, self.etcd, self.location = max_body, etcd, location
        self.deadlines = deadlines or {}
        self.static = [upstream] if isinstance(upstream, str) else list(upstream)
        self.nodes = NodeSet(self.static)
        self.admission = Admission(self.nodes, tenants, max_queued=max_queued, queueing=queueing)
        self.metrics = EdgeMetrics(self.admission, self.nodes)
        self.jobs = AsyncJobs()
        self.forwarder = Forwarder(
            self.nodes, self.admission, self.metrics, self.jobs, early_release
        )

    def add_to(self, app: web.Application) -> None:
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/edge/nodes", self.node_view)
        app.router.add_get("/v1/async/{job}", self.async_result)
        app.router.add_get("/metrics", self.metrics_page)
        for path in INFERENCE_PATHS:
            app.router.add_post(path, self.infer)
        app.router.add_post(transcriptions.PATH, self.transcribe)
        app.router.add_post(images.PATH, self.generate_images)
        app.router.add_post(run_json.PATH, self.run_model)
        app.router.add_get("/v2", server_metadata)  # the Open Inference Protocol
        app.router.add_get("/v2/health/live", live)
        app.router.add_get("/v2/health/ready", self.oip_ready)
        add_model_routes(app, self.oip_model_query, self.oip_model_query, self.oip_infer)

    async def start(self, app: web.Application) -> None:
        """The client session the relays share, admission's polls of the nodes, and with
        etcd, the followers of its nodes and latency map."""
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        await self.admission.start(app[SESSION])
        if self.etcd:
            self._follow_etcd(app, self.etcd)

    def _follow_etcd(self, app: web.Application, etcd: str) -> None:
        """Route to the nodes announced in etcd too; with a location, read this edge's
        round trips to theirs from the latency map."""
        from omni.cluster.membership import follow_nodes  # aetcd (gRPC) only with --etcd

        app[FOLLOWER] = asyncio.create_task(follow_nodes(etcd, self._joined))
        if self.location:
            app[MAP_FOLLOWER] = asyncio.create_task(
                follow_latency_map(etcd, self.location, self.nodes)
            )

    def _joined(self, announced: dict[str, dict]) -> None:
        urls = self.static + [n["url"] for n in announced.values() if n.get("url")]
        where = {n["url"].rstrip("/"): n.get("location", "") for n in announced.values()}
        self.nodes.set_urls(urls, where)
        self.admission.resize()
        log.info("nodes: %s", ", ".join(urls) or "none")

    async def close(self, app: web.Application) -> None:
        for key in (FOLLOWER, MAP_FOLLOWER):
            if key in app:
                app[key].cancel()
        await self.jobs.stop()
        await self.admission.stop()
        await app[SESSION].close()

    def _tenant(self, request: web.Request) -> Tenant:
        return self.admission.tenant(request.headers.get("Authorization"))

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        self._tenant(request)
        return await self._relay_query(request, any_node(self.nodes))

    def model_node(self, model: str) -> Node:
        """A healthy node that serves `model`, else any (which answers the 404)."""
        return next(iter(self.nodes.hosts(model)), None) or any_node(self.nodes)

    async def oip_model_query(self, request: web.Request) -> web.StreamResponse:
        """A model's OIP metadata or readiness, from a node that serves it (no permit)."""
        self._tenant(request)
        return await self._relay_query(request, self.model_node(request.match_info["name"]))

    async def _relay_query(self, request: web.Request, node: Node) -> web.StreamResponse:
        """A GET that needs no permit, relayed to `node` as it is."""
        return await relay(
            request,
            request.app[SESSION],
            node.url + request.path_qs,
            None,
            upstream_name="omnid",
            drop_headers=TRUSTED_HEADERS,
        )

    async def oip_ready(self, _request: web.Request) -> web.Response:
        if any(n.healthy and n.models for n in self.nodes.nodes):
            return json_response({"ready": True})
        return oip_error(503, "No node is reachable.", 1)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        tenant = self._tenant(request)
        body = await read_bounded(request, self.max_body)
        data = check_inference_body(body)
        if data.get("stream") and request.headers.get(ASYNC_HEADER, "").lower() in ("true", "1"):
            message = "An async request cannot stream; fetch its result when done."
            raise ApiError(400, message, param="stream", code="invalid_value")
        cost, prompt_tokens = estimate_cost(data), estimate_prompt_tokens(data)
        model = data["model"]
        return await self.admit_and_relay(
            request, tenant, model, body, cost, prompt_tokens, arrived
        )

    async def oip_infer(self, request: web.Request) -> web.StreamResponse:
        """An Open Inference Protocol request: the model is in the path; its tensors are
        not tokens, so it costs OIP_COST in the fair queues and rate limits."""
        arrived = time.monotonic()
        tenant = self._tenant(request)
        body = await read_bounded(request, self.max_body)
        model = request.match_info["name"]
        return await self.admit_and_relay(request, tenant, model, body, OIP_COST, 0, arrived)

    async def transcribe(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's transcriptions: the upload is read (within its own limit, not
        max_body) for the model it names; a handler's request, it costs OIP_COST."""
        arrived = time.monotonic()
        tenant = self._tenant(request)
        body, upload = await transcriptions.read_upload(request)
        return await self.admit_and_relay(request, tenant, upload.model, body, OIP_COST, 0, arrived)

    async def generate_images(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's image generations: the body is checked here for the model it names;
        its n images, n handler requests, cost OIP_COST each."""
        arrived = time.monotonic()
        tenant = self._tenant(request)
        body = await read_bounded(request, images.MAX_BODY_BYTES)
        generation = images.parse_request(body)
        cost = OIP_COST * generation.n
        return await self.admit_and_relay(request, tenant, generation.model, body, cost, 0, arrived)

    async def run_model(self, request: web.Request) -> web.StreamResponse:
        """Plain JSON for a handler model (omni/api/run_json.py): the model is in the path,
        the body (checked by the node) costs OIP_COST, as its tensors would."""
        arrived = time.monotonic()
        tenant = self._tenant(request)
        body = await read_bounded(request, self.max_body)
        model = request.match_info["model"]
        return await self.admit_and_relay(request, tenant, model, body, OIP_COST, 0, arrived)

    async def admit_and_relay(
        self,
        request: web.Request,
        tenant: Tenant,
        model: str,
        body: bytes,
        cost: float,
        prompt_tokens: int,
        arrived: float,
    ) -> web.StreamResponse:
        """Queue a checked request fairly for a permit, then relay it to a node (or, with
        x-omni-async, answer 202 and run it later)."""
        default_ms = self.deadlines.get(model, self.deadlines.get("*"))
        deadline = deadline_from(request.headers, arrived, default_ms)
        self.admission.check_rate(tenant, cost)
        call = Call(
            tenant=tenant,
            model=model,
            path=request.path_qs,
            body=body,
            headers=self._node_headers(request, tenant),
            cost=cost,
            prompt_tokens=prompt_tokens,
            deadline=deadline,
            session_key=request.headers.get(AFFINITY_HEADER) or None,
            arrived=arrived,
        )
        if request.headers.get(ASYNC_HEADER, "").lower() in ("true", "1"):
            return self.forwarder.submit_async(call, request.app[SESSION])
        call.client = request
        return await self.forwarder.forward(call, relay_to(request, call))

    def _node_headers(self, request: web.Request, tenant: Tenant) -> dict[str, str]:
        """The client's headers for the node, with the tenant, the trace and the origin
        that only the edge sets."""
        return {
            **relay_headers(request.headers, FORWARDED),
            "x-omni-tenant": tenant.name,
            "traceparent": trace_header(request.headers.get("traceparent")),
            **({"x-omni-origin": self.location} if self.location else {}),
        }

    async def async_result(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        job = self.jobs.get(request.match_info["job"], tenant.name)
        if job is None:
            raise ApiError(404, "No such async request.", code="not_found")
        if job.result is None:
            return json_response(job.to_json(), 202, {"Retry-After": "1"})
        status, content_type, data = job.result
        return web.Response(
            status=status,
            body=data,
            headers={"Content-Type": content_type, "x-omni-async-status": job.status},
        )

    async def healthz(self, request: web.Request) -> web.Response:
        healthy = [n for n in self.nodes.nodes if n.healthy and n.models]
        if healthy:
            return json_response({"status": "ok", "nodes": len(healthy)})
        return json_response(
            {"status": "degraded", "omnid": "unreachable"}, 503, {"Retry-After": "1"}
        )

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def node_view(self, request: web.Request) -> web.Response:
        self._tenant(request)
        return json_response({"nodes": [n.to_json() for n in self.nodes.nodes]})


def relay_to(request: web.Request, call: Call) -> Send:
    """How a call whose client waits is sent: relayed to it as the node answers."""

    async def send(
        node: Node, on_usage: Callable[[dict], None], on_done: Callable[[], None] | None
    ) -> tuple[int, web.StreamResponse]:
        resp = await relay(
            request,
            request.app[SESSION],
            node.url + call.path,
            call.body,
            upstream_name="omnid",
            drop_headers=FORWARDED | {phased.HEADER},
            extra_headers={
                **{k: v for k, v in call.headers.items() if k in FORWARDED},
                phased.HEADER: "1",  # a handler's GPU work's end: the permit goes on
            },
            on_usage=on_usage,
            on_upstream_done=on_done,
        )
        return request.get(OUTCOME, resp.status), resp  # 499 if the client left mid-stream

    return send


async def follow_latency_map(etcd: str, location: str, nodes: NodeSet) -> None:
    """Keep `nodes.rtt_from_here` at the published map's row for this edge's location."""
    # Here, not at the top: aetcd (gRPC) loads only for an edge that follows etcd.
    from omni.cluster.latency import LATENCY_MAP, LatencyMap
    from omni.cluster.membership import follow_key

    async for value in follow_key(etcd, LATENCY_MAP):
        if value is not None:
            nodes.rtt_from_here = (
                LatencyMap.from_json(orjson.dumps(value)).matrix().get(location, {})
            )
