"""The edge's live dashboard: its tenants (share of the permits and of the tokens served,
queued, shed) and its nodes (health, round trip, in flight), from what admission, the
fair queues, the node set and the metrics already keep.

Served read-only on a loopback listener of its own (`--dashboard`), never on the public
port: it has no authentication, and it names every tenant. Counts are cumulative: the
page turns them into rates.
"""

from __future__ import annotations

import time
from pathlib import Path

from aiohttp import web

from omni.api import live
from omni.dashboard_page import PageAssets

from .admission import ANONYMOUS, Admission
from .metrics import EdgeMetrics
from .nodes import NodeSet

STATIC = Path(__file__).resolve().parent / "static"
DEFAULT_BIND = "127.0.0.1:9180"


class EdgeView:
    """Snapshots of one edge's admission and nodes."""

    def __init__(self, admission: Admission, nodes: NodeSet, metrics: EdgeMetrics):
        self.admission, self.nodes, self.metrics = admission, nodes, metrics
        self.queue_wait = live.HistogramWindow()
        self.upstream = live.HistogramWindow()
        self.snapshots = live.Snapshots(self.snapshot, "edge")

    def snapshot(self) -> dict:
        now = time.monotonic()
        self.queue_wait.update(now, live.histogram_buckets(self.metrics.queue_wait, "tenant"))
        self.upstream.update(now, live.histogram_buckets(self.metrics.upstream, "node"))
        queues = dict(self.admission.queues)
        return {
            "kind": "edge",
            "at": time.time(),
            "queueing": "fifo" if self.admission.fifo else "fair",
            "tenants": self._tenants(queues),
            "models": [
                {
                    "name": model,
                    "permits": q.permits,
                    "in_use": q.in_use,
                    "queued": q.queued(),
                    "shed": q.shed_counts,
                    "nodes": len(self.nodes.hosts(model)),
                }
                for model, q in sorted(queues.items())
            ],
            "nodes": [self._node(n.to_json(), n.failures) for n in list(self.nodes.nodes)],
        }

    def _tenants(self, queues: dict) -> list[dict]:
        configured = self.admission.tenants
        weights = {t.name: t.weight for t in configured.tenants.values()} if configured else {}
        if configured is None:
            weights[ANONYMOUS.name] = ANONYMOUS.weight
        elif configured.anonymous is not None:
            weights[configured.anonymous.name] = configured.anonymous.weight
        requests = live.counter_pairs(self.metrics.requests, "tenant", "status")
        shed = live.counter_pairs(self.metrics.shed, "tenant", "reason")
        queued: dict[str, int] = {}
        held: dict[str, int] = {}
        served: dict[str, float] = {}
        for q in queues.values():
            for name, n in q.queued_by_tenant().items():
                queued[name] = queued.get(name, 0) + n
            for name, n in q.held_by_tenant().items():
                held[name] = held.get(name, 0) + n
            for name, cost in q.served_cost.items():
                served[name] = served.get(name, 0.0) + cost
        names = set(weights) | set(queued) | set(held) | set(served)
        names |= {t for t, _ in requests} | {t for t, _ in shed}
        return [
            {
                "name": name,
                "weight": weights.get(name),
                "requests": int(sum(n for (t, _), n in requests.items() if t == name)),
                "errors": int(sum(n for (t, s), n in requests.items() if t == name and s != "200")),
                "served_tokens": round(served.get(name, 0.0), 1),  # fair queueing's cost
                "held": held.get(name, 0),  # permits in use
                "queued": queued.get(name, 0),
                "shed": {r: int(n) for (t, r), n in shed.items() if t == name},
                "queue_wait": self.queue_wait.summary(name),
            }
            for name in sorted(names)
        ]

    def _node(self, info: dict, failures: int) -> dict:
        return {
            **info,
            "failures": failures,
            "in_flight_total": sum(info["in_flight"].values()),
            "upstream": self.upstream.summary(info["url"]),
        }


VIEW = web.AppKey("dashboard_view", EdgeView)


def parse(value: str) -> tuple[str, int] | None:
    """`--dashboard`: HOST:PORT or PORT (loopback unless an address is written out), or
    `off`."""
    if value.strip().lower() == "off":
        return None
    return live.parse_bind(value, "--dashboard")


def dashboard_app(view: EdgeView, bind_host: str) -> web.Application:
    app = live.listener_app(bind_host)
    live.add_routes(app, view.snapshots, PageAssets(view.snapshots, STATIC, live.STATIC))
    return app


async def serve(view: EdgeView, bind: tuple[str, int] | None) -> web.AppRunner | None:
    """The dashboard's listener; None when off, or when its address is taken: one warning
    line says so and how to move it, and the edge serves on without it."""
    if bind is None:
        return None
    move = "move it with --dashboard HOST:PORT (omni serve --edge-dashboard), or 'off'"
    return await live.start_listener(dashboard_app(view, bind[0]), bind, "edge", move)
