"""What omnid's and the edge's dashboards share over HTTP: their static files, a stream of
snapshots as server-sent events, windowed quantiles from Prometheus histograms, and the
loopback-only listeners they are served on.

Both dashboards are read-only views of what the process already records: nothing here
changes state, and a snapshot that fails to build is logged while the stream goes on, so
an operator watching can never break serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import orjson
from aiohttp import web

from omni.api.errors import ApiError, error_middleware, json_response

log = logging.getLogger(__name__)

# The page and its files: omnid's, and the shared ones (the chart library among them).
STATIC = Path(__file__).resolve().parent.parent / "runtime" / "static"
PAGE_PATH = "/dashboard"
SNAPSHOT_PATH = "/v1/dashboard"
EVENTS_PATH = "/v1/dashboard/events"
INTERVAL_S = 1.0  # one snapshot a second on the event stream
CACHE_S = 0.5  # streams and polls within this share one snapshot
LOG_EVERY_S = 60.0  # a snapshot that keeps failing is logged once a minute
ASSET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.(js|css|html)$")
CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
SECURITY_HEADERS = {
    # no inline script, nothing from elsewhere; uPlot sets inline styles on its elements
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
STOP = web.AppKey("dashboard_stop", asyncio.Event)
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
WILDCARDS = {"0.0.0.0", "::"}  # every interface


class Snapshots:
    """One snapshot builder behind a short cache, whose failures are logged, not raised."""

    def __init__(self, build: Callable[[], dict], what: str):
        self._build, self._what = build, what
        self._cached: tuple[float, dict] | None = None
        self._logged_at = -LOG_EVERY_S
        self.failures = 0

    def get(self) -> dict | None:
        """The latest snapshot, or None when building it failed (logged)."""
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < CACHE_S:
            return self._cached[1]
        try:
            snap = self._build()
        except Exception:
            self.failures += 1
            if now - self._logged_at >= LOG_EVERY_S:
                self._logged_at = now
                log.exception(
                    "%s dashboard: snapshot failed (%d so far)", self._what, self.failures
                )
            return None
        self._cached = (now, snap)
        return snap


class Assets:
    """The dashboard's files, by name, from a few directories (the first one wins): only
    plain files whose names look like a page's files are served, so no path is walked."""

    def __init__(self, *dirs: Path):
        self.files: dict[str, Path] = {}
        for d in dirs:
            for path in sorted(d.iterdir()) if d.is_dir() else ():
                if path.is_file() and ASSET_NAME.match(path.name):
                    self.files.setdefault(path.name, path)

    def response(self, name: str) -> web.Response:
        path = self.files.get(name)
        if path is None:
            raise ApiError(404, f"No dashboard file {name!r}.", code="not_found")
        return web.Response(
            body=path.read_bytes(),
            headers={"Content-Type": CONTENT_TYPES[path.suffix], **SECURITY_HEADERS},
        )


def add_routes(app: web.Application, snapshots: Snapshots, assets: Assets) -> None:
    """GET /dashboard, /dashboard/{file}, /v1/dashboard, /v1/dashboard/events on `app`;
    the event streams end when `app` shuts down."""
    if STOP not in app:
        app[STOP] = asyncio.Event()

        async def stop_streams(app: web.Application) -> None:
            app[STOP].set()

        app.on_shutdown.append(stop_streams)

    async def page(_request: web.Request) -> web.Response:
        return assets.response("index.html")

    async def asset(request: web.Request) -> web.Response:
        return assets.response(request.match_info["name"])

    async def snapshot(_request: web.Request) -> web.Response:
        snap = snapshots.get()
        if snap is None:
            raise ApiError(500, "The dashboard's snapshot failed; see the log.")
        return json_response(snap, headers={"Cache-Control": "no-store"})

    async def events(request: web.Request) -> web.StreamResponse:
        return await stream(request, snapshots, request.app[STOP])

    app.router.add_get(PAGE_PATH, page)
    app.router.add_get(PAGE_PATH + "/{name}", asset)
    app.router.add_get(SNAPSHOT_PATH, snapshot)
    app.router.add_get(EVENTS_PATH, events)


async def stream(
    request: web.Request,
    snapshots: Snapshots,
    stop: asyncio.Event,
    interval_s: float = INTERVAL_S,
) -> web.StreamResponse:
    """Server-sent events: a snapshot every `interval_s` until the client goes (a write
    fails) or `stop` is set (the server is stopping: a last `end` event says so)."""
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    try:
        await resp.write(b"retry: 2000\n\n")
        while not stop.is_set():
            snap = snapshots.get()
            if snap is None:  # logged by Snapshots; the page says it missed one
                await resp.write(b"event: failed\ndata: {}\n\n")
            else:
                await resp.write(b"data: " + orjson.dumps(snap) + b"\n\n")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
        await resp.write(b"event: end\ndata: {}\n\n")
        await resp.write_eof()
    except (ConnectionError, RuntimeError):  # the client went away mid-write
        pass
    return resp


# -------------------------------------------------------------- metrics, as numbers


