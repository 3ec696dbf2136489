"""Tool-call parsing per model family, on outputs as the models write them."""

from __future__ import annotations

import json

import pytest

from omni.api.toolcalls import PARSERS, parser_for

WEATHER = {"city": "Paris", "unit": "celsius"}


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


CASES = {
    "hermes": [
        # (model output, expected content, expected calls)
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            "Let me check both.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
            "</tool_call>",
            "Let me check both.",
            [("get_weather", WEATHER), ("get_time", {"tz": "CET"})],
        ),
        (  # cut off by max_tokens before the closing tag
            '<tool_call>\n{"name": "get_time", "arguments": {}}',
            None,
            [("get_time", {})],
        ),
        (  # several calls, the last cut off by max_tokens: the complete ones stand
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
            '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
            [("get_time", {})],
        ),
        (  # malformed JSON: stays text
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
            [],
        ),
        ("Paris is sunny today.", "Paris is sunny today.", []),
    ],
    "llama3": [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}; '
            '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
            None,
            [("get_time", {"tz": "CET"}), ("get_weather", WEATHER)],
        ),
        (
            'I will look it up. {"name": "get_time", "parameters": {"tz": "CET"}}',
            "I will look it up.",
            [("get_time", {"tz": "CET"})],
        ),
        (  # a JSON object that is no call
            'Here is the data: {"city": "Paris"}',
            'Here is the data: {"city": "Paris"}',
            [],
        ),
        (
            '{"name": "get_time", "parameters": {"tz":',
            '{"name": "get_time", "parameters": {"tz":',
            [],
        ),
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]',
            None,
            [("get_weather", WEATHER), ("get_time", {"tz": "CET"})],
        ),
        (
            'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
            '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
            "Checking.",
            [("get_weather", WEATHER), ("get_time", {"tz": "CET"})],
        ),
        (  # arguments already a JSON string
            '[TOOL_CALLS][{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}]',
            None,
            [("get_time", {"tz": "CET"})],
        ),
        ('[TOOL_CALLS][{"name": "get_time"', '[TOOL_CALLS][{"name": "get_time"', []),
        ("No tools needed.", "No tools needed.", []),
    ],
}


@pytest.mark.parametrize(
    ("family", "output", "content", "expected"),
    [(f, *case) for f, cases in CASES.items() for case in cases],
)
def test_parser_reads_calls_and_keeps_text(family, output, content, expected):
    parsed = PARSERS[family](output)
    assert parsed.content == content
    assert calls(parsed) == expected
    ids = [c.id for c in parsed.calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    assert all(c.to_json()["type"] == "function" for c in parsed.calls)


def test_parser_is_chosen_from_the_checkpoint():
    assert parser_for("qwen2", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for("llama", "<|start_header_id|>{{ role }}<|end_header_id|>") == "llama3"
    assert parser_for("mistral", "[AVAILABLE_TOOLS]...[TOOL_CALLS]") == "mistral"
    assert parser_for("qwen3") == "hermes"
    assert parser_for("llama", "<|im_start|>") == "hermes"  # SmolLM2: no tool format of its own
    assert parser_for("qwen2", "<tool_call>", override="mistral") == "mistral"
    with pytest.raises(ValueError, match="unknown tool parser 'xml'"):
        parser_for("qwen2", override="xml")


# Issue 50: text cut off by max_tokens inside a call. The complete calls stand; the cut
# one (or a call's marker begun at the very end) is neither a call nor content.
CUT_CASES = {
    "hermes": [
        # (model output, cut off, expected content, expected calls)
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "', None, []),
        ("<tool_", None, []),
        ("Let me check.\n<tool_call>\n{", "Let me check.", []),
        (
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
            None,
            [("get_time", {})],
        ),
        (  # only the closing tag cut: the call is whole
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool',
            None,
            [("get_time", {})],
        ),
        ("Paris is sunny", "Paris is sunny", []),
        (
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            None,
            [("get_time", {})],
        ),
    ],
    "llama3": [
        ('{"name": "get_time", "parameters": {"tz":', None, []),
        ('I will look it up. {"na', "I will look it up.", []),
        (
            '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}; {"name": "get_w',
            None,
            [("get_time", {"tz": "CET"})],
        ),
        ("<|python_", None, []),
        ('Here is the data: {"city": "Par', 'Here is the data: {"city": "Par', []),  # no call
        ('{"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_time"', None, []),
        (
            '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "CET"}}, {"name": "get_',
            None,
            [("get_time", {"tz": "CET"})],
        ),
        (
            'Checking.[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}[TOOL_CALLS]get_weather[ARGS]{"ci',
            "Checking.",
            [("get_time", {"tz": "CET"})],
        ),
        ("No tools needed. [TOOL_", "No tools needed.", []),
        ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
    ],
}


@pytest.mark.parametrize(
    ("family", "output", "content", "expected"),
    [(f, *case) for f, cases in CUT_CASES.items() for case in cases],
)
def test_a_call_cut_off_is_neither_a_call_nor_content(family, output, content, expected):
    parsed = PARSERS[family](output, True)
    assert parsed.content == content
    assert calls(parsed) == expected
