"""A step's inputs as the model runner hands them to the model, the CUDA graphs and the
other ranks: a leaf module, so that the runner, the graphs and the engine import it and
none of them another for its data."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Previous:
    """The tokens the last step sampled, still on the device, by sequence."""

    tokens: torch.Tensor  # [sampling rows] int64
    rows: dict[int, int]  # seq_id -> row of `tokens`


@dataclass
class HostInputs:
    """A step's flat inputs on the host, as they travel: to the device, and (split over
    ranks) to the other ranks (tp_runner.py)."""

    longs: np.ndarray  # int64: ids, positions, slots, sample_at, fill_at, fill_rows
    long_sizes: list[int]
    ints: np.ndarray  # int32: seq_lens, cu_seqlens_q, tables, counts, work
    int_sizes: list[int]
    rows: int  # sequences
    width: int  # block-table columns
    num_decodes: int

    @classmethod
    def pack(cls, longs: list, ints: list, table_shape: tuple[int, int], num_decodes: int):
        """From the parts, in the order upload() splits them: (ids, positions, slots,
        sample_at, fill_at, fill_rows) and (seq_lens, cu_seqlens_q, tables, counts, work)."""
        return cls(
            longs=np.concatenate([np.asarray(p, dtype=np.int64) for p in longs]),
            long_sizes=[len(p) for p in longs],
            ints=np.concatenate([np.asarray(p, dtype=np.int32) for p in ints]),
            int_sizes=[len(p) for p in ints],
            rows=table_shape[0],
            width=table_shape[1],
            num_decodes=num_decodes,
        )


@dataclass
class Prepared:
    """A step's inputs on their way to the device, but for the placeholders' tokens."""

    ids: torch.Tensor
    step: StepInputs
    placeholders: tuple[torch.Tensor, torch.Tensor] | None  # (token index, row of previous)
    host: HostInputs


@dataclass
class StepInputs:
    positions: torch.Tensor  # [tokens]
    slot_mapping: torch.Tensor  # [tokens] int64
    block_tables: torch.Tensor  # [seqs, max blocks] int32
    seq_lens: torch.Tensor  # [seqs] int32: context length after this step
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32
    num_decodes: int  # the first sequences decode one token each: the split-KV decode kernel
    counts: torch.Tensor  # [2] int32: (decoding sequences, prefill work entries)
    work: torch.Tensor  # [entries, 2] int32: the prefill kernel's (row, query block) list
    sample_at: torch.Tensor | None = None  # [sampling sequences]: their last token's index

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.seq_lens.shape[0]
