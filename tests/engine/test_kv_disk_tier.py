"""The disk tier under the host tier (kv_tiers.py): blocks the host tier drops past its
budget are written to files and come back bit for bit, under the whole key only; the disk
keeps to its own budget and a failed write loses a block, never the engine. Then the real
SmolLM2 (CPU): a conversation's second turn finds its prefix on disk."""

from __future__ import annotations

import queue
import shutil

import pytest
import torch

from omni.engine.checkpoint import Checkpoint
from omni.engine.engine import Engine, GenerationRequest
from omni.engine.kv_tiers import DiskTier, HostTier, Payload
from omni.engine.llama import LlamaForCausalLM
from omni.engine.model_runner import kv_bytes_per_block
from omni.engine.sampling import SamplingParams
from omni.engine.tokenizer import TextTokenizer
from omni.testing.runs import tokens

from .test_kv_tiers import STORY


def block(seed: int, dtype: torch.dtype = torch.float32) -> tuple[int, tuple, Payload]:
    """(hash, key, K/V) of a random block: [layers, block, heads, dim] = [2, 16, 2, 8]."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, 16, 2, 8, generator=gen).to(dtype) for _ in range(2))
    key = ("alice", seed, tuple(range(seed, seed + 16)))
    return hash(key), key, (k, v)


def nbytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


def files(tier: DiskTier) -> list:
    return sorted(tier.directory.iterdir())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_the_host_drops_lands_on_disk_and_comes_back_bit_identical(tmp_path, dtype):
    a, b = block(1, dtype), block(2, dtype)
    size = nbytes(a[2])
    tier = HostTier(size, DiskTier(tmp_path / "kv", 10 * size))  # the directory is made
    tier.store(*a)
    tier.store(*b)  # past the host's budget: a goes down
    assert len(tier) == 1 and len(tier.below) == 1 and len(files(tier.below)) == 1
    assert tier.has(a[0], a[1]) and tier.has(b[0], b[1])
    k, v = tier.take(a[0], a[1])
    assert k.dtype == v.dtype == dtype and k.shape == v.shape == a[2][0].shape
    assert torch.equal(k, a[2][0]) and torch.equal(v, a[2][1])
    assert not tier.has(a[0], a[1]) and files(tier.below) == []  # taken: its file is gone
    assert tier.take(b[0], b[1])[0] is b[2][0]  # from host memory, as it was
    stats = tier.stats_dict()
    assert stats["kv_host_stored_blocks"] == 2 and stats["kv_host_dropped_blocks"] == 1
    assert stats["kv_host_restored_blocks"] == 1 and stats["kv_host_bytes_in"] == size
    assert stats["kv_disk_stored_blocks"] == stats["kv_disk_restored_blocks"] == 1
    assert stats["kv_disk_bytes_out"] == stats["kv_disk_bytes_in"] == size
    assert stats["kv_disk_dropped_blocks"] == stats["kv_disk_write_errors"] == 0
    assert stats["kv_disk_restore_seconds"] > 0
    assert tier.bytes == tier.below.bytes == 0


def test_the_disk_tier_serves_only_the_whole_key(tmp_path):
    h, key, payload = block(1)
    disk = DiskTier(tmp_path, 10 * nbytes(payload))
    disk.store(h, key, payload)
    assert disk.has(h, key)
    assert not disk.has(h, ("bob", *key[1:]))  # the same hash, another principal's key
    assert HostTier(1, disk).has(h, key) and not HostTier(1, disk).has(h, ("bob", *key[1:]))


def test_the_disk_tier_keeps_to_its_budget_by_deleting_its_oldest_files(tmp_path):
    blocks = [block(i) for i in range(5)]
    size = nbytes(blocks[0][2])
    tier = HostTier(size, DiskTier(tmp_path, 2 * size))
    for b in blocks:
        tier.store(*b)
    # the host holds the newest; of the 4 it dropped, the disk kept the 2 newest
    assert [tier.has(h, key) for h, key, _ in blocks] == [False, False, True, True, True]
    assert len(files(tier.below)) == 2 and tier.below.bytes == 2 * size
    assert tier.below.stats.stored_blocks == 4 and tier.below.stats.dropped_blocks == 2


def test_a_block_stored_again_replaces_its_copy_on_disk(tmp_path):
    a, b = block(1), block(2)
    size = nbytes(a[2])
    tier = HostTier(size, DiskTier(tmp_path, 10 * size))
    tier.store(*a)
    tier.store(*b)  # a on disk
    tier.store(*a)  # a recomputed and evicted again: b down, a's old file gone
    assert len(tier.below) == 1 and tier.below.has(b[0], b[1])
    assert len(files(tier.below)) == 1 and tier.below.bytes == size


def test_a_failed_write_drops_the_block_and_nothing_else(tmp_path):
    a, b = block(1), block(2)
    size = nbytes(a[2])
    tier = HostTier(size, DiskTier(tmp_path / "kv", 10 * size))
    shutil.rmtree(tmp_path / "kv")  # the disk gone from under the tier
    tier.store(*a)
    tier.store(*b)  # a's write fails: a is lost
    assert not tier.has(a[0], a[1]) and tier.has(b[0], b[1])
    assert tier.below.stats.write_errors == 1 and tier.below.stats.stored_blocks == 0
    assert tier.below.bytes == 0


def test_the_directory_starts_empty_of_old_blocks_and_close_deletes_its_own(tmp_path):
    (tmp_path / "0.kv").write_bytes(b"a previous process's block")
    (tmp_path / "notes.txt").write_text("not the tier's")
    h, key, payload = block(1)
    disk = DiskTier(tmp_path, 10 * nbytes(payload))
    assert files(disk) == [tmp_path / "notes.txt"]
    disk.store(h, key, payload)
    assert len(files(disk)) == 2
    HostTier(1, disk).close()
    assert files(disk) == [tmp_path / "notes.txt"] and len(disk) == 0 and disk.bytes == 0


@pytest.fixture(scope="module")
def model_and_tokenizer(text_model_dir):
    ckpt = Checkpoint.open(text_model_dir)
    return LlamaForCausalLM.load(ckpt), TextTokenizer(ckpt)


def ask(engine: Engine, prompt: list[int], principal: str) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one greedy request of 8 tokens."""
    q: queue.Queue = queue.Queue()
    engine.submit(
        GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=0.0), principal), q.put
    )
    steps = [q.get(timeout=120)]
    while not steps[-1].finished:
        steps.append(q.get(timeout=120))
    return tokens(steps), steps[-1].cached_tokens


