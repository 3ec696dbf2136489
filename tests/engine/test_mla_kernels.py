"""The MLA kernels (kernels/mla.py, mla_rope.py) against their references, on fresh random inputs.

No GPU: Triton's interpreter, toy widths (latent 32 + rope 16). GPU: DeepSeek-V3's
(512 + 64) and longer contexts.
"""

from __future__ import annotations

import pytest
import torch

from omni.engine.kernels.head_matmul import head_matmul, head_matmul_ref
from omni.engine.kernels.mla import (
    mla_attention,
    mla_attention_ref,
    mla_decode_ref,
    mla_prefill_ref,
)
from omni.engine.kernels.mla_rope import (
    mla_query_and_cache,
    mla_query_and_cache_ref,
    mla_rope_and_cache,
    mla_rope_and_cache_ref,
)
from omni.engine.kernels.norm import rms_norm

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
LATENT, ROPE = (512, 64) if GPU else (32, 16)
HEADS = (16, 128) if GPU else (4, 72)  # four rows a tile; one row, two head groups
GROW = 9 if GPU else 1  # contexts and prompts are this many times longer on the GPU
# (atol = rtol, the most error relative to a row's norm) by dtype: the probabilities go to
# the tensor cores in the inputs' dtype; fp32 runs as tf32 on the GPU
TOL = {
    torch.float32: (1e-2, 5e-3) if GPU else (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# head_matmul against torch's product (fp32 runs as tf32 on the GPU)
TORCH_TOL = {"atol": 2e-2, "rtol": 2e-2} if GPU else {"atol": 1e-5, "rtol": 1e-5}
# contexts across page and tile boundaries: (seq_lens, q_lens) with decode rows (one row,
# one long enough to split), prompts, extensions, and a sequence with no rows (a graph's
# padding) between them
MIXED = ([40, 1, 23, 200, 9, 33, 17], [1, 1, 5, 1, 9, 0, 16])
# the interpreter's tl.dot reads bf16 operands as integers (numpy has no bf16): GPU only
BF16 = pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(not GPU, reason="interpreter: no bf16 dots")
)


@pytest.fixture
def gen():
    g = torch.Generator(device=DEVICE)
    g.seed()  # fresh inputs every run
    return g


def rand(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def latent_batch(gen, seq_lens, q_lens, heads, block, dtype=torch.float32):
    """A random latent cache with shuffled, gapped block tables, and query rows for each
    sequence's last q_len tokens."""
    per_seq = [-(-n // block) for n in seq_lens]
    n_blocks = 2 * sum(per_seq) + 3
    cache = rand(n_blocks, block, 1, LATENT + ROPE, gen=gen, dtype=dtype)
    order = torch.randperm(n_blocks, generator=gen, device=DEVICE).int()
    table = torch.zeros(len(seq_lens), max(per_seq) + 2, dtype=torch.int32, device=DEVICE)
    for b, nb in enumerate(per_seq):
        table[b, :nb] = order[2 * sum(per_seq[:b]) :][:nb]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = rand(sum(q_lens), heads, LATENT + ROPE, gen=gen, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, cache, table, lens, cu.to(DEVICE)


def grown(seq_lens, q_lens):
    return [n * GROW for n in seq_lens], [n * GROW for n in q_lens]


def assert_near(out, ref, dtype):
    """Close elementwise, and each row's error small against its norm: a long context
    averages many values into a small output, which an absolute tolerance lets through."""
    tol, rel = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    err = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
    assert err.max() < rel, err.max()


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
@pytest.mark.parametrize("block", [8, 16, 64])
def test_mla_attention(gen, dtype, block):
    """Decode rows, prompts and extensions in one ragged batch, pages smaller and larger
    than the kernel's context tile."""
    q, cache, table, lens, cu = latent_batch(gen, *grown(*MIXED), HEADS[0], block, dtype)
    scale = (LATENT + ROPE) ** -0.5
    out = mla_attention(q, cache, table, lens, cu, scale, LATENT)
    assert out.dtype == dtype and out.shape == (q.shape[0], HEADS[0], LATENT)
    assert_near(out, mla_attention_ref(q, cache, table, lens, cu, scale, LATENT), dtype)


def test_mla_attention_over_several_head_groups(gen):
    """Heads past one tile (the last group part-filled), strided query rows: a view."""
    seq_lens, q_lens = grown([30, 70, 12], [1, 1, 12])
    q, cache, table, lens, cu = latent_batch(gen, seq_lens, q_lens, HEADS[1], 16)
    wide = torch.cat([q, rand(*q.shape[:2], 8, gen=gen)], dim=-1)[..., : q.shape[-1]]
    out = mla_attention(wide, cache, table, lens, cu, 0.1, LATENT)
    assert_near(out, mla_attention_ref(q, cache, table, lens, cu, 0.1, LATENT), torch.float32)


def test_a_query_in_two_parts_gives_the_joined_querys_bits(gen):
    """The latent part head-major underneath (as a batched product leaves it) and the
    rope part in a tensor of its own: the same bits as the one joined query."""
    seq_lens, q_lens = grown(*MIXED)
    q, cache, table, lens, cu = latent_batch(gen, seq_lens, q_lens, HEADS[0], 16)
    latent = q[..., :LATENT].transpose(0, 1).contiguous().transpose(0, 1)
    rope = q[..., LATENT:].clone()
    joined = mla_attention(q, cache, table, lens, cu, 0.2, LATENT)
    parts = mla_attention(latent, cache, table, lens, cu, 0.2, LATENT, q_rope=rope)
    assert torch.equal(parts, joined)


@pytest.mark.parametrize("transpose", [False, True])  # the query's product, the output's
def test_per_head_products_against_torch_and_alone_as_in_a_batch(gen, transpose):
    """head_matmul against torch.bmm on strided rows (a view of a wider tensor), and each
    row's bits the same alone, among a few and among many."""
    heads, k, n = HEADS[0], 32 if not GPU else 128, 48 if not GPU else 512
    x = rand(70, heads, k + 8, gen=gen)[..., :k]
    w = rand(heads, n, k, gen=gen) if transpose else rand(heads, k, n, gen=gen)
    out = head_matmul(x, w, transpose)
    assert out.shape == (70, heads, n) and out.is_contiguous()
    torch.testing.assert_close(out, head_matmul_ref(x, w, transpose), **TORCH_TOL)
    # (the interpreter's numpy product may sum a row by its place in the tile: there the
    # rows keep theirs, starting at multiples of 16)
    for rows in (slice(0, 1), slice(16, 40), slice(32, 70), *([slice(3, 20)] if GPU else [])):
        assert torch.equal(head_matmul(x[rows], w, transpose), out[rows]), rows


def test_the_reference_is_the_decode_reference_at_one_row(gen):
    q, cache, table, lens, cu = latent_batch(gen, [5, 40, 17], [1, 1, 1], HEADS[0], 8)
    want = mla_decode_ref(q, cache, table, lens, 0.2, LATENT)
    got = mla_attention_ref(q, cache, table, lens, cu, 0.2, LATENT)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_decode_splits_do_not_change_the_bits(gen):
    """A decode row's context split across programs: close to the reference, and
    bit-identical however many programs share the splits."""
    seq_lens = [1, 37, 130, 300, 16] if not GPU else [1, 600, 2048, 17, 4096, 4161, 333]
    q, cache, table, lens, cu = latent_batch(gen, seq_lens, [1] * len(seq_lens), HEADS[0], 16)
    outs = [mla_attention(q, cache, table, lens, cu, 0.2, LATENT, programs=n) for n in (1, 3, 16)]
    assert_near(outs[0], mla_attention_ref(q, cache, table, lens, cu, 0.2, LATENT), torch.float32)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("heads", HEADS)  # one head group; several
def test_the_values_product_with_the_merge_in_it_is_the_two_launches_bits(
    gen, dtype, decode_only, heads
):
    """mla_attention(w_uv=...): the split rows' merge done inside the per-head product's
    launch, bit for bit head_matmul over the merged output; split decode rows, one-split
    ones, prompts and a sequence without rows in one batch, or decode rows alone."""
    seq_lens, q_lens = grown(*MIXED)
    if decode_only:
        seq_lens, q_lens = [1, 37, 130, 300, 16, 61] * (3 if GPU else 1), [1] * (18 if GPU else 6)
    q, cache, table, lens, cu = latent_batch(gen, seq_lens, q_lens, heads, 16, dtype)
    v_dim = 128 if GPU else 24
    w_uv = rand(heads, v_dim, LATENT, gen=gen, dtype=dtype) * LATENT**-0.5
    got = mla_attention(q, cache, table, lens, cu, 0.2, LATENT, w_uv=w_uv)
    attended = mla_attention(q, cache, table, lens, cu, 0.2, LATENT)
    assert got.shape == (q.shape[0], heads, v_dim) and got.dtype == dtype
    assert torch.equal(got, head_matmul(attended, w_uv, transpose=True))
    want = head_matmul_ref(mla_attention_ref(q, cache, table, lens, cu, 0.2, LATENT), w_uv, True)
    assert_near(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_value_slices_do_not_change_the_bits(gen, dtype):
    """A tile's values summed in column slices by programs of their own (as small decode
    batches run): the bits of the whole tile's sums, split decode rows and prompts."""
    seq_lens, q_lens = grown(*MIXED)
    q, cache, table, lens, cu = latent_batch(gen, seq_lens, q_lens, HEADS[0], 16, dtype)
    whole = mla_attention(q, cache, table, lens, cu, 0.2, LATENT, value_splits=1)
    assert_near(whole, mla_attention_ref(q, cache, table, lens, cu, 0.2, LATENT), dtype)
    for n in (2, 4) if GPU else (2,):
        assert torch.equal(
            mla_attention(q, cache, table, lens, cu, 0.2, LATENT, value_splits=n), whole
        )
    with pytest.raises(ValueError, match="value_splits"):
        mla_attention(q, cache, table, lens, cu, 0.2, LATENT, value_splits=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_a_row_does_not_depend_on_its_batch(gen, dtype):
    """A sequence's rows alone (a table as wide as its own) and in two batches at other
    places: the same bits, a split decode row and a prompt's rows alike."""
    seq_lens, q_lens = grown(*MIXED)
    q, cache, table, lens, cu = latent_batch(gen, seq_lens, q_lens, HEADS[0], 16, dtype)
    whole = mla_attention(q, cache, table, lens, cu, 0.2, LATENT)
    order = list(reversed(range(len(seq_lens))))
    rows = [torch.arange(cu[b], cu[b + 1]) for b in order]
    flipped = mla_attention(
        q[torch.cat(rows)],
        cache,
        table[order],
        lens[order],
        torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()]).to(cu),
        0.2,
        LATENT,
    )
    for b in (3, 4):  # the long decode row, a prompt
        width = -(-seq_lens[b] // 16)
        alone = mla_attention(
            q[cu[b] : cu[b + 1]],
            cache,
            table[b : b + 1, :width],
            lens[b : b + 1],
            torch.tensor([0, q_lens[b]], dtype=torch.int32, device=DEVICE),
            0.2,
            LATENT,
        )
        assert torch.equal(alone, whole[cu[b] : cu[b + 1]]), b
        first = sum(q_lens[c] for c in order[: order.index(b)])
        assert torch.equal(alone, flipped[first : first + q_lens[b]]), b


def test_absorbed_attention_computes_what_the_expanded_form_computes(gen):
    """Prefill absorbed on the GPU: q_nope through kv_b_proj's K part into the latent
    space, the kernel, then its V part, equals expanding every cached latent (the
    reference's prefill), for prompts, extensions and decode rows alike."""
    heads, nope, v_dim = HEADS[0], 32 if not GPU else 128, 32 if not GPU else 128
    seq_lens, q_lens = grown([40, 23, 9, 1], [1, 5, 9, 1])
    _, cache, table, lens, cu = latent_batch(gen, seq_lens, q_lens, heads, 8)
    q = rand(sum(q_lens), heads, nope + ROPE, gen=gen)
    kv_b = rand(heads * (nope + v_dim), LATENT, gen=gen) * LATENT**-0.5
    scale = (nope + ROPE) ** -0.5
    want = mla_prefill_ref(q, cache, kv_b, table, lens, cu, scale, nope, v_dim)
    w_uk, w_uv = kv_b.view(heads, nope + v_dim, LATENT).split([nope, v_dim], dim=1)
    q_latent = torch.einsum("thd,hdr->thr", q[..., :nope], w_uk)
    absorbed = torch.cat([q_latent, q[..., nope:]], dim=-1)
    got = torch.einsum(
        "thr,hvr->thv", mla_attention(absorbed, cache, table, lens, cu, scale, LATENT), w_uv
    )
    assert_near(got, want, torch.float32)


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_rope_and_cache(gen, dtype, normed):
    """q's rope parts and the rope key as views into their projections' rows (strided),
    slot -1 rows written nowhere; every other cache row untouched. `normed`: the latent
    RMS-normed on its way, as the norm kernel norms it."""
    tokens, heads, nope, block = 11, 12, 16, 8
    q = rand(tokens, heads, nope + ROPE, gen=gen, dtype=dtype)
    kv_a = rand(tokens, LATENT + ROPE, gen=gen, dtype=dtype)
    q_rope, (latent, k_rope) = q[..., nope:], kv_a.split([LATENT, ROPE], dim=-1)
    positions = torch.randint(0, 4000, (tokens,), generator=gen, device=DEVICE)
    inv_freq = 10000.0 ** -(torch.arange(0, ROPE, 2, device=DEVICE).float() / ROPE)
    slots = torch.randperm(6 * block, generator=gen, device=DEVICE)[:tokens]
    slots[[2, 7]] = -1
    cache = rand(6, block, 1, LATENT + ROPE, gen=gen, dtype=dtype)
    want_cache = cache.clone()
    weight = rand(LATENT, gen=gen) if normed else None
    args = (q_rope, latent, k_rope, positions, inv_freq)
    want = mla_rope_and_cache_ref(*args, want_cache, slots, weight, 1e-6)
    got = mla_rope_and_cache(*args, cache, slots, weight, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # sin and cos: libm's against Triton's
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, want_cache, atol=tol, rtol=tol)
    rows = cache.view(-1, LATENT + ROPE)
    stored = rows[slots[slots >= 0], :LATENT]
    if normed:  # as the norm kernel norms it (its reduction order: the tolerance)
        torch.testing.assert_close(stored, rms_norm(latent, weight, 1e-6)[0][slots >= 0],
                                   atol=tol, rtol=tol)  # fmt: skip
    else:
        assert torch.equal(stored, latent[slots >= 0])  # as it is
    untouched = torch.ones(rows.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(rows[untouched], want_cache.view(-1, LATENT + ROPE)[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_query_and_cache_in_one_launch_are_the_two_launches_bits(gen, dtype):
    """mla_query_and_cache: head_matmul's latent query and mla_rope_and_cache's rotation
    and cache rows in one launch, bit for bit those of the two launches (rows over
    several row blocks, strided views of one projection), and near the references."""
    tokens, heads, nope, block = 37, HEADS[0], 128 if GPU else 16, 8
    q = rand(tokens, heads, nope + ROPE, gen=gen, dtype=dtype)
    q_nope, q_rope = q.split([nope, ROPE], dim=-1)
    w_uk = rand(heads, nope, LATENT, gen=gen, dtype=dtype) * nope**-0.5
    kv_a = rand(tokens, LATENT + ROPE, gen=gen, dtype=dtype)
    latent, k_rope = kv_a.split([LATENT, ROPE], dim=-1)
    positions = torch.randint(0, 4000, (tokens,), generator=gen, device=DEVICE)
    inv_freq = 10000.0 ** -(torch.arange(0, ROPE, 2, device=DEVICE).float() / ROPE)
    slots = torch.randperm(6 * block, generator=gen, device=DEVICE)[:tokens]
    slots[[3, 30]] = -1
    cache = rand(6, block, 1, LATENT + ROPE, gen=gen, dtype=dtype)
    caches = [cache.clone() for _ in range(3)]
    weight = rand(LATENT, gen=gen)
    rope_args = (latent, k_rope, positions, inv_freq)
    lat, rotated = mla_query_and_cache(
        q_nope, w_uk, q_rope, *rope_args, caches[0], slots, weight, 1e-6
    )
    assert torch.equal(lat, head_matmul(q_nope, w_uk))
    assert torch.equal(rotated, mla_rope_and_cache(q_rope, *rope_args, caches[1], slots, weight))
    assert torch.equal(caches[0], caches[1]) and not torch.equal(caches[0], cache)
    want_lat, want_rotated = mla_query_and_cache_ref(
        q_nope, w_uk, q_rope, *rope_args, caches[2], slots, weight, 1e-6
    )
    tol = {} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(lat, want_lat, **(tol or TORCH_TOL))
    torch.testing.assert_close(rotated, want_rotated, **(tol or {"atol": 1e-5, "rtol": 1e-5}))
