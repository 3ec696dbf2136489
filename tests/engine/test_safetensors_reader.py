"""The chunked safetensors reader against safetensors' own loader, and its refusals.

Tiny chunks (4 KiB) so that tensors split across chunks and chunks span tensors; the
chunked path runs on the CPU with plain staging buffers, on CUDA with pinned ones.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni.engine.checkpoint import CheckpointError
from omni.engine.safetensors_reader import load_tensors, read_header, read_tensors


def random_tensor(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype):
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    return torch.randint(-(2**40), 2**40, shape, generator=gen).to(dtype)


def write_shards(directory: Path) -> list[Path]:
    """Three shards of mixed dtypes; sizes straddle the 4 KiB chunks."""
    gen = torch.Generator().manual_seed(1234)
    layouts = [
        {
            "a.weight": ((33, 97), torch.bfloat16),  # 6,402 bytes
            "a.bias": ((97,), torch.float32),
            "a.ids": ((1000,), torch.int64),  # 8,000 bytes
            "a.empty": ((0, 16), torch.float32),
            "a.scale": ((), torch.float32),
        },
        {
            "b.weight": ((129, 65), torch.float32),  # 33,540 bytes: several chunks
            "b.mask": ((300,), torch.bool),
            "b.norm": ((7,), torch.bfloat16),
        },
        {"c.small": ((3,), torch.int64), "c.also": ((5, 5), torch.bfloat16)},
    ]
    files = []
    for i, layout in enumerate(layouts):
        tensors = {name: random_tensor(gen, shape, dt) for name, (shape, dt) in layout.items()}
        path = directory / f"model-{i:05d}-of-{len(layouts):05d}.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        files.append(path)
    return files


def reference(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        assert torch.equal(g.cpu(), w), name


@pytest.fixture
def shards(tmp_path):
    return write_shards(tmp_path)


@pytest.mark.parametrize("chunk_bytes", [4096, 4099, 1 << 20])
@pytest.mark.parametrize("workers", [1, 3])
def test_chunked_read_matches_safetensors(shards, chunk_bytes, workers):
    want = reference(shards)
    assert any(w.numel() for w in want.values()) and all(
        w.count_nonzero() > 0 for w in want.values() if w.numel()
    )
    got = read_tensors(shards, "cpu", None, chunk_bytes=chunk_bytes, pinned=False, workers=workers)
    assert_same(got, want)


def test_floating_tensors_are_cast_integers_kept(shards):
    want = {k: v.float() if v.is_floating_point() else v for k, v in reference(shards).items()}
    assert_same(read_tensors(shards, "cpu", torch.float32, chunk_bytes=4096), want)
    assert_same(load_tensors(shards, "cpu", torch.float32), want)


def test_tensors_are_separate_allocations(shards):
    """The model frees tensors one by one (fuse_projections): none may hold a shard."""
    got = read_tensors(shards, "cpu", None, chunk_bytes=4096)
    for t in got.values():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_a_group_is_read_back_to_back_into_one_allocation(shards):
    """What fused projections rely on: the group's tensors adjacent, in the group's order,
    across shards; a group with a missing tensor or mixed dtypes is read as usual."""
    group = ["c.also", "a.weight"]  # both bf16, in two shards, listed out of file order
    got = read_tensors(
        shards, "cpu", None, chunk_bytes=4096, together=[group, ["a.weight", "nope"]]
    )
    assert_same(got, reference(shards))
    first, second = got["c.also"], got["a.weight"]
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert second.data_ptr() == first.data_ptr() + first.numel() * first.element_size()
    mixed = read_tensors(shards, "cpu", None, together=[["a.bias", "a.weight"]])
    assert mixed["a.bias"].untyped_storage().nbytes() == 97 * 4


def test_header(shards):
    header = read_header(shards[0])
    assert header.metadata == {"format": "pt"}
    names = {t.name: t for t in header.tensors}
    assert names["a.weight"].dtype == torch.bfloat16
    assert names["a.weight"].shape == (33, 97)
    assert names["a.empty"].begin == names["a.empty"].end


def raw_file(path: Path, header: dict, data: bytes) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def broken_files(directory: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the error says)."""
    data = good.read_bytes()
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    cases = {
        "truncated": (data[: len(data) - 100], "beyond"),
        "too short": (b"\x05\x00", "too short"),
        "header length past the end": (struct.pack("<Q", 10**6) + b"{}", "header length"),
        "garbage header": (struct.pack("<Q", 12) + b"not json!!!!" + bytes(16), "not valid JSON"),
        "not utf-8": (struct.pack("<Q", 4) + b"\xff\xfe{}" + bytes(16), "not valid JSON"),
        "a list": (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    }
    out = {
        name: (directory / f"{i}.safetensors", why)
        for i, (name, (_, why)) in enumerate(cases.items())
    }
    for name, (blob, _) in cases.items():
        out[name][0].write_bytes(blob)
    raw = {
        "offsets beyond the file": ({"t": {**entry, "data_offsets": [16, 32]}}, 16, "beyond"),
        "offsets disagree with shape": ({"t": {**entry, "data_offsets": [0, 12]}}, 12, "needs 16"),
        "unknown dtype": ({"t": {**entry, "dtype": "F7"}}, 16, "unsupported dtype"),
        "negative shape": ({"t": {**entry, "shape": [-4]}}, 16, "bad shape"),
        "overlap": (
            {"t": entry, "u": {**entry, "data_offsets": [8, 24]}},
            24,
            "expected 16",
        ),
        "trailing bytes": ({"t": entry}, 20, "after the last tensor"),
    }
    for i, (name, (header, size, why)) in enumerate(raw.items()):
        path = raw_file(directory / f"raw{i}.safetensors", header, bytes(range(size)))
        out[name] = (path, why)
    return out


def test_broken_files_are_refused_naming_the_file(tmp_path, shards):
    for case, (path, why) in broken_files(tmp_path, shards[1]).items():
        for load in (
            lambda f: read_tensors([f], "cpu", None, chunk_bytes=4096),
            lambda f: load_tensors([f], "cpu", torch.float32),
        ):
            with pytest.raises(CheckpointError) as err:
                load(path)
            assert str(path) in str(err.value), case
            assert why in str(err.value), case


def test_a_file_cut_short_after_its_header_was_read(shards):
    """A shard truncated between validation and reading fails; it does not spin."""
    header = read_header(shards[1])
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[:-5000])
    with pytest.raises(CheckpointError, match=r"model-00001-of-00003\.safetensors: .*ends"):
        read_tensors([header], "cpu", None, chunk_bytes=4096, workers=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
def test_cuda_read_matches_cpu(shards, chunk_bytes):
    want = reference(shards)
    got = read_tensors(shards, "cuda", None, chunk_bytes=chunk_bytes, workers=4)
    assert all(t.is_cuda for t in got.values())
    assert_same(got, want)
    cast = load_tensors(shards, "cuda", torch.bfloat16)
    assert_same(cast, {k: v.bfloat16() if v.is_floating_point() else v for k, v in want.items()})


def test_fusing_adjacent_projections_is_a_view_and_others_a_copy():
    from omni.engine.llama import _stacked

    gen = torch.Generator().manual_seed(5)
    base = torch.randn(10, 4, generator=gen)
    parts = [base[:6], base[6:8], base[8:]]  # q, k, v as read back to back
    fused = _stacked(parts)
    assert fused.data_ptr() == base.data_ptr() and torch.equal(fused, base)
    apart = [torch.randn(6, 4, generator=gen), torch.randn(2, 4, generator=gen)]
    assert torch.equal(_stacked(apart), torch.cat(apart))
    assert torch.equal(_stacked([base[6:8], base[:6]]), torch.cat([base[6:8], base[:6]]))


def pick_rows(name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """A rank's kind of selection: some tensors' middle rows, some left out, the rest whole."""
    if name in ("a.ids", "c.small"):
        return None
    if name == "b.weight":
        return (40, 60)  # rows 40..99 of 129: a run of bytes across several chunks
    if name == "a.weight":
        return (0, 11)
    return (0, shape[0])


def test_a_rank_reads_only_the_rows_it_picks(shards, monkeypatch):
    """The chunked reader and the memory-mapped one return the same picked rows, and the
    chunked one reads fewer bytes than the files hold."""
    import omni.engine.safetensors_reader as reader

    want = {}
    for name, t in reference(shards).items():
        pick = pick_rows(name, tuple(t.shape)) if t.dim() else (0, 0)
        if pick is not None:
            want[name] = t if not t.dim() else t[pick[0] : pick[0] + pick[1]]
    read = []
    real = reader._pread
    monkeypatch.setattr(reader, "_pread", lambda c, v: (read.append(c.n), real(c, v)))
    got = read_tensors(shards, "cpu", None, chunk_bytes=4096, pinned=False, rows=pick_rows)
    assert_same(got, want)
    assert_same(load_tensors(shards, "cpu", None, rows=pick_rows), want)
    whole = sum(h.tensors[-1].end if h.tensors else 0 for h in map(read_header, shards))
    assert 0 < sum(read) < whole - 8000  # a.ids (8,000 bytes) and more were never read
