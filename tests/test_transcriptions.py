"""OpenAI's /v1/audio/transcriptions on omnid and through the edge, with the `openai`
client unchanged.

A real omnid serves PocketSphinx with the real US English model its wheel ships (one
permit), a handler model that is not a speech recognizer, and a tiny LLM; a real edge
with an API key stands in front. espeak-ng speaks the sentence the model must hear.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import orjson
import pytest

from edge.tenants import hash_key
from omni.api import oip, transcriptions
from omni.api.errors import ApiError
from omni.api.transcriptions import MAX_BODY_BYTES, MAX_FILE_BYTES
from omni.testing.checkpoints import tiny_llama
from tests.conftest import free_port, wait_until
from tests.nodes import Omnid
from tests.runtimes.conftest import silence, spoken, wav_bytes

REPO = Path(__file__).resolve().parent.parent
ASR, ECHO, LLM = "asr", "echo", "chat"
KEY = "sk-asr-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
SENTENCE = "hello world this is a test of speech recognition"
SANDBOX = "isolated" if os.geteuid() == 0 else "process"
HANDLER = '''
from omni.instance.handler import Handler, TensorSpec


class Echo(Handler):
    """Takes text, not audio: not a transcription model."""

    inputs = (TensorSpec("text", "BYTES", (1,)),)
    outputs = (TensorSpec("text", "BYTES", (1,)),)

    def infer(self, batch):
        return [{"text": request["text"]} for request in batch]
'''


@dataclass
class Stack:
    omnid: Omnid
    edge_url: str
    speech: bytes  # a WAV of SENTENCE
    seconds: float

    def url(self, where: str) -> str:
        return self.edge_url if where == "edge" else self.omnid.base_url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.edge_url + "/v1", api_key=KEY, max_retries=0)


def world_readable(*paths: Path) -> None:
    """As the isolated sandbox's own uid reads them."""
    for path in paths:
        for p in (path, *path.rglob("*")):
            p.chmod(0o755 if p.is_dir() else 0o644)
        path.parent.chmod(0o755)


def write_config(tmp: Path) -> str:
    asr_dir, echo_dir = tmp / "pocketsphinx", tmp / "echo"
    asr_dir.mkdir()
    (asr_dir / "omni-model.toml").write_text('weights = "package"\n')
    echo_dir.mkdir()
    (echo_dir / "handler.py").write_text(HANDLER)
    world_readable(asr_dir, echo_dir)
    handler = "omni.runtimes.pocketsphinx_asr:PocketsphinxASR"
    return (
        f'[[models]]\nname = "{ASR}"\npath = "{asr_dir}"\nruntime = "python"\n'
        f'handler = "{handler}"\npermits = 1\nmemory = "2GiB"\n\n'
        f'[[models]]\nname = "{ECHO}"\npath = "{echo_dir}"\nruntime = "python"\n'
        f'handler = "handler.py:Echo"\nmemory = "2GiB"\n\n'
        f'[[models]]\nname = "{LLM}"\npath = "{tiny_llama(tmp / LLM)}"\n'
    )


def start_edge(tmp: Path, omnid: Omnid) -> tuple[subprocess.Popen, str]:
    (tmp / "tenants.toml").write_text(
        f'[[tenants]]\nname = "asr"\nweight = 1\nkeys = ["{hash_key(KEY)}"]\n'
    )
    port, log = free_port(), tmp / "edge.log"
    argv = [sys.executable, "-m", "edge.server", "--port", str(port), "--grpc-port", "off"]
    argv += ["--dashboard", "off", "--upstream", omnid.base_url]
    argv += ["--tenants", str(tmp / "tenants.toml")]
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
    return edge, url


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("transcriptions")
    # the Klatt voice: espeak-ng's default one is far from any speaker the model knows
    samples = spoken(SENTENCE, tmp, voice="en-us+klatt")
    omnid = Omnid(tmp, write_config(tmp), "--sandbox", SANDBOX)
    edge = None
    try:
        omnid.wait_ready([ASR, ECHO, LLM], timeout_s=180)
        edge, edge_url = start_edge(tmp, omnid)
        yield Stack(omnid, edge_url, wav_bytes(samples), samples.size / 16_000)
    finally:
        if edge is not None:
            edge.terminate()
            edge.wait(timeout=30)
        assert omnid.stop() == 0, omnid.log()


def words_heard(text: str) -> int:
    heard = set(text.lower().split())
    return sum(word in heard for word in SENTENCE.split())


