"""The Open Inference Protocol (KServe v2) on omnid and through the edge, over HTTP and
gRPC, with Triton's own clients (`tritonclient.http`, `tritonclient.grpc`) unchanged.

A real omnid serves a tiny handler model (`runtime = "python"`, a handler.py in its
directory); a real edge with API keys stands in front of it. Both run their gRPC front.
Every check runs on the four ways in: omnid or the edge, HTTP or gRPC.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from edge.tenants import hash_key
from omni.api import oip
from omni.testing.checkpoints import tiny_llama
from tests.conftest import free_port, running_server, wait_until
from tests.nodes import Omnid

REPO = Path(__file__).resolve().parent.parent
MODEL = "echo"
SLOW = "slow"  # one permit: it sleeps as long as its request says
LLM = "chat"  # OMNI's own engine: OpenAI routes only
KEY = "sk-oip-0123456789"
HANDLER = '''
import time

import numpy as np

from omni.instance.handler import Handler, TensorSpec


class Echo(Handler):
    """x doubled, text upper-cased."""

    inputs = (TensorSpec("x", "FP32", (-1,)), TensorSpec("text", "BYTES", (-1,)))
    outputs = (TensorSpec("doubled", "FP32", (-1,)), TensorSpec("upper", "BYTES", (-1,)))
    max_batch_size = 4

    def infer(self, batch):
        answers = []
        for request in batch:
            upper = np.empty(len(request["text"]), dtype=object)
            upper[:] = [t.upper() for t in request["text"]]
            answers.append({"doubled": request["x"] * 2, "upper": upper})
        return answers


class Slow(Handler):
    inputs = (TensorSpec("seconds", "FP32", (1,)),)
    outputs = (TensorSpec("slept", "FP32", (1,)),)

    def infer(self, batch):
        for request in batch:
            time.sleep(float(request["seconds"][0]))
        return [{"slept": request["seconds"]} for request in batch]
'''


@dataclass
class Target:
    """One way in: where, and which of Triton's clients."""

    name: str
    url: str  # HOST:PORT, as tritonclient takes it
    grpc: bool
    headers: dict[str, str]

    def client(self):
        module = triton_grpc if self.grpc else triton_http
        return module.InferenceServerClient(self.url)

    @property
    def module(self):
        return triton_grpc if self.grpc else triton_http


@dataclass
class Stack:
    omnid: Omnid
    omnid_grpc: int
    edge_http: int
    edge_grpc: int
    edge_log: Path

    def targets(self) -> dict[str, Target]:
        auth = {"authorization": f"Bearer {KEY}"}
        local = "127.0.0.1"
        return {
            "omnid-http": Target("omnid-http", f"{local}:{self.omnid.port}", False, {}),
            "omnid-grpc": Target("omnid-grpc", f"{local}:{self.omnid_grpc}", True, {}),
            "edge-http": Target("edge-http", f"{local}:{self.edge_http}", False, auth),
            "edge-grpc": Target("edge-grpc", f"{local}:{self.edge_grpc}", True, auth),
        }

    def access(self, trace: str) -> dict:
        """The edge's access-log record of the request sent with `trace`."""

        def record() -> dict | None:
            for line in self.edge_log.read_text().splitlines():
                if "omni-edge.access: " in line and trace in line:
                    return orjson.loads(line.split("omni-edge.access: ", 1)[1])
            return None

        return wait_until(record, 20, f"the access log of trace {trace}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("oip")
    model_dir = tmp / "echo"
    model_dir.mkdir()
    (model_dir / "handler.py").write_text(HANDLER)
    config = "".join(
        f'[[models]]\nname = "{name}"\npath = "{model_dir}"\n'
        f'runtime = "python"\nhandler = "handler.py:{cls}"\n{extra}\n'
        for name, cls, extra in [(MODEL, "Echo", ""), (SLOW, "Slow", "permits = 1\n")]
    )
    config += f'[[models]]\nname = "{LLM}"\npath = "{tiny_llama(tmp / LLM)}"\n'

    omnid_grpc = free_port()
    omnid = Omnid(tmp, config, "--grpc-port", str(omnid_grpc))
    edge = None
    try:
        omnid.wait_ready([MODEL, SLOW, LLM])
        (tmp / "tenants.toml").write_text(
            f'[[tenants]]\nname = "oip"\nweight = 1\nkeys = ["{hash_key(KEY)}"]\n'
        )
        edge_http, edge_grpc = free_port(), free_port()
        log = tmp / "edge.log"
        argv = [sys.executable, "-m", "edge.server", "--port", str(edge_http)]
        argv += ["--grpc-port", str(edge_grpc), "--dashboard", "off"]
        argv += ["--upstream", omnid.base_url, "--tenants", str(tmp / "tenants.toml")]
        edge = subprocess.Popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)

        def edge_ready() -> bool:
            if edge.poll() is not None:
                raise AssertionError(log.read_text())
            try:
                url = f"http://127.0.0.1:{edge_http}/v2/health/ready"
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(edge_ready, 60, "the edge ready", interval_s=0.2)
        yield Stack(omnid, omnid_grpc, edge_http, edge_grpc, log)
    finally:
        if edge is not None:
            edge.terminate()
            edge.wait(timeout=30)
        omnid.stop()


