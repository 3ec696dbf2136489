"""`POST /v1/run/{model}`, plain JSON for handler models, on omnid and through the edge.

A real omnid serves language identification (py3langid's own weights), Silero VAD (the
silero-vad wheel's model), a numeric handler this file writes (one permit, so it can be
overloaded) and a tiny LLM; a real edge with an API key stands in front.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from omni.api import oip, run_json
from omni.api.errors import ApiError
from omni.testing.checkpoints import tiny_llama
from tests.conftest import wait_until
from tests.nodes import Omnid
from tests.runtimes.conftest import silence, wav_bytes
from tests.test_transcriptions import AUTH, SANDBOX, start_edge, world_readable

LANGID, VAD, NUMBERS, LLM = "langid", "vad", "numbers", "chat"
WHERE = ["omnid", "edge"]
HANDLER = '''
import time

import numpy as np

from omni.instance.handler import Handler, HandlerError, TensorSpec


class Numbers(Handler):
    """Numbers in, numbers out; `wait_s` holds the permit that long."""

    inputs = (
        TensorSpec("matrix", "FP32", (-1, 3)),
        TensorSpec("scale", "INT16", (1,)),
        TensorSpec("flags", "BOOL", (2,)),
        TensorSpec("wait_s", "FP32", (1,)),
    )
    outputs = (
        TensorSpec("scaled", "FP64", (-1, 3)),
        TensorSpec("total", "INT64", (1,)),
        TensorSpec("flags", "BOOL", (2,)),
        TensorSpec("note", "BYTES", (1,)),
        TensorSpec("raw", "BYTES", (1,)),
    )

    def infer(self, batch):
        return [self.one(request) for request in batch]

    def one(self, request):
        scale = int(request["scale"][0])
        if scale == 0:
            return HandlerError("scale must not be 0")
        time.sleep(float(request["wait_s"][0]))
        matrix = request["matrix"].astype(np.float64)
        note, raw = np.empty(1, dtype=object), np.empty(1, dtype=object)
        note[0], raw[0] = f"{matrix.shape[0]} rows".encode(), b"\\xff\\x00"
        return {
            "scaled": matrix * scale,
            "total": np.array([int(matrix.sum())], dtype=np.int64),
            "flags": ~request["flags"],
            "note": note,
            "raw": raw,
        }
'''


@dataclass
class Stack:
    omnid: Omnid
    edge_url: str

    def url(self, where: str) -> str:
        return self.edge_url if where == "edge" else self.omnid.base_url


def write_config(tmp: Path) -> str:
    dirs = {name: tmp / name for name in (LANGID, VAD, NUMBERS)}
    for path in dirs.values():
        path.mkdir()
    for name in (LANGID, VAD):
        (dirs[name] / "omni-model.toml").write_text('weights = "package"\n')
    (dirs[NUMBERS] / "handler.py").write_text(HANDLER)
    world_readable(*dirs.values())
    handlers = {
        LANGID: "omni.runtimes.language_id:LanguageID",
        VAD: "omni.runtimes.silero_vad_runtime:SileroVAD",
        NUMBERS: "handler.py:Numbers",
    }
    config = ""
    for name, handler in handlers.items():
        config += f'[[models]]\nname = "{name}"\npath = "{dirs[name]}"\nruntime = "python"\n'
        config += f'handler = "{handler}"\nmemory = "2GiB"\n'
        config += "permits = 1\n\n" if name == NUMBERS else "\n"
    return config + f'[[models]]\nname = "{LLM}"\npath = "{tiny_llama(tmp / LLM)}"\n'


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("run")
    omnid = Omnid(tmp, write_config(tmp), "--sandbox", SANDBOX)
    edge = None
    try:
        omnid.wait_ready([LANGID, VAD, NUMBERS, LLM], timeout_s=180)
        edge, edge_url = start_edge(tmp, omnid)
        yield Stack(omnid, edge_url)
    finally:
        if edge is not None:
            edge.terminate()
            edge.wait(timeout=30)
        assert omnid.stop() == 0, omnid.log()


def run(stack: Stack, where: str, model: str, body: object = None, raw: bytes | None = None):
    """The route's answer to `body` as JSON (or to the bytes `raw`)."""
    content = raw if raw is not None else orjson.dumps(body)
    headers = {**AUTH, "Content-Type": "application/json"}
    url = f"{stack.url(where)}/v1/run/{model}"
    return httpx.post(url, content=content, headers=headers, timeout=60)


