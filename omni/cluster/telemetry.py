"""Load telemetry, the node's side: omnid records every finished request into a
`LoadAccumulator`; a `TelemetryReporter` takes its figures every interval (10 s, on a
grid aligned to the epoch, so that all nodes' intervals line up) and streams them over
gRPC. Each report is acknowledged once the scheduler has stored it; unacknowledged ones
(at most `max_buffered`, an hour) are resent after a reconnect, so a scheduler restart or
failover loses nothing. The records and messages are in reports.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from .reports import (
    CLIENT_CLOSED,
    EPS,
    MAX_LABEL,
    MAX_ORIGINS,
    OUT_OF_CAPACITY,
    IntervalReport,
    ModelFigures,
    pb_grpc,
)

log = logging.getLogger(__name__)

# Keepalive: a half-open connection (scheduler host gone) fails in ~30 s instead of
# hanging the stream; the server has to allow pings this frequent.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


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
            k = max(math.floor(now / self.interval_s + EPS) + 1, last + 1)
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
