"""Disaggregated serving's handoff (kv_transfer.py) on the real SmolLM2 (CPU): a prompt
computed by one engine and decoded by another answers what one engine answers, greedy
and seeded; the handoff goes only to the request it was written for."""

from __future__ import annotations

import asyncio
import queue

import pytest
import torch

from omni.engine import kv_transfer
from omni.engine.checkpoint import Checkpoint
from omni.engine.engine import Engine, GenerationRequest, StepOutput
from omni.engine.llama import LlamaForCausalLM
from omni.engine.sampling import SamplingParams
from omni.engine.tokenizer import TextTokenizer
from omni.testing.runs import tokens

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=11)
STORY = (
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and "
    "wrote in the log that the sea was calm and two fishing boats had come home."
)


def run(engine: Engine, request: GenerationRequest) -> list[StepOutput]:
    q: queue.Queue = queue.Queue()
    engine.submit(request, q.put)
    steps = [q.get(timeout=120)]
    while not steps[-1].finished:
        steps.append(q.get(timeout=120))
    assert steps[-1].finish_reason != "error", steps[-1].error
    return steps


def handoff(prefill: Engine, prompt: list[int], principal: str, path) -> kv_transfer.Handoff:
    """What the prefill side does: its full blocks short of the last token's, on disk."""
    kv_transfer.write(path, asyncio.run(prefill.prefill_handoff(prompt, principal)))
    return kv_transfer.read(path)


@pytest.fixture(scope="module")
def engines(text_model_dir):
    ckpt = Checkpoint.open(text_model_dir)
    model, tok = LlamaForCausalLM.load(ckpt), TextTokenizer(ckpt)
    made = [Engine(model, tok, num_blocks=64, max_batch_tokens=256) for _ in range(3)]
    yield made
    for engine in made:
        engine.shutdown()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prompt_prefilled_elsewhere_decodes_as_on_one_engine(engines, tmp_path, params):
    one, prefill, decode = engines
    tok = one.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": f"{STORY} Who lit the lamp?"}])
    assert len(prompt) > 48
    want = run(one, GenerationRequest(prompt, params, "alice"))
    moved = handoff(prefill, prompt, "alice", tmp_path / "kv")
    assert moved.k.shape[1] == (len(prompt) - 1) // 16 and moved.k.abs().sum() > 0
    moved.check("alice", prompt, decode.runner.block_shape, decode.runner.kv_dtype)
    request = GenerationRequest(prompt, params, "alice")
    request.kv_import, request.prior_cached_tokens = moved.payloads(), moved.cached_tokens
    got = run(decode, request)
    assert tokens(got) == tokens(want)
    assert got[-1].cached_tokens == moved.cached_tokens  # the prefill side's hits, reported
    # the decode side computed only the tail: its pool now holds the prompt's full blocks
    again = run(decode, GenerationRequest(prompt, GREEDY, "alice"))
    assert again[-1].cached_tokens == (len(prompt) - 1) // 16 * 16


def test_a_handoff_goes_only_to_its_own_request(engines, tmp_path):
    _, prefill, decode = engines
    prompt = prefill.tokenizer.encode(STORY)
    moved = handoff(prefill, prompt, "alice", tmp_path / "kv")
    layout = decode.runner.block_shape, decode.runner.kv_dtype
    with pytest.raises(kv_transfer.HandoffError, match="not this request's"):
        moved.check("bob", prompt, *layout)  # another tenant, the same prompt
    with pytest.raises(kv_transfer.HandoffError, match="not this request's"):
        moved.check("alice", [prompt[0] + 1, *prompt[1:]], *layout)
    with pytest.raises(kv_transfer.HandoffError, match="do not fit"):
        moved.check("alice", prompt, layout[0], torch.bfloat16)
    (tmp_path / "short").write_bytes((tmp_path / "kv").read_bytes()[:-10])
    with pytest.raises(kv_transfer.HandoffError, match="malformed"):
        kv_transfer.read(tmp_path / "short")
    with pytest.raises(kv_transfer.HandoffError, match="invalid handoff id"):
        kv_transfer.handoff_path(tmp_path, "../../etc/passwd")


@pytest.mark.gpu
def test_a_handoff_on_the_gpu_decodes_as_on_one_engine(tmp_path):
    """The same on the GPU, a random Llama in bf16: blocks leave through a gather and a
    copy to the host, and come back ahead of the step that reads them."""
    from omni.testing.checkpoints import small_random_llama

    model, tok = small_random_llama(tmp_path)
    prompt = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    made = [Engine(model, tok, num_blocks=64, max_batch_tokens=256) for _ in range(3)]
    one, prefill, decode = made
    try:
        for params in (GREEDY, SEEDED):
            want = run(one, GenerationRequest(prompt, params, "alice"))
            moved = handoff(prefill, prompt, "alice", tmp_path / "kv")
            assert moved.k.dtype == decode.runner.kv_dtype == torch.bfloat16
            request = GenerationRequest(prompt, params, "alice")
            request.kv_import = moved.payloads()
            assert tokens(run(decode, request)) == tokens(want)
    finally:
        for engine in made:
            engine.shutdown()
