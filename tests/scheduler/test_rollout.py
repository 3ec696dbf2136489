"""Gradual rollouts: the stages and their judgement (rollout.py), the per-version counts
the nodes report and the history keeps, and the leader carrying a rollout out over a
real etcd: placements change version stage by stage, a version that errs more than the
old one is rolled back, and `omnictl cluster rollout` starts, aborts and shows them."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from omni.cluster.reports import IntervalReport, ModelFigures
from omni.cluster.rollout import ROLLOUT_STATUS, RolloutRequest
from omni.cluster.state import ClusterStore
from omni.cluster.telemetry import LoadAccumulator
from omni.testing.checkpoints import tiny_llama
from scheduler.history import HistoryStore
from scheduler.placement import ModelSpec
from scheduler.rollout import (
    DONE,
    REFUSED,
    ROLLED_BACK,
    ROLLING,
    Counts,
    Observed,
    Version,
    advance,
    begin,
    new_replicas,
    stable,
    versions,
)
from scheduler.service import ClusterScheduler, WantedModel
from tests.conftest import free_port, wait_until
from tests.nodes import Omnid

from .etcd import EtcdServer
from .omnictl import REPO, omnictl, omnictl_json

V1 = Version("v1", "/models/m-v1")
REQ = RolloutRequest("r1", "v2", "/models/m-v2", steps=(25, 100), step_s=60, min_requests=10)


def test_a_malformed_rollout_is_refused_with_its_reason():
    good = {"id": "a", "version": "v2", "path": "/m"}
    assert RolloutRequest.from_json(good).steps == (10, 50, 100)
    for bad, why in [
        ({"version": "v2", "path": "/m"}, "missing 'id'"),
        ({**good, "steps": [50, 90]}, "ending at 100"),
        ({**good, "steps": [50, 20, 100]}, "must increase"),
        ({**good, "steps": [0, 100]}, "ending at 100"),
        ({**good, "tolerance": 2}, "tolerance"),
        ({**good, "max_restarts": 0}, "max_restarts"),
        ({**good, "step_s": "soon"}, "could not convert"),
        ([1, 2], "JSON object"),
    ]:
        with pytest.raises(ValueError, match=why):
            RolloutRequest.from_json(bad)


def test_the_lowest_replicas_run_the_new_version_and_at_least_one_does():
    status = begin(REQ, V1, now=0.0)
    new = Version("v2", "/models/m-v2")
    assert versions([0, 1, 2, 3], status, V1) == {0: new, 1: V1, 2: V1, 3: V1}  # 25% of 4
    assert versions([3, 5], status, V1) == {3: new, 5: V1}  # 25% of 2 rounds up to one
    assert new_replicas(10, 25) == 3 and new_replicas(4, 100) == 4 and new_replicas(0, 50) == 0
    assert versions([0, 1], None, V1) == {0: V1, 1: V1}  # no rollout: the models file's


def test_a_stage_ends_after_its_time_with_enough_requests_and_its_replicas_ready():
    status = begin(REQ, V1, now=0.0)
    assert (status["state"], status["percent"]) == (ROLLING, 25)
    good, old = Counts(40, 0), Counts(200, 0)
    ready = Observed(ready=1)
    assert advance(REQ, status, good, old, ready, 1, now=30)["stage"] == 0  # too early
    assert advance(REQ, status, Counts(5, 0), old, ready, 1, now=90)["stage"] == 0  # too few
    assert advance(REQ, status, good, old, Observed(ready=0), 1, now=90)["stage"] == 0
    second = advance(REQ, status, good, old, ready, 1, now=90)
    assert (second["state"], second["stage"], second["percent"]) == (ROLLING, 1, 100)
    assert second["new"] == {"requests": 40, "errors": 0}
    assert advance(REQ, second, good, old, Observed(ready=4), 4, now=120)["state"] == ROLLING
    done = advance(REQ, second, good, old, Observed(ready=4), 4, now=151)
    assert done["state"] == DONE
    assert stable(done, V1) == Version("v2", "/models/m-v2")  # every replica runs it now
    assert advance(REQ, done, Counts(40, 40), old, ready, 4, now=999) is done  # over


def test_a_new_version_that_errs_more_than_the_old_is_rolled_back():
    status = begin(REQ, V1, now=0.0)
    old = Counts(1000, 10)  # 1%
    # Equal rates, and 2% within the tolerance of one point: it goes on.
    assert advance(REQ, status, Counts(100, 1), old, Observed(1), 1, 5)["state"] == ROLLING
    assert advance(REQ, status, Counts(100, 2), old, Observed(1), 1, 5)["state"] == ROLLING
    # Worse, but before min_requests: not judged yet.
    assert advance(REQ, status, Counts(9, 5), old, Observed(1), 1, 5)["state"] == ROLLING
    back = advance(REQ, status, Counts(100, 30), old, Observed(1), 1, 5)
    assert back["state"] == ROLLED_BACK
    assert "30.00% (30/100) above v1's 1.00% (10/1000)" in back["reason"]
    assert stable(back, V1) == V1
    assert versions([0, 1, 2, 3], back, V1) == dict.fromkeys(range(4), V1)


def test_restarts_of_a_new_instance_or_an_abort_roll_back():
    status = begin(REQ, V1, now=0.0)
    crashing = Observed(ready=0, restarts=2, where="n3")
    back = advance(REQ, status, None, None, crashing, 1, 5)
    assert (back["state"], back["reason"]) == (ROLLED_BACK, "v2 restarted 2 times on n3")
    aborted = RolloutRequest(**{**REQ.__dict__, "abort": True})
    assert advance(aborted, status, None, None, Observed(1), 1, 5)["state"] == ROLLED_BACK


def test_rolling_out_the_running_version_is_refused():
    status = begin(RolloutRequest("r", "v1", "/elsewhere"), V1, now=0.0)
    assert status["state"] == REFUSED and "running now" in status["reason"]
    assert stable(status, V1) == V1


def test_a_nodes_counts_are_split_by_the_version_that_served_them(tmp_path):
    """An interval that spans a version switch reports each version's own requests and
    errors; the history keeps them per version, and a resent report is not counted twice."""
    acc = LoadAccumulator(clock=lambda: 100.0)
    acc.record_request("m", wall_s=0.1, version="v1")
    acc.record_request("m", wall_s=0.1, status=500, version="v1")
    acc.record_request("m", wall_s=0.1, status=400, version="v2")
    acc.record_request("m", wall_s=0.1, version="v2")
    acc.record_request("m", wall_s=0.0, status=429, version="v2")  # shed: not judged
    report = acc.take(110.0)
    assert report.models["m"].by_version == {"v1": [2, 1], "v2": [2, 1]}
    wire = IntervalReport.from_proto(report.to_proto("n1"))
    assert wire.models["m"].by_version == {"v1": [2, 1], "v2": [2, 1]}
    history = HistoryStore(tmp_path / "h.sqlite", clock=lambda: 120.0)
    try:
        assert history.add("n1", wire) == 1
        assert history.add("n1", wire) == 0  # resent
        other = ModelFigures(by_version={"v2": [3, 0]})
        history.add("n2", IntervalReport(100.0, 10.0, {"m": other}))
        assert history.version_counts("m", 100.0) == {"v1": (2, 1), "v2": (5, 1)}
        assert history.version_counts("m", 100.5) == {}  # reports starting since
        assert history.version_counts("other", 0.0) == {}
    finally:
        history.close()


# -- the leader, over a real etcd --------------------------------------------------------


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd-data")
    yield server
    server.stop()


class FakeNodes:
    """Four nodes without omnid behind them: the test plays their part, reporting each
    placement ready at the version placed, and each version's requests to the history."""

    def __init__(self, store: ClusterStore, history: HistoryStore):
        self.store, self.history = store, history
        self.t = 0.0

    async def register(self) -> None:
        gpu = {"index": 0, "kind": "H100", "budget_bytes": 8 << 30}
        for i in range(4):
            record = {"id": f"n{i}", "location": "fra", "gpus": [gpu], "url": "http://x:9"}
            await self.store.register_node(record, ttl_s=30)

    async def versions(self) -> dict[str, str]:
        """node -> the version placed there."""
        placed = await self.store.placements()
        return {k.split("/")[0]: spec["version"] for k, spec in placed.items()}

    async def report(self, errors: dict[str, float]) -> None:
        """Every node ready at its version, and 20 requests served each, a share of them
        failed by version (`errors`)."""
        self.t = max(self.t + 1, time.time())  # after the rollout's start: it counts
        for node, version in (await self.versions()).items():
            await self.store.client.put(
                f"/omni/observed/{node}/m".encode(),
                orjson.dumps({"state": "ready", "restarts": 0, "version": version}),
            )
            failed = round(20 * errors.get(version, 0.0))
            figures = ModelFigures(requests=20, errors=failed, by_version={version: [20, failed]})
            self.history.add(node, IntervalReport(self.t, 1.0, {"m": figures}))


