"""Every Triton kernel against its reference, on fresh random inputs.

No GPU: Triton's interpreter, small shapes, fp32. GPU: real shapes, bf16.
"""

from __future__ import annotations

import pytest
import torch

from omni.engine.kernels import (
    builds,
    linear,
    linear_ref,
    paged_attention_ref,
    paged_decode,
    paged_prefill,
    prefill_work,
    rms_norm,
    rms_norm_ref,
    rope_and_cache,
    rope_and_cache_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from omni.engine.kernels.matmul import weight_descriptor

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
# INTERPRETER_ROWS: Triton's interpreter computes tl.dot with numpy, and OpenBLAS's sgemm
# sums a row differently by its place in the tile on some CPUs (its Haswell kernels on an
# AMD EPYC: rows 0-6 of a 16-row product differ from the same rows multiplied alone). The
# batch-invariance tests there compare rows that keep their place in the tile; on the GPU
# they move them anywhere.
TOL = {"atol": 3e-2, "rtol": 3e-2} if GPU else {"atol": 1e-4, "rtol": 1e-4}
# (q_heads, kv_heads, head_dim, hidden): Llama-3-8B on the GPU, toy-sized in the interpreter
SHAPE = (32, 8, 128, 4096) if GPU else (4, 2, 32, 96)
BLOCK = 16


@pytest.fixture
def gen():
    g = torch.Generator(device=DEVICE)
    g.seed()  # fresh inputs every run
    return g


def rand(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(DTYPE)


@pytest.mark.parametrize("strided", [False, True])  # rows of a wider projection's output
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(gen, with_residual, strided):
    hidden = SHAPE[3]
    x, w = rand(37, hidden, gen=gen), rand(hidden, gen=gen)
    if strided:
        x = torch.cat([rand(37, 24, gen=gen), x], dim=1)[:, 24:]
        assert x.stride(0) == hidden + 24
    res = rand(37, hidden, gen=gen) if with_residual else None
    out, new_res = rms_norm(x, w, 1e-6, res)
    ref, ref_res = rms_norm_ref(x, w, 1e-6, res)
    torch.testing.assert_close(out, ref, **TOL)
    if with_residual:
        torch.testing.assert_close(new_res, ref_res, **TOL)


def test_silu_and_mul(gen):
    x = rand(29, 2 * SHAPE[3] + 64, gen=gen)  # not a power of two
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL)


@pytest.mark.parametrize("heads", [SHAPE[:2], (12, 3)])  # (12, 3): part-filled groups
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache(gen, fused, heads, qk_norm):
    """Separate q, k, v, or views into one fused qkv projection's rows (strided: the
    kernel reads them in place); with Qwen3's per-head norms of q and k or without."""
    (n_q, n_kv), dim = heads, SHAPE[2]
    tokens, n_blocks = 23, 8
    if fused:
        qkv = rand(tokens, (n_q + 2 * n_kv) * dim, gen=gen)
        q, k, v = qkv.split([n_q * dim, n_kv * dim, n_kv * dim], dim=-1)
        q, k, v = q.view(tokens, n_q, dim), k.view(tokens, n_kv, dim), v.view(tokens, n_kv, dim)
        assert not q.is_contiguous()
    else:
        q, k, v = (
            rand(tokens, n_q, dim, gen=gen),
            rand(tokens, n_kv, dim, gen=gen),
            rand(tokens, n_kv, dim, gen=gen),
        )
    positions = torch.randint(0, 4000, (tokens,), generator=gen, device=DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    slots = torch.randperm(n_blocks * BLOCK, generator=gen, device=DEVICE)[:tokens]
    slots[::5] = -1  # padding tokens are not written
    caches = [torch.zeros(n_blocks, BLOCK, n_kv, dim, dtype=DTYPE, device=DEVICE) for _ in range(4)]
    norms = None
    if qk_norm:  # weights away from 1, inputs away from unit scale (in place: views stay)
        norms = (1 + rand(dim, gen=gen), 1 + rand(dim, gen=gen), 1e-6)
        q.mul_(3)
        k.mul_(0.5)
    q_out = rope_and_cache(q, k, v, positions, inv_freq, caches[0], caches[1], slots, norms)
    q_ref = rope_and_cache_ref(q, k, v, positions, inv_freq, caches[2], caches[3], slots, norms)
    torch.testing.assert_close(q_out, q_ref, **TOL)
    torch.testing.assert_close(caches[0], caches[2], **TOL)
    torch.testing.assert_close(caches[1], caches[3], **TOL)
    assert caches[0].abs().sum() > 0


@pytest.mark.parametrize("bias", [False, True])
def test_linear(gen, bias):
    n, k = (6144, 4096) if GPU else (200, 96)  # K not a multiple of the tile in the interpreter
    x, w = rand(77, k, gen=gen), rand(n, k, gen=gen, scale=k**-0.5)
    b = rand(n, gen=gen) if bias else None
    torch.testing.assert_close(linear(x, w, b), linear_ref(x, w, b), **TOL)


@pytest.mark.parametrize("n", [2048, 3648, 4096, 6144, 28672] if GPU else [160])  # tiles follow N
def test_linear_rows_do_not_depend_on_the_batch(gen, n):
    """Bit for bit: a row's output is the same alone, in a small batch and in a large one,
    though the tile shape and the kernel (pointer or TMA) follow the row count. On the GPU
    the tensor cores chain one accumulator through K whatever the tile; the interpreter's
    dot is numpy's, whose sums follow the tile's shape and, with some CPUs' BLAS kernels
    (OpenBLAS on an AMD EPYC), a row's place in it: there one tile shape is compared, with
    the rows at the start of their tile (INTERPRETER_ROWS)."""
    k = 14336 if GPU else 256
    total = 2300 if GPU else 16  # tile_config's classes up to 4,096 rows on the GPU
    x, w = rand(total, k, gen=gen), rand(n, k, gen=gen, scale=k**-0.5)
    full = linear(x, w)
    for size in (s for s in (1, 7, 17, 33, 63, 64, 65, 200, 299, 700, 1099, 2000) if s <= total):
        for start in {0, total - size} if GPU else {0}:
            rows = slice(start, start + size)
            assert torch.equal(linear(x[rows], w), full[rows]), rows


def test_weight_descriptor_is_made_once_per_tile_and_follows_a_reload():
    w = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    first = weight_descriptor(w, 16, 32)
    assert weight_descriptor(w, 16, 32) is first
    assert weight_descriptor(w, 32, 32) is not first  # another tile shape
    w.data = torch.randn(48, 32)  # reloaded: another address and shape
    again = weight_descriptor(w, 16, 32)
    assert again is not first and list(again.shape) == [48, 32]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 6144, 28672])
