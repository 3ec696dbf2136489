"""DeepSeek-V3's multi-token-prediction layer as a speculative proposer (deepseek_mtp.py),
on the CPU: the head's logits against HF transformers running the same layer (a one-layer
DeepseekV3 fed the paper's projected inputs), each proposal's first token against that
reference at its position, greedy outputs unchanged by speculation, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from omni.engine.block_manager import BlockManager
from omni.engine.checkpoint import Checkpoint, CheckpointError
from omni.engine.deepseek_mtp import load_mtp
from omni.engine.deepseek_v3 import DeepseekV3ForCausalLM, QuantizedExperts
from omni.engine.eagle3 import HiddenTaps
from omni.engine.engine import Engine
from omni.engine.model_runner import ModelRunner
from omni.engine.proposers import FeatureProposer, load_draft
from omni.engine.sampling import SamplingParams
from omni.engine.scheduler import Batch
from omni.engine.sequence import Sequence
from omni.engine.spec_config import SpecConfig
from omni.engine.tokenizer import TextTokenizer
from omni.testing.checkpoints import save_word_level_tokenizer
from omni.testing.runs import run_requests, tokens

from .test_deepseek_v3 import VOCAB, deepseek_config, randomize

LAYERS = 3  # deepseek_config's; the MTP layer is index 3
MTP = f"model.layers.{LAYERS}."


def mtp_tensors(seed: int) -> dict[str, torch.Tensor]:
    """A random MTP layer as DeepSeek-V3's checkpoints store it (HF names): an MoE
    decoder layer's tensors, enorm, hnorm, eh_proj, shared_head.norm, and the copies of
    the embedding and output head (which the loader does not read)."""
    torch.manual_seed(seed)
    four = transformers.AutoModelForCausalLM.from_config(
        deepseek_config(24, num_hidden_layers=LAYERS + 1), dtype=torch.float32
    )
    randomize(four)
    state = {k: v for k, v in four.state_dict().items() if k.startswith(MTP)}
    gen = torch.Generator().manual_seed(seed)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        state[f"{MTP}{name}.weight"] = 1 + 0.2 * torch.randn(64, generator=gen)
    state[f"{MTP}eh_proj.weight"] = 0.15 * torch.randn(64, 128, generator=gen)
    state[f"{MTP}embed_tokens.weight"] = torch.zeros(VOCAB, 64)  # never read
    state[f"{MTP}shared_head.head.weight"] = torch.zeros(VOCAB, 64)
    return state


def as_stored(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's in-memory expert stacks as checkpoints store them: a tensor per expert."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint with one MTP layer (num_nextn_predict_layers 1)."""
    directory = tmp_path_factory.mktemp("mtp")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(deepseek_config(24), dtype=torch.float32)
    randomize(hf)
    hf.save_pretrained(directory)
    save_word_level_tokenizer(directory / "tokenizer.json", VOCAB)
    files = sorted(directory.glob("*.safetensors"))
    state = load_file(str(files[0]))
    extra = mtp_tensors(1)
    save_file({**state, **as_stored(extra)}, str(files[0]))
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    return Checkpoint.open(directory), extra


def last_hidden(model: DeepseekV3ForCausalLM, ids: list[int]) -> torch.Tensor:
    """The model's hidden state its output head reads (after the final norm) at each of
    `ids`: HF's last hidden states."""
    taps = HiddenTaps((LAYERS,), model.cfg.hidden_size, torch.float32, torch.device("cpu"))
    taps.fit(len(ids))
    model.taps = taps
    runner = ModelRunner(model, block_size=8, num_blocks=16)
    seq = Sequence(token_ids=list(ids))
    BlockManager(runner.num_blocks, runner.block_size).allocate(seq)
    runner.run(Batch([seq], [len(ids)]))
    model.taps = None
    return taps.buffer[: len(ids)].clone()


