"""The latency map: every node measures its round-trip time to every other node over the
real network, and the scheduler aggregates the rows by location for placement and
routing (scheduler/latency.py). Here: the probes, a node's row in etcd, the map's
published form (`LatencyMap`) and its reading, for the nodes, the edge and omnictl.

Keys (JSON values):
    /omni/latency/<node>    that node's row {"at": unix time, "rtt_s": {peer: seconds or
                            null}}, under the node's lease: a dead node's row goes with it
    /omni/latencymap        the scheduler's aggregate (LatencyMap.to_json)

A probe is a TCP connect to the peer's inference port: connect() returns when the
SYN/ACK arrives, so its duration is one round trip, measured on the path requests take,
with no ICMP (often filtered) and no cooperation from the peer beyond listening. The
median of a few connects drops the outliers (the first one also pays for ARP).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aetcd
import orjson

from .state import PREFIX, ClusterStore

log = logging.getLogger(__name__)

LATENCY = PREFIX + b"latency/"
LATENCY_MAP = PREFIX + b"latencymap"
DEFAULT_LOCATION = "default"  # what scheduler/service.py assumes for a node that names none

Row = dict[str, float | None]  # peer id -> RTT in seconds; None: probed, no answer
Peers = Mapping[str, tuple[str, int]]  # peer id -> (host, port)


async def tcp_rtt(host: str, port: int, *, samples: int = 5, timeout: float = 1.0) -> float | None:
    """Median TCP connect time to host:port in seconds (SYN -> SYN/ACK: one round trip),
    or None if no connect completed. A refused or unroutable connect ends the probe at
    once (it would fail the same way again); a timeout is retried (a lost packet)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout
        )
    except (OSError, TimeoutError):
        return None  # resolved before timing: DNS is not part of the round trip
    family, _, proto, _, address = infos[0]
    times = []
    for _ in range(samples):
        sock = socket.socket(family, socket.SOCK_STREAM, proto)
        sock.setblocking(False)
        try:
            start = time.perf_counter()
            await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
            times.append(time.perf_counter() - start)
        except TimeoutError:
            continue
        except OSError:
            break
        finally:
            sock.close()
    return statistics.median(times) if times else None


def peers_from_nodes(
    records: Mapping[str, dict], exclude: str | None = None
) -> dict[str, tuple[str, int]]:
    """The peers to probe from the node records in etcd: each node's inference address,
    from its "url" (the port requests go to)."""
    peers: dict[str, tuple[str, int]] = {}
    for node_id, rec in records.items():
        if node_id == exclude or not rec.get("url"):
            continue
        url = urlsplit(rec["url"])
        if url.hostname:
            peers[node_id] = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    return peers


class Prober:
    """One node's view: it probes every peer each `interval_s` and keeps the latest row.

    `peers` is a mapping or a callable returning one, read each round, so the set can
    follow the nodes announced in etcd. `publish`, if given, is awaited with each new
    row (e.g. functools.partial(publish_row, store, node_id, lease=lease)); a failure
    there is logged and the next round tries again.
    """

    def __init__(
        self,
        node_id: str,
        peers: Peers | Callable[[], Peers],
        *,
        interval_s: float = 10.0,
        samples: int = 5,
        timeout_s: float = 1.0,
        publish: Callable[[Row], Awaitable[None]] | None = None,
    ):
        self.node_id, self.peers = node_id, peers
        self.interval_s, self.samples, self.timeout_s = interval_s, samples, timeout_s
        self.publish = publish
        self.row: Row = {}

    def _current_peers(self) -> dict[str, tuple[str, int]]:
        peers = self.peers() if callable(self.peers) else self.peers
        return {p: addr for p, addr in peers.items() if p != self.node_id}

    async def probe_once(self) -> Row:
        """Probe all peers at once (a round lasts as long as the slowest peer)."""
        peers = self._current_peers()
        rtts = await asyncio.gather(
            *(
                tcp_rtt(host, port, samples=self.samples, timeout=self.timeout_s)
                for host, port in peers.values()
            )
        )
        self.row = dict(zip(peers, rtts, strict=True))
        return self.row

    async def run(self) -> None:
        """Probe and publish every `interval_s` until cancelled."""
        while True:
            started = time.monotonic()
            row = await self.probe_once()
            if self.publish is not None:
                try:
                    await self.publish(row)
                except Exception as exc:  # etcd hiccup: the next round publishes again
                    log.warning("latency row of %s not published: %s", self.node_id, exc)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))


