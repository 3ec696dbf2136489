"""The scheduler's side of the latency map: each round the leader reads the live nodes'
rows, aggregates them by the nodes' locations and publishes the map. The probes that
write the rows, the keys and the map's published form are in omni/cluster/latency.py.
"""

from __future__ import annotations

from collections.abc import Mapping

from omni.cluster.latency import DEFAULT_LOCATION, LATENCY, LATENCY_MAP, LatencyMap, Row
from omni.cluster.state import ClusterStore


def locations_of(records: Mapping[str, dict]) -> dict[str, str]:
    """node -> location from the node records in etcd (/omni/nodes)."""
    return {n: str(rec.get("location") or DEFAULT_LOCATION) for n, rec in records.items()}


async def read_rows(store: ClusterStore) -> dict[str, Row]:
    """Every node's latest row."""
    return {node: value["rtt_s"] for node, value in (await store.get_prefix(LATENCY)).items()}


async def publish_map(store: ClusterStore, latency_map: LatencyMap) -> None:
    await store.client.put(LATENCY_MAP, latency_map.to_json())


async def build_map(store: ClusterStore) -> LatencyMap:
    """The scheduler's round: the rows of the live nodes, placed by their locations (a
    peer that has gone since a row was written is left out of it)."""
    rows, records = await read_rows(store), await store.nodes()
    live = {
        node: {peer: rtt for peer, rtt in row.items() if peer in records}
        for node, row in rows.items()
        if node in records
    }
    return LatencyMap(live, locations_of(records))
