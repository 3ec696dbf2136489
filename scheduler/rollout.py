"""Gradual rollouts: a model's new version runs on a share of its replicas, then a larger
one, then all of them; it is rolled back on its own when it does worse than the version
it replaces.

An operator asks (`omnictl cluster rollout start`), the scheduler's leader carries it
out: each round `advance()` looks at the rollout's status, the nodes' reports and the
telemetry history, and returns the next status; `versions()` says which replica runs
which version, and the placements written to the nodes carry it (omnid restarts an
instance whose version changes). Both keys live in etcd, so a standby that takes over
goes on where the old leader stopped.

The keys and the request (`RolloutRequest`), which omnictl writes, are in
omni/cluster/rollout.py.

Judging: the new version's error rate (errors / admitted requests, from the telemetry
that nodes tag with the version they run) since the rollout started, against the old
version's over the same time plus `BASELINE_S` before it (so the old rate is known even
at 100%). Once the new version has `min_requests`, a rate above the old one's plus
`tolerance` rolls back at once; a stage ends after `step_s` if the new version has that
many requests and all of its replicas are ready. A new-version instance restarting
`max_restarts` times (crashing at start or while serving) also rolls back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omni.cluster.rollout import RolloutRequest

BASELINE_S = 600.0  # the old version's rate also counts this long before the rollout

ROLLING, DONE, ROLLED_BACK, REFUSED = "rolling", "done", "rolled-back", "refused"


@dataclass(frozen=True)
class Version:
    """What a replica runs: a version label and the checkpoint it names."""

    name: str
    path: str

    def to_json(self) -> dict:
        return {"version": self.name, "path": self.path}

    @classmethod
    def from_json(cls, value: dict) -> Version:
        return cls(value["version"], value["path"])


@dataclass(frozen=True)
class Counts:
    """Admitted requests and the errors among them, for one version."""

    requests: int = 0
    errors: int = 0

    @property
    def rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def to_json(self) -> dict:
        return {"requests": self.requests, "errors": self.errors}


@dataclass(frozen=True)
class Observed:
    """What the nodes report of the model's instances running the new version."""

    ready: int = 0  # instances of the new version that are ready
    restarts: int = 0  # the most restarts of any of them
    where: str = ""  # the node of that one


def stable(status: dict | None, default: Version) -> Version:
    """The version every replica runs outside a rollout: the last one rolled out, the one
    kept by a rollback, or the models file's."""
    if not status:
        return default
    if status.get("state") == DONE:
        return Version(status["version"], status["path"])
    return Version.from_json(status["previous"])  # rolling, rolled back or refused


def new_replicas(replicas: int, percent: float) -> int:
    """How many of `replicas` run the new version at `percent`: at least one."""
    if replicas <= 0:
        return 0
    return min(replicas, max(1, math.ceil(replicas * percent / 100 - 1e-9)))


def versions(replica_ids: list[int], status: dict | None, default: Version) -> dict[int, Version]:
    """Which version each replica runs. During a rollout the lowest-numbered replicas run
    the new one: replica 0 is the last to go on a scale-down, so the new version keeps
    its share of traffic while the model shrinks."""
    base = stable(status, default)
    out = {r: base for r in replica_ids}
    if status and status.get("state") == ROLLING:
        n = new_replicas(len(replica_ids), float(status["percent"]))
        new = Version(status["version"], status["path"])
        for r in sorted(replica_ids)[:n]:
            out[r] = new
    return out


def begin(req: RolloutRequest, previous: Version, now: float) -> dict:
    """The status of a rollout that starts now, from `previous`: refused when it names
    the version running already (its telemetry could not be told apart)."""
    base = {
        "id": req.id,
        "version": req.version,
        "path": req.path,
        "previous": previous.to_json(),
        "started": now,
    }
    if req.version == previous.name:
        reason = f"{req.version} is the version running now"
        return {**base, "state": REFUSED, "reason": reason, "ended": now}
    return {
        **base,
        "state": ROLLING,
        "stage": 0,
        "percent": req.steps[0],
        "stage_since": now,
        "reason": f"{req.steps[0]:g}% of replicas",
        "new": Counts().to_json(),
        "old": Counts().to_json(),
    }


def advance(
    req: RolloutRequest,
    status: dict,
    new: Counts | None,
    old: Counts | None,
    observed: Observed,
    wanted_new: int,
    now: float,
) -> dict:
    """The rollout's next status (`status` itself once the rollout is over; else a new
    dict, with the latest counts).

    `new`/`old`: each version's counts (see the module docstring), None without telemetry
    (then stages end on time and readiness alone). `wanted_new`: replicas the current
    stage gives the new version.
    """
    if status.get("state") != ROLLING:
        return status
    out = dict(status)
    if new is not None and old is not None:
        out["new"], out["old"] = new.to_json(), old.to_json()

    def end(state: str, reason: str) -> dict:
        return {**out, "state": state, "reason": reason, "ended": now}

    if req.abort:
        return end(ROLLED_BACK, "aborted by the operator")
    if observed.restarts >= req.max_restarts:
        return end(
            ROLLED_BACK,
            f"{req.version} restarted {observed.restarts} times on {observed.where}",
        )
    judged = new is not None and old is not None and new.requests >= req.min_requests
    if judged and new.requests and new.rate > old.rate + req.tolerance:
        return end(
            ROLLED_BACK,
            f"error rate {new.rate:.2%} ({new.errors}/{new.requests}) above "
            f"{status['previous']['version']}'s {old.rate:.2%} ({old.errors}/{old.requests})",
        )
    enough = new is None or judged
    if now - status["stage_since"] < req.step_s or not enough or observed.ready < wanted_new:
        return out
    stage = status["stage"] + 1
    if stage >= len(req.steps):
        return end(DONE, f"all replicas on {req.version}")
    return {
        **out,
        "stage": stage,
        "percent": req.steps[stage],
        "stage_since": now,
        "reason": f"{req.steps[stage]:g}% of replicas",
    }
