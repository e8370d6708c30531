"""Write blocks (ckpt_tool/core/blocks.py): small output chunks handed to the Orbax writer a block at a time."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import tensorstore as ts

from ckpt_tool import formats
from ckpt_tool.core.blocks import BLOCK_BYTES, block_shape, blocks
from ckpt_tool.core.model import ArrayLeaf, ChunkList, RegularGrid, grid_chunks
from ckpt_tool.ops.reshard import ReshardOptions, reshard

from conftest import fixture_path


def _leaf(shape, chunks) -> ArrayLeaf:
    return ArrayLeaf(keys=("w",), name="w", shape=tuple(shape), dtype="float32", layout=RegularGrid(tuple(chunks)))


def test_a_finer_grid_is_blocked_by_the_source_chunks():
    src = _leaf((1024, 1024), (512, 256))
    assert block_shape((1024, 1024), RegularGrid((64, 64)), src, 2, 512 * 2**20) == (8, 4)
    # a dimension where the output grid does not divide the source's is not blocked
    assert block_shape((1024, 1024), RegularGrid((64, 96)), src, 2, 512 * 2**20) == (8, 1)


@pytest.mark.parametrize("out", [(512, 256), (1024, 256), (1024, 1024)])
def test_the_same_or_a_coarser_grid_is_not_blocked(out):
    assert block_shape((1024, 1024), RegularGrid(out), _leaf((1024, 1024), (512, 256)), 4, 512 * 2**20) is None


def test_no_regular_grid_no_blocks():
    src = _leaf((8, 8), (4, 4))
    assert block_shape((8, 8), ChunkList(()), src, 4, 512 * 2**20) is None
    assert block_shape((), RegularGrid(()), _leaf((), ()), 4, 512 * 2**20) is None


def test_chunks_of_a_mebibyte_are_written_one_by_one():
    src = _leaf((4096, 4096), (4096, 4096))
    assert block_shape((4096, 4096), RegularGrid((512, 512)), src, 4, 512 * 2**20) is None  # 1 MiB chunks
    assert block_shape((4096, 4096), RegularGrid((512, 256)), src, 4, 512 * 2**20) == (2, 16)  # 16 MiB


def test_blocks_stay_within_the_cap_and_keep_the_alignment():
    src = _leaf((8192, 8192), (8192, 8192))  # one 256 MiB chunk (float32)
    per = block_shape((8192, 8192), RegularGrid((64, 64)), src, 4, 512 * 2**20)
    assert per is not None
    assert math.prod(p * 64 for p in per) * 4 <= BLOCK_BYTES
    assert all(128 % p == 0 for p in per)  # each still divides the source chunk's 128 output chunks
    small = block_shape((8192, 8192), RegularGrid((64, 64)), src, 4, 64 * 2**20)
    assert math.prod(p * 64 for p in small) * 4 <= 2 * 2**20  # a 32nd of --memory


@pytest.mark.parametrize("shape,chunks,per", [((10, 7), (3, 2), (2, 3)), ((16,), (4,), (2,)), ((5, 4, 3), (2, 2, 2), (2, 1, 2))])
def test_blocks_cover_every_chunk_once_in_the_engines_indices(shape, chunks, per):
    grid = grid_chunks(shape, chunks)
    seen = []
    for members, region in blocks(shape, chunks, per):
        seen += members
        covered = [grid[i].region for i in members]
        # the block's region is exactly its chunks' union: its corners are theirs
        assert tuple(r.start for r in region) == tuple(min(c[d].start for c in covered) for d in range(len(shape)))
        assert tuple(r.stop for r in region) == tuple(max(c[d].stop for c in covered) for d in range(len(shape)))
        assert math.prod(r.stop - r.start for r in region) == sum(
            math.prod(s.stop - s.start for s in c) for c in covered)
    assert sorted(seen) == list(range(len(grid)))


def _stored(path: Path) -> dict[bytes, bytes]:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(path) + "/"}}).result()
    return {k: kv.read(k).result().value for k in kv.list().result()}


def test_blocked_output_is_the_chunk_by_chunk_output(tmp_path, monkeypatch):
    """Every stored chunk (and zarr metadata) of a reshard to a finer layout is the same either way."""
    src = str(fixture_path("orbax_ocdbt_zarr2"))
    opts = ReshardOptions(mesh="data=8,model=4", devices=32)
    blocked = reshard(src, str(tmp_path / "blocked"), opts)
    info = formats.REGISTRY["orbax"]
    monkeypatch.setitem(formats.REGISTRY, "orbax", dataclasses.replace(info, writes_chunk_blocks=False))
    single = reshard(src, str(tmp_path / "single"), opts)
    assert blocked.chunks == single.chunks and blocked.bytes == single.bytes
    a, b = _stored(tmp_path / "blocked"), _stored(tmp_path / "single")
    assert len(a) == len(b) > 100 and a == b
    for name in ("_METADATA", "_sharding", "array_metadatas/process_0"):
        assert (tmp_path / "blocked" / name).read_bytes() == (tmp_path / "single" / name).read_bytes()
