"""Activations with room for whole row tiles: the room is there, the linear layer's TMA
loads read into it, and what it holds never reaches a result."""

from __future__ import annotations

import pytest
import torch

from omni.engine.kernels import linear, rms_norm, silu_and_mul
from omni.engine.kernels.rows import ROW_TILE, empty_rows, tile_rows

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32


def room(t: torch.Tensor) -> int:
    """Rows the storage holds from t's first row on."""
    per_row = t.stride(0) * t.element_size()
    return (t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()) // per_row


@pytest.mark.parametrize(("m", "rows"), [(1, 1), (64, 64), (65, 128), (300, 384), (1025, 1025)])
def test_empty_rows_rounds_up_only_where_the_tma_kernel_runs(m, rows):
    t = empty_rows(m, 24, torch.float32, torch.device("cpu"))
    assert t.shape == (m, 24) and t.is_contiguous()
    assert room(t) == rows


def test_tile_rows_extends_only_into_storage_it_owns():
    big = torch.randn(200, 8)
    view = tile_rows(big[:100], 64)
    assert view.shape == (128, 8) and view.data_ptr() == big.data_ptr()
    assert torch.equal(view, big[:128])
    assert tile_rows(big[150:], 64).shape == (50, 8)  # rows 200-191 are not there
    assert tile_rows(big[:128], 64).shape == (128, 8)  # already whole tiles
    assert tile_rows(torch.randn(100, 16)[:, :8], 64).shape == (100, 8)  # not contiguous


@pytest.mark.gpu  # the CPU path runs the references
def test_kernels_that_feed_a_linear_layer_leave_room():
    x = torch.randn(300, 4096, device=DEVICE, dtype=DTYPE)
    out, _ = rms_norm(x, torch.ones(4096, device=DEVICE, dtype=DTYPE), 1e-6)
    assert room(out) == 384
    assert room(silu_and_mul(torch.randn(300, 2 * 4096, device=DEVICE, dtype=DTYPE))) == 384


@pytest.mark.parametrize("m", [77, 130])
def test_what_the_room_holds_never_reaches_a_row(m):
    """NaN in the rows past the end: a matmul row depends on its own input row only, and
    the store clips to the real rows, so the output matches a copy without room bit for
    bit."""
    k, n = (4096, 6144) if GPU else (96, 160)
    g = torch.Generator(device=DEVICE).manual_seed(torch.seed() % 2**31)
    x = empty_rows(m, k, DTYPE, torch.device(DEVICE))
    x.copy_(torch.randn(m, k, generator=g, device=DEVICE).to(DTYPE))
    tile_rows(x, ROW_TILE)[m:].fill_(float("nan"))
    w = (torch.randn(n, k, generator=g, device=DEVICE) * k**-0.5).to(DTYPE)
    got = linear(x, w)
    assert not got.isnan().any()
    assert torch.equal(got, linear(x.clone(), w))