def post(stack: Stack, where: str, files: dict | None = None, **fields) -> httpx.Response:
    """A form as the openai client sends it (multipart: the file, then the fields)."""
    files = files if files is not None else {"file": ("speech.wav", stack.speech, "audio/wav")}
    return httpx.post(
        stack.url(where) + "/v1/audio/transcriptions",
        data={k: str(v) for k, v in fields.items()},
        files=files or {"none": ("", b"")},  # (still multipart without a file)
        headers=AUTH,
        timeout=60,
    )


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---- what a client gets ------------------------------------------------------------


def test_the_openai_client_transcribes_speech_through_the_edge(stack: Stack):
    result = stack.client().audio.transcriptions.create(
        model=ASR, file=("speech.wav", stack.speech, "audio/wav")
    )
    assert words_heard(result.text) >= 6, result.text


def test_text_and_verbose_json_formats(stack: Stack):
    client = stack.client()
    text = client.audio.transcriptions.create(
        model=ASR, file=("speech.wav", stack.speech), response_format="text"
    )
    assert isinstance(text, str) and words_heard(text) >= 6, text
    verbose = client.audio.transcriptions.create(
        model=ASR,
        file=("speech.wav", stack.speech),
        response_format="verbose_json",
        language="en",
        temperature=0.0,
        prompt="a test",
    )
    assert verbose.task == "transcribe" and verbose.language == "en"
    assert verbose.duration == pytest.approx(stack.seconds, abs=0.01)
    assert verbose.text.split() == text.split()
    assert verbose.segments == []


def test_omnid_answers_the_same_without_the_edge(stack: Stack):
    direct, edge = post(stack, "omnid", model=ASR), post(stack, "edge", model=ASR)
    assert direct.status_code == edge.status_code == 200, direct.text
    assert direct.json() == edge.json()
    assert direct.json()["usage"] == {"type": "duration", "seconds": math.ceil(stack.seconds)}


def test_silence_is_an_empty_transcript(stack: Stack):
    resp = post(stack, "edge", files={"file": ("quiet.wav", wav_bytes(silence(1.0)))}, model=ASR)
    assert resp.status_code == 200 and resp.json()["text"] == "", resp.text


# ---- errors: OpenAI's bodies, never a 500 ----------------------------------------

WHERE = ["omnid", "edge"]


@pytest.mark.parametrize("where", WHERE)
def test_a_missing_file_or_model_is_a_400_naming_it(stack: Stack, where: str):
    assert error_of(post(stack, where, files={}, model=ASR), 400)["param"] == "file"
    assert error_of(post(stack, where), 400)["param"] == "model"


@pytest.mark.parametrize("where", WHERE)
def test_an_unknown_model_is_a_404(stack: Stack, where: str):
    error = error_of(post(stack, where, model="nope"), 404)
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("model", [LLM, ECHO])
def test_a_model_that_does_not_transcribe_is_a_400_that_says_so(stack, where, model):
    error = error_of(post(stack, where, model=model), 400)
    assert "not a speech-recognition model" in error["message"]
    assert error["param"] == "model" and error["code"] == "wrong_model_kind"


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("data", [b"not a sound file", b""], ids=["not-audio", "empty"])
def test_a_file_that_is_not_audio_is_a_400_with_the_models_message(stack, where, data):
    error = error_of(post(stack, where, files={"file": ("x.wav", data)}, model=ASR), 400)
    assert error["message"].startswith("audio: not a sound file"), error
    assert error["param"] == "file"


@pytest.mark.parametrize("where", WHERE)
def test_an_unsupported_response_format_is_a_400_listing_those_supported(stack, where):
    error = error_of(post(stack, where, model=ASR, response_format="srt"), 400)
    assert "json, text, verbose_json" in error["message"]
    assert error["param"] == "response_format"
    assert error_of(post(stack, where, model=ASR, temperature="hot"), 400)["param"] == (
        "temperature"
    )


@pytest.mark.parametrize("where", WHERE)
def test_a_file_past_the_limit_is_a_413(stack: Stack, where: str):
    big = {"file": ("big.wav", b"\0" * (MAX_FILE_BYTES + 1))}
    assert error_of(post(stack, where, files=big, model=ASR), 413)["param"] == "file"
    huge = httpx.post(  # said by its Content-Length: refused before it is read
        stack.url(where) + "/v1/audio/transcriptions",
        content=b"\0" * (MAX_BODY_BYTES + 1),
        headers={"Content-Type": "multipart/form-data; boundary=x", **AUTH},
        timeout=60,
    )
    assert error_of(huge, 413)["code"] == "request_too_large"