WAYS = ["omnid-http", "omnid-grpc", "edge-http", "edge-grpc"]


@pytest.fixture(params=WAYS)
def target(request, stack: Stack) -> Target:
    return stack.targets()[request.param]


def inputs(module, x: np.ndarray, text: list[bytes], binary: bool = True) -> list:
    x_in = module.InferInput("x", list(x.shape), "FP32")
    text_in = module.InferInput("text", [len(text)], "BYTES")
    array = np.empty(len(text), dtype=object)
    array[:] = text
    if module is triton_http:
        x_in.set_data_from_numpy(x, binary_data=binary)
        text_in.set_data_from_numpy(array, binary_data=binary)
    else:
        x_in.set_data_from_numpy(x)
        text_in.set_data_from_numpy(array)
    return [x_in, text_in]


def test_health_and_server_metadata(target: Target) -> None:
    client = target.client()
    assert client.is_server_live(headers=target.headers)
    assert client.is_server_ready(headers=target.headers)
    meta = client.get_server_metadata(headers=target.headers)
    if target.grpc:
        name, extensions = meta.name, list(meta.extensions)
    else:
        name, extensions = meta["name"], meta["extensions"]
    assert name == "omni" and "binary_tensor_data" in extensions


def tensors(specs) -> list[dict]:
    """gRPC's TensorMetadata as HTTP's JSON."""
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in specs]


def test_model_metadata_and_readiness(target: Target) -> None:
    client = target.client()
    assert client.is_model_ready(MODEL, headers=target.headers)
    meta = client.get_model_metadata(MODEL, headers=target.headers)
    if target.grpc:
        meta = {"name": meta.name, "inputs": tensors(meta.inputs), "outputs": tensors(meta.outputs)}
    assert meta["name"] == MODEL
    assert meta["inputs"] == [
        {"name": "x", "datatype": "FP32", "shape": [-1]},
        {"name": "text", "datatype": "BYTES", "shape": [-1]},
    ]
    assert [t["name"] for t in meta["outputs"]] == ["doubled", "upper"]
    assert not client.is_model_ready("no-such-model", headers=target.headers)


# tritonclient.grpc sends raw contents only (typed contents: test_grpc_typed_contents)
ENCODINGS = [(w, True) for w in WAYS] + [("omnid-http", False), ("edge-http", False)]


@pytest.mark.parametrize(("way", "binary"), ENCODINGS)
def test_infer(stack: Stack, way: str, binary: bool) -> None:
    target = stack.targets()[way]
    module, client = target.module, target.client()
    x = np.random.default_rng().standard_normal(5).astype(np.float32)
    text = [uuid.uuid4().hex.encode(), b"", "héllo".encode()]
    result = client.infer(MODEL, inputs(module, x, text, binary), headers=target.headers)
    assert np.array_equal(result.as_numpy("doubled"), x * 2)
    upper = [t if isinstance(t, bytes) else t.encode() for t in result.as_numpy("upper")]
    assert upper == [t.upper() for t in text]

    kwargs = {"binary_data": binary} if module is triton_http else {}
    only = [module.InferRequestedOutput("upper", **kwargs)]
    result = client.infer(
        MODEL, inputs(module, x, text, binary), outputs=only, headers=target.headers
    )
    assert result.as_numpy("doubled") is None and len(result.as_numpy("upper")) == 3


def error_of(target: Target, call) -> tuple[str, str]:
    """(status, message) of a call that fails: the HTTP status, or the gRPC code's name."""
    with pytest.raises(InferenceServerException) as err:
        call()
    return str(err.value.status()).removeprefix("StatusCode."), err.value.message()


def test_errors(target: Target) -> None:
    module, client = target.module, target.client()
    good = inputs(module, np.ones(2, np.float32), [b"a"])
    status, message = error_of(target, lambda: client.infer("nope", good, headers=target.headers))
    assert status == ("NOT_FOUND" if target.grpc else "404") and "nope" in message
    status, message = error_of(
        target, lambda: client.get_model_metadata("nope", headers=target.headers)
    )
    assert status == ("NOT_FOUND" if target.grpc else "404") and "nope" in message

    bad = inputs(module, np.ones((2, 2), np.float32), [b"a"])
    status, message = error_of(target, lambda: client.infer(MODEL, bad, headers=target.headers))
    assert status == ("INVALID_ARGUMENT" if target.grpc else "400")
    assert "'x'" in message and "[2, 2]" in message


