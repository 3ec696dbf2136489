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
import os
import re
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

COMPACT = {"any_whitespace": False}
# One string character, unescaped (xgrammar keeps escapes out of length-bounded strings
# too, so the strings allowed are the same).
_CHAR = r'[^"\\\x00-\x1f]'
# Longest maxLength spelled out as a pattern (the pattern grows with it; longer bounds
# stay with xgrammar's own counted repetition).
MAX_SPELLED_LENGTH = 256
_DATA_KEYS = ("enum", "const", "default", "examples")  # values, not schemas
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# A batch's masks are filled on up to this many threads: 64 rows take ~10 ms on one core.
THREADS = max(1, min(8, len(os.sched_getaffinity(0))))
SWITCH_INTERVAL_S = 0.0002


# Where in xgrammar's sources an error was raised, and when: "[09:06:05]
# /project/cpp/json_schema_converter.cc:4944: " (nothing a caller can act on).
_XGRAMMAR_LOCATION = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\]\s*|(?:[\w.+-]*/)*[\w.+-]+\.\w+:\d+:\s*")
_EBNF_PLACE = re.compile(r"^EBNF parser error at line \d+, column \d+:\s*")


class GrammarError(ValueError):
    """A grammar xgrammar cannot compile: an invalid or unsupported schema."""


def xgrammar_reason(exc: BaseException) -> str:
    """xgrammar's error message without its source file, line and timestamp: the
    reason alone ("Lookbehind is not supported yet")."""
    lines = (_XGRAMMAR_LOCATION.sub("", line).strip() for line in str(exc).splitlines())
    return " ".join(line for line in lines if line) or type(exc).__name__


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json_object" | "json_schema" | "structural_tag"
    source: str = ""  # the schema or tag as xgrammar compiles it, JSON text (the cache key)

    @classmethod
    def json_schema(cls, schema: dict) -> GrammarSpec:
        # keys in their order: a schema's property order is its output's order (a
        # "reasoning" field put before "answer" is written first)
        return cls("json_schema", json.dumps(spelled_string_bounds(schema)))

    @classmethod
    def structural_tag(cls, tag: dict) -> GrammarSpec:
        """xgrammar's structural tag: fixed text around JSON (a model's tool-call format)."""
        return cls("structural_tag", json.dumps(_spell_tag_schemas(tag)))