def test_the_leader_carries_a_rollout_through_and_rolls_a_bad_one_back(etcd, tmp_path):
    endpoint = f"127.0.0.1:{etcd.port}"

    async def main():
        store = ClusterStore(port=etcd.port)
        history = HistoryStore(tmp_path / "history.sqlite")
        nodes = FakeNodes(store, history)
        await nodes.register()
        model = WantedModel(ModelSpec("m", 1 << 30, replicas=4), "/models/m-v1", version="v1")
        scheduler = ClusterScheduler(store, "lead", [model], history=history)
        try:
            await scheduler.reconcile()
            assert sorted((await nodes.versions()).values()) == ["v1"] * 4
            await nodes.report({"v1": 0.05})

            args = ["start", "m", "v2", "/models/m-v2", "--steps", "25,100"]
            args += ["--step-time", "0", "--min-requests", "10"]
            out = await asyncio.to_thread(omnictl, endpoint, "rollout", args=args)
            assert "m to v2 in steps [25.0, 100.0]" in out
            await scheduler.reconcile()
            assert sorted((await nodes.versions()).values()) == ["v1", "v1", "v1", "v2"]
            placed = await store.placements()
            (canary,) = [p for p in placed.values() if p["version"] == "v2"]
            assert (canary["replica"], canary["path"]) == (0, "/models/m-v2")
            view = await asyncio.to_thread(omnictl_json, endpoint, "rollout", ["status"])
            (row,) = view["rollouts"]
            assert (row["state"], row["percent"], row["from"]) == (ROLLING, 25, "v1")

            await nodes.report({"v1": 0.05, "v2": 0.05})  # as good as the old one
            await scheduler.reconcile()  # stage 2: all of them
            assert sorted((await nodes.versions()).values()) == ["v2"] * 4
            await nodes.report({"v1": 0.05, "v2": 0.05})
            await scheduler.reconcile()
            status = orjson.loads((await store.client.get(ROLLOUT_STATUS + b"m")).value)
            assert status["state"] == DONE, status

            # v3 fails a fifth of its requests where v2 failed a twentieth: rolled back.
            args = ["start", "m", "v3", "/models/m-v3", "--steps", "50,100"]
            args += ["--step-time", "0", "--min-requests", "10"]
            await asyncio.to_thread(omnictl, endpoint, "rollout", args=args)
            await scheduler.reconcile()
            assert sorted((await nodes.versions()).values()) == ["v2", "v2", "v3", "v3"]
            await nodes.report({"v2": 0.05, "v3": 0.2})
            await scheduler.reconcile()
            assert sorted((await nodes.versions()).values()) == ["v2"] * 4
            view = await asyncio.to_thread(omnictl_json, endpoint, "rollout", ["status"])
            (row,) = view["rollouts"]
            assert (row["version"], row["state"], row["from"]) == ("v3", ROLLED_BACK, "v2")
            assert "above v2's 5.00%" in row["reason"]
            text = await asyncio.to_thread(omnictl, endpoint, "rollout", args=["status"])
            assert "rolled-back" in text and "8/40" in text

            # v4 is aborted by the operator while its canary runs.
            args = ["start", "m", "v4", "/models/m-v4", "--step-time", "3600"]
            await asyncio.to_thread(omnictl, endpoint, "rollout", args=args)
            await scheduler.reconcile()
            assert sorted((await nodes.versions()).values()) == ["v2", "v2", "v2", "v4"]
            await asyncio.to_thread(omnictl, endpoint, "rollout", args=["abort", "m"])
            await scheduler.reconcile()
            assert sorted((await nodes.versions()).values()) == ["v2"] * 4
            versions_shown = await asyncio.to_thread(omnictl_json, endpoint, "placements")
            assert {p["version"] for p in versions_shown["placements"]} == {"v2"}
        finally:
            history.close()
            await store.close()

    asyncio.run(main())


