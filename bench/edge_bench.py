"""The edge's own cost: latency it adds and requests/s it sustains, against instant nodes.

Stand-in nodes (omni/testing/standin.py) answer at once (token_s=0, 4096 permits), so
whatever the edge adds is the edge. Runs, each with fresh processes:
- direct: the load generator straight to the node(s), the baseline;
- edge-fair / edge-fifo: through `python -m edge.server --queueing fair|fifo`;
- and a "-max" run of each: a closed loop of `--concurrency` clients, the sustained req/s.
Open-loop runs send at a fixed `--rate`, each request at its scheduled time; when the
generator cannot keep up, how late it sent is recorded (lag), not hidden.
The generator, the edge and the nodes share this machine's cores: on a small one they
slow each other, so the added latency is an upper bound. Writes bench/results/edge.json.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import psutil  # noqa: E402

from bench.results_io import write_result  # noqa: E402
from omni.testing.standin import StandinNode, free_port  # noqa: E402

BODY = b'{"model":"m","prompt":"hello world","max_tokens":1}'
HEADERS = {"Content-Type": "application/json"}
TARGET_ADDED_P50_MS = 1.0
TARGET_RATE = 1000.0


@dataclass
class Rec:
    """One request: when it was due and sent (s from the run's start), how long it took."""

    due: float
    sent: float
    latency: float
    status: int | str


@dataclass
class Load:
    """The load generator: one keep-alive connection pool, every request timed."""

    urls: list[str]
    session: aiohttp.ClientSession
    t0: float = field(default_factory=time.perf_counter)

    async def one(self, i: int, due: float) -> Rec:
        sent = time.perf_counter()
        try:
            async with self.session.post(self.urls[i % len(self.urls)], data=BODY) as resp:
                await resp.read()
                status: int | str = resp.status
        except TimeoutError:
            status = "timeout"
        except aiohttp.ClientError as exc:
            status = type(exc).__name__
        end = time.perf_counter()
        return Rec(due - self.t0, sent - self.t0, end - sent, status)

    async def open_loop(self, rate: float, seconds: float) -> list[Rec]:
        """Request i goes at t0 + i/rate; any that are due go at once, then we sleep."""
        tasks, n = [], int(rate * seconds)
        for i in range(n):
            due = self.t0 + i / rate
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(self.one(i, due)))
        return list(await asyncio.gather(*tasks))

    async def closed_loop(self, clients: int, seconds: float) -> list[Rec]:
        """`clients` workers, each sending its next request when its last one is answered."""
        end, recs = self.t0 + seconds, []

        async def worker(k: int) -> None:
            i = k
            while (now := time.perf_counter()) < end:
                recs.append(await self.one(i, now))
                i += clients

        await asyncio.gather(*(worker(k) for k in range(clients)))
        return recs


class CpuMeter:
    """Cores each process used over the window: what a request costs the edge, and whether
    anything else ran (the "machine" figure counts every process)."""

    def __init__(self, pids: dict[str, int]):
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.start: dict[str, float] = {}
        self.wall = 0.0

    def _now(self) -> dict[str, float]:
        out = {}
        for name, p in self.procs.items():
            t = p.cpu_times()
            out[name] = t.user + t.system
        m = psutil.cpu_times()  # all processes: more than ours means others shared the cores
        out["machine"] = sum(m) - m.idle - getattr(m, "iowait", 0.0)
        return out

    def mark(self) -> None:
        self.start, self.wall = self._now(), time.perf_counter()

    def since(self) -> dict[str, float]:
        now, wall = self._now(), time.perf_counter() - self.wall
        return {name: (now[name] - self.start[name]) / wall for name in now}


