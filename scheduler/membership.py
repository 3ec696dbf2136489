"""How omnid and the edge take part in the cluster: a node announces itself in etcd for
as long as it lives and runs what the scheduler places on it; an edge follows the
announced nodes to route to them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

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


async def follow_nodes(endpoint: str, on_change: Callable[[dict[str, dict]], None]) -> None:
    """Call `on_change` with every announced node (id -> its record) now and after each
    change, until cancelled; reconnects after etcd failures."""
    host, port = parse_endpoint(endpoint)
    while True:
        store = ClusterStore(host, port)
        try:
            nodes = await store.nodes()
            on_change(dict(nodes))
            async for change in store.watch(NODES):
                if change.value is None:
                    nodes.pop(change.key, None)
                else:
                    nodes[change.key] = change.value
                on_change(dict(nodes))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # etcd down or unreachable: keep the last view, retry
            log.warning("following nodes in etcd failed: %s; retrying", exc)
        finally:
            with contextlib.suppress(Exception):
                await store.close()
        await asyncio.sleep(RETRY_S)


async def follow_placements(
    endpoint: str, node_id: str, apply: Callable[[str, dict | None], Awaitable[None]]
) -> None:
    """Call `apply(model, spec)` for each placement of this node now and as they change
    (`spec` None: removed), until cancelled; reconnects after etcd failures, replaying
    the full set (apply must be idempotent)."""
    host, port = parse_endpoint(endpoint)
    prefix = PLACEMENTS + node_id.encode() + b"/"
    applied: set[str] = set()
    while True:
        store = ClusterStore(host, port)
        try:
            current = await store.placements(node_id)
            for model in applied - set(current):  # removed while we were away
                await apply(model, None)
            for model, spec in current.items():
                await apply(model, spec)
            applied = set(current)
            async for change in store.watch(prefix):
                await apply(change.key, change.value)
                if change.value is None:
                    applied.discard(change.key)
                else:
                    applied.add(change.key)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("following placements in etcd failed: %s; retrying", exc)
        finally:
            with contextlib.suppress(Exception):
                await store.close()
        await asyncio.sleep(RETRY_S)
