"""A rollout as omnictl asks for it and the scheduler's leader carries it out
(scheduler/rollout.py): its keys in etcd, and the request an operator writes.

Keys (JSON values):
    /omni/rollouts/<model>        the rollout asked for, written by omnictl: {id, version,
                                  path, steps, step_s, min_requests, tolerance,
                                  max_restarts, abort?}
    /omni/rollout-status/<model>  its progress, written by the leader: {id, version, path,
                                  previous: {version, path}, state, stage, percent,
                                  started, stage_since, reason, new, old}
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from .state import PREFIX

ROLLOUTS = PREFIX + b"rollouts/"
ROLLOUT_STATUS = PREFIX + b"rollout-status/"


@dataclass(frozen=True)
class RolloutRequest:
    """What the operator asked for; `check()` refuses a malformed one."""

    id: str
    version: str
    path: str
    steps: tuple[float, ...] = (10.0, 50.0, 100.0)
    step_s: float = 300.0
    min_requests: int = 100
    tolerance: float = 0.01
    max_restarts: int = 2
    abort: bool = False

    @classmethod
    def from_json(cls, value: dict) -> RolloutRequest:
        """ValueError names what is wrong."""
        if not isinstance(value, dict):
            raise ValueError("a rollout is a JSON object")
        try:
            req = cls(
                id=str(value["id"]),
                version=str(value["version"]),
                path=str(value["path"]),
                steps=tuple(float(s) for s in value.get("steps", cls.steps)),
                step_s=float(value.get("step_s", cls.step_s)),
                min_requests=int(value.get("min_requests", cls.min_requests)),
                tolerance=float(value.get("tolerance", cls.tolerance)),
                max_restarts=int(value.get("max_restarts", cls.max_restarts)),
                abort=bool(value.get("abort", False)),
            )
        except KeyError as exc:
            raise ValueError(f"missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None
        req.check()
        return req

    def check(self) -> None:
        if not self.id or not self.version or not self.path:
            raise ValueError("id, version and path must not be empty")
        steps = self.steps
        if not steps or steps[-1] != 100 or any(not 0 < s <= 100 for s in steps):
            raise ValueError(f"steps {list(steps)}: percentages in (0, 100], ending at 100")
        if any(a >= b for a, b in itertools.pairwise(steps)):
            raise ValueError(f"steps {list(steps)} must increase")
        if not (math.isfinite(self.step_s) and self.step_s >= 0):
            raise ValueError("step_s must be >= 0")
        if self.min_requests < 0 or self.max_restarts < 1:
            raise ValueError("min_requests must be >= 0 and max_restarts >= 1")
        if not (math.isfinite(self.tolerance) and 0 <= self.tolerance <= 1):
            raise ValueError("tolerance must be in [0, 1]")

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["steps"] = list(self.steps)
        return out