def hf_mtp_logits(extra: dict, model: DeepseekV3ForCausalLM, ids: list[int]) -> torch.Tensor:
    """The paper's MTP at positions 0..n-2 of `ids` through HF transformers: a one-layer
    DeepseekV3 holding the MTP layer, fed eh_proj([enorm(embed(token t + 1)); hnorm(h_t)])
    as its input embeddings, with the MTP's final norm and the model's output head."""
    h = last_hidden(model, ids)[:-1]
    emb = model.model.embed_tokens.weight[torch.tensor(ids[1:])]

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    e, hidden = norm(emb, extra[f"{MTP}enorm.weight"]), norm(h, extra[f"{MTP}hnorm.weight"])
    x = torch.cat([e, hidden], -1) @ extra[f"{MTP}eh_proj.weight"].T
    one = transformers.AutoModelForCausalLM.from_config(
        deepseek_config(24, num_hidden_layers=1, first_k_dense_replace=0), dtype=torch.float32
    )
    state = {k.replace(MTP, "model.layers.0."): v for k, v in extra.items()}
    state["model.norm.weight"] = state.pop("model.layers.0.shared_head.norm.weight")
    state["lm_head.weight"] = model.lm_head.weight
    state["model.embed_tokens.weight"] = model.model.embed_tokens.weight
    for name in ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head.head"):
        state.pop(f"model.layers.0.{name}.weight")
    missing, unexpected = one.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        return one(inputs_embeds=x[None]).logits[0]


def test_the_mtp_head_computes_the_papers_layer_as_hf_runs_it(with_mtp):
    """The feature the model leaves in its taps is HF's last hidden state; the head's
    logits over a whole sequence at once are HF's run of the MTP layer."""
    ckpt, extra = with_mtp
    model = DeepseekV3ForCausalLM.load(ckpt)
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    with torch.no_grad():
        hf_last = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(last_hidden(model, ids), hf_last, atol=1e-4, rtol=1e-4)
    want = hf_mtp_logits(extra, model, ids)
    head, _ = load_mtp(model, ckpt.path)
    head.static_rows(32)
    head.features = last_hidden(model, ids)[:-1]
    runner = ModelRunner(head, block_size=8, num_blocks=16)
    seq = Sequence(token_ids=ids[1:])
    BlockManager(runner.num_blocks, runner.block_size).allocate(seq)
    got = runner.run(Batch([seq], [len(seq.token_ids)]), all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_each_proposal_starts_with_the_references_pick_and_greedy_outputs_keep(
    with_mtp, monkeypatch
):
    """Through the engine: each proposal's first token is the reference MTP's pick at the
    sequence's newest computed position (the model's feature there, the newest token's
    embedding), over prompt, catch-up and verify steps; the greedy tokens are plain
    decoding's."""
    ckpt, extra = with_mtp
    model = DeepseekV3ForCausalLM.load(ckpt)
    spec = SpecConfig(method="mtp", k=3)
    proposals = []
    propose = FeatureProposer.propose

    def recorded(self, seqs, ks):
        out = propose(self, seqs, ks)
        proposals.extend((list(s.token_ids), p) for s, p in zip(seqs, out, strict=True) if p)
        return out

    monkeypatch.setattr(FeatureProposer, "propose", recorded)
    rng = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=rng).tolist() for n in (9, 17)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = Engine(model, TextTokenizer(ckpt), block_size=8, num_blocks=64)
    try:
        want = [tokens(s) for s in run_requests(plain, prompts, params)]
    finally:
        plain.shutdown()
    draft = load_draft(spec, model, ckpt.path)
    speculating = Engine(
        model, TextTokenizer(ckpt), block_size=8, num_blocks=64, speculative=spec, draft=draft
    )
    try:
        got = [tokens(s) for s in run_requests(speculating, prompts, params)]
        stats = speculating.stats()
    finally:
        speculating.shutdown()
    assert got == want
    assert stats["spec_steps"] > 0 and proposals, stats
    model.taps = None
    for prompt, out in zip(prompts, got, strict=True):
        full = prompt + out
        reference = hf_mtp_logits(extra, model, full).argmax(-1)
        mine = [(seq, p) for seq, p in proposals if full[: len(seq)] == seq]
        assert mine
        for seq, p in mine:  # the head read h_{n-2} and token n-1 for token n
            assert p[0] == int(reference[len(seq) - 2]), (len(seq), p)


