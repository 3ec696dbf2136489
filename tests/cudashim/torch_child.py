"""Runs inside a process under libomnicuda on a real GPU; prints one JSON report.

python torch_child.py SCENARIO QUOTA_BYTES, with the shim's environment set.
Scenarios wait for a line on stdin where the parent must act (swap).
"""

from __future__ import annotations

import json
import sys

import torch

MiB = 1 << 20


def report(**kw) -> None:
    print(json.dumps(kw), flush=True)


def tiny_llama_logits(seed: int = 0) -> torch.Tensor:
    from omni.engine.llama import LlamaConfig, LlamaForCausalLM, rope_inv_freq

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position=512,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.inv_freq = rope_inv_freq(cfg)
    from omni.engine.model_runner import ModelRunner, SoloSequence

    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref = SoloSequence(ModelRunner(model, num_blocks=8)).extend(ids, all_logits=True)
    model = model.cuda()
    model.inv_freq = model.inv_freq.cuda()
    out = SoloSequence(ModelRunner(model, num_blocks=8)).extend(ids, all_logits=True).cpu()
    return (out - ref).abs().max()


def compute() -> dict:
    torch.manual_seed(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    gemm_err = ((a.cuda() @ b.cuda()).cpu() - a @ b).abs().max().item()
    return {"gemm_err": gemm_err, "llama_err": tiny_llama_logits().item()}


def scenario_basics(quota: int) -> None:
    free, total = torch.cuda.mem_get_info()
    result = compute()
    x = torch.empty(quota // 4, dtype=torch.uint8, device="cuda")  # within the quota
    free_with_x, _ = torch.cuda.mem_get_info()
    try:
        torch.empty(quota, dtype=torch.uint8, device="cuda")
        oom = None
    except torch.cuda.OutOfMemoryError as exc:
        oom = type(exc).__name__
    del x
    torch.cuda.empty_cache()
    y = torch.ones(quota // 2, dtype=torch.uint8, device="cuda")  # works again after freeing
    after_oom_ok = int(y[:4096].sum().item()) == 4096
    import pynvml

    pynvml.nvmlInit()
    nvml_total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
    report(
        free=free,
        total=total,
        free_with_x=free_with_x,
        oom=oom,
        after_oom_ok=after_oom_ok,
        nvml_total=nvml_total,
        **result,
    )


def timed_read(w: torch.Tensor) -> float:
    """Seconds for the GPU to read all of `w` (faults it in if it is on the host)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    w.sum()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def scenario_swap(quota: int) -> None:
    torch.manual_seed(2)
    w = torch.randn(quota // 2 // 4, device="cuda")  # half the quota, in float32
    checksum = w.sum().item()  # in place: a float64 copy would not fit the quota
    from omni.cudashim.read_only import declare_read_only

    ro = torch.randn(quota // 8 // 4, device="cuda")  # weights: their host copy is kept
    declared = declare_read_only([ro])
    timed_read(w)
    report(
        ready=True, bytes=w.numel() * 4, checksum=checksum, declared=declared, ro=ro.sum().item()
    )
    sys.stdin.readline()  # the parent has swapped out and in again
    resident = timed_read(w)
    checksum = w.sum().item()
    w[: w.numel() // 3].mul_(2)  # pages written since the last move in: no host copy yet
    report(checksum=checksum, written=w.sum().item(), read_resident_s=resident, **compute())
    sys.stdin.readline()  # the parent has swapped out and in again
    report(checksum=w.sum().item(), ro=ro.sum().item())
    sys.stdin.readline()  # the parent has swapped out once more
    report(read_swapped_s=timed_read(w))


def scenario_engine(quota: int) -> None:
    """An engine whose KV cache is the shim's pool (omni/cudashim/kv_pool.py)."""
    import tempfile
    from pathlib import Path

    from omni.engine.engine import Engine
    from omni.engine.sampling import SamplingParams
    from omni.testing.checkpoints import small_random_llama
    from omni.testing.runs import run_requests, tokens

    model, tokenizer = small_random_llama(Path(tempfile.mkdtemp()))
    engine = Engine(model, tokenizer)
    prompts = [list(range(i, i + 40)) for i in (1, 500)]  # two full blocks each, and some
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run() -> dict:
        steps = run_requests(engine, prompts, params)
        return {
            "tokens": [tokens(s) for s in steps],
            "cached": [s[-1].cached_tokens for s in steps],
        }

    pool = engine.runner.kv_pool
    cache = engine.runner.k_cache
    report(
        pool=pool is not None,
        pool_bytes=2 * cache.numel() * cache.element_size(),
        first=run(),
        again=run(),
    )
    sys.stdin.readline()  # the parent has swapped out and in again
    after = run()
    report(after=after, epoch=pool.epoch() if pool else None, again=run())
    engine.shutdown()


def scenario_handler(quota: int) -> None:
    """A handler's model (an image classifier, ViT-base's widths) whose worker declared its
    weights read-only, as python_backend.py does after load(), and trims its allocator's
    cache when omnid asks before a swap-out (trim.py)."""
    import io
    import tempfile
    from pathlib import Path

    import numpy as np
    from PIL import Image
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    from omni.instance.python_backend import declare_weights
    from omni.instance.trim import free_cached
    from omni.runtimes.image_classifier import ImageClassifier

    out = Path(tempfile.mkdtemp())
    # ViT-base's widths and image size, four layers: a batch of 16 has activations of over
    # 10 MiB (fp32), which PyTorch's allocator gives segments of their own, left in its
    # cache once freed
    config = ViTConfig(num_hidden_layers=4, num_labels=10)
    torch.manual_seed(0)
    ViTForImageClassification(config).save_pretrained(out)
    ViTImageProcessor().save_pretrained(out)
    handler = ImageClassifier()
    handler.load(out, "cuda")
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(
        png, "PNG"
    )
    image = np.empty(1, dtype=object)
    image[0] = png.getvalue()

    def scores() -> list[list[float]]:
        answers = handler.infer([{"image": image}] * 16)
        return [answer["scores"].tolist() for answer in answers]

    weights = [*handler.model.parameters(), *handler.model.buffers()]
    report(
        declared=declare_weights(handler, "cuda"),
        weight_bytes=sum(t.numel() * t.element_size() for t in weights),
        scores=scores(),
    )
    sys.stdin.readline()  # the parent has read the shim's count
    report(freed=free_cached("cuda"))
    sys.stdin.readline()  # the parent has swapped out and in again
    report(scores=scores())


if __name__ == "__main__":
    scenarios = {
        "basics": scenario_basics,
        "swap": scenario_swap,
        "engine": scenario_engine,
        "handler": scenario_handler,
    }
    scenarios[sys.argv[1]](int(sys.argv[2]))
