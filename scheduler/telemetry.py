"""Load telemetry: nodes stream per-model load reports to the scheduler, which keeps them.

Node side: omnid records every finished request into a `LoadAccumulator`; a
`TelemetryReporter` takes its figures every interval (10 s, on a grid aligned to the
epoch, so that all nodes' intervals line up) and streams them over gRPC. Each report is
acknowledged once the scheduler has stored it; unacknowledged ones (at most
`max_buffered`, an hour) are resent after a reconnect, so a scheduler restart or
failover loses nothing.

The scheduler's side: a `TelemetryServer` writes every report into a `HistoryStore`
(history.py: sqlite, survives restarts) and keeps the latest per (node, model) in memory.

The messages are in telemetry.proto next to this file, compiled in-process when this
module is imported (`grpc.protos_and_services`, from grpcio-tools): no generated code is
committed, none can go stale, and no cache directory has to be writable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from .history import HistoryStore

log = logging.getLogger(__name__)


def _load_protos() -> tuple[Any, Any]:
    """telemetry_pb2 and telemetry_pb2_grpc, compiled from the .proto beside this file.

    grpc_tools finds the file through sys.path; an editable or zipped install need not
    have this package's parent there, so it is put first for the duration of the call.
    """
    root = str(Path(__file__).resolve().parent.parent)
    sys.path.insert(0, root)
    try:
        return grpc.protos_and_services("scheduler/telemetry.proto")
    finally:
        sys.path.remove(root)


pb, pb_grpc = _load_protos()

DAY_S = 86_400
OUT_OF_CAPACITY = frozenset({429, 503})  # shed by omnid: at capacity, or busy past the deadline
CLIENT_CLOSED = 499  # the client left before its answer's end: the model's fault in nothing
MAX_ORIGINS = 64  # locations counted per model and interval (a header may come from anyone)
MAX_LABEL = 64  # characters of a version or origin label
MAX_INTERVAL_S = 3600.0  # a longer report is a broken clock, not telemetry
_EPS = 1e-6  # of a resolution step: float noise when timestamps become bucket indices

# Keepalive: a half-open connection (scheduler host gone) fails in ~30 s instead of
# hanging the stream; the server has to allow pings this frequent.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second scheduler on the port fails instead of sharing it
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


# -- figures ---------------------------------------------------------------------------


@dataclass
class ModelFigures:
    """One model on one node over one interval: the proto's ModelLoad, in Python."""

    wall_s: float = 0.0  # inference wall time, summed over requests
    queue_s: float = 0.0  # permit wait, summed over requests
    queued: int = 0  # requests that waited for a permit
    requests: int = 0  # admitted: everything but out_of_capacity
    errors: int = 0  # admitted, failed
    out_of_capacity: int = 0  # shed with 429 / 503
    prompt_tokens: int = 0
    completion_tokens: int = 0
    permits_total: int = 0  # gauges, at the interval's end
    permits_free: int = 0
    replicas: int = 0
    version: str = ""
    # version -> [requests, errors]: what each version served (rollouts are judged on it)
    by_version: dict[str, list[int]] = field(default_factory=dict)
    # edge location -> requests offered through it (shed ones too): where demand comes from
    origins: dict[str, int] = field(default_factory=dict)

    def to_proto(self, model: str) -> Any:
        def n(x: int) -> int:
            return max(0, int(x))

        return pb.ModelLoad(
            model=model,
            wall_time_s=self.wall_s,
            permits_total=n(self.permits_total),
            permits_free=n(self.permits_free),
            queue_time_s=self.queue_s,
            queued_requests=n(self.queued),
            requests=n(self.requests),
            errors=n(self.errors),
            out_of_capacity=n(self.out_of_capacity),
            prompt_tokens=n(self.prompt_tokens),
            completion_tokens=n(self.completion_tokens),
            version=self.version,
            replicas=n(self.replicas),
            versions=[
                pb.VersionLoad(version=v, requests=n(r), errors=n(e))
                for v, (r, e) in sorted(self.by_version.items())
            ],
            origins={o: n(c) for o, c in self.origins.items()},
        )

    @classmethod
    def from_proto(cls, m: Any) -> ModelFigures:
        return cls(
            wall_s=m.wall_time_s,
            queue_s=m.queue_time_s,
            queued=m.queued_requests,
            requests=m.requests,
            errors=m.errors,
            out_of_capacity=m.out_of_capacity,
            prompt_tokens=m.prompt_tokens,
            completion_tokens=m.completion_tokens,
            permits_total=m.permits_total,
            permits_free=m.permits_free,
            replicas=m.replicas,
            version=m.version,
            by_version={v.version: [v.requests, v.errors] for v in m.versions},
            origins=dict(m.origins),
        )


