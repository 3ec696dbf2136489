"""50 JSON schemas of varied shape through `omni serve` and the openai client, all at
once (they batch): every answer parses and validates with jsonschema, 50/50, at
temperature 0 and 1."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from .json_schemas import schemas

TEXT = "smollm2-135m-instruct"
SCHEMAS = schemas(50, seed=21)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fifty_schemas_all_validate(server, temperature):
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600
    )

    def answer(i: int):
        return client.chat.completions.create(
            model=TEXT,
            messages=[{"role": "user", "content": "Fill in this record with plausible values."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True},
            },
            max_tokens=500,
            temperature=temperature,
            seed=i,
        ).choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        choices = list(pool.map(answer, range(len(SCHEMAS))))
    failures = []
    for i, choice in enumerate(choices):
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"schema {i}: {exc}: {choice.message.content!r:.300}")
    assert not failures, "\n".join(failures)
