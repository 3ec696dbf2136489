"""Replicas per model: enough for the demand now and for what the forecast says is coming.

A replica takes a cold start (minutes) to become ready, so scaling only on what is seen
is late on every ramp. `Autoscaler` asks for the larger of
- the reactive need: the last minute's demand over a target utilization (70% busy), and
- the forecast need: the peak forecast demand over the next cold start (plus a bucket),
  raised by the forecast's usual error, over the same target;
then damps it: up at once, down only when utilization has stayed below a lower
threshold (hysteresis) for a delay, to the largest need seen meanwhile. Out-of-capacity
errors bypass all of that: the replicas those requests would have needed are asked for
as the report arrives. `ReactivePolicy` is the same without the forecast: the baseline.

Demand is counted in replicas' worth of work: ready replicas x utilization, where
utilization is the busiest of wall-time busy fraction and permits in use (a queue wait
over the limit counts as full), scaled up by the share of requests refused for capacity.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from scheduler.forecast import Bucketer, ForecastConfig, SeasonalForecaster


@dataclass(frozen=True)
class Telemetry:
    """One model's report over the interval_s seconds up to t (10 s in production)."""

    t: float
    replicas: int  # ready replicas that reported
    busy_s: float  # inference wall time, summed over those replicas
    permits_free: int
    permits_total: int
    queue_s: float = 0.0  # mean queue wait of the interval's requests
    oc_errors: int = 0  # requests refused: out of capacity
    requests: int = 0  # requests admitted
    tokens: int = 0
    interval_s: float = 10.0

    def utilization(self, max_queue_s: float) -> float:
        """The busiest resource's share: wall time, permits, or full when the queue is long."""
        if self.replicas <= 0:
            return 0.0
        busy = self.busy_s / (self.interval_s * self.replicas)
        permits = 1.0 - self.permits_free / self.permits_total if self.permits_total else 0.0
        queued = 1.0 if self.queue_s > max_queue_s else 0.0
        return max(busy, permits, queued)

    def refused_factor(self) -> float:
        """Offered over admitted requests: how much more work there was than was done."""
        if not self.oc_errors:
            return 1.0
        return (self.requests + self.oc_errors) / max(self.requests, 1)


@dataclass(frozen=True)
class AutoscaleConfig:
    target_util: float = 0.7  # scale up when demand needs more replicas than this allows
    scale_down_util: float = 0.5  # hysteresis: scale down only below this utilization
    scale_down_delay_s: float = 600.0  # ... sustained this long
    min_replicas: int = 1
    max_replicas: int = 64
    cold_start_s: float = 180.0  # a new replica is ready this long after it is asked for
    window_s: float = 60.0  # the reactive demand: the mean over this many seconds
    max_queue_s: float = 2.0  # a longer mean queue wait counts as fully busy
    forecast_margin: float = 1.0  # x the forecast's mean error, added to its peak
    forecast: ForecastConfig = field(default_factory=ForecastConfig)

    @property
    def lead_s(self) -> float:
        """How far ahead the forecast need looks: a cold start and the bucket it ends in."""
        return self.cold_start_s + self.forecast.step_s


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str  # hold | up:reactive | up:forecast | up:capacity | down | wait-down | no-data
    demand: float  # the reactive demand, replicas' worth
    forecast: float | None  # the forecast peak over the lead time, margin included


