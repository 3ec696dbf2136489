"""Tools on chat completions: the prompt side (tools and past calls into the chat
template), tool_choice as a grammar, and the model's output back into calls, whole or
streamed.

A template that renders tools itself (Qwen, Llama 3.1+, Mistral) gets them as HF's
`apply_chat_template` passes them: `tools`, assistant `tool_calls` with their arguments
decoded, and `tool` messages. One that does not (SmolLM2, most small chat models) gets
the tools described in the system message, past calls written in the parser's format
and tool results as `tool` turns (or user turns, where the template refuses that role),
so that any chat model can take part in an agent loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .toolcalls import PARSERS, Parsed, ToolCall, format_calls

# How a template without tool support is told about them. The call format shown is the
# parser family's own, written by format_calls.
_TOOLS_PROMPT = """You can call functions to help with the user's request. Their signatures, \
as JSON schemas, are inside <tools></tools>:
<tools>
{tools}
</tools>
To call a function, answer with only this, one per call, and nothing else:
{example}
Each function's result comes back in a <tool_response></tool_response> block."""

# A call as each family writes it (what format_calls writes and its parser reads):
# (before the calls, a call's start up to its name, from the name to its arguments, its
# end, between calls, after the calls). Ours, not xgrammar's builtin tags: those let free
# text follow a forced call, which runs a small model on to max_tokens.
_CALL_FORMATS = {
    "hermes": ("", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n", ""),
    "llama3": ("", '{"name": "', '", "parameters": ', "}", "; ", ""),
    "mistral": ("[TOOL_CALLS][", '{"name": "', '", "arguments": ', "}", ", ", "]"),
}

# Where each parser starts reading a call (Llama 3's: at the first JSON object)
_MARKERS = {
    "hermes": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    "llama3": ("<|python_tag|>", "{"),
}

# The most calls a forced answer may hold with parallel calls: the grammar ends the
# answer after this many (a larger fan-out takes another turn).
MAX_PARALLEL_CALLS = 4


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _decoded_arguments(call: dict) -> dict:
    """An OpenAI tool call with its arguments as an object, as HF templates expect."""
    function = dict(call["function"])
    try:
        args = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        args = None
    function["arguments"] = args if isinstance(args, dict) else function.get("arguments")
    return {**call, "function": function}


@dataclass(frozen=True)
class ToolUse:
    """One request's tools: what the model may call, and how it writes a call."""

    family: str  # the parser's: hermes | llama3 | mistral
    tools: list[dict]  # OpenAI function tools
    choice: str | dict  # "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the output is read for calls (tool_choice "none" turns tools off)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def grammar_forced(self) -> bool:
        """Whether a grammar makes the output a call (tool_choice required or named)."""
        return self.active and self.choice != "auto"

    # ---------------------------------------------------------------- prompt

    def template_inputs(
        self, messages: list[dict], template_knows_tools: bool, tool_role: bool = True
    ) -> tuple[list[dict], list[dict] | None]:
        """The messages (and tools) to render with the model's chat template. Without
        `tool_role` (a template that refuses roles it does not know), tool results are
        written as user turns."""
        tools = self.tools if self.active else None
        if template_knows_tools:
            out = [
                {**m, "tool_calls": [_decoded_arguments(c) for c in m["tool_calls"]]}
                if m.get("tool_calls")
                else m
                for m in messages
            ]
            return out, tools
        out: list[dict] = []
        for i, m in enumerate(messages):
            if m.get("tool_calls"):
                calls = [
                    ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"])
                    for c in m["tool_calls"]
                ]
                written = format_calls(self.family, calls)
                text = "\n".join(t for t in (m.get("content"), written) if t)
                out.append({"role": "assistant", "content": text})
            elif m["role"] == "tool" and tool_role:
                out.append({"role": "tool", "content": m.get("content") or ""})
            elif m["role"] == "tool":
                response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
                if i and messages[i - 1]["role"] == "tool":  # consecutive results: one turn
                    out[-1]["content"] += "\n" + response
                else:
                    out.append({"role": "user", "content": response})
            else:
                out.append(dict(m))
        if tools:
            described = _TOOLS_PROMPT.format(
                tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools),
                example=format_calls(self.family, [ToolCall("<name>", '{"<arg>": "<value>"}')]),
            )
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
            else:
                out.insert(0, {"role": "system", "content": described})
        return out, None

    # ---------------------------------------------------------------- grammar

    def grammar(self) -> dict | None:
        """xgrammar's structural tag that makes tool_choice "required" or a named function
        exact: the output is one call (with parallel calls under "required", up to
        MAX_PARALLEL_CALLS) of the listed functions in the family's format, each one's
        arguments valid for its schema, and nothing else; then the end. (Unbounded, a
        small model writes its call again and again until max_tokens.)"""
        if not self.grammar_forced:
            return None
        tools = self.tools
        if isinstance(self.choice, dict):
            tools = [t for t in tools if t["function"]["name"] == self.choice["function"]["name"]]
        prefix, begin, args_at, end, separator, suffix = _CALL_FORMATS[self.family]
        tags = [
            {
                "type": "tag",
                "begin": f"{begin}{t['function']['name']}{args_at}",
                "content": {
                    "type": "json_schema",
                    # an object, also where the schema leaves its type open: the
                    # parser reads no other arguments
                    "json_schema": {"type": "object", **(t["function"].get("parameters") or {})},
                    "max_whitespace_cnt": 1,  # free whitespace could pad a sampled call forever
                },
                "end": end,
            }
            for t in tools
        ]
        call = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        parts = [_const(prefix), call] if prefix else [call]
        more = MAX_PARALLEL_CALLS - 1 if self.parallel and self.choice == "required" else 0
        if more:
            then = {"type": "sequence", "elements": [_const(separator), call]}
            parts.append({"type": "repeat", "min": 0, "max": more, "content": then})
        parts += [_const(suffix)] if suffix else []
        # a newline may close the turn: a model that writes one there is not thereby
        # made to start another call
        parts.append({"type": "optional", "content": _const("\n")})
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": parts}}

    # ---------------------------------------------------------------- output

    def parse(self, text: str, cut_off: bool = False) -> Parsed:
        """The calls in a choice's `text`, `cut_off` where it ended at max_tokens. Under a
        forced call every text is calls, so any that is not whole was cut off (by
        max_tokens, a stop sequence or a stop token): the call it ends in is left out,
        never returned as content."""
        parsed = PARSERS[self.family](text, cut_off or self.grammar_forced)
        if not self.parallel and len(parsed.calls) > 1:
            parsed = Parsed(parsed.content, parsed.calls[:1], parsed.cut)
        return parsed

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """Streams a choice's text as content until a call may begin; from there holds it
    back, and at the end sends the calls (or, if it was no call after all, the text):
    what arrives is what the whole response would have said."""

    def __init__(self, use: ToolUse):
        self._use = use
        self._markers = _MARKERS[use.family]
        self._sent = ""  # content already streamed
        self._held = ""  # text not streamed yet
        self._calling = False

    def feed(self, text: str) -> str:
        """The content that can go out now."""
        self._held += text
        if self._calling:
            return ""
        at, keep = self._call_start()
        if at is not None:
            self._calling = True
            cut = at
        else:
            cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        self._sent += out
        return out

    def _call_start(self) -> tuple[int | None, int]:
        """Where in the held text a call may begin (as its parser reads it), or how much
        of its end to hold back because a marker may be starting there."""
        held = self._held
        found = [at for marker in self._markers if (at := held.find(marker)) >= 0]
        if found:
            return min(found), 0
        keep = max(
            (k for m in self._markers for k in range(1, len(m)) if held.endswith(m[:k])),
            default=0,
        )
        return None, keep

    def finish(self, cut_off: bool = False) -> tuple[str, list[ToolCall]]:
        """The rest: content still to send, and the calls (`cut_off`: the text ended at
        max_tokens)."""
        parsed = self._use.parse(self._sent + self._held, cut_off)
        if not parsed.calls and not parsed.cut:
            return self._held, []
        content, sent = parsed.content or "", self._sent.strip()
        return (content[len(sent) :] if content.startswith(sent) else ""), parsed.calls
