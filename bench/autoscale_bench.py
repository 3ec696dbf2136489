"""Forecast autoscaling against the reactive baseline, on one synthetic trace, replayed.

Several models' demand (in replicas' worth of work) over 3 weeks of history and 1
measured week, at 10 s: daily and weekly cycles per model (business hours, evenings, a
sharp 9:00 ramp, a nightly batch), growth or decline, day-to-day variation, correlated
noise, Poisson request counts and random spikes. Both policies replay the same trace on a
simulated clock: 10 s demand aggregated into 1-minute telemetry reports (busy seconds,
permits, queue time, refused requests), one decision per report, and a replica asked for
becomes ready only after a cold start (3 min). Measured over the last week:
- the forecast's error an hour ahead (MAPE of 5-minute buckets, spike buckets excluded),
  against the actual demand and against its noise-free seasonal part;
- out-of-capacity minutes (10 s intervals whose demand exceeded the ready replicas);
- GPU-hours (replicas ready or starting) and scale events.
Seeded and reproducible. Writes bench/results/autoscale.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results_io import write_result  # noqa: E402
from scheduler.autoscale import (  # noqa: E402
    AutoscaleConfig,
    Autoscaler,
    ReactivePolicy,
    Telemetry,
)

T0 = 1_704_067_200  # Monday 2024-01-01 00:00 UTC
TICK_S = 10  # telemetry resolution
REPORT_S = 60  # what the autoscaler sees: 10 s reports summed per minute
BUCKET_S = 300  # the forecast's step
HORIZON = 12  # buckets: the forecast scored an hour ahead
TARGET_MAPE = 0.15
TARGET_OOC_CUT = 0.5  # the forecast policy: at most half the reactive out-of-capacity time
TARGET_GPU_OVERHEAD = 0.10  # ... for at most 10% more GPU-hours
PERMITS_PER_REPLICA = 8
POLICIES = {"forecast": Autoscaler, "reactive": ReactivePolicy}


@dataclass(frozen=True)
class ModelSpec:
    """One model's traffic: a daily shape (bumps over a base), weekly factors, growth."""

    name: str
    peak: float  # replicas' worth of work at a weekday's peak
    base: float  # the shape's floor, relative to its peak
    bumps: tuple[tuple[float, float, float], ...] = ()  # (hour, width h, height)
    steps: tuple[tuple[float, float, float], ...] = ()  # (on hour, off hour, edge width h)
    weekend: float = 1.0  # Saturday and Sunday, relative to weekdays
    growth_per_week: float = 0.0
    rps_per_replica: float = 5.0  # requests/s one replica serves: the known capacity
    spikes_per_week: float = 1.5
    min_replicas: int = 1


MODELS = (
    # business hours, a lunch dip, quiet weekends, growing
    ModelSpec("chat-8b", 14, 0.12, ((10.5, 2.2, 1.0), (15.0, 2.5, 0.9)), (), 0.45, 0.04),
    # consumer: evenings, busier weekends
    ModelSpec("chat-70b", 8, 0.2, ((13, 3, 0.5), (21, 2.2, 1.0)), (), 1.25, 0.02, 2.0),
    # developers: a steep 9:00 ramp, a plateau to 18:00, empty weekends, growing fast
    ModelSpec("code-34b", 10, 0.08, ((14, 1.5, 0.2),), ((9, 18, 0.15),), 0.2, 0.06, 3.0),
    # a nightly batch 2:00-4:00 with minute-sharp edges, every day
    ModelSpec("embed-batch", 6, 0.15, ((12, 4, 0.2),), ((2, 4, 0.05),), 1.0, 0.0, 50.0),
    # Europe's and America's mornings, declining
    ModelSpec("summarize", 5, 0.2, ((9, 2, 0.8), (15.5, 2.5, 1.0)), (), 0.6, -0.03),
    # hardly used: one replica's worth at most
    ModelSpec("tail-1b", 1.0, 0.25, ((11, 3, 1.0), (19, 2, 0.6)), (), 0.5, 0.0, 20.0),
)


@dataclass
class Trace:
    demand: np.ndarray  # offered work per 10 s tick, replicas' worth
    seasonal: np.ndarray  # its noise-free part (shape x weekly x growth)
    spike: np.ndarray  # bool per tick: a spike is on


