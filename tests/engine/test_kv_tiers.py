"""The host tier under the paged KV cache (kv_tiers.py) on the real SmolLM2 (CPU): a
conversation's next turn finds its prefix there after other traffic evicted it from the
pool, and answers what recomputing would; no other tenant ever hits it."""

from __future__ import annotations

import queue

import pytest

from omni.engine.checkpoint import Checkpoint
from omni.engine.engine import Engine, GenerationRequest
from omni.engine.llama import LlamaForCausalLM
from omni.engine.sampling import SamplingParams
from omni.engine.tokenizer import TextTokenizer
from omni.testing.runs import tokens

BLOCKS = 48  # 768 tokens: the filler traffic below evicts the conversation's blocks
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
STORY = (
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and "
    "wrote in the log that the sea was calm, the wind was from the west, and two fishing "
    "boats had come home before the fog rolled in over the harbour and the village."
)


def ask(engine: Engine, prompt: list[int], principal: str) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one request."""
    q: queue.Queue = queue.Queue()
    engine.submit(GenerationRequest(prompt, GREEDY, principal), q.put)
    steps = [q.get(timeout=120)]
    while not steps[-1].finished:
        steps.append(q.get(timeout=120))
    return tokens(steps), steps[-1].cached_tokens


def conversation(engine: Engine, principal: str = "alice") -> dict:
    tok = engine.tokenizer
    turn1 = [{"role": "user", "content": f"{STORY}\nWho lit the lamp?"}]
    prompt1 = tok.encode_chat(turn1)
    out1, _ = ask(engine, prompt1, principal)
    for i in range(6):  # another tenant's traffic: more than the pool holds
        filler = [{"role": "user", "content": f"Story {i}: {STORY * 3} What was calm?"}]
        ask(engine, tok.encode_chat(filler), "bob")
    turn2 = [*turn1, {"role": "assistant", "content": tok.decode(out1)}]
    turn2.append({"role": "user", "content": "And where did the boats come home?"})
    prompt2 = tok.encode_chat(turn2)
    out2, cached = ask(engine, prompt2, principal)
    # what reuse can reach: full blocks of turn 1's computed tokens (all but its last)
    # that turn 2 repeats, short of turn 2's last token
    first = prompt1 + out1[:-1]
    same = next(
        (i for i, (x, y) in enumerate(zip(first, prompt2, strict=False)) if x != y), len(first)
    )
    reach = min(same, len(prompt2) - 1) // 16 * 16
    return {"out1": out1, "out2": out2, "cached": cached, "prompt2": prompt2, "reach": reach}


@pytest.fixture(scope="module")
def model_and_tokenizer(text_model_dir):
    ckpt = Checkpoint.open(text_model_dir)
    return LlamaForCausalLM.load(ckpt), TextTokenizer(ckpt)


def test_a_conversation_finds_its_evicted_prefix_in_the_host_tier(model_and_tokenizer):
    """A pool too small for the traffic, with a host tier: the conversation's second turn
    takes its prefix from the tier (every hit block restored: the pool had lost them),
    and answers what recomputing answers (the same prompt as another tenant, who hits
    nothing in the pool or the tier)."""
    model, tok = model_and_tokenizer
    tiered = Engine(model, tok, num_blocks=BLOCKS, max_batch_tokens=256, host_cache_bytes=1 << 30)
    try:
        got = conversation(tiered)
        assert got["cached"] == got["reach"] >= 64, (got["cached"], got["reach"])
        stats = tiered.stats()
        assert stats["kv_host_restored_blocks"] == got["cached"] // 16, stats
        assert stats["kv_host_stored_blocks"] > stats["kv_host_restored_blocks"]
        restored = stats["kv_host_restored_blocks"]
        recomputed, cached = ask(tiered, got["prompt2"], "carol")
        assert cached == 0 and tiered.stats()["kv_host_restored_blocks"] == restored
        assert got["out2"] == recomputed
    finally:
        tiered.shutdown()


@pytest.mark.gpu
def test_the_host_tier_on_the_gpu_gives_back_what_recomputing_gives(tmp_path):
    """The same on the GPU, a random Llama: the pool's blocks go out through pinned
    copies and come back in stream order, ahead of the step that reads them."""
    import torch

    from omni.testing.checkpoints import small_random_llama

    model, tok = small_random_llama(tmp_path)
    gen = torch.Generator().manual_seed(7)

    def run(engine: Engine) -> dict:
        prompt1 = torch.randint(0, 1024, (150,), generator=gen).tolist()
        out1, _ = ask(engine, prompt1, "alice")
        for _ in range(6):
            ask(engine, torch.randint(0, 1024, (200,), generator=gen).tolist(), "bob")
        prompt2 = prompt1 + out1 + torch.randint(0, 1024, (20,), generator=gen).tolist()
        out2, cached = ask(engine, prompt2, "alice")
        return {"out1": out1, "out2": out2, "cached": cached, "reach": (150 + 15) // 16 * 16}

    plain = Engine(model, tok, num_blocks=BLOCKS, max_batch_tokens=256)
    tiered = Engine(model, tok, num_blocks=BLOCKS, max_batch_tokens=256, host_cache_bytes=1 << 28)
    try:
        gen.manual_seed(7)
        want = run(plain)
        gen.manual_seed(7)
        got = run(tiered)
    finally:
        plain.shutdown()
        tiered.shutdown()
    assert want["cached"] == 0 and got["cached"] == got["reach"], (want, got)
    assert got["out1"] == want["out1"] and got["out2"] == want["out2"]
