"""Tile sweep of the batch-invariant linear kernel on Llama-3-8B's bf16 shapes.

Why: batch-1 decode is memory-bound, and at M=1 `_linear_kernel` with `tile_config`'s
tiles reads the weights at about 2.5 TB/s where we need about 2.9 (an H100's HBM copy
runs at 3.03). Every tile shape keeps each output element one fp32 accumulator chained
through K in order, so any of them may replace the current one without changing a bit;
this measures which is fastest per row count M and layer shape, and checks the bits.

For each M (in order of importance, until --budget-s runs out) and shape (N, K): the time
of tile_config's tiles and of every config of the search space, in µs, weight TB/s
(N*K*2 bytes / time) and TFLOPS. Each config's output is compared with torch.equal to
tile_config's on the same inputs; a mismatching config is reported, never chosen as best.
Per M also the best single config for all shapes, by a decode step's linear time.

Timing: CUDA events around each launch, all of a config's launches queued behind
torch.cuda._sleep so that Python's launch overhead leaves no gaps: 3 warm-ups, then the
median of 20. bf16 weights under ROTATE_BYTES are timed over copies taken in turn, so that
none is read from L2 (a decode step reads each once).
Compiling the ~1,100 (config, M specialization) pairs, about a second each, would take
the whole budget, so a pool of processes compiles them into Triton's disk cache
(kernel.warmup) ahead of the timing loop, in the same order.
Writes bench/results/tune-linear-<gpu>.json.

--fp8: the W8A8 kernels (omni/engine/kernels/w8a8.py) on e4m3 weights (lm_head stays
bf16 in FP8 models: left out) and rows quantized once per M, against fp8_tiles; only
tiles that take K 128 at a time with 64+ rows (the bits, see fp8_tiles); and per shape
the bf16 kernel's time with tile_config's tiles on the same M, for FP8's speedup. Writes
tune-linear-fp8-<gpu>.json.

--small: tiny shapes and 3 configs under TRITON_INTERPRET=1 on the CPU in fp32 (the
interpreter has no bf16), a check of the harness only: the interpreter's dot is numpy's,
whose summation order follows the tile, so mismatches are expected there.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import itertools
import json
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import results_io  # noqa: E402
from omni.engine.fp8 import quantize_weight  # noqa: E402
from omni.engine.kernels.matmul import (  # noqa: E402
    SHARED_MEMORY,
    TMA_MIN_ROWS,
    TMA_SHARED_MEMORY,
    _linear_kernel,
    launch_linear,
    linear,
    tile_config,
    tma_usable,
)
from omni.engine.kernels.w8a8 import (  # noqa: E402
    FEW_ROWS,
    fp8_linear,
    fp8_tiles,
    launch_fp8_linear,
)
from omni.engine.kernels.w8a8 import quantize_rows as quantize_rows_gpu  # noqa: E402

SHAPES = {  # (N, K) of Llama-3-8B's weights, q/k/v and gate/up fused
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
# (N, K) of Moonlight-16B-A3B's dense weights (--model moonlight) as the engine runs them:
# MLA's q and latent input fused, o, the first (dense) layer's gate/up and down, the lm
# head (the shared experts run in the routed stack); 27 layers
MOONLIGHT_SHAPES = {
    "q_kv_a": (3648, 2048),
    "o": (2048, 2048),
    "dense_gate_up": (22528, 2048),
    "dense_down": (2048, 11264),
    "lm_head": (163840, 2048),
}
PER_STEP = {"lm_head": 1, "dense_gate_up": 1, "dense_down": 1}  # the rest: a layer each
LAYERS = 32
M_ORDER = (1, 128, 256, 16, 4, 64, 32, 512)
SPACE_DECODE = ((16, 32, 64), (16, 32, 64, 128), (64, 128, 256), (2, 4, 8), (3, 4, 5, 6, 8))
SPACE_PREFILL = ((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4, 5))
SPACE_LARGE = ((64, 128, 256), (64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4, 5))  # M >= 512
# 64 < M < 512, besides SPACE_PREFILL: a whole batch in one row tile, narrow column tiles
SPACE_MID = ((64, 128, 256), (16, 32), (64, 128, 256), (4, 8), (3, 4, 5, 6))
# The TMA kernel (M >= TMA_MIN_ROWS on Hopper): + one program per tile (0) or persistent (1)
TMA_SMALL = ((64, 128), (32, 64, 128), (64, 128), (4,), (4, 5, 6, 8), (0, 1))  # M <= 128
TMA_MID = ((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4, 5), (0, 1))  # M <= 1024
TMA_LARGE = ((128, 256), (128, 256), (64, 128), (8,), (2, 3, 4), (0, 1))
# --fp8, the TMA kernel: 64+ rows and K 128 a tile only (fp8_tiles says why)
FP8_TMA = ((64, 128), (64, 128, 256), (128,), (4, 8), (3, 4, 5, 6), (0, 1))
SMALL_SHAPES = {"o": (64, 128), "down": (48, 192)}  # tails of N and K masked
SMALL_M_ORDER = (1, 4, 16)
# bf16 weights smaller than this are timed over copies taken in turn, so that no launch
# finds its weights in L2 (50 MB on an H100, 60 on an H200) as a decode step would not
ROTATE_BYTES = 256 << 20
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


class Tile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    persistent: int = -1  # -1: the pointer kernel; TMA: 0 one program per tile, 1 persistent

    @classmethod
    def of(cls, cfg: dict) -> Tile:
        return cls(*(cfg[key] for key in KEYS), int(cfg.get("persistent", -1)))

    def kwargs(self) -> dict:
        tma = {"persistent": bool(self.persistent)} if self.persistent >= 0 else {}
        return dict(zip(KEYS, self[:5], strict=True)) | tma

    def __str__(self) -> str:
        kind = ("", " tma", " tma-p")[self.persistent + 1]
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.warps} s{self.stages}{kind}"


def candidates(m: int, current: list[Tile], small: bool, tma: bool, fp8: bool = False):
    """tile_config's tiles first (always timed), then the search space for this M: the
    TMA kernel's where `linear` would use it, else the pointer kernel's."""
    if fp8:
        return fp8_candidates(m, current, tma)
    if small:
        extra = [Tile(16, 32, 64, 4, 3), Tile(32, 16, 32, 2, 3), Tile(16, 32, 64, 4, 3, 1)]
        return list(dict.fromkeys([*current, *extra]))
    if tma and m >= TMA_MIN_ROWS:
        dims = TMA_SMALL if m <= 128 else TMA_MID if m <= 1024 else TMA_LARGE
        space = (Tile(*t) for t in itertools.product(*dims))
        fits = [
            t
            for t in space
            if (t.block_m + t.block_n) * t.block_k * 2 * t.stages + t.block_m * t.block_n * 2
            <= TMA_SHARED_MEMORY
            and t.block_m <= 2 * m
        ]
        return list(dict.fromkeys(current + fits))
    mid = [SPACE_PREFILL, SPACE_MID] if m < 512 else [SPACE_LARGE]
    spaces = [SPACE_DECODE] if m <= 64 else mid
    space = (Tile(*t) for dims in spaces for t in itertools.product(*dims))
    fits = [
        t
        for t in space
        if (t.block_m + t.block_n) * t.block_k * 2 * t.stages <= SHARED_MEMORY
        and t.block_m <= 2 * max(m, 16)
    ]
    return list(dict.fromkeys(current + fits))


def fp8_candidates(m: int, current: list[Tile], tma: bool) -> list[Tile]:
    """--fp8: fp8_tiles' first, then tiles of 64+ rows taking K 128 at a time (e4m3 in, a
    bf16 tile out of the TMA kernel's epilogue)."""
    if tma and m >= TMA_MIN_ROWS:
        space = (Tile(*t) for t in itertools.product(*FP8_TMA))
        fits = [
            t
            for t in space
            if (t.block_m + t.block_n) * t.block_k * t.stages + t.block_m * t.block_n * 2
            <= TMA_SHARED_MEMORY
            and (t.warps == 4 or t.block_m * t.block_n >= 128 * 128)  # 8 warps: big tiles
            and (t.warps == 8 or t.block_m * t.block_n <= 128 * 128)
        ]
    else:
        dims = ((64,), (32, 64, 128), (128,), (4, 8), (3, 4, 5, 6))
        fits = [
            t
            for t in (Tile(*t) for t in itertools.product(*dims))
            if (t.block_m + t.block_n) * t.block_k * t.stages <= SHARED_MEMORY
        ]
    return list(dict.fromkeys(current + fits))


