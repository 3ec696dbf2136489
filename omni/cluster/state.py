"""Cluster state in etcd: nodes under leases, desired and observed placements, a leader.

Keys (JSON values):
    /omni/nodes/<node>                 a node's registration, under its lease: it vanishes
                                       when the node stops renewing (dies, or is cut off)
    /omni/placements/<node>/<model>    what the scheduler wants on that node
    /omni/observed/<node>/<model>      what the node runs, under its lease
    /omni/leader                       the scheduler replica in charge, under its lease

etcd does the hard parts (consensus, leases, watches, transactions); this module
names the keys and keeps the leases alive. The client is aetcd: asyncio-native
like omnid and the edge, speaking etcd's own gRPC API (3.4+), with leases,
watches and transactions; etcd3gw goes through the HTTP gateway with blocking
calls and polling watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aetcd
import orjson

log = logging.getLogger(__name__)

PREFIX = b"/omni/"
NODES = PREFIX + b"nodes/"
PLACEMENTS = PREFIX + b"placements/"
OBSERVED = PREFIX + b"observed/"
LEADER = PREFIX + b"leader"
# {"target": "host:port", "leader": "<scheduler name>"}: where the leader takes the nodes'
# telemetry, written by it under its leadership lease.
TELEMETRY = PREFIX + b"telemetry"
DEFAULT_TTL_S = 10


@dataclass(frozen=True)
class Change:
    """One watched key: its new value, or None once deleted (or expired)."""

    key: str
    value: dict | None


def _key(*parts: str) -> bytes:
    for part in parts:
        if not part or "/" in part:
            raise ValueError(f"bad key part {part!r}")
    return b"/".join(p.encode() for p in parts)


class ClusterStore:
    """One connection to etcd, and the leases this process keeps alive."""

    def __init__(self, host: str = "127.0.0.1", port: int = 2379):
        self.client = aetcd.Client(host=host, port=port)
        self._keepers: set[asyncio.Task] = set()

    async def close(self) -> None:
        for task in list(self._keepers):
            task.cancel()
        for task in list(self._keepers):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.client.close()

    # ---------------------------------------------------------------- leases

    async def lease(self, ttl_s: int) -> aetcd.Lease:
        """A lease renewed every third of its TTL until close() (or a failed renewal)."""
        lease = await self.client.lease(ttl_s)

        async def keep() -> None:
            while True:
                await asyncio.sleep(ttl_s / 3)
                try:
                    await lease.refresh()
                except aetcd.exceptions.ClientError as exc:
                    log.warning("lease %x not renewed: %s", lease.id, exc)

        task = asyncio.create_task(keep())
        self._keepers.add(task)
        task.add_done_callback(self._keepers.discard)
        return lease

    # ----------------------------------------------------------------- nodes

    async def register_node(self, node: dict, ttl_s: int = DEFAULT_TTL_S) -> aetcd.Lease:
        """Announce this node (`node["id"]` and whatever describes it) for as long as this
        process keeps its lease."""
        lease = await self.lease(ttl_s)
        await self.client.put(_node_key(node["id"]), orjson.dumps(node), lease=lease)
        return lease

    async def nodes(self) -> dict[str, dict]:
        return await self.get_prefix(NODES)

    # ------------------------------------------------------------ placements

    async def set_placement(self, node: str, model: str, spec: dict) -> None:
        await self.client.put(PLACEMENTS + _key(node, model), orjson.dumps(spec))

    async def remove_placement(self, node: str, model: str) -> None:
        await self.client.delete(PLACEMENTS + _key(node, model))

    async def placements(self, node: str | None = None) -> dict[str, dict]:
        """Desired placements, keyed "node/model" (all nodes, or one)."""
        return await self.get_prefix(PLACEMENTS + (_key(node) + b"/" if node else b""))

    async def report_observed(self, node: str, model: str, state: dict, lease) -> None:
        await self.client.put(OBSERVED + _key(node, model), orjson.dumps(state), lease=lease)

    async def forget_observed(self, node: str, model: str) -> None:
        await self.client.delete(OBSERVED + _key(node, model))

    async def observed(self, node: str | None = None) -> dict[str, dict]:
        return await self.get_prefix(OBSERVED + (_key(node) + b"/" if node else b""))

    # ---------------------------------------------------------------- watches

    async def watch(self, prefix: bytes, after: int | None = None) -> AsyncIterator[Change]:
        """Changes under `prefix`, keys relative to it: from now on, or every change after
        revision `after` (that of a read: nothing between the read and the watch is lost)."""
        start = None if after is None else after + 1
        watch = await self.client.watch_prefix(prefix, start_revision=start)
        try:
            async for event in watch:
                key = event.kv.key[len(prefix) :].decode()
                value = orjson.loads(event.kv.value) if event.kind == "PUT" else None
                yield Change(key, value)
        finally:
            with contextlib.suppress(Exception):
                await watch.cancel()

    # ----------------------------------------------------------------- helpers

    async def get_prefix(self, prefix: bytes) -> dict[str, dict]:
        """Every value under `prefix`, keyed by the rest of its key."""
        return (await self.read_prefix(prefix))[0]

    async def read_prefix(self, prefix: bytes) -> tuple[dict[str, dict], int]:
        """get_prefix, and the store's revision at that read (to watch from)."""
        got = await self.client.get_prefix(prefix)
        values = {kv.key[len(prefix) :].decode(): orjson.loads(kv.value) for kv in got}
        return values, got.header.revision


def _node_key(node_id: str) -> bytes:
    return NODES + _key(node_id)


class Election:
    """One leader among scheduler replicas: whoever creates /omni/leader under its lease.
    A standby waits for that key to go (the leader resigned, or died and its lease
    expired) and tries again."""

    def __init__(self, store: ClusterStore, name: str, ttl_s: int = DEFAULT_TTL_S):
        self.store, self.name, self.ttl_s = store, name, ttl_s
        self.lease: aetcd.Lease | None = None

    async def leader(self) -> str | None:
        kv = await self.store.client.get(LEADER)
        return kv.value.decode() if kv is not None else None

    async def campaign(self) -> None:
        """Return once this replica leads."""
        client = self.store.client
        self.lease = await self.store.lease(self.ttl_s)
        while True:
            won, _ = await client.transaction(
                compare=[client.transactions.create(LEADER) == 0],
                success=[client.transactions.put(LEADER, self.name.encode(), lease=self.lease)],
                failure=[],
            )
            if won:
                log.info("%s leads", self.name)
                return
            watch = await client.watch(LEADER)
            try:
                if await self.leader() is None:  # gone between the transaction and the watch
                    continue
                async for event in watch:
                    if event.kind == "DELETE":
                        break
            finally:
                with contextlib.suppress(Exception):
                    await watch.cancel()

    async def resign(self) -> None:
        """Give up the lead: its lease revoked, or already expired (a renewal that came too
        late on a loaded host), which ends the lead as well."""
        if self.lease is not None:
            try:
                await self.lease.revoke()
            except aetcd.exceptions.ClientError as exc:
                log.warning("%s: lease %x not revoked: %s", self.name, self.lease.id, exc)
            self.lease = None
