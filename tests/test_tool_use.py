"""The chat side of tools without a server: streamed output says what the whole output
says, for every family and however the text is cut into deltas; tools and past calls
reach the chat template (one that renders tools itself, and one that does not)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from omni.api.toolcalls import PARSERS, ToolCall, format_calls
from omni.api.tooluse import MAX_PARALLEL_CALLS, ToolUse
from omni.engine.checkpoint import Checkpoint
from omni.engine.tokenizer import TextTokenizer

from .test_tool_parsers import CASES

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temperature_c": 18}', "tool_call_id": "call_1"},
]


def streamed(use: ToolUse, text: str, rng: random.Random) -> tuple[str, list]:
    """`text` fed in random pieces: the content sent, and the calls at the end."""
    stream, sent, at = use.stream(), "", 0
    while at < len(text):
        n = rng.randint(1, 6)
        sent += stream.feed(text[at : at + n])
        at += n
    rest, calls = stream.finish()
    return sent + rest, calls


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_stream_says_what_the_whole_output_says(family):
    use = ToolUse(family, TOOLS, "auto")
    rng = random.Random(0)
    for text, _content, _calls in CASES[family]:
        whole = PARSERS[family](text)
        for _ in range(5):
            content, calls = streamed(use, text, rng)
            assert [(c.name, c.arguments) for c in calls] == [
                (c.name, c.arguments) for c in whole.calls
            ]
            if calls:  # the text before the calls went out as content
                assert content.strip() == (whole.content or "")
            else:  # no call: every character went out, none twice
                assert content == text


@pytest.fixture(scope="module")
def tokenizer(text_model_dir):
    return TextTokenizer(Checkpoint.open(text_model_dir))


def test_a_template_without_tools_is_told_of_them_in_the_system_message(tokenizer):
    assert not tokenizer.template_renders_tools  # SmolLM2's
    use = ToolUse("hermes", TOOLS, "auto")
    messages, tools = use.template_inputs(HISTORY, False)
    prompt = tokenizer.apply_chat_template(messages, tools=tools)
    assert json.dumps(TOOLS[0]) in prompt and "<tool_call>" in prompt
    # the past call, as the model would write it, and its result as a tool turn
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<|im_start|>tool\n{"temperature_c": 18}<|im_end|>' in prompt
    # tool_choice none: nothing about tools in the prompt
    messages, _ = ToolUse("hermes", TOOLS, "none").template_inputs(HISTORY, False)
    assert "<tools>" not in tokenizer.apply_chat_template(messages)


NATIVE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_tools_gets_them_as_hf_passes_them(text_model_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text_model_dir / name, tmp_path / name)
    (tmp_path / "model.safetensors").symlink_to(text_model_dir / "model.safetensors")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": NATIVE}))
    tok = TextTokenizer(Checkpoint.open(tmp_path))
    assert tok.template_renders_tools
    messages, tools = ToolUse("hermes", TOOLS, "auto").template_inputs(HISTORY, True)
    prompt = tok.apply_chat_template(messages, tools=tools)
    tools_part = prompt[: prompt.index("</tools>")]
    assert tools_part.startswith("<tools>") and '"name": "get_weather"' in tools_part
    assert '<call>get_weather {"city": "Paris"}</call>' in prompt  # an object, not a string
    assert "<|im_start|>tool\n" in prompt


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("family", sorted(PARSERS))
@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        ("required", True),
        ("required", False),
        ({"type": "function", "function": {"name": "add"}}, True),
    ],
)
def test_a_forced_call_is_exactly_calls_then_the_end(tokenizer, family, choice, parallel):
    """Random logits under the family's call grammar (the end made likely once allowed):
    whatever is picked, the text is only calls its parser reads (the named one, or one
    when not parallel) with valid arguments, and the grammar ends."""
    import jsonschema
    import torch

    from omni.engine.grammar import Grammars, GrammarSpec

    use = ToolUse(family, [ADD, CITY], choice, parallel)
    grammars = Grammars(tokenizer, tokenizer.vocab_size)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, CITY)}
    for seed in range(4):
        constraint = grammars.constraint(GrammarSpec.structural_tag(use.grammar()))
        gen = torch.Generator().manual_seed(seed)
        out = []
        while not constraint.done:
            assert len(out) < 400, tokenizer.decode(out)
            logits = torch.randn(grammars.vocab_size, generator=gen)
            logits[sorted(tokenizer.eos_ids)] += 8  # the end, when allowed: calls stop coming
            constraint.mask(logits)
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            constraint.accept(token)
            out.append(token)
        text = tokenizer.decode(out)
        parsed = PARSERS[family](text)
        assert parsed.calls and parsed.content is None, text
        if isinstance(choice, dict) or not parallel:
            assert len(parsed.calls) == 1
        for call in parsed.calls:
            assert not isinstance(choice, dict) or call.name == "add"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_stream_cut_off_says_what_the_whole_output_says(family):
    """Cut off by max_tokens: the same calls, and the cut call in neither's content."""
    from .test_tool_parsers import CUT_CASES

    use = ToolUse(family, TOOLS, "auto")
    rng = random.Random(1)
    for text, content, _calls in CUT_CASES[family]:
        whole = use.parse(text, cut_off=True)
        assert whole.content == content
        for _ in range(5):
            stream, sent, at = use.stream(), "", 0
            while at < len(text):
                n = rng.randint(1, 6)
                sent += stream.feed(text[at : at + n])
                at += n
            rest, calls = stream.finish(cut_off=True)
            assert [(c.name, c.arguments) for c in calls] == [
                (c.name, c.arguments) for c in whole.calls
            ]
            assert (sent + rest).strip() == (content or "")


@pytest.fixture(scope="module")
def grammars(tokenizer):
    from omni.engine.grammar import Grammars

    return Grammars(tokenizer, tokenizer.vocab_size)


@pytest.mark.parametrize("family", sorted(PARSERS))
@pytest.mark.parametrize(
    ("choice", "parallel", "most"),
    [
        ("required", True, MAX_PARALLEL_CALLS),
        ("required", False, 1),
        ({"type": "function", "function": {"name": "add"}}, True, 1),
    ],
)
def test_a_forced_answer_ends_after_its_last_call(
    tokenizer, grammars, family, choice, parallel, most
):
    """Issue 50: the grammar takes `most` calls, then only the end (unbounded, a small
    model repeated its call until max_tokens)."""
    from omni.engine.grammar import GrammarSpec

    spec = GrammarSpec.structural_tag(ToolUse(family, [ADD, CITY], choice, parallel).grammar())
    call = ToolCall("add", '{"a": 1, "b": 2}')
    eos = min(tokenizer.eos_ids)
    for n in range(1, most + 2):
        matcher = grammars.constraint(spec)._matcher
        taken = matcher.accept_string(format_calls(family, [call] * n))
        assert taken == (n <= most), (n, most)
        if taken:
            assert matcher.accept_token(eos) and matcher.is_terminated()
