"""The scheduler's load history: every node's reports, per model, in sqlite.

`HistoryStore` keeps per-node rows for a day (so a resent report is recognised) and
per-model totals per resolution interval for 15 days (the forecaster needs a week and a
day; two weeks see each weekly slot twice), surviving restarts. `telemetry_series`,
`demand_series` and `demand_buckets` turn it into what `scheduler.autoscale` takes: its
`Telemetry` reports, and bucket means for `Autoscaler.preload`.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from omni.cluster.reports import DAY_S, EPS, MAX_INTERVAL_S, IntervalReport, ModelFigures

from .autoscale import AutoscaleConfig, ReactivePolicy, Telemetry

log = logging.getLogger(__name__)


# -- scheduler side: history -----------------------------------------------------------


@dataclass(frozen=True)
class SeriesPoint:
    """One model across all nodes over [t, t + step_s).

    Counters are sums over the step; gauges (nodes, replicas, permits) are the cluster
    totals averaged over the resolution intervals that had reports (`intervals` of them),
    each weighted by the time it covered, so a node's short first interval counts for
    its length.
    """

    t: float
    step_s: float
    intervals: int
    nodes: float
    replicas: float
    permits_total: float
    permits_free: float
    wall_s: float
    queue_s: float
    queued: float
    requests: float
    errors: float
    out_of_capacity: float
    prompt_tokens: float
    completion_tokens: float


# model_load's additive columns, in SeriesPoint's order after `intervals`; the first
# four are gauges integrated over time (value x seconds).
_MODEL_COLS = (
    "node_s",
    "replicas_s",
    "permits_total_s",
    "permits_free_s",
    "wall_s",
    "queue_s",
    "queued",
    "requests",
    "errors",
    "oc",
    "prompt_tokens",
    "completion_tokens",
)
_GAUGES = 4
_NUMBERS = [
    f.name for f in fields(ModelFigures) if f.name not in ("version", "by_version", "origins")
]

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS node_load (
    node TEXT NOT NULL, model TEXT NOT NULL, start REAL NOT NULL, interval_s REAL NOT NULL,
    wall_s REAL, queue_s REAL, queued INTEGER, requests INTEGER, errors INTEGER,
    oc INTEGER, prompt_tokens INTEGER, completion_tokens INTEGER,
    permits_total INTEGER, permits_free INTEGER, replicas INTEGER, version TEXT,
    PRIMARY KEY (node, model, start)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS node_load_start ON node_load (start);
CREATE TABLE IF NOT EXISTS version_load (
    model TEXT NOT NULL, start REAL NOT NULL, node TEXT NOT NULL, version TEXT NOT NULL,
    requests INTEGER NOT NULL, errors INTEGER NOT NULL,
    PRIMARY KEY (model, start, node, version)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS origin_load (
    model TEXT NOT NULL, start REAL NOT NULL, node TEXT NOT NULL, origin TEXT NOT NULL,
    requests INTEGER NOT NULL,
    PRIMARY KEY (model, start, node, origin)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS model_load (
    model TEXT NOT NULL, k INTEGER NOT NULL,
    {", ".join(f"{c} REAL NOT NULL" for c in _MODEL_COLS)},
    PRIMARY KEY (model, k)
) WITHOUT ROWID;
"""

_UPSERT = (
    f"INSERT INTO model_load (model, k, {', '.join(_MODEL_COLS)}) "
    f"VALUES (?, ?, {', '.join('?' for _ in _MODEL_COLS)}) "
    f"ON CONFLICT (model, k) DO UPDATE SET "
    + ", ".join(f"{c} = {c} + excluded.{c}" for c in _MODEL_COLS)
)

# A loose index scan: one B-tree probe per distinct model, not a pass over every row.
_MODELS = """
WITH RECURSIVE m(name) AS (
    SELECT MIN(model) FROM model_load
    UNION ALL
    SELECT (SELECT MIN(model) FROM model_load WHERE model > m.name) FROM m
    WHERE m.name IS NOT NULL
)
SELECT name FROM m WHERE name IS NOT NULL
"""