def counter_totals(counter, label: str) -> dict[str, float]:
    """A labelled prometheus_client Counter's totals summed by one of its labels."""
    out: dict[str, float] = {}
    for metric in counter.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def counter_pairs(counter, first: str, second: str) -> dict[tuple[str, str], float]:
    """A Counter's totals summed by two of its labels."""
    out: dict[tuple[str, str], float] = {}
    for metric in counter.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                key = (s.labels.get(first, ""), s.labels.get(second, ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


Buckets = dict[float, float]  # upper bound -> cumulative count


def histogram_buckets(histogram, label: str) -> dict[str, Buckets]:
    """A labelled Histogram's cumulative bucket counts summed by one of its labels."""
    out: dict[str, Buckets] = {}
    for metric in histogram.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket"):
                buckets = out.setdefault(s.labels.get(label, ""), {})
                bound = float(s.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + s.value
    return out


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated in its bucket as Prometheus'
    histogram_quantile does; None without observations."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower  # past the last bound: the last bound is all that is known
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


class HistogramWindow:
    """Quantiles over the last `window_s` of cumulative histograms, from the snapshots'
    own samples (taken only while someone looks): the difference between the newest
    sample and the oldest one inside the window. Before any earlier sample exists, the
    histograms since the process started."""

    def __init__(self, window_s: float = 30.0):
        self.window_s = window_s
        self._samples: deque[tuple[float, dict[str, Buckets]]] = deque()

    def update(self, now: float, histograms: dict[str, Buckets]) -> None:
        if not self._samples or now - self._samples[-1][0] >= 0.5:
            self._samples.append((now, histograms))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def recent(self, key: str) -> tuple[Buckets, float | None]:
        """(key's counts inside the window, the window's length; None: since start)."""
        if not self._samples:
            return {}, None
        newest_t, newest = self._samples[-1]
        oldest_t, oldest = self._samples[0]
        now = newest.get(key, {})
        if len(self._samples) == 1:
            return now, None
        then = oldest.get(key, {})
        return {b: c - then.get(b, 0.0) for b, c in now.items()}, newest_t - oldest_t

    def summary(self, key: str) -> dict:
        buckets, window = self.recent(key)
        count = max(buckets.values(), default=0.0)
        return {
            "p50_s": quantile(buckets, 0.5),
            "p99_s": quantile(buckets, 0.99),
            "count": int(count),
            "window_s": None if window is None else round(window, 1),
        }


# -------------------------------------------------------------------- listeners


def parse_bind(value: object, what: str) -> tuple[str, int]:
    """HOST:PORT, or a bare PORT (on 127.0.0.1), for a dashboard listener. Loopback unless
    written out: a non-loopback bind must be an IP address ("10.0.0.5:9181", or
    "0.0.0.0:9181" for every interface); a host name or an empty host is refused, so no
    resolver or default ever opens the dashboard, which has no authentication, to the
    network."""
    text = str(value).strip() if isinstance(value, int | str) and value is not True else ""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: expected HOST:PORT or PORT, e.g. '127.0.0.1:9181'")
    if host == "localhost":
        return "127.0.0.1", int(port)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"{what}: {host or 'an empty host'!r} is not an IP address; the dashboard binds "
            "to loopback unless an address is written out (e.g. 127.0.0.1:9181)"
        ) from None
    return host, int(port)


def is_loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host in LOOPBACK_NAMES


def host_guard(allowed: Iterable[str]):
    """Refuse requests whose Host header is not one of this listener's names: a web page
    elsewhere cannot read a loopback dashboard through a name it rebinds to 127.0.0.1.
    (A listener on every interface, written out as such, takes any name.)"""
    names = {*LOOPBACK_NAMES, *allowed}

    @web.middleware
    async def guard(request: web.Request, handler):
        host = (request.host or "").lower()
        name = host[1:].split("]")[0] if host.startswith("[") else host.rpartition(":")[0]
        if (name or host) not in names and not names & WILDCARDS:
            raise ApiError(403, f"Host {host!r} is not this dashboard's.", code="forbidden")
        return await handler(request)

    return guard


def listener_app(bind_host: str) -> web.Application:
    """An app for a dashboard of its own listener: GETs only (aiohttp answers 405 to any
    other method), `/` leads to the page, Host checked."""
    app = web.Application(middlewares=[error_middleware, host_guard([bind_host])])

    async def root(_request: web.Request) -> web.Response:
        raise web.HTTPFound(PAGE_PATH)

    app.router.add_get("/", root)
    return app


async def start_listener(app: web.Application, bind: tuple[str, int], what: str, move: str):
    """Serve `app` on `bind`; None when it cannot: a dashboard whose address is taken
    never keeps the server from serving, and one warning line says how to `move` it."""
    host, port = bind
    if not is_loopback(host):
        log.warning(
            "%s dashboard on %s:%d is reachable off this host, unauthenticated", what, *bind
        )
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        reason = exc.strerror or exc
        log.warning(
            "%s dashboard not served: cannot listen on %s:%d (%s); %s", what, *bind, reason, move
        )
        return None
    log.info("%s dashboard on http://%s:%d%s", what, host, port, PAGE_PATH)
    return runner