def test_a_conversation_finds_its_evicted_prefix_on_disk(model_and_tokenizer, tmp_path):
    """A pool of 13 blocks: one filler request (13 blocks) evicts the 5 full blocks of turn
    1; the host tier holds 2 blocks, so 3 of them go on to disk. Turn 2 gets all 5 back,
    and answers what another tenant, recomputing the same prompt, gets."""
    model, tok = model_and_tokenizer
    size = kv_bytes_per_block(model, 16)
    with pytest.raises(ValueError, match="host"):
        Engine(model, tok, num_blocks=4, disk_cache_bytes=size, disk_cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="directory"):
        Engine(model, tok, num_blocks=4, host_cache_bytes=size, disk_cache_bytes=size)
    engine = Engine(
        model,
        tok,
        num_blocks=13,
        max_batch_tokens=256,
        host_cache_bytes=2 * size,
        disk_cache_bytes=64 * size,
        disk_cache_dir=str(tmp_path),
    )
    try:
        turn1 = [{"role": "user", "content": f"{STORY}\nWho lit the lamp?"}]
        prompt1 = tok.encode_chat(turn1)
        out1, _ = ask(engine, prompt1, "alice")
        filler = [{"role": "user", "content": f"Story: {STORY * 3} What was calm?"}]
        ask(engine, tok.encode_chat(filler), "bob")
        turn2 = [*turn1, {"role": "assistant", "content": tok.decode(out1)}]
        turn2.append({"role": "user", "content": "And where did the boats come home?"})
        prompt2 = tok.encode_chat(turn2)
        out2, cached = ask(engine, prompt2, "alice")
        stats = engine.stats()
        recomputed, none = ask(engine, prompt2, "carol")  # another tenant: no hit anywhere
    finally:
        engine.shutdown()
    reach = len(prompt1 + out1[:-1]) // 16 * 16  # turn 1's computed full blocks
    assert prompt2[:reach] == (prompt1 + out1)[:reach]
    assert cached == reach == 80, (cached, reach)
    assert stats["kv_disk_restored_blocks"] == 3 and stats["kv_host_restored_blocks"] == 2
    assert none == 0 and out2 == recomputed  # as recomputed


@pytest.mark.gpu
def test_the_disk_tier_on_the_gpu_gives_back_what_recomputing_gives(tmp_path):
    """On the GPU (a random Llama), a prompt's eviction of many blocks at once drops pinned
    copies to disk while they may still be on their way: what comes back is what was
    computed."""
    from omni.testing.checkpoints import small_random_llama

    model, tok = small_random_llama(tmp_path)
    size = kv_bytes_per_block(model, 16)

    def run(**tiers) -> tuple[list[int], list[int], int, dict]:
        gen = torch.Generator().manual_seed(7)
        engine = Engine(model, tok, num_blocks=48, max_batch_tokens=256, **tiers)
        try:
            prompt1 = torch.randint(0, 1024, (150,), generator=gen).tolist()
            out1, _ = ask(engine, prompt1, "alice")
            for _ in range(6):
                ask(engine, torch.randint(0, 1024, (200,), generator=gen).tolist(), "bob")
            prompt2 = prompt1 + out1 + torch.randint(0, 1024, (20,), generator=gen).tolist()
            out2, cached = ask(engine, prompt2, "alice")
            return out1, out2, cached, engine.stats()
        finally:
            engine.shutdown()

    *want, _, _ = run()
    *got, cached, stats = run(
        host_cache_bytes=2 * size, disk_cache_bytes=1 << 28, disk_cache_dir=str(tmp_path / "kv")
    )
    assert cached == (150 + 7) // 16 * 16 and stats["kv_disk_restored_blocks"] > 0, stats
    assert got == want