class HistoryStore:
    """The cluster's load history in one sqlite file; it survives scheduler restarts.

    Four tables:
    - node_load: every report as sent, one row per (node, model, interval start), kept
      `node_retention_s` (default a day). Its key makes a resent report a no-op, so
      storing is idempotent; per-node figures are there for inspection.
    - version_load: the same reports' requests and errors split by the model version
      that served them, kept as long: what rollouts are judged on.
    - origin_load: their requests split by the location of the edge they came through,
      kept as long: where placement puts replicas.
    - model_load: per model and resolution interval (10 s), summed over nodes as reports
      arrive (a late one still lands in its interval), kept `retention_s`. This is what
      the autoscaler reads: its forecast needs a week and a day of history for every
      component (a week for the level and weekly profile, a day more for the trend), and
      a second visit of each weekly slot makes that profile much better, so the default
      is 15 days: ~130k rows per model (~15 MB).

    A report is split over the resolution intervals it overlaps, counters pro rata, so
    an unaligned or longer report lands where it happened. Writes are WAL with
    synchronous=NORMAL: a crash of the scheduler loses nothing committed; a power loss
    may lose the last commits, already acknowledged (seconds of history), for an fsync
    less per report.
    Thread-safe (one lock); the server calls it from one worker thread.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        resolution_s: float = 10.0,
        retention_s: float = 15 * DAY_S,
        node_retention_s: float = DAY_S,
        prune_every_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ):
        if resolution_s <= 0:
            raise ValueError("resolution_s must be > 0")
        self.path, self.resolution_s = Path(path), resolution_s
        self.retention_s, self.node_retention_s = retention_s, node_retention_s
        self.prune_every_s, self.clock = prune_every_s, clock
        self._lock = threading.Lock()
        self._next_prune = 0.0
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._db:
            self._db.executescript(_SCHEMA)
            meta = "SELECT value FROM meta WHERE key = 'resolution_s'"
            kept = self._db.execute(meta).fetchone()
            if kept is None:
                keep = "INSERT INTO meta VALUES ('resolution_s', ?)"
                self._db.execute(keep, (str(resolution_s),))
        if kept is not None and float(kept[0]) != resolution_s:
            self._db.close()
            raise ValueError(
                f"{self.path}: history kept at {kept[0]} s resolution, not {resolution_s}"
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _index(self, t: float) -> int:
        return math.floor(t / self.resolution_s + EPS)

    def _split(self, start: float, length: float) -> list[tuple[int, float, float]]:
        """(interval index, share of the report, seconds covered) for each interval hit."""
        res = self.resolution_s
        k = self._index(start)
        if length <= 0 or k >= math.floor((start + length) / res - EPS):  # the usual case
            return [(k, 1.0, max(length, 0.0))]
        out, end = [], start + length
        while k * res < end - EPS * res:
            covered = min(end, (k + 1) * res) - max(start, k * res)
            if covered > EPS * res:
                out.append((k, covered / length, covered))
            k += 1
        return out

    def add(self, node_id: str, report: IntervalReport) -> int:
        """Stores a node's report; returns how many models were new (0 for a resend).

        A report older than the node retention is refused (0): past it a resend could
        no longer be recognized and would count twice.
        """
        if not node_id or not math.isfinite(report.start):
            raise ValueError("a report needs a node id and a start time")
        if not 0 <= report.interval_s <= max(MAX_INTERVAL_S, self.resolution_s):
            raise ValueError(f"interval of {report.interval_s} s")
        for model, f in report.models.items():
            numbers = [getattr(f, name) for name in _NUMBERS]
            numbers += [x for counts in f.by_version.values() for x in counts]
            numbers += list(f.origins.values())
            if not model or not all(math.isfinite(x) and 0 <= x < 2**62 for x in numbers):
                raise ValueError(f"model {model!r}: figures out of range")
            if any(len(label) > 256 for label in [*f.by_version, *f.origins]):
                raise ValueError(f"model {model!r}: version or origin over 256 characters")
        now = self.clock()
        if report.start < now - min(self.node_retention_s, self.retention_s):
            return 0
        parts = self._split(report.start, report.interval_s)
        new = 0
        with self._lock, self._db:
            for model, f in report.models.items():
                cur = self._db.execute(
                    "INSERT OR IGNORE INTO node_load VALUES "
                    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        node_id, model, report.start, report.interval_s,
                        f.wall_s, f.queue_s, f.queued, f.requests, f.errors,
                        f.out_of_capacity, f.prompt_tokens, f.completion_tokens,
                        f.permits_total, f.permits_free, f.replicas, f.version,
                    ),
                )  # fmt: skip
                if cur.rowcount == 0:
                    continue  # a resend: stored already
                new += 1
                self._db.executemany(
                    "INSERT OR IGNORE INTO version_load VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (model, report.start, node_id, version, int(req), int(err))
                        for version, (req, err) in f.by_version.items()
                    ],
                )
                self._db.executemany(
                    "INSERT OR IGNORE INTO origin_load VALUES (?, ?, ?, ?, ?)",
                    [
                        (model, report.start, node_id, origin, int(req))
                        for origin, req in f.origins.items()
                    ],
                )
                counters = (
                    f.wall_s, f.queue_s, f.queued, f.requests, f.errors,
                    f.out_of_capacity, f.prompt_tokens, f.completion_tokens,
                )  # fmt: skip
                gauges = (1, f.replicas, f.permits_total, f.permits_free)
                self._db.executemany(
                    _UPSERT,
                    [
                        (model, k, *(g * secs for g in gauges), *(c * share for c in counters))
                        for k, share, secs in parts
                    ],
                )
            if now >= self._next_prune:
                self._prune(now)
        return new

    def prune(self, now: float | None = None) -> None:
        """Drops what is past retention (also done by `add`, every prune_every_s)."""
        with self._lock, self._db:
            self._prune(self.clock() if now is None else now)

    def _prune(self, now: float) -> None:
        self._next_prune = now + self.prune_every_s
        node_oldest = now - self.node_retention_s
        self._db.execute("DELETE FROM node_load WHERE start < ?", (node_oldest,))
        oldest = self._index(now - self.retention_s)
        for (model,) in self._db.execute(_MODELS).fetchall():
            self._db.execute("DELETE FROM model_load WHERE model = ? AND k < ?", (model, oldest))
            for table in ("version_load", "origin_load"):  # keyed by model first
                self._db.execute(
                    f"DELETE FROM {table} WHERE model = ? AND start < ?", (model, node_oldest)
                )

    def models(self) -> list[str]:
        """Models with any history, sorted."""
        with self._lock:
            return [m for (m,) in self._db.execute(_MODELS)]

    def version_counts(self, model: str, since: float) -> dict[str, tuple[int, int]]:
        """Admitted requests and errors per version of `model` in the reports starting
        at or after `since` (kept as long as the node reports): what a rollout is judged
        on."""
        with self._lock:
            rows = self._db.execute(
                "SELECT version, SUM(requests), SUM(errors) FROM version_load "
                "WHERE model = ? AND start >= ? GROUP BY version",
                (model, since),
            ).fetchall()
        return {version: (int(req), int(err)) for version, req, err in rows}

    def demand_by_origin(self, model: str, since: float) -> dict[str, int]:
        """Requests for `model` by the location of the edge they came through, in the
        reports starting at or after `since`: where placement should put its replicas."""
        with self._lock:
            rows = self._db.execute(
                "SELECT origin, SUM(requests) FROM origin_load "
                "WHERE model = ? AND start >= ? GROUP BY origin",
                (model, since),
            ).fetchall()
        return {origin: int(n) for origin, n in rows}

    def series(
        self, model: str, since: float, until: float, step: float | None = None
    ) -> list[SeriesPoint]:
        """The model's steps starting in [since, until), on a grid of multiples of `step`
        (default and minimum: the resolution; it must be a multiple of it). Steps without
        any report are left out: no report is not zero load."""
        res = self.resolution_s
        step = res if step is None else step
        ratio = round(step / res)
        if ratio < 1 or abs(ratio * res - step) > EPS * res:
            raise ValueError(f"step {step} s is not a multiple of the resolution ({res} s)")
        first = math.ceil(since / step - EPS)
        last = math.ceil(until / step - EPS)
        sums = ", ".join(f"SUM({c})" for c in _MODEL_COLS)
        with self._lock:
            rows = self._db.execute(
                f"SELECT k / ? AS g, COUNT(*), {sums} FROM model_load "
                "WHERE model = ? AND k >= ? AND k < ? GROUP BY g ORDER BY g",
                (ratio, model, first * ratio, last * ratio),
            ).fetchall()
        out = []
        for g, n, *v in rows:
            gauges = [x / (n * res) for x in v[:_GAUGES]]
            out.append(SeriesPoint(g * step, step, n, *gauges, *v[_GAUGES:]))
        return out


# -- history -> autoscaler -------------------------------------------------------------


def to_telemetry(point: SeriesPoint) -> Telemetry:
    """One step of history as the autoscaler's report (t is the step's end).

    busy_s is the wall time per permit (x replicas / permits): an instance runs up to
    `permits` requests at once, so their summed wall time over permits x interval is its
    busy fraction, which is what `Telemetry.utilization` takes busy_s / (interval x
    replicas) to be. Replicas and permits are time averages, so they may be fractional.
    """
    busy = point.wall_s
    if point.permits_total > 0 and point.replicas > 0:
        busy = point.wall_s * point.replicas / point.permits_total
    offered = point.requests + point.out_of_capacity
    return Telemetry(
        t=point.t + point.step_s,
        replicas=point.replicas,  # type: ignore[arg-type]  # a time average
        busy_s=busy,
        permits_free=point.permits_free,  # type: ignore[arg-type]
        permits_total=point.permits_total,  # type: ignore[arg-type]
        queue_s=point.queue_s / offered if offered else 0.0,
        oc_errors=round(point.out_of_capacity),
        requests=round(point.requests),
        tokens=round(point.prompt_tokens + point.completion_tokens),
        interval_s=point.step_s,
    )


def telemetry_series(
    store: HistoryStore, model: str, since: float, until: float, step: float | None = None
) -> list[Telemetry]:
    """The model's history as autoscaler reports: what `Autoscaler.observe` takes."""
    return [to_telemetry(p) for p in store.series(model, since, until, step)]


