"""The scheduler's leader loop: from the live nodes in etcd and the wanted models, the
placements each node should run, written back to etcd for the nodes to converge on.

Replicas elect one leader (scheduler/state.py); the others wait to take over. The
leader reconciles on every change of nodes and every `interval_s`: a node that dies
drops out of etcd when its lease runs out, and its models are placed elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path

from omni.runtime.catalog import parse_size

from .placement import Gpu, ModelSpec, Node, Placement, place
from .state import NODES, ClusterStore, Election

log = logging.getLogger(__name__)

CPU_BUDGET = 16 << 30  # what a node without GPUs offers its CPU instances, when it says nothing


@dataclass
class WantedModel:
    """A model the cluster should serve: where its checkpoint is and what it needs."""

    spec: ModelSpec
    path: str
    permits: int | None = None

    def node_spec(self) -> dict:
        """What a node is told to run (omnid's catalog keys)."""
        out: dict = {"path": self.path}
        if self.permits:
            out["permits"] = self.permits
        return out


def load_models(path: Path) -> list[WantedModel]:
    """[[models]] tables: name, path, quota, replicas, and the placement constraints."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    out = []
    for i, m in enumerate(data.get("models", [])):
        where = f"{path}: models[{i}]"
        try:
            spec = ModelSpec(
                name=m["name"],
                quota_bytes=parse_size(m.get("quota", "1GiB")),
                replicas=int(m.get("replicas", 1)),
                gpu_kinds=frozenset(m.get("gpu_kinds", ())),
                min_gpu_memory=parse_size(m["min_gpu_memory"]) if "min_gpu_memory" in m else 0,
                allowed_locations=frozenset(m.get("allowed_locations", ())),
                denied_locations=frozenset(m.get("denied_locations", ())),
                spread=int(m.get("spread", 1)),
            )
            out.append(WantedModel(spec, str(m["path"]), m.get("permits")))
        except KeyError as exc:
            raise ValueError(f"{where}: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    return out


def cluster_nodes(records: dict[str, dict]) -> list[Node]:
    """Placement's view of the announced nodes; a node without GPUs offers one CPU slot."""
    nodes = []
    for node_id, rec in sorted(records.items()):
        gpus = [
            Gpu(
                node_id,
                int(g["index"]),
                str(g.get("kind", "gpu")),
                int(g.get("memory_bytes") or g["budget_bytes"]),
                int(g["budget_bytes"]),
                float(g.get("overcommit", 1.0)),
            )
            for g in rec.get("gpus") or []
        ]
        if not gpus:
            budget = int(rec.get("memory_bytes") or CPU_BUDGET)
            gpus = [Gpu(node_id, -1, "cpu", budget, budget, 1.0)]
        nodes.append(Node(node_id, str(rec.get("location", "default")), gpus))
    return nodes


class Scheduler:
    def __init__(
        self,
        store: ClusterStore,
        name: str,
        models: list[WantedModel],
        interval_s: float = 5.0,
        lease_ttl_s: int = 10,
    ):
        self.store, self.name, self.interval_s = store, name, interval_s
        self.models = {m.spec.name: m for m in models}
        self.election = Election(store, name, lease_ttl_s)
        self._wake = asyncio.Event()

    async def run(self) -> None:
        await self.election.campaign()
        watcher = asyncio.create_task(self._watch_nodes())
        try:
            while True:
                try:
                    await self.reconcile()
                except Exception:  # etcd hiccup: the next round tries again
                    log.exception("reconcile failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
                self._wake.clear()
        finally:
            watcher.cancel()

    async def _watch_nodes(self) -> None:
        async for _change in self.store.watch(NODES):
            self._wake.set()

    async def reconcile(self) -> None:
        """Place the wanted models on the live nodes; write what changed."""
        records = await self.store.nodes()
        written = await self.store.placements()
        current = []
        for key, spec in written.items():
            node, model = key.split("/", 1)
            if node in records and model in self.models:
                current.append(Placement(model, spec.get("replica", 0), node, spec.get("gpu", -1)))
        result = place(cluster_nodes(records), [m.spec for m in self.models.values()], current)
        wanted = {}
        for p in result.placements:
            spec = {**self.models[p.model].node_spec(), "replica": p.replica}
            if p.gpu >= 0:
                spec.update(gpu=p.gpu, quota=self.models[p.model].spec.quota_bytes)
            wanted[f"{p.node}/{p.model}"] = spec
        for key, spec in wanted.items():
            if written.get(key) != spec:
                node, model = key.split("/", 1)
                await self.store.set_placement(node, model, spec)
                log.info("placed %s on %s", model, node)
        for key in set(written) - set(wanted):
            node, model = key.split("/", 1)
            await self.store.remove_placement(node, model)
            log.info("removed %s from %s", model, node)
        for miss in result.unplaced:
            log.warning("cannot place %s replica %d: %s", miss.model, miss.replica, miss.reason)
