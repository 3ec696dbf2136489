"""How omnid takes part in a cluster: it announces its node in etcd, runs what the
scheduler places on it, probes its peers' round-trip times for the latency map, and
reports its load to the scheduler.

`ClusterMember` is all of it, started and stopped by omnid:
- with `--etcd`: the announcement (under a lease, revoked on a clean stop), the
  placements this node converges on, a `Prober` publishing this node's latency row under
  the announcement's lease, and the telemetry target followed in etcd
  (`/omni/telemetry`, written by the scheduler's leader);
- with `--telemetry HOST:PORT`: load reports to that target, with or without etcd.

The node's figures are summed by one `NodeLoad` (omnid's request path records every
finished request into it); a `TelemetryReporter` takes them every interval. When the
leader changes and the target with it, the reporter is restarted on the new target with
the same accumulator and the reports the old one had not had acknowledged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni.api.errors import ApiError
from omni.cluster.latency import Prober, peers_from_nodes, publish_row
from omni.cluster.membership import (
    Announcement,
    follow_key,
    follow_nodes,
    follow_placements,
)
from omni.cluster.reports import MAX_INTERVAL_S, IntervalReport
from omni.cluster.state import TELEMETRY
from omni.cluster.telemetry import LoadAccumulator, TelemetryReporter
from omni.engine.checkpoint import CheckpointError

from .catalog import CatalogError, ModelEntry
from .instance import State

if TYPE_CHECKING:
    import argparse

    from .omnid import Node

log = logging.getLogger("omnid.cluster")


class NodeLoad(LoadAccumulator):
    """The node's load figures. The gauges (permits, ready replicas) are read from the
    node's instances right before each take, so every report ends with the current ones
    and a model that left the node stops being reported."""

    def __init__(self, node: Node):
        super().__init__()
        self.node = node
        self._gauged: set[str] = set()

    def refresh(self) -> None:
        """Every instance's permits now; models gone from the node are removed."""
        current = set()
        for name, inst in list(self.node.instances.items()):
            total = inst.entry.placement.permits
            ready = int(inst.state == State.READY)
            self.set_permits(name, total, max(0, total - inst.in_flight), replicas=ready)
            current.add(name)
        for name in self._gauged - current:
            self.remove(name)
        self._gauged = current

    def take(self, now: float) -> IntervalReport:
        self.refresh()
        return super().take(now)


OBSERVED_EVERY_S = 1.0  # how often instance states are compared with what etcd holds