class Operands(NamedTuple):
    """What a launch takes: bf16 x and w, or (--fp8) quantized rows and weights."""

    x: torch.Tensor
    w: torch.Tensor
    x_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None


def launch(tile: Tile, ops: Operands, out: torch.Tensor) -> None:
    """As `linear()` (or `fp8_linear()`) launches it, without bias."""
    if ops.w_scale is None:
        launch_linear(ops.x, ops.w, None, out, tile.kwargs())
    else:
        launch_fp8_linear(ops.x, ops.x_scale, ops.w, ops.w_scale, None, out, tile.kwargs())


def _compile(kwargs: dict, m: int) -> str | None:
    """In a pool process: compile for this M's specialization (N and K are multiples of 16
    in every shape) into Triton's disk cache; the error, if any (the launch repeats it)."""
    try:
        bf16 = [torch.bfloat16] * 4
        _linear_kernel.warmup(*bf16, m, 4096, 4096, HAS_BIAS=False, GROUP_M=8, grid=(1,), **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


class Precompiler:
    """Compiles ahead in `jobs` processes; without them (or once the pool breaks) the
    first launch compiles, as usual."""

    def __init__(self, jobs: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding CUDA
        self.pool = cf.ProcessPoolExecutor(jobs, mp_context=ctx) if jobs > 0 else None
        self.futures: dict[tuple, cf.Future] = {}

    @staticmethod
    def key(tile: Tile, m: int) -> tuple:
        return tile, 1 if m == 1 else m % 16 == 0  # Triton specializes ints on == 1, % 16

    def submit(self, tile: Tile, m: int) -> None:
        """Pointer-kernel tiles only: the TMA kernel's warm-up would need descriptors."""
        if self.pool and tile.persistent < 0 and self.key(tile, m) not in self.futures:
            self.futures[self.key(tile, m)] = self.pool.submit(_compile, tile.kwargs(), m)

    def wait(self, tile: Tile, m: int, deadline: float) -> bool:
        """Until this tile is compiled; False when the deadline passes first."""
        try:
            if fut := self.futures.get(self.key(tile, m)):
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            return False
        except Exception as exc:  # a broken pool
            print(f"precompile pool failed ({type(exc).__name__}: {exc}); compiling here")
            self.close()
        return time.monotonic() < deadline

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool, self.futures = None, {}


class Timer:
    """Median µs of each of a list of launches. On the GPU from CUDA events around each
    launch, all of them queued behind torch.cuda._sleep (longer while the GPU wakes before
    the queue is full), so Python's launch overhead leaves no gaps between the kernels."""

    def __init__(self, count: int, warmup: int, iters: int) -> None:
        self.warmup, self.iters, self.cycles = warmup, iters, 10**7  # ~5 ms on an H100
        if torch.cuda.is_available():
            event = partial(torch.cuda.Event, enable_timing=True)
            self.events = [
                [(event(), event()) for _ in range(warmup + iters)] for _ in range(count)
            ]

    def __call__(self, fns: list[Callable[[], None]]) -> list[float]:
        if not torch.cuda.is_available():  # the interpreter: wall time
            return [self.wall(f) for f in fns]
        while True:
            torch.cuda._sleep(self.cycles)
            gate = torch.cuda.Event()
            gate.record()
            for f, pairs in zip(fns, self.events, strict=True):
                for start, end in pairs:
                    start.record()
                    f()
                    end.record()
            if not gate.query() or self.cycles >= 2**31:  # still asleep: queued in time
                break
            torch.cuda.synchronize()
            self.cycles *= 2
        torch.cuda.synchronize()
        return [
            statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs[self.warmup :])
            for pairs in self.events
        ]

    def wall(self, f: Callable[[], None]) -> float:
        times = []
        for _ in range(self.warmup + self.iters):
            t0 = time.perf_counter()
            f()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times[self.warmup :])