# ------------------------------------------------------------------------ the map


@dataclass
class LatencyMap:
    """The rows of all nodes, and where each node is. Each directed measurement a->b is
    one sample of the path between a's and b's locations; RTT is symmetric, so
    matrix()[x][y] == matrix()[y][x]."""

    rows: dict[str, Row]
    locations: dict[str, str]  # node -> location; a node missing here is DEFAULT_LOCATION
    at: float = field(default_factory=time.time)

    def location_of(self, node: str) -> str:
        return self.locations.get(node, DEFAULT_LOCATION)

    def node_rtt(self, a: str, b: str) -> float | None:
        """RTT between two nodes: the mean of a's probe of b and b's of a (either alone
        when only one answered), None if neither did."""
        if a == b:
            return 0.0
        both = (self.rows.get(a, {}).get(b), self.rows.get(b, {}).get(a))
        seen = [v for v in both if v is not None]
        return statistics.fmean(seen) if seen else None

    def matrix(self) -> dict[str, dict[str, float]]:
        """Location x location median RTT in seconds; a pair with no measurement between
        them (e.g. a location of one node with itself) is absent."""
        samples: dict[tuple[str, str], list[float]] = {}
        for a, row in self.rows.items():
            for b, rtt in row.items():
                if rtt is None or a == b:
                    continue
                pair = tuple(sorted((self.location_of(a), self.location_of(b))))
                samples.setdefault(pair, []).append(rtt)
        out: dict[str, dict[str, float]] = {}
        for (x, y), values in sorted(samples.items()):
            median = statistics.median(values)
            out.setdefault(x, {})[y] = median
            out.setdefault(y, {})[x] = median
        return out

    def location_rtt(self, x: str, y: str) -> float | None:
        return self.matrix().get(x, {}).get(y)

    def to_json(self) -> bytes:
        """The published form: the matrix (for readers that only want it), and the rows
        and locations it came from (from_json rebuilds the map from those)."""
        nodes = set(self.rows) | {p for row in self.rows.values() for p in row}
        return orjson.dumps(
            {
                "at": self.at,
                "matrix": self.matrix(),
                "locations": {n: self.location_of(n) for n in sorted(nodes)},
                "rows": self.rows,
            },
            option=orjson.OPT_SORT_KEYS,
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> LatencyMap:
        value = orjson.loads(data)
        return cls(value["rows"], value["locations"], value.get("at", 0.0))


# ------------------------------------------------------------------------ etcd


def _row_key(node_id: str) -> bytes:
    if not node_id or "/" in node_id:
        raise ValueError(f"bad node id {node_id!r}")
    return LATENCY + node_id.encode()


async def publish_row(
    store: ClusterStore, node_id: str, row: Row, *, lease: aetcd.Lease | None = None
) -> None:
    """Write this node's row; under the node's lease, it goes when the node does."""
    value = orjson.dumps({"at": time.time(), "rtt_s": row})
    await store.client.put(_row_key(node_id), value, lease=lease)


async def read_map(store: ClusterStore) -> LatencyMap | None:
    """The map the scheduler last published, None before the first."""
    kv = await store.client.get(LATENCY_MAP)
    return LatencyMap.from_json(kv.value) if kv is not None else None


# ------------------------------------------------------------------------ CLI


def _peer(value: str) -> tuple[str, tuple[str, int]]:
    peer_id, sep, address = value.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not peer_id or not colon or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: expected ID=HOST:PORT")
    return peer_id, (host.strip("[]"), int(port))


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni.cluster.latency", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("probe", help="probe peers once, print the row as JSON")
    probe.add_argument("--peer", type=_peer, action="append", default=[], help="ID=HOST:PORT")
    probe.add_argument("--samples", type=int, default=5)
    probe.add_argument("--timeout", type=float, default=1.0, help="seconds per connect")
    args = parser.parse_args(None if argv is None else list(argv))
    prober = Prober("", dict(args.peer), samples=args.samples, timeout_s=args.timeout)
    row = asyncio.run(prober.probe_once())
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.write(orjson.dumps(row).decode() + "\n")


if __name__ == "__main__":
    main()
