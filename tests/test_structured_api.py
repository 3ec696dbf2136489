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


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (  # lookbehind: which pattern, where, and xgrammar's reason
            {"type": "object", "properties": {"city": {"type": "string", "pattern": "(?<=a)b"}}},
            "properties.city.pattern '(?<=a)b': Regex parsing error at position 3: "
            "Lookbehind is not supported yet.",
        ),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum greater than maximum"),
    ],
)
def test_a_schema_xgrammar_refuses_is_a_400_saying_why_not_where_in_xgrammar(client, schema, says):
    """Issue 50: the message named xgrammar's source file and line
    (/project/cpp/json_schema_converter.cc:4944) instead of only the reason."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=TEXT,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            max_tokens=1,
        )
    err = caught.value.body
    assert err["param"] == "response_format.json_schema.schema", err
    assert err["message"].startswith("Invalid schema for response_format 'x': "), err
    assert says in err["message"], err
    assert ".cc" not in err["message"] and "/project" not in err["message"], err


def test_xgrammar_reason_drops_its_source_location():
    from omni.engine.grammar import xgrammar_reason

    exc = RuntimeError(
        "[09:06:05] /project/cpp/json_schema_converter.cc:4944: Type should be a string\n"
    )
    assert xgrammar_reason(exc) == "Type should be a string"
    exc = RuntimeError("[9:06:05] src/regex_converter.cc:83: Regex parsing error at position 3: x")
    assert xgrammar_reason(exc) == "Regex parsing error at position 3: x"