@dataclass
class IntervalReport:
    """A node's figures per model over [start, start + interval_s)."""

    start: float
    interval_s: float
    models: dict[str, ModelFigures] = field(default_factory=dict)

    def to_proto(self, node_id: str, seq: int = 0) -> Any:
        return pb.LoadReport(
            node_id=node_id,
            seq=seq,
            start=self.start,
            interval_s=self.interval_s,
            models=[f.to_proto(m) for m, f in sorted(self.models.items())],
        )

    @classmethod
    def from_proto(cls, msg: Any) -> IntervalReport:
        return cls(
            msg.start, msg.interval_s, {m.model: ModelFigures.from_proto(m) for m in msg.models}
        )


# -- node side -------------------------------------------------------------------------


class LoadAccumulator:
    """Sums one node's per-model figures between two `take`s.

    Every method holds a lock only for a few dict updates: callable from the event loop
    and from threads alike, and never awaits, so a request path can call it inline.
    """

    def __init__(self, clock: Callable[[], float] = time.time):
        self._lock = threading.Lock()
        self._start = clock()
        self._counts: dict[str, ModelFigures] = {}
        self._gauges: dict[str, tuple[int, int, int]] = {}  # total, free, replicas
        self._versions: dict[str, str] = {}

    def record_request(
        self,
        model: str,
        *,
        wall_s: float,
        queue_s: float = 0.0,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        status: int = 200,
        version: str = "",
        origin: str = "",
    ) -> None:
        """One finished request: 429 and 503 count as out of capacity, other >= 400 as
        errors but 499 (the client left). `version`: the model version that served it;
        `origin`: the location of the edge it came through."""
        with self._lock:
            f = self._counts.get(model)
            if f is None:
                f = self._counts[model] = ModelFigures()
            f.wall_s += max(wall_s, 0.0)
            f.queue_s += max(queue_s, 0.0)
            f.queued += queue_s > 0
            f.prompt_tokens += prompt_tokens
            f.completion_tokens += completion_tokens
            if status in OUT_OF_CAPACITY:
                f.out_of_capacity += 1
            else:
                failed = status >= 400 and status != CLIENT_CLOSED
                f.requests += 1
                f.errors += failed
                if version:
                    counts = f.by_version.setdefault(version, [0, 0])
                    counts[0] += 1
                    counts[1] += failed
            if version:
                self._versions[model] = version
            if (
                origin
                and len(origin) <= MAX_LABEL
                and (origin in f.origins or len(f.origins) < MAX_ORIGINS)
            ):
                f.origins[origin] = f.origins.get(origin, 0) + 1

    def set_permits(
        self, model: str, total: int, free: int, *, replicas: int | None = None
    ) -> None:
        """The model's concurrency now; replicas (ready instances) defaults to 1 if total > 0.

        A gauge: reported at every interval's end until changed or `remove`d, so an idle
        model still reports its free capacity.
        """
        with self._lock:
            ready = (1 if total > 0 else 0) if replicas is None else replicas
            self._gauges[model] = (total, free, ready)

    def remove(self, model: str) -> None:
        """The model left the node: no more reports for it after the pending interval's."""
        with self._lock:
            self._gauges.pop(model, None)
            self._versions.pop(model, None)

    def take(self, now: float) -> IntervalReport:
        """The figures since the last take (or creation) up to now; counters restart at 0.

        Consecutive takes tile time: each report starts where the previous one ended.
        """
        with self._lock:
            start = self._start
            if now <= start:  # the clock went back: nothing to report, counters kept
                return IntervalReport(start, 0.0)
            self._start = now
            counts, self._counts = self._counts, {}
            out = {}
            for model in counts.keys() | self._gauges.keys():
                f = counts.get(model) or ModelFigures()
                f.permits_total, f.permits_free, f.replicas = self._gauges.get(model, (0, 0, 0))
                f.version = self._versions.get(model, "")
                out[model] = f
            return IntervalReport(start, now - start, out)


