"""Varied JSON schemas, made from a seed: nested objects, arrays with bounds, enums,
bounded numbers, required and optional properties, anyOf. Bounded throughout (lengths,
items, depth), so that any answer that keeps to one ends in a few hundred tokens."""

from __future__ import annotations

import random

WORDS = [
    "id",
    "name",
    "email",
    "age",
    "score",
    "tags",
    "kind",
    "owner",
    "price",
    "active",
    "city",
    "code",
    "count",
    "ratio",
    "notes",
    "level",
    "color",
    "created",
    "items",
    "meta",
    "title",
    "status",
    "unit",
]
FEATURES = ("object", "array", "enum", "number", "anyOf")


def schema(rng: random.Random, depth: int = 0, feature: str | None = None) -> dict:
    """A node; `feature` makes sure the node (or, for the root, one property) is of it."""
    if depth == 0:  # the root: an object with the feature among its properties
        names = rng.sample(WORDS, rng.randint(2, 4))
        props = {n: schema(rng, 1) for n in names}
        props[names[0]] = schema(rng, 1, feature)
        required = sorted(rng.sample(names, rng.randint(1, len(names))))
        return {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
    kinds = ["string", "integer", "enum", "boolean", "number"]
    kinds += ["object", "array", "anyOf"] if depth < 2 else []
    kind = feature or rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 16)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 5))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {
            "type": "array",
            "items": schema(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(2, 3),
        }
    if kind == "anyOf":
        options = [schema(rng, depth + 1) for _ in range(2)]
        return {"anyOf": options + [{"type": "null"}] * (rng.random() < 0.5)}
    names = rng.sample(WORDS, rng.randint(1, 3))
    return {
        "type": "object",
        "properties": {n: schema(rng, depth + 1) for n in names},
        "required": sorted(rng.sample(names, rng.randint(0, len(names)))),
        "additionalProperties": False,
    }


def schemas(n: int, seed: int = 0) -> list[dict]:
    """`n` schemas, each of the FEATURES in turn at the root."""
    rng = random.Random(seed)
    return [schema(rng, feature=FEATURES[i % len(FEATURES)]) for i in range(n)]
