"""Checks of tensors against a handler's declared specs, both ways.

Inputs are checked before a handler sees them (a mismatch is the caller's 400). Outputs
are checked before a client sees them: a handler is untrusted code, and what it returns
may be of any type, shape or size, so nothing about it is assumed (a mismatch is a 500
for that request alone).
"""

from __future__ import annotations

import numpy as np

from omni.api.oip import DTYPES

from .handler import TensorSpec

BYTES_OVERHEAD = 4  # the protocol's length prefix of each BYTES element


class TensorError(ValueError):
    """A tensor that does not match its spec; the message names it and says how."""


def shape_matches(shape: tuple[int, ...], declared: tuple[int, ...]) -> bool:
    if len(shape) != len(declared):
        return False
    return all(d in (-1, s) for s, d in zip(shape, declared, strict=True))


def check_tensor(name: str, value: object, spec: TensorSpec) -> int:
    """Raise TensorError unless `value` is a numpy array of `spec`'s datatype and shape;
    return its size in bytes."""
    if type(value) is not np.ndarray:
        raise TensorError(f"{name!r} is a {type(value).__name__}, not a numpy array")
    if value.dtype != DTYPES[spec.datatype]:
        raise TensorError(f"{name!r} has dtype {value.dtype}, not {spec.datatype}")
    if not shape_matches(value.shape, spec.shape):
        raise TensorError(f"{name!r} has shape {list(value.shape)}, not {list(spec.shape)}")
    if spec.datatype != "BYTES":
        return value.nbytes
    total = 0
    for element in value.flat:
        if type(element) is not bytes:
            raise TensorError(f"{name!r} holds a {type(element).__name__}, not bytes (BYTES)")
        total += len(element) + BYTES_OVERHEAD
    return total


def check_inputs(inputs: dict[str, np.ndarray], specs: tuple[TensorSpec, ...]) -> None:
    """A request's inputs: exactly the declared names, each of its spec."""
    by_name = {s.name: s for s in specs}
    for name in inputs:
        if name not in by_name:
            raise TensorError(f"unknown input {name!r}; this model takes {sorted(by_name)}")
    for spec in specs:
        if spec.name not in inputs:
            raise TensorError(f"missing input {spec.name!r}")
        check_tensor(spec.name, inputs[spec.name], spec)


def check_outputs(
    outputs: object, specs: tuple[TensorSpec, ...], max_bytes: int
) -> dict[str, np.ndarray]:
    """One request's outputs as a handler returned them: a dict of exactly the declared
    names, each of its spec, together within `max_bytes`."""
    if not isinstance(outputs, dict):
        raise TensorError(f"outputs are a {type(outputs).__name__}, not a dict of arrays")
    by_name = {s.name: s for s in specs}
    names = [n for n in outputs if n not in by_name]
    if names:
        raise TensorError(f"undeclared output {str(names[0])[:64]!r}")
    total = 0
    for spec in specs:
        if spec.name not in outputs:
            raise TensorError(f"missing output {spec.name!r}")
        value = outputs[spec.name]
        if type(value) is np.ndarray and value.size * value.itemsize > max_bytes:
            raise TensorError(f"{spec.name!r} is past the {max_bytes}-byte limit of a response")
        total += check_tensor(spec.name, value, spec)
        if total > max_bytes:
            raise TensorError(f"outputs are past the {max_bytes}-byte limit of a response")
    return dict(outputs)
