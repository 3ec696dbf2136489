"""xgrammar's masks on the SmolLM2 tokenizer: whatever the logits, the output keeps to the
grammar. The logits are random (sampled: the hardest case for a mask), tilted toward
closing characters so that the walk ends: the mask, not the tilt, makes it valid."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from omni.engine.checkpoint import Checkpoint
from omni.engine.grammar import GrammarError, Grammars, GrammarSpec
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