def test_omnictl_refuses_a_malformed_rollout_before_writing_it(etcd):
    argv = [sys.executable, "-m", "omni.ctl", "cluster", "--etcd", f"127.0.0.1:{etcd.port}"]
    argv += ["rollout", "start", "m", "v2", "/m", "--steps", "50,90"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 2 and "ending at 100" in out.stderr
    argv[-7:] = ["rollout", "abort", "m"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 1 and "no rollout of m" in out.stderr


# -- end to end: real omnids serving, judged on their telemetry ----------------------------


def test_omnids_switch_versions_as_a_rollout_goes_and_a_failing_one_is_rolled_back(tmp_path):
    """etcd + a scheduler (telemetry and history) + two omnids serving tiny v1. v2 (the
    same weights elsewhere) is rolled out to both; v3 cannot take the prompts (its context
    is 16 tokens: every request is a 400) and is rolled back to v2 while clients keep
    being served."""
    etcd = EtcdServer(tmp_path / "etcd-data")
    endpoint = f"127.0.0.1:{etcd.port}"
    v1 = tiny_llama(tmp_path / "tiny-v1")
    v2 = Path(shutil.copytree(v1, tmp_path / "tiny-v2"))
    v3 = Path(shutil.copytree(v1, tmp_path / "tiny-v3"))
    config = orjson.loads((v3 / "config.json").read_bytes())
    (v3 / "config.json").write_bytes(orjson.dumps({**config, "max_position_embeddings": 16}))
    (tmp_path / "models.toml").write_text(
        f'[[models]]\nname = "tiny"\nversion = "v1"\npath = "{v1}"\nreplicas = 2\n'
    )
    argv = ["--etcd", endpoint, "--models", str(tmp_path / "models.toml"), "--interval", "0.5"]
    argv += ["--lease-ttl", "2", "--name", "s1", "--history", str(tmp_path / "h.sqlite")]
    argv += ["--telemetry-listen", f"127.0.0.1:{free_port()}"]
    scheduler = None
    nodes: dict[str, Omnid] = {}
    try:
        scheduler = subprocess.Popen(
            [sys.executable, "-m", "scheduler", *argv],
            stdout=(tmp_path / "scheduler.log").open("w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        for name in ("n1", "n2"):
            (tmp_path / name).mkdir()
            nodes[name] = Omnid(
                tmp_path / name,
                "",
                *("--sandbox", "process", "--etcd", endpoint, "--node-id", name),
                *("--lease-ttl", "2", "--telemetry-interval", "0.5"),
            )

        def versions() -> dict[str, str | None]:
            out = {}
            for name, node in nodes.items():
                inst = node.instances().get("tiny")
                out[name] = inst["version"] if inst and inst["state"] == "ready" else None
            return out

        def serve(prompt: str) -> list[int]:
            """One request to each node: its status (503 while a node switches)."""
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            return [
                httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=30).status_code
                for node in nodes.values()
            ]

        def rollout_state(prompt: str) -> str:
            serve(prompt)
            (row,) = omnictl_json(endpoint, "rollout", ["status"])["rollouts"]
            return row["state"]

        for node in nodes.values():
            node.models()  # its admin API answers
        wait_until(lambda: versions() == {"n1": "v1", "n2": "v1"}, 60, "tiny v1 on both nodes")
        assert serve("t1 t2 t3") == [200, 200]

        steps = ["--steps", "50,100", "--step-time", "1", "--min-requests", "4"]
        omnictl(endpoint, "rollout", args=["start", "tiny", "v2", str(v2), *steps])
        wait_until(lambda: rollout_state("t1 t2 t3") == DONE, 90, "v2 rolled out")
        wait_until(lambda: versions() == {"n1": "v2", "n2": "v2"}, 30, "v2 on both nodes")
        assert serve("t1 t2 t3") == [200, 200]

        long_prompt = " ".join(f"t{i % 90}" for i in range(30))  # > v3's 16 positions
        omnictl(endpoint, "rollout", args=["start", "tiny", "v3", str(v3), *steps])
        wait_until(lambda: rollout_state(long_prompt) == ROLLED_BACK, 90, "v3 rolled back")
        (row,) = omnictl_json(endpoint, "rollout", ["status"])["rollouts"]
        assert row["from"] == "v2" and "error rate 100.00%" in row["reason"], row
        wait_until(lambda: versions() == {"n1": "v2", "n2": "v2"}, 30, "v2 back on both nodes")
        assert serve(long_prompt) == [200, 200]
    finally:
        if scheduler is not None:
            scheduler.terminate()
            scheduler.wait(timeout=20)
        for node in nodes.values():
            node.stop()
        etcd.stop()
