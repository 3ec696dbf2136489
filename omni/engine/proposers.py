"""Proposers: where a speculative step's guesses come from (speculative.py checks them).

One interface, three kinds (`speculative.method` in a model's config):
- NgramProposer: the tokens that followed the newest n-gram earlier in the sequence.
- DraftProposer: a smaller model of the same tokenizer, decoding greedily a few tokens
  ahead, in the same instance and on the same GPU.
- FeatureProposer: a head drafting from the target's own hidden states, an EAGLE-3 head
  (eagle3.py) or DeepSeek-V3's multi-token-prediction module (deepseek_mtp.py).

The model proposers keep their KV in a cache of their own with as many blocks as the
target's, addressed by the target sequence's block table: a block the target holds
holds the draft's K/V of the same positions. So prompt blocks shared through the prefix
cache share the draft's K/V too, and nothing is allocated or freed for the draft. What
the draft computed is known per sequence (its confirmed positions) and per full block
(the block's prefix-cache key when the draft computed it): a reused block whose key
still matches needs no recompute. Proposals are the draft's greedy tokens (a
deterministic proposer: rejection sampling keeps the target's distribution exactly).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from .block_manager import BlockManager
from .checkpoint import Checkpoint, CheckpointError
from .cuda_graphs import BUCKETS, DecodeGraphs
from .deepseek_mtp import load_mtp
from .eagle3 import load_eagle3
from .llama import LlamaForCausalLM
from .model_runner import ModelRunner, kv_bytes_per_block
from .scheduler import Batch
from .sequence import PLACEHOLDER, Sequence
from .spec_config import OWN_WEIGHTS, WITH_WEIGHTS, SpecConfig
from .speculative import ngram_proposal
from .step import Previous

# The target's features kept for an EAGLE-3 head until it catches up (a sequence's prompt,
# and its tokens while its batch is too large to speculate); past this, the largest
# holder's oldest go first (the head then drafts worse for those positions, never wrongly).
MAX_PENDING_BYTES = 256 << 20
FEATURE_HEADS = ("eagle3", "mtp")  # methods whose head drafts from the target's features


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow seqs[i] (decoding, newest token on the host; the
        target's blocks reserved for k more tokens)."""

    def observe(self, seqs: list[Sequence], counts: list[int]) -> None:
        """A target step was just launched: counts[i] tokens of seqs[i] from its
        num_computed (called before anything else is queued on the device)."""

    def release(self, seq_id: int) -> None:
        """The sequence ended."""

    def memory_bytes(self) -> int:
        """Device memory the proposer holds beyond the target's."""

    def warm_up_tasks(self, max_batch_tokens: int, graphs: bool) -> list[Callable[[], None]]:
        """The proposer's own compiles and graph captures (Engine.warm_up)."""


class NgramProposer:
    def __init__(self, spec: SpecConfig):
        self.spec = spec

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        n_max, n_min = self.spec.ngram_max, self.spec.ngram_min
        return [ngram_proposal(s.token_ids, k, n_max, n_min) for s, k in zip(seqs, ks, strict=True)]

    def observe(self, seqs: list[Sequence], counts: list[int]) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0

    def warm_up_tasks(self, max_batch_tokens: int, graphs: bool) -> list[Callable[[], None]]:
        return []


@dataclass
class _Track:
    """What the draft's cache holds for one target sequence."""

    table: list[int]  # the target's block table it was computed in (a new list: reallocated)
    computed: int  # positions whose draft K/V are right for the target's tokens
    confirmed: int = 0  # the draft's input tokens that were the target's, at the last proposal
    proposed: list[int] = field(default_factory=list)  # draft inputs after those (K/V computed)


