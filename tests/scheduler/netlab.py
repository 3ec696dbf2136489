"""A network lab for tests: nodes in their own network namespaces, grouped into
locations, with a fixed round-trip delay added between locations.

    <prefix>-n0  eth0 10.77.0.1 ==veth== v0 -+
    <prefix>-n1  eth0 10.77.0.2 ==veth== v1 -+- br0 (first location)
                                                  |
                                             delay link: RTT + delay_ms
                                                  |
    <prefix>-n2  eth0 10.77.0.3 ==veth== v2 -+- br1 (second location)
    <prefix>-n3  eth0 10.77.0.4 ==veth== v3 -+
                 (bridges, v*, and the delay link live in <prefix>-wan)

All nodes share one subnet and address each other by plain IP; the delay is per
packet, so TCP just sees a longer path. `delay_ms` is the round trip the lab adds
between two locations: each direction is held delay_ms / 2.

The delay link is `tc netem` (delay_ms / 2 on each end of a veth pair joining the two
bridges) where the kernel has sch_netem. Where it has not (this is checked by trying),
it is a relay process in the wan namespace: it owns two TAP devices, one enslaved to
each bridge, and writes every frame read from one to the other delay_ms / 2 later.

Everything lives in namespaces named with a unique prefix; close() (or leaving the
`with` block, also after a failure) kills what runs in them and removes them, which
removes every link, bridge and TAP with them. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)
and nothing else: pyroute2 for netlink and setns(2) for processes, no `ip` binary.

Run as a script, this file is the relay: `python netlab.py relay TAP_A TAP_B DELAY_S`.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import queue
import re
import secrets
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
NETNS_DIR = Path("/var/run/netns")
PREFIX = "omnilab"  # every lab's namespaces: omnilab-<pid>-<random>-...
READY_TIMEOUT_S = 10.0


def unavailable_reason() -> str | None:
    """Why a lab cannot be built here, or None if it can."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, bridges, TAP devices)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    try:
        from pyroute2 import netns  # noqa: F401
    except ImportError:
        return "pyroute2 is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _create_netns(probe)
    except OSError as exc:
        return f"cannot create a network namespace: {exc}"
    _remove_netns(probe)
    return None


