"""The CPU engine against HF transformers: GGUF import, tokenizer, model, generation."""

from __future__ import annotations

import itertools
import queue
import shutil
import time

import pytest
import torch
import transformers

from omni.engine.block_manager import BlockManager
from omni.engine.checkpoint import Checkpoint, CheckpointError
from omni.engine.engine import Engine, GenerationRequest
from omni.engine.llama import LlamaForCausalLM
from omni.engine.mixed_graphs import BUCKETS as MIXED_BUCKETS
from omni.engine.model_runner import ModelRunner, SoloSequence
from omni.engine.sampling import SamplingParams
from omni.engine.scheduler import Batch
from omni.engine.sequence import Sequence
from omni.engine.tokenizer import TextTokenizer
from omni.runtime.defaults import SMOLLM_FILE, SMOLLM_PACKAGE, package_dir
from omni.testing.checkpoints import save_word_level_tokenizer
from omni.testing.runs import greedy_steps, run_requests, tokens

TEXTS = ["Hello, world! 12345 café 🚀 naïve", "  two spaces\n\ttab", "def f(x):\n    return x**2"]


@pytest.fixture(scope="module")
def hf_from_gguf():
    """transformers' own reading of the same GGUF file: an independent reference."""
    d = str(package_dir(SMOLLM_PACKAGE))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=SMOLLM_FILE, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM_FILE)
    return model.eval(), tok


def test_gguf_import_matches_transformers(text_model_dir, hf_from_gguf):
    hf_model, hf_tok = hf_from_gguf
    ckpt = Checkpoint.open(text_model_dir)
    tok = TextTokenizer(ckpt)
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )

    model = LlamaForCausalLM.load(ckpt)
    ids = torch.tensor(tok.encode(TEXTS[0] + " " + TEXTS[2]))
    with torch.no_grad():
        reference = hf_model(ids[None]).logits[0]
    ours = SoloSequence(ModelRunner(model, num_blocks=16)).extend(ids.tolist(), all_logits=True)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


def tiny_checkpoint(tmp_path, config) -> Checkpoint:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random, not the init's near-zero values
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    save_word_level_tokenizer(tmp_path / "tokenizer.json", config.vocab_size)  # loader needs one
    return hf, Checkpoint.open(tmp_path)


ARCHES = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        max_position_embeddings=256,
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "mixtral": lambda: transformers.MixtralConfig(  # top-2 of 4 experts, renormalized
        vocab_size=96,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(  # top-3 of 6, layer 1 dense
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
    ),
}


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_tiny_models_match_transformers(arch, tmp_path):
    hf, ckpt = tiny_checkpoint(tmp_path, ARCHES[arch]())
    model = LlamaForCausalLM.load(ckpt)
    runner = ModelRunner(model, block_size=8, num_blocks=64)
    # chunked prefill (17 + 13 tokens), then one token at a time over the paged cache
    ids = torch.randint(0, 96, (40,)).tolist()
    solo = SoloSequence(runner)
    ours = torch.cat(
        [solo.extend(ids[:17], all_logits=True), solo.extend(ids[17:30], chunk=5, all_logits=True)]
        + [solo.extend([t], all_logits=True) for t in ids[30:]]
    )
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(torch.tensor([ids])).logits[0], atol=1e-4, rtol=0)
    # several ragged sequences in one batch, each against HF on its own
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seqs = [Sequence(token_ids=torch.randint(0, 96, (n,)).tolist()) for n in (5, 23, 12)]
    for seq in seqs:
        blocks.allocate(seq)
    batch = Batch(seqs, [len(s.token_ids) for s in seqs])
    logits = runner.run(batch, all_logits=True).split(batch.num_tokens)
    for seq, got in zip(seqs, logits, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([seq.token_ids])).logits[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_broken_checkpoints_name_the_file(tmp_path, text_model_dir):
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["GPTNeoXForCausalLM"]}')
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        Checkpoint.open(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    shutil.copy(text_model_dir / "tokenizer.json", tmp_path)
    ckpt = Checkpoint.open(tmp_path)
    with pytest.raises(CheckpointError, match="model_type None not supported"):
        LlamaForCausalLM.load(ckpt)
    (tmp_path / "config.json").write_text('{"architectures": ["Wav2Vec2Model"]}')
    with pytest.raises(CheckpointError, match="architecture 'Wav2Vec2Model' not supported"):
        Checkpoint.open(tmp_path)
    config = (text_model_dir / "config.json").read_text()
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors"):
        LlamaForCausalLM.load(Checkpoint.open(tmp_path))


def test_a_missing_or_misshapen_projection_is_named(tmp_path):
    """q/k/v and gate/up are stacked into fused projections at load: a checkpoint that
    lacks one of them, or has one of the wrong width, is refused naming that tensor."""
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES["llama"]())
    cfg = LlamaForCausalLM.load(ckpt).cfg
    state = ckpt.load_tensors("cpu", torch.float32)
    del state["model.layers.1.self_attn.k_proj.weight"]
    missing = r"missing tensors \['model\.layers\.1\.self_attn\.k_proj\.weight'\]"
    with pytest.raises(CheckpointError, match=missing):
        LlamaForCausalLM.from_state(cfg, state, ckpt.path)
    state = ckpt.load_tensors("cpu", torch.float32)
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:, :5]
    with pytest.raises(CheckpointError, match=r"unequal width: .*up_proj\.weight \(96, 5\)"):
        LlamaForCausalLM.from_state(cfg, state, ckpt.path)


