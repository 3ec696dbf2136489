"""Where an engine step's time goes, on the engine_bench checkpoint: a diagnostic for the
engine-speed work, not a benchmark with a target.

- GPU time of one decode step by graph replay, for each --decode shape (batch x context;
  b = 1 and 128 at 512 by default), against the same step's host-side wall time through
  ModelRunner.run (prepare + replay + lm head), with the K/V bytes the step reads;
- the top kernels of each eager decode step and of a 2,048-token prefill, by CUDA time
  (torch.profiler);
- the engine thread's Python profile (cProfile) while it serves 128 requests of 512 in
  / 128 out, with the wall time per step.

Prints tables and writes bench/results/engine-profile-<gpu>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.engine_bench import device_tag, llama3_8b_config, write_checkpoint
from bench.results_io import write_result


def decode_batch(runner, n: int, context: int):
    """A decode step of `n` sequences with `context` tokens cached each."""
    from omni.engine.block_manager import BlockManager
    from omni.engine.scheduler import Batch
    from omni.engine.sequence import Sequence

    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seqs = []
    for i in range(n):
        ids = [(7 * i + j) % 1000 + 1 for j in range(context + 1)]
        seq = Sequence(token_ids=ids, num_prompt_tokens=context)  # the last one generated
        blocks.allocate(seq)
        seq.num_computed = context
        seqs.append(seq)
    return Batch(seqs, [1] * n)


def cuda_ms(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def wall_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def top_kernels(fn, rows: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if cuda_us and e.device_type.name == "CUDA":
            out.append({"kernel": e.key[:90], "calls": e.count, "cuda_us": round(cuda_us, 1)})
    out.sort(key=lambda r: -r["cuda_us"])
    total = sum(r["cuda_us"] for r in out)
    for r in out:
        r["share"] = round(r["cuda_us"] / total, 3) if total else 0
    return out[:rows]


def engine_profile(engine_cls, model, tokenizer, requests: int, prompt: int, out_tokens: int):
    """cProfile of the engine thread while it serves `requests` at once."""
    from omni.engine.engine import GenerationRequest
    from omni.engine.sampling import SamplingParams

    prof = cProfile.Profile()
    steps = [0]

    class Profiled(engine_cls):
        def _run(self) -> None:
            prof.enable()
            try:
                super()._run()
            finally:
                prof.disable()

        def _step(self) -> None:
            steps[0] += 1
            super()._step()

    engine = Profiled(model, tokenizer)
    engine.warm_up()
    done = threading.Semaphore(0)

    def emit(out) -> None:
        if out.finished:
            done.release()

    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i in range(requests):
        ids = [(31 * i + j) % 100_000 + 1 for j in range(prompt)]
        engine.submit(GenerationRequest(ids, params), emit)
    for _ in range(requests):
        done.acquire()
    wall = time.perf_counter() - t0
    engine.shutdown()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return {
        "requests": requests,
        "wall_s": round(wall, 3),
        "steps": steps[0],
        "ms_per_step": round(wall * 1e3 / max(steps[0], 1), 3),
        "out_tok_s": round(requests * out_tokens / wall, 1),
        "cprofile_top_tottime": text.getvalue().splitlines()[:60],
    }


def step_profile(model, shapes: list[tuple[int, int]]) -> dict:
    """Decode steps (graph and eager) of each (batch, context) shape, and a 4 x 512
    prefill."""
    from omni.engine.block_manager import BlockManager
    from omni.engine.model_runner import ModelRunner
    from omni.engine.scheduler import Batch
    from omni.engine.sequence import Sequence

    res: dict = {"decode": {}, "kernels": {}}
    with torch.inference_mode():
        tokens = max(n * (context + 1) for n, context in shapes)
        runner = ModelRunner(model, num_blocks=max(8192, 2 * tokens // 16))
        for n, context in shapes:
            batch = decode_batch(runner, n, context)
            ids, step = runner.prepare(batch)
            runner.graphs.capture(runner.graphs.bucket(n))
            replay = cuda_ms(lambda ids=ids, step=step: runner.graphs.run(ids, step), 50)
            full = wall_ms(lambda batch=batch: runner.run(batch), 50)
            prep = wall_ms(lambda batch=batch: runner.prepare(batch), 50)
            eager = cuda_ms(
                lambda ids=ids, step=step: model.hidden_states(
                    ids, step, runner.k_cache, runner.v_cache
                ),
                10,
            )
            assert step.decode_only
            tag = f"b{n}_ctx{context}"
            cfg = model.cfg
            per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
            kv_bytes = n * context * per_token * runner.k_cache.element_size()
            res["decode"][tag] = {
                "kv_gb": round(kv_bytes / 1e9, 3),
                "graph_replay_ms": round(replay, 3),
                "run_wall_ms": round(full, 3),
                "prepare_wall_ms": round(prep, 3),
                "eager_ms": round(eager, 3),
            }
            res["kernels"][f"decode_{tag}"] = top_kernels(
                lambda ids=ids, step=step: model.hidden_states(
                    ids, step, runner.k_cache, runner.v_cache
                ),
                15,
            )
            print(f"decode {tag}: {res['decode'][tag]}")

        blocks = BlockManager(runner.num_blocks, runner.block_size)
        seqs = []
        for i in range(4):
            seq = Sequence(token_ids=[(13 * i + j) % 1000 + 1 for j in range(512)])
            blocks.allocate(seq)
            seqs.append(seq)
        prefill = Batch(seqs, [512] * 4)
        res["prefill_2048_ms"] = round(wall_ms(lambda: runner.run(prefill), 5), 3)
        res["kernels"]["prefill_2048"] = top_kernels(lambda: runner.run(prefill), 15)
        print(f"prefill 4x512: {res['prefill_2048_ms']} ms")
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ckpt-root", default="/tmp/omni-engine-bench")
    parser.add_argument(
        "--decode",
        type=lambda s: [tuple(int(v) for v in pair.split("x")) for pair in s.split(",")],
        default=[(1, 512), (128, 512)],
        help="decode shapes, BATCHxCONTEXT, comma-separated",
    )
    parser.add_argument("--name", help="result file bench/results/<name>.json")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine's cProfile")
    parser.add_argument("--quantization", choices=["fp8"], help="the model's projections in FP8")
    parser.add_argument("--kv-cache-dtype", choices=["fp8"], help="the KV cache in e4m3")
    args = parser.parse_args()
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.engine import Engine
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.tokenizer import TextTokenizer

    path, _ = write_checkpoint(Path(args.ckpt_root), llama3_8b_config(False), 4, 0)
    ckpt = Checkpoint.open(path)
    model = LlamaForCausalLM.load(
        ckpt, "cuda", torch.bfloat16, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    res = step_profile(model, args.decode)
    torch.cuda.empty_cache()
    if not args.no_engine:
        res["engine"] = engine_profile(Engine, model, TextTokenizer(ckpt), 128, 512, 128)
    for name, rows in res["kernels"].items():
        print(f"\n{name}")
        for r in rows:
            print(f"  {r['cuda_us']:>10.1f} us {r['share']:>6.1%} x{r['calls']:<4} {r['kernel']}")
    if eng := res.get("engine"):
        print(
            f"\nengine: {eng['requests']} x 512/128: {eng['wall_s']} s, {eng['steps']} steps, "
            f"{eng['ms_per_step']} ms/step, {eng['out_tok_s']} out tok/s"
        )
        print("\n".join(eng["cprofile_top_tottime"]))
    name = args.name or f"engine-profile-{device_tag()}"
    write_result(name, res)


if __name__ == "__main__":
    main()
