"""engine_bench's bytes floor and its Triton-build counter: the figures a closing note
leans on when it says a throughput target is out of reach."""

from __future__ import annotations

import pytest
import triton

from bench.engine_bench import JitBuilds, Req, offline_floor, workload


def test_workload_counts_each_decode_steps_context():
    reqs = [Req([1, 2, 3], 4), Req([1] * 5, 1)]
    # the 3-token prompt's steps for tokens 2..4 read 4, 5 and 6 tokens of K/V; the other
    # request's only token comes from its prompt's step, which reads no decode K/V
    assert workload(reqs) == {
        "max_output": 4,
        "decode_kv_token_reads": 4 + 5 + 6,
        "prompt_tokens": 3 + 5,
        "prompt_attention_pairs": 6 + 15,  # causal: 1 + 2 + 3, and 1 + ... + 5
    }


def prep(bandwidth: float, device: str = "cpu") -> dict:
    cfg = {
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "intermediate_size": 16,
    }  # head_dim 4: K and V of a token are 2 layers x 2 heads x 4 x 2 bytes x 2 = 64 bytes
    return {
        "bandwidth": {"bytes_per_s": bandwidth, "device": device},
        "checkpoint": {"weight_bytes": {"read_per_decode_step": 100}, "config": cfg},
    }


def test_offline_floor_adds_weight_and_kv_reads_at_the_measured_bandwidth():
    work = {"max_output": 4, "decode_kv_token_reads": 15}
    floor = offline_floor(work, prep(1000.0), output_tokens=17)
    assert floor["weights_s"] == pytest.approx(0.4)  # 4 steps x 100 bytes
    assert floor["kv_s"] == pytest.approx(0.96)  # 15 tokens x 64 bytes
    assert floor["floor_s"] == pytest.approx(1.36)
    assert floor["ceiling_output_tok_s"] == pytest.approx(17 / 1.36, rel=1e-3)


def test_the_floor_with_prompts_adds_their_flops_at_the_devices_peak():
    """A layer of hidden 8, K and V 8 wide each, intermediate 16: q/k/v/o 8 x 32 = 256 and
    the MLP 3 x 8 x 16 = 384 weights, 2 FLOPs each per prompt token, over 2 layers;
    attention 4 FLOPs per (query, key) pair per hidden unit and layer."""
    work = {
        "max_output": 4,
        "decode_kv_token_reads": 15,
        "prompt_tokens": 10,
        "prompt_attention_pairs": 30,
    }
    flops = 2 * 2 * 640 * 10 + 4 * 2 * 8 * 30
    floor = offline_floor(work, prep(1000.0, "NVIDIA H100 80GB HBM3"), 17, wall_s=2.72)
    assert floor["prompt_flops"] == flops
    assert floor["prompt_s_at_peak"] == pytest.approx(flops / 989.4e12, abs=1e-3)
    assert floor["floor_with_prompts_s"] == pytest.approx(1.36, abs=1e-3)
    assert floor["ours_fraction_of_floor"] == pytest.approx(0.5)
    unknown = offline_floor(work, prep(1000.0, "cpu"), 17, wall_s=2.72)
    assert "prompt_flops" not in unknown and "ours_fraction_of_floor_with_prompts" not in unknown


def test_offline_floor_needs_every_input():
    work = {"max_output": 4, "decode_kv_token_reads": 15}
    assert offline_floor(None, prep(1000.0), 17) is None
    assert offline_floor(work, prep(0.0), 17) is None
    assert offline_floor(work, {}, 17) is None


def test_jit_builds_counts_the_builds_inside_it(monkeypatch):
    knobs = triton.knobs.runtime
    monkeypatch.setattr(knobs, "jit_cache_hook", None)  # restored after the test
    monkeypatch.setattr(knobs, "jit_post_compile_hook", None)

    class Fn:
        name = "_linear_kernel"

    def build(key: str, variant: str) -> None:  # as Triton calls the hooks around one
        assert knobs.jit_cache_hook(key=key, repr=variant, fn=Fn()) is False
        assert knobs.jit_post_compile_hook(key=key, repr=variant, fn=Fn()) is False

    with JitBuilds() as jit:
        build("a", "_linear_kernel[...](M: i32)")
    build("b", "outside")  # after the block: not its build
    got = jit.result()
    assert got["hooked"] and got["count"] == 1
    assert got["kernels"] == {"_linear_kernel": 1}
    assert got["variants"] == ["_linear_kernel[...](M: i32)"]
