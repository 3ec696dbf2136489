"""Instances outlive omnid (live restore): a killed or stopped omnid's sandboxes keep
running, the next omnid adopts them as they are, and those no omnid adopts end
themselves after the orphan timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from omni.isolation import hostfs
from omni.testing.checkpoints import readable_tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid

MODELS = ("a", "b")


@pytest.fixture(scope="module")
def models() -> Path:
    if os.geteuid() != 0:
        pytest.skip("sandboxes need root")
    with readable_tiny_llama("omni-lr-") as path:
        yield path


def config(model: Path, **node) -> str:
    lines = [f"{k} = {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in node.items()]
    for name in MODELS:
        lines.append(f'[[models]]\nname = "{name}"\npath = "{model}"\n')
    return "".join(lines)


class Load:
    """A steady stream of short completions, one at a time, each with a timeout: what each
    got, and when."""

    def __init__(self, node: Omnid):
        self.node, self.results, self.stopped = node, [], False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": "a", "prompt": "t1 t2", "max_tokens": 4}
        while not self.stopped:
            t0 = time.monotonic()
            try:
                r = httpx.post(f"{self.node.base_url}/v1/completions", json=body, timeout=15)
                outcome = r.status_code
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            self.results.append((t0, time.monotonic(), outcome))
            time.sleep(0.02)

    def stop(self) -> list[tuple[float, float, object]]:
        self.stopped = True
        self.thread.join(timeout=30)
        return self.results


def serving_since(load: Load, t: float) -> float:
    """Seconds after `t` until the first request that succeeded, begun after `t`."""
    first = wait_until(
        lambda: next((end for start, end, o in load.results if start >= t and o == 200), None),
        60,
        "a request served",
        interval_s=0.05,
    )
    return first - t


def port_open(node: Omnid) -> float:
    """When the node's inference port accepts connections (its start of service)."""

    def up() -> float | None:
        try:
            httpx.get(f"{node.base_url}/healthz", timeout=1)
            return time.monotonic()
        except httpx.HTTPError:
            return None

    return wait_until(up, 60, "omnid's port", interval_s=0.02)


def test_a_killed_then_stopped_omnid_s_instances_are_adopted_as_they_run(tmp_path, models):
    text = config(models, live_restore=True, orphan_timeout=60)
    first = Omnid(tmp_path, text, "--sandbox", "isolated")
    runtime = first.runtime_dir
    nodes, pids = [first], {}
    try:
        first.wait_ready(list(MODELS))
        pids = {n: i["pid"] for n, i in first.instances().items()}
        load = Load(first)
        wait_until(lambda: len(load.results) >= 3, 60, "the load running")
        first.proc.kill()  # kill -9: no goodbye
        first.proc.wait()
        time.sleep(0.5)
        assert all(psutil.pid_exists(p) for p in pids.values())  # outlived their omnid

        second = Omnid(tmp_path, text, "--sandbox", "isolated", runtime_dir=runtime)
        nodes.append(second)
        load.node = second
        gap = serving_since(load, port_open(second))
        assert gap < 2.0, f"served again {gap:.2f}s after the new omnid's start"
        second.wait_ready(list(MODELS))
        after = second.instances()
        assert {n: i["pid"] for n, i in after.items()} == pids  # adopted, not reloaded
        assert all(i["restarts"] == 0 for i in after.values())
        results = load.stop()
        assert all(end - start < 16 for start, end, _ in results)  # none hung
        outcomes = {o for _, _, o in results}
        assert outcomes <= {200, "ConnectError", "RemoteProtocolError", "ReadError"}, outcomes
        assert results[-1][2] == 200

        assert second.stop() == 0  # SIGTERM with live restore: they stay
        assert all(psutil.pid_exists(p) for p in pids.values())
        third = Omnid(tmp_path, text, "--sandbox", "isolated", runtime_dir=runtime)
        nodes.append(third)
        third.wait_ready(list(MODELS))
        assert {n: i["pid"] for n, i in third.instances().items()} == pids
        with third.admin() as c:  # the way to stop them with their omnid
            assert c.post("/v1/node/drain").status_code in (200, 202)
        wait_until(lambda: not any(psutil.pid_exists(p) for p in pids.values()), 60, "a drain")
        assert third.stop() == 0
        assert hostfs.mount_points_under(runtime) == []
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.kill()
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        hostfs.remove_tree(runtime)


def test_instances_no_omnid_adopts_end_after_the_orphan_timeout(tmp_path, models):
    node = Omnid(tmp_path, config(models, orphan_timeout=2), "--sandbox", "isolated")
    try:
        node.wait_ready(list(MODELS))
        instances = node.instances().values()
        pids = [i["pid"] for i in instances]
        launchers = [psutil.Process(p).parent().parent().pid for p in pids]
        node.proc.kill()
        node.proc.wait()
        t0 = time.monotonic()
        gone = [*pids, *launchers]
        wait_until(lambda: not any(psutil.pid_exists(p) for p in gone), 30, "the orphans' end")
        took = time.monotonic() - t0
        assert 2 <= took < 15, f"orphans ended {took:.1f}s after their omnid"
    finally:
        if node.proc.poll() is None:
            node.proc.kill()
        hostfs.remove_tree(node.runtime_dir)