class ClusterMember:
    """This node's part in the cluster (see the module docstring); `start()` does nothing
    when neither etcd nor a telemetry target is configured.

    `record` is what the node announces (id, location, url, gpus); `make_entry(model,
    spec)` turns a placement into a catalog entry (blocking: run in a thread).
    """

    def __init__(
        self,
        node: Node,
        args: argparse.Namespace,
        record: dict,
        make_entry: Callable[[str, dict], ModelEntry],
    ):
        self.node, self.args, self.record, self.make_entry = node, args, record, make_entry
        self.node_id: str = args.node_id
        self.announcement: Announcement | None = None
        self.load: NodeLoad | None = None
        self.nodes: dict[str, dict] = {}  # the announced nodes (id -> record), latest view
        self.prober: Prober | None = None
        self.target: str | None = None
        self.reporter: TelemetryReporter | None = None
        self._reporting: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._load_since = 0.0

    async def start(self) -> None:
        args = self.args
        if args.etcd or args.telemetry:
            self.load = self.node.load = NodeLoad(self.node)
            self._load_since = time.time()
        if args.etcd:
            self.announcement = Announcement(args.etcd, self.record, args.lease_ttl)
            await self.announcement.start()
            self._spawn(follow_placements(args.etcd, self.node_id, self._apply), "placements")
            self._spawn(follow_nodes(args.etcd, self._nodes_changed), "nodes")
            self.prober = Prober(
                self.node_id,
                self.peers,
                interval_s=args.probe_interval,
                publish=functools.partial(
                    publish_row,
                    self.announcement.store,
                    self.node_id,
                    lease=self.announcement.lease,
                ),
            )
            self._spawn(self.prober.run(), "latency-probes")
            self._spawn(self._report_observed(), "observed-state")
        if args.telemetry:
            await self.report_to(args.telemetry)
        elif args.etcd:
            self._spawn(self._follow_telemetry_target(), "telemetry-target")

    async def stop(self) -> None:
        """Cancel everything, then revoke the announcement: the node is routed around at
        once, not a lease TTL later (its latency row goes with the lease)."""
        tasks = [*self._tasks, *([self._reporting] if self._reporting else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._reporting = None
        if self.announcement is not None:
            await self.announcement.stop()

    # ------------------------------------------------------------- placements

    async def _apply(self, model: str, spec: dict | None) -> None:
        """Run what the scheduler places on this node (origin "cluster"), and stop what it
        takes away; models of the local config or the admin API are left alone. A placed
        model whose checkpoint or version changes (a rollout, or its rollback) is stopped
        and started again from the new one."""
        node = self.node
        inst = node.instances.get(model)
        if spec is None:
            if inst is not None and inst.entry.origin == "cluster":
                await node.remove(model)
                log.info("unplaced %s", model)
            return
        if inst is not None and (inst.entry.origin != "cluster" or _runs(inst.entry, spec)):
            return
        try:
            entry = await asyncio.to_thread(self.make_entry, model, spec)
        except (CatalogError, CheckpointError, ApiError, ValueError) as exc:
            log.error("cannot run placed model %s: %s", model, getattr(exc, "message", exc))
            return
        if inst is not None:  # another checkpoint or version (_runs said so above)
            log.info(
                "%s: version %s -> %s (%s)", model, inst.entry.version, entry.version, entry.path
            )
            await node.remove(model)
        try:
            node.add(entry)
            log.info("placed %s %s from %s", model, entry.version, entry.path)
        except ApiError as exc:
            log.error("cannot run placed model %s: %s", model, exc.message)

    async def _report_observed(self) -> None:
        """What runs here, as it changes: each instance's state (starting, ready, failed,
        ...), residency, origin and restarts under /omni/observed/<node>/<model>, on the
        node's lease (a dead node's reports go with it), so the cluster sees whether a
        placement converged, not only what was wanted."""
        assert self.announcement is not None
        store, lease = self.announcement.store, self.announcement.lease
        sent: dict[str, dict] = {}
        while True:
            now = {
                name: {
                    "state": str(inst.state),
                    "residency": inst.member.state.value if inst.member else None,
                    "origin": inst.entry.origin,
                    "restarts": inst.restarts,
                    "version": inst.entry.version,
                }
                for name, inst in self.node.instances.items()
            }
            try:
                for model, state in now.items():
                    if sent.get(model) != state:
                        await store.report_observed(self.node_id, model, state, lease)
                        sent[model] = state
                for model in set(sent) - set(now):
                    await store.forget_observed(self.node_id, model)
                    del sent[model]
            except Exception as exc:  # etcd hiccup: the next round sends what differs
                log.warning("reporting observed state failed: %s", exc)
            await asyncio.sleep(OBSERVED_EVERY_S)

    # ---------------------------------------------------------------- latency

    def _nodes_changed(self, nodes: dict[str, dict]) -> None:
        self.nodes = nodes

    def peers(self) -> dict[str, tuple[str, int]]:
        """The other announced nodes' inference addresses: what the prober measures."""
        return peers_from_nodes(self.nodes, exclude=self.node_id)

    # -------------------------------------------------------------- telemetry

    async def _follow_telemetry_target(self) -> None:
        """Report to wherever the scheduler's leader says. A target that goes (the leader
        died, its lease ran out) keeps the reporter on it, buffering and retrying, until
        the next leader writes its own."""
        assert self.args.etcd
        async for value in follow_key(self.args.etcd, TELEMETRY):
            target = value.get("target") if isinstance(value, dict) else None
            if not isinstance(target, str) or not target or target == self.target:
                continue
            log.info("telemetry: the scheduler %s takes reports at %s", value.get("leader"), target)
            await self.report_to(target)

    async def report_to(self, target: str) -> None:
        """(Re)start reporting to `target`: the same reporter, so the accumulator, what
        was not acknowledged yet (resent first: the history ignores a report it has) and
        the sequence numbers carry over to the new scheduler."""
        assert self.load is not None
        if self._reporting is not None:
            self._reporting.cancel()
            await asyncio.gather(self._reporting, return_exceptions=True)
        if self.reporter is None:
            if time.time() - self._load_since > MAX_INTERVAL_S:
                self.load.take(time.time())  # too long for one report: a scheduler refuses it
            self.reporter = TelemetryReporter(
                self.load, target, self.node_id, interval_s=self.args.telemetry_interval
            )
        self.target = self.reporter.target = target
        self._reporting = asyncio.create_task(self.reporter.run(), name="telemetry")
        self._reporting.add_done_callback(_log_failure)

    # ---------------------------------------------------------------- helpers

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_failure)
        self._tasks.append(task)


def _runs(entry: ModelEntry, spec: dict) -> bool:
    """Whether `entry` is what the placement `spec` names (checkpoint and version)."""
    path = spec.get("path")
    return (
        isinstance(path, str)
        and entry.version == spec.get("version", "")
        and entry.path == Path(path).resolve()
    )


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("cluster task %s failed", task.get_name(), exc_info=task.exception())
