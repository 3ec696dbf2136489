"""Cold start of the engine, as a serving process sees it: process start to first token.

Run by bench/engine_bench.py in a fresh process with OMNI_BENCH_T0 set to the time
it was spawned. Imports only what an instance imports (not the benchmark's own
tools), so the import figure is the engine's. Marks are seconds since the spawn;
the first request runs before any warm-up (graphs are captured lazily), then the
full warm-up, then a full batch's first tokens.

    python bench/coldstart_probe.py CKPT OUT.json [--batch 128 --prompt 512]
"""

from __future__ import annotations

import time

SPAWNED_TO_STARTED = time.time()  # before any import: "python started"

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--first-prompt", type=int, default=128)
    args = parser.parse_args()
    t0 = float(os.environ.get("OMNI_BENCH_T0", SPAWNED_TO_STARTED))
    marks = {"python_started": SPAWNED_TO_STARTED - t0}

    def mark(name: str) -> None:
        marks[name] = round(time.time() - t0, 3)
        print(f"[coldstart] {name}: {marks[name]:.2f}s", flush=True)

    import torch

    mark("torch_imported")
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.engine import Engine, GenerationRequest
    from omni.engine.kernels.prewarm import prewarm_triton
    from omni.engine.llama import LlamaConfig, LlamaForCausalLM, fused_groups
    from omni.engine.sampling import SamplingParams
    from omni.engine.tokenizer import TextTokenizer

    mark("engine_imported")
    device, dtype = (
        ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    )
    # LlamaForCausalLM.load, in marks: Triton's set-up in a thread while CUDA starts and
    # the tensors are read, joined once the weights are in
    warming = prewarm_triton() if device == "cuda" else None
    if device == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    mark("device_ready")
    ckpt = Checkpoint.open(args.ckpt)
    cfg = LlamaConfig.from_checkpoint(ckpt)
    tensors = ckpt.load_tensors(device, dtype, together=fused_groups(cfg))
    if device == "cuda":
        torch.cuda.synchronize()
    mark("tensors_read")
    model = LlamaForCausalLM.from_state(cfg, tensors, ckpt.path)
    if device == "cuda":
        torch.cuda.synchronize()
        warming.join()
    mark("weights_loaded")
    engine = Engine(model, TextTokenizer(ckpt))
    mark("engine_built")
    vocab = model.cfg.vocab_size
    rng = random.Random(5)

    def generate(n_requests: int, prompt: int) -> None:
        done: queue.Queue[str | None] = queue.Queue()
        for _ in range(n_requests):
            ids = [rng.randrange(vocab) for _ in range(prompt)]
            params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

            def emit(out, done=done) -> None:
                if out.finished:
                    done.put(out.error)

            engine.submit(GenerationRequest(ids, params), emit)
        for _ in range(n_requests):
            error = done.get(timeout=600)
            if error:
                raise RuntimeError(error)

    try:
        generate(1, args.first_prompt)
        mark("first_token")
        engine.warm_up(graphs=True)
        mark("ready_full_batch")
        generate(args.batch, args.prompt)
        mark("full_batch_first_tokens")
    finally:
        engine.shutdown()
    with open(args.out, "w") as f:
        json.dump(
            {
                "cold_start_s": marks,
                "full_batch": {"requests": args.batch, "prompt_tokens": args.prompt},
                "first_prompt_tokens": args.first_prompt,
                "pycache_prefix": sys.pycache_prefix,
                "dont_write_bytecode": bool(sys.flags.dont_write_bytecode),
            },
            f,
        )


if __name__ == "__main__":
    main()
