"""The CPU engine's KV cache takes memory as requests write it: an engine starts without
touching its pool (1 GiB by default), and what requests write there reads back right."""

from __future__ import annotations

import psutil
import torch
import transformers

from omni.engine.checkpoint import Checkpoint
from omni.engine.engine import Engine
from omni.engine.llama import LlamaForCausalLM
from omni.engine.sampling import SamplingParams
from omni.engine.tokenizer import TextTokenizer
from omni.testing.checkpoints import tiny_llama
from omni.testing.runs import run_requests, tokens

POOL = 1 << 30


def test_a_cpu_engine_takes_cache_memory_as_requests_write_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_KV_CACHE_BYTES", str(POOL))
    path = tiny_llama(tmp_path / "m")
    ckpt = Checkpoint.open(path)
    model = LlamaForCausalLM.load(ckpt)
    me = psutil.Process()
    before = me.memory_info().rss
    engine = Engine(model, TextTokenizer(ckpt))
    try:
        started = me.memory_info().rss - before
        pool = engine.runner.k_cache.nbytes + engine.runner.v_cache.nbytes
        assert pool > POOL * 0.9
        assert started < 64 << 20, f"{started >> 20} MiB taken at start"

        prompts = [[1 + (i * 7 + j) % 90 for j in range(20 + 9 * i)] for i in range(4)]
        greedy = SamplingParams(max_tokens=24, temperature=0.0)
        got = [tokens(s) for s in run_requests(engine, prompts, greedy)]
        assert me.memory_info().rss - before < 64 << 20  # four short requests: a few blocks
    finally:
        engine.shutdown()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, got, strict=True):
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert out == ids[0, len(prompt) :].tolist()
