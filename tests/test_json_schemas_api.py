"""50 JSON schemas of varied shape through `omni serve` and the openai client, each at
temperature 0 and 1, all 100 requests at once (they batch): every answer parses and
validates with jsonschema, 100/100."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

from .json_schemas import schemas

TEXT = "smollm2-135m-instruct"
SCHEMAS = schemas(50, seed=21)


def test_fifty_schemas_all_validate(server):
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600
    )
    asks = [(i, temperature) for temperature in (0.0, 1.0) for i in range(len(SCHEMAS))]

    def answer(ask: tuple[int, float]):
        i, temperature = ask
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

    with ThreadPoolExecutor(len(asks)) as pool:
        choices = list(pool.map(answer, asks))
    failures = []
    for (i, temperature), choice in zip(asks, choices, strict=True):
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"schema {i} at {temperature}: {exc}: {choice.message.content!r:.300}")
    assert not failures, "\n".join(failures)
