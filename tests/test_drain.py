"""Unload and restart drain an instance: its streams in flight finish, new requests are
held (restart) or refused for another node to take (unload), none is cut."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from omni.testing.checkpoints import tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid

STREAMS = 6
TOKENS = 240  # the tiny model has no EOS: each stream is exactly this long


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("models") / "a")


@pytest.fixture
def node(tmp_path, model):
    config = f'[[models]]\nname = "a"\npath = "{model}"\npermits = 4\ndrain = 60\n'
    node = Omnid(tmp_path, config, "--sandbox", "process", env={"OMNI_TORCH_THREADS": "1"})
    node.wait_ready(["a"])
    yield node
    node.stop()


class Streams:
    """STREAMS streamed completions, each counting its tokens and how it ended."""

    def __init__(self, base_url: str):
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        self.started = threading.Barrier(STREAMS + 1)
        self.results: list[tuple[int, str | None]] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._one) for _ in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _one(self) -> None:
        tokens, finish = 0, None
        try:
            stream = self.client.completions.create(
                model="a", prompt="t1 t2 t3", max_tokens=TOKENS, temperature=0, stream=True
            )
            for i, chunk in enumerate(stream):
                if i == 0:
                    self.started.wait(timeout=60)
                tokens += 1 if chunk.choices and chunk.choices[0].text else 0
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
        except Exception as exc:
            self.errors.append(repr(exc))
            self.started.abort()
        self.results.append((tokens, finish))

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=120)


def test_a_restart_lets_streams_finish_and_holds_new_requests(node):
    pid = node.instances()["a"]["pid"]
    streams = Streams(node.base_url)
    streams.started.wait(timeout=60)  # every stream has its first token
    with node.admin() as c:
        r = c.post("/v1/instances/a/restart")
    assert r.status_code == 202, r.text
    assert r.json()["in_flight"] > 0  # the restart came while they streamed
    later = httpx.post(  # arrives while the old process drains: held for the new one
        f"{node.base_url}/v1/completions",
        json={"model": "a", "prompt": "t4", "max_tokens": 3},
        timeout=120,
    )
    streams.join()
    assert streams.errors == []
    assert streams.results == [(TOKENS, "length")] * STREAMS
    assert later.status_code == 200, later.text
    after = node.instances()["a"]
    assert after["pid"] != pid
    assert after["last_exit"].startswith("restarted by the operator"), after["last_exit"]


def test_an_unload_lets_streams_finish_and_refuses_new_requests(node):
    streams = Streams(node.base_url)
    streams.started.wait(timeout=60)
    unloaded: list[httpx.Response] = []
    unloading = threading.Thread(
        target=lambda: unloaded.append(node.admin().delete("/v1/models/a", timeout=120))
    )
    unloading.start()
    refused = None
    while refused is None and unloading.is_alive():  # once the unload has begun
        if node.instances().get("a", {}).get("state") == "draining":
            refused = httpx.post(
                f"{node.base_url}/v1/completions",
                json={"model": "a", "prompt": "t4", "max_tokens": 3},
                timeout=30,
            )
        time.sleep(0.01)
    unloading.join(timeout=120)
    streams.join()
    assert streams.errors == []
    assert streams.results == [(TOKENS, "length")] * STREAMS
    assert unloaded and unloaded[0].status_code == 200, unloaded
    assert refused is not None, "the unload never drained: the streams had ended before it"
    assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
    assert "a" not in node.instances()


SLOW_START = """
import time
import numpy as np
from omni.instance.handler import Handler, TensorSpec
class Sleepy(Handler):
    inputs = (TensorSpec("x", "FP32", (1,)),)
    outputs = (TensorSpec("x", "FP32", (1,)),)
    def load(self, model_dir, device):
        time.sleep(120)  # never ready while the test runs
    def infer(self, batch):
        return batch
"""


def test_a_request_waiting_for_a_start_is_answered_when_its_model_is_unloaded(tmp_path):
    """It waits (up to --ready-wait, 30 s here) for an instance still loading; unloaded
    meanwhile, the instance will never be ready: a 503 at once, not at the wait's end."""
    model = tmp_path / "sleepy"
    model.mkdir()
    (model / "handler.py").write_text(SLOW_START)
    model.chmod(0o755)
    config = f'[[models]]\nname = "s"\npath = "{model}"\nruntime = "python"\n'
    config += 'handler = "handler.py:Sleepy"\n'
    node = Omnid(tmp_path, config, "--sandbox", "process", "--ready-wait", "30")
    try:

        def starting() -> bool:
            try:
                return node.instances().get("s", {}).get("state") == "starting"
            except httpx.ConnectError:  # its admin socket is not up yet
                return False

        wait_until(starting, 60, "the instance starting")
        answered: list[tuple[httpx.Response, float]] = []

        def infer() -> None:
            t0 = time.monotonic()
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}
            r = httpx.post(f"{node.base_url}/v2/models/s/infer", json=body, timeout=60)
            answered.append((r, time.monotonic() - t0))

        waiting = threading.Thread(target=infer)
        waiting.start()
        time.sleep(1.0)  # it is waiting for the start by now
        with node.admin() as c:
            assert c.delete("/v1/models/s", timeout=60).status_code == 200
        waiting.join(timeout=60)
        ((response, seconds),) = answered
        assert response.status_code == 503 and response.headers.get("retry-after"), response.text
        assert seconds < 15, seconds  # (the whole wait would be 30 s)
    finally:
        node.stop()