def test_linear_builds_once_per_row_class(gen, n):
    """A step's size picks a tile class; within it, any other size must reuse the builds
    (one for a multiple of 16 rows, one for the rest) that the engine's warm-up makes, or
    a mid-serving step waits for a compile. Sizes inside each class give different program
    counts, persistent and not."""
    k = 4096
    w = rand(n, k, gen=gen, scale=k**-0.5)
    assert builds.install()
    classes = [(80, 128, 65, 97, 120), (150, 256, 129, 193, 250), (300, 512, 257, 700, 1000)]
    classes += [(1100, 2048, 1025, 3000, 4096), (4100, 8192, 4097, 5000, 6001)]
    for warm_a, warm_b, *others in classes:
        for m in (warm_a, warm_b):
            linear(rand(m, k, gen=gen), w)
        before = builds.BUILDS.count
        for m in others:
            linear(rand(m, k, gen=gen), w)
        assert builds.BUILDS.count == before, (n, others, builds.BUILDS.since(before))


def test_paged_prefill_does_not_depend_on_the_chunking(gen):
    """A prompt prefilled in one pass or in chunks gets bit-identical attention outputs
    (in the interpreter, chunks that start where a query tile does: INTERPRETER_ROWS)."""
    length = 200 if GPU else 40
    q, kc, vc, table, lens, cu = paged_batch(gen, [length], [length])
    scale, block_m = q.shape[-1] ** -0.5, 64 if GPU else 16
    whole = paged_prefill(q, kc, vc, table, lens, cu, scale, block_m=block_m)
    done = 0
    chunks = (length // 3, 1, length - length // 3 - 1) if GPU else (16, 16, length - 32)
    for chunk in chunks:
        end = done + chunk
        part = paged_prefill(
            q[done:end].contiguous(),
            kc,
            vc,
            table,
            torch.tensor([end], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE),
            scale,
            block_m=block_m,
        )
        assert torch.equal(part, whole[done:end]), (done, end)
        done = end


def paged_batch(gen, seq_lens, q_lens):
    """Random caches with shuffled block tables, and queries for the last q_len tokens."""
    n_q, n_kv, dim, _ = SHAPE
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    n_blocks = sum(blocks_per_seq) + 3
    k_cache = rand(n_blocks, BLOCK, n_kv, dim, gen=gen)
    v_cache = rand(n_blocks, BLOCK, n_kv, dim, gen=gen)
    order = torch.randperm(n_blocks, generator=gen, device=DEVICE).int()
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=DEVICE)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        table[b, :nb] = order[used : used + nb]
        used += nb
    cu = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    q = rand(sum(q_lens), n_q, dim, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, table, lens, cu


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        ([40, 17, 64], [40, 5, 33]),  # fresh prompt, short extension, long extension
        ([1, 23], [1, 23]),
    ],
)
def test_paged_prefill(gen, seq_lens, q_lens):
    if GPU:
        seq_lens, q_lens = [n * 9 for n in seq_lens], [n * 9 for n in q_lens]
    q, kc, vc, table, lens, cu = paged_batch(gen, seq_lens, q_lens)
    scale = q.shape[-1] ** -0.5
    out = paged_prefill(q, kc, vc, table, lens, cu, scale, block_m=64 if GPU else 16)
    ref = paged_attention_ref(q, kc, vc, table, lens, cu, scale)
    torch.testing.assert_close(out, ref, **TOL)


