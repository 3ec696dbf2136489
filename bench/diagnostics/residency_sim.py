"""The residency policy alone (omni/runtime/residency.py) under bench/catalog_bench.py's
closed loop, on the CPU: no GPU, no processes, no HTTP.

Each instance is a fake shim that swaps in `swap_s_per_gib` per GiB of its use and reports
that use (the catalog's measured peaks); each request holds its instance for the kind's
measured time. 16 clients pick models by Zipf(1.1), the first the hottest, as the bench
does. What it shows is the policy's own queueing: how long cold requests wait for room
when nothing else is slow. Variants of what the kinds hold: the LLMs' KV pools filling
their quotas, the peaks measured on the H100 (KV pools backed as used), those after the
vision models went to float16 and the VAE decoded one image at a time, and with the
detector and the text-to-image model shrunk further. Each under the policy as it is and
without backfilling (small cold models kept out of the room the head waits for). Per
variant, policy and seed: cold p50/p99 (the instances outside the three hottest), the
hottest's p99, requests/s. Writes bench/results/residency-sim-cpu.json.

    python bench/diagnostics/residency_sim.py --seeds 0 1 2 3 4 5
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.results_io import write_result
from omni.cudashim import ShimResidency, SwapResult
from omni.runtime.residency import GpuPool, PoolMember

GiB = 1 << 30
BUDGET_GIB = 6.4
# bench/catalog_bench.py's seed-0 order: (kind, quota GiB); the first is the hottest
CATALOG = [
    ("llm-small", 2), ("llm-small", 2), ("t2i", 4), ("detector", 2.5), ("asr", 1),
    ("embed", 0.5), ("llm-large", 4), ("llm-large", 4), ("classifier", 1), ("asr", 1),
    ("llm-small", 2), ("embed", 0.5), ("classifier", 1),
]  # fmt: skip
# GiB each kind held at its peak, and seconds a request holds it: catalog-h100.json
USE_GIB = {"llm-small": 1.17, "llm-large": 3.08, "t2i": 3.35, "detector": 2.25, "asr": 0.4,
           "classifier": 0.5, "embed": 0.2}  # fmt: skip
VARIANTS = {  # what each kind holds, over USE_GIB
    "KV pools filling their quotas": {"llm-small": 1.98, "llm-large": 3.99},
    "KV pools as used (measured)": {},
    "and float16 vision, VAE slicing (measured)": {"t2i": 2.53, "detector": 2.12,
                                                   "classifier": 0.3},
    "and detector 0.6, text-to-image 2.3 GiB": {"detector": 0.6, "t2i": 2.3},
}  # fmt: skip
HOLD_S = {"llm-small": 0.04, "llm-large": 0.2, "t2i": 0.4, "detector": 0.1, "asr": 0.2,
          "classifier": 0.04, "embed": 0.02}  # fmt: skip


class HeadOnly(GpuPool):
    """The policy without backfilling: no cold model takes room the head waits for."""

    def _backfills(self, member: PoolMember, head: PoolMember, now: float) -> bool:
        return False


POLICIES = {"head and backfill": GpuPool, "head only": HeadOnly}


class FakeShim:
    """Moves in `delay_s`, and reports `use` bytes as its window's peak."""

    def __init__(self, delay_s: float, use: int):
        self.delay_s, self.window_peak_bytes = delay_s, use

    def move(self, target: ShimResidency, timeout_s: float) -> SwapResult:
        time.sleep(self.delay_s)
        return SwapResult(target, self.delay_s, self.window_peak_bytes)

    def close(self) -> None:
        pass


async def run(seed: int, use: dict[str, float], policy: type[GpuPool], args) -> dict:
    rng = random.Random(seed)
    pool = policy(0, int(BUDGET_GIB * GiB), swap_timeout_s=5)
    members = []
    for i, (kind, quota) in enumerate(CATALOG):
        t = PoolMember(f"{kind}-{i}", int(quota * GiB), lambda reason: print("failed:", reason))
        pool.add(t)
        shim = FakeShim(args.swap_s_per_gib * use[kind], int(use[kind] * GiB))
        await pool.starting(t, shim)
        await pool.ready(t, cold=True)
        members.append((t, HOLD_S[kind]))
    weights = [1 / (k + 1) ** 1.1 for k in range(len(members))]
    latencies: dict[int, list[float]] = {i: [] for i in range(len(members))}
    start = time.monotonic()

    async def client() -> None:
        while time.monotonic() < start + args.warmup + args.duration:
            i = rng.choices(range(len(members)), weights)[0]
            member, hold_s = members[i]
            t0 = time.monotonic()
            async with pool.use(member, t0 + 30):
                await asyncio.sleep(hold_s)
            if t0 - start > args.warmup:
                latencies[i].append(time.monotonic() - t0)

    await asyncio.gather(*(client() for _ in range(args.clients)))
    cold = sorted(x for i, v in latencies.items() if i >= 3 for x in v)
    hot = sorted(latencies[0])
    served = sum(map(len, latencies.values()))

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")

    return {
        "seed": seed,
        "cold_p50_s": pct(cold, 0.5),
        "cold_p99_s": pct(cold, 0.99),
        "hottest_p99_s": pct(hot, 0.99),
        "requests_per_s": served / args.duration,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--swap-s-per-gib", type=float, default=0.03)
    args = ap.parse_args()
    out = {}
    print(f"{'variant':44} {'policy':18} seed  cold p50   p99  hottest p99  req/s")
    for name, change in VARIANTS.items():
        out[name] = {"use_gib": {**USE_GIB, **change}}
        for label, policy in POLICIES.items():
            runs = out[name].setdefault(label, [])
            for seed in args.seeds:
                r = asyncio.run(run(seed, out[name]["use_gib"], policy, args))
                runs.append(r)
                print(
                    f"{name:44} {label:18} {seed:4} {r['cold_p50_s']:8.2f} "
                    f"{r['cold_p99_s']:5.2f} {r['hottest_p99_s']:12.3f} "
                    f"{r['requests_per_s']:6.1f}",
                    flush=True,
                )
    config = {k: v for k, v in vars(args).items()} | {"budget_gib": BUDGET_GIB, "hold_s": HOLD_S}
    print("wrote", write_result("residency-sim-cpu", {"config": config, "variants": out}))


if __name__ == "__main__":
    main()
