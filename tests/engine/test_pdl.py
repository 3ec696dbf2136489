"""Programmatic dependent launch: kernels let in early still read what the kernel before
them wrote, under a CUDA graph as the engine runs them."""

from __future__ import annotations

import pytest
import torch

from omni.engine.kernels import linear, paged_decode, rms_norm
from omni.engine.kernels import pdl as pdl_module
from omni.engine.kernels.pdl import pdl_options


def test_pdl_is_off_where_there_is_no_hopper_gpu(monkeypatch):
    assert pdl_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl_module, "PDL_ENABLED", False)
    assert pdl_options(torch.device("cuda", 0)) == {"PDL": False}


def chain(x, weights, norm_weight, cache, tables, lens):
    """Each kernel reads the one before's output: norm, linear, decode attention over a
    cache the chain does not write, norm with a residual, linear; 12 times."""
    residual = x
    for w in weights:
        h, residual = rms_norm(x, norm_weight, 1e-6, residual)
        q = linear(h, w).view(x.shape[0], 8, 64)
        a = paged_decode(q, cache, cache, tables, lens, 0.125).reshape(x.shape[0], -1)
        x = linear(rms_norm(a, norm_weight, 1e-6)[0], w)
    return x + residual


@pytest.mark.gpu
def test_a_graph_of_dependent_launches_reads_fresh_inputs(monkeypatch):
    """Replayed with new inputs each time (so a kernel that ran ahead of its input would
    read the last replay's values): the bits of the same chain launched plainly."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    gen = torch.Generator(device="cuda").manual_seed(3)
    dev, dt = "cuda", torch.bfloat16
    weights = [(torch.randn(512, 512, generator=gen, device=dev) / 23).to(dt) for _ in range(12)]
    norm_weight = torch.rand(512, generator=gen, device=dev).to(dt) + 0.5
    cache = torch.randn(40, 16, 8, 64, generator=gen, device=dev).to(dt)  # 8 heads: MHA
    tables = torch.arange(40, device=dev, dtype=torch.int32).view(4, 10)
    lens = torch.tensor([37, 150, 9, 160], device=dev, dtype=torch.int32)
    inputs = [torch.randn(4, 512, generator=gen, device=dev).to(dt) for _ in range(4)]
    args = (weights, norm_weight, cache, tables, lens)

    monkeypatch.setattr(pdl_module, "PDL_ENABLED", False)
    want = [chain(x, *args) for x in inputs]
    monkeypatch.setattr(pdl_module, "PDL_ENABLED", True)
    assert pdl_options(inputs[0].device)["PDL"]

    static = inputs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static, *args)  # builds the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static, *args)
    for _ in range(3):
        for x, expected in zip(inputs, want, strict=True):
            static.copy_(x)
            graph.replay()
            assert torch.equal(out, expected)
    assert not torch.equal(want[0], want[1])  # the inputs do change the output
