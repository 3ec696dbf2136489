"""Load telemetry's records: what a node reports of each model over each interval
(`ModelFigures`, `IntervalReport`), the messages they travel in, and the constants both
ends share. The node's side (the accumulator and the reporter) is in telemetry.py here;
the scheduler's (the server, the history) in scheduler/.

The messages are in telemetry.proto next to this file, compiled in-process when this
module is imported (`grpc.protos_and_services`, from grpcio-tools): no generated code is
committed, none can go stale, and no cache directory has to be writable.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc


def _load_protos() -> tuple[Any, Any]:
    """telemetry_pb2 and telemetry_pb2_grpc, compiled from the .proto beside this file.

    grpc_tools finds the file through sys.path; an editable or zipped install need not
    have the directory that holds `omni/` there, so it is put first for the duration of the call.
    """
    root = str(Path(__file__).resolve().parents[2])
    sys.path.insert(0, root)
    try:
        return grpc.protos_and_services("omni/cluster/telemetry.proto")
    finally:
        sys.path.remove(root)


pb, pb_grpc = _load_protos()

DAY_S = 86_400
OUT_OF_CAPACITY = frozenset({429, 503})  # shed by omnid: at capacity, or busy past the deadline
CLIENT_CLOSED = 499  # the client left before its answer's end: the model's fault in nothing
MAX_ORIGINS = 64  # locations counted per model and interval (a header may come from anyone)
MAX_LABEL = 64  # characters of a version or origin label
MAX_INTERVAL_S = 3600.0  # a longer report is a broken clock, not telemetry
EPS = 1e-6  # of a resolution step: float noise when timestamps become bucket indices


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
