"""xgrammar's masks on the SmolLM2 tokenizer: whatever the logits, the output keeps to the
grammar. The logits are random (sampled: the hardest case for a mask), tilted toward
closing characters so that the walk ends: the mask, not the tilt, makes it valid."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from omni.engine.checkpoint import Checkpoint
from omni.engine.grammar import GrammarError, Grammars, GrammarSpec, spelled_string_bounds
from omni.engine.tokenizer import TextTokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "kind": {"enum": ["cat", "dog"]},
            "owner": {
                "type": "object",
                "properties": {"email": {"type": "string"}, "vip": {"type": "boolean"}},
                "required": ["vip"],
                "additionalProperties": False,
            },
        },
        "required": ["age", "kind", "owner"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "null"}]},
]


CLOSING = {'"', "}", "]", ",", "0", "1", "7", "true", "false", "null", "-"}


@pytest.fixture(scope="module")
def setup(text_model_dir):
    tok = TextTokenizer(Checkpoint.open(text_model_dir))
    tilt = torch.zeros(tok.vocab_size)
    for token in range(tok.vocab_size):
        if tok.decode([token]).strip() in CLOSING:
            tilt[token] = 6.0
    return tok, Grammars(tok, tok.vocab_size), tilt


def generate(setup, spec: GrammarSpec, seed: int, limit: int = 400) -> str:
    tok, grammars, tilt = setup
    constraint = grammars.constraint(spec)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(limit):
        logits = torch.randn(grammars.vocab_size, generator=gen) * 2 + tilt
        constraint.mask(logits)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        constraint.accept(token)
        if constraint.done:
            return tok.decode(out)
        out.append(token)
    raise AssertionError(f"the grammar was not closed in {limit} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_under_a_schema_give_valid_json(setup, index, seed):
    text = generate(setup, GrammarSpec.json_schema(SCHEMAS[index]), seed)
    jsonschema.validate(json.loads(text), SCHEMAS[index])


def test_json_object_gives_an_object(setup):
    assert isinstance(json.loads(generate(setup, GrammarSpec("json_object"), 5)), dict)


def test_an_invalid_schema_is_a_grammar_error(setup):
    grammars = setup[1]
    with pytest.raises(GrammarError):
        grammars.compile(GrammarSpec.json_schema({"type": "object", "properties": 5}))


BOUNDED = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 4},
        "default": {"type": "string", "maxLength": 1},  # a property named like a keyword
    },
    "required": ["code", "tags", "default"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(6))
def test_string_bounds_spelled_out_keep_to_them(setup, seed):
    """maxLength/minLength become a pattern of nested optionals (`spelled_string_bounds`):
    random walks through every escape and multi-byte token still keep to the bounds."""
    text = generate(setup, GrammarSpec.json_schema(BOUNDED), seed)
    jsonschema.validate(json.loads(text), BOUNDED)


def test_string_bounds_are_exact(setup):
    """The longest string is allowed, one more character is not, nor a raw control
    character (invalid JSON; xgrammar's own bounded strings allow one); a bound inside
    `properties` is rewritten whatever the property's name."""
    spelled = spelled_string_bounds(BOUNDED)
    assert "pattern" in spelled["properties"]["default"]
    assert "maxLength" not in spelled["properties"]["code"]
    grammars = setup[1]

    def accepts(text: str) -> bool:
        return grammars.constraint(GrammarSpec.json_schema(BOUNDED))._matcher.accept_string(text)

    longest = {"code": "abcdé", "tags": ["abc", "日本語"], "default": "x"}
    assert accepts(json.dumps(longest, ensure_ascii=False))
    assert not accepts('{"code": "abcdef"')
    assert not accepts('{"code": "a"')
    assert not accepts('{"code": "a\tb"')
    assert not accepts('{"code": "ab", "tags": ["abcd"')


def test_properties_come_in_the_schemas_order(setup):
    """A schema's property order is the output's (OpenAI's too): "reasoning" before
    "answer" means the model reasons first."""
    grammars = setup[1]
    schema = {
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    }
    matcher = grammars.constraint(GrammarSpec.json_schema(schema))._matcher
    assert matcher.accept_string('{"reasoning": "')
    matcher = grammars.constraint(GrammarSpec.json_schema(schema))._matcher
    assert not matcher.accept_string('{"answer": ')


def test_data_and_long_bounds_are_left_alone():
    schema = {
        "type": "string",
        "maxLength": 10_000,
        "default": {"type": "string", "maxLength": 2},
    }
    assert spelled_string_bounds(schema) == schema


def test_a_big_batch_accepts_as_one_at_a_time(setup):
    """Accepting 40 rows in one batch gives each row what accepting it alone gives:
    refusals in their rows, and every matcher where its own tokens took it."""
    tok, grammars, _ = setup
    spec = GrammarSpec.json_schema(SCHEMAS[0])
    good = tok.encode('{"name": "a cat"}')
    bad = tok.encode('{"nom": 1}')
    rows = [grammars.constraint(spec) for _ in range(40)]
    alone = [grammars.constraint(spec) for _ in range(40)]
    texts = [bad if i % 7 == 3 else good for i in range(40)]
    for step in range(max(map(len, texts))):
        live = [i for i in range(40) if step < len(texts[i])]
        tokens = [texts[i][step] for i in live]
        together = grammars.accept([rows[i] for i in live], tokens)
        assert together == [
            alone[i]._matcher.accept_token(t) for i, t in zip(live, tokens, strict=True)
        ]
    assert [c._matcher.is_completed() for c in rows] == [t is good for t in texts]