def test_paged_decode(gen):
    """Close to the reference, and bit-identical however many programs share the splits
    (the count follows the batch size; a sequence's output must not)."""
    # lengths around the split boundaries: one tile, several splits, the most splits
    seq_lens = [1, 37, 1100, 16, 300] if not GPU else [1, 600, 2048, 17, 4096, 4161, 333]
    q, kc, vc, table, lens, cu = paged_batch(gen, seq_lens, [1] * len(seq_lens))
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_ref(q, kc, vc, table, lens, cu, scale)
    outs = [paged_decode(q, kc, vc, table, lens, scale, programs=n) for n in (1, 3, 16)]
    torch.testing.assert_close(outs[0], ref, **TOL)
    # a long context averages many values into a small output, which an absolute
    # tolerance alone would let through wrong: the error relative to each row's size too
    err = (outs[0].float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
    assert err.max() < (2e-2 if GPU else 1e-5), err.max()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    # and alone, with a table only as wide as its own: the same row
    width = -(-seq_lens[2] // BLOCK)
    alone = paged_decode(q[2:3], kc, vc, table[2:3, :width], lens[2:3], scale)
    assert torch.equal(alone, outs[0][2:3])


def test_decode_and_prefill_write_their_rows_of_one_output(gen):
    """A mixed step's attention: the decode kernel writes the first rows and the prefill
    kernel the rest of one given tensor (no concatenation, no copy), the same bits as
    each kernel's own output."""
    seq_lens, q_lens = [30, 51, 40, 17], [1, 1, 40, 5]
    q, kc, vc, table, lens, cu = paged_batch(gen, seq_lens, q_lens)
    scale, nd, block_m = q.shape[-1] ** -0.5, 2, 64 if GPU else 16
    decode = paged_decode(q[:nd], kc, vc, table[:nd], lens[:nd], scale)
    prefill = paged_prefill(
        q[nd:], kc, vc, table[nd:], lens[nd:], cu[nd:] - nd, scale, block_m=block_m
    )
    out = torch.full_like(q, float("nan"))
    entries = prefill_work(q_lens[nd:], nd, block_m)
    work = torch.tensor(entries, dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([nd, len(entries)], dtype=torch.int32, device=DEVICE)
    paged_decode(q, kc, vc, table, lens, scale, out=out, rows=nd, counts=counts)
    paged_prefill(q, kc, vc, table, lens, cu, scale, work, counts, block_m, out=out)
    assert torch.equal(out, torch.cat([decode, prefill]))


def test_launches_for_more_than_the_step_does_the_step_alone(gen):
    """A CUDA graph launches attention for the most its bucket can hold: decode rows and
    prefill work entries past the device's counts must do nothing (the same bits for the
    real rows, no write anywhere else), whatever stale values the padding holds."""
    seq_lens, q_lens = [30, 51, 40, 17], [1, 1, 40, 5]
    q, kc, vc, table, lens, cu = paged_batch(gen, seq_lens, q_lens)
    scale, nd, block_m = q.shape[-1] ** -0.5, 2, 64 if GPU else 16
    entries = prefill_work(q_lens[nd:], nd, block_m)
    exact = torch.full_like(q, float("nan"))
    work = torch.tensor(entries, dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([nd, len(entries)], dtype=torch.int32, device=DEVICE)
    paged_decode(q, kc, vc, table, lens, scale, out=exact, rows=nd, counts=counts)
    paged_prefill(q, kc, vc, table, lens, cu, scale, work, counts, block_m, out=exact)
    # padding: 4 more query rows, every sequence a decode row of the grid, stale work
    pad = torch.cat([q, rand(4, *q.shape[1:], gen=gen)])
    stale = torch.tensor([[0, 0], [3, 2], [1, 1]], dtype=torch.int32, device=DEVICE)
    padded_work = torch.cat([work, stale])
    out = torch.full_like(pad, float("nan"))
    rows = len(seq_lens)
    paged_prefill(pad, kc, vc, table, lens, cu, scale, padded_work, counts, block_m, out=out)
    paged_decode(pad, kc, vc, table, lens, scale, out=out, rows=rows, counts=counts)
    assert torch.equal(out[: q.shape[0]], exact)
    assert out[q.shape[0] :].isnan().all()
    # and with counts of zero (a capture's warm-up run), nothing at all
    none = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(pad, float("nan"))
    paged_prefill(pad, kc, vc, table, lens, cu, scale, padded_work, none, block_m, out=out)
    paged_decode(pad, kc, vc, table, lens, scale, out=out, rows=rows, counts=none)
    assert out.isnan().all()
