"""Can a decode step overlap its memory-bound attention with its compute-bound projections?

One Llama-3-8B layer's decode attention (bf16 cache, 450 tokens a sequence) and its four
projections (our Triton linear), each timed alone, back to back, on two plain streams,
and on green contexts (torch.cuda.green_contexts) that split the SMs between them; and
each alone on 16-128 SMs. All as CUDA-graph replays. A diagnostic for issue 22's "two
nano-batches on two streams", not a benchmark with a target. Prints tables and writes
bench/results/overlap-<gpu>.json.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from bench.engine_bench import device_tag  # noqa: E402
from bench.results_io import write_result  # noqa: E402
from omni.engine.kernels.attention import paged_decode  # noqa: E402
from omni.engine.kernels.matmul import linear  # noqa: E402

HIDDEN, N_Q, N_KV, DIM, INTER, PAGE, CONTEXT = 4096, 32, 8, 128, 14336, 16, 450
ROWS = (128, 200, 256)
SPLITS = ((96, 32), (104, 24), (64, 64))  # (SMs for the projections, SMs for attention)
ALONE_SMS = (16, 32, 48, 64, 80, 96, 112, 128)
Work = Callable[[], None]


def layer_work(rows: int, weights: dict[str, torch.Tensor]) -> tuple[Work, Work]:
    """(attention, projections) of one layer for `rows` sequences, on fresh random inputs."""
    pages = rows * -(-CONTEXT // PAGE)
    k = torch.randn(pages, PAGE, N_KV, DIM, device="cuda").bfloat16()
    v = torch.randn(pages, PAGE, N_KV, DIM, device="cuda").bfloat16()
    table = torch.randperm(pages, device="cuda").int().view(rows, -1)
    lens = torch.full((rows,), CONTEXT, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, N_Q, DIM, device="cuda").bfloat16()
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    x_inter = torch.randn(rows, INTER, device="cuda").bfloat16()
    out = torch.empty_like(q)

    def attention() -> None:
        paged_decode(q, k, v, table, lens, DIM**-0.5, out=out)

    def projections() -> None:
        for name in ("qkv", "o", "gate_up"):
            linear(x, weights[name])
        linear(x_inter, weights["down"])

    return attention, projections


def graph_us(work: Work) -> float:
    """A CUDA graph of `work`, its replay's median time in us."""
    work()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=300) * 1000


def on_streams(parts: list[tuple[torch.cuda.Stream, Work]]) -> Work:
    """Each part on its stream, forked from and joined back to the current one."""

    def work() -> None:
        current = torch.cuda.current_stream()
        for stream, _ in parts:
            stream.wait_stream(current)
        for stream, part in parts:
            with torch.cuda.stream(stream):
                part()
        for stream, _ in parts:
            current.wait_stream(stream)

    return work


GREEN_CONTEXTS = []  # alive for the run: a context's streams die with it


def green_stream(sms: int) -> torch.cuda.Stream:
    """A stream whose kernels run on `sms` SMs only."""
    context = torch.cuda.green_contexts.GreenContext.create(sms, 0)
    GREEN_CONTEXTS.append(context)
    s = context.Stream()
    return torch.cuda.Stream(
        stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type
    )


def main() -> None:
    torch.manual_seed(0)
    shapes = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN)}
    shapes["down"] = (HIDDEN, INTER)
    weights = {n: (torch.randn(s, device="cuda") * 0.02).bfloat16() for n, s in shapes.items()}
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    streams = []
    print(f"{'rows':>5}{'attention':>11}{'projections':>13}{'back to back':>14}{'2 streams':>11}")
    for rows in ROWS:
        attention, projections = layer_work(rows, weights)
        row = {
            "rows": rows,
            "attention_us": graph_us(attention),
            "projections_us": graph_us(projections),
            "back_to_back_us": graph_us(lambda a=attention, p=projections: (a(), p())),
            "two_streams_us": graph_us(on_streams([(side, projections), (other, attention)])),
        }
        streams.append(row)
        print(
            f"{rows:>5}{row['attention_us']:>11.1f}{row['projections_us']:>13.1f}"
            f"{row['back_to_back_us']:>14.1f}{row['two_streams_us']:>11.1f}"
        )
    attention, projections = layer_work(200, weights)
    splits = []
    print(
        f"\n200 rows on green contexts: {'SMs':>8}{'projections':>13}{'attention':>11}"
        f"{'together':>10}"
    )
    for lin_sms, att_sms in SPLITS:
        lin_stream, att_stream = green_stream(lin_sms), green_stream(att_sms)
        row = {
            "projection_sms": lin_sms,
            "attention_sms": att_sms,
            "projections_us": graph_us(on_streams([(lin_stream, projections)])),
            "attention_us": graph_us(on_streams([(att_stream, attention)])),
            "together_us": graph_us(
                on_streams([(lin_stream, projections), (att_stream, attention)])
            ),
        }
        splits.append(row)
        print(
            f"{'':28}{lin_sms:>4}+{att_sms:<3}{row['projections_us']:>13.1f}"
            f"{row['attention_us']:>11.1f}{row['together_us']:>10.1f}"
        )
    alone = []
    print(f"\n200 rows alone on n SMs: {'SMs':>5}{'attention':>11}{'projections':>13}")
    for sms in ALONE_SMS:
        stream = green_stream(sms)
        row = {
            "sms": sms,
            "attention_us": graph_us(on_streams([(stream, attention)])),
            "projections_us": graph_us(on_streams([(stream, projections)])),
        }
        alone.append(row)
        print(f"{'':25}{sms:>4}{row['attention_us']:>11.1f}{row['projections_us']:>13.1f}")
    config = {"hidden": HIDDEN, "q_heads": N_Q, "kv_heads": N_KV, "head_dim": DIM}
    config |= {"intermediate": INTER, "context": CONTEXT, "page": PAGE}
    data = {"config": config, "streams": streams, "green_splits": splits, "alone_on_sms": alone}
    print(f"wrote {write_result(f'overlap-{device_tag()}', data)}")


if __name__ == "__main__":
    main()
