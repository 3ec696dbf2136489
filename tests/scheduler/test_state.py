"""Cluster state over a real etcd: node leases, placements per node, leader election."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from omni.cluster.state import ClusterStore, Election
from tests.conftest import wait_until

from .etcd import EtcdServer, lease_of

REPO = Path(__file__).resolve().parents[2]
# seconds: short, with room for a renewal (every third of it) that comes late on a loaded
# host; at 2 s one came too late under make test and the live node's key expired
TTL = 5


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    yield server
    server.stop()


def in_process(port: int, body: str) -> subprocess.Popen:
    """A separate process holding its own lease (so the test can kill it: a dead node)."""
    code = (
        textwrap.dedent(
            f"""
        import asyncio
        from omni.cluster.state import ClusterStore, Election
        async def main():
            store = ClusterStore(port={port})
        """
        )
        + textwrap.indent(textwrap.dedent(body), " " * 4)
        + "\nasyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO
    )


def run(coro):
    return asyncio.run(coro)


def test_a_node_is_listed_while_alive_and_gone_once_its_lease_runs_out(etcd):
    node = in_process(
        etcd.port,
        f"""
        await store.register_node({{"id": "n1", "location": "fra"}}, ttl_s={TTL})
        print("registered", flush=True)
        await asyncio.sleep(3600)
        """,
    )
    assert node.stdout.readline().strip() == "registered"

    async def nodes():
        store = ClusterStore(port=etcd.port)
        try:
            return await store.nodes()
        finally:
            await store.close()

    time.sleep(2 * TTL)  # renewed meanwhile: still there
    assert run(nodes()) == {"n1": {"id": "n1", "location": "fra"}}
    granted, remaining = lease_of(etcd.port, b"/omni/nodes/n1")
    assert granted == TTL and 0 < remaining <= TTL
    node.kill()
    node.wait()
    wait_until(lambda: run(nodes()) == {}, 15 * TTL, "the dead node's key to expire")


def test_a_node_sees_its_own_placements_as_they_change(etcd):
    async def main():
        store = ClusterStore(port=etcd.port)
        seen = []

        async def watch():
            async for change in store.watch(b"/omni/placements/n1/"):
                seen.append((change.key, change.value))
                if len(seen) == 2:
                    return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        await store.set_placement("n2", "llama", {"instances": 1})  # not n1's
        await store.set_placement("n1", "llama", {"instances": 2, "quota": "4GiB"})
        await store.remove_placement("n1", "llama")
        await asyncio.wait_for(watcher, 5)
        everything = await store.placements()
        await store.close()
        return seen, everything

    seen, everything = run(main())
    assert seen == [("llama", {"instances": 2, "quota": "4GiB"}), ("llama", None)]
    assert everything == {"n2/llama": {"instances": 1}}


def test_one_leader_and_the_standby_takes_over_when_it_dies(etcd):
    def candidate(name: str) -> subprocess.Popen:
        return in_process(
            etcd.port,
            f"""
            election = Election(store, "{name}", ttl_s={TTL})
            await election.campaign()
            print("leading", flush=True)
            await asyncio.sleep(3600)
            """,
        )

    first = candidate("a")
    assert first.stdout.readline().strip() == "leading"
    second = candidate("b")
    time.sleep(1.5)
    assert second.poll() is None

    async def leader():
        store = ClusterStore(port=etcd.port)
        try:
            return await Election(store, "observer").leader()
        finally:
            await store.close()

    assert run(leader()) == "a"
    granted, _ = lease_of(etcd.port, b"/omni/leader")
    assert granted == TTL  # so the standby waits one TTL at most for a dead leader
    first.kill()
    first.wait()
    ready, _, _ = select.select([second.stdout], [], [], 15 * TTL)
    assert ready, "the standby never took over"
    assert second.stdout.readline().strip() == "leading"
    assert run(leader()) == "b"
    second.kill()
    second.wait()


def test_a_leader_whose_lease_ran_out_resigns_without_an_error(etcd):
    """A renewal too late on a loaded host: the lease is gone when the leader resigns.
    Resigning still ends the lead (the key went with the lease), and raises nothing."""

    async def main():
        store = ClusterStore(port=etcd.port)
        election = Election(store, "late", ttl_s=TTL)
        await asyncio.wait_for(election.campaign(), 10)
        assert await election.leader() == "late"
        await store.client.revoke_lease(election.lease.id)  # as if it had run out
        await election.resign()
        after = await election.leader(), election.lease
        await store.close()
        return after

    assert run(main()) == (None, None)
