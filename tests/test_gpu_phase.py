"""The CPU-GPU split: a handler marks where its GPU work ends (handler.gpu_done); the next
batch then starts in the instance, and omnid and the edge hand the request's permit on,
while its CPU work finishes. The phases' durations are the model's predicted ETA."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import pytest

from edge.tenants import hash_key
from omni.instance.batcher import Batcher
from omni.instance.handler import Handler, TensorSpec, gpu_done, gpu_phase, gpu_step
from omni.instance.validate import check_outputs
from omni.runtime.gpuyield import YieldFlag, YieldGate
from tests.conftest import REPO, free_port, wait_until
from tests.nodes import Omnid

SANDBOX = "isolated" if os.geteuid() == 0 else "process"
KEY = "sk-gpu-phase"


class Overlapping(Handler):
    """Each call's CPU work waits (a while at most) for the next call to start: it sees
    one only if that call may start before this one ends."""

    inputs = (TensorSpec("x", "FP32", (1,)),)
    outputs = (TensorSpec("y", "FP32", (1,)),)

    def __init__(self, mark: bool, wait_s: float | None = None):
        self.mark, self.overlapped = mark, []
        self.wait_s = wait_s if wait_s is not None else 10 if mark else 0.3
        self.started = [threading.Event() for _ in range(4)]  # call i has begun
        self.calls = 0

    def infer(self, batch):
        i, self.calls = self.calls, self.calls + 1
        self.started[i].set()
        if self.mark:
            with gpu_phase():
                y = [r["x"] + 1 for r in batch]
        else:
            y = [r["x"] + 1 for r in batch]
        # the CPU work: does the next call begin meanwhile?
        self.overlapped.append(self.started[i + 1].wait(timeout=self.wait_s))
        return [{"y": v} for v in y]


def run_three(handler: Overlapping, split: bool = True) -> tuple[list, dict]:
    async def main():
        check = partial(check_outputs, specs=handler.outputs, max_bytes=1 << 20)
        batcher = Batcher(handler.infer, check, max_batch_size=1, split=split)
        released = []
        answers = await asyncio.gather(
            *(
                batcher.submit({"x": np.array([i], np.float32)}, partial(released.append, i))
                for i in range(3)
            )
        )
        await batcher.close()
        return answers, {**batcher.stats(), "released": sorted(released)}

    return asyncio.run(main())


def test_a_marked_gpu_phase_lets_the_next_batch_start_during_the_cpu_work():
    handler = Overlapping(mark=True)
    answers, stats = run_three(handler)
    assert [float(a["y"][0]) for a in answers] == [1.0, 2.0, 3.0]
    assert handler.overlapped == [True, True, False]  # 2 and 3 began in 1's and 2's CPU work
    assert stats["released"] == [0, 1, 2] and stats["batch_gpu_released_early"] == 3
    assert stats["batch_gpu_phase_ms"] is not None and stats["batch_cpu_phase_ms"] > 0


def test_without_the_mark_calls_run_one_after_another():
    handler = Overlapping(mark=False)
    answers, stats = run_three(handler)
    assert [float(a["y"][0]) for a in answers] == [1.0, 2.0, 3.0]
    assert handler.overlapped == [False, False, False]
    assert stats["released"] == [] and stats["batch_gpu_released_early"] == 0
    assert stats["batch_cpu_phase_ms"] == 0.0  # all of a call counts as GPU work


def test_with_the_split_off_a_marked_handler_runs_one_call_after_another():
    handler = Overlapping(mark=True, wait_s=0.3)  # `gpu_split = false` in its catalog entry
    answers, stats = run_three(handler, split=False)
    assert [float(a["y"][0]) for a in answers] == [1.0, 2.0, 3.0]
    assert handler.overlapped == [False, False, False]
    assert stats["released"] == [] and stats["batch_gpu_released_early"] == 0
    assert stats["batch_cpu_phase_ms"] > 0  # the phases are still timed, for the ETA


def test_gpu_done_outside_a_worker_does_nothing():
    gpu_done()  # a handler run bare: no worker to tell


class Stepping(Handler):
    """Two GPU steps (gpu_step() between), gpu_done(), then one more gpu_step() in its
    CPU work; records when each began, from the flag's own clock."""

    inputs = Overlapping.inputs
    outputs = Overlapping.outputs

    def __init__(self, clock):
        self.clock, self.marks = clock, []

    def infer(self, batch):
        self.marks.append(("start", self.clock()))
        gpu_step()
        self.marks.append(("step", self.clock()))
        gpu_done()
        gpu_step()  # CPU work: never waits
        self.marks.append(("cpu", self.clock()))
        return [{"y": r["x"]} for r in batch]


def test_a_handler_waits_for_a_hotter_model_before_its_batch_and_between_its_gpu_steps(
    tmp_path,
):
    """While omnid raises the instance's yield flag (a hotter model of its GPU serves),
    a batch does not start, and a handler's gpu_step() holds its next GPU step, each for
    at most the flag's bound; its CPU work does not wait. The waits are in its stats."""
    flag = YieldFlag(tmp_path / "gpu.yield", max_defer_s=1.0)
    gate = YieldGate(tmp_path / "gpu.yield")

    async def main():
        handler = Stepping(time.monotonic)
        check = partial(check_outputs, specs=handler.outputs, max_bytes=1 << 20)
        batcher = Batcher(handler.infer, check, max_batch_size=1, gate=gate)
        flag.set(True)
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, flag.set, False)  # the hot model's request ends
        first = await batcher.submit({"x": np.array([1], np.float32)})
        flag.set(True)  # and stays raised: the next batch waits out the bound, twice
        second = await batcher.submit({"x": np.array([2], np.float32)})
        await batcher.close()
        return t0, handler.marks, first, second

    t0, marks, first, second = asyncio.run(main())
    assert float(first["y"][0]) == 1.0 and float(second["y"][0]) == 2.0
    (_, start1), (_, step1), (_, cpu1), (_, start2), (_, step2), (_, cpu2) = marks
    assert 0.15 < start1 - t0 < 0.9  # until the flag dropped, not the whole bound
    assert step1 - start1 < 0.5  # dropped: the step goes on
    assert start2 - cpu1 >= 0.99 and step2 - start2 >= 0.99  # held up to the bound each
    assert cpu2 - step2 < 0.5  # after gpu_done(): no wait
    assert gate.stats()["yield_steps"] == 3 and gate.stats()["yield_wait_s"] >= 2.1


