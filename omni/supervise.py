"""Keep `omni serve`'s processes running: one that exits is started again, with backoff.

A component that exits is started again, with the same argv, 0.5 s later, the
delay doubling per restart up to 30 s and back to 0.5 s once a start has stayed
up 60 s; the others keep running. Each restart is one line on stderr.

Restarting is given up (`GaveUp`; `omni serve` then stops everything and exits 1):
- at once when a component exits with status 2, bad flags or a bad config, which
  another start would not fix;
- after 5 starts in a row that exited before their /healthz ever answered: a
  crash loop. Any HTTP answer counts as up (the edge answers 503 while omnid
  is away, and it is serving).
A component that stays running but stops answering is left alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from omni.proc import die_with_parent

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # up this long, the next restart waits BACKOFF_MIN_S again
GIVE_UP_STARTS = 5  # starts in a row that never answered /healthz
USAGE_EXIT = 2  # argparse's and omnid's status for bad flags or config
STOP_GRACE_S = 15.0  # omnid's stop: its instances' 5 s grace, then their teardown


class GaveUp(Exception):
    """A component that restarting will not fix; the message says why."""


def spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGTERM),
    )


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each, then SIGKILL the process group of any still there after the grace."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def answers(url: str) -> bool:
    """Whether an HTTP server answers at `url`, whatever its status."""
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


@dataclass
class Component:
    """One supervised process: `check()` it often, it restarts itself when due."""

    name: str
    argv: list[str]
    health_url: str
    proc: subprocess.Popen | None = None
    started: float = 0.0
    up: bool = False  # /healthz has answered since this start
    restarts: int = 0  # since a start last stayed up STABLE_S
    failed_starts: int = 0  # in a row, exited before /healthz answered
    restart_at: float | None = None

    def start(self) -> None:
        self.proc = spawn(self.argv)
        self.started, self.up, self.restart_at = time.monotonic(), False, None

    def check(self) -> str | None:
        """Start it again when due, note it up or exited; returns a line to announce."""
        if self.restart_at is not None:
            if time.monotonic() >= self.restart_at:
                self.start()
            return None
        code = self.proc.poll()
        if code is None:
            if not self.up and answers(self.health_url):
                self.up, self.failed_starts = True, 0
            return None
        return self._exited(code)

    def _exited(self, code: int) -> str:
        now = time.monotonic()
        how = f"{self.name} (pid {self.proc.pid}) {describe_exit(code)}"
        if code == USAGE_EXIT:
            raise GaveUp(f"{how}: bad flags or config; not restarting it")
        if not self.up:
            self.failed_starts += 1
        if self.failed_starts >= GIVE_UP_STARTS:
            raise GaveUp(
                f"{how}; its last {self.failed_starts} starts never answered "
                f"{self.health_url}: giving up"
            )
        if now - self.started >= STABLE_S:
            self.restarts = 0
        delay = min(BACKOFF_MIN_S * 2 ** min(self.restarts, 16), BACKOFF_MAX_S)
        self.restarts += 1
        self.restart_at = now + delay
        return f"{how} after {now - self.started:.1f} s; restarting it in {delay:g} s"
