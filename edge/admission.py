"""What the edge decides before forwarding: who is asking, what it costs, and when it may go.

One fair queue per model, sized to the permits its healthy nodes report for it
(polled, so catalog changes and node failures reach the edge without a
restart). A request's cost is an estimate in tokens (prompt bytes / 4 +
max_tokens), corrected from the answer's usage once known. `fifo` queueing puts
every tenant in one queue: the baseline that fair queueing is measured against.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from omni.api.errors import ApiError, unavailable

from .fairq import FairQueue, Permit, Shed
from .nodes import REFRESH_S, NodeSet
from .tenants import RateLimited, Tenant, TenantError, Tenants

log = logging.getLogger(__name__)

DEADLINE_HEADER = "x-omni-deadline-ms"
DEFAULT_MAX_TOKENS = 256  # what an unbounded request is charged until its usage is known
BYTES_PER_TOKEN = 4
ANONYMOUS = Tenant("anonymous")  # without a tenants file: one tenant, no keys, no limits


def text_bytes(value: object) -> int:
    """Bytes of the strings in a JSON value, walked without recursion (a body may nest
    deeper than Python's recursion limit); other scalars count as their text."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode(errors="replace"))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif item is not None:
            total += len(str(item))
    return total


def estimate_cost(data: dict) -> float:
    """Tokens a request will take: its text's size, plus what it may generate."""
    text = data.get("prompt") or data.get("input") or ""
    if "messages" in data and isinstance(data["messages"], list):
        text = [m.get("content") for m in data["messages"] if isinstance(m, dict)]
    prompt_bytes = text_bytes(text)
    max_tokens = data.get("max_completion_tokens") or data.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        max_tokens = 0 if "input" in data else DEFAULT_MAX_TOKENS  # embeddings generate nothing
    return max(1.0, prompt_bytes / BYTES_PER_TOKEN + max_tokens)


def deadline_from(headers, now: float, default_ms: float | None = None) -> float | None:
    """The request's deadline: its header's, else the model's default, else none."""
    value = headers.get(DEADLINE_HEADER)
    if value is None:
        return None if default_ms is None else now + default_ms / 1000
    try:
        ms = float(value)
    except ValueError:
        ms = -1
    if not ms > 0:
        message = f"{DEADLINE_HEADER} must be a positive number of milliseconds."
        raise ApiError(400, message, param=DEADLINE_HEADER, code="invalid_value")
    return now + ms / 1000


def parse_deadlines(specs: list[str]) -> dict[str, float]:
    """`MODEL=MS` (or `*=MS` for every model) -> {model: ms}; a bad spec is a ValueError."""
    out: dict[str, float] = {}
    for spec in specs:
        model, sep, ms = spec.partition("=")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if not sep or not model or not value > 0:
            raise ValueError(f"--deadline-ms {spec!r}: expected MODEL=MILLISECONDS (> 0)")
        out[model] = value
    return out


def api_error(exc: TenantError | Shed) -> ApiError:
    if isinstance(exc, Shed):
        if exc.status == 503:
            return unavailable("No node can serve this model now; retry shortly.", 2)
        if exc.reason == "deadline":
            return ApiError(
                504,
                "The request could not be served before its deadline.",
                code="deadline_exceeded",
            )
        return ApiError(
            429,
            "The service is overloaded; retry shortly.",
            code="overloaded",
            retry_after=exc.retry_after_s,
        )
    return ApiError(exc.status, exc.message, code=exc.code, retry_after=exc.retry_after_s)


class Admission:
    """Tenants and one fair queue per model."""

    def __init__(
        self,
        nodes: NodeSet,
        tenants: Tenants | None,
        max_queued: int = 1024,
        queueing: str = "fair",
    ):
        if queueing not in ("fair", "fifo"):
            raise ValueError(f"queueing must be 'fair' or 'fifo', not {queueing!r}")
        self.nodes = nodes
        self.tenants = tenants
        self.fifo = queueing == "fifo"
        self.max_queued = max_queued
        self.queues: dict[str, FairQueue] = {}
        self._weights = {t.name: t.weight for t in tenants.tenants.values()} if tenants else {}
        self._refresher: asyncio.Task | None = None

    def tenant(self, authorization: str | None) -> Tenant:
        if self.tenants is None:
            return ANONYMOUS
        try:
            return self.tenants.authenticate(authorization)
        except TenantError as exc:
            raise api_error(exc) from None

    def check_rate(self, tenant: Tenant, cost: float) -> None:
        try:
            tenant.check_rate(cost)
        except RateLimited as exc:
            raise api_error(exc) from None

    async def permit(self, model: str, tenant: Tenant, cost: float, deadline) -> Permit | None:
        """A permit for `model`, queued fairly; None for a model no node lists (the node
        it goes to answers 404 itself); 503 while every node that lists it is down."""
        queue = self.queues.get(model)
        if queue is None:
            if any(model in node.models for node in self.nodes.nodes):
                raise unavailable(f"No node serving '{model}' is up; retry shortly.", 2)
            return None
        try:
            return await queue.acquire("all" if self.fifo else tenant.name, cost, deadline)
        except Shed as exc:
            raise api_error(exc) from None

    async def start(self, session: aiohttp.ClientSession) -> None:
        await self.refresh(session)
        self._refresher = asyncio.create_task(self._refresh_forever(session))

    async def stop(self) -> None:
        if self._refresher:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        """Models and permits from every node's /v1/models."""
        await self.nodes.refresh(session)
        self.resize()

    def resize(self) -> None:
        """Each model's queue to the permits of its healthy nodes. A model no healthy
        node serves any more loses its queue: what waited there gets 503 at once rather
        than waiting for capacity that may never come back."""
        permits = self.nodes.models()
        for model in set(permits) | set(self.queues):
            queue = self.queues.get(model)
            if model not in permits:
                queue.set_permits(0)
                queue.shed_all()
                del self.queues[model]  # its permits in use still return to it
            elif queue is None:
                queue = self.queues[model] = FairQueue(
                    permits[model], max_queued=self.max_queued, weights=self._weights
                )
            else:
                queue.set_permits(permits[model])
            if model in self.queues:  # a handler's ETA: its GPU turn is what a permit holds
                eta = self.nodes.eta(model)
                self.queues[model].service_s = eta[0] if eta is not None else None

    async def _refresh_forever(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await self.refresh(session)
