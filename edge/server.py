"""omni-edge, the front door: checks requests, forwards /v1/* to omnid, relays answers.

Each inference request is authenticated to a tenant (API keys from `--tenants`;
without it, one anonymous tenant), checked against the tenant's rate limits, and
queued fairly per model for one of the model's permits. The permit goes back
as soon as omnid has sent the whole answer (early release), while a slow client
may still be reading it from the edge. The tenant travels to omnid in
x-omni-tenant (prefix caches are per tenant); a client can never set it.
Errors from omnid pass through unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time

import aiohttp
import orjson
from aiohttp import web

from omni.api.errors import ApiError, error_middleware, json_response
from omni.api.proxy import relay
from omni.logs import setup_logging

from .admission import Admission, deadline_from, estimate_cost
from .tenants import TenantConfigError, Tenants

log = logging.getLogger("omni-edge")

DEFAULT_MAX_BODY = 4 << 20
# Set by the edge itself (from the caller's credentials), never taken from a client.
TRUSTED_HEADERS = frozenset({"x-omni-tenant"})
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it passes `limit` bytes."""
    too_large = ApiError(
        413, f"Request body exceeds the {limit}-byte limit.", code="request_too_large"
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def check_inference_body(body: bytes) -> dict:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ApiError(400, "Request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "Request body must be a JSON object.", code="invalid_value")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(
            400, "Missing required parameter: 'model'.", param="model", code="invalid_value"
        )
    return data


def edge_app(upstream: str, max_body: int, tenants: Tenants | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body)
    upstream = upstream.rstrip("/")
    admission = Admission(upstream, tenants)

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        await admission.start(app["session"])

    async def close(app: web.Application) -> None:
        await admission.stop()
        await app["session"].close()

    app.on_startup.append(start)
    app.on_cleanup.append(close)

    async def list_models(request: web.Request) -> web.StreamResponse:
        admission.tenant(request.headers.get("Authorization"))
        return await relay(
            request,
            request.app["session"],
            upstream + request.path_qs,
            None,
            upstream_name="omnid",
            drop_headers=TRUSTED_HEADERS,
        )

    async def infer(request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        tenant = admission.tenant(request.headers.get("Authorization"))
        body = await read_body(request, max_body)
        data = check_inference_body(body)
        deadline = deadline_from(request.headers, arrived)
        cost = estimate_cost(data)
        admission.check_rate(tenant, cost)
        permit = await admission.permit(data["model"], tenant, cost, deadline)

        def usage(u: dict) -> None:
            actual = float((u.get("prompt_tokens") or 0) + (u.get("completion_tokens") or 0))
            if actual and permit is not None:
                permit.correct_cost(actual)
                tenant.correct_tokens(cost, actual)

        try:
            return await relay(
                request,
                request.app["session"],
                upstream + request.path_qs,
                body,
                upstream_name="omnid",
                drop_headers=TRUSTED_HEADERS,
                extra_headers={"x-omni-tenant": tenant.name},
                on_usage=usage,
                on_upstream_done=permit.release if permit is not None else None,
            )
        finally:
            if permit is not None:
                permit.release()  # once only: a no-op after the early release

    async def healthz(request: web.Request) -> web.Response:
        try:
            async with request.app["session"].get(
                upstream + "/healthz", timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            ok = False
        if ok:
            return json_response({"status": "ok"})
        return json_response(
            {"status": "degraded", "omnid": "unreachable"}, 503, {"Retry-After": "1"}
        )

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/models", list_models)
    for path in INFERENCE_PATHS:
        app.router.add_post(path, infer)
    return app


async def run(args: argparse.Namespace) -> None:
    tenants = Tenants.from_file(args.tenants) if args.tenants else None
    runner = web.AppRunner(
        edge_app(args.upstream, args.max_body_bytes, tenants),
        handler_cancellation=True,
        access_log=None,
    )
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("omni-edge listening on http://%s:%d -> %s", args.host, args.port, args.upstream)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="omni-edge", description=__doc__)
    parser.add_argument("--host", default=env("OMNI_EDGE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("OMNI_EDGE_PORT", "8080")))
    parser.add_argument(
        "--upstream",
        default=env("OMNI_UPSTREAM", "http://127.0.0.1:8081"),
        help="omnid's inference endpoint",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=int(env("OMNI_MAX_BODY_BYTES", str(DEFAULT_MAX_BODY)))
    )
    parser.add_argument(
        "--tenants",
        default=env("OMNI_TENANTS"),
        help="TOML file of tenants and their API keys (without it: no keys, one tenant)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("omni-edge")
    try:
        asyncio.run(run(args))
    except TenantConfigError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