def test_the_openai_client_raises_its_own_error_types(stack: Stack):
    client = stack.client()
    with pytest.raises(openai.BadRequestError, match="not a sound file"):
        client.audio.transcriptions.create(model=ASR, file=("x.wav", b"not audio"))
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="nope", file=("s.wav", stack.speech))
    with pytest.raises(openai.BadRequestError, match="not a speech-recognition model"):
        client.audio.transcriptions.create(model=LLM, file=("s.wav", stack.speech))
    stranger = openai.OpenAI(base_url=stack.edge_url + "/v1", api_key="sk-no", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.audio.transcriptions.create(model=ASR, file=("s.wav", stack.speech))


# ---- admission: the same permits as every request ----------------------------------


def test_overload_at_omnid_is_a_429_with_retry_after_and_the_edge_queues_it(stack: Stack):
    short = {"file": ("short.wav", wav_bytes(silence(0.2)))}
    with ThreadPoolExecutor(8) as pool:
        # the sentence holds the one permit while the burst comes: PERMIT_QUEUE (4) of
        # the burst wait for it, the rest are turned away at once
        holder = pool.submit(post, stack, "omnid", model=ASR)
        wait_until(lambda: stack.omnid.instances()[ASR]["in_flight"] == 1, 30, "in flight")
        burst = list(pool.map(lambda _: post(stack, "omnid", short, model=ASR), range(7)))
        assert holder.result().status_code == 200
    refused = [r for r in burst if r.status_code == 429]
    assert len(refused) == 3 and all(r.headers.get("Retry-After") for r in refused)
    assert error_of(refused[0], 429)["type"] == "rate_limit_error"
    # the edge holds a burst in its fair queue for the node's one permit: none refused
    with ThreadPoolExecutor(6) as pool:
        queued = list(pool.map(lambda _: post(stack, "edge", short, model=ASR), range(6)))
    assert [r.status_code for r in queued] == [200] * 6


# ---- the model's side, without a node ----------------------------------------------


def metadata(inputs: list[tuple], outputs: list[tuple]) -> dict:
    def specs(items):
        return [{"name": n, "datatype": d, "shape": list(s)} for n, d, s in items]

    return {"inputs": specs(inputs), "outputs": specs(outputs)}


def test_a_transcription_model_is_told_by_its_tensors():
    asr = metadata(
        [("audio", "BYTES", (1,)), ("language", "BYTES", (1,))],
        [("text", "BYTES", (1,)), ("duration", "FP32", (1,)), ("other", "FP32", (3,))],
    )
    sig = transcriptions.signature("m", asr)
    assert sig.inputs == {"audio": "BYTES", "language": "BYTES"}
    assert sig.outputs == ("text", "duration")  # (not "other")
    for inputs in (
        [("audio", "FP32", (-1,))],  # samples, not a file
        [("audio", "BYTES", (1,)), ("image", "BYTES", (1,))],  # an input no form field fills
        [("text", "BYTES", (1,))],
    ):
        with pytest.raises(ApiError, match="not a speech-recognition model"):
            transcriptions.signature("m", metadata(inputs, [("text", "BYTES", (1,))]))
    with pytest.raises(ApiError, match="no BYTES 'text' output"):
        transcriptions.signature("m", metadata([("audio", "BYTES", (1,))], []))


def answer(**outputs: object) -> oip.InferResponse:
    arrays = {}
    for name, value in outputs.items():
        arrays[name] = np.empty(1, dtype=object) if isinstance(value, str) else np.array([value])
        if isinstance(value, str):
            arrays[name][0] = value.encode()
    return oip.InferResponse("m", "1", None, arrays)


def test_a_models_segments_and_language_reach_verbose_json():
    segments = '[{"start": 0, "end": 1.5, "text": "hello"}, {"start": 1.5, "end": 2, "text": "x"}]'
    result = transcriptions.transcript(
        answer(text=" hello x ", duration=2.0, language="english", segments=segments)
    )
    upload = transcriptions.Upload("m", b"", response_format="verbose_json")
    body = orjson.loads(transcriptions.response(upload, result).body)
    assert body["language"] == "english" and body["duration"] == 2.0
    assert body["text"] == "hello x"
    assert body["segments"][1] == {"id": 1, "start": 1.5, "end": 2.0, "text": "x"}


@pytest.mark.parametrize("segments", ["{", '{"start": 0}', '[{"start": 0, "text": "a"}]'])
def test_malformed_segments_are_the_models_fault(segments):
    with pytest.raises(ApiError) as caught:
        transcriptions.transcript(answer(text="a", segments=segments))
    assert caught.value.status == 502