class ModelProposer:
    """A draft network run through a ModelRunner of its own over the target's blocks.
    Draft position t reads input token t + SHIFT of the target's sequence."""

    SHIFT = 0

    def __init__(self, spec: SpecConfig, draft, target: ModelRunner, blocks: BlockManager):
        self.spec = spec
        self.draft = draft
        self.runner = ModelRunner(draft, target.block_size, target.num_blocks)
        self.blocks = blocks  # the target's: its tables index this cache too
        self.vocab = target.model.cfg.vocab_size
        self._tracks: dict[int, _Track] = {}
        self._valid: dict[int, tuple] = {}  # block -> its stamp when the draft computed it
        self.caught_up_tokens = 0  # positions the draft computed of the target's tokens

    # --------------------------------------------------------------- what subclasses say

    def _before(self, views: list[Sequence], previous_rows: list[int] | None) -> None:
        """Ready the draft for a step over `views` (None: the first, catching up)."""

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, : self.vocab].argmax(-1)

    def _keeps_proposals(self) -> bool:
        """Whether the K/V the draft computed for its own tokens stay right once the
        target accepts them (a draft model's do; an EAGLE head's were made from its own
        features, not the target's)."""
        return True

    # --------------------------------------------------------------------- the interface

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        going = [(i, self._view(seqs[i]), k) for i, k in enumerate(ks) if k > 0]
        if not going:
            return out
        going.sort(key=lambda g: g[1].is_prefilling)  # the runner takes decodes first
        views = [v for _, v, _ in going]
        self._before(views, None)
        counts = [v.num_uncomputed for v in views]
        self.caught_up_tokens += sum(counts)
        picks = self._pick(self.runner.run(Batch(views, counts)))
        steps = [(going, picks)]
        for v in views:
            v.num_computed = len(v.token_ids)
            v.token_ids.append(PLACEHOLDER)
        for j in range(1, max(k for _, _, k in going)):
            rows = {v.seq_id: r for r, (_, v, _) in enumerate(going)}
            going = [g for g in going if g[2] > j]
            views = [v for _, v, _ in going]
            self._before(views, [rows[v.seq_id] for v in views])
            logits = self.runner.run(Batch(views, [1] * len(views)), previous=Previous(picks, rows))
            picks = self._pick(logits)
            steps.append((going, picks))
            for v in views:
                v.num_computed += 1
                v.token_ids.append(PLACEHOLDER)
        tokens = torch.cat([p for _, p in steps]).tolist()  # the one wait for the device
        at = 0
        for step_going, _ in steps:
            for i, _, _ in step_going:
                out[i].append(tokens[at])
                at += 1
        for i, k in enumerate(ks):
            if k > 0:
                self._after(seqs[i], out[i])
        return out

    def observe(self, seqs: list[Sequence], counts: list[int]) -> None:
        pass

    def release(self, seq_id: int) -> None:
        self._tracks.pop(seq_id, None)

    def memory_bytes(self) -> int:
        """The draft's own weights and its cache (weights it shares are the target's)."""
        return self.runner.memory_bytes()

    def warm_up_tasks(self, max_batch_tokens: int, graphs: bool) -> list[Callable[[], None]]:
        """Its steps hold at most max_batch sequences (more do not speculate)."""
        return self.runner.warm_up_tasks(self.spec.max_batch, max_batch_tokens, graphs)

    # ------------------------------------------------------------------------ bookkeeping

    def _inputs(self, seq: Sequence) -> list[int]:
        return seq.token_ids[self.SHIFT :]

    def _view(self, seq: Sequence) -> Sequence:
        """The draft's sequence for `seq`: its input tokens, the target's block table, and
        how far the draft's K/V there are right."""
        tokens = self._inputs(seq)
        track = self._tracks.get(seq.seq_id)
        if track is None or track.table is not seq.block_table:  # new, or reallocated
            track = _Track(seq.block_table, self._valid_prefix(seq))
            self._tracks[seq.seq_id] = track
        else:
            match = 0
            for guess, token in zip(track.proposed, tokens[track.confirmed :], strict=False):
                if guess != token:
                    break
                match += 1
            track.computed = min(track.computed, track.confirmed + match)
        track.computed = min(track.computed, len(tokens) - 1)  # the newest: for its logits
        return Sequence(
            token_ids=list(tokens),
            seq_id=seq.seq_id,
            block_table=seq.block_table,
            num_prompt_tokens=1,
            num_computed=track.computed,
        )

    def _stamp(self, seq: Sequence, i: int) -> tuple | None:
        """What block i of `seq` must still be for the draft's K/V there to hold: its
        prefix-cache key (principal, parent, tokens), and with SHIFT the input tokens
        past its end that its positions read."""
        key = self.blocks.blocks[seq.block_table[i]].key
        if key is None:
            return None
        end = (i + 1) * self.blocks.block_size
        return key, tuple(seq.token_ids[end : end + self.SHIFT])

    def _valid_prefix(self, seq: Sequence) -> int:
        """Positions at the start of a newly allocated `seq` (prefix-cache hits) whose draft
        K/V some earlier sequence computed."""
        n = 0
        for i in range(seq.num_cached_tokens // self.blocks.block_size):
            stamp = self._stamp(seq, i)
            if stamp is None or self._valid.get(seq.block_table[i]) != stamp:
                break
            n += 1
        return n * self.blocks.block_size

    def _after(self, seq: Sequence, proposed: list[int]) -> None:
        """Record what the draft computed for `seq` at this proposal."""
        track = self._tracks[seq.seq_id]
        inputs = len(seq.token_ids) - self.SHIFT
        track.confirmed = inputs
        if self._keeps_proposals():
            track.computed = inputs + len(proposed) - 1  # the last one's K/V: never computed
            track.proposed = proposed
        else:
            track.computed, track.proposed = inputs, []
        for i in range(inputs // self.blocks.block_size):  # full blocks of the target's
            stamp = self._stamp(seq, i)
            if stamp is not None:
                self._valid[seq.block_table[i]] = stamp


class DraftProposer(ModelProposer):
    """A draft model (a LlamaForCausalLM of the target's tokenizer)."""


class FeatureProposer(ModelProposer):
    """A head that drafts from the target's features (an EAGLE-3 head, DeepSeek's MTP
    module): position t reads token t + 1 and the target's feature at t; the target's
    steps leave their hidden states in `taps`, projected here (head.project) as each
    step is launched and kept per sequence until the head catches up. The head picks
    its proposals (head.pick) and feeds its own output back as the next feature."""

    SHIFT = 1

    def __init__(self, spec: SpecConfig, head, taps, target: ModelRunner, blocks: BlockManager):
        super().__init__(spec, head, target, blocks)
        # its decode steps replay graphs that read features in place (head.feature_rows);
        # its other steps (catching up on several tokens) run eagerly
        self.runner.mixed = None
        head.static_rows(BUCKETS[-1])
        self.taps = taps
        self._pending: dict[int, list[tuple[int, torch.Tensor]]] = {}  # seq -> (start, rows)
        self._pending_rows = 0
        rows = head.feature_rows
        self._max_pending_rows = max(1, MAX_PENDING_BYTES // (rows.shape[1] * rows.element_size()))

    def _keeps_proposals(self) -> bool:
        return False

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        return self.draft.pick(logits)

    @torch.inference_mode()
    def observe(self, seqs: list[Sequence], counts: list[int]) -> None:
        total = sum(counts)
        if total > self.taps.buffer.shape[0]:
            return  # a step beyond the taps' rows: its positions get no features
        features = self.draft.project(self.taps.buffer[:total])
        at = 0
        for seq, n in zip(seqs, counts, strict=True):
            self._pending.setdefault(seq.seq_id, []).append(
                (seq.num_computed, features[at : at + n])
            )
            self._pending_rows += n
            at += n
        while self._pending_rows > self._max_pending_rows:
            largest = max(self._pending.values(), key=lambda chunks: sum(len(c) for _, c in chunks))
            self._pending_rows -= len(largest.pop(0)[1])

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._drop_pending(seq_id)

    def _drop_pending(self, seq_id: int) -> list[tuple[int, torch.Tensor]]:
        chunks = self._pending.pop(seq_id, [])
        self._pending_rows -= sum(len(c) for _, c in chunks)
        return chunks

    def memory_bytes(self) -> int:
        return super().memory_bytes() + self.taps.buffer.numel() * self.taps.buffer.element_size()

    def _features(self, view: Sequence) -> torch.Tensor:
        """The target's features at the view's uncomputed positions (newer steps' over
        older ones': a rejected row's position is computed again later); zeros where none
        was kept (the draft then proposes worse, never wrongly)."""
        start, end = view.num_computed, len(view.token_ids)
        rows = self.draft.feature_rows
        out = rows.new_zeros(end - start, rows.shape[1])
        for first, rows in self._drop_pending(view.seq_id):
            lo, hi = max(first, start), min(first + len(rows), end)
            if lo < hi:
                out[lo - start : hi - start] = rows[lo - first : hi - first]
        return out

    def _before(self, views: list[Sequence], previous_rows: list[int] | None) -> None:
        head = self.draft
        if previous_rows is None:
            features = torch.cat([self._features(v) for v in views])
        else:
            rows = torch.tensor(previous_rows, device=head.hidden_rows.device)
            features = head.hidden_rows.index_select(0, rows)
        if len(features) <= len(head.feature_rows):  # in place, where a graph reads them
            head.feature_rows[: len(features)].copy_(features)
            head.features = None
        else:
            head.features = features

    def warm_up_tasks(self, max_batch_tokens: int, graphs: bool) -> list[Callable[[], None]]:
        """Its decode graphs, up to max_batch sequences (its other steps are eager)."""
        if self.runner.graphs is None or not graphs:
            return []
        buckets = [b for b in BUCKETS if b < self.spec.max_batch]
        buckets.append(DecodeGraphs.bucket(self.spec.max_batch) or BUCKETS[-1])

        def capture(b: int) -> None:
            self.draft.features = None  # the graph reads feature_rows
            with torch.inference_mode():
                self.runner.graphs.capture(b)

        return [partial(capture, b) for b in buckets]


def load_draft(spec: SpecConfig | None, target: LlamaForCausalLM, target_dir: Path | None = None):
    """The weights `spec` drafts with, on the target's device: a draft model, or an EAGLE-3
    or MTP head and the taps it reads (installed in the target here); None for n-grams.
    `target_dir`: the target's checkpoint, whose tokenizer a draft model must share (and
    whose multi-token-prediction layer an MTP head is)."""
    if spec is None or spec.method not in WITH_WEIGHTS + OWN_WEIGHTS:
        return None
    if target.cfg.tp > 1:
        raise CheckpointError(f"speculative.method {spec.method!r}: a model on one GPU so far")
    device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    if spec.method in FEATURE_HEADS:
        if spec.method == "eagle3":
            head, taps = load_eagle3(spec.path, target)
        elif target_dir is None:
            raise CheckpointError("speculative.method 'mtp' needs the model's checkpoint")
        else:
            head, taps = load_mtp(target, target_dir)
        target.taps = taps
        return head, taps
    ckpt = Checkpoint.open(spec.path)
    if target_dir is not None and not same_vocabulary(Path(target_dir), ckpt.path):
        raise CheckpointError(f"{ckpt.path}: a draft model needs the model's tokenizer")
    draft = LlamaForCausalLM.load(ckpt, device, dtype)
    if draft.cfg.vocab_size < target.cfg.vocab_size:
        raise CheckpointError(
            f"{ckpt.path}: a vocabulary of {draft.cfg.vocab_size} tokens, the model's has "
            f"{target.cfg.vocab_size}"
        )
    return draft


def same_vocabulary(a: Path, b: Path) -> bool:
    """Whether two checkpoints' tokenizers map the same strings to the same ids."""

    def vocabulary(path: Path) -> tuple:
        data = json.loads((path / "tokenizer.json").read_text())
        added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
        return data.get("model", {}).get("vocab"), added

    return vocabulary(a) == vocabulary(b)


def make_proposer(
    spec: SpecConfig, draft, target: ModelRunner, blocks: BlockManager, max_step_tokens: int
) -> Proposer:
    """The proposer `spec` names; `draft`: what load_draft loaded for it."""
    if spec.method == "draft":
        return DraftProposer(spec, draft, target, blocks)
    if spec.method in FEATURE_HEADS:
        head, taps = draft
        # a step's features: the largest prefill step, or a verify step's rows
        taps.fit(max(max_step_tokens, spec.max_batch * (spec.k + 1)))
        return FeatureProposer(spec, head, taps, target, blocks)
    return NgramProposer(spec)


def draft_bytes_per_block(spec: SpecConfig | None, draft, block_size: int) -> int:
    """What the draft's cache adds per block of the target's pool."""
    if spec is None or draft is None:
        return 0
    model = draft[0] if spec.method in FEATURE_HEADS else draft
    return kv_bytes_per_block(model, block_size)
