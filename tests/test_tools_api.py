"""Tool calling through `omni serve` and the openai client: an agent loop, streamed and
not (the client's own stream helper reassembles the calls), forced calls through the
grammar, n choices, and the errors."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

TEXT = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
RESULT = {"temperature_c": 18, "sky": "sunny"}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def complete(client, stream: bool, **kw):
    """A whole completion: straight, or reassembled by the client from the stream."""
    kw = {"model": TEXT, "temperature": 0, "max_tokens": 80, **kw}
    if not stream:
        return client.chat.completions.create(**kw)
    with client.chat.completions.stream(**kw) as events:
        return events.get_final_completion()


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop(client, stream):
    """The model calls the tool, gets its result back, and answers from it."""
    messages = [QUESTION]
    # one call: with parallel calls the grammar lets the model add calls, and this small
    # one repeats its call until max_tokens
    first = complete(
        client,
        stream,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert "paris" in args["city"].lower()

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)},
    ]
    answer = complete(client, stream, messages=messages, tools=[WEATHER])  # tool_choice auto
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # the result reached the model: without tools on offer, it answers with it
    final = complete(client, stream, messages=messages, tools=[WEATHER], tool_choice="none")
    assert "18" in final.choices[0].message.content


def test_streamed_calls_are_the_whole_response_calls(client):
    kw = {
        "messages": [{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}],
        "tools": [WEATHER, ADD],
        "tool_choice": "required",
        "max_tokens": 120,
    }
    whole = complete(client, False, **kw).choices[0].message.tool_calls
    chunks = client.chat.completions.create(model=TEXT, temperature=0, stream=True, **kw)
    streamed = ChatCompletionStreamState()
    for chunk in chunks:  # the client's own reassembly (its helper refuses a cut-off answer)
        streamed.handle_chunk(chunk)
    streamed = streamed.current_completion_snapshot.choices[0].message.tool_calls
    assert len(whole) >= 2
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_tool_choice_is_always_that_call_with_valid_arguments(client, temperature):
    for seed in range(3):
        resp = complete(
            client,
            False,
            messages=[QUESTION],
            tools=[WEATHER, ADD],
            tool_choice={"type": "function", "function": {"name": "add"}},
            temperature=temperature,
            seed=seed,
            max_tokens=60,
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])


def test_parallel_tool_calls_false_gives_one_call(client):
    resp = complete(
        client,
        False,
        messages=[{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=4,
    )
    assert len(resp.choices[0].message.tool_calls) == 1


def test_n_choices_share_the_prompt_and_are_n_1_at_temperature_0(client):
    kw = {"messages": [QUESTION], "max_tokens": 20}
    one = complete(client, False, **kw)
    three = complete(client, False, n=3, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    chunks = client.chat.completions.create(
        model=TEXT, n=3, temperature=1.0, seed=9, stream=True, **kw
    )
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert sorted(streamed) == [0, 1, 2] and len(set(streamed.values())) > 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        ({"messages": [QUESTION, {"role": "tool", "content": "{}"}]}, "messages[1]"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(server, extra, param):
    body = {"model": TEXT, "messages": [QUESTION], **extra}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("question", ["Weather in Paris?", "What is 2 + 3?"])
def test_a_forced_call_ends_after_the_call(client, question):
    """Nothing may follow the call but the end: no text run on to max_tokens."""
    resp = complete(
        client,
        False,
        messages=[{"role": "user", "content": question}],
        tools=[WEATHER, ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
    )
    assert resp.choices[0].finish_reason == "tool_calls"
    assert resp.usage.completion_tokens < 300


# Issue 50: a tool's schema is checked whatever tool_choice says; a forced call ends once
# its calls are complete, and a call cut off by max_tokens is never content.

UNSUPPORTED = {  # a pattern xgrammar cannot compile (lookbehind)
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "(?<=x)y"}},
        },
    },
}
NOT_AN_OBJECT = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required"])
@pytest.mark.parametrize(("tool", "why"), [(UNSUPPORTED, "Lookbehind"), (NOT_AN_OBJECT, "object")])
def test_a_bad_tool_schema_is_a_400_whatever_the_tool_choice(client, tool_choice, tool, why):
    kw = {"tool_choice": tool_choice} if tool_choice else {}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=TEXT, messages=[QUESTION], tools=[WEATHER, tool], max_tokens=1, **kw
        )
    err = caught.value
    assert err.status_code == 400
    assert err.body["param"] == "tools[1].function.parameters", err.body
    name = tool["function"]["name"]
    assert err.body["message"].startswith(f"Invalid schema for function '{name}': "), err.body
    assert why in err.body["message"] and ".cc:" not in err.body["message"], err.body


def streamed_calls(client, **kw) -> tuple[str, str | None, list[tuple[str, str]]]:
    """A streamed answer as its deltas say: content, finish_reason and calls."""
    content, reason, calls = "", None, {}
    for chunk in client.chat.completions.create(model=TEXT, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                name, args = calls.get(d.index, ("", ""))
                calls[d.index] = (
                    name + (d.function.name or ""),
                    args + (d.function.arguments or ""),
                )
    return content, reason, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    ("question", "seed"),
    [("Weather in Paris?", 0), ("Is it raining in Tokyo?", 1), ("How hot is Cairo today?", 2)],
)
def test_required_without_parallel_calls_is_one_call_whole_and_streamed(client, question, seed):
    kw = {
        "messages": [{"role": "user", "content": question}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 60,
    }
    choice = client.chat.completions.create(model=TEXT, **kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, reason, calls = streamed_calls(client, **kw)
    assert (content, reason) == ("", "tool_calls")
    assert calls == [(call.function.name, call.function.arguments)]


@pytest.mark.parametrize("max_tokens", [3, 12])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_call_cut_off_by_max_tokens_is_not_content(client, max_tokens, tool_choice):
    """The answer is cut inside its call: no call, no markup, finish_reason length;
    streamed, nothing at all."""
    kw = {
        "messages": [QUESTION],
        "tools": [WEATHER],
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    choice = client.chat.completions.create(model=TEXT, **kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and not choice.message.tool_calls, choice
    assert streamed_calls(client, **kw) == ("", "length", [])
