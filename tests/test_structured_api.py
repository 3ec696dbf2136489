"""response_format through `omni serve` and the openai client: the output keeps to the
schema (xgrammar's mask in the sampler), at temperature 0 and 1."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

TEXT = "smollm2-135m-instruct"
SCHEMAS = {
    "city": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"enum": ["France", "Spain", "Italy"]},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    },
    "flags": {
        "type": "object",
        "properties": {
            "answers": {
                "type": "array",
                "items": {"type": "boolean"},
                "minItems": 1,
                "maxItems": 3,
            },
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["answers", "count"],
        "additionalProperties": False,
    },
}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates(client, name, temperature):
    resp = client.chat.completions.create(
        model=TEXT,
        messages=[{"role": "user", "content": "Describe the capital of France as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
        },
        max_tokens=120,
        temperature=temperature,
        seed=3,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_output_is_an_object(client):
    resp = client.chat.completions.create(
        model=TEXT,
        messages=[
            {"role": "user", "content": 'Reply in JSON: {"city": "..."}. The capital of France?'}
        ],
        response_format={"type": "json_object"},
        max_tokens=300,
        temperature=0,
    )
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "json_schema"}, "response_format"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(server, fmt, param):
    body = {"model": TEXT, "messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
