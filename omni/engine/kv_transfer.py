"""A prompt's K/V handed from a prefill instance to a decode instance on the same node.

Disaggregated serving computes a prompt on one instance and decodes it on another. The
prefill instance computes the prompt's full blocks short of the one holding its last
token, and writes their K/V to a file in its own socket directory (the one directory it
may write; tmpfs under omnid's runtime dir, so host memory, not disk). omnid copies the
file into a new file of the decode instance's directory (never following a link either
instance planted; neither instance ever sees the other's files), and the decode
instance takes the blocks as it takes host-tier hits (block_manager.IMPORTED): it
computes only the prompt's last block or two, samples the first token itself (so a seed
draws what it draws on one instance) and decodes.

The file says whose blocks they are (principal) and of which tokens; the decode instance
takes them only for the same principal and the same prompt, so a handoff can never give
a request another's K/V. Written here: NIXL and Mooncake's transfer engine move GPU
memory between nodes; between two sandboxed processes of one node, a file on tmpfs copied
by omnid needs neither network nor shared mappings.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch is imported where tensors are read and written: omnid, which
    import torch  # moves handoffs, never loads it)

EXPORT_HEADER = "x-omni-kv-export"  # omnid to a prefill instance: write the handoff <id>
IMPORT_HEADER = "x-omni-kv-import"  # omnid to a decode instance: start from handoff <id>
HEADERS = frozenset({EXPORT_HEADER, IMPORT_HEADER})  # never taken from a client
_MAGIC = b"OMNIKV1\n"
_ID = re.compile(r"[0-9a-f]{32}")


class HandoffError(ValueError):
    """A handoff that is missing, malformed, or not this request's."""


def handoff_path(directory: Path, handoff_id: str) -> Path:
    if not _ID.fullmatch(handoff_id):
        raise HandoffError(f"invalid handoff id {handoff_id!r}")
    return directory / f"kv-{handoff_id}"


@dataclass
class Handoff:
    principal: str
    token_ids: list[int]  # the tokens whose K/V the blocks hold (whole blocks)
    cached_tokens: int  # the prefill instance's prefix-cache hits, which usage reports
    k: torch.Tensor  # [layers, blocks, block, heads, dim]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def payloads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (K, V) per block, as the block manager takes them."""
        return [(self.k[:, i], self.v[:, i]) for i in range(self.k.shape[1])]

    def check(self, principal: str, prompt: list[int], block: tuple, dtype: torch.dtype) -> None:
        """Refuse a handoff that is not for this request or not for this cache's layout
        (`block`: one block's K shape, [layers, block, heads, dim])."""
        if self.principal != principal or prompt[: len(self.token_ids)] != self.token_ids:
            raise HandoffError("the handoff's blocks are not this request's prompt")
        if self.k.dtype != dtype or (self.k.shape[0], *self.k.shape[2:]) != block:
            raise HandoffError(
                f"the handoff's blocks ({self.k.dtype}, {list(self.k.shape)}) do not fit this "
                f"instance's cache ({dtype}, {list(block)})"
            )


def write(path: Path, handoff: Handoff) -> int:
    """Write `handoff` (to a temporary name first: a reader never sees half a file);
    returns its size in bytes."""
    import torch

    header = {
        "principal": handoff.principal,
        "token_ids": handoff.token_ids,
        "cached_tokens": handoff.cached_tokens,
        "dtype": str(handoff.k.dtype).removeprefix("torch."),
        "shape": list(handoff.k.shape),
    }
    encoded = json.dumps(header).encode()
    tmp = path.with_suffix(".part")
    with open(tmp, "wb") as f:
        f.write(_MAGIC + len(encoded).to_bytes(4, "little") + encoded)
        for t in (handoff.k, handoff.v):
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
    os.replace(tmp, path)
    return path.stat().st_size


def read(path: Path) -> Handoff:
    import numpy as np
    import torch

    try:
        with open(path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                raise HandoffError(f"{path.name}: not a KV handoff")
            header = json.loads(f.read(int.from_bytes(f.read(4), "little")))
            dtype = getattr(torch, header["dtype"])
            shape = header["shape"]
            size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            k, v = (_tensor(np.fromfile(f, np.uint8, size), dtype, shape) for _ in range(2))
    except FileNotFoundError:
        raise HandoffError(f"{path.name}: no such handoff") from None
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise HandoffError(f"{path.name}: malformed ({exc})") from None
    return Handoff(header["principal"], header["token_ids"], header["cached_tokens"], k, v)


def _tensor(raw, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    import torch

    return torch.from_numpy(raw).view(dtype).view(shape)