def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank; None with no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def summarize(recs: list[Rec], warmup: float, cores: dict[str, float]) -> dict:
    """The measured window only: requests due after the warm-up."""
    window = [r for r in recs if r.due >= warmup]
    ok = [r for r in window if r.status == 200]
    lat = [r.latency * 1e3 for r in ok]
    lag = [(r.sent - r.due) * 1e3 for r in window]
    elapsed = max((r.sent + r.latency for r in window), default=warmup) - warmup
    rps = len(ok) / elapsed if elapsed > 0 else 0.0

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v, 3)

    return {
        "sent": len(window),
        "ok": len(ok),
        "statuses": dict(Counter(str(r.status) for r in window)),
        "elapsed_s": round(elapsed, 3),
        "achieved_rps": round(rps, 1),
        "latency_ms": {k: ms(percentile(lat, p)) for k, p in (("p50", 50), ("p99", 99))}
        | {"p999": ms(percentile(lat, 99.9)), "max": ms(max(lat, default=None))},
        # How late the generator sent (open loop): large values mean it, not the edge, lagged.
        "generator_lag_ms": {"p50": ms(percentile(lag, 50)), "p99": ms(percentile(lag, 99))}
        | {"max": ms(max(lag, default=None))},
        "cpu_cores": {k: round(v, 3) for k, v in cores.items()},
        "edge_cpu_ms_per_request": (
            round(cores["edge"] * 1e3 / rps, 4) if "edge" in cores and rps else None
        ),
        "latencies_ms": [round(x, 2) for x in lat],
    }


