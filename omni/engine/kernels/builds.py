"""Triton kernel builds in this process: how many, how long, which variants.

A step whose kernel has no build for its arguments' specialization waits while Triton
compiles one (about a second) or loads it from its disk cache. The warm-up builds what
steps need before the first request; a build after it is a variant the warm-up missed,
and a stall some request paid for. Each one is logged once the engine calls
`mark_warm`, and /health and the benchmarks report the count.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Build:
    seq: int  # 1, 2, ... in the order they finished
    kernel: str
    seconds: float
    variant: str  # Triton's signature of the specialization: argument types, alignment


class BuildLog:
    """Fed by Triton's JIT hooks, called around every build on the launching thread."""

    def __init__(self, keep: int = 64) -> None:
        self.count = 0
        self.seconds = 0.0
        self.recent: deque[Build] = deque(maxlen=keep)
        self.warm = False
        self._started: dict[str, tuple[float, str, str]] = {}
        self._lock = threading.Lock()

    def before(self, *args, **kw) -> bool:
        name, variant = getattr(kw.get("fn"), "name", "?"), str(kw.get("repr", "?"))
        constants = (kw.get("compile") or {}).get("constants")
        if constants:  # the constexpr values: the repr leaves them out
            variant += f" constants={constants}"
        with self._lock:
            self._started[repr(kw.get("key"))] = (time.perf_counter(), name, variant)
        return False  # False: Triton goes on and builds it

    def after(self, *args, **kw) -> bool:
        now = time.perf_counter()
        with self._lock:
            t0, name, variant = self._started.pop(repr(kw.get("key")), (now, "?", "?"))
            self.count += 1
            self.seconds += now - t0
            build = Build(self.count, name, now - t0, variant[:800])
            self.recent.append(build)
        if self.warm:
            log.warning("a step waited %.2f s for a Triton build: %s", build.seconds, variant)
        return False

    def since(self, seq: int) -> list[Build]:
        """The kept builds after the seq-th one."""
        with self._lock:
            return [b for b in self.recent if b.seq > seq]


BUILDS = BuildLog()


def install() -> bool:
    """Count this process's builds from now on; False where this Triton has no hooks or
    someone else holds them."""
    try:
        import triton

        knobs = triton.knobs.runtime
    except (ImportError, AttributeError):
        return False
    if knobs.jit_cache_hook in (None, BUILDS.before) and knobs.jit_post_compile_hook in (
        None,
        BUILDS.after,
    ):
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = BUILDS.before, BUILDS.after
        return True
    return False


def mark_warm() -> None:
    """The warm-up is over: log every build from now on."""
    BUILDS.warm = True
