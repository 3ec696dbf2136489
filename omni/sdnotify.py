"""sd_notify(3) without libsystemd: tell systemd we are ready, alive or stopping.

A Type=notify unit is "started" only once the daemon says READY=1, so units ordered
after omnid wait for its sockets rather than for its process to exist; with
WatchdogSec= systemd restarts a daemon that stops sending WATCHDOG=1. Outside
systemd (no $NOTIFY_SOCKET) every call here is a no-op, so callers need no checks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

_warned = False


def _address(raw: str) -> str | bytes:
    """'@name' is Linux's abstract namespace: a leading NUL byte on the wire."""
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    return raw


def notify(*states: str) -> bool:
    """Send `states` ("READY=1", "STATUS=...") as one datagram; True if it was sent.

    Never raises: a lost notification must not take the daemon down with it (systemd
    then acts on its own timeouts), so a failure is logged once and answered False.
    """
    global _warned
    raw = os.environ.get("NOTIFY_SOCKET")
    if not raw:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # The daemon calls this from its event loop: never block it for long.
            sock.settimeout(1.0)
            sock.connect(_address(raw))
            sock.sendall("\n".join(states).encode())
        return True
    except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
        if not _warned:
            _warned = True
            log.warning("sd_notify to %r failed: %s (further failures not logged)", raw, exc)
        return False


def watchdog_interval_s() -> float | None:
    """How often to send WATCHDOG=1: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3)
    advises, so one late ping is not fatal. None when there is no watchdog for us
    ($WATCHDOG_PID names another process, e.g. a parent that exec'd us is not us)."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    try:
        if pid and int(pid) != os.getpid():
            return None
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


async def watchdog(healthy: Callable[[], bool]) -> None:
    """Ping systemd's watchdog forever while `healthy()` holds; run it as a task.

    Running on the event loop is the point: a blocked loop sends nothing. A failing
    check (false or raising) skips the ping, so systemd restarts a daemon that is
    alive but wedged. Returns at once where the unit has no WatchdogSec=.
    """
    interval = watchdog_interval_s()
    if interval is None:
        return
    while True:
        if _passes(healthy):
            notify("WATCHDOG=1")
        await asyncio.sleep(interval)


def _passes(healthy: Callable[[], bool]) -> bool:
    try:
        if healthy():
            return True
    except Exception:
        log.exception("watchdog: health check raised; not pinging systemd")
        return False
    log.warning("watchdog: health check failed; not pinging systemd")
    return False
