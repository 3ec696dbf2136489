"""A request as the scheduler sees it: its tokens, its blocks, how far its KV is computed."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from .block_manager import BlockOwner

_ids = itertools.count()
# A token sampled on the GPU whose value the host does not know yet: the step after it
# is launched first (its input comes from the device), then the value is filled in.
PLACEHOLDER = -1


class Status(enum.Enum):
    WAITING = "waiting"  # no blocks (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds blocks; prefilling in chunks or decoding
    FINISHED = "finished"


@dataclass
class Sequence(BlockOwner):
    max_tokens: int = 16
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    num_prompt_tokens: int = 0
    num_computed: int = 0  # tokens whose K/V are in the cache
    preemptions: int = 0

    def __post_init__(self):
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """Prompt tokens, or more than the newest token, still lack their K/V (a prompt
        or a recompute). Otherwise the sequence decodes: its next step is one generated
        token through the decode kernel, however its neighbours are batched."""
        return self.num_uncomputed > 1 or self.num_computed < self.num_prompt_tokens
