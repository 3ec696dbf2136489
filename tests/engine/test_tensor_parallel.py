"""Tensor parallelism on the CPU (gloo): a model split over two ranks, each in its own
process, computes what the whole model computes: the same greedy tokens, logits equal
up to the order of the ranks' partial sums."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from omni.engine.checkpoint import CheckpointError
from omni.engine.llama import LlamaConfig, LlamaForCausalLM
from omni.engine.tensor_parallel import shard_config

from ..test_engine import ARCHES, tiny_checkpoint
from .tp_rank import greedy_steps, run_rank

STEPS = 12


def run_ranks(target, tp: int, tmp_path, *args):
    """target(rank, tp, *args, rendezvous file, queue) in one spawned process per rank;
    what rank 0 puts on the queue."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = str(tmp_path / "tp-init")
    procs = [ctx.Process(target=target, args=(r, tp, *args, init, out)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return result


@pytest.mark.parametrize(
    ("arch", "experts"),
    [("llama", False), ("qwen2", False), ("mixtral", False), ("mixtral", True)],
)  # dense, biases + tied, MoE with each expert split, MoE with the experts shared out
def test_two_ranks_compute_what_one_computes(arch, experts, tmp_path):
    _, ckpt = tiny_checkpoint(tmp_path / "ckpt", ARCHES[arch]())
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=rng).tolist() for n in (5, 37, 18)]
    want_tokens, want_logits = greedy_steps(LlamaForCausalLM.load(ckpt), prompts, STEPS)
    got = run_ranks(run_rank, 2, tmp_path, str(ckpt.path), prompts, STEPS, experts)
    tokens, logits, vocab_rows, held = got
    assert vocab_rows == 96 // 2  # rank 0 held half the vocabulary (and of each layer)
    if arch == "mixtral":  # (experts, 2 x width): 2 of 4 whole ones, or a half of all 4
        cfg = LlamaConfig.from_checkpoint(ckpt).moe
        assert tuple(held) == ((2, 2 * cfg.intermediate) if experts else (4, cfg.intermediate))
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("q_lora_rank", "experts"), [(24, False), (None, True)])
def test_a_deepseek_over_two_ranks_computes_what_one_computes(q_lora_rank, experts, tmp_path):
    """DeepSeek-V3's architecture over two ranks: MLA's heads split (the latent cache
    whole on each), the dense and shared MLPs split, the routed experts each split by
    width or shared out whole; the same greedy tokens and logits as one rank's."""
    from omni.engine.deepseek_v3 import DeepseekV3ForCausalLM

    from .test_deepseek_v3 import deepseek_config
    from .test_deepseek_v3 import tiny_checkpoint as deepseek_checkpoint

    _, ckpt = deepseek_checkpoint(tmp_path / "ckpt", deepseek_config(q_lora_rank))
    rng = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 96, (n,), generator=rng).tolist() for n in (5, 29, 12)]
    want_tokens, want_logits = greedy_steps(DeepseekV3ForCausalLM.load(ckpt), prompts, STEPS)
    got = run_ranks(run_rank, 2, tmp_path, str(ckpt.path), prompts, STEPS, experts)
    tokens, logits, vocab_rows, held = got
    assert vocab_rows == 96 // 2
    # (experts, 2 x width): 4 of the 8 whole; or all 8 halved, the shared one's half after
    assert tuple(held) == ((4, 64) if experts else (9, 32))
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-4, rtol=1e-4)


def test_a_model_that_does_not_split_evenly_is_refused(tmp_path):
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES["qwen3_moe"]())  # one KV head
    cfg = LlamaConfig.from_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"KV heads \(1\) not divisible"):
        shard_config(cfg, 2)
    with pytest.raises(CheckpointError, match=r"experts \(6\) not divisible"):
        shard_config(cfg, 4, experts=True)
    half = shard_config(LlamaConfig.from_checkpoint(tiny_checkpoint(
        tmp_path / "llama", ARCHES["llama"]())[1]), 2)  # fmt: skip
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size) == (2, 1, 48)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_an_engine_over_two_ranks_serves_what_one_serves(arch, tmp_path):
    """Rank 0 schedules, samples and streams; rank 1 follows its runner. Chunked prompts,
    mixed steps, a seeded sampled request and a prefix-cache hit: the same tokens."""
    from omni.engine.engine import Engine
    from omni.engine.tokenizer import TextTokenizer

    from .tp_rank import ENGINE, serve, serve_rank

    _, ckpt = tiny_checkpoint(tmp_path / "ckpt", ARCHES[arch]())
    rng = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 96, (n,), generator=rng).tolist() for n in (9, 30, 17)]
    engine = Engine(LlamaForCausalLM.load(ckpt), TextTokenizer(ckpt), **ENGINE)
    try:
        want = serve(engine, prompts)
    finally:
        engine.shutdown()
    got = run_ranks(serve_rank, 2, tmp_path, str(ckpt.path), prompts)
    assert got == want
    assert len(got[3]) == 16 and got[3] != got[0]  # the sampled one ran, and sampled


@pytest.mark.gpu
def test_two_gpus_compute_what_one_gpu_computes(tmp_path):
    """NCCL over two GPUs, bf16: the logits of one GPU along one greedy path (up to the
    order of the partial sums), and an Engine with CUDA graphs (all-reduces captured)
    whose greedy tokens do not depend on the batch or the prefix cache."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from .tp_rank import gpu_rank

    _, ckpt = tiny_checkpoint(tmp_path / "ckpt", ARCHES["llama"]())
    rng = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 96, (n,), generator=rng).tolist() for n in (5, 37, 18)]
    (tmp_path / "one").mkdir()
    one = run_ranks(run_rank, 1, tmp_path / "one", str(ckpt.path), prompts, STEPS, False)
    one_tokens = one[0]
    runs = {}
    for tp in (1, 2):
        (tmp_path / f"tp{tp}").mkdir()
        runs[tp] = run_ranks(
            gpu_rank, tp, tmp_path / f"tp{tp}", str(ckpt.path), prompts, STEPS, one_tokens
        )
    for got, want in zip(runs[2][0], runs[1][0], strict=True):
        torch.testing.assert_close(
            torch.from_numpy(got), torch.from_numpy(want), atol=5e-2, rtol=5e-2
        )
    for tp in (1, 2):  # (greedy tokens may differ between them at near-ties, in bf16)
        served = runs[tp][1]
        assert served[0] == served[-1]  # a prompt in a batch, then alone from the prefix cache


def test_experts_shared_out_keep_their_tensors_whatever_the_name_order():
    """16 experts, names in the files' (lexicographic) order: experts.10 comes before
    experts.2, so a rank's renumbered name may be one not yet read."""
    from omni.engine.tensor_parallel import rank_rows, shard_state

    names = sorted(f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(16))
    for rank in (0, 1):
        state = {n: torch.full((2, 3), float(n.split(".")[5])) for n in names}
        rows = rank_rows(rank, 2, experts=16)
        assert [rows(n, (2, 3)) is not None for n in names].count(True) == 8
        shard_state(state, rank, 2, experts=16)
        kept = {int(n.split(".")[5]): int(t[0, 0]) for n, t in state.items()}
        assert kept == {e: e + 8 * rank for e in range(8)}  # local e holds expert e + 8r
