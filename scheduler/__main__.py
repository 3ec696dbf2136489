"""omni-scheduler: places the cluster's models on the nodes announced in etcd.

Several replicas may run; one leads (an etcd lease), the others stand by.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from pathlib import Path

from omni.logs import setup_logging

log = logging.getLogger("omni-scheduler")


async def run(args: argparse.Namespace) -> None:
    from .membership import parse_endpoint
    from .service import Scheduler, load_models
    from .state import ClusterStore

    models = load_models(args.models) if args.models else []
    store = ClusterStore(*parse_endpoint(args.etcd))
    scheduler = Scheduler(store, args.name, models, args.interval, args.lease_ttl)
    task = asyncio.create_task(scheduler.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("scheduler %s: %d models, etcd %s", args.name, len(models), args.etcd)
    await stop.wait()
    task.cancel()
    await scheduler.election.resign()  # a standby takes over now, not a lease later
    await store.close()
    log.info("scheduler: stopping")


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="omni-scheduler", description=__doc__)
    parser.add_argument("--etcd", default=env("OMNI_ETCD", "127.0.0.1:2379"), help="HOST:PORT")
    parser.add_argument(
        "--models",
        type=Path,
        default=env("OMNI_SCHEDULER_MODELS"),
        help="TOML: [[models]] name, path, quota, replicas, constraints",
    )
    parser.add_argument("--name", default=env("OMNI_SCHEDULER_NAME") or socket.gethostname())
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between rounds")
    parser.add_argument("--lease-ttl", type=int, default=10, help="leadership lease, seconds")
    args = parser.parse_args(argv)
    setup_logging("omni-scheduler")
    try:
        asyncio.run(run(args))
    except ValueError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
