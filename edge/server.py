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
import signal
from typing import Any

from aiohttp import web

from omni.api import oip_grpc
from omni.api.errors import error_middleware
from omni.api.oip_http import oip_errors
from omni.logs import setup_logging

from . import dashboard
from .admission import parse_deadlines
from .routes import INFERENCE_PATHS, EdgeRoutes, check_inference_body, estimate_prompt_tokens
from .tenants import TenantConfigError, Tenants

log = logging.getLogger("omni-edge")

DEFAULT_MAX_BODY = 4 << 20
DEFAULT_GRPC_PORT = "8001"  # as Triton's
# The request checks and the routes live in routes.py; their names stay importable here.
__all__ = [
    "DEFAULT_MAX_BODY",
    "INFERENCE_PATHS",
    "EdgeRoutes",
    "arg_parser",
    "check_inference_body",
    "edge_app",
    "estimate_prompt_tokens",
    "main",
    "parse_args",
    "run",
]


def edge_app(
    upstream: str | list[str], max_body: int, tenants: Tenants | None = None, **options: Any
) -> web.Application:
    """The edge's HTTP app; `options` are EdgeRoutes' (queueing, max_queued, early_release,
    deadlines, etcd, location), which says what each means."""
    app = web.Application(middlewares=[error_middleware, oip_errors], client_max_size=max_body)
    routes = EdgeRoutes(upstream, max_body, tenants, **options)
    view = dashboard.EdgeView(routes.admission, routes.nodes, routes.metrics)
    app[dashboard.VIEW] = view  # its own listener
    routes.add_to(app)
    return app


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
