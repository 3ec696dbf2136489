"""Handlers yield their GPU to hotter models, through a real omnid: two third-party
handlers on one GPU (the real shim over the fake CUDA), one hotter than the other.
While the hotter one serves, the colder one's batch and its gpu_step() wait, each up to
the node's `gpu_yield` bound; once it is idle, they do not. Read from /v1/instances."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_until
from tests.nodes import Omnid

QUOTA = 64 << 20
YIELD_S = 0.5

HANDLERS = """
import time

from omni.instance.handler import Handler, TensorSpec, gpu_step


class Hold(Handler):
    \"\"\"Holds its GPU turn for x seconds.\"\"\"

    inputs = (TensorSpec("x", "FP32", (1,)),)
    outputs = (TensorSpec("y", "FP32", (1,)),)

    def infer(self, batch):
        time.sleep(max(float(r["x"][0]) for r in batch))
        return [{"y": r["x"]} for r in batch]


class Steps(Handler):
    \"\"\"Two GPU steps, a yield point between them.\"\"\"

    inputs = Hold.inputs
    outputs = Hold.outputs

    def infer(self, batch):
        gpu_step()
        return [{"y": r["x"] + 1} for r in batch]
"""


@pytest.fixture(scope="module")
def node(fake, tmp_path_factory):
    # world-readable: the sandboxes' own uids read the models and the fake CUDA
    root = Path(tempfile.mkdtemp(prefix="omni-handler-yield-", dir="/tmp"))
    root.chmod(0o755)
    libdir = root / "cuda"
    shutil.copytree(fake.libdir, libdir, symlinks=True, ignore=shutil.ignore_patterns("shim"))
    libdir.chmod(0o755)
    model = root / "handlers"
    model.mkdir(mode=0o755)
    (model / "handler.py").write_text(HANDLERS)
    (model / "handler.py").chmod(0o644)
    config = f'gpu_yield = {YIELD_S}\n[[gpus]]\nindex = 0\nbudget = "{4 * QUOTA}"\n'
    for name, cls in (("hot", "Hold"), ("cold", "Steps")):
        config += (
            f'[[models]]\nname = "{name}"\npath = "{model}"\nruntime = "python"\n'
            f'handler = "handler.py:{cls}"\ngpu = 0\nquota = {QUOTA}\npermits = 4\n'
        )
    omnid = Omnid(
        tmp_path_factory.mktemp("handler-yield"),
        config,
        "--data-dir",
        str(root / "state"),
        env={"LD_LIBRARY_PATH": str(libdir)},
    )
    try:
        omnid.wait_ready(["hot", "cold"], 300)
        yield omnid
    finally:
        omnid.stop()
        shutil.rmtree(root, ignore_errors=True)


def infer(omnid: Omnid, model: str, x: float) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [x]}]}
    return httpx.post(f"{omnid.base_url}/v2/models/{model}/infer", json=body, timeout=60)


def yields(omnid: Omnid) -> dict:
    return omnid.instances()["cold"].get("gpu_yield") or {"yield_steps": 0, "yield_wait_s": 0}


def test_a_colder_handler_waits_while_a_hotter_one_serves_and_not_after(node):
    for _ in range(4):  # the hotter model: more requests of late
        assert infer(node, "hot", 0.0).status_code == 200
    assert infer(node, "cold", 1.0).status_code == 200
    before = yields(node)

    held = threading.Thread(target=infer, args=(node, "hot", 4.0))
    held.start()
    try:
        wait_until(lambda: node.instances()["hot"]["in_flight"] == 1, 10, "the held request")
        t0 = time.monotonic()
        answer = infer(node, "cold", 1.0)
        waited = time.monotonic() - t0
    finally:
        held.join()
    assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [2.0]
    assert waited >= 2 * YIELD_S - 0.05
    # its batch's start and its gpu_step(), each held up to the bound (read from the
    # instance's health, which omnid polls)
    steps = lambda: yields(node)["yield_steps"] - before["yield_steps"]  # noqa: E731
    wait_until(lambda: steps() >= 2, 15, "the waits in omnid's view")
    during = yields(node)
    assert steps() == 2, (before, during)
    assert during["yield_wait_s"] - before["yield_wait_s"] >= 2 * YIELD_S - 0.05

    assert infer(node, "cold", 1.0).status_code == 200  # the hot one idle: no wait
    time.sleep(2 * 2.0)  # two health polls
    assert yields(node)["yield_steps"] == during["yield_steps"]