@pytest.mark.parametrize("way", ["edge-http", "edge-grpc"])
def test_edge_admits_and_authenticates_oip_requests(stack: Stack, way: str) -> None:
    """Through the edge, an infer request takes a permit of the model's fair queue like
    any /v1 request (its access log says so), and needs the tenant's key."""
    target = stack.targets()[way]
    module, client = target.module, target.client()
    trace = f"00-{uuid.uuid4().hex}-{'1' * 16}-01"
    headers = {**target.headers, "traceparent": trace}
    client.infer(MODEL, inputs(module, np.ones(2, np.float32), [b"a"]), headers=headers)
    record = stack.access(trace[3:35])
    assert record["tenant"] == "oip" and record["model"] == MODEL and record["status"] == 200
    assert record["path"] == f"/v2/models/{MODEL}/infer" and record["nodes"]

    good = inputs(module, np.ones(2, np.float32), [b"a"])
    status, _ = error_of(target, lambda: client.infer(MODEL, good))  # no key
    assert status == ("UNAUTHENTICATED" if target.grpc else "401")


def test_errors_are_oip_bodies(stack: Stack) -> None:
    """Under /v2 an error is `{"error": "..."}`, whichever layer answers it."""
    for base in (stack.omnid.base_url, f"http://127.0.0.1:{stack.edge_http}"):
        headers = {"authorization": f"Bearer {KEY}"}
        for method, path, status in [
            ("POST", "/v2/models/nope/infer", 404),
            ("POST", f"/v2/models/{MODEL}/infer", 400),
            ("GET", "/v2/models/nope/ready", 404),
            ("GET", "/v2/nothing-here", 404),
        ]:
            resp = httpx.request(method, base + path, content=b"{", headers=headers)
            assert resp.status_code == status, (base, path, resp.text)
            assert isinstance(resp.json()["error"], str), resp.text
        versions = f"{base}/v2/models/{MODEL}/versions"
        assert httpx.get(f"{versions}/1", headers=headers).json()["name"] == MODEL
        assert httpx.get(f"{versions}/1/ready", headers=headers).status_code == 200
        unknown = httpx.get(f"{versions}/7", headers=headers)
        assert unknown.status_code == 404 and "version '7'" in unknown.json()["error"]


@pytest.mark.parametrize("way", ["omnid-grpc", "edge-grpc"])
def test_grpc_typed_contents(stack: Stack, way: str) -> None:
    """Typed `contents` in place of raw bytes (what other KServe clients send)."""
    target = stack.targets()[way]
    request = service_pb2.ModelInferRequest(model_name=MODEL, id="typed-1")
    x = request.inputs.add(name="x", datatype="FP32", shape=[3])
    x.contents.fp32_contents.extend([1.5, -2.0, 0.25])
    text = request.inputs.add(name="text", datatype="BYTES", shape=[2])
    text.contents.bytes_contents.extend([b"ab", b"xyz"])
    with grpc.insecure_channel(target.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = tuple(target.headers.items())
        response = stub.ModelInfer(request, metadata=metadata, timeout=30)
        result = triton_grpc.InferResult(response)
        assert response.id == "typed-1"
        assert result.as_numpy("doubled").tolist() == [3.0, -4.0, 0.5]
        assert result.as_numpy("upper").tolist() == [b"AB", b"XYZ"]

        x.contents.fp32_contents.append(9.0)  # 4 values for a shape of 3
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, metadata=metadata, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'x'" in err.value.details()


def test_llm_models_are_not_under_v2(target: Target) -> None:
    """OMNI's own LLM is absent from /v2, with a message naming its routes."""
    client = target.client()
    assert not client.is_model_ready(LLM, headers=target.headers)
    status, message = error_of(
        target, lambda: client.get_model_metadata(LLM, headers=target.headers)
    )
    assert status == ("NOT_FOUND" if target.grpc else "404") and "/v1" in message
    good = inputs(target.module, np.ones(2, np.float32), [b"a"])
    status, message = error_of(target, lambda: client.infer(LLM, good, headers=target.headers))
    assert status == ("NOT_FOUND" if target.grpc else "404") and "/v1" in message


def test_llm_still_serves_v1(stack: Stack) -> None:
    body = {"model": LLM, "prompt": "t1 t2", "max_tokens": 2}
    resp = httpx.post(f"{stack.omnid.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text


def slow_body(seconds: float) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]}
    )