class Autoscaler:
    """Desired replicas for one model, from its telemetry; deterministic given the clock."""

    uses_forecast = True

    def __init__(
        self,
        config: AutoscaleConfig | None = None,
        clock: Callable[[], float] = time.time,
        replicas: int | None = None,
    ):
        self.cfg = cfg = config or AutoscaleConfig()
        self.clock = clock
        self.replicas = self._clamp(cfg.min_replicas if replicas is None else replicas)
        self.forecaster = SeasonalForecaster(cfg.forecast) if self.uses_forecast else None
        self._bucketer = Bucketer(cfg.forecast.step_s)
        self._recent: deque[tuple[float, float]] = deque()  # (t, demand)
        self._last: Telemetry | None = None
        self._last_demand = 0.0
        self._work_per_request = 0.0  # busy seconds per request, for a model at zero
        self._low_since: float | None = None  # since when utilization has been low
        self._needs: deque[tuple[float, int]] = deque()  # (t, need) over the down delay
        self.events = {"up": 0, "down": 0, "capacity": 0}

    # -- input ---------------------------------------------------------------------------

    def observe(self, report: Telemetry) -> Decision | None:
        """Takes one report; one with out-of-capacity errors is acted on at once."""
        demand = self.demand_of(report)
        self._recent.append((report.t, demand))
        self._last, self._last_demand = report, demand
        if self.forecaster is not None:
            closed = self._bucketer.add(report.t - report.interval_s, demand)
            if closed is not None:
                self.forecaster.observe(*closed)
        return self.decide() if report.oc_errors else None

    def preload(self, buckets: Iterable[tuple[float, float]]) -> None:
        """Seeds the forecast from stored history: (bucket start, mean demand) in order."""
        if self.forecaster is not None:
            for t, demand in buckets:
                self.forecaster.observe(t, demand)

    def demand_of(self, report: Telemetry) -> float:
        """Replicas' worth of work offered in a report, refused requests included."""
        if report.requests:
            per = report.busy_s / report.requests
            self._work_per_request += 0.1 * (per - self._work_per_request)
        if report.replicas <= 0:  # none to measure: refused requests x their usual work
            if not report.oc_errors:
                return 0.0
            work = report.oc_errors * self._work_per_request / report.interval_s
            return max(work, self.cfg.target_util)  # at least one replica's worth
        served = report.replicas * report.utilization(self.cfg.max_queue_s)
        return served * report.refused_factor()

    # -- decisions -----------------------------------------------------------------------

    def decide(self) -> Decision:
        """The desired replicas now; call it after each report (or on a timer)."""
        now, cfg = self.clock(), self.cfg
        while self._recent and self._recent[0][0] <= now - cfg.window_s:
            self._recent.popleft()
        predicted = self.forecast_peak(now)
        if not self._recent:  # no telemetry is no evidence of low demand: hold
            return Decision(self.replicas, "no-data", 0.0, predicted)
        demand = sum(d for _, d in self._recent) / len(self._recent)
        need = self._need(max(demand, predicted or 0.0))
        capacity = self._capacity_need(now)
        if capacity > self.replicas:
            return self._set(capacity, "up:capacity", demand, predicted)
        if need > self.replicas:
            reason = "up:forecast" if need > self._need(demand) else "up:reactive"
            return self._set(need, reason, demand, predicted)
        self._needs.append((now, need))
        while self._needs[0][0] < now - cfg.scale_down_delay_s:
            self._needs.popleft()
        low = max(demand, predicted or 0.0) < cfg.scale_down_util * self.replicas
        if not low:
            self._low_since = None
            return Decision(self.replicas, "hold", demand, predicted)
        if self._low_since is None:
            self._low_since = now
        target = max(n for _, n in self._needs)  # the most needed over the delay
        if now - self._low_since >= cfg.scale_down_delay_s and target < self.replicas:
            return self._set(target, "down", demand, predicted)
        return Decision(self.replicas, "wait-down", demand, predicted)

    def forecast_peak(self, now: float) -> float | None:
        """The peak forecast demand over the lead time, raised by the forecast's usual error."""
        f = self.forecaster
        if f is None or f.last is None:
            return None
        peak = f.peak(now, now + self.cfg.lead_s)
        return None if peak is None else peak * math.exp(self.cfg.forecast_margin * f.scale)

    def _need(self, demand: float) -> int:
        return self._clamp(math.ceil(demand / self.cfg.target_util - 1e-9))

    def _capacity_need(self, now: float) -> int:
        """After refusals: the last report's demand at target, and one more than was ready."""
        last = self._last
        if last is None or not last.oc_errors or last.t <= now - self.cfg.window_s:
            return 0
        return self._clamp(max(self._need(self._last_demand), last.replicas + 1))

    def _set(self, replicas: int, reason: str, demand: float, predicted: float | None):
        replicas = self._clamp(replicas)
        if replicas != self.replicas:
            kind = "capacity" if reason == "up:capacity" else reason.split(":")[0]
            self.events[kind] += 1
            self.replicas = replicas
        self._low_since = None
        return Decision(replicas, reason, demand, predicted)

    def _clamp(self, n: int) -> int:
        return max(self.cfg.min_replicas, min(self.cfg.max_replicas, n))


class ReactivePolicy(Autoscaler):
    """The baseline: the same thresholds, delays and capacity rule, without the forecast."""

    uses_forecast = False
