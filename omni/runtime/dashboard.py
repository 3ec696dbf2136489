"""omnid's live dashboard: a page and a JSON snapshot (once, or a stream of them) of what
the node already records: each GPU's budget and the instances resident on it or swapped
out, swap counts, per model its requests, latency, queue and state, and which sandbox
limits hold.

Served read-only on the admin socket (`omnictl dashboard` forwards a loopback port to it)
and, with the config's `dashboard` key, on a loopback TCP listener of its own; never on
the inference port. Counts are cumulative: the page turns them into rates.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING

from aiohttp import web

from omni.api import live
from omni.dashboard_page import PageAssets

if TYPE_CHECKING:
    from .omnid import Node

log = logging.getLogger(__name__)

CHARGED = ("starting", "resident", "moving")  # residencies that hold their GPU's budget
_views: weakref.WeakKeyDictionary[Node, NodeView] = weakref.WeakKeyDictionary()


class NodeView:
    """Snapshots of one node, with the latency windows they are measured over (one per
    node: every listener of the dashboard shows the same figures)."""

    def __init__(self, node: Node):
        self.node = node
        self.latency = live.HistogramWindow()
        self.admission = live.HistogramWindow()
        self.snapshots = live.Snapshots(self.snapshot, "omnid")

    def snapshot(self) -> dict:
        node = self.node
        metrics = node.metrics
        self.latency.update(time.monotonic(), live.histogram_buckets(metrics.latency, "model"))
        self.admission.update(time.monotonic(), live.histogram_buckets(metrics.admission, "model"))
        requests = live.counter_pairs(metrics.requests, "model", "status")
        infos = {name: node.instance_json(inst) for name, inst in list(node.instances.items())}
        models = [
            self._model(info, node.instances[name].waiting, requests)
            for name, info in sorted(infos.items())
        ]
        swaps = live.counter_totals(metrics.swaps, "direction")
        return {
            "kind": "omnid",
            "at": time.time(),
            "node": {
                "draining": node.draining,
                "drained": node.drained_names(),  # stopped by the drain: undrain restarts them
                "started": node.started,
                "instances": len(infos),
                "sandbox": node.sandbox,  # which limits instances' sandboxes enforce
            },
            "gpus": [self._gpu(pool.to_json(), infos) for pool in node.pools_list()],
            "swaps": {"in": int(swaps.get("in", 0)), "out": int(swaps.get("out", 0))},
            "models": models,
        }

    def _model(self, info: dict, waiting: int, requests: dict[tuple[str, str], float]) -> dict:
        name = info["name"]
        ranks = _ranks(info)
        mine = {status: n for (model, status), n in requests.items() if model == name}
        return {
            "name": name,
            "kind": info.get("kind"),
            "state": info.get("state"),
            "residency": info.get("residency"),  # None: the CPU path
            "gpus": info.get("gpus") or [],
            "permits": info.get("permits"),
            "in_flight": info.get("in_flight", 0),
            "waiting": waiting,  # for a permit
            "requests": int(sum(mine.values())),
            "errors": int(sum(n for s, n in mine.items() if not s.startswith(("1", "2", "3")))),
            "latency": self.latency.summary(name),
            "admission": self.admission.summary(name),  # permit + swap-in wait
            "quota_bytes": sum(r.get("quota_bytes", 0) for r in ranks) if ranks else None,
            "used_bytes": sum(r.get("used_bytes", 0) for r in ranks) if ranks else None,
            "swaps_in": info.get("swaps_in"),
            "swaps_out": info.get("swaps_out"),
            "restarts": info.get("restarts", 0),
            "failure": info.get("failure"),
            "pid": info.get("pid"),
            "uptime_s": info.get("uptime_s"),
            "version": info.get("version"),
            "last_used": info.get("last_used"),
        }

    @staticmethod
    def _gpu(pool: dict, infos: dict[str, dict]) -> dict:
        index = pool["index"]
        placed = [
            {"name": name, **{k: rank.get(k) for k in RANK_KEYS}}
            for name, info in sorted(infos.items())
            for rank in _ranks(info)
            if rank.get("gpu") == index
        ]
        return {
            "index": index,
            "budget_bytes": pool["budget_bytes"],
            "charged_bytes": pool["charged_bytes"],
            "waiting": pool["waiting"],  # requests waiting for a swap-in
            "swaps_in": sum(p["swaps_in"] or 0 for p in placed),
            "swaps_out": sum(p["swaps_out"] or 0 for p in placed),
            "resident": [p for p in placed if p["residency"] in CHARGED],
            "swapped": [p for p in placed if p["residency"] == "swapped"],
            "stopped": [p for p in placed if p["residency"] == "stopped"],
        }


RANK_KEYS = ("residency", "quota_bytes", "used_bytes", "swaps_in", "swaps_out")


def _ranks(info: dict) -> list[dict]:
    """An instance's standing on each of its GPUs (none on the CPU path)."""
    if "residency" not in info:
        return []
    return info.get("ranks") or [info]


def view_of(node: Node) -> NodeView:
    if node not in _views:
        _views[node] = NodeView(node)
    return _views[node]


def add_routes(app: web.Application, node: Node) -> None:
    """The dashboard's GET routes on `app` (omnid's admin app, or a listener's)."""
    snapshots = view_of(node).snapshots
    live.add_routes(app, snapshots, PageAssets(snapshots, live.STATIC))


async def serve(node: Node, bind: tuple[str, int] | None) -> list[web.AppRunner]:
    """The config's `dashboard` listener, when it names one: its runner, for omnid to
    clean up with the others (none when unset, or when it could not bind: logged)."""
    if bind is None:
        return []
    app = live.listener_app(bind[0])
    add_routes(app, node)
    move = 'move it with `dashboard = "HOST:PORT"` in omnid\'s config, or leave the key out'
    runner = await live.start_listener(app, bind, "omnid", move)
    return [runner] if runner is not None else []