class TelemetryReporter:
    """Streams a node's accumulated figures to the scheduler every `interval_s`.

    Reports wait in a buffer until acknowledged (stored). While the scheduler is down
    they pile up there, and the connection is retried with exponential backoff (jittered,
    so that a restarted scheduler is not hit by every node at once). The buffer keeps
    the newest `max_buffered` (default 360: an hour at 10 s, ~100 kB per model): enough
    to ride out a scheduler restart or failover with the history whole, bounded so that
    a long outage costs a node fixed memory and the scheduler a bounded backlog per node
    when it returns. Older intervals are dropped (counted in `dropped`); the autoscaler
    reacts to the last minute and the forecast copes with gaps.
    """

    def __init__(
        self,
        accumulator: LoadAccumulator,
        target: str,
        node_id: str,
        *,
        interval_s: float = 10.0,
        max_buffered: int = 360,
        backoff_s: tuple[float, float] = (0.5, 30.0),
        clock: Callable[[], float] = time.time,
    ):
        if interval_s <= 0 or max_buffered < 1:
            raise ValueError("interval_s must be > 0 and max_buffered >= 1")
        self.accumulator, self.target, self.node_id = accumulator, target, node_id
        self.interval_s, self.max_buffered = interval_s, max_buffered
        self.backoff_s, self.clock = backoff_s, clock
        self.connected = False
        self.connects = 0  # streams the scheduler accepted
        self.sent = 0  # reports taken (seq of the newest)
        self.acked = 0  # seq of the newest acknowledged
        self.dropped = 0  # dropped unacknowledged (buffer full); in flight, one may arrive
        self._buffer: deque[Any] = deque()  # LoadReport messages, by seq
        self._new = asyncio.Event()

    @property
    def pending(self) -> int:
        """Reports taken and not acknowledged yet."""
        return len(self._buffer)

    async def run(self) -> None:
        """Reports until cancelled; never raises for the scheduler being unreachable."""
        ticker = asyncio.create_task(self._tick(), name="telemetry-tick")
        try:
            await self._stream_forever()
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker

    async def _tick(self) -> None:
        """Takes the figures at each multiple of the interval (the same grid on every node)."""
        last = -math.inf
        while True:
            now = self.clock()
            k = max(math.floor(now / self.interval_s + _EPS) + 1, last + 1)
            last, boundary = k, k * self.interval_s
            await asyncio.sleep(boundary - now)  # may end a hair early: the next k is still k+1
            report = self.accumulator.take(boundary)
            if report.models:
                self._push(report)

    def _push(self, report: IntervalReport) -> None:
        self.sent += 1
        self._buffer.append(report.to_proto(self.node_id, self.sent))
        if len(self._buffer) > self.max_buffered:
            self._buffer.popleft()
            self.dropped += 1
        self._new.set()

    def _ack(self, seq: int) -> None:
        self.acked = max(self.acked, seq)
        while self._buffer and self._buffer[0].seq <= seq:
            self._buffer.popleft()

    async def _requests(self):
        """One stream's requests: everything unacknowledged, then each new report."""
        sent = 0
        while True:
            self._new.clear()
            batch = [msg for msg in self._buffer if msg.seq > sent]
            for msg in batch:
                sent = msg.seq
                yield msg
            if not batch:
                await self._new.wait()

    async def _stream_forever(self) -> None:
        low, high = self.backoff_s
        delay = low
        while True:
            try:
                async with grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS) as ch:
                    call = pb_grpc.TelemetryStub(ch).Report(self._requests())
                    metadata = await call.initial_metadata()
                    if metadata is not None and any(k == "omni-telemetry" for k, _ in metadata):
                        self.connected, delay = True, low
                        self.connects += 1
                        log.info("telemetry: streaming to %s", self.target)
                    async for ack in call:
                        self._ack(ack.seq)
                    log.info("telemetry: %s ended the stream (%s)", self.target, await call.code())
            except grpc.aio.AioRpcError as exc:
                level = logging.WARNING if self.connected else logging.DEBUG
                log.log(level, "telemetry to %s: %s", self.target, exc.code().name)
            except Exception:
                log.exception("telemetry stream to %s failed", self.target)
            self.connected = False
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, high)


