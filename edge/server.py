"""omni-edge, the front door: checks requests, picks a node, relays answers.

Each inference request is authenticated to a tenant (API keys from `--tenants`;
without it, one anonymous tenant), checked against the tenant's rate limits, and
queued fairly per model for one of the permits of the model's nodes. Then a node
is picked (edge/nodes.py: the session's own node for `x-session-affinity`, else
the better of two random ones, token-aware: by latency, free permits, the prompt
tokens queued there for prefill and how full its KV cache is). The permit goes
back as soon as the node has sent the whole answer (early release), while a
slow client may still be reading it from the edge. A node that fails before any
of its answer reached the client is counted towards its ejection and the request
goes to another node, within a retry budget. The tenant travels to omnid in
x-omni-tenant (prefix caches are per tenant; a client can never set it), with a
W3C traceparent naming the edge's span. Errors from omnid pass through unchanged.
With `x-omni-async: true` a request is answered 202 at once and runs when the
queue allows; its answer is fetched from /v1/async/{id} (edge/async_jobs.py).
An upload to /v1/audio/transcriptions is read within its own limit (an audio file's,
omni/api/transcriptions.py) for the model it names, and then goes the same way; so does
a request to /v1/images/generations (omni/api/images.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from omni.api import images, oip_grpc, phased, run_json, transcriptions
from omni.api.errors import ApiError, error_middleware, json_response, unavailable
from omni.api.multipart_form import read_bounded
from omni.api.oip_http import add_model_routes, live, oip_error, oip_errors, server_metadata
from omni.api.proxy import (
    CLIENT_CLOSED,
    OUTCOME,
    UpstreamFailed,
    relay,
    relay_headers,
    report_usage,
)
from omni.logs import setup_logging

from . import dashboard
from .admission import (
    BYTES_PER_TOKEN,
    Admission,
    deadline_from,
    estimate_cost,
    parse_deadlines,
    text_bytes,
)
from .async_jobs import AsyncJobs, fetch
from .fairq import Permit
from .metrics import CONTENT_TYPE, EdgeMetrics
from .nodes import Attempt, Node, NodeSet
from .tenants import Tenant, TenantConfigError, Tenants

log = logging.getLogger("omni-edge")
access = logging.getLogger("omni-edge.access")  # one JSON line per request; never a key

DEFAULT_MAX_BODY = 4 << 20
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
MAX_ATTEMPTS = 3  # nodes tried for one request that failed before anything was streamed
# What an Open Inference Protocol request costs in the fair queues and rate limits, in
# place of tokens: its tensors say nothing of its work, so each request counts one.
OIP_COST = 1.0
DEFAULT_GRPC_PORT = "8001"  # as Triton's


def check_inference_body(body: bytes) -> dict:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ApiError(400, "Request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "Request body must be a JSON object.", code="invalid_value")
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


@dataclass
class Call:
    """One admitted inference request, as forward() needs it."""

    tenant: Tenant
    model: str
    path: str
    body: bytes
    headers: dict[str, str]  # for the node: the client's, the tenant's, the trace
    cost: float
    prompt_tokens: int  # estimated: the node's prefill load it adds
    deadline: float | None
    session_key: str | None
    arrived: float
    job_id: str | None = None  # async requests
    client: web.Request | None = None  # the client's own request, while it waits (not async)

    def left(self) -> int:
        """The status of a call whose client left: what relay had sent it (OUTCOME)."""
        return self.client.get(OUTCOME, CLIENT_CLOSED) if self.client else CLIENT_CLOSED


# send(node, on_usage, on_done) -> (status, result); raises UpstreamFailed to try another
Send = Callable[[Node, Callable[[dict], None], Callable[[], None] | None], Awaitable[Any]]


class RetryBudget:
    """Retries may add at most `ratio` of the requests' load (plus a small burst): a
    failing fleet is not hit twice as hard by its own clients' retries."""

    def __init__(self, ratio: float = 0.2, burst: float = 10.0):
        self.ratio, self.burst, self.tokens = ratio, burst, burst

    def request(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def take(self) -> bool:
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


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


def edge_app(
    upstream: str | list[str],
    max_body: int,
    tenants: Tenants | None = None,
    queueing: str = "fair",
    max_queued: int = 1024,
    early_release: bool = True,
    deadlines: dict[str, float] | None = None,
    etcd: str | None = None,
    location: str | None = None,
) -> web.Application:
    """`upstream`: the nodes' (omnid's) inference endpoints; `max_queued`: requests a
    model's queue holds before shedding; `early_release=False` holds each permit until
    the client has read the whole answer (the baseline early release is measured against);
    `deadlines`: default deadline (ms) per model, "*" for the others; `etcd`: HOST:PORT
    of the cluster's etcd, whose announced nodes join the static ones; `location`: where
    this edge is, to read its distance to each node's location from the latency map."""
    app = web.Application(middlewares=[error_middleware, oip_errors], client_max_size=max_body)
    deadlines = deadlines or {}
    static = [upstream] if isinstance(upstream, str) else list(upstream)
    nodes = NodeSet(static)
    admission = Admission(nodes, tenants, max_queued=max_queued, queueing=queueing)
    retries = RetryBudget()
    metrics = EdgeMetrics(admission, nodes)
    app[dashboard.VIEW] = dashboard.EdgeView(admission, nodes, metrics)  # its own listener
    jobs = AsyncJobs()

    async def start(app: web.Application) -> None:
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        await admission.start(app[SESSION])
        if etcd:
            from scheduler.membership import follow_nodes

            def joined(announced: dict[str, dict]) -> None:
                urls = static + [n["url"] for n in announced.values() if n.get("url")]
                where = {n["url"].rstrip("/"): n.get("location", "") for n in announced.values()}
                nodes.set_urls(urls, where)
                admission.resize()
                log.info("nodes: %s", ", ".join(urls) or "none")

            app[FOLLOWER] = asyncio.create_task(follow_nodes(etcd, joined))
            if location:
                app[MAP_FOLLOWER] = asyncio.create_task(follow_latency_map(etcd, location, nodes))

    async def close(app: web.Application) -> None:
        for key in (FOLLOWER, MAP_FOLLOWER):
            if key in app:
                app[key].cancel()
        await jobs.stop()
        await admission.stop()
        await app[SESSION].close()

    app.on_startup.append(start)
    app.on_cleanup.append(close)

    def any_node() -> Node:
        """A healthy node for what needs no particular one (the model list, a model no
        node lists: the node answers its 404)."""
        node = next((n for n in nodes.nodes if n.healthy), None)
        if node is None:
            raise unavailable("No node is available; retry shortly.", 1)
        return node

    async def list_models(request: web.Request) -> web.StreamResponse:
        admission.tenant(request.headers.get("Authorization"))
        return await relay(
            request,
            request.app[SESSION],
            any_node().url + request.path_qs,
            None,
            upstream_name="omnid",
            drop_headers=TRUSTED_HEADERS,
        )

    def model_node(model: str) -> Node:
        """A healthy node that serves `model`, else any (which answers the 404)."""
        return next(iter(nodes.hosts(model)), None) or any_node()

    async def oip_model_query(request: web.Request) -> web.StreamResponse:
        """A model's OIP metadata or readiness, from a node that serves it (no permit)."""
        admission.tenant(request.headers.get("Authorization"))
        return await relay(
            request,
            request.app[SESSION],
            model_node(request.match_info["name"]).url + request.path_qs,
            None,
            upstream_name="omnid",
            drop_headers=TRUSTED_HEADERS,
        )

    async def oip_ready(_request: web.Request) -> web.Response:
        if any(n.healthy and n.models for n in nodes.nodes):
            return json_response({"ready": True})
        return oip_error(503, "No node is reachable.", 1)

    async def admit(call: Call) -> Permit | None:
        try:
            return await admission.permit(call.model, call.tenant, call.cost, call.deadline)
        except ApiError as exc:
            metrics.shed.labels(call.tenant.name, exc.code or str(exc.status)).inc()
            raise

    async def forward(call: Call, send: Send) -> Any:
        """Queue `call` fairly for a permit, then send it to a node (another one when the
        node fails before anything reached the client); counted, logged, released."""
        tenant, model = call.tenant, call.model
        status = 500  # an unexpected error: the middleware answers 500
        permit: Permit | None = None
        admitted: float | None = None
        tried: list[Node] = []
        attempt: Attempt | None = None

        def usage(u: dict) -> None:
            actual = float((u.get("prompt_tokens") or 0) + (u.get("completion_tokens") or 0))
            if actual and permit is not None:
                permit.correct_cost(actual)
                tenant.correct_tokens(call.cost, actual)

        def upstream_done() -> None:  # early release: the node's GPU work is over
            if attempt is not None and attempt.open:
                attempt.end(ok=True)
                metrics.upstream.labels(attempt.node.url).observe(
                    time.monotonic() - attempt.started
                )
            if permit is not None:
                permit.release()

        try:
            permit = await admit(call)
            admitted = time.monotonic()
            metrics.queue_wait.labels(tenant.name).observe(admitted - call.arrived)
            retries.request()
            while True:
                node = (
                    nodes.pick(model, call.session_key, tried, call.prompt_tokens)
                    if permit
                    else None
                )
                node = node or (any_node() if not tried else None)
                if node is None:
                    raise unavailable(f"No node can serve '{model}' now; retry shortly.", 1)
                tried.append(node)
                attempt = Attempt(nodes, node, model, call.prompt_tokens)
                try:
                    status, result = await send(
                        node, usage, upstream_done if early_release else None
                    )
                except UpstreamFailed:  # nothing reached the client: another node may serve it
                    attempt.end(ok=False)
                    others = permit and any(n not in tried for n in nodes.hosts(model))
                    if others and len(tried) < MAX_ATTEMPTS and retries.take():
                        log.info("retrying a request for %s on another node", model)
                        metrics.retries.inc()
                        continue
                    raise
                return result
        except ApiError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:  # the client left: 499 unless it had the whole answer
            status = call.left()
            raise
        finally:
            if attempt is not None:
                attempt.end(ok=True)  # the client left, or the relay ended without a callback
            if permit is not None:
                permit.release()  # once only: a no-op after the early release
            metrics.requests.labels(tenant.name, model, status).inc()
            now = time.monotonic()
            access.info(
                "%s",
                orjson.dumps(
                    {
                        "tenant": tenant.name,
                        "model": model,
                        "path": call.path,
                        "async": call.job_id,
                        "status": status,
                        "nodes": [n.url for n in tried],
                        "queued_ms": round(((admitted or now) - call.arrived) * 1e3, 3),
                        "ms": round((now - call.arrived) * 1e3, 3),
                        "traceparent": call.headers["traceparent"],
                    }
                ).decode(),
            )

    async def infer(request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        tenant = admission.tenant(request.headers.get("Authorization"))
        body = await read_bounded(request, max_body)
        data = check_inference_body(body)
        if data.get("stream") and request.headers.get(ASYNC_HEADER, "").lower() in ("true", "1"):
            message = "An async request cannot stream; fetch its result when done."
            raise ApiError(400, message, param="stream", code="invalid_value")
        cost, prompt_tokens = estimate_cost(data), estimate_prompt_tokens(data)
        model = data["model"]
        return await admit_and_relay(request, tenant, model, body, cost, prompt_tokens, arrived)

    async def oip_infer(request: web.Request) -> web.StreamResponse:
        """An Open Inference Protocol request: the model is in the path; its tensors are
        not tokens, so it costs OIP_COST in the fair queues and rate limits."""
        arrived = time.monotonic()
        tenant = admission.tenant(request.headers.get("Authorization"))
        body = await read_bounded(request, max_body)
        model = request.match_info["name"]
        return await admit_and_relay(request, tenant, model, body, OIP_COST, 0, arrived)

    async def transcribe(request: web.Request) -> web.StreamResponse:
        """OpenAI's transcriptions: the upload is read (within its own limit, not
        max_body) for the model it names; a handler's request, it costs OIP_COST."""
        arrived = time.monotonic()
        tenant = admission.tenant(request.headers.get("Authorization"))
        body, upload = await transcriptions.read_upload(request)
        return await admit_and_relay(request, tenant, upload.model, body, OIP_COST, 0, arrived)

    async def generate_images(request: web.Request) -> web.StreamResponse:
        """OpenAI's image generations: the body is checked here for the model it names;
        its n images, n handler requests, cost OIP_COST each."""
        arrived = time.monotonic()
        tenant = admission.tenant(request.headers.get("Authorization"))
        body = await read_bounded(request, images.MAX_BODY_BYTES)
        generation = images.parse_request(body)
        cost = OIP_COST * generation.n
        return await admit_and_relay(request, tenant, generation.model, body, cost, 0, arrived)

    async def run_model(request: web.Request) -> web.StreamResponse:
        """Plain JSON for a handler model (omni/api/run_json.py): the model is in the path,
        the body (checked by the node) costs OIP_COST, as its tensors would."""
        arrived = time.monotonic()
        tenant = admission.tenant(request.headers.get("Authorization"))
        body = await read_bounded(request, max_body)
        model = request.match_info["model"]
        return await admit_and_relay(request, tenant, model, body, OIP_COST, 0, arrived)

    async def admit_and_relay(
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
        deadline = deadline_from(request.headers, arrived, deadlines.get(model, deadlines.get("*")))
        admission.check_rate(tenant, cost)
        call = Call(
            tenant=tenant,
            model=model,
            path=request.path_qs,
            body=body,
            headers={
                **relay_headers(request.headers, FORWARDED),
                "x-omni-tenant": tenant.name,
                "traceparent": trace_header(request.headers.get("traceparent")),
                **({"x-omni-origin": location} if location else {}),
            },
            cost=cost,
            prompt_tokens=prompt_tokens,
            deadline=deadline,
            session_key=request.headers.get(AFFINITY_HEADER) or None,
            arrived=arrived,
        )
        if request.headers.get(ASYNC_HEADER, "").lower() in ("true", "1"):
            return submit_async(call)
        call.client = request

        async def send(node: Node, on_usage, on_done) -> tuple[int, web.StreamResponse]:
            resp = await relay(
                request,
                request.app[SESSION],
                node.url + call.path,
                body,
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

        return await forward(call, send)

    def submit_async(call: Call) -> web.Response:
        """202 now; the request queues and runs like any other, its answer kept for GET."""
        job = jobs.create(call.tenant.name)
        call.job_id = job.id

        async def send(node: Node, on_usage, on_done) -> tuple[int, None]:
            status, content_type, data = await fetch(
                app[SESSION], node.url + call.path, call.body, call.headers
            )
            if on_done:
                on_done()
            if status == 200:
                report_usage(data, on_usage)
            job.finish(status, content_type, data)
            return status, None

        async def run() -> None:
            job.status = "running"
            try:
                await forward(call, send)
            except ApiError as exc:
                job.finish(exc.status, "application/json", exc.response().body)
            except Exception:  # a bug: the job must still end, and say so
                log.exception("async request %s failed", job.id)
                err = ApiError(500, "The request failed inside the edge.", code="internal_error")
                job.finish(500, "application/json", err.response().body)

        jobs.start(job, run())
        return json_response(job.to_json(), 202, {"Location": f"/v1/async/{job.id}"})

    async def async_result(request: web.Request) -> web.Response:
        tenant = admission.tenant(request.headers.get("Authorization"))
        job = jobs.get(request.match_info["job"], tenant.name)
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

    async def healthz(request: web.Request) -> web.Response:
        healthy = [n for n in nodes.nodes if n.healthy and n.models]
        if healthy:
            return json_response({"status": "ok", "nodes": len(healthy)})
        return json_response(
            {"status": "degraded", "omnid": "unreachable"}, 503, {"Retry-After": "1"}
        )

    async def metrics_page(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def node_view(request: web.Request) -> web.Response:
        admission.tenant(request.headers.get("Authorization"))
        return json_response({"nodes": [n.to_json() for n in nodes.nodes]})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/edge/nodes", node_view)
    app.router.add_get("/v1/async/{job}", async_result)
    app.router.add_get("/metrics", metrics_page)
    for path in INFERENCE_PATHS:
        app.router.add_post(path, infer)
    app.router.add_post(transcriptions.PATH, transcribe)
    app.router.add_post(images.PATH, generate_images)
    app.router.add_post(run_json.PATH, run_model)
    app.router.add_get("/v2", server_metadata)  # the Open Inference Protocol
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", oip_ready)
    add_model_routes(app, oip_model_query, oip_model_query, oip_infer)
    return app


async def follow_latency_map(etcd: str, location: str, nodes: NodeSet) -> None:
    """Keep `nodes.rtt_from_here` at the published map's row for this edge's location."""
    from scheduler.latency import LATENCY_MAP, LatencyMap
    from scheduler.membership import follow_key

    async for value in follow_key(etcd, LATENCY_MAP):
        if value is not None:
            nodes.rtt_from_here = (
                LatencyMap.from_json(orjson.dumps(value)).matrix().get(location, {})
            )


async def run(args: argparse.Namespace) -> None:
    tenants = Tenants.from_file(args.tenants) if args.tenants else None
    app = edge_app(
        args.upstream,
        args.max_body_bytes,
        tenants,
        queueing=args.queueing,
        max_queued=args.max_queued,
        early_release=not args.no_early_release,
        deadlines=args.deadlines,
        etcd=args.etcd,
        location=args.location,
    )
    http_url = oip_grpc.loopback_url(args.host, args.port)  # gRPC calls take the HTTP path
    grpc_front = await oip_grpc.start_front(args.grpc_bind, http_url, args.grpc_required)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    board = await dashboard.serve(app[dashboard.VIEW], args.dashboard)
    log.info(
        "omni-edge listening on http://%s:%d -> %s", args.host, args.port, ", ".join(args.upstream)
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if grpc_front is not None:
        await grpc_front.stop()
    if board is not None:
        await board.cleanup()
    await runner.cleanup()


def arg_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="omni-edge", description=__doc__)
    parser.add_argument(
        "--host",
        default=env("OMNI_EDGE_HOST", "127.0.0.1"),
        help="address the public endpoint listens on ($OMNI_EDGE_HOST; 127.0.0.1)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(env("OMNI_EDGE_PORT", "8080")),
        help="port the public endpoint listens on ($OMNI_EDGE_PORT; 8080)",
    )
    parser.add_argument(
        "--upstream",
        action="append",
        help="a node's (omnid's) inference endpoint; repeat for several nodes "
        "(default: $OMNI_UPSTREAM, comma-separated, else http://127.0.0.1:8081)",
    )
    parser.add_argument(
        "--queueing",
        choices=("fair", "fifo"),
        default=env("OMNI_EDGE_QUEUEING", "fair"),
        help="fair: weighted fair queues per tenant; fifo: one queue (a baseline)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=int(env("OMNI_MAX_BODY_BYTES", str(DEFAULT_MAX_BODY))),
        help=f"largest request body taken, in bytes ($OMNI_MAX_BODY_BYTES; {DEFAULT_MAX_BODY})",
    )
    parser.add_argument(
        "--tenants",
        default=env("OMNI_TENANTS"),
        help="TOML file of tenants and their API keys (without it: no keys, one tenant)",
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=int(env("OMNI_EDGE_MAX_QUEUED", "1024")),
        help="requests one model's queue holds; beyond, the tenants over their share shed",
    )
    parser.add_argument(
        "--no-early-release",
        action="store_true",
        help="hold a permit until the client has read everything (a baseline)",
    )
    parser.add_argument(
        "--deadline-ms",
        action="append",
        default=[],
        metavar="MODEL=MS",
        help="default deadline of a model's requests without x-omni-deadline-ms "
        "(*=MS: every model); repeat per model",
    )
    parser.add_argument(
        "--etcd",
        default=env("OMNI_ETCD"),
        help="HOST:PORT of etcd: route to the nodes announced there too",
    )
    parser.add_argument(
        "--location",
        default=env("OMNI_LOCATION"),
        help="this edge's location: new nodes start at the latency map's round trip to theirs",
    )
    parser.add_argument(
        "--grpc-port",
        default=env("OMNI_GRPC_PORT"),
        help="the Open Inference Protocol over gRPC: PORT (on --host), HOST:PORT or 'off' "
        f"($OMNI_GRPC_PORT; {DEFAULT_GRPC_PORT}, given up with a warning if it is taken)",
    )
    parser.add_argument(
        "--dashboard",
        default=env("OMNI_EDGE_DASHBOARD", dashboard.DEFAULT_BIND),
        help="HOST:PORT of the read-only dashboard's own listener, loopback unless an "
        f"address is written out; 'off': none ($OMNI_EDGE_DASHBOARD; {dashboard.DEFAULT_BIND})",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = arg_parser()
    args = parser.parse_args(argv)
    try:
        args.deadlines = parse_deadlines(args.deadline_ms)
        args.dashboard = dashboard.parse(args.dashboard)
        args.grpc_required = args.grpc_port is not None
        args.grpc_bind = oip_grpc.parse_port(args.grpc_port or DEFAULT_GRPC_PORT, args.host)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.upstream:
        default = "" if args.etcd else "http://127.0.0.1:8081"
        args.upstream = [u for u in env("OMNI_UPSTREAM", default).split(",") if u]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("omni-edge")
    try:
        asyncio.run(run(args))
    except (TenantConfigError, oip_grpc.ListenError) as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
