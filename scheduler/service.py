"""The scheduler's leader loop: from the live nodes in etcd and the wanted models, the
placements each node should run, written back to etcd for the nodes to converge on.

Replicas elect one leader (omni/cluster/state.py); the others wait to take over. The
leader reconciles on every change of nodes and every `interval_s`: a node that dies
drops out of etcd when its lease runs out, and its models are placed elsewhere.

Every replica keeps a load history (history.py, fed by its telemetry server); the
leader also
- publishes where the nodes should stream their telemetry: /omni/telemetry, under its
  leadership lease, so it goes with the leader and the next one writes its own;
- scales each model between its `replicas` (the minimum) and `max_replicas` with one
  `Autoscaler` per model: seeded from the history when it takes over, fed each round
  with the history's newly finished intervals, its decisions published in
  /omni/autoscale (for `omnictl cluster forecast`);
- publishes the latency map of the live nodes (/omni/latencymap, latency.py).

Keys (JSON values), beside omni/cluster/state.py's:
    /omni/telemetry    {"target": "host:port", "leader": name}, under the leader's lease
    /omni/autoscale    {model: {replicas, reason, demand, predicted, at, min, max}}
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import tomllib
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from omni.cluster.rollout import ROLLOUT_STATUS, ROLLOUTS, RolloutRequest
from omni.cluster.state import LEADER, NODES, PREFIX, TELEMETRY, ClusterStore, Election
from omni.model_spec import HANDLER_KEYS, parse_size

from .autoscale import AutoscaleConfig, Autoscaler, Decision
from .history import HistoryStore, demand_buckets, telemetry_series
from .latency import build_map, publish_map
from .placement import Gpu, ModelSpec, Node, Placement, PlacementResult, Unplaced, place
from .rollout import (
    BASELINE_S,
    ROLLING,
    Counts,
    Observed,
    Version,
    advance,
    begin,
    new_replicas,
    stable,
    versions,
)

log = logging.getLogger(__name__)

CPU_BUDGET = 16 << 30  # what a node without GPUs offers its CPU instances, when it says nothing
AUTOSCALE = PREFIX + b"autoscale"
RETRY_S = 2.0  # between campaigns that failed (etcd unreachable)
PRELOAD_S = 15 * 86_400  # the history read when taking over: all the store keeps
DEMAND_WINDOW_S = 3600.0  # where a model's demand came from, over this long


@dataclass
class WantedModel:
    """A model the cluster should serve: where its checkpoint is and what it needs.
    `spec.replicas` is the least it runs; the autoscaler may add up to `max_replicas`
    (None: the autoscaler's own bound)."""

    spec: ModelSpec
    path: str
    permits: int | None = None
    max_replicas: int | None = None
    version: str = "1"
    runtime: dict = dataclasses.field(default_factory=dict)  # what runs it: RUNTIME_KEYS

    @property
    def base_version(self) -> Version:
        """The version the models file names: what runs before any rollout."""
        return Version(self.version, self.path)

    def node_spec(self, version: Version) -> dict:
        """What a node is told to run (omnid's catalog keys)."""
        out: dict = {"path": version.path, "version": version.name, **self.runtime}
        if self.permits:
            out["permits"] = self.permits
        return out

    def autoscale_config(self, base: AutoscaleConfig) -> AutoscaleConfig:
        """`base` bounded by this model's replicas (the minimum) and max_replicas."""
        high = base.max_replicas if self.max_replicas is None else self.max_replicas
        return dataclasses.replace(
            base, min_replicas=self.spec.replicas, max_replicas=max(high, self.spec.replicas)
        )


# A node's catalog keys that say what runs a model, passed to the nodes as they are
# (omnid checks them): a handler's model (runtime = "python") and its packages.
RUNTIME_KEYS = ("runtime", *HANDLER_KEYS)


def load_models(path: Path) -> list[WantedModel]:
    """[[models]] tables: name, path, version (a label, default "1"), quota (on each of its
    GPUs), gpus (GPUs of one node an instance spans: tensor parallelism), replicas (the
    minimum), max_replicas, the placement constraints, and what runs it (RUNTIME_KEYS)."""
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
                gpus=int(m.get("gpus", 1)),
            )
            high = m.get("max_replicas")
            if high is not None:
                high = int(high)
                if high < spec.replicas:
                    raise ValueError(f"max_replicas {high} is below replicas {spec.replicas}")
            version = str(m.get("version", "1"))
            if not version:
                raise ValueError("version must not be empty")
            runtime = {k: m[k] for k in RUNTIME_KEYS if k in m}
            if "handler" in runtime and runtime.get("runtime") != "python":
                raise ValueError('handler needs runtime = "python"')
            out.append(WantedModel(spec, str(m["path"]), m.get("permits"), high, version, runtime))
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