def run_engine(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[str, list]:
    steps = run_requests(engine, [prompt], params)[0]
    return "".join(s.text for s in steps), steps


@pytest.fixture(scope="module")
def engine(text_model_dir):
    ckpt = Checkpoint.open(text_model_dir)
    eng = Engine(LlamaForCausalLM.load(ckpt), TextTokenizer(ckpt))
    yield eng
    eng.shutdown()


def test_greedy_generation_matches_transformers(engine, text_model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(text_model_dir, dtype=torch.float32)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "List three fruits."}])
    text, steps = run_engine(
        engine, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    reference = hf.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None
    )[0, len(prompt) :].tolist()
    assert [t for s in steps for t in s.token_ids] == reference
    assert text == engine.tokenizer.decode(reference)
    assert steps[-1].finish_reason == "length" and steps[-1].completion_tokens == 24


def test_stop_string_never_leaks(engine):
    prompt = engine.tokenizer.encode("1, 2, 3, 4,")
    full, _ = run_engine(engine, prompt, SamplingParams(max_tokens=20, temperature=0))
    assert " 7," in full
    text, steps = run_engine(
        engine, prompt, SamplingParams(max_tokens=20, temperature=0, stop=[" 7,"])
    )
    assert text == full[: full.index(" 7,")]
    assert steps[-1].finish_reason == "stop"
    assert all(" 7" not in s.text for s in steps)