def spelled_string_bounds(node):
    """`node` (a JSON schema) with each string's maxLength (and minLength) spelled out as
    a pattern of nested optional characters: the same strings. xgrammar checks a counted
    repetition against every token at run time (~100 us a row, milliseconds near the
    bound); nested optionals are rule positions its compiler precomputes masks for
    (~10 us a row), at the same compile time."""
    if isinstance(node, list):
        return [spelled_string_bounds(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: spelled_string_bounds(v) for name, v in value.items()}
        else:
            out[key] = value if key in _DATA_KEYS else spelled_string_bounds(value)
    low, high = out.get("minLength", 0), out.get("maxLength")
    plain = not any(k in out for k in ("pattern", "format", *_DATA_KEYS))
    if (
        out.get("type") == "string"
        and plain
        and isinstance(high, int)
        and isinstance(low, int)
        and 0 <= low <= high <= MAX_SPELLED_LENGTH
    ):
        optional = ""
        for _ in range(high - low):
            optional = f"(?:{_CHAR}{optional})?"
        del out["maxLength"]
        out.pop("minLength", None)
        out["pattern"] = f"^{_CHAR * low}{optional}$"
    return out


def _patterns(node, path: str = ""):
    """(where, regex) of each `pattern` and `patternProperties` key in a JSON schema."""
    if isinstance(node, list):
        for i, value in enumerate(node):
            yield from _patterns(value, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        at = f"{path}.{key}" if path else key
        if key == "pattern" and isinstance(value, str):
            yield at, value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                if key == "patternProperties":
                    yield f"{at}[{name!r}]", name
                yield from _patterns(sub, f"{at}.{name}")
        elif key not in _DATA_KEYS:
            yield from _patterns(value, at)


def _spell_tag_schemas(node):
    """A structural tag with `spelled_string_bounds` applied to each JSON schema in it."""
    if isinstance(node, list):
        return [_spell_tag_schemas(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _spell_tag_schemas(v) for k, v in node.items()}
    if out.get("type") == "json_schema" and isinstance(out.get("json_schema"), dict):
        out["json_schema"] = spelled_string_bounds(node["json_schema"])
    return out


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
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=THREADS)
        self._bitmask: torch.Tensor | None = None  # the batch's, on the host: grown as needed
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="omni-grammar")
        # the tokens that end a grammar (xgrammar's stop tokens): nothing to mask after
        self.stop_ids = frozenset(tokenizer.eos_ids)
        # The grammar thread needs the GIL for a moment before and after each call; at
        # Python's default 5 ms switch interval it could wait most of a model step for
        # it while the engine's thread streams. (An instance process runs one engine.)
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    def compile(self, spec: GrammarSpec):
        # Compact JSON: with free whitespace a sampled sequence can pad forever between
        # tokens (and a random one does), never closing the object.
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', **COMPACT)
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(spec.source, **COMPACT)
            if spec.kind == "structural_tag":
                return self._compiler.compile_structural_tag(spec.source)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors for a bad schema
            reason = xgrammar_reason(exc)
            if spec.kind == "json_schema" and ("regex" in reason.lower() or "EBNF" in reason):
                reason = self._where(json.loads(spec.source), reason)
            raise GrammarError(reason) from None
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")

    def _where(self, schema, reason: str) -> str:
        """`reason` with the place in `schema` of the first pattern xgrammar refuses, if
        one is (its regex errors say where in the pattern, not which pattern)."""
        for path, pattern in _patterns(schema):
            try:
                self._xgr.Grammar.from_regex(pattern)
            except (RuntimeError, ValueError) as exc:
                # the line and column of its own grammar text mean nothing to a caller
                why = _EBNF_PLACE.sub("", xgrammar_reason(exc))
                return f"{path} {pattern!r}: {why}"
        return reason

    def constraint(self, spec: GrammarSpec) -> Constraint:
        return Constraint(self, self._xgr.GrammarMatcher(self.compile(spec)))

    def advance_and_fill(
        self,
        accepting: list[Constraint],
        tokens: list[int],
        n_rows: int,
        rows: list[int],
        filling: list[Constraint],
    ) -> Future[tuple[list[bool], torch.Tensor | None, list[int]]]:
        """On the grammar thread: advance `accepting` by `tokens`, then fill the bitmasks
        of `rows` (of an `n_rows` batch) from `filling`; the engine streams meanwhile
        (xgrammar runs both without the GIL). The future gives (accepted, per token;
        the bitmask, on the host; `rows`). `filling` must leave out a grammar its token ends.
        (The buffer is refilled next step, after the engine has waited for this one's
        pick, so its copy to the GPU is done.)"""
        bitmask = self._bitmask_rows(n_rows) if rows else None
        return self._thread.submit(
            self._advance_and_fill,
            [c._matcher for c in accepting],
            tokens,
            bitmask,
            rows,
            [c._matcher for c in filling],
        )

    def _advance_and_fill(self, accepting, tokens, bitmask, rows, filling):
        accepted = self._accept(accepting, tokens) if accepting else []
        if rows:
            if len(filling) == 1:
                filling[0].fill_next_token_bitmask(bitmask, rows[0])
            else:
                self._batch.batch_fill_next_token_bitmask(filling, bitmask, rows)
        return accepted, bitmask, rows

    def _bitmask_rows(self, n_rows: int) -> torch.Tensor:
        if self._bitmask is None or len(self._bitmask) < n_rows:
            size = max(n_rows, 2 * len(self._bitmask if self._bitmask is not None else ()))
            self._bitmask = self._xgr.allocate_token_bitmask(size, self.vocab_size)
            if torch.cuda.is_available():  # pinned: the copy to the GPU does not wait
                self._bitmask = self._bitmask.pin_memory()
        return self._bitmask[:n_rows]

    def apply_masks(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Mask `rows` of `logits` [n_rows, vocab] in place, on their device, with
        xgrammar's kernel."""
        on_device = bitmask.to(logits.device, non_blocking=True)
        every_row = len(rows) == len(logits)
        self._xgr.apply_token_bitmask_inplace(
            logits, on_device, vocab_size=self.vocab_size, indices=None if every_row else rows
        )

    def accept(self, constraints: list[Constraint], tokens: list[int]) -> list[bool]:
        """Advance each constraint by its token (in one batch); False where the grammar
        does not allow it."""
        return self._accept([c._matcher for c in constraints], tokens)

    def _accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        if len(matchers) == 1:
            return [matchers[0].accept_token(tokens[0])]
        return self._batch.batch_accept_token(matchers, tokens)


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

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from here, the grammar allows in a row (its place is
        left where it was)."""
        n = 0
        while n < len(tokens) and not self._matcher.is_terminated():
            if not self._matcher.accept_token(tokens[n]):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n

    def fill_along(self, bitmask: torch.Tensor, first_row: int, tokens: list[int]) -> None:
        """Rows first_row.. of `bitmask`: the grammar's masks after tokens[:i], i = 0 to
        len(tokens) (which it must allow); its place is left where it was."""
        for i in range(len(tokens) + 1):
            self._matcher.fill_next_token_bitmask(bitmask, first_row + i)
            if i < len(tokens):
                self.accept(tokens[i])
        if tokens:
            self._matcher.rollback(len(tokens))

    def mask_along(self, rows: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Rows of logits [len(tokens) + 1, vocab] (a speculative step's, on the CPU), each
        masked for the grammar's place after tokens[:i] (which it must allow); in place,
        and the grammar's place is left where it was."""
        for i, row in enumerate(rows):
            self.mask(row)
            if i < len(tokens):
                self.accept(tokens[i])
        if tokens:
            self._matcher.rollback(len(tokens))
        return rows

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        return self._matcher.is_terminated()
