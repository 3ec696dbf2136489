"""Bring up loopback, and nothing else, in a sandbox's fresh network namespace.

Done from omnid, which has pyroute2 loaded already: a short-lived thread
enters the namespace with setns (which moves only that thread), opens the
netlink socket there and hands it to pyroute2. The launcher stays free of
pyroute2's import cost, and no helper process is forked.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading

from pyroute2 import IPRoute

CLONE_NEWNET = 0x40000000
NETLINK_ROUTE = 0
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _netlink_socket_in(pid: int) -> socket.socket:
    """A NETLINK_ROUTE socket that lives in `pid`'s network namespace."""
    result: dict = {}

    def work() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            _setns(target)
            try:
                result["sock"] = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE)
            finally:
                _setns(own)
        except OSError as exc:
            result["error"] = exc
        finally:
            os.close(own)
            os.close(target)

    thread = threading.Thread(target=work, name="omni-netns")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["sock"]


def loopback_up(pid: int) -> None:
    fd = _netlink_socket_in(pid).detach()  # pyroute2 owns and closes it
    with IPRoute(fileno=fd) as ipr:
        (lo,) = ipr.link_lookup(ifname="lo")
        ipr.link("set", index=lo, state="up")
