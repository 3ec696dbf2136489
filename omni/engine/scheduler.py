"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step mixes decodes (one token each, scheduled first: they hold users
waiting on the next token) with prefill chunks, under a per-step token budget,
so a long prompt never stalls the running sequences. Requests join and leave
between steps. When the KV cache runs out, the newest running sequence is
preempted: its blocks are freed and it is recomputed later from its tokens.

While the batch is full, waiting requests are admitted in groups (an eighth of
the batch) rather than one per freed slot: each admission makes a mixed step,
which costs more than a decode step.

Waiting requests are admitted longest first (see wait_queue): a backlog's run
lasts as many steps as its longest request, which should start at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import PLACEHOLDER, Sequence, Status
from .wait_queue import WaitQueue


@dataclass
class Batch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens each sequence computes in this step

    def samples(self, i: int) -> bool:
        """Whether sequence i gets a new token from this step's logits."""
        seq = self.seqs[i]
        return seq.num_computed + self.num_tokens[i] == len(seq.token_ids)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_batch_tokens: int = 2048,
        max_seqs: int = 256,
        max_wait_s: float = 2.0,
    ):
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.admit_group = max(1, max_seqs // 8)
        self.waiting = WaitQueue(max_wait_s)
        self.running: list[Sequence] = []  # in admission order: newest last
        self.preemptions = 0

    def fits(self, seq: Sequence) -> bool:
        """Whether `seq` can ever run: prompt and all its new tokens within the whole cache
        (otherwise it would wait forever; the engine refuses it instead)."""
        total = self.blocks.num_blocks * self.blocks.block_size
        return len(seq.token_ids) + seq.max_tokens - seq.num_generated <= total

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.push(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        budget = self.max_batch_tokens
        batch = Batch([], [])
        # 1. decodes, preempting the newest sequences while the cache is full
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            if seq.num_generated >= seq.max_tokens:
                continue  # its last token is still on the GPU; it ends when that arrives
            while not self.blocks.can_append(seq):
                self._preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.append_slot(seq)
                batch.seqs.append(seq)
                batch.num_tokens.append(1)
                budget -= 1
        # 2. prefill chunks of admitted sequences, oldest first
        for seq in self.running:
            if seq.is_prefilling and budget > 0:
                n = min(seq.num_uncomputed, budget)
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
        # 3. admit waiting sequences while blocks and budget last; a full batch takes a
        # group at a time (or every waiting one, when fewer wait)
        room = self.max_seqs - len(self.running)
        decode_only = batch.seqs and not any(s.is_prefilling for s in batch.seqs)
        if decode_only and room < min(self.admit_group, len(self.waiting)):
            room = 0
        while self.waiting and budget > 0 and room > 0:
            seq = self.waiting.peek()
            if seq.token_ids[-1] == PLACEHOLDER or not self.blocks.can_allocate(seq):
                break  # (preempted with its newest token still on the GPU: next step)
            room -= 1
            self.waiting.remove(seq)
            seq.num_computed = self.blocks.allocate(seq)  # prefix-cache hits are computed
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch if batch.seqs else None

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Run `child`, a copy of `parent`'s prompt, on the KV `parent` computed for it
        (see BlockManager.fork); returns the blocks to copy. Without a free block the
        child waits, first in line, to be computed from its tokens (the prompt's full
        blocks are prefix-cache hits then)."""
        copies = self.blocks.fork(parent, child)
        if copies is None:
            child.status = Status.WAITING
            self.waiting.push_front(child)
            return []
        child.num_computed = len(child.token_ids)
        child.status = Status.RUNNING
        self.running.append(child)
        return copies

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks; it will be recomputed from its tokens, before newer work."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        seq.status = Status.WAITING
        self.waiting.push_front(seq)

    def update(self, batch: Batch, new_tokens: dict[int, int]) -> None:
        """After a step: advance each sequence; append the tokens it sampled (PLACEHOLDER
        where the value is still on the GPU: the engine fills it in later)."""
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.status is not Status.RUNNING:
                continue  # aborted or finished during the step
            seq.num_computed += n
            self.blocks.register_full_blocks(seq, seq.num_computed)
            if seq.seq_id in new_tokens:
                seq.token_ids.append(new_tokens[seq.seq_id])

    def advance(self, seq: Sequence, tokens: list[int]) -> None:
        """After a speculative step: `tokens` (accepted proposals, then the target's own
        token) join `seq`; all but the last have their K/V computed."""
        seq.num_computed = len(seq.token_ids) + len(tokens) - 1
        seq.token_ids.extend(tokens)
        self.blocks.register_full_blocks(seq, seq.num_computed)

    def finish(self, seq: Sequence) -> None:
        """Done or aborted: its blocks are free at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