# -- scheduler side: server ------------------------------------------------------------


@dataclass(frozen=True)
class NodeLoad:
    """The latest report of one model on one node, and when it came."""

    node: str
    model: str
    start: float
    interval_s: float
    received: float
    figures: ModelFigures


class TelemetryServer:
    """The scheduler's end of the nodes' streams: stores each report, then acknowledges it.

    The store is written from one worker thread, so a slow disk delays acks rather than
    the event loop. A report that cannot be stored fails its stream (the node resends it
    after reconnecting); an invalid one is logged and acknowledged, never resent.
    """

    def __init__(self, store: HistoryStore, *, clock: Callable[[], float] = time.time):
        self.store, self.clock = store, clock
        self.received = 0
        self._latest: dict[tuple[str, str], NodeLoad] = {}
        self._server: grpc.aio.Server | None = None
        self._executor: ThreadPoolExecutor | None = None

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> int:
        """Listens on host:port (0: any free port); returns the bound port."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="telemetry-store")
        self._server = grpc.aio.server(options=_SERVER_OPTIONS)
        pb_grpc.add_TelemetryServicer_to_server(_Servicer(self), self._server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound = self._server.add_insecure_port(address)
        await self._server.start()
        log.info("telemetry: listening on %s", address.rsplit(":", 1)[0] + f":{bound}")
        return bound

    async def stop(self, grace_s: float = 1.0) -> None:
        """Ends the streams (nodes keep their unacknowledged reports) and stops listening."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def latest(self, max_age_s: float | None = None) -> dict[tuple[str, str], NodeLoad]:
        """The newest report per (node, model); with max_age_s, only those received since."""
        if max_age_s is None:
            return dict(self._latest)
        oldest = self.clock() - max_age_s
        return {key: v for key, v in self._latest.items() if v.received >= oldest}

    async def ingest(self, msg: Any) -> None:
        """Stores one LoadReport message and remembers it as its node's latest."""
        report = IntervalReport.from_proto(msg)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self.store.add, msg.node_id, report)
        except ValueError as exc:  # invalid: acknowledged and dropped, never resent
            log.warning("telemetry from %r: report dropped: %s", msg.node_id, exc)
            return
        # Anything else (sqlite3.OperationalError: disk full, locked) fails the stream: the
        # report is not acknowledged, and the node resends it after reconnecting.
        self.received += 1
        now = self.clock()
        for model, figures in report.models.items():
            key = (msg.node_id, model)
            old = self._latest.get(key)
            if old is None or old.start <= report.start:
                self._latest[key] = NodeLoad(
                    msg.node_id, model, report.start, report.interval_s, now, figures
                )


class _Servicer(pb_grpc.TelemetryServicer):
    def __init__(self, server: TelemetryServer):
        self.server = server

    async def Report(self, request_iterator, context):
        # Headers at once: the node knows it is connected before it has anything to send.
        await context.send_initial_metadata((("omni-telemetry", "1"),))
        async for msg in request_iterator:
            await self.server.ingest(msg)
            yield pb.ReportAck(seq=msg.seq)
