"""How omnid and the edge take part in the cluster: a node announces itself in etcd for
as long as it lives and runs what the scheduler places on it; an edge follows the
announced nodes to route to them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from .state import NODES, PLACEMENTS, ClusterStore

log = logging.getLogger(__name__)

RETRY_S = 2.0


def parse_endpoint(value: str) -> tuple[str, int]:
    """ "host:port" of an etcd client endpoint (ValueError names the problem)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {value!r}: expected HOST:PORT")
    return host, int(port)


class Announcement:
    """This node's key in etcd, under a lease renewed while omnid runs; revoked on a clean
    stop, so the node disappears at once instead of one TTL later."""

    def __init__(self, endpoint: str, node: dict, ttl_s: int):
        host, port = parse_endpoint(endpoint)
        self.store = ClusterStore(host, port)
        self.node, self.ttl_s = node, ttl_s
        self.lease = None

    async def start(self) -> None:
        self.lease = await self.store.register_node(self.node, self.ttl_s)
        log.info("announced node %s in etcd (lease %ds)", self.node["id"], self.ttl_s)

    async def stop(self) -> None:
        if self.lease is not None:
            with contextlib.suppress(Exception):
                await self.lease.revoke()
        await self.store.close()


async def follow_prefix(endpoint: str, prefix: bytes) -> AsyncIterator[dict[str, dict]]:
    """Everything under `prefix` (key rest -> value) now and after each change, until
    the caller stops. The watch starts right after the read's revision, so no change in
    between is lost; after an etcd failure it reconnects and starts from a fresh read."""
    host, port = parse_endpoint(endpoint)
    while True:
        store = ClusterStore(host, port)
        try:
            view, revision = await store.read_prefix(prefix)
            yield dict(view)
            async for change in store.watch(prefix, after=revision):
                if change.value is None:
                    view.pop(change.key, None)
                else:
                    view[change.key] = change.value
                yield dict(view)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # etcd down or unreachable: the last view holds, retry
            log.warning("following %s in etcd failed: %s; retrying", prefix.decode(), exc)
        finally:
            with contextlib.suppress(Exception):
                await store.close()
        await asyncio.sleep(RETRY_S)


async def follow_key(endpoint: str, key: bytes) -> AsyncIterator[dict | None]:
    """One key's value (None while it is absent) now and after each change, until the
    caller stops: follow_prefix, keeping the key itself."""
    async for view in follow_prefix(endpoint, key):
        yield view.get("")


async def follow_nodes(endpoint: str, on_change: Callable[[dict[str, dict]], None]) -> None:
    """Call `on_change` with every announced node (id -> its record) now and after each
    change, until cancelled."""
    async for nodes in follow_prefix(endpoint, NODES):
        on_change(nodes)


async def follow_placements(
    endpoint: str, node_id: str, apply: Callable[[str, dict | None], Awaitable[None]]
) -> None:
    """Call `apply(model, None)` for each placement of this node that goes and
    `apply(model, spec)` for each one there, after every change, until cancelled
    (`apply` is idempotent: one that failed is tried again)."""
    applied: set[str] = set()
    async for placed in follow_prefix(endpoint, PLACEMENTS + node_id.encode() + b"/"):
        for model in applied - set(placed):
            await apply(model, None)
        for model, spec in placed.items():
            await apply(model, spec)
        applied = set(placed)
