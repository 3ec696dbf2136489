"""omni-scheduler: places the cluster's models on the nodes announced in etcd, scaled by
their load, and publishes the latency map.

Several replicas may run; one leads (an etcd lease), the others stand by. Each one
listens for the nodes' load telemetry and keeps it in its history file; the leader
tells the nodes (in etcd) to report to it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sqlite3
from pathlib import Path

from omni.logs import setup_logging

log = logging.getLogger("omni-scheduler")

DEFAULT_HISTORY = "/var/lib/omni/scheduler/history.sqlite"
WILDCARDS = ("", "0.0.0.0", "::")


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" (ValueError names the flag)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what} {value!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def join_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def advertised_host(listen_host: str, etcd_host: str) -> str:
    """The address nodes should dial for a server listening on `listen_host`: that host if
    it is a specific one; for a wildcard, this host's name's address, unless that is a
    loopback (Debian maps the hostname to 127.0.1.1), then the source address of the
    route to etcd (the nodes reach etcd, so likely this network too)."""
    if listen_host not in WILDCARDS:
        return listen_host
    hostname = None
    with contextlib.suppress(OSError):
        hostname = socket.gethostbyname(socket.gethostname())
    if hostname and not _loopback(hostname):
        return hostname
    with contextlib.suppress(OSError):
        info = socket.getaddrinfo(etcd_host, 2379, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])  # UDP: picks the route and source address, sends nothing
            return s.getsockname()[0]
    return hostname or "127.0.0.1"


async def run(args: argparse.Namespace) -> None:
    # Here, not at the top: gRPC, aetcd and the telemetry messages load only to run, not
    # for --help nor for the address helpers above.
    from omni.cluster.membership import parse_endpoint
    from omni.cluster.state import ClusterStore

    from .autoscale import AutoscaleConfig
    from .history import HistoryStore
    from .service import ClusterScheduler, load_models
    from .telemetry import TelemetryServer

    models = load_models(args.models) if args.models else []
    etcd_host, etcd_port = parse_endpoint(args.etcd)
    listen_host, listen_port = parse_hostport(args.telemetry_listen, "--telemetry-listen")
    if args.advertise_telemetry:
        parse_hostport(args.advertise_telemetry, "--advertise-telemetry")
    if args.telemetry_resolution <= 0:
        raise ValueError("--telemetry-resolution must be > 0")
    try:
        args.history.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--history {args.history}: {exc}") from None
    try:
        history = HistoryStore(args.history, resolution_s=args.telemetry_resolution)
    except sqlite3.Error as exc:  # not writable, not a database
        raise ValueError(f"--history {args.history}: {exc}") from None
    server = TelemetryServer(history)
    try:
        bound = await server.start(listen_host, listen_port)
    except Exception as exc:  # grpc: RuntimeError when the port cannot be bound
        await server.stop(0)
        history.close()
        raise ValueError(f"--telemetry-listen {args.telemetry_listen}: {exc}") from None
    target = args.advertise_telemetry or join_hostport(
        advertised_host(listen_host, etcd_host), bound
    )
    store = ClusterStore(etcd_host, etcd_port)
    scheduler = ClusterScheduler(
        store,
        args.name,
        models,
        args.interval,
        args.lease_ttl,
        history=history,
        telemetry_target=target,
        autoscale=AutoscaleConfig(),
    )
    task = asyncio.create_task(scheduler.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "scheduler %s: %d models, etcd %s, telemetry at %s, history %s",
        args.name,
        len(models),
        args.etcd,
        target,
        args.history,
    )
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    failed = task.done() and not task.cancelled() and task.exception()
    stopping.cancel()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    log.info("scheduler: stopping")
    with contextlib.suppress(Exception):  # a standby takes over now, not a lease later
        await scheduler.election.resign()
    await server.stop()
    history.close()
    await store.close()
    if failed:
        raise failed


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="omni-scheduler", description=__doc__)
    parser.add_argument("--etcd", default=env("OMNI_ETCD", "127.0.0.1:2379"), help="HOST:PORT")
    parser.add_argument(
        "--models",
        type=Path,
        default=env("OMNI_SCHEDULER_MODELS"),
        help="TOML: [[models]] name, path, version, quota, replicas (the minimum), "
        "max_replicas, constraints",
    )
    parser.add_argument("--name", default=env("OMNI_SCHEDULER_NAME") or socket.gethostname())
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between rounds")
    parser.add_argument("--lease-ttl", type=int, default=10, help="leadership lease, seconds")
    parser.add_argument(
        "--telemetry-listen",
        default="0.0.0.0:7701",
        help="HOST:PORT the nodes' telemetry streams come to (port 0: any free one)",
    )
    parser.add_argument(
        "--advertise-telemetry",
        help="HOST:PORT the nodes should dial, published in etcd while this replica leads "
        "[default: this host's address and the bound port]",
    )
    parser.add_argument(
        "--history",
        type=Path,
        default=Path(env("OMNI_SCHEDULER_HISTORY") or DEFAULT_HISTORY),
        help="the load history (sqlite; its directory is created) [$OMNI_SCHEDULER_HISTORY]",
    )
    parser.add_argument(
        "--telemetry-resolution",
        type=float,
        default=10.0,
        help="seconds per history interval (fixed for a history file; the nodes report every 10 s)",
    )
    args = parser.parse_args(argv)
    setup_logging("omni-scheduler")
    try:
        asyncio.run(run(args))
    except ValueError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