def test_omnid_sheds_past_its_permit_queue(stack: Stack) -> None:
    """One permit and four waiting per permit: of eight requests at once, some get 429
    with Retry-After (an OIP error body), the others their answer; over gRPC the same
    is RESOURCE_EXHAUSTED, with the retry-after in its trailing metadata."""
    url = f"{stack.omnid.base_url}/v2/models/{SLOW}/infer"
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda _: httpx.post(url, content=slow_body(0.3), timeout=60), range(8))
        )
    shed = [a for a in answers if a.status_code == 429]
    assert shed and all(a.headers.get("Retry-After") for a in shed)
    assert all(isinstance(a.json()["error"], str) for a in shed)
    assert {a.status_code for a in answers} == {200, 429}

    request = service_pb2.ModelInferRequest(model_name=SLOW)
    tensor = request.inputs.add(name="seconds", datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(0.3)
    with grpc.insecure_channel(f"127.0.0.1:{stack.omnid_grpc}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer.future(request, timeout=60) for _ in range(8)]
        codes = [c.code() for c in calls]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
    exhausted = next(c for c in calls if c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert dict(exhausted.trailing_metadata()).get("retry-after")


@pytest.mark.parametrize("way", ["edge-http", "edge-grpc"])
def test_edge_queues_for_the_models_permits(stack: Stack, way: str) -> None:
    """Through the edge, requests beyond the model's one permit wait in its fair queue
    (none is shed by omnid): all answered, one after another."""
    target = stack.targets()[way]
    module = target.module
    traces = [f"00-{uuid.uuid4().hex}-{'2' * 16}-01" for _ in range(3)]

    def call(trace: str):
        seconds = module.InferInput("seconds", [1], "FP32")
        seconds.set_data_from_numpy(np.array([0.4], np.float32))
        headers = {**target.headers, "traceparent": trace}
        return target.client().infer(SLOW, [seconds], headers=headers)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(call, traces))
    assert all(np.allclose(r.as_numpy("slept"), [0.4]) for r in results)
    records = [stack.access(t[3:35]) for t in traces]
    assert all(r["status"] == 200 for r in records)
    assert max(r["queued_ms"] for r in records) >= 600  # the third waited for two


def test_omni_serve_passes_its_grpc_port_to_the_edge(tmp_path) -> None:
    """`omni serve --grpc-port` is the edge's: Triton's clients reach the handler model
    over HTTP on the edge's port and over gRPC on that one."""
    model_dir = tmp_path / "echo"
    model_dir.mkdir()
    (model_dir / "handler.py").write_text(HANDLER)
    config = tmp_path / "omnid.toml"
    config.write_text(
        f'default_models = false\n\n[[models]]\nname = "{MODEL}"\npath = "{model_dir}"\n'
        'runtime = "python"\nhandler = "handler.py:Echo"\n'
    )
    grpc_port = free_port()
    with running_server(
        tmp_path, "--config", str(config), "--grpc-port", str(grpc_port), ready=(MODEL,)
    ) as server:
        x = np.arange(3, dtype=np.float32)
        for module, url in [
            (triton_http, f"127.0.0.1:{server.port}"),
            (triton_grpc, f"127.0.0.1:{grpc_port}"),
        ]:
            client = module.InferenceServerClient(url)
            assert client.is_server_ready() and client.is_model_ready(MODEL)
            result = client.infer(MODEL, inputs(module, x, [b"ok"]))
            assert result.as_numpy("doubled").tolist() == [0.0, 2.0, 4.0]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_answers_come_in_the_encoding_asked(stack: Stack, binary: bool) -> None:
    """Binary outputs when asked for, JSON otherwise, through both hops unchanged."""
    text = np.empty(1, dtype=object)
    text[:] = [b"hi"]
    arrays = {"x": np.array([1.5, 2.5], np.float32), "text": text}
    body, headers = oip.encode_request(
        arrays, ["doubled"], binary_inputs=binary, binary_outputs=binary
    )
    headers["authorization"] = f"Bearer {KEY}"
    for base in (stack.omnid.base_url, f"http://127.0.0.1:{stack.edge_http}"):
        resp = httpx.post(f"{base}/v2/models/{MODEL}/infer", content=body, headers=headers)
        assert resp.status_code == 200, resp.text
        assert (oip.HEADER_LENGTH in resp.headers) == binary
        answer = oip.decode_response(resp.content, resp.headers)
        assert list(answer.outputs) == ["doubled"]
        assert answer.outputs["doubled"].tolist() == [3.0, 5.0]