def one_per_node(
    nodes: list[Node],
    specs: list[ModelSpec],
    result: PlacementResult,
    current: list[Placement],
) -> tuple[list[Placement], list[Unplaced]]:
    """`result` with at most one instance of a model per node, and what is left unplaced.

    A node runs one instance of a model (its placement key is node/model), while placement
    only keeps a model's replicas off a shared GPU. A second replica on one node moves to
    a GPU with room on a node without one (a location the model is not in yet first, then
    best fit), or is left unplaced. The replicas kept in place are those running already.
    """
    by_name = {spec.name: spec for spec in specs}
    gpus = [(node.location, gpu) for node in nodes for gpu in node.gpus]
    location = {node.id: node.location for node in nodes}
    used: Counter[tuple[str, int]] = Counter()
    for p in result.placements:
        for index in p.gpus or (p.gpu,):
            used[p.node, index] += by_name[p.model].quota_bytes
    running = {(p.model, p.node, p.gpu) for p in current}
    per_model: dict[str, list[Placement]] = defaultdict(list)
    for p in result.placements:
        per_model[p.model].append(p)
    out, unplaced = [], list(result.unplaced)
    for name, placed in per_model.items():
        spec, hosts, extra = by_name[name], set(), []
        placed.sort(key=lambda p: ((p.model, p.node, p.gpu) not in running, p.replica))
        for p in placed:
            if p.node in hosts:
                extra.append(p)
                for index in p.gpus or (p.gpu,):
                    used[p.node, index] -= spec.quota_bytes
            else:
                hosts.add(p.node)
                out.append(p)
        locations = {location[n] for n in hosts}
        for p in extra:
            if p.gpus:  # placement put them on distinct nodes where it could
                unplaced.append(Unplaced(name, p.replica, "one instance per node"))
                continue
            best = None
            for loc, gpu in gpus:
                room = gpu.capacity - used[gpu.node, gpu.index] - spec.quota_bytes
                if (
                    gpu.node in hosts
                    or room < 0
                    or spec.quota_bytes > gpu.budget_bytes
                    or not spec.matches(gpu, loc)
                ):
                    continue
                rank = (loc in locations, -spec.demand.get(loc, 0.0), room, gpu.node, gpu.index)
                if best is None or rank < best[0]:
                    best = (rank, gpu)
            if best is None:
                why = "one instance per node, and no other node has room"
                unplaced.append(Unplaced(name, p.replica, why))
                continue
            gpu = best[1]
            used[gpu.node, gpu.index] += spec.quota_bytes
            hosts.add(gpu.node)
            locations.add(location[gpu.node])
            out.append(Placement(name, p.replica, gpu.node, gpu.index))
    out.sort(key=lambda p: (p.model, p.replica))
    return out, unplaced


