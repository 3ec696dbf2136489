"""Demand forecast up to an hour ahead, so replicas start before the load arrives.

A cold start takes minutes: a purely reactive autoscaler is always that late on a ramp.
Most inference traffic repeats by time of day and day of week, so the forecast is a
seasonal model over a regular series of buckets (say 5-minute means of the 10 s reports),
in logs so that its parts multiply: a weekend at 40% of a weekday and 5%-a-week growth are
one number each, whatever the traffic's size.

    log y = level + trend + daily[time of day] + weekly[hour of week] + short-term

- level: the mean of the last whole days, up to a week, so it does not chase the weekly
  cycle itself (a learned level absorbs every weekend and gets Monday morning wrong);
- trend: the level's change over the last day, damped over the horizon;
- daily, weekly: profiles learned by exponential smoothing of the residual per slot
  (Holt-Winters style): a running mean over a slot's first visits, then an EWMA;
- short-term: a smoothed recent residual ("busier than usual today"), decaying over the
  horizon; it only forecasts, it does not feed back into what the profiles learn.

Each update is O(1) (amortized: the level's running sum is refreshed once a week,
and once a day in the first week). A residual beyond a few times its usual size is clipped before
anything learns from it, so one spike barely moves a profile. A missing bucket is filled
with its forecast (nothing learned from it); a time of day not seen yet (under a day of
history) is forecast at the recent level.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DAY_S = 86_400
WEEK_S = 7 * DAY_S


class Profile:
    """A seasonal profile, one value per slot, kept zero-mean in O(1) per update.

    The mean is held as a shift applied on read: adding delta to one slot raises the
    shift by delta/n, which the caller adds to its level, so no forecast changes.
    """

    def __init__(self, slots: int):
        self.raw = [0.0] * slots
        self.visits = [0] * slots
        self.shift = 0.0

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, slot: int) -> float:
        return self.raw[slot] - self.shift

    def add(self, slot: int, delta: float) -> float:
        """Adds delta to one slot; returns the change of the mean, for the level to take."""
        self.raw[slot] += delta
        self.visits[slot] += 1
        moved = delta / len(self.raw)
        self.shift += moved
        return moved


@dataclass(frozen=True)
class ForecastConfig:
    """Defaults suit 5-minute buckets of a demand series in replica units."""

    step_s: float = 300.0
    weekly_slot_s: float = 3600.0  # the weekly profile's resolution: hour of the week
    gamma_daily: float = 0.15  # a daily slot's gain floor, per day (memory ~ a week)
    gamma_weekly: float = 0.1  # a weekly slot's gain floor, per bucket it covers
    rho: float = 0.98  # the short-term deviation's decay per bucket (x0.78 an hour)
    dev_gain: float = 0.2  # the short-term deviation: EWMA of recent residuals
    phi: float = 0.99  # trend damping per bucket
    clip: float = 4.0  # residuals beyond clip x their mean size are outliers, clipped
    scale_gain: float = 0.05  # EWMA gain of the residuals' mean absolute size
    floor: float = 0.05  # added before the log, so that zero demand is defined


class SeasonalForecaster:
    """Level x damped trend x daily x weekly x short-term, fitted online."""

    def __init__(self, config: ForecastConfig | None = None):
        self.cfg = cfg = config or ForecastConfig()
        self.per_day = round(DAY_S / cfg.step_s)
        self.per_week = 7 * self.per_day
        self.daily = Profile(self.per_day)
        self.weekly = Profile(round(WEEK_S / cfg.weekly_slot_s))
        self.bias = 0.0  # the profiles' means (their shifts), part of the level
        self.trend = 0.0  # log change per bucket
        self.dev = 0.0  # short-term deviation, log
        self.scale = 0.1  # mean absolute residual, log (robust: of clipped residuals)
        self.last: int | None = None  # index of the last bucket observed (or filled)
        self.observed = 0
        self.outliers = 0
        self._ring = [0.0] * (self.per_week + 1)  # the last week's log values, by _n
        self._n = 0  # buckets pushed, filled ones included
        self._win = 0  # how many of the newest the level averages
        self._sum = 0.0
        self._levels: deque[float] = deque(maxlen=self.per_day + 1)

    # -- slots and parts -----------------------------------------------------------------

    def bucket(self, t: float) -> int:
        return math.floor(t / self.cfg.step_s)

    def _d(self, k: int) -> int:
        return k % self.per_day

    def _w(self, k: int) -> int:
        return math.floor(k * self.cfg.step_s / self.cfg.weekly_slot_s) % len(self.weekly)

    @property
    def recent(self) -> float:
        """The mean log demand of the last whole days, up to a week (under a day: all)."""
        return self._sum / self._win if self._win else 0.0

    @property
    def level(self) -> float:
        """The log level: the recent mean plus the profiles' means."""
        return self.recent + self.bias

    def _seen(self, k: int) -> bool:
        return self.daily.visits[self._d(k)] > 0

    def _base(self, k: int) -> float:
        """The seasonal forecast of bucket k at today's level (log); the level if unseen."""
        if not self._seen(k):
            return self.recent
        return self.level + self.daily[self._d(k)] + self.weekly[self._w(k)]

    # -- updates -------------------------------------------------------------------------

    def observe(self, t: float, y: float) -> bool:
        """Feeds the bucket starting at t (its mean demand); returns whether it was an outlier.

        Buckets come in order; a repeated or older one is ignored.
        """
        k = self.bucket(t)
        if self.last is not None and k <= self.last:
            return False
        if self.last is not None:
            self._fill(k - self.last - 1)
        self.last = k
        self.observed += 1
        x = math.log(max(y, 0.0) + self.cfg.floor)
        if self._n == 0:
            self._push(x)
            return False
        return self._learn(k, x)

    def _learn(self, k: int, x: float) -> bool:
        cfg = self.cfg
        seen, base = self._seen(k), self._base(k)
        residual = x - base
        limit = cfg.clip * max(self.scale, 0.01)
        r = max(-limit, min(limit, residual))
        outlier = seen and abs(residual) > limit
        if seen:
            self.scale += cfg.scale_gain * (abs(r) - self.scale)
        self.dev = cfg.rho * self.dev + cfg.dev_gain * (r - cfg.rho * self.dev)
        d, w = self._d(k), self._w(k)
        if seen:
            self.bias += self.daily.add(d, max(cfg.gamma_daily, 1 / (self.daily.visits[d] + 1)) * r)
        else:  # first visit: the slot takes whatever the level does not explain
            full = x - (self.level + self.daily[d] + self.weekly[w])
            self.bias += self.daily.add(d, full)
        if self._n >= self.per_day:  # a weekly slot learns once the daily shape exists
            gain = max(cfg.gamma_weekly, 1 / (self.weekly.visits[w] + 1))
            self.bias += self.weekly.add(w, gain * r)
        self._push(base + r if seen else x)
        self.outliers += outlier
        return outlier

    def _fill(self, missing: int) -> None:
        """Missing buckets: their forecasts keep the level's window whole; nothing learns."""
        for j in range(min(missing, self.per_week + 1)):
            self._push(self._base(self.last + 1 + j))
            self.dev *= self.cfg.rho

    def _push(self, x: float) -> None:
        """Appends a log value to the level's window: whole days, up to a week, O(1)."""
        ring, size = self._ring, len(self._ring)
        ring[self._n % size] = x
        self._n += 1
        n, days = self._n, min(7, self._n // self.per_day)
        win = days * self.per_day if days else n
        if win == self._win + 1:  # still growing (the first day)
            self._sum += x
        elif win == self._win and n % self.per_week:
            self._sum += x - ring[(n - 1 - win) % size]
        else:  # a new whole day joins the window, or the weekly refresh of the running sum
            self._sum = sum(ring[i % size] for i in range(n - win, n))
        self._win = win
        self._levels.append(self.level)
        if n >= self.per_week + self.per_day:  # a week's level a day ago exists
            self.trend = (self._levels[-1] - self._levels[0]) / self.per_day

    # -- forecasts -----------------------------------------------------------------------

    def at(self, h: int) -> float:
        """Forecast of the bucket h steps after the last one observed (h >= 1), >= 0."""
        if self.last is None:
            return 0.0
        log_y = sum(self.components(h).values())
        return max(0.0, math.exp(log_y) - self.cfg.floor)

    def predict(self, horizon: int) -> list[float]:
        """Forecasts of the next `horizon` buckets."""
        return [self.at(h) for h in range(1, horizon + 1)]

    def components(self, h: int) -> dict[str, float]:
        """The log forecast h buckets ahead, by part (exp of a part is its factor)."""
        if self.last is None:
            return {}
        k, cfg = self.last + h, self.cfg
        short = self.dev * cfg.rho**h
        if not self._seen(k):  # cold start: the recent level
            return {"level": self.recent, "short_term": short}
        return {
            "level": self.level,
            "trend": self.trend * _damped_sum(cfg.phi, h),
            "daily": self.daily[self._d(k)],
            "weekly": self.weekly[self._w(k)],
            "short_term": short,
        }

    def peak(self, t0: float, t1: float) -> float | None:
        """The highest forecast bucket overlapping [t0, t1]; None before any observation."""
        if self.last is None:
            return None
        first = max(self.bucket(t0) - self.last, 1)
        last = max(self.bucket(t1) - self.last, first)
        return max(self.at(h) for h in range(first, last + 1))

    @property
    def history_s(self) -> float:
        return self.observed * self.cfg.step_s


def _damped_sum(phi: float, n: int) -> float:
    """phi + phi^2 + ... + phi^n: how far a damped trend carries over n buckets."""
    if phi == 1.0:
        return float(n)
    return phi * (1.0 - phi**n) / (1.0 - phi)


class Bucketer:
    """Averages timestamped samples (e.g. 10 s reports) into regular buckets.

    A bucket is the mean of the samples it got, so a few lost reports do not bias it;
    a bucket with none is not emitted (the forecaster sees a gap).
    """

    def __init__(self, step_s: float = 300.0):
        self.step_s = step_s
        self._k: int | None = None
        self._sum = 0.0
        self._n = 0

    def add(self, t: float, value: float) -> tuple[float, float] | None:
        """Adds a sample taken over [t, ...); returns (start, mean) of a bucket it closed."""
        k = math.floor(t / self.step_s)
        if self._k is not None and k < self._k:
            return None  # late: its bucket is closed
        done = None
        if self._k is not None and k > self._k:
            done = (self._k * self.step_s, self._sum / self._n)
            self._sum, self._n = 0.0, 0
        self._k = k
        self._sum += value
        self._n += 1
        return done
