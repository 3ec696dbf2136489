"""Sandbox uids are the host's, not one omnid's: two omnids never hand out the same uid."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest

from omni.isolation import uids as uids_module
from omni.isolation.uids import UidAllocator, UidError, started
from omni.runtime.omnid import HOST_UID_TABLE
from omni.testing.checkpoints import tiny_llama
from tests.nodes import Omnid

# Far above the 200000 where omnids (of other tests, too) start leasing.
TEST_UIDS = range(264_000, 264_200)
BASE = TEST_UIDS.start

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs processes as other uids: root")


@pytest.fixture
def table(tmp_path) -> UidAllocator:
    return UidAllocator(tmp_path / "run" / "uids.json", TEST_UIDS)


def run_as(uid: int) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], user=uid, group=uid)


def seed(table: UidAllocator, leases: dict[int, dict]) -> None:
    """The table as an earlier omnid left it."""
    table.path.parent.mkdir(parents=True, exist_ok=True)
    table.path.write_text(json.dumps({str(uid): lease for uid, lease in leases.items()}))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_an_instance_keeps_its_uid_and_each_gets_its_own(table):
    a, b = table.lease("/run/x", "a"), table.lease("/run/x", "b")
    assert (a, b) == (BASE, BASE + 1)
    assert table.lease("/run/x", "a") == a  # again: the same one
    assert table.lease("/run/y", "a") == BASE + 2  # another daemon's "a"
    saved = json.loads(table.path.read_text())
    assert saved[str(a)] == {
        "owner": "/run/x",
        "name": "a",
        "pid": os.getpid(),
        "started": started(os.getpid()),
    }
    assert table.path.stat().st_mode & 0o777 == 0o600
    assert table.path.parent.stat().st_mode & 0o777 == 0o755


def test_a_released_uid_is_handed_out_again(table):
    a = table.lease("/run/x", "a")
    table.lease("/run/x", "b")
    table.release("/run/x", "a")
    table.release("/run/x", "never leased")
    assert a not in table.leases()
    assert table.lease("/run/y", "c") == a


def test_an_omnid_restarted_on_its_runtime_dir_gets_its_uids_back(table):
    uid = table.lease("/run/x", "a")
    lease = table.leases()[uid]
    seed(table, {uid: {**lease, "pid": dead_pid()}})  # its omnid died
    assert table.lease("/run/x", "a") == uid
    assert table.leases()[uid]["pid"] == os.getpid()


def test_a_live_omnid_on_the_same_runtime_dir_is_refused(table):
    other = subprocess.Popen(["sleep", "60"])
    try:
        lease = {"owner": "/run/x", "name": "a", "pid": other.pid, "started": started(other.pid)}
        seed(table, {BASE: lease})
        with pytest.raises(UidError, match="another live omnid"):
            table.lease("/run/x", "a")
    finally:
        other.kill()
        other.wait()


def test_a_dead_omnids_uid_is_reclaimed_once_no_process_runs_as_it(table, monkeypatch):
    gone = {"owner": "/run/gone", "pid": dead_pid(), "started": 1}
    seed(table, {BASE: {**gone, "name": "a"}, BASE + 1: {**gone, "name": "b"}})
    monkeypatch.setattr(uids_module, "ids_in_use", lambda: {BASE, BASE + 2})
    # BASE still has a process (an instance outliving its omnid); BASE + 2 has no lease
    # but a process; BASE + 1 is free again.
    assert table.lease("/run/x", "a") == BASE + 1
    assert table.lease("/run/x", "b") == BASE + 3
    assert table.leases()[BASE]["owner"] == "/run/gone"
    monkeypatch.setattr(uids_module, "ids_in_use", lambda: set())
    assert table.lease("/run/x", "c") == BASE


@needs_root
def test_a_uid_a_real_process_runs_as_is_never_handed_out(table):
    proc = run_as(BASE)
    try:
        assert table.lease("/run/x", "a") == BASE + 1
    finally:
        proc.kill()
        proc.wait()
    assert table.lease("/run/x", "b") == BASE


def test_an_account_uid_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(uids_module, "has_account", lambda uid: uid == BASE)
    assert UidAllocator(tmp_path / "uids.json", TEST_UIDS).lease("/run/x", "a") == BASE + 1


def test_a_full_range_and_a_shared_directory_are_refused(tmp_path):
    full = UidAllocator(tmp_path / "full" / "uids.json", range(BASE, BASE + 1))
    full.lease("/run/x", "a")
    with pytest.raises(UidError, match="no free sandbox uid"):
        full.lease("/run/x", "b")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(UidError, match="ours alone"):
        UidAllocator(shared / "uids.json", TEST_UIDS).lease("/run/x", "a")


def lease_many(path: Path, owner: str, start, done, out) -> None:
    """One omnid's worth of leases, all at once with the others'; it stays alive until
    every process has leased (a dead one's uids may be handed out again)."""
    table = UidAllocator(path, TEST_UIDS)
    start.wait()
    out.put([table.lease(owner, f"m{i}") for i in range(5)])
    done.wait()


def test_omnids_leasing_at_once_get_distinct_uids(tmp_path):
    ctx = multiprocessing.get_context("fork")
    workers = 6
    start, done, out = ctx.Barrier(workers), ctx.Barrier(workers + 1), ctx.Queue()
    path = tmp_path / "uids.json"
    procs = [
        ctx.Process(target=lease_many, args=(path, f"/run/omnid-{i}", start, done, out))
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    leased = [uid for _ in procs for uid in out.get(timeout=30)]
    done.wait(timeout=30)
    for p in procs:
        p.join(timeout=30)
    assert sorted(leased) == list(range(BASE, BASE + workers * 5))
    assert len(UidAllocator(path, TEST_UIDS).leases()) == workers * 5


def instance_uids(node: Omnid) -> dict[str, int]:
    """Each instance's real uid, from its host pid."""
    out = {}
    for name, inst in node.instances().items():
        status = Path(f"/proc/{inst['pid']}/status").read_text()
        out[name] = int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])
    return out


@needs_root
def test_two_omnids_side_by_side_never_share_a_uid(tmp_path):
    """Two sandboxed omnids, each with instances "a" and "b", through the host's own table
    (the default path): four instances, four uids."""
    model = tiny_llama(tmp_path / "model")
    config = f'[[models]]\nname = "a"\npath = "{model}"\n[[models]]\nname = "b"\npath = "{model}"\n'
    nodes = []
    try:
        for i in range(2):
            (tmp_path / str(i)).mkdir()
            nodes.append(Omnid(tmp_path / str(i), config, "--sandbox", "isolated"))
        for node in nodes:
            node.wait_ready(["a", "b"])
        first, second = (instance_uids(node) for node in nodes)
        assert len({*first.values(), *second.values()}) == 4, (first, second)
        assert all(uid >= 200_000 for uid in [*first.values(), *second.values()])
        leases = UidAllocator(HOST_UID_TABLE).leases()
        for node, uids in zip(nodes, (first, second), strict=True):
            owner = str(node.runtime_dir.resolve())
            for name, uid in uids.items():
                assert leases[uid]["owner"] == owner and leases[uid]["name"] == name
                assert leases[uid]["pid"] == node.proc.pid
        with nodes[0].admin() as c:  # an unloaded model gives its uid back
            assert c.delete("/v1/models/a").status_code == 200
        assert first["a"] not in UidAllocator(HOST_UID_TABLE).leases()
    finally:
        stopped = [node.stop() for node in nodes]
    assert stopped == [0, 0], [node.log() for node in nodes]