class Edge:
    """The edge under test, in its own process; fails with its log if it will not serve."""

    def __init__(self, upstreams: list[str], queueing: str, tenants: str | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "edge.server", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--queueing", queueing]
        for u in upstreams:
            argv += ["--upstream", u]
        if tenants:
            argv += ["--tenants", tenants]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the process runs)
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def wait_healthy(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log().strip()
                last = log.splitlines()[-1] if log else "no output"
                raise RuntimeError(f"edge exited ({self.proc.returncode}): {last}\n{log}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # refused, or a 503 (HTTPError) while nodes are unknown
                pass
            time.sleep(0.05)
        raise RuntimeError(f"edge not healthy in {timeout_s}s: {self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


async def measure(urls: list[str], pids: dict[str, int], args, closed: bool) -> dict:
    """Drive the load; CPU is read over the measured window (after the warm-up)."""
    meter = CpuMeter({**pids, "loadgen": psutil.Process().pid})
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    limit = max(args.connections, args.concurrency)
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=HEADERS) as s:
        for url in urls:  # open a connection and check the path before the clock starts
            async with s.post(url, data=BODY) as resp:
                await resp.read()

        async def window() -> dict[str, float]:
            await asyncio.sleep(args.warmup)
            meter.mark()
            await asyncio.sleep(args.duration)
            return meter.since()

        load = Load(urls, s)
        cpu = asyncio.create_task(window())
        seconds = args.warmup + args.duration
        if closed:
            recs = await load.closed_loop(args.concurrency, seconds)
        else:
            recs = await load.open_loop(args.rate, seconds)
    return summarize(recs, args.warmup, await cpu)


def run_one(label: str, args) -> dict:
    """Fresh nodes (and a fresh edge unless direct), one load, every process stopped after."""
    mode, closed = label.removesuffix("-max"), label.endswith("-max")
    load_before = round(os.getloadavg()[0], 2)  # another job on the machine skews everything
    nodes = [
        StandinNode(f"n{k}", ["m"], permits=args.permits, token_s=0.0) for k in range(args.nodes)
    ]
    edge = None
    try:
        pids = {f"node{k}": n.proc.pid for k, n in enumerate(nodes)}
        if mode == "direct":
            urls = [n.url + "/v1/completions" for n in nodes]
        else:
            edge = Edge([n.url for n in nodes], mode.removeprefix("edge-"), args.tenants)
            edge.wait_healthy()
            urls, pids["edge"] = [edge.url + "/v1/completions"], edge.proc.pid
        result = asyncio.run(measure(urls, pids, args, closed))
        result["loop"] = "closed" if closed else "open"
        result["loadavg_1m_before"] = load_before
        result["node_served"] = {n.name: sum(n.stats()["served"].values()) for n in nodes}
        return result
    finally:
        if edge is not None:
            edge.stop()
        for n in nodes:
            n.stop()


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(runs: dict) -> None:
    heads = ["run", "sent", "ok", "req/s", "p50 ms", "p99 ms", "p999 ms", "lag p99", "edge cpu"]
    heads.append("all cpu")
    widths = [15, 7, 7, 8, 8, 8, 8, 8, 9, 8]

    def row(cells: list[str]) -> str:
        return cells[0].ljust(widths[0]) + "".join(map(str.rjust, cells[1:], widths[1:]))

    print(row(heads))
    for label, r in runs.items():
        if "error" in r:
            print(f"{label:15}error: {r['error'].splitlines()[0][:100]}")
            continue
        lat = r["latency_ms"]
        cells = [label, str(r["sent"]), str(r["ok"]), fmt(r["achieved_rps"], ".0f")]
        cells += [fmt(lat["p50"]), fmt(lat["p99"]), fmt(lat["p999"])]
        cpu = r["cpu_cores"]
        cells += [fmt(r["generator_lag_ms"]["p99"]), fmt(cpu.get("edge")), fmt(cpu["machine"])]
        print(row(cells))
        if set(r["statuses"]) != {"200"}:
            print(f"  {label}: statuses {r['statuses']}")
    print("(lag: how late the generator sent, ms; cpu: cores the edge / every process used)")


def added_latency(runs: dict) -> dict:
    """Edge minus direct, at p50 and p99, for each open-loop edge run."""
    base = runs.get("direct", {}).get("latency_ms")
    out = {}
    for label in ("edge-fair", "edge-fifo"):
        lat = runs.get(label, {}).get("latency_ms")
        if not (base and lat):
            continue
        out[label] = {
            k: None if lat[k] is None or base[k] is None else round(lat[k] - base[k], 3)
            for k in ("p50", "p99")
        }
        print(
            f"{label} adds p50 {fmt(out[label]['p50'], '.3f')} ms, "
            f"p99 {fmt(out[label]['p99'], '.3f')} ms over direct"
        )
    return out


def check_target(added: dict, rate: float) -> dict:
    """PASS/FAIL on edge-fair's added p50 at 1000 req/s; n/a at another rate or no figure."""
    value = added.get("edge-fair", {}).get("p50")
    verdict = "n/a"
    if value is not None and rate == TARGET_RATE:
        verdict = "PASS" if value <= TARGET_ADDED_P50_MS else "FAIL"
    print(
        f"edge-fair added p50 at {rate:.0f} req/s: {fmt(value, '.3f')} ms "
        f"(target <= {TARGET_ADDED_P50_MS} ms at {TARGET_RATE:.0f}): {verdict}"
    )
    return {
        "added_p50_ms_at_1000rps": value,
        "target_ms": TARGET_ADDED_P50_MS,
        "rate": rate,
        "verdict": verdict,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=TARGET_RATE, help="open loop, req/s")
    ap.add_argument("--duration", type=float, default=10.0, help="measured window, seconds")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured load first, seconds")
    ap.add_argument("--concurrency", type=int, default=64, help="closed-loop (max) clients")
    ap.add_argument("--connections", type=int, default=256, help="client keep-alive pool size")
    ap.add_argument(
        "--nodes", type=int, default=1, help="stand-in nodes (edge: one --upstream each)"
    )
    ap.add_argument("--permits", type=int, default=4096, help="per node")
    ap.add_argument("--timeout", type=float, default=10.0, help="per request, seconds")
    ap.add_argument("--tenants", help="the edge's --tenants file (default: anonymous)")
    ap.add_argument(
        "--runs",
        default="direct,edge-fair,edge-fifo,direct-max,edge-fair-max,edge-fifo-max",
        help="which, in order",
    )
    ap.add_argument("--smoke", action="store_true", help="--duration 2 --rate 200: a quick check")
    args = ap.parse_args()
    if args.smoke:
        args.duration, args.rate = 2.0, 200.0
    config = dict(vars(args))
    config.update(body=BODY.decode(), node_token_s=0.0)
    note = (
        f"The load generator, the edge and the stand-in node(s) share this machine's "
        f"{psutil.cpu_count()} cores; on a small machine they slow each other, so the added "
        "latency and the max req/s are pessimistic for the edge on its own."
    )
    runs: dict = {}
    for label in args.runs.split(","):
        print(f"[{label}] ...", flush=True)
        try:
            runs[label] = run_one(label, args)
        except Exception as exc:  # one failed run (say the edge refuses a flag) keeps the rest
            runs[label] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{label}] failed: {runs[label]['error']}")
        # Written after every run: a run cut short keeps the earlier ones.
        write_result("edge", {"config": config, "note": note, "runs": runs})
    print_table(runs)
    added = added_latency(runs)
    data = {"config": config, "note": note, "runs": runs, "added_latency_ms": added}
    data["targets"] = check_target(added, args.rate)
    print("wrote", write_result("edge", data))
    sys.exit(1 if any("error" in r for r in runs.values()) else 0)


if __name__ == "__main__":
    main()