def test_models_without_an_mtp_layer_are_refused(tmp_path, with_mtp):
    ckpt, _ = with_mtp
    config = json.loads((ckpt.path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in ckpt.path.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    model = DeepseekV3ForCausalLM.load(ckpt)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        load_mtp(model, tmp_path)
    with pytest.raises(CheckpointError, match="DeepSeek-V3"):
        load_mtp(object(), ckpt.path)
    with pytest.raises(ValueError, match="own checkpoint"):
        SpecConfig(method="mtp", path="/somewhere")


@pytest.mark.gpu
def test_on_the_gpu_mtp_speculation_under_cuda_graphs_keeps_the_eager_tokens(with_mtp):
    """bf16 on the GPU, both the model's and the MTP head's decode steps replayed from
    CUDA graphs: each request's greedy tokens are the model's own run eagerly, prompt by
    prompt, but where that run's top two were nearly tied (a verify step's rows split
    MLA's work otherwise than a decode row's)."""
    from .test_deepseek_v3_gpu import assert_follows_eager

    ckpt, _ = with_mtp
    model = DeepseekV3ForCausalLM.load(ckpt, "cuda", torch.bfloat16)
    spec = SpecConfig(method="mtp", k=3)
    draft = load_draft(spec, model, ckpt.path)
    engine = Engine(
        model, TextTokenizer(ckpt), block_size=8, num_blocks=96, speculative=spec, draft=draft
    )
    engine.warm_up(graphs=True)
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=rng).tolist() for n in (7, 31, 18)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        results = run_requests(engine, prompts, params)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats["spec_steps"] > 0, stats
    for prompt, steps in zip(prompts, results, strict=True):
        assert_follows_eager(model, prompt, tokens(steps))


def test_an_fp8_checkpoints_mtp_layer_loads_as_its_dequantized_twin(tmp_path, with_mtp):
    """Every projection of the model and of its MTP layer stored in block FP8 (as
    DeepSeek-V3 ships them): the head's logits are those of the same checkpoint with
    those weights dequantized."""
    from .test_quant_weights import FP8_CONFIG, dequantize_fp8, quantize_fp8

    ckpt, _ = with_mtp
    state = load_file(str(sorted(ckpt.path.glob("*.safetensors"))[0]))
    quantized, dense = dict(state), dict(state)
    for name in [n for n in state if n.endswith(("_proj.weight", "_mqa.weight"))]:
        q, s = quantize_fp8(state[name])
        quantized[name], quantized[name.removesuffix("weight") + "weight_scale_inv"] = q, s
        dense[name] = dequantize_fp8(q, s)
    heads = []
    for form, tensors in (("fp8", quantized), ("dense", dense)):
        directory = tmp_path / form
        directory.mkdir()
        config = json.loads((ckpt.path / "config.json").read_text())
        if form == "fp8":
            config["quantization_config"] = FP8_CONFIG
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "tokenizer.json").symlink_to(ckpt.path / "tokenizer.json")
        save_file(tensors, str(directory / "model.safetensors"))
        model = DeepseekV3ForCausalLM.load(Checkpoint.open(directory))
        head, _ = load_mtp(model, directory)
        assert isinstance(head.layer.mlp.experts, QuantizedExperts) == (form == "fp8")
        head.static_rows(32)
        ids = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(6)).tolist()
        head.features = last_hidden(model, ids)[:-1]
        runner = ModelRunner(head, block_size=8, num_blocks=16)
        seq = Sequence(token_ids=ids[1:])
        BlockManager(runner.num_blocks, runner.block_size).allocate(seq)
        heads.append(runner.run(Batch([seq], [len(seq.token_ids)]), all_logits=True))
    torch.testing.assert_close(heads[0], heads[1], atol=1e-5, rtol=1e-5)
