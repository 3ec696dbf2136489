"""Tool calls out of a model's text, one parser per model family, in one place.

Each family writes its calls its own way:

- hermes (Qwen2, Qwen2.5, Qwen3 and most fine-tunes): `<tool_call>{"name": ..,
  "arguments": {..}}</tool_call>`, one block per call, after any text;
- llama3 (Llama 3.1+ JSON tool calling): `{"name": .., "parameters": {..}}`, optionally
  after `<|python_tag|>`, several separated by `;`;
- mistral: `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`, or the newer
  `[TOOL_CALLS]name[ARGS]{..}` once per call.

A parser never loses text: output it cannot read as calls stays the message's content,
with one exception. Where the text was cut off (by max_tokens), the call it ends in is
left out, and so is a start of a call's marker at its very end: half a call is neither
a call nor content. The calls complete before the cut stand.
`parser_for` picks the family from the checkpoint's chat template (what the model was
taught), then its model type; a model's catalog entry can name one instead.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text around the calls (None where there is none)
    calls: list[ToolCall]
    cut: bool = False  # a call (or its marker) cut off at the end was left out


def _call(obj, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from a decoded JSON value: an object with a string name and object arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models send the arguments already encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


_DECODER = json.JSONDecoder()


def _json_prefix(text: str, sep: str) -> tuple[list, int]:
    """The JSON values `text` starts with, separated by `sep` (or whitespace), and where
    they end (len(text) where all of it is values)."""
    values, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == sep):
            pos += 1
        if pos == len(text):
            return values, pos
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, pos
        values.append(value)


def _json_values(text: str, sep: str) -> list | None:
    """`text` as JSON values separated by `sep` (or whitespace); None unless all of it is."""
    values, end = _json_prefix(text, sep)
    return values if end == len(text) else None


def _less_partial(text: str, *markers: str) -> str:
    """`text` less a start of one of `markers` at its end ('<tool_' of '<tool_call>')."""
    for k in range(max(map(len, markers)) - 1, 0, -1):
        if any(text.endswith(m[:k]) for m in markers if k < len(m)):
            return text[:-k]
    return text


def _uncut(text: str, cut_off: bool, *markers: str) -> Parsed:
    """Text with no call in it; cut off, less a call's marker begun at its end."""
    kept = _less_partial(text, *markers) if cut_off else text
    return Parsed(_content(kept), [], cut=kept != text)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, cut_off: bool = False) -> Parsed:
    if "<tool_call>" not in text:
        return _uncut(text, cut_off, "<tool_call>")
    calls, cut = [], None
    for match in _HERMES.finditer(text):
        unclosed = match.end() == len(text) and not match.group(0).endswith(">")
        body = _less_partial(match.group(1), "</tool_call>") if unclosed else match.group(1)
        try:
            call = _call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None and unclosed:
            cut = match.group(0)  # the last call, cut off (max_tokens)
        elif call is None:
            return Parsed(_content(text), [])  # one unreadable block: all of it is text
        else:
            calls.append(call)
    before = text[: text.index("<tool_call>")]
    if cut and cut_off:
        return Parsed(_content(before), calls, cut=True)
    if not calls:
        return Parsed(_content(text), [])
    return Parsed(_content(before + ("\n" + cut if cut else "")), calls)


# How every Llama 3 call begins (a JSON object that does not is no call)
_LLAMA3_CALL = '{"name":'


def parse_llama3(text: str, cut_off: bool = False) -> Parsed:
    """JSON calls from the first '{' (or after <|python_tag|>) to the end of the text."""
    start = text.find("<|python_tag|>")
    body_at = start + len("<|python_tag|>") if start >= 0 else text.find("{")
    if body_at < 0:
        return _uncut(text, cut_off, "<|python_tag|>", "{")
    body = text[body_at:]
    values, end = _json_prefix(body, ";")
    calls = [_call(v) for v in values]
    before = text[: start if start >= 0 else body_at]
    rest = "".join(body[end:].split())  # what is not values: a call cut off?
    a_call = start >= 0 or rest.startswith(_LLAMA3_CALL) or _LLAMA3_CALL.startswith(rest)
    if rest and cut_off and a_call and None not in calls:
        return Parsed(_content(before), calls, cut=True)
    if not calls or None in calls or rest:
        return Parsed(_content(text.replace("<|python_tag|>", "")), [])
    return Parsed(_content(before), calls)


_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.-]+)\s*\[ARGS\]")


def parse_mistral(text: str, cut_off: bool = False) -> Parsed:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return _uncut(text, cut_off, "[TOOL_CALLS]")
    before, body = text[:at], text[at:]
    calls: list[ToolCall | None] = []
    whole = True  # every call complete
    if _MISTRAL_NAMED.match(body):  # [TOOL_CALLS]name[ARGS]{...}, once per call
        for match in _MISTRAL_NAMED.finditer(body):
            try:
                args, _ = _DECODER.raw_decode(body, match.end())
            except json.JSONDecodeError:
                args = None
            calls.append(_call({"name": match.group(1), "arguments": args}))
        if calls[-1] is None:  # the last: cut off, if it is no call
            calls, whole = calls[:-1], False
    else:  # [TOOL_CALLS][{...}, ...]
        listed = body[len("[TOOL_CALLS]") :].lstrip()
        bracketed = listed.startswith("[")
        inner = listed[1:] if bracketed else listed
        values, end = _json_prefix(inner, ",")
        whole = bool(values) and inner[end:].strip() == ("]" if bracketed else "")
        calls = [_call(v) for v in values]
    if not whole and cut_off and None not in calls:
        return Parsed(_content(before), calls, cut=True)
    if not whole or not calls or None in calls:
        return Parsed(_content(text), [])
    return Parsed(_content(before), calls)


def format_calls(family: str, calls: list[ToolCall]) -> str:
    """Calls as `family` writes them: what its parser reads back (past calls in a prompt
    whose template has no tool support, and the example shown to the model)."""

    def call(c: ToolCall, args_key: str = "arguments") -> str:
        return f'{{"name": {json.dumps(c.name)}, "{args_key}": {c.arguments}}}'

    if family == "hermes":
        return "\n".join(f"<tool_call>\n{call(c)}\n</tool_call>" for c in calls)
    if family == "llama3":
        return "; ".join(call(c, "parameters") for c in calls)
    if family == "mistral":
        return "[TOOL_CALLS][" + ", ".join(call(c) for c in calls) + "]"
    raise ValueError(f"unknown tool parser {family!r}")


# text, and whether it was cut off (by max_tokens) -> its calls
PARSERS: dict[str, Callable[[str, bool], Parsed]] = {
    "hermes": parse_hermes,
    "llama3": parse_llama3,
    "mistral": parse_mistral,
}
_BY_TEMPLATE = (  # markers of a template that renders tools, then Llama 3's header tokens
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"),
    ("<|start_header_id|>", "llama3"),
)
_BY_MODEL_TYPE = {
    "qwen2": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "mistral": "mistral",
    "mixtral": "mistral",
}
DEFAULT = "hermes"  # the most common format among fine-tunes without a tool template


def parser_for(model_type: str, chat_template: str = "", override: str | None = None) -> str:
    """The family whose format this model writes calls in."""
    if override is not None:
        if override not in PARSERS:
            raise ValueError(f"unknown tool parser {override!r} (one of {', '.join(PARSERS)})")
        return override
    for marker, family in _BY_TEMPLATE:
        if marker in chat_template:
            return family
    return _BY_MODEL_TYPE.get(model_type, DEFAULT)