# ---------------------------------------------------------------- through omnid and the edge

SPLIT = """
import os
import time

import numpy as np

from omni.instance.handler import Handler, TensorSpec, gpu_done


class Split(Handler):
    \"\"\"GPU work, then CPU work that (for x > 0) waits for the file `go` beside it.\"\"\"

    inputs = (TensorSpec("x", "FP32", (1,)),)
    outputs = (TensorSpec("y", "FP32", (1,)),)

    def load(self, model_dir, device):
        self.go = model_dir / "go"

    def infer(self, batch):
        y = [r["x"] * 2 for r in batch]
        gpu_done()
        if any(float(r["x"][0]) > 0 for r in batch):
            deadline = time.monotonic() + 60
            while not self.go.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return [{"y": v} for v in y]
"""


@dataclass
class Stack:
    omnid: Omnid
    edge_url: str
    model_dir: Path

    def infer(self, x: float) -> httpx.Response:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [x]}]}
        return httpx.post(
            f"{self.edge_url}/v2/models/split/infer",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        )

    def permits_in_use(self) -> float:
        text = httpx.get(f"{self.edge_url}/metrics", timeout=10).text
        found = re.search(r'omni_edge_permits_in_use\{model="split"\} (\S+)', text)
        return float(found.group(1)) if found else -1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gpu-phase")
    model = tmp / "split"
    model.mkdir(mode=0o777)  # the test writes `go` into it; the instance only reads
    (model / "handler.py").write_text(SPLIT)
    (model / "handler.py").chmod(0o644)
    tmp.chmod(0o755)
    config = (
        f'[[models]]\nname = "split"\npath = "{model}"\nruntime = "python"\n'
        'handler = "handler.py:Split"\npermits = 1\nmemory = "2GiB"\n'
    )
    omnid = Omnid(tmp, config, "--sandbox", SANDBOX)
    edge = None
    try:
        omnid.wait_ready(["split"], timeout_s=180)
        (tmp / "tenants.toml").write_text(
            f'[[tenants]]\nname = "t"\nweight = 1\nkeys = ["{hash_key(KEY)}"]\n'
        )
        port = free_port()
        argv = [sys.executable, "-m", "edge.server", "--port", str(port), "--grpc-port", "off"]
        argv += ["--dashboard", "off", "--upstream", omnid.base_url]
        argv += ["--tenants", str(tmp / "tenants.toml")]
        log = tmp / "edge.log"
        edge = subprocess.Popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if edge.poll() is not None:
                raise AssertionError(log.read_text())
            try:
                return httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 60, "the edge ready", interval_s=0.2)
        yield Stack(omnid, url, model)
    finally:
        if edge is not None:
            edge.terminate()
            edge.wait(timeout=30)
        assert omnid.stop() == 0, omnid.log()


def test_the_permit_goes_on_while_the_cpu_work_finishes(stack):
    """One permit at the edge and at omnid. A waits in its CPU work until the test lets it
    go; B, sent meanwhile, is served in full; the edge's metrics show A's permit free."""
    (stack.model_dir / "go").unlink(missing_ok=True)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(stack.infer, 1.0)
        wait_until(
            lambda: (stack.omnid.instances()["split"].get("batching") or {}).get(
                "batch_gpu_released_early"
            ),
            60,
            "A's GPU work to end",
        )
        assert not first.done()
        second = stack.infer(0.0)  # no CPU wait: served while A still works
        assert second.status_code == 200, second.text
        assert second.json()["outputs"][0]["data"] == [0.0]
        assert not first.done() and stack.permits_in_use() == 0  # A's permit went on
        (stack.model_dir / "go").write_text("")
        answer = first.result(timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2.0]
    assert answer.headers["content-type"].startswith("application/json")


def test_the_phases_are_reported_as_the_model_s_eta(stack):
    (stack.model_dir / "go").write_text("")
    assert stack.infer(0.0).status_code == 200

    def timed() -> dict | None:  # as of omnid's next health check of the instance
        batching = stack.omnid.instances()["split"].get("batching") or {}
        return batching if batching.get("batch_gpu_phase_ms") is not None else None

    batching = wait_until(timed, 30, "the phases in the instance's stats")
    assert batching["batch_gpu_phase_ms"] >= 0 and batching["batch_cpu_phase_ms"] >= 0
    models = httpx.get(f"{stack.omnid.base_url}/v1/models", timeout=10).json()["data"]
    (entry,) = [m for m in models if m["id"] == "split"]
    assert set(entry["load"]["eta_ms"]) == {"gpu", "cpu"}

    def at_the_edge() -> bool:
        text = httpx.get(f"{stack.edge_url}/metrics", timeout=10).text
        return 'omni_edge_model_eta_seconds{model="split",phase="gpu"}' in text

    wait_until(at_the_edge, 30, "the ETA in the edge's metrics")