def demand_series(
    store: HistoryStore,
    model: str,
    since: float,
    until: float,
    config: AutoscaleConfig | None = None,
) -> list[tuple[float, float]]:
    """(interval start, demand in replicas) per resolution interval, as the autoscaler
    would have computed it live (its demand_of, with the same config)."""
    scratch = ReactivePolicy(config)
    return [
        (r.t - r.interval_s, scratch.demand_of(r))
        for r in telemetry_series(store, model, since, until)
    ]


def demand_buckets(
    store: HistoryStore,
    model: str,
    since: float,
    until: float,
    config: AutoscaleConfig | None = None,
) -> list[tuple[float, float]]:
    """(bucket start, mean demand) per forecast bucket: `Autoscaler.preload`'s input.

    A bucket is the mean of the intervals that reported (as `forecast.Bucketer` does
    live); buckets without any are left out (gaps). Only buckets whole inside
    [since, until): pass until = now and the bucket in progress is left to the live
    reports, so the forecaster never sees one twice.
    """
    cfg = config or AutoscaleConfig()
    step = cfg.forecast.step_s
    sums: dict[int, list[float]] = {}
    for t, demand in demand_series(store, model, since, until, cfg):
        acc = sums.setdefault(math.floor(t / step + EPS), [0.0, 0])
        acc[0] += demand
        acc[1] += 1
    return [
        (b * step, total / n)
        for b, (total, n) in sorted(sums.items())
        if b * step >= since - EPS and (b + 1) * step <= until + EPS
    ]