def result_of(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()["result"]


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def numbers(**changes: object) -> dict:
    """A body for the numeric handler, with `changes`."""
    body = {"matrix": [[1, 2, 3], [4, 5, 6.5]], "scale": 2, "flags": [True, False]}
    return {**body, "wait_s": 0.0, **changes}


# ---- what a caller gets ------------------------------------------------------------


@pytest.mark.parametrize(
    "text, language",
    [
        ("Bonjour tout le monde, je suis très content de vous voir aujourd'hui.", "fr"),
        ("I love this, it is a wonderful day and everyone is happy.", "en"),
    ],
)
def test_a_sentence_gets_its_language_through_the_edge(stack: Stack, text: str, language: str):
    result = result_of(run(stack, "edge", LANGID, {"text": text}))
    assert result["label"] == language
    assert isinstance(result["scores"], list) and len(result["scores"]) > 50
    assert sum(result["scores"]) == pytest.approx(1.0, abs=1e-3)


def test_vad_on_base64_silence_finds_no_speech(stack: Stack):
    wav = base64.b64encode(wav_bytes(silence(1.0))).decode()
    assert "audio" in run_json.BINARY_NAMES
    assert result_of(run(stack, "edge", VAD, {"audio": wav})) == {"segments": []}
    same = run(stack, "edge", VAD, {"audio": {"base64": wav}})  # (the explicit form)
    assert result_of(same) == {"segments": []}


@pytest.mark.parametrize("where", WHERE)
def test_numbers_round_trip_with_their_shapes(stack: Stack, where: str):
    result = result_of(run(stack, where, NUMBERS, numbers()))
    assert result == {
        "scaled": [[2.0, 4.0, 6.0], [8.0, 10.0, 13.0]],
        "total": 21,
        "flags": [False, True],
        "note": "2 rows",
        "raw": {"base64": base64.b64encode(b"\xff\x00").decode()},
    }
    empty = result_of(run(stack, where, NUMBERS, numbers(matrix=[], scale=[3])))
    assert empty["scaled"] == [] and empty["total"] == 0 and empty["note"] == "0 rows"


def test_omnid_answers_the_same_without_the_edge(stack: Stack):
    body = {"text": "Das ist ein schöner Tag in Berlin, und wir gehen spazieren."}
    direct, edge = run(stack, "omnid", LANGID, body), run(stack, "edge", LANGID, body)
    assert result_of(direct) == result_of(edge)
    assert result_of(direct)["label"] == "de"


# ---- errors: OpenAI's bodies, naming the field -----------------------------------


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(
    "body, param",
    [
        (numbers(colour="red"), "colour"),  # an input the model does not take
        ({"matrix": [[1, 2, 3]], "scale": 1}, "flags"),  # one missing
        (numbers(matrix=[[1, 2]]), "matrix"),  # the wrong shape
        (numbers(matrix=[[1, 2, 3], [4, 5]]), "matrix"),  # ragged
        (numbers(matrix=[1, 2, 3]), "matrix"),  # too shallow
        (numbers(matrix=[["a", 2, 3]]), "matrix"),  # not a number
        (numbers(scale=1.5), "scale"),  # not an integer
        (numbers(scale=40_000), "scale"),  # past INT16
        (numbers(flags=[1, 0]), "flags"),  # not booleans
        (numbers(matrix=[[1e39, 0, 0]]), "matrix"),  # past FP32
    ],
)
def test_a_body_that_does_not_fit_the_model_is_a_400_naming_the_field(
    stack: Stack, where: str, body: dict, param: str
):
    error = error_of(run(stack, where, NUMBERS, body), 400)
    assert error["param"] == param and param in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("where", WHERE)
def test_text_and_audio_of_the_wrong_kind_are_400s(stack: Stack, where: str):
    assert error_of(run(stack, where, LANGID, {"text": 42}), 400)["param"] == "text"
    assert error_of(run(stack, where, VAD, {"audio": "not base64!"}), 400)["param"] == "audio"


@pytest.mark.parametrize("where", WHERE)
def test_a_body_that_is_not_a_json_object_is_a_400(stack: Stack, where: str):
    bad = run(stack, where, LANGID, raw=b"{not json")
    assert error_of(bad, 400)["code"] == "invalid_json"
    assert "JSON object" in error_of(run(stack, where, LANGID, ["hello"]), 400)["message"]


@pytest.mark.parametrize("where", WHERE)
def test_the_handlers_refusal_is_a_400_with_its_message(stack: Stack, where: str):
    error = error_of(run(stack, where, NUMBERS, numbers(scale=0)), 400)
    assert error["message"] == "scale must not be 0"
    not_audio = base64.b64encode(b"not a sound file").decode()
    error = error_of(run(stack, where, VAD, {"audio": not_audio}), 400)
    assert error["message"].startswith("audio: not a sound file") and error["param"] == "audio"


@pytest.mark.parametrize("where", WHERE)
def test_an_unknown_model_is_a_404(stack: Stack, where: str):
    assert error_of(run(stack, where, "nope", {"text": "hi"}), 404)["code"] == "model_not_found"


@pytest.mark.parametrize("where", WHERE)
def test_an_llm_is_a_400_pointing_to_chat_completions(stack: Stack, where: str):
    error = error_of(run(stack, where, LLM, {"text": "hi"}), 400)
    assert "/v1/chat/completions" in error["message"]
    assert error["param"] == "model" and error["code"] == "wrong_model_kind"


@pytest.mark.parametrize("where, limit", [("omnid", 64 << 20), ("edge", 4 << 20)])
def test_a_body_past_the_limit_is_a_413(stack: Stack, where: str, limit: int):
    huge = b'{"text": "' + b"a" * limit + b'"}'
    resp = run(stack, where, LANGID, raw=huge)
    assert error_of(resp, 413)["type"] == "invalid_request_error"


def test_the_instances_keep_serving_after_bad_requests(stack: Stack):
    for _ in range(3):
        error_of(run(stack, "edge", NUMBERS, numbers(scale=0)), 400)
        error_of(run(stack, "edge", NUMBERS, {"matrix": "x"}), 400)
        error_of(run(stack, "edge", VAD, {"audio": base64.b64encode(b"RIFF junk").decode()}), 400)
    assert result_of(run(stack, "edge", NUMBERS, numbers()))["total"] == 21
    assert result_of(run(stack, "edge", LANGID, {"text": "hello there my friend"}))["label"]
    instances = stack.omnid.instances()
    assert all(instances[name]["state"] == "ready" for name in (LANGID, VAD, NUMBERS))


# ---- admission: the same permits as every request --------------------------------


def test_overload_at_omnid_is_a_429_with_retry_after_and_the_edge_queues_it(stack: Stack):
    with ThreadPoolExecutor(8) as pool:
        # one request holds the model's one permit while the burst comes: the node's
        # queue (4) takes some of the burst, the rest are turned away at once
        holder = pool.submit(run, stack, "omnid", NUMBERS, numbers(wait_s=3.0))
        wait_until(lambda: stack.omnid.instances()[NUMBERS]["in_flight"] == 1, 30, "in flight")
        quick = numbers()
        burst = list(pool.map(lambda _: run(stack, "omnid", NUMBERS, quick), range(7)))
        assert holder.result().status_code == 200
    refused = [r for r in burst if r.status_code == 429]
    assert len(refused) == 3 and all(r.headers.get("Retry-After") for r in refused)
    assert error_of(refused[0], 429)["type"] == "rate_limit_error"
    # the edge holds a burst in its fair queue for the node's one permit: none refused
    with ThreadPoolExecutor(6) as pool:
        queued = list(pool.map(lambda _: run(stack, "edge", NUMBERS, quick), range(6)))
    assert [r.status_code for r in queued] == [200] * 6


# ---- the mapping, without a node -----------------------------------------------------


def signature(inputs: list[tuple], outputs: list[tuple] = ()) -> run_json.Signature:
    def specs(items):
        return [{"name": n, "datatype": d, "shape": list(s)} for n, d, s in items]

    return run_json.signature({"inputs": specs(inputs), "outputs": specs(outputs)})


def decoded(body: dict, sig: run_json.Signature) -> dict[str, np.ndarray]:
    return oip.decode_request(*run_json.infer_request(orjson.dumps(body), sig)).inputs


def test_a_single_value_stands_for_a_tensor_of_one_element_only():
    sig = signature([("x", "FP16", (-1, 1)), ("words", "BYTES", (2,)), ("n", "UINT8", ())])
    inputs = decoded({"x": 1.5, "words": ["a", {"base64": "/w=="}], "n": 7}, sig)
    assert inputs["x"].shape == (1, 1) and inputs["x"].dtype == np.float16
    assert inputs["words"].tolist() == [b"a", b"\xff"] and inputs["n"].shape == ()
    with pytest.raises(ApiError, match="shape \\[2\\]") as caught:
        decoded({"x": 1.5, "words": "a", "n": 7}, sig)
    assert caught.value.param == "words"
    for bad in ({"x": 70_000.0}, {"n": -1}, {"n": [7]}):
        with pytest.raises(ApiError) as caught:
            decoded({"x": 1.5, "words": ["a", "b"], "n": 7, **bad}, sig)
        assert caught.value.status == 400 and caught.value.param == next(iter(bad))


def test_outputs_keep_their_shapes_and_bytes_their_kind():
    sig = signature([], [("one", "INT32", (1,)), ("any", "INT32", (-1,)), ("image", "BYTES", (1,))])
    image = np.empty(1, dtype=object)
    image[0] = b"PNG"
    outputs = {"one": np.array([4], np.int32), "any": np.array([4], np.int32), "image": image}
    answer = oip.InferResponse("m", "1", None, outputs)
    assert "image" in run_json.BINARY_NAMES
    assert run_json.result(answer, sig) == {"result": {"one": 4, "any": [4], "image": "UE5H"}}
