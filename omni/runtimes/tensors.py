"""Reading one request's BYTES input and writing BYTES outputs, as the handlers need."""

from __future__ import annotations

import numpy as np

from omni.instance.handler import HandlerError


def single_bytes(request: dict[str, np.ndarray], name: str) -> bytes:
    """The one element of a request's BYTES tensor `name` (declared with shape [1])."""
    value = request[name]
    if value.size != 1 or not isinstance(value.flat[0], bytes):
        raise HandlerError(f"{name!r} must hold one bytes element")
    return value.flat[0]


def single_text(request: dict[str, np.ndarray], name: str) -> str:
    """The one element of a request's BYTES tensor `name`, as UTF-8 text."""
    try:
        return single_bytes(request, name).decode()
    except UnicodeDecodeError as e:
        raise HandlerError(f"{name}: not UTF-8 ({e})") from e


def bytes_tensor(text: str) -> np.ndarray:
    """A BYTES tensor of shape [1] holding `text` as UTF-8."""
    out = np.empty(1, dtype=object)
    out[0] = text.encode()
    return out