def netem_available() -> bool:
    """Whether this kernel has sch_netem (tried on a veth in a throwaway namespace)."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    name = f"{PREFIX}-{os.getpid()}-netem"
    _create_netns(name)
    try:
        with IPRoute(netns=name, flags=0) as ipr:
            ipr.link("add", ifname="x0", kind="veth", peer="x1")
            (index,) = ipr.link_lookup(ifname="x0")
            try:
                ipr.tc("add", "netem", index=index, delay=1000)
            except NetlinkError:
                return False
            return True
    finally:
        _remove_netns(name)


@dataclass(frozen=True)
class LabNode:
    name: str  # n0, n1, ...
    netns: str  # <prefix>-n0
    ip: str
    location: str


class NetLab:
    """`with NetLab({"east": 2, "west": 2}, delay_ms=40) as lab:` four nodes, n0 and n1
    in east, n2 and n3 in west, 40 ms more round trip between east and west.

    `mechanism`: "auto" (netem if the kernel has it, else the relay), "netem" or
    "relay"; afterwards it says which one carries the delay ("none" with no delay link:
    one location, or delay_ms 0 with a plain veth between the bridges)."""

    def __init__(
        self,
        locations: Mapping[str, int],
        delay_ms: float = 0.0,
        *,
        subnet: str = "10.77.0.0/24",
        mechanism: Literal["auto", "netem", "relay"] = "auto",
        host_location: str | None = None,
    ):
        if not 1 <= len(locations) <= 2:
            raise ValueError("the lab joins one or two locations")
        self.locations = dict(locations)
        self.delay_ms = float(delay_ms)
        self.mechanism: str = mechanism
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.wan = f"{self.prefix}-wan"
        network = ipaddress.ip_network(subnet)
        hosts = network.hosts()
        self.prefixlen = network.prefixlen
        self.nodes: list[LabNode] = []
        for location, count in self.locations.items():
            for _ in range(count):
                name = f"n{len(self.nodes)}"
                ip = str(next(hosts))
                self.nodes.append(LabNode(name, f"{self.prefix}-{name}", ip, location))
        # The test's own (root) namespace joins `host_location` at the subnet's last
        # address: processes started the plain way (etcd, an edge) reach every node.
        if host_location is not None and host_location not in self.locations:
            raise ValueError(f"host_location {host_location!r} is not one of the locations")
        self.host_location = host_location
        self.host_ip = str(list(network.hosts())[-1]) if host_location else None
        self.host_ifname = f"olab{secrets.token_hex(3)}" if host_location else None
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self.relay: subprocess.Popen | None = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> NetLab:
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def uses_netem(self) -> bool:
        return self.mechanism == "netem"

    def namespaces(self) -> list[str]:
        """Every namespace of this lab (the wan router's included)."""
        return [self.wan] + [n.netns for n in self.nodes]

    def node(self, name: str) -> LabNode:
        return next(n for n in self.nodes if name in (n.name, n.netns))

    def close(self) -> None:
        """Stop what runs in the lab and remove its namespaces (idempotent)."""
        if self.relay is not None and self.relay.stdin is not None:
            with contextlib.suppress(OSError):
                self.relay.stdin.close()  # the relay exits on EOF
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 2
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _kill_in(self._created)
        for name in reversed(self._created):
            _remove_netns(name)
        self._created.clear()
        self._procs.clear()

    # ------------------------------------------------------------------- processes

    def popen_in(self, where: LabNode | str, argv: Sequence[str], **kwargs: Any):
        """subprocess.Popen of argv inside a lab namespace (a LabNode, or a node's or
        namespace's name). The lab stops it on close() if it still runs."""
        # nsenter, not a preexec_fn calling setns: Python code between fork and exec can
        # deadlock in a process with threads (a gRPC client's, an earlier test's), and the
        # child then never ran (seen once as "the delay relay did not start")
        path = NETNS_DIR / self._netns_name(where)
        proc = subprocess.Popen(["nsenter", f"--net={path}", "--", *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def run_in(
        self, where: LabNode | str, argv: Sequence[str], *, timeout: float = 60, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """subprocess.run of argv inside a lab namespace (output captured as text unless
        told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        with self.popen_in(where, argv, **_popen_kwargs(kwargs)) as proc:
            try:
                out, err = proc.communicate(kwargs.get("input"), timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        if kwargs.get("check"):
            result.check_returncode()
        return result

    def _netns_name(self, where: LabNode | str) -> str:
        if isinstance(where, LabNode):
            return where.netns
        if where in ("wan", self.wan):
            return self.wan
        return self.node(where).netns

    # ------------------------------------------------------------------------ build

    def _build(self) -> None:
        from pyroute2 import IPRoute

        for name in self.namespaces():
            _create_netns(name)
            self._created.append(name)
        locations = list(self.locations)
        with IPRoute(netns=self.wan, flags=0) as wan:
            _up(wan, "lo")
            for i in range(len(locations)):
                wan.link("add", ifname=f"br{i}", kind="bridge", br_stp_state=0)
                _up(wan, f"br{i}")
            for node in self.nodes:
                port = f"v{node.name[1:]}"
                wan.link(
                    "add",
                    ifname=port,
                    kind="veth",
                    peer={"ifname": "eth0", "net_ns_fd": node.netns},
                )
                _enslave(wan, port, f"br{locations.index(node.location)}")
            if len(locations) == 2:
                self._join(wan)
            else:
                self.mechanism = "none"
        if self.host_location is not None:
            self._host_link(locations.index(self.host_location))
        for node in self.nodes:
            with IPRoute(netns=node.netns, flags=0) as ipr:
                _up(ipr, "lo")
                (eth0,) = ipr.link_lookup(ifname="eth0")
                ipr.addr("add", index=eth0, address=node.ip, prefixlen=self.prefixlen)
                ipr.link("set", index=eth0, state="up")

    def _host_link(self, bridge: int) -> None:
        """A veth from the root namespace into a location's bridge; it goes with the wan
        namespace (a veth pair dies with either end)."""
        from pyroute2 import IPRoute

        with IPRoute() as host:
            host.link(
                "add",
                ifname=self.host_ifname,
                kind="veth",
                peer={"ifname": "vh", "net_ns_fd": self.wan},
            )
            (index,) = host.link_lookup(ifname=self.host_ifname)
            host.addr("add", index=index, address=self.host_ip, prefixlen=self.prefixlen)
            host.link("set", index=index, state="up")
        with IPRoute(netns=self.wan, flags=0) as wan:
            _enslave(wan, "vh", f"br{bridge}")

    def _join(self, wan: Any) -> None:
        """The link between br0 and br1, carrying the delay."""
        if self.delay_ms <= 0:
            self.mechanism = "none"
            self._veth_link(wan)
        elif self.mechanism == "relay" or not self._netem_link(wan):
            self.mechanism = "relay"
            self._relay_link(wan)
        else:
            self.mechanism = "netem"

    def _veth_link(self, wan: Any) -> None:
        wan.link("add", ifname="x0", kind="veth", peer="x1")
        _enslave(wan, "x0", "br0")
        _enslave(wan, "x1", "br1")

    def _netem_link(self, wan: Any) -> bool:
        """A veth pair with netem holding each direction delay_ms / 2 on its way out;
        False (and no link) where the kernel has no sch_netem and mechanism is "auto"."""
        from pyroute2.netlink.exceptions import NetlinkError

        wan.link("add", ifname="x0", kind="veth", peer="x1")
        try:
            for end in ("x0", "x1"):
                (index,) = wan.link_lookup(ifname=end)
                wan.tc("add", "netem", index=index, delay=round(self.delay_ms * 500))  # us
        except NetlinkError as exc:
            (index,) = wan.link_lookup(ifname="x0")
            wan.link("del", index=index)  # its peer goes with it
            if self.mechanism == "netem":
                raise RuntimeError(f"tc netem is not available: {exc}") from exc
            return False
        _enslave(wan, "x0", "br0")
        _enslave(wan, "x1", "br1")
        return True

    def _relay_link(self, wan: Any) -> None:
        """TAP t0 on br0, t1 on br1, and the relay process between them."""
        relay = [sys.executable, str(Path(__file__).resolve()), "relay", "t0", "t1"]
        self.relay = self.popen_in(
            self.wan,
            [*relay, repr(self.delay_ms / 2000)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = _readline(self.relay, READY_TIMEOUT_S)
        if line.strip() != "ready":
            raise RuntimeError(f"the delay relay did not start: {line!r}")
        _enslave(wan, "t0", "br0")
        _enslave(wan, "t1", "br1")


# ---------------------------------------------------------------------- helpers


def _popen_kwargs(kwargs: dict) -> dict:
    out = {k: v for k, v in kwargs.items() if k not in ("capture_output", "check", "input")}
    if kwargs.get("capture_output"):
        out["stdout"] = out["stderr"] = subprocess.PIPE
    if kwargs.get("input") is not None:
        out["stdin"] = subprocess.PIPE
    return out


def _create_netns(name: str) -> None:
    from pyroute2 import netns

    netns.create(name)


def _remove_netns(name: str) -> None:
    from pyroute2 import netns

    with contextlib.suppress(OSError):
        netns.remove(name)


def _kill_in(names: Sequence[str]) -> None:
    """SIGKILL whatever still runs in these namespaces (all started by this lab's user:
    the namespaces are its own), so that removing them frees them."""
    from pyroute2 import netns

    for name, pids in netns.ns_pids().items():
        if name in names:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def sweep_stale() -> None:
    """Remove the namespaces of labs whose process died without closing them."""
    from pyroute2 import netns

    stale = []
    for name in netns.listnetns():
        match = re.fullmatch(rf"{PREFIX}-(\d+)-.+", name)
        if match and not _alive(int(match.group(1))):
            stale.append(name)
    if stale:
        _kill_in(stale)
        for name in stale:
            _remove_netns(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _up(ipr: Any, ifname: str) -> None:
    (index,) = ipr.link_lookup(ifname=ifname)
    ipr.link("set", index=index, state="up")


def _enslave(ipr: Any, ifname: str, bridge: str) -> None:
    (index,) = ipr.link_lookup(ifname=ifname)
    (master,) = ipr.link_lookup(ifname=bridge)
    ipr.link("set", index=index, master=master, state="up")


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line of proc's stdout, "" at EOF or after timeout_s."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return proc.stdout.readline()


# ---------------------------------------------------------------------- the relay


def open_tap(name: str) -> int:
    """An fd on a new TAP device `name` (frames without packet info). The device lives
    while the fd is open, in the netns of the process that opened it."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def relay(tap_a: str, tap_b: str, delay_s: float) -> None:
    """Forward every frame between two TAP devices, each one delay_s after it was read.
    Per direction a thread reads and a thread writes; the delay is the same for every
    frame, so a FIFO keeps them in order, and the writer sleeps (time.sleep: to the
    tens of microseconds; an event loop's timers round up to the millisecond) until the
    oldest frame is due. Exits when stdin closes (the lab closed, or its process died)."""
    fd_a, fd_b = open_tap(tap_a), open_tap(tap_b)
    with contextlib.suppress(OSError):
        os.nice(-10)  # the wire: ahead of the lab's own busy processes on a small host

    def read(src: int, fifo: queue.SimpleQueue) -> None:
        while True:
            try:
                frame = os.read(src, 65536)
            except OSError:  # not up yet
                time.sleep(0.01)
                continue
            fifo.put((time.monotonic() + delay_s, frame))

    def write(dst: int, fifo: queue.SimpleQueue) -> None:
        while True:
            due, frame = fifo.get()
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            with contextlib.suppress(OSError):  # device down: a lost frame, as on a wire
                os.write(dst, frame)

    for src, dst in ((fd_a, fd_b), (fd_b, fd_a)):
        fifo: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=read, args=(src, fifo), daemon=True).start()
        threading.Thread(target=write, args=(dst, fifo), daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "relay":
        sys.exit(f"usage: {sys.argv[0]} relay TAP_A TAP_B DELAY_S")
    relay(sys.argv[2], sys.argv[3], float(sys.argv[4]))
