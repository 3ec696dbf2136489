"""The edge's request path once a request is checked: a permit from the model's fair
queue, a node (another one, within a retry budget, when the node fails before any of its
answer reached the client), the permit back at the early release, and one access-log line
per request. An async request (x-omni-async) takes the same path later, its answer kept
for GET (edge/async_jobs.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from omni.api.errors import ApiError, json_response, unavailable
from omni.api.proxy import CLIENT_CLOSED, OUTCOME, UpstreamFailed, report_usage

from .admission import Admission
from .async_jobs import AsyncJobs, Job, fetch
from .fairq import Permit
from .metrics import EdgeMetrics
from .nodes import Attempt, Node, NodeSet
from .tenants import Tenant

log = logging.getLogger("omni-edge")
access = logging.getLogger("omni-edge.access")  # one JSON line per request; never a key

MAX_ATTEMPTS = 3  # nodes tried for one request that failed before anything was streamed


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


@dataclass
class CallState:
    """How far one call has got (its permit, the nodes tried, the attempt in flight): what
    the usage correction, the early release and the access log read as it goes."""

    call: Call
    status: int = 500  # an unexpected error: the middleware answers 500
    permit: Permit | None = None
    admitted: float | None = None
    tried: list[Node] = field(default_factory=list)
    attempt: Attempt | None = None

    def usage(self, u: dict) -> None:
        """The answer's usage corrects the estimated cost, in the queue and the tenant's
        rate limit."""
        actual = float((u.get("prompt_tokens") or 0) + (u.get("completion_tokens") or 0))
        if actual and self.permit is not None:
            self.permit.correct_cost(actual)
            self.call.tenant.correct_tokens(self.call.cost, actual)


def any_node(nodes: NodeSet) -> Node:
    """A healthy node for what needs no particular one (the model list, a model no
    node lists: the node answers its 404)."""
    node = next((n for n in nodes.nodes if n.healthy), None)
    if node is None:
        raise unavailable("No node is available; retry shortly.", 1)
    return node


class Forwarder:
    """Admitted calls to the nodes: queued, sent (and retried), counted, logged, released."""

    def __init__(
        self,
        nodes: NodeSet,
        admission: Admission,
        metrics: EdgeMetrics,
        jobs: AsyncJobs,
        early_release: bool = True,
    ):
        """`early_release=False` holds each permit until the client has read the whole
        answer (the baseline early release is measured against)."""
        self.nodes, self.admission, self.metrics, self.jobs = nodes, admission, metrics, jobs
        self.early_release = early_release
        self.retries = RetryBudget()

    async def admit(self, call: Call) -> Permit | None:
        try:
            return await self.admission.permit(call.model, call.tenant, call.cost, call.deadline)
        except ApiError as exc:
            self.metrics.shed.labels(call.tenant.name, exc.code or str(exc.status)).inc()
            raise

    async def forward(self, call: Call, send: Send) -> Any:
        """Queue `call` fairly for a permit, then send it to a node (another one when the
        node fails before anything reached the client); counted, logged, released."""
        state = CallState(call)
        try:
            state.permit = await self.admit(call)
            state.admitted = time.monotonic()
            self.metrics.queue_wait.labels(call.tenant.name).observe(state.admitted - call.arrived)
            self.retries.request()
            return await self._send(state, send)
        except ApiError as exc:
            state.status = exc.status
            raise
        except asyncio.CancelledError:  # the client left: 499 unless it had the whole answer
            state.status = call.left()
            raise
        finally:
            self._finish(state)

    async def _send(self, state: CallState, send: Send) -> Any:
        """Send the call to one node after another until one answers or none is left to
        try: a node's failure before anything reached the client is not the client's."""
        call = state.call
        on_done = functools.partial(self._upstream_done, state) if self.early_release else None
        while True:
            node = self._next_node(state)
            state.tried.append(node)
            state.attempt = Attempt(self.nodes, node, call.model, call.prompt_tokens)
            try:
                state.status, result = await send(node, state.usage, on_done)
            except UpstreamFailed:  # nothing reached the client: another node may serve it
                state.attempt.end(ok=False)
                if self._may_retry(state):
                    log.info("retrying a request for %s on another node", call.model)
                    self.metrics.retries.inc()
                    continue
                raise
            return result

    def _next_node(self, state: CallState) -> Node:
        """The node for the next attempt; without a permit (no node lists the model), any
        node, once, to answer its 404."""
        call = state.call
        node = (
            self.nodes.pick(call.model, call.session_key, state.tried, call.prompt_tokens)
            if state.permit
            else None
        )
        node = node or (any_node(self.nodes) if not state.tried else None)
        if node is None:
            raise unavailable(f"No node can serve '{call.model}' now; retry shortly.", 1)
        return node

    def _may_retry(self, state: CallState) -> bool:
        """Another node serves the model, the attempts and the retry budget allow one more."""
        others = state.permit and any(
            n not in state.tried for n in self.nodes.hosts(state.call.model)
        )
        return bool(others and len(state.tried) < MAX_ATTEMPTS and self.retries.take())

    def _upstream_done(self, state: CallState) -> None:
        """Early release: the node's GPU work is over."""
        attempt = state.attempt
        if attempt is not None and attempt.open:
            attempt.end(ok=True)
            self.metrics.upstream.labels(attempt.node.url).observe(
                time.monotonic() - attempt.started
            )
        if state.permit is not None:
            state.permit.release()

    def _finish(self, state: CallState) -> None:
        """The attempt ended, the permit back, the request counted and logged, in that order."""
        call = state.call
        if state.attempt is not None:
            state.attempt.end(ok=True)  # the client left, or the relay ended without a callback
        if state.permit is not None:
            state.permit.release()  # once only: a no-op after the early release
        self.metrics.requests.labels(call.tenant.name, call.model, state.status).inc()
        log_access(state)

    def submit_async(self, call: Call, session: aiohttp.ClientSession) -> web.Response:
        """202 now; the request queues and runs like any other, its answer kept for GET."""
        job = self.jobs.create(call.tenant.name)
        call.job_id = job.id
        self.jobs.start(job, self._run_async(job, call, self._fetch_into(job, call, session)))
        return json_response(job.to_json(), 202, {"Location": f"/v1/async/{job.id}"})

    def _fetch_into(self, job: Job, call: Call, session: aiohttp.ClientSession) -> Send:
        """How an async call is sent: its whole answer read from the node into the job."""

        async def send(
            node: Node, on_usage: Callable[[dict], None], on_done: Callable[[], None] | None
        ) -> tuple[int, None]:
            status, content_type, data = await fetch(
                session, node.url + call.path, call.body, call.headers
            )
            if on_done:
                on_done()
            if status == 200:
                report_usage(data, on_usage)
            job.finish(status, content_type, data)
            return status, None

        return send

    async def _run_async(self, job: Job, call: Call, send: Send) -> None:
        job.status = "running"
        try:
            await self.forward(call, send)
        except ApiError as exc:
            job.finish(exc.status, "application/json", exc.response().body)
        except Exception:  # a bug: the job must still end, and say so
            log.exception("async request %s failed", job.id)
            err = ApiError(500, "The request failed inside the edge.", code="internal_error")
            job.finish(500, "application/json", err.response().body)


def log_access(state: CallState) -> None:
    """One JSON line for the request: who, what, where it went, how it ended, how long."""
    call, now = state.call, time.monotonic()
    access.info(
        "%s",
        orjson.dumps(
            {
                "tenant": call.tenant.name,
                "model": call.model,
                "path": call.path,
                "async": call.job_id,
                "status": state.status,
                "nodes": [n.url for n in state.tried],
                "queued_ms": round(((state.admitted or now) - call.arrived) * 1e3, 3),
                "ms": round((now - call.arrived) * 1e3, 3),
                "traceparent": call.headers["traceparent"],
            }
        ).decode(),
    )
