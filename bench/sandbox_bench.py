"""Start-up cost of a sandboxed instance over a plain subprocess.

Start-up: from asking for the process to its first instruction, read from the
clock by the program itself (`date +%s%N`, or Python's time.time_ns() as its
first statement). Run: until it has exited and been cleaned up (cgroup
removed), for reference. Plain and sandboxed runs alternate; the cost is the
difference of the medians. Writes bench/results/sandbox.json (or --name).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results_io import write_result
from omni.isolation.cgroups import CgroupManager
from omni.isolation.isolated import IsolatedSandbox
from omni.isolation.sandbox import Limits, ProcessSandbox, SandboxSpec
from omni.isolation.seccomp import export_bpf

PROGRAMS = {
    "date": ["/bin/date", "+%s%N"],
    "python": [sys.executable, "-S", "-c", "import time; print(time.time_ns())"],
}
KINDS = ("plain", "sandboxed")
PHASES = ("start", "run")


async def run_once(make, spec: SandboxSpec) -> tuple[float, float]:
    """(seconds to the program's first instruction, seconds to exited and cleaned up)."""
    spec.log_path.unlink(missing_ok=True)
    t0 = time.time_ns()
    box = make(spec)
    await box.start()
    status = await box.wait()
    total = (time.time_ns() - t0) / 1e9
    assert status.returncode == 0, (status, spec.log_path.read_text())
    started = int(spec.log_path.read_text().split()[-1])
    return (started - t0) / 1e9, total


async def measure(runs: int) -> dict:
    """Its /tmp/omni-bench-* dir and bench-<pid> cgroups are removed when it is done."""
    root = Path(tempfile.mkdtemp(prefix="omni-bench-", dir="/tmp"))
    try:
        cgroups = CgroupManager.detect(f"bench-{os.getpid()}")
        try:
            return await measure_in(root, cgroups, runs)
        finally:
            cgroups.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def measure_in(root: Path, cgroups: CgroupManager, runs: int) -> dict:
    model = root / "model"
    model.mkdir()
    bpf = export_bpf(root / "seccomp.bpf")

    def isolated(spec: SandboxSpec) -> IsolatedSandbox:
        return IsolatedSandbox(spec, cgroups, root / "sandboxes", seccomp_bpf=bpf)

    makers = {"plain": ProcessSandbox, "sandboxed": isolated}
    raw: dict = {}
    for label, argv in PROGRAMS.items():
        raw[label] = {k: {p: [] for p in PHASES} for k in KINDS}
        for i in range(runs + 2):  # two warm-up rounds, not recorded
            for kind in KINDS:
                spec = SandboxSpec(
                    f"b{i}",
                    argv,
                    {"PATH": "/usr/bin:/bin"},
                    model,
                    root / "run" / f"b{i}",
                    Limits(memory_bytes=1 << 30, pids=64),
                    log_path=root / f"{kind}.log",
                )
                start, total = await run_once(makers[kind], spec)
                if i >= 2:
                    raw[label][kind]["start"].append(start)
                    raw[label][kind]["run"].append(total)
    return {"cgroup_version": cgroups.version, "runs": runs, "seconds": raw}


def summarize(result: dict) -> dict:
    summary = {}
    for label, kinds in result["seconds"].items():
        for phase in PHASES:
            row = {}
            for kind in KINDS:
                values = kinds[kind][phase]
                row[f"{kind}_median_ms"] = statistics.median(values) * 1e3
                row[f"{kind}_p90_ms"] = statistics.quantiles(values, n=10)[-1] * 1e3
            row["overhead_median_ms"] = row["sandboxed_median_ms"] - row["plain_median_ms"]
            summary[f"{label}_{phase}"] = row
    return summary


def print_table(result: dict) -> None:
    print(
        f"sandbox start-up, cgroup v{result['cgroup_version']}, {result['runs']} runs "
        "(median / p90, ms)"
    )
    print(f"{'program':<16}{'plain':>16}{'sandboxed':>18}{'overhead':>11}")
    for key, row in result["summary_ms"].items():
        print(
            f"{key:<16}{row['plain_median_ms']:>9.1f} / {row['plain_p90_ms']:<5.1f}"
            f"{row['sandboxed_median_ms']:>10.1f} / {row['sandboxed_p90_ms']:<5.1f}"
            f"{row['overhead_median_ms']:>10.1f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--name", default="sandbox", help="result file name")
    args = parser.parse_args()
    result = asyncio.run(measure(args.runs))
    result["summary_ms"] = summarize(result)
    result["target"] = "start-up overhead (sandboxed - plain, median) under 50 ms"
    print_table(result)
    print("wrote", write_result(args.name, result))
