"""Load telemetry, the scheduler's side: a `TelemetryServer` takes the nodes' streams
(omni/cluster/telemetry.py), writes every report into a `HistoryStore` (history.py:
sqlite, survives restarts) and keeps the latest per (node, model) in memory. The
records and messages are in omni/cluster/reports.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from omni.cluster.reports import IntervalReport, ModelFigures, pb, pb_grpc

if TYPE_CHECKING:
    from .history import HistoryStore

log = logging.getLogger(__name__)

# Lets in the nodes' keepalive pings (the channel options in omni/cluster/telemetry.py).
_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second scheduler on the port fails instead of sharing it
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


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