def test_cancel_stops_generation(engine):
    outputs: queue.Queue = queue.Queue()
    req = GenerationRequest(
        engine.tokenizer.encode("Tell me a story."),
        SamplingParams(max_tokens=500, temperature=0, ignore_eos=True),
    )
    engine.submit(req, outputs.put)
    outputs.get(timeout=60)
    req.cancelled.set()
    last = outputs.get(timeout=60)
    while not last.finished:
        last = outputs.get(timeout=60)
    assert last.finish_reason == "abort" and last.completion_tokens < 500


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
def test_batched_prefill_and_decode_on_the_gpu_match_the_cpu_path(arch, tmp_path):
    """The Triton path (paged prefill, split-KV decode, fused experts) against the
    references, batched."""
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES[arch]())
    cpu, gpu = LlamaForCausalLM.load(ckpt), LlamaForCausalLM.load(ckpt, device="cuda")
    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (5, 40, 17)]
    # a mixed prefill step, then decode-only steps; the GPU fed the CPU's tokens
    tokens, want = greedy_steps(cpu, prompts, 8)
    _, got = greedy_steps(gpu, prompts, 8, forced=tokens)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)  # TF32 dot products


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_greedy_32_tokens_match_transformers_under_batching_preemption_and_prefix_hits(
    arch, tmp_path
):
    hf, ckpt = tiny_checkpoint(tmp_path, ARCHES[arch]())
    # 20 blocks of 8: far fewer slots than the requests need at once, so the scheduler
    # preempts; 24 tokens a step, so prompts are prefilled in chunks
    engine = Engine(
        LlamaForCausalLM.load(ckpt),
        TextTokenizer(ckpt),
        block_size=8,
        num_blocks=20,
        max_batch_tokens=24,
    )
    rng = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 96, (24,), generator=rng).tolist()
    first = [torch.randint(0, 96, (n,), generator=rng).tolist() for n in (7, 31, 18, 40)]
    second = [shared + torch.randint(0, 96, (n,), generator=rng).tolist() for n in (3, 9)]
    second += [first[1], first[3]]  # repeats: their prefixes are cached

    def generate_all(prompts):
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        return run_requests(engine, prompts, params)

    try:
        warm = generate_all([[*shared, 1, 2, 3]])  # puts the shared prefix in the cache
        results = generate_all(first) + generate_all(second)
    finally:
        engine.shutdown()
    assert warm[0][-1].finish_reason == "length"
    assert engine.scheduler.preemptions > 0, "no preemption: the test lost its pressure"
    assert sum(r[-1].cached_tokens > 0 for r in results) >= 3  # shared prefix and repeats
    for prompt, steps in zip(first + second, results, strict=True):
        ours = tokens(steps)
        ids = torch.tensor([prompt])
        with torch.no_grad():  # an explicit mask: else generate takes every token 0 for padding
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert ours == ref
    assert engine.scheduler.blocks.num_free == 20


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_decode_graphs_replay_what_eager_decode_computes(arch, tmp_path):
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES[arch]())
    model = LlamaForCausalLM.load(ckpt, device="cuda")
    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (5, 40, 17)]

    def decode(use_graphs: bool) -> tuple[list[torch.Tensor], ModelRunner]:
        runner = ModelRunner(model, block_size=16, num_blocks=32)
        if not use_graphs:
            runner.graphs = None
        blocks = BlockManager(runner.num_blocks, runner.block_size)
        seqs = [Sequence(token_ids=list(p)) for p in prompts]
        for seq in seqs:
            blocks.allocate(seq)
        batch, out = Batch(seqs, [len(p) for p in prompts]), []
        for step in range(10):
            logits = runner.run(batch).float().cpu()
            out.append(logits)
            for seq, n in zip(seqs, batch.num_tokens, strict=True):
                seq.num_computed += n
                seq.token_ids.append((7 * step + seq.num_computed) % 96)  # same for both runs
                blocks.append_slot(seq)
            batch = Batch(seqs, [1] * len(seqs))
        return out, runner

    eager, _ = decode(False)
    graphed, runner = decode(True)
    assert set(runner.graphs.graphs) == {4}  # 3 sequences: one bucket, captured once
    for e, g in zip(eager, graphed, strict=True):
        torch.testing.assert_close(g, e, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_mixed_graphs_compute_what_eager_steps_compute(arch, tmp_path):
    """Prompt steps, mixed steps (decodes beside a new prompt) and chunks, through the
    mixed-step graphs (attention launched for the whole bucket): the same bits as eager
    steps, padding and all."""
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES[arch]())
    model = LlamaForCausalLM.load(ckpt, device="cuda")
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=rng).tolist() for n in (5, 40, 17, 70)]

    def run(graphs: bool) -> tuple[list[torch.Tensor], ModelRunner]:
        runner = ModelRunner(model, block_size=16, num_blocks=64)
        runner.graphs = None  # decode-only steps eager too: this test is about the others
        if graphs:
            for b in (16, 32, 64):  # the steps' buckets: 9 to 37 tokens
                runner.mixed.capture(b)
        else:
            runner.mixed = None
        blocks = BlockManager(runner.num_blocks, runner.block_size)
        seqs = [Sequence(token_ids=list(p)) for p in prompts]
        for seq in seqs:
            blocks.allocate(seq)
        out = []
        # step 0: the first two prompts; then they decode beside the third prompt, and
        # beside the fourth in chunks of 32
        plan = [[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
        for step, members in enumerate(plan):
            chosen = [seqs[i] for i in members]
            counts = [min(s.num_uncomputed, 32) for s in chosen]
            batch = Batch(chosen, counts)
            logits = runner.run(batch).float().cpu()
            out.append(logits)
            sampled = [batch.samples(i) for i in range(len(chosen))]
            for seq, n, samples in zip(chosen, counts, sampled, strict=True):
                seq.num_computed += n
                if samples:
                    seq.token_ids.append((5 * step + seq.num_computed) % 96)
                    blocks.append_slot(seq)
        return out, runner

    eager, _ = run(False)
    graphed, runner = run(True)
    assert runner.mixed.steps == 5
    for e, g in zip(eager, graphed, strict=True):
        assert torch.equal(g, e)


@pytest.mark.gpu
def test_a_capture_after_real_steps_writes_nothing_to_the_cache(tmp_path):
    """A graph captured in idle time, after steps left their cache slots in the static
    inputs, must not write its warm-up run's K/V there (those blocks may be cached
    prefixes)."""
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES["llama"]())
    model = LlamaForCausalLM.load(ckpt, device="cuda")
    runner = ModelRunner(model, block_size=16, num_blocks=32)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seqs = [Sequence(token_ids=torch.randint(0, 96, (n,)).tolist()) for n in (9, 12)]
    for seq in seqs:
        blocks.allocate(seq)
    runner.mixed.capture(32)
    runner.run(Batch(seqs, [9, 12]))  # through the 32-token mixed graph
    for seq in seqs:
        seq.num_computed = len(seq.token_ids)
        seq.token_ids.append(3)
        blocks.append_slot(seq)
    runner.run(Batch(seqs, [1, 1]))  # through the decode graph of 2
    assert runner.mixed.steps == 1
    k_before, v_before = runner.k_cache.clone(), runner.v_cache.clone()
    runner.mixed.capture(64)
    runner.graphs.capture(4)
    assert torch.equal(runner.k_cache, k_before) and torch.equal(runner.v_cache, v_before)


@pytest.mark.gpu
def test_warm_up_captures_every_bucket_and_writes_nothing_to_the_cache(tmp_path):
    """Warm-up runs fake steps (cache slots -1): it must leave no trace a request could see."""
    _, ckpt = tiny_checkpoint(tmp_path, ARCHES["llama"]())
    model = LlamaForCausalLM.load(ckpt, device="cuda")
    runner = ModelRunner(model, block_size=16, num_blocks=32)
    runner.k_cache.normal_()  # random contents: a stray write would change them
    runner.v_cache.normal_()
    k_before, v_before = runner.k_cache.clone(), runner.v_cache.clone()
    runner.warm_up(max_seqs=6, max_batch_tokens=64)
    assert set(runner.graphs.graphs) == {1, 2, 4, 8}  # 6 sequences pad to the bucket of 8
    assert set(runner.mixed.graphs) == set(MIXED_BUCKETS)
    assert torch.equal(runner.k_cache, k_before) and torch.equal(runner.v_cache, v_before)

    seq = Sequence(token_ids=torch.randint(0, 96, (21,)).tolist())
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    blocks.allocate(seq)
    prefill = runner.run(Batch([seq], [21])).float()
    solo = SoloSequence(ModelRunner(model, block_size=16, num_blocks=32))
    torch.testing.assert_close(prefill[0], solo.extend(seq.token_ids).float())


def test_the_engine_asks_before_each_step_and_not_while_idle(text_model_dir):
    """The hook a GPU instance yields through runs once per step that has work, and its
    delay holds the step back (the output is unchanged)."""
    ckpt = Checkpoint.open(text_model_dir)
    calls: list[float] = []
    eng = Engine(
        LlamaForCausalLM.load(ckpt),
        TextTokenizer(ckpt),
        before_step=lambda: (calls.append(time.monotonic()), time.sleep(0.01)),
    )
    try:
        prompt = eng.tokenizer.encode("1, 2, 3,")
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        steps = run_requests(eng, [prompt], params)[0]
        time.sleep(0.2)  # idle: no more calls
    finally:
        eng.shutdown()
    tokens = [t for s in steps for t in s.token_ids]
    assert len(tokens) == 6
    assert len(calls) == 6  # one prefill step and five decode steps
    assert all(b - a >= 0.01 for a, b in itertools.pairwise(calls))


def test_idle_work_runs_only_between_requests(text_model_dir):
    """Warm-up pieces handed to the engine (the worker serves at once after loading) run
    on the engine thread while no request runs: a request arriving meanwhile is served
    before the rest of them, with the same tokens, and every piece still runs."""
    ckpt = Checkpoint.open(text_model_dir)
    eng = Engine(LlamaForCausalLM.load(ckpt), TextTokenizer(ckpt))
    busy_during_piece: list[bool] = []

    def piece() -> None:
        busy_during_piece.append(eng.scheduler.has_work())
        time.sleep(0.05)

    try:
        prompt = eng.tokenizer.encode("1, 2, 3,")
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        alone = tokens(run_requests(eng, [prompt], params)[0])
        eng.when_idle([piece] * 40)  # 2 s of idle-time work
        during = tokens(run_requests(eng, [prompt], params)[0])
        pieces_before_served = len(busy_during_piece)
        deadline = time.monotonic() + 30
        while eng.stats()["idle_work"] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # the last piece, popped but maybe still running
    finally:
        eng.shutdown()
    assert during == alone
    assert pieces_before_served < 40  # the request did not wait for all of them
    assert len(busy_during_piece) == 40 and not any(busy_during_piece)
