"""omni-scheduler: a placeholder process so its unit and console script exist already.

Placement and autoscaling are a later issue; until then it only waits to be stopped.
"""

from __future__ import annotations

import logging
import signal
import threading

from omni.logs import setup_logging

log = logging.getLogger("omni-scheduler")


def main() -> None:
    setup_logging("omni-scheduler")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: stop.set())
    log.info("scheduler: nothing to place yet")
    stop.wait()
    log.info("scheduler: stopping")


if __name__ == "__main__":
    main()