class ClusterScheduler:
    """One scheduler replica: campaigns, and while it leads, reconciles every round.

    Without `history` there is no autoscaling (each model runs its `replicas`); without
    `telemetry_target` no /omni/telemetry is published.
    """

    def __init__(
        self,
        store: ClusterStore,
        name: str,
        models: list[WantedModel],
        interval_s: float = 5.0,
        lease_ttl_s: int = 10,
        *,
        history: HistoryStore | None = None,
        telemetry_target: str | None = None,
        autoscale: AutoscaleConfig | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.store, self.name, self.interval_s = store, name, interval_s
        self.models = {m.spec.name: m for m in models}
        self.election = Election(store, name, lease_ttl_s)
        self.history, self.telemetry_target = history, telemetry_target
        self.autoscale = autoscale or AutoscaleConfig()
        self.clock = clock
        self.autoscalers: dict[str, Autoscaler] = {}
        self.decisions: dict[str, Decision] = {}
        self._fed: dict[str, float] = {}  # model -> history fed to its autoscaler up to
        self._in_office = False  # this term's start (telemetry key, preload) is done
        self._unplaced: set[tuple[str, int]] = set()  # warned about already
        self._bad_rollouts: dict[str, dict] = {}  # malformed requests, warned about already
        self._wake = asyncio.Event()

    async def run(self) -> None:
        """Campaign, lead until leadership is lost, campaign again; until cancelled."""
        while True:
            try:
                await self.election.campaign()
            except Exception as exc:  # etcd unreachable: a standby keeps trying
                log.warning("campaign failed: %s; retrying in %.0f s", exc, RETRY_S)
                await asyncio.sleep(RETRY_S)
                continue
            await self._lead()

    async def _lead(self) -> None:
        self._in_office = False
        watcher = asyncio.create_task(self._watch_nodes())
        try:
            while True:
                try:
                    if not await self._still_leading():
                        log.warning("%s no longer leads; campaigning again", self.name)
                        with contextlib.suppress(Exception):
                            await self.election.resign()
                        return
                    if not self._in_office:
                        await self._take_office()
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

    async def _still_leading(self) -> bool:
        """Whether /omni/leader is still under this replica's lease (it expires if the
        renewals fail for a TTL, e.g. cut off from etcd, and a standby may lead by now)."""
        lease = self.election.lease
        kv = await self.store.client.get(LEADER)
        return lease is not None and kv is not None and kv.lease == lease.id

    async def _take_office(self) -> None:
        """A new term: tell the nodes where to stream telemetry, and start the autoscalers
        from the history (the forecast) and from what is placed now (the replicas)."""
        if self.telemetry_target is not None:
            value = {"target": self.telemetry_target, "leader": self.name}
            await self.store.client.put(TELEMETRY, orjson.dumps(value), lease=self.election.lease)
            log.info("telemetry: nodes report to %s", self.telemetry_target)
        self.autoscalers.clear()
        self.decisions.clear()
        self._fed.clear()
        if self.history is not None:
            now = self.clock()
            placed = Counter(key.split("/", 1)[1] for key in await self.store.placements())
            for name, model in self.models.items():
                cfg = model.autoscale_config(self.autoscale)
                scaler = Autoscaler(cfg, self.clock, replicas=placed.get(name) or None)
                buckets = await asyncio.to_thread(
                    demand_buckets, self.history, name, now - PRELOAD_S, now, cfg
                )
                scaler.preload(buckets)
                self.autoscalers[name] = scaler
                # The bucket in progress is left out of the preload: the live feed starts
                # at its beginning, so the forecast gets it whole.
                step = cfg.forecast.step_s
                self._fed[name] = math.floor(now / step) * step
                log.info("autoscale %s: %d buckets of history", name, len(buckets))
        self._in_office = True

    async def _scale(self) -> dict[str, int]:
        """Each model's replicas for this round: its autoscaler's decision after the
        history's intervals finished since the last round (a step is read one step after
        it ends, so that late reports are in), or its `replicas` without autoscaling."""
        if self.history is None or not self.autoscalers:
            return {name: m.spec.replicas for name, m in self.models.items()}
        res = self.history.resolution_s
        until = (math.floor(self.clock() / res + 1e-6) - 1) * res
        out = {}
        for name, scaler in self.autoscalers.items():
            since, before = self._fed[name], scaler.replicas
            if until > since:
                reports = await asyncio.to_thread(
                    telemetry_series, self.history, name, since, until
                )
                for report in reports:
                    scaler.observe(report)
                self._fed[name] = until
            decision = scaler.decide()
            if not isinstance(decision.replicas, int):
                # History's replicas are time averages (a node that joined mid-interval
                # counts for part of it): "one more than were ready" can be fractional,
                # and even a whole one is a float that placement cannot count with.
                scaler.replicas = math.ceil(decision.replicas - 1e-9)
                decision = dataclasses.replace(decision, replicas=scaler.replicas)
            self.decisions[name] = decision
            if decision.replicas != before:
                log.info(
                    "autoscale %s: %d -> %d replicas (%s, demand %.2f, forecast %s)",
                    name,
                    before,
                    decision.replicas,
                    decision.reason,
                    decision.demand,
                    "-" if decision.forecast is None else f"{decision.forecast:.2f}",
                )
            out[name] = max(decision.replicas, self.models[name].spec.replicas)
        return out

    async def _publish_decisions(self) -> None:
        now = self.clock()
        value = {}
        for name, d in sorted(self.decisions.items()):
            cfg = self.autoscalers[name].cfg
            value[name] = {
                "replicas": d.replicas,
                "reason": d.reason,
                "demand": round(d.demand, 4),
                "predicted": None if d.forecast is None else round(d.forecast, 4),
                "at": now,
                "min": cfg.min_replicas,
                "max": cfg.max_replicas,
            }
        await self.store.client.put(AUTOSCALE, orjson.dumps(value))

    async def _roll(self, replica_ids: dict[str, list[int]]) -> dict[str, dict]:
        """Carry the rollouts on by a round (rollout.py): each model's rollout status after
        it, written back where it changed."""
        asked = await self.store.get_prefix(ROLLOUTS)
        statuses = await self.store.get_prefix(ROLLOUT_STATUS)
        observed = await self.store.observed() if asked else {}
        now = self.clock()
        for name, value in asked.items():
            model = self.models.get(name)
            if model is None:
                continue
            try:
                req = RolloutRequest.from_json(value)
            except ValueError as exc:
                if self._bad_rollouts.get(name) != value:
                    log.warning("rollout of %s ignored: %s", name, exc)
                    self._bad_rollouts[name] = value
                continue
            status = statuses.get(name)
            if status is None or status.get("id") != req.id:
                after = begin(req, stable(status, model.base_version), now)
                log.info("rollout of %s to %s: %s", name, req.version, after["reason"])
            elif status.get("state") == ROLLING:
                new, old = await self._version_counts(name, status)
                wanted_new = new_replicas(len(replica_ids.get(name, [])), status["percent"])
                after = advance(
                    req, status, new, old, _observed(observed, name, req.version), wanted_new, now
                )
                if after["state"] != ROLLING or after["stage"] != status["stage"]:
                    log.info("rollout of %s to %s: %s", name, req.version, after["reason"])
            else:
                continue
            if after != status:
                await self.store.client.put(ROLLOUT_STATUS + name.encode(), orjson.dumps(after))
                statuses[name] = after
        return statuses

    async def _version_counts(
        self, model: str, status: dict
    ) -> tuple[Counts | None, Counts | None]:
        """The new version's requests and errors since the rollout started, and the old
        one's since BASELINE_S before; None for both without a history."""
        if self.history is None:
            return None, None
        started = status["started"]
        since = await asyncio.to_thread(self.history.version_counts, model, started)
        before = await asyncio.to_thread(self.history.version_counts, model, started - BASELINE_S)
        new = Counts(*since.get(status["version"], (0, 0)))
        old = Counts(*before.get(status["previous"]["version"], (0, 0)))
        return new, old

    async def _demand(
        self, nodes: list[Node], matrix: dict[str, dict[str, float]]
    ) -> dict[str, dict[str, float]]:
        """Per model, its requests of the last DEMAND_WINDOW_S by the location nearest to
        the edge they came through among those with nodes it may run on (the edge's own,
        or the closest by the latency map; demand from a location the map does not
        connect to any is left out).
        Placement puts new replicas where this demand is short of them."""
        if self.history is None:
            return {}
        since = self.clock() - DEMAND_WINDOW_S
        out: dict[str, dict[str, float]] = {}
        for name, model in self.models.items():
            allowed, denied = model.spec.allowed_locations, model.spec.denied_locations
            hosts = {
                node.location
                for node in nodes
                if (not allowed or node.location in allowed) and node.location not in denied
            }
            by_origin = await asyncio.to_thread(self.history.demand_by_origin, name, since)
            weights: dict[str, float] = defaultdict(float)
            for origin, requests in by_origin.items():
                if origin in hosts:
                    weights[origin] += requests
                    continue
                row = matrix.get(origin, {})
                near = min((loc for loc in hosts if loc in row), key=row.get, default=None)
                if near is not None:
                    weights[near] += requests
            if weights:
                out[name] = dict(weights)
        return out

    async def reconcile(self) -> None:
        """One round: scale, place the wanted models on the live nodes and write what
        changed, publish the decisions and the latency map."""
        replicas = await self._scale()
        records = await self.store.nodes()
        nodes = cluster_nodes(records)
        latency_map = await build_map(self.store)
        demand = await self._demand(nodes, latency_map.matrix())
        specs = [
            dataclasses.replace(m.spec, replicas=replicas[name], demand=demand.get(name, {}))
            for name, m in self.models.items()
        ]
        written = await self.store.placements()
        current = []
        for key, spec in written.items():
            node, model = key.split("/", 1)
            if node in records and model in self.models:
                current.append(_placement_of(model, node, spec))
        result = place(nodes, specs, current)
        placements, misses = one_per_node(nodes, specs, result, current)
        replica_ids: dict[str, list[int]] = defaultdict(list)
        for p in placements:
            replica_ids[p.model].append(p.replica)
        rollouts = await self._roll(replica_ids)
        version_of = {
            name: versions(ids, rollouts.get(name), self.models[name].base_version)
            for name, ids in replica_ids.items()
        }
        wanted = {}
        for p in placements:
            model = self.models[p.model]
            spec = {**model.node_spec(version_of[p.model][p.replica]), "replica": p.replica}
            if p.gpus:
                spec.update(gpu=list(p.gpus), quota=model.spec.quota_bytes)
            elif p.gpu >= 0:
                spec.update(gpu=p.gpu, quota=model.spec.quota_bytes)
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
        unplaced = {(m.model, m.replica): m.reason for m in misses}
        for (model, replica), reason in sorted(unplaced.items()):
            if (model, replica) not in self._unplaced:  # once, not every round
                log.warning("cannot place %s replica %d: %s", model, replica, reason)
        self._unplaced = set(unplaced)
        if self.decisions:
            await self._publish_decisions()
        await publish_map(self.store, latency_map)


def _placement_of(model: str, node: str, spec: dict) -> Placement:
    """A placement as written for a node (`gpu`: an index, or a multi-GPU instance's list)."""
    gpu = spec.get("gpu", -1)
    if isinstance(gpu, list):
        return Placement(model, spec.get("replica", 0), node, gpu[0], tuple(gpu))
    return Placement(model, spec.get("replica", 0), node, gpu)


def _observed(observed: dict[str, dict], model: str, version: str) -> Observed:
    """The nodes' reports on `model`'s instances of `version`: how many are ready, and the
    most restarts of one (and where)."""
    ready, restarts, where = 0, 0, ""
    for key, state in observed.items():
        node, name = key.split("/", 1)
        if name != model or state.get("version") != version:
            continue
        ready += state.get("state") == "ready"
        if int(state.get("restarts") or 0) > restarts:
            restarts, where = int(state["restarts"]), node
    return Observed(ready, restarts, where)
