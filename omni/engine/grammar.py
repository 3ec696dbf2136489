"""Structured output: a token mask per sequence from xgrammar, a real grammar engine.

`Grammars` belongs to one model: it builds xgrammar's view of the tokenizer once and
compiles each grammar once (JSON objects, JSON schemas; xgrammar caches compiled
grammars by their source). A `Constraint` follows one sequence: before each pick it
masks the logits to the tokens the grammar allows, after it accepts the picked token.

Why xgrammar and not a state machine of our own: JSON Schema (nested objects, arrays,
enums, bounds, anyOf, refs) over a byte-level BPE vocabulary is a large, subtle job that
xgrammar does with a precompiled, cached per-token mask, in microseconds a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

COMPACT = {"any_whitespace": False}


class GrammarError(ValueError):
    """A grammar xgrammar cannot compile: an invalid or unsupported schema."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json_object" | "json_schema"
    source: str = ""  # the schema, as canonical JSON text (the cache key)

    @classmethod
    def json_schema(cls, schema: dict) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, sort_keys=True))


class Grammars:
    def __init__(self, tokenizer, vocab_size: int):
        """`tokenizer`: the engine's TextTokenizer; `vocab_size`: the model's logits width
        (which may exceed the tokenizer's vocabulary)."""
        import transformers
        import xgrammar

        self._xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.raw)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=sorted(tokenizer.eos_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile(self, spec: GrammarSpec):
        # Compact JSON: with free whitespace a sampled sequence can pad forever between
        # tokens (and a random one does), never closing the object.
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', **COMPACT)
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(spec.source, **COMPACT)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors for a bad schema
            raise GrammarError(str(exc).strip().splitlines()[-1]) from None
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")

    def constraint(self, spec: GrammarSpec) -> Constraint:
        return Constraint(self, self._xgr.GrammarMatcher(self.compile(spec)))


class Constraint:
    """One sequence's place in its grammar."""

    def __init__(self, grammars: Grammars, matcher):
        self._xgr = grammars._xgr
        self._matcher = matcher
        self._bitmask = self._xgr.allocate_token_bitmask(1, grammars.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] with every token the grammar forbids at -inf (in place)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bitmask = self._bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(logits.view(1, -1), bitmask)
        return logits

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise GrammarError(f"token {token} is not allowed here")

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        return self._matcher.is_terminated()
