"""Cancellations are counted as what they are, with real processes and the openai client:
a client that leaves mid-stream is 499 under its model (omnid's /metrics, the edge's
metrics and access log), a stream the node breaks off is 502, and a request the client
had all of is 200, a stream whose client closed right after its [DONE] included."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni.testing.checkpoints import tiny_llama
from omni.testing.standin import StandinNode
from tests.conftest import free_port, wait_until
from tests.nodes import Omnid

REPO = Path(__file__).resolve().parent.parent
LONG = 200  # tokens: the tiny model has no EOS, so such a stream is still going when left
STREAMS = 20  # complete streams through the edge (before the fix, about 1 in 8 said "error")


class Edge:
    """omni-edge in its own process in front of `upstreams`; its log in `tmp`."""

    def __init__(self, tmp: Path, upstreams: list[str]):
        self.url = f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "edge.server", "--port", self.url.rsplit(":", 1)[1]]
        argv += ["--dashboard", "off", *(f"--upstream={u}" for u in upstreams)]
        self.log = tmp / "edge.log"
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )

    def serving(self, model: str) -> None:
        def answered() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(self.log.read_text())
            try:
                body = {"model": model, "prompt": "t1", "max_tokens": 1}
                return httpx.post(f"{self.url}/v1/completions", json=body).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(answered, 60, "the edge serving", interval_s=0.2)

    def access(self, trace: str) -> dict:
        """The access-log record of the request sent with `trace` (waited for)."""

        def record() -> dict | None:
            for line in self.log.read_text().splitlines():
                if "omni-edge.access: " in line and trace in line:
                    return orjson.loads(line.split("omni-edge.access: ", 1)[1])
            return None

        return wait_until(record, 20, f"the access log of trace {trace}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def requests_by(url: str, metric: str) -> Counter:
    """A /metrics page's request counter, by (model, status)."""
    counts: Counter = Counter()
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == f"{metric}_total":
                counts[s.labels["model"], s.labels["status"]] += s.value
    return counts


def client(url: str, trace: str) -> openai.OpenAI:
    """An openai client whose requests carry `trace` (the edge logs it in its traceparent)."""
    headers = {"traceparent": f"00-{trace}-{secrets.token_hex(8)}-01"}
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, default_headers=headers)


def abandon(url: str, model: str) -> str:
    """A long streamed completion left after its first chunk; its trace id."""
    trace = secrets.token_hex(16)
    stream = client(url, trace).completions.create(
        model=model, prompt="t1 t2", max_tokens=LONG, stream=True
    )
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None  # mid-stream, as meant
    stream.close()
    return trace


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A tiny model in omnid (process sandbox) with an edge in front."""
    tmp = tmp_path_factory.mktemp("cancellations")
    model = tiny_llama(tmp / "tiny")
    omnid = Omnid(
        tmp,
        f'[[models]]\nname = "tiny"\npath = "{model}"\npermits = 2\n',
        "--sandbox",
        "process",
        env={"OMNI_TORCH_THREADS": "1"},
    )
    edge = None
    try:
        omnid.wait_ready(["tiny"])
        edge = Edge(tmp, [omnid.base_url])
        edge.serving("tiny")
        yield omnid, edge
    finally:
        if edge is not None:
            edge.stop()
        omnid.stop()


def test_omnid_counts_a_stream_its_client_left_as_499_under_its_model(stack):
    omnid, _ = stack
    before = requests_by(omnid.base_url, "omni_requests")
    abandon(omnid.base_url, "tiny")

    def counted() -> Counter | None:
        now = requests_by(omnid.base_url, "omni_requests")
        return now if now["tiny", "499"] == before["tiny", "499"] + 1 else None

    after = wait_until(counted, 20, "omnid counting the abandoned stream")
    assert after["tiny", "200"] == before["tiny", "200"]  # not a success either
    assert sum(n for (_, status), n in after.items() if status == "500") == sum(
        n for (_, status), n in before.items() if status == "500"
    )
    assert after["-", "499"] == 0


def test_the_edge_logs_what_the_client_saw(stack):
    omnid, edge = stack
    at_omnid = requests_by(omnid.base_url, "omni_requests")
    at_edge = requests_by(edge.url, "omni_edge_requests")
    traces = [secrets.token_hex(16) for _ in range(STREAMS)]
    for trace in traces:  # read to [DONE]; the client closes before the chunked end
        stream = client(edge.url, trace).completions.create(
            model="tiny", prompt="t1 t2", max_tokens=2, stream=True
        )
        assert [c.choices[0].finish_reason for c in stream][-1] == "length"
    whole = secrets.token_hex(16)
    answer = client(edge.url, whole).completions.create(model="tiny", prompt="t1", max_tokens=2)
    assert answer.choices[0].finish_reason == "length"
    left = abandon(edge.url, "tiny")

    assert [edge.access(t)["status"] for t in traces] == [200] * STREAMS
    assert edge.access(whole)["status"] == 200
    assert edge.access(left)["status"] == 499
    now = requests_by(edge.url, "omni_edge_requests")
    assert now["tiny", "200"] - at_edge["tiny", "200"] == STREAMS + 1
    assert now["tiny", "499"] - at_edge["tiny", "499"] == 1
    changed = {status for (model, status), n in now.items() if n != at_edge[model, status]}
    assert changed == {"200", "499"}  # no "error", no 500

    def counted() -> Counter | None:  # omnid saw the edge leave, and says so too
        got = requests_by(omnid.base_url, "omni_requests")
        return got if got["tiny", "499"] == at_omnid["tiny", "499"] + 1 else None

    got = wait_until(counted, 20, "omnid counting the stream the edge left")
    assert got["tiny", "200"] - at_omnid["tiny", "200"] == STREAMS + 1


def test_a_stream_the_node_breaks_off_is_502_at_the_edge(tmp_path):
    node = StandinNode(models=("m",), token_s=0.05)
    edge = Edge(tmp_path, [node.url])
    try:
        edge.serving("m")
        trace = secrets.token_hex(16)
        stream = client(edge.url, trace).completions.create(
            model="m", prompt="hello", max_tokens=LONG, stream=True
        )
        chunks = iter(stream)
        next(chunks)
        node.kill()  # mid-stream: the edge has sent its 200 and writes an error event
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            for _ in chunks:
                pass
        assert edge.access(trace)["status"] == 502
        assert requests_by(edge.url, "omni_edge_requests")["m", "502"] == 1
    finally:
        edge.stop()
        node.stop()
