"""A real etcd server (Debian's etcd-server) for one test module, on free loopback ports."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from omni.cluster.state import ClusterStore
from tests.conftest import free_port, wait_until


class EtcdServer:
    def __init__(self, data_dir: Path, also_on: str | None = None):
        """`also_on`: one more address to serve clients on (a network lab's host side)."""
        binary = shutil.which("etcd")
        if binary is None:
            pytest.skip("etcd is not installed (make test installs Debian's etcd-server)")
        self.port, peer = free_port(), free_port()
        client = f"http://127.0.0.1:{self.port}"
        if also_on:
            client += f",http://{also_on}:{self.port}"
        self.log = data_dir.parent / "etcd.log"
        self.proc = subprocess.Popen(
            [
                binary,
                "--name=test",
                f"--data-dir={data_dir}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=test=http://127.0.0.1:{peer}",
            ],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, 20, "etcd serving", interval_s=0.1)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"etcd exited:\n{self.log.read_text()[-2000:]}")
        return b"ready to serve client requests" in self.log.read_bytes()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


def lease_of(port: int, key: bytes) -> tuple[int, int] | None:
    """(granted, remaining) seconds of the lease etcd holds `key` under; None without the key.

    How soon a dead holder's key goes is etcd's part, bound to this TTL: tests check the
    TTL asked for here, and wait for the expiry itself only as long as a loaded host needs.
    """

    async def read() -> tuple[int, int] | None:
        store = ClusterStore(port=port)
        try:
            kv = await store.client.get(key)
            if kv is None:
                return None
            info = await store.client.get_lease_info(kv.lease)
            return info.grantedTTL, info.TTL
        finally:
            await store.close()

    return asyncio.run(read())