def sweep(args: argparse.Namespace, shapes: dict, m_order: tuple[int, ...]) -> dict:
    deadline = time.monotonic() + args.budget_s
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter lacks bf16
    gen = torch.Generator(dev).manual_seed(0)
    weights, inputs = {}, {}
    for name, (n, k) in shapes.items():  # inputs and outputs O(1), never zeros
        weights[name] = (torch.randn(n, k, device=dev, generator=gen) * k**-0.5).to(dtype)
        if k not in inputs:
            inputs[k] = torch.randn(max(m_order), k, device=dev, generator=gen).to(dtype)
    tma = tma_usable(inputs[next(iter(inputs))])
    fp8 = {name: quantize_weight(w) for name, w in weights.items()} if args.fp8 else None
    itemsize = 1 if fp8 else dtype.itemsize

    def tiles_now(m: int, n: int, k: int) -> Tile:
        return Tile.of(fp8_tiles(m, n, k, tma) if fp8 else tile_config(m, n, itemsize, tma))

    def operands(name: str, x: torch.Tensor) -> Operands:
        if fp8 is None:
            return Operands(x, weights[name])
        xq, xs = quantize_rows_gpu(x)
        return Operands(xq, fp8[name][0], xs, fp8[name][1])

    copies = {  # (--fp8 times one copy: its figures keep the L2 note below)
        name: [w] + [w.clone() for _ in range(ROTATE_BYTES // w.nbytes if fp8 is None else 0)]
        for name, w in weights.items()
    }
    current = {m: {s: tiles_now(m, n, k) for s, (n, k) in shapes.items()} for m in m_order}
    plan = [
        (m, candidates(m, list(current[m].values()), args.small, tma, bool(fp8))) for m in m_order
    ]
    pre = Precompiler(0 if fp8 else args.jobs)  # (its warm-up is the bf16 pointer kernel's)
    timer = Timer(len(shapes), args.warmup, args.iters)
    for m, tiles in plan:
        for tile in tiles:
            pre.submit(tile, m)
    rows, per_m, failed, examples = [], [], Counter(), {}
    first_launch_s, stopped = 0.0, None
    for m, tiles in plan:
        xs = {name: inputs[k][:m] for name, (_, k) in shapes.items()}
        ops = {name: operands(name, x) for name, x in xs.items()}
        if fp8:
            refs = {name: fp8_linear(xs[name], *fp8[name]) for name in weights}
        else:
            refs = {name: linear(xs[name], w) for name, w in weights.items()}
        outs = {name: torch.empty_like(ref) for name, ref in refs.items()}
        timed: dict[Tile, dict[str, tuple[float, bool]]] = {}  # tile: shape: (µs, equal)
        t0, tried = time.monotonic(), 0
        for tile in tiles:
            if not pre.wait(tile, m, deadline):
                stopped = f"out of time at M={m} after {tried} of {len(tiles)} configs"
                break
            tried += 1
            try:
                t1 = time.perf_counter()
                same = {}
                for name in weights:  # compiles (or loads) it, checks the bits
                    launch(tile, ops[name], outs[name])
                    same[name] = torch.equal(outs[name], refs[name])
                first_launch_s += time.perf_counter() - t1
                us = timer([rotating(tile, ops[n], copies[n], outs[n]) for n in weights])
            except Exception as exc:  # out of resources, compile errors
                failed[type(exc).__name__] += 1
                examples.setdefault(type(exc).__name__, f"{tile}: {exc}"[:300])
                continue
            timed[tile] = {name: (u, same[name]) for name, u in zip(weights, us, strict=True)}
        bf16 = bf16_times(m, shapes, xs, weights, tma, timer) if fp8 else {}
        rows += summarize(m, shapes, current[m], timed, itemsize, bf16)
        per_m.append(step_summary(m, current[m], timed))
        per_m[-1] |= dict(configs=len(tiles), failed=tried - len(timed))
        per_m[-1]["seconds"] = round(time.monotonic() - t0, 1)
        print(
            f"M={m}: {len(timed)} of {len(tiles)} configs in {per_m[-1]['seconds']} s", flush=True
        )
        if stopped:
            break
    pre.close()
    return {
        "rows": rows,
        "per_m": per_m,
        "stopped": stopped,
        "failed_configs": dict(failed),
        "failure_examples": examples,
        "first_launch_s": round(first_launch_s, 1),  # load + check; high: the pool missed
    }


def rotating(tile: Tile, ops: Operands, copies: list[torch.Tensor], out: torch.Tensor):
    """A launch of `tile` whose weights are the next of `copies` each call (bf16)."""
    turns = itertools.cycle([ops] if len(copies) == 1 else [Operands(ops.x, w) for w in copies])
    return lambda: launch(tile, next(turns), out)


def bf16_times(m: int, shapes: dict, xs: dict, weights: dict, tma: bool, timer) -> dict:
    """--fp8: each shape's bf16 time with tile_config's tiles, on the same rows (µs)."""
    outs, fns = {}, []
    for name, (n, _) in shapes.items():
        tile = Tile.of(tile_config(m, n, 2, tma))
        outs[name] = torch.empty(m, n, dtype=torch.bfloat16, device=xs[name].device)
        fns.append(partial(launch, tile, Operands(xs[name], weights[name]), outs[name]))
    for f in fns:
        f()
    return dict(zip(shapes, timer(fns), strict=True))


def figures(prefix: str, us: float, m: int, n: int, k: int, itemsize: int) -> dict:
    return {
        f"{prefix}_us": round(us, 2),
        f"{prefix}_weight_tbps": round(n * k * itemsize / us / 1e6, 3),
        f"{prefix}_tflops": round(2 * m * n * k / us / 1e6, 2),
    }


def summarize(
    m: int, shapes: dict, current: dict, timed: dict, itemsize: int, bf16: dict
) -> list[dict]:
    """Per shape: tile_config's tiles against the fastest bit-identical config (and, with
    --fp8, the bf16 kernel's time and both FP8 times' speedup over it)."""
    rows = []
    for name, (n, k) in shapes.items():
        cur, got = current[name], {t: r[name] for t, r in timed.items()}
        ok = sorted((us, t) for t, (us, same) in got.items() if same)
        if cur not in got or not ok:
            continue
        (best_us, best), cur_us = ok[0], got[cur][0]
        rows.append(
            {"M": m, "shape": name, "N": n, "K": k, "configs": len(got), "current": str(cur)}
            | figures("current", cur_us, m, n, k, itemsize)
            | {"best": str(best)}
            | figures("best", best_us, m, n, k, itemsize)
            | {
                "speedup": round(cur_us / best_us, 3),
                "mismatches": [str(t) for t, (_, same) in got.items() if not same],
                "top": [[str(t), round(us, 2)] for us, t in ok[:8]],
            }
        )
        if name in bf16:
            rows[-1] |= {
                "bf16_us": round(bf16[name], 2),
                "fp8_current_speedup": round(bf16[name] / cur_us, 3),
                "fp8_best_speedup": round(bf16[name] / best_us, 3),
            }
    return rows


def step_summary(m: int, current: dict, timed: dict) -> dict:
    """The best single config for this M by a decode step's linear time (LAYERS layers,
    PER_STEP's once), and tile_config's (a tile is timed on all shapes or on none)."""

    def step(tile_of: Callable[[str], Tile]) -> float:
        return round(sum(PER_STEP.get(s, LAYERS) * timed[tile_of(s)][s][0] for s in current), 1)

    out: dict = {"M": m, "configs_timed": len(timed)}
    if all(t in timed for t in current.values()):
        out["current_step_us"] = step(current.__getitem__)
    if ok := [t for t, r in timed.items() if all(same for _, same in r.values())]:
        best = min(ok, key=lambda t: step(lambda _: t))
        out |= {"best_single": str(best), "best_single_step_us": step(lambda _: best)}
    return out


def print_table(res: dict) -> None:
    head = f"{'M':>4} {'shape':13} {'cur us':>9} {'cur TB/s':>8} {'best us':>9} {'best TB/s':>9}"
    print(f"\n{head} {'TFLOPS':>7} {'best config':22} {'speedup':>7}  mismatches")
    for r in res["rows"]:
        print(
            f"{r['M']:4} {r['shape']:13} {r['current_us']:9.1f} {r['current_weight_tbps']:8.2f} "
            f"{r['best_us']:9.1f} {r['best_weight_tbps']:9.2f} {r['best_tflops']:7.1f} "
            f"{r['best']:22} {r['speedup']:7.3f}  {len(r['mismatches'])} "
            + ", ".join(r["mismatches"][:3])
        )
    print("\nper M, one config for all shapes (a step's linear time, µs):")
    for p in res["per_m"]:
        print(
            f"  M={p['M']:<4} {p['configs_timed']}/{p['configs']} configs ({p['failed']} failed) "
            f"in {p['seconds']} s; current {p.get('current_step_us')}, "
            f"best {p.get('best_single')} {p.get('best_single_step_us')}"
        )
    print(f"failed: {res['failed_configs']}; {res['stopped'] or 'sweep complete'}")


def gpu_tag() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    if m := re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name):
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")


def save(name: str, data: dict, out: Path | None) -> Path:
    """bench/results/<name>.json, or the same record at `out`."""
    if out is None:
        return results_io.write_result(name, data)
    record = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "commit": results_io.commit(),
        "device": results_io.device(),
        **data,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=100.0, help="cap of the sweep (s)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--jobs", type=int, help="compile processes (default: CPUs - 2; 0: none)")
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--out", type=Path, help="result file (default bench/results/...)")
    ap.add_argument("--m", help=f"row counts to sweep, in order (default {M_ORDER})")
    ap.add_argument("--fp8", action="store_true", help="the W8A8 kernels (a GPU with FP8)")
    ap.add_argument("--model", choices=("llama3-8b", "moonlight"), default="llama3-8b")
    args = ap.parse_args()
    if args.small:
        args.warmup, args.iters = 1, 3
        args.out = args.out or Path(tempfile.mkdtemp()) / "tune-linear-small.json"
    if args.jobs is None:
        args.jobs = max(1, (os.cpu_count() or 2) - 2) if torch.cuda.is_available() else 0
    shapes, m_order = (SMALL_SHAPES, SMALL_M_ORDER) if args.small else (SHAPES, M_ORDER)
    if args.m:
        m_order = tuple(int(m) for m in args.m.split(","))
    if args.model == "moonlight" and not args.small:
        global LAYERS
        shapes, LAYERS = MOONLIGHT_SHAPES, 27
    if args.fp8:  # the lm head stays bf16 in an FP8 model
        shapes = {name: shape for name, shape in shapes.items() if name != "lm_head"}
        # up to FEW_ROWS rows FP8 runs the few-rows kernel, whose tiles fp8_few_rows.py
        # measured; this sweep covers the pointer and TMA kernels
        m_order = tuple(m for m in m_order if m > FEW_ROWS)
    res = sweep(args, shapes, m_order)
    print_table(res)
    keys = ("budget_s", "warmup", "iters", "jobs", "small", "fp8")
    settings = {k: getattr(args, k) for k in keys}
    settings["m"] = list(m_order)
    notes = (
        f"bf16 weights under {ROTATE_BYTES >> 20} MiB timed over copies in turn (none in L2);"
        " --fp8: one copy, the o (17 MB) and qkv (25 MB) weights fit L2 in part"
    )
    data = {"settings": settings, "notes": notes, **res}
    kind = "tune-linear-fp8" if args.fp8 else "tune-linear"
    kind += "-moonlight" if args.model == "moonlight" else ""
    print("wrote", save(f"{kind}-{gpu_tag()}", data, args.out))


if __name__ == "__main__":
    main()
