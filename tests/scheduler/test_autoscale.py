"""The forecast learns repeating traffic; the autoscaler scales ahead of it, calmly."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from scheduler.autoscale import AutoscaleConfig, Autoscaler, ReactivePolicy, Telemetry
from scheduler.forecast import Bucketer, SeasonalForecaster

STEP = 300
DAY = 86_400
MONDAY = 1_704_067_200  # 2024-01-01 00:00 UTC


def pattern(t: float, growth_per_week: float = 0.0) -> float:
    """Business hours with a lunch dip, 40% on weekends, optional growth."""
    h, dow = (t % DAY) / 3600, int((t - MONDAY) // DAY) % 7
    y = 1 + 8 * math.exp(-(((h - 10.5) / 2) ** 2)) + 6 * math.exp(-(((h - 15.5) / 2) ** 2))
    return y * (0.4 if dow >= 5 else 1.0) * (1 + growth_per_week) ** ((t - MONDAY) / (7 * DAY))


def replay(
    f: SeasonalForecaster,
    weeks: float,
    truth: Callable[[float], float],
    noise: float = 0.05,
    skip: Callable[[int], bool] = lambda i: False,
    spike: Callable[[int], float] = lambda i: 1.0,
    seed: int = 1,
) -> float:
    """Feeds 5-minute buckets; returns the hour-ahead MAPE over the last week."""
    rng = random.Random(seed)
    n, errors, pending = int(weeks * 7 * DAY / STEP), [], {}
    for i in range(n):
        t = MONDAY + i * STEP
        if i in pending and i >= n - 7 * DAY // STEP:
            errors.append(abs(pending.pop(i) - truth(t)) / truth(t))
        if skip(i):
            continue
        f.observe(t, truth(t) * spike(i) * (1 + rng.gauss(0, noise)))
        pending[i + 12] = f.at(12)
    return sum(errors) / len(errors)


def test_forecast_learns_daily_and_weekly_cycles():
    assert replay(SeasonalForecaster(), 3, pattern) < 0.06  # after 2 weeks
    f = SeasonalForecaster()
    assert replay(f, 4, pattern) < 0.03  # after 3 weeks
    parts = f.components(1)
    assert set(parts) == {"level", "trend", "daily", "weekly", "short_term"}


def test_forecast_copes_with_gaps_and_a_spike():
    rng = random.Random(5)
    lost = {i for i in range(4 * 2016) if rng.random() < 0.1} | set(range(3000, 3030))
    spike_at = 2 * 2016 + 132  # a Wednesday, 11:00, week 3: five times the load for 15 min
    f = SeasonalForecaster()
    mape = replay(
        f, 4, pattern, skip=lambda i: i in lost, spike=lambda i: 5.0 if 0 <= i - spike_at < 3 else 1
    )
    assert mape < 0.04
    assert f.outliers >= 3
    clean = SeasonalForecaster()
    replay(clean, 4, pattern, skip=lambda i: i in lost)
    slot = clean._d(spike_at)  # the spike's time of day: barely moved
    assert abs(f.daily[slot] - clean.daily[slot]) < 0.05


def test_forecast_tracks_a_trend():
    def growing(t):
        return pattern(t, growth_per_week=0.3)

    f = SeasonalForecaster()
    assert replay(f, 4, growing) < 0.04
    per_bucket = math.log(1.3) / (7 * DAY / STEP)
    assert 0.5 * per_bucket < f.trend < 1.5 * per_bucket


def test_forecast_cold_start_is_the_recent_level():
    f = SeasonalForecaster()
    assert f.at(1) == 0.0 and f.peak(0, 600) is None
    for i in range(12):  # an hour at 5 replicas' worth
        f.observe(MONDAY + i * STEP, 5.0)
    assert f.predict(12) == pytest.approx([5.0] * 12, rel=0.01)


def test_bucketer_averages_and_leaves_gaps():
    b = Bucketer(60)
    assert b.add(0, 1.0) is None and b.add(30, 3.0) is None
    assert b.add(60, 5.0) == (0, 2.0)
    assert b.add(200, 1.0) == (60, 5.0)  # the bucket at 120 got nothing: not emitted
    assert b.add(50, 9.0) is None  # late


# -- the autoscaler, on a simulated clock -----------------------------------------------


class Sim:
    """One model: demand (replicas' worth) against ready replicas, a minute per report."""

    def __init__(self, policy: type[Autoscaler], demand, start: float, **cfg):
        self.now = start
        self.cfg = AutoscaleConfig(**cfg)
        self.scaler = policy(self.cfg, clock=lambda: self.now)
        self.demand, self.ready, self.starting = demand, self.scaler.replicas, []
        self.ooc_s = 0.0
        self.changes: list[tuple[float, int]] = []

    def step(self) -> None:
        self.ready += sum(1 for s in self.starting if s <= self.now)
        self.starting = [s for s in self.starting if s > self.now]
        d = self.demand(self.now)
        served = min(d, self.ready)
        self.ooc_s += 60 * (d > self.ready)
        self.now += 60
        self.scaler.observe(telemetry(self.now, self.ready, served, d - served))
        want, have = self.scaler.decide().replicas, self.ready + len(self.starting)
        if want != have:
            self.changes.append((self.now, want))
        if want > have:
            self.starting += [self.now + self.cfg.cold_start_s] * (want - have)
        elif want < have:
            drop = min(have - want, len(self.starting))
            self.starting = self.starting[: len(self.starting) - drop]
            self.ready -= have - want - drop

    def run(self, seconds: float) -> Sim:
        for _ in range(int(seconds // 60)):
            self.step()
        return self


def telemetry(t: float, replicas: int, served: float, refused: float, s: int = 60) -> Telemetry:
    """A report over s seconds at 10 requests/s per replica's worth of work."""
    return Telemetry(
        t=t,
        replicas=replicas,
        busy_s=s * served,
        permits_free=8 * replicas,
        permits_total=8 * replicas,
        oc_errors=round(10 * s * refused),
        requests=round(10 * s * served),
        interval_s=s,
    )


def ramp(t: float) -> float:
    """A 9:00 rush every weekday: 1 replica's worth at night, 8 from 9:00 to 17:00."""
    h, dow = (t % DAY) / 3600, int((t - MONDAY) // DAY) % 7
    return 8.0 if 9 <= h < 17 and dow < 5 else 1.0


def test_scales_up_ahead_of_a_predictable_ramp():
    day15 = MONDAY + 14 * DAY  # a Monday, after two weeks of history
    history = [(t, ramp(t)) for t in range(MONDAY, day15 + 8 * 3600, STEP)]
    first_up = {}
    for policy in (Autoscaler, ReactivePolicy):
        sim = Sim(policy, ramp, day15 + 8 * 3600)
        sim.scaler.preload(history)
        sim.run(2 * 3600)
        first_up[policy] = next(t for t, n in sim.changes if n > 2)
        if policy is Autoscaler:
            assert first_up[policy] <= day15 + 9 * 3600 - 180  # ready when the rush starts
            assert sim.ooc_s == 0
        else:
            assert sim.ooc_s >= 180  # a cold start late, at least
    assert first_up[Autoscaler] < first_up[ReactivePolicy]


@pytest.mark.parametrize("policy", [Autoscaler, ReactivePolicy])
def test_no_oscillation_on_noisy_steady_load(policy):
    rng = random.Random(3)
    sim = Sim(policy, lambda t: 4.0 * (1 + rng.gauss(0, 0.1)), MONDAY).run(8 * 3600)
    assert len(sim.changes) <= 3  # settling in, then holding: never down and up again
    assert [n for _, n in sim.changes] == sorted(n for _, n in sim.changes)


def test_scale_down_waits_for_sustained_low_need():
    def drop(t):
        return 6.0 if t < MONDAY + 3600 else 1.0

    sim = Sim(ReactivePolicy, drop, MONDAY).run(3600)
    peak = sim.scaler.replicas
    assert peak >= 9
    sim.run(540)  # 9 low minutes: not yet
    assert sim.scaler.replicas == peak
    sim.run(180)
    assert sim.scaler.replicas == 2  # then at once to what the last 10 minutes needed


def test_min_and_max_replicas():
    sim = Sim(ReactivePolicy, lambda t: 100.0, MONDAY, max_replicas=5).run(1800)
    assert sim.scaler.replicas == 5
    sim = Sim(ReactivePolicy, lambda t: 0.0, MONDAY, min_replicas=2).run(3600)
    assert sim.scaler.replicas == 2 and not sim.changes


def test_out_of_capacity_errors_scale_up_at_once():
    now = [MONDAY + 600.0]
    scaler = ReactivePolicy(AutoscaleConfig(), clock=lambda: now[0], replicas=4)
    for _ in range(6):  # a quiet spell: waiting to scale down
        now[0] += 10
        assert scaler.observe(telemetry(now[0], 4, 0.5, 0.0, s=10)) is None
    assert scaler.decide().reason == "wait-down"
    now[0] += 10
    burst = telemetry(now[0], 4, 4.0, 2.0, s=10)  # saturated, a third of requests refused
    decision = scaler.observe(burst)
    assert decision is not None and decision.reason == "up:capacity"
    assert decision.replicas >= math.ceil(6.0 / 0.7)
    now[0] += 10
    again = scaler.observe(telemetry(now[0], 4, 4.0, 2.0, s=10))  # still starting: no more
    assert again is not None and again.replicas == decision.replicas
    assert scaler.events["capacity"] == 1