def daily_shape(spec: ModelSpec, hours: np.ndarray) -> np.ndarray:
    """The weekday shape, peak 1: a base, Gaussian bumps, logistic on/off plateaus."""
    y = np.full_like(hours, spec.base)
    for h, w, a in spec.bumps:
        dist = (hours - h + 12) % 24 - 12
        y += a * np.exp(-0.5 * (dist / w) ** 2)
    for on, off, edge in spec.steps:
        up = 1 / (1 + np.exp(-((hours - on + 12) % 24 - 12) / edge))
        down = 1 / (1 + np.exp(((hours - off + 12) % 24 - 12) / edge))
        y += up * down
    return y / y.max()


def make_trace(spec: ModelSpec, weeks: int, rng: np.random.Generator) -> Trace:
    n = weeks * 7 * 86_400 // TICK_S
    t = np.arange(n) * TICK_S
    hours, day = (t % 86_400) / 3600, t // 86_400
    weekend = np.where(day % 7 >= 5, spec.weekend, 1.0)
    growth = (1 + spec.growth_per_week) ** (t / (7 * 86_400))
    seasonal = spec.peak * daily_shape(spec, hours) * weekend * growth
    day_factor = np.exp(rng.normal(0, 0.06, weeks * 7 + 1))[day]  # some days are busier
    minutes = n * TICK_S // 60 + 1  # AR(1) in logs per minute: ~10 min correlation
    phi, sigma = math.exp(-1 / 10), 0.08
    shocks = rng.normal(0, sigma * math.sqrt(1 - phi * phi), minutes)
    ar = np.empty(minutes)
    ar[0] = rng.normal(0, sigma)
    for i in range(1, minutes):
        ar[i] = phi * ar[i - 1] + shocks[i]
    level = seasonal * day_factor * np.exp(ar[t // 60])
    factor = np.ones(n)
    for _ in range(rng.poisson(6 * 7 * weeks)):  # bursts: ~6 a day, 1-3 min, part of noise
        start = rng.integers(0, n)
        factor[start : start + int(rng.uniform(1, 3) * 60 / TICK_S)] = rng.uniform(1.2, 1.6)
    spike = np.zeros(n, bool)
    for _ in range(rng.poisson(spec.spikes_per_week * weeks)):
        start = rng.integers(0, n)
        stop = start + int(rng.uniform(5, 30) * 60 / TICK_S)
        factor[start:stop] = rng.uniform(1.5, 3.0)
        spike[start:stop] = True
    rate = level * factor * spec.rps_per_replica * TICK_S  # requests per tick
    demand = rng.poisson(rate) / (spec.rps_per_replica * TICK_S)
    return Trace(demand, seasonal, spike)


@dataclass
class Replay:
    """One policy on one model's trace: what the measured week cost and missed."""

    ooc_s: float = 0.0
    ooc_spike_s: float = 0.0  # of which while a spike was on
    refused_work: float = 0.0
    offered_work: float = 0.0
    replica_s: float = 0.0
    events: dict = field(default_factory=dict)
    forecasts: dict = field(default_factory=dict)  # bucket index -> forecast (an hour before)


def report(t_end: float, ticks: list[float], ready: int, spec: ModelSpec) -> Telemetry:
    """A minute's telemetry for `ready` replicas facing the ticks' demand."""
    served = sum(min(d, ready) for d in ticks) * TICK_S
    refused = sum(max(d - ready, 0.0) for d in ticks) * TICK_S
    util = served / (REPORT_S * ready) if ready else 0.0
    total = ready * PERMITS_PER_REPLICA
    requests = round(served * spec.rps_per_replica)
    return Telemetry(
        t=t_end,
        replicas=ready,
        busy_s=served,
        permits_free=total - round(0.8 * util * total),
        permits_total=total,
        queue_s=0.2 * util / max(1.0 - util, 0.02),
        oc_errors=round(refused * spec.rps_per_replica),
        requests=requests,
        tokens=requests * 200,
        interval_s=REPORT_S,
    )


def replay(spec: ModelSpec, trace: Trace, policy: type[Autoscaler], measured_from: int) -> Replay:
    """Minute by minute: report, decide, start or stop replicas; score from measured_from."""
    clock = [float(T0)]
    cfg = AutoscaleConfig(min_replicas=spec.min_replicas, max_replicas=64, cold_start_s=180)
    scaler = policy(cfg, clock=lambda: clock[0])
    demand = trace.demand.tolist()
    per_report = REPORT_S // TICK_S
    spikes = trace.spike.reshape(-1, per_report).any(1).tolist()
    ready, starting = scaler.replicas, []  # starting: when each pending replica is ready
    out, events_before = Replay(), None
    f = scaler.forecaster
    for m in range(len(demand) // per_report):
        t = T0 + m * REPORT_S
        ready += sum(1 for s in starting if s <= t)
        starting = [s for s in starting if s > t]
        ticks = demand[m * per_report : (m + 1) * per_report]
        measured = m * per_report >= measured_from
        if measured:
            if events_before is None:
                events_before = dict(scaler.events)
            ooc = TICK_S * sum(d > ready for d in ticks)
            out.ooc_s += ooc
            out.ooc_spike_s += ooc if spikes[m] else 0
            out.refused_work += TICK_S * sum(max(d - ready, 0.0) for d in ticks)
            out.offered_work += TICK_S * sum(ticks)
            out.replica_s += REPORT_S * (ready + len(starting))
        clock[0] = t + REPORT_S
        last_bucket = f.last if f else None
        scaler.observe(report(clock[0], ticks, ready, spec))
        want = scaler.decide().replicas
        if f is not None and f.last != last_bucket and measured:
            out.forecasts[f.last + HORIZON] = f.at(HORIZON)
        have = ready + len(starting)
        if want > have:
            starting += [clock[0] + cfg.cold_start_s] * (want - have)
        elif want < have:  # stop replicas still starting first
            drop = min(have - want, len(starting))
            starting = starting[: len(starting) - drop]
            ready -= have - want - drop
    out.events = {k: v - (events_before or {}).get(k, 0) for k, v in scaler.events.items()}
    return out


def forecast_error(trace: Trace, forecasts: dict) -> dict:
    """MAPE of the hour-ahead forecasts per 5-minute bucket, spike buckets left out."""
    per = BUCKET_S // TICK_S
    n = len(trace.demand) // per
    actual = trace.demand[: n * per].reshape(n, per).mean(1)
    seasonal = trace.seasonal[: n * per].reshape(n, per).mean(1)
    spiky = trace.spike[: n * per].reshape(n, per).any(1)
    base = T0 // BUCKET_S
    ks = [k - base for k in forecasts if 0 <= k - base < n and not spiky[k - base]]
    pred = np.array([forecasts[k + base] for k in ks])
    act, sea = actual[ks], seasonal[ks]
    return {
        "mape_actual": float(np.mean(np.abs(pred - act) / act)),
        "mape_seasonal": float(np.mean(np.abs(pred - sea) / sea)),
        "buckets": len(ks),
        "spike_buckets_excluded": int(spiky[min(ks) :].sum()) if ks else 0,
    }


def summarize(r: Replay) -> dict:
    return {
        "ooc_minutes": round(r.ooc_s / 60, 1),
        "ooc_minutes_in_spikes": round(r.ooc_spike_s / 60, 1),
        "refused_share": round(r.refused_work / r.offered_work, 5) if r.offered_work else 0,
        "gpu_hours": round(r.replica_s / 3600, 1),
        "scale_events": sum(r.events.values()),
        "events": r.events,
    }


def print_table(rows: dict) -> None:
    heads = ["model", "policy", "OOC min", "in spikes", "refused %", "GPU-h", "events", "MAPE 1h"]
    widths = [13, 10, 9, 10, 10, 9, 8, 9]

    def line(cells: list[str]) -> str:
        return "".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(line(heads))
    for model, pols in rows.items():
        for pol, s in pols.items():
            mape = s.get("forecast", {}).get("mape_actual")
            cells = [model, pol, f"{s['ooc_minutes']:.1f}", f"{s['ooc_minutes_in_spikes']:.1f}"]
            cells += [f"{100 * s['refused_share']:.3f}", f"{s['gpu_hours']:.1f}"]
            cells += [str(s["scale_events"]), "-" if mape is None else f"{100 * mape:.1f}%"]
            print(line(cells))
    print("(OOC: 10 s intervals with demand above the ready replicas; refused: share of work)")


def verdict(value: float, ok: bool, target: str, **extra) -> dict:
    return {"value": value, "target": target, "verdict": "PASS" if ok else "FAIL", **extra}


def verdicts(totals: dict, mape: float) -> dict:
    """The targets, judged on the measured week, all models together."""
    fc, re = totals["forecast"], totals["reactive"]
    cut = 1 - fc["ooc_minutes"] / re["ooc_minutes"] if re["ooc_minutes"] else 0.0
    overhead = fc["gpu_hours"] / re["gpu_hours"] - 1
    events = fc["scale_events"]
    out = {
        "forecast_mape_1h": verdict(round(mape, 4), mape < TARGET_MAPE, f"< {TARGET_MAPE}"),
        "ooc_minutes_cut_vs_reactive": verdict(
            round(cut, 3), cut >= TARGET_OOC_CUT, f">= {TARGET_OOC_CUT}"
        ),
        "gpu_hours_overhead_vs_reactive": verdict(
            round(overhead, 3), overhead <= TARGET_GPU_OVERHEAD, f"<= {TARGET_GPU_OVERHEAD}"
        ),
        "scale_events": verdict(
            events, events <= re["scale_events"], "<= reactive's", reactive=re["scale_events"]
        ),
    }
    for name, v in out.items():
        print(f"{name}: {v['value']} (target {v['target']}): {v['verdict']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--history-weeks", type=int, default=3)
    ap.add_argument("--models", default=",".join(m.name for m in MODELS))
    ap.add_argument("--smoke", action="store_true", help="2 models, 1 week of history")
    args = ap.parse_args()
    specs = [m for m in MODELS if m.name in args.models.split(",")]
    if args.smoke:
        specs, args.history_weeks = specs[:2], 1
    weeks = args.history_weeks + 1
    measured_from = args.history_weeks * 7 * 86_400 // TICK_S
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    rows: dict = {}
    keys = ("ooc_minutes", "ooc_minutes_in_spikes", "gpu_hours", "scale_events")
    totals = {p: dict.fromkeys(keys, 0) for p in POLICIES}
    abs_errors: list[float] = []
    seasonal_errors: list[float] = []
    for spec in specs:
        trace = make_trace(spec, weeks, rng)
        rows[spec.name] = {}
        for label, policy in POLICIES.items():
            r = replay(spec, trace, policy, measured_from)
            s = summarize(r)
            if r.forecasts:
                s["forecast"] = forecast_error(trace, r.forecasts)
                abs_errors.append(s["forecast"]["mape_actual"])
                seasonal_errors.append(s["forecast"]["mape_seasonal"])
            rows[spec.name][label] = s
            for key in keys:
                totals[label][key] = round(totals[label][key] + s[key], 1)
        print(f"[{spec.name}] done at {time.perf_counter() - started:.1f}s", flush=True)
    print_table(rows)
    for label, tot in totals.items():
        ooc, gpu, events = tot["ooc_minutes"], tot["gpu_hours"], tot["scale_events"]
        print(f"all {label}: {ooc:.1f} OOC min, {gpu:.1f} GPU-h, {events:.0f} scale events")
    mape = float(np.mean(abs_errors))
    targets = verdicts(totals, mape)
    config = {
        "seed": args.seed,
        "history_weeks": args.history_weeks,
        "measured_weeks": 1,
        "tick_s": TICK_S,
        "report_s": REPORT_S,
        "bucket_s": BUCKET_S,
        "horizon_buckets": HORIZON,
        "autoscale": {k: v for k, v in asdict(AutoscaleConfig()).items() if k != "forecast"},
        "forecast": asdict(AutoscaleConfig().forecast),
        "models": [asdict(s) for s in specs],
    }
    data = {
        "config": config,
        "per_model": rows,
        "totals": totals,
        "forecast_mape_1h_mean": round(mape, 4),
        "forecast_mape_1h_vs_seasonal_part_mean": round(float(np.mean(seasonal_errors)), 4),
        "targets": targets,
        "runtime_s": round(time.perf_counter() - started, 1),
    }
    print("wrote", write_result("autoscale", data))


if __name__ == "__main__":
    main()
