"""The read scheduler on many small stored chunks (ckpt_tool/scheduler/).

Checkpoints of thousands of small leaves, each in 4 to 8 per-device chunks,
were slower through the scheduler than read region by region: a read, a copy
and an assembly per chunk. Now a small leaf's chunks are read in one region
(a batch), a want whose chunks are all its own is read whole, and small
reads are started together (a group). These tests hold the plan to what it
promises on real orbax fixtures (8 devices, 2 to 8 chunks per leaf): every
stored chunk decoded exactly once, values equal to orbax's own restore, a
damaged chunk reported as that chunk, and the DCP writer's small archives
written in a few large writes that torch reads back exactly.
"""
from __future__ import annotations

import json
import math
import shutil
from typing import Callable
from pathlib import Path

import numpy as np
import pytest

from ckpt_tool.formats import open_checkpoint
from ckpt_tool.core.model import ArrayLeaf, stored_chunks
from ckpt_tool.scheduler import Scheduler, Want

from conftest import fixture_path, run_ckpt
from library_reference import dcp_values, orbax_values

FIXTURES = ["orbax_plain_zarr2", "orbax_ocdbt_zarr2", "orbax_ocdbt_zarr3"]


def _arrays(ckpt) -> list[ArrayLeaf]:
    return [leaf for leaf in ckpt.leaves if isinstance(leaf, ArrayLeaf) and leaf.shape]


def _keeper(got: dict, key):
    def deliver(arrays):
        got[key] = [a.copy() for a in arrays]
        return sum(a.nbytes for a in arrays)
    return deliver


def _kinds(sched: Scheduler) -> dict[str, int]:
    out = {"group": 0, "batch": 0, "want": 0, "chunk": 0}
    for unit in sched.units:
        for u in unit.group or [unit]:
            kind = "batch" if u.batch is not None else "want" if u.want is not None else "chunk"
            out[kind] += 1
        out["group"] += bool(unit.group)
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_one_want_per_stored_chunk_decodes_each_chunk_once(name):
    """convert's shape: an output chunk per source chunk (small leaves are read in one batch each)."""
    ckpt = open_checkpoint(str(fixture_path(name)))
    reference = orbax_values(fixture_path(name))
    got: dict = {}
    wants = []
    for leaf in _arrays(ckpt):
        for i, chunk in enumerate(stored_chunks(leaf.shape, leaf.layout)):
            wants.append(Want([(leaf, chunk.region)], _keeper(got, (leaf.path, i)), keeps=True))
    sched = Scheduler(wants, workers=2)
    sched.run()
    total = sum(len(stored_chunks(leaf.shape, leaf.layout)) for leaf in _arrays(ckpt))
    assert sum(sched.stats.decodes.values()) == total == len(sched.stats.decodes) == sched.planned_chunks
    kinds = _kinds(sched)
    assert kinds["batch"] > 0, kinds  # the new paths are the ones taken
    # small reads are started together where the reader starts them (tensorstore); the chunks of an
    # OCDBT database are read by pread and decoded by ckpt (LocatedZarrRegionReader), each at once
    assert (kinds["group"] > 0) == all(leaf.reader.starts_reads for leaf in _arrays(ckpt)), kinds
    assert len(sched.units) < total / 4, (len(sched.units), total)
    for leaf in _arrays(ckpt):
        want = np.asarray(reference[tuple(leaf.keys)])
        for i, chunk in enumerate(stored_chunks(leaf.shape, leaf.layout)):
            assert got[(leaf.path, i)][0].tobytes() == want[chunk.region].tobytes(), (leaf.path, i)


def test_whole_leaf_wants_read_whole_and_each_chunk_counted_once():
    """A want holding several whole chunks that feed nothing else: one read through the reader."""
    name = "orbax_ocdbt_zarr2"
    # diff's shape: the same regions of two checkpoints (here the same one, opened twice)
    left, right = (open_checkpoint(str(fixture_path(name))) for _ in range(2))
    reference = orbax_values(fixture_path(name))
    pairs = [(a, b) for a, b in zip(_arrays(left), _arrays(right)) if len(stored_chunks(a.shape, a.layout)) > 1]
    got: dict = {}
    wants = []
    for a, b in pairs:
        half = a.shape[0] // 2  # each half holds whole chunks
        for part in ((slice(0, half),), (slice(half, a.shape[0]),)):
            region = part + tuple(slice(0, n) for n in a.shape[1:])
            wants.append(Want([(a, region), (b, region)], _keeper(got, (a.path, part[0].start))))
    sched = Scheduler(wants, workers=2)
    sched.run()
    assert _kinds(sched)["want"] == len(wants)
    chunks = sum(len(stored_chunks(a.shape, a.layout)) for a, _ in pairs)
    assert sched.planned_chunks == 2 * chunks
    assert set(sched.stats.decodes.values()) == {2}  # once on each side
    for a, _ in pairs:
        arr = np.asarray(reference[tuple(a.keys)])
        half = a.shape[0] // 2
        for start, want in ((0, arr[:half]), (half, arr[half:])):
            assert [x.tobytes() for x in got[(a.path, start)]] == [want.tobytes()] * 2, a.path


def test_damaged_chunk_of_a_batched_leaf_is_reported_as_that_chunk(tmp_path):
    """A batch or a group that fails is decoded chunk by chunk, so the finding names the bad one only."""
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_path("orbax_plain_zarr2"), src)
    chunk = src / "layers.0.w" / "1.1"
    assert chunk.exists()
    data = chunk.read_bytes()
    chunk.write_bytes(data[: len(data) // 2])  # a zstd frame cut short does not decode
    r = run_ckpt("validate", str(src), "--deep", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    bad = [f for f in doc["findings"] if f["code"] == "bad-chunk"]
    assert len(bad) == 1, bad
    assert bad[0]["leaf"] == "layers/0/w" and "[2:4, 4:8]" in bad[0]["message"], bad[0]
    # every other chunk of the checkpoint was read and checked
    assert doc["checked"]["chunks_read"] == 115


def test_small_archives_are_written_in_few_large_writes(tmp_path, monkeypatch):
    """convert to DCP of many small chunks: archives gathered into 1 MiB writes; torch reads the values exactly."""
    from ckpt_tool.ops.engine import ConvertOptions, convert
    from ckpt_tool.formats.dcp import write as dcp_writer
    from ckpt_tool.storage import LocalFileWriter

    calls = []
    real = LocalFileWriter.write_at

    def counting(self, offset, parts, **kw):
        calls.append(sum(memoryview(p).nbytes for p in parts))
        return real(self, offset, parts, **kw)

    monkeypatch.setattr(LocalFileWriter, "write_at", counting)
    monkeypatch.setattr(dcp_writer, "COALESCE_BYTES", 32768)  # the fixture is small: several writes
    name = "orbax_ocdbt_zarr2"
    dst = tmp_path / "dcp"
    result = convert(str(fixture_path(name)), str(dst), ConvertOptions(to="dcp", workers=4))
    assert result.chunks > 50
    assert 1 < len(calls) < result.chunks / 8, (len(calls), result.chunks)
    reference = orbax_values(fixture_path(name))
    got = dcp_values(dst)
    arrays = {k: v for k, v in reference.items() if isinstance(v, np.ndarray) and v.ndim}
    assert arrays
    for key, want in arrays.items():
        assert np.asarray(got[key]).tobytes() == want.tobytes(), key


def test_chunk_feeding_several_regions_is_read_into_them(monkeypatch):
    """reshard's shape: each chunk split between two output regions; tensorstore writes the pieces in place."""
    from ckpt_tool.scheduler import planning
    from ckpt_tool.scheduler.execution import Executor

    used = []
    real = Executor._run_into
    monkeypatch.setattr(Executor, "_run_into", lambda self, *a: (used.append(1), real(self, *a))[1])
    # the fixture's leaves are small: without this they are read in batches and groups instead
    monkeypatch.setattr(planning, "BATCH_BYTES", 0)
    monkeypatch.setattr(planning, "GROUP_BYTES", 0)
    monkeypatch.setattr(planning, "CLUSTER_BYTES", 0)  # (else the two regions read as a cluster: below)
    leaves, wants, check = _half_chunk_wants()
    sched = Scheduler(wants, workers=2)
    sched.run()
    assert used, "no chunk was read into its regions"
    assert set(sched.stats.decodes.values()) == {1}
    check()


def test_located_chunk_feeding_several_regions_is_decoded_once(monkeypatch):
    """The same shape on an OCDBT database: ckpt decodes each chunk itself, once, whole, and the
    scheduler cuts both regions from it."""
    from ckpt_tool.core import codecs
    from ckpt_tool.machinery.arrays.reading import LocatedZarrRegionReader
    from ckpt_tool.scheduler import planning

    decoded = []
    real = codecs.decode_chunk
    monkeypatch.setattr(codecs, "decode_chunk", lambda data, zmeta, zarr3, shape, where: (decoded.append(where), real(data, zmeta, zarr3, shape, where))[1])
    monkeypatch.setattr(planning, "BATCH_BYTES", 0)
    monkeypatch.setattr(planning, "GROUP_BYTES", 0)
    monkeypatch.setattr(planning, "CLUSTER_BYTES", 0)
    leaves, wants, check = _half_chunk_wants("orbax_ocdbt_zarr2")
    assert all(isinstance(leaf.reader, LocatedZarrRegionReader) for leaf in leaves)
    sched = Scheduler(wants, workers=2)
    sched.run()
    assert set(sched.stats.decodes.values()) == {1}
    assert len(decoded) == len(set(decoded)) == sum(len(stored_chunks(leaf.shape, leaf.layout)) for leaf in leaves)
    check()


def _half_chunk_wants(name: str = "orbax_plain_zarr2") -> tuple[list, list[Want], Callable[[], None]]:
    """Reshard's shape on orbax_plain_zarr2: each 2-d leaf whose chunks are an even number (>= 2) of
    columns wide, read as regions of half a chunk's columns and all rows, so each chunk feeds two
    regions. (leaves, wants, check): check() compares what the wants got with orbax's restore.
    (Plain zarr: tensorstore reads it, and these are its paths; an OCDBT database's chunks are
    read by LocatedZarrRegionReader, which the scheduler reads whole: test below.)"""
    ckpt = open_checkpoint(str(fixture_path(name)))
    reference = orbax_values(fixture_path(name))
    got: dict = {}
    wants = []
    leaves = [leaf for leaf in _arrays(ckpt) if len(leaf.shape) == 2 and leaf.layout.chunk_shape[1] >= 2
              and leaf.layout.chunk_shape[1] % 2 == 0]
    assert leaves
    for leaf in leaves:
        step = leaf.layout.chunk_shape[1] // 2
        for c in range(0, leaf.shape[1], step):
            region = (slice(0, leaf.shape[0]), slice(c, min(c + step, leaf.shape[1])))
            wants.append(Want([(leaf, region)], _keeper(got, (leaf.path, c)), keeps=True))

    def check() -> None:
        for leaf in leaves:
            arr = np.asarray(reference[tuple(leaf.keys)])
            step = leaf.layout.chunk_shape[1] // 2
            for c in range(0, leaf.shape[1], step):
                want = np.ascontiguousarray(arr[:, c : c + step]).tobytes()
                assert got[(leaf.path, c)][0].tobytes() == want, (leaf.path, c)

    return leaves, wants, check


def test_regions_sharing_their_chunks_are_read_as_a_cluster(monkeypatch):
    """The same shape without its chunks read into place: each region read whole, all reads started together."""
    from ckpt_tool.scheduler import planning

    monkeypatch.setattr(planning, "BATCH_BYTES", 0)
    leaves, wants, check = _half_chunk_wants()
    sched = Scheduler(wants, workers=2)
    clusters = [u for u in sched.units if u.cluster]
    assert clusters and sum(len(u.cluster) for u in clusters) == len(wants)
    sched.run()
    total = sum(len(stored_chunks(leaf.shape, leaf.layout)) for leaf in leaves)
    assert sched.planned_chunks == total and sum(sched.stats.decodes.values()) == total
    check()


def test_damaged_chunk_in_a_cluster_is_reported_as_that_chunk(tmp_path, monkeypatch):
    """A cluster whose read fails is decoded chunk by chunk: one finding, naming the bad chunk."""
    from ckpt_tool.scheduler import planning

    monkeypatch.setattr(planning, "BATCH_BYTES", 0)
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_path("orbax_plain_zarr2"), src)
    chunk = src / "layers.0.w" / "1.1"
    chunk.write_bytes(chunk.read_bytes()[:5])
    ckpt = open_checkpoint(str(src))
    leaf = next(l for l in _arrays(ckpt) if l.path == "layers/0/w")
    step = leaf.layout.chunk_shape[1] // 2
    wants = [Want([(leaf, (slice(0, leaf.shape[0]), slice(c, c + step)))], lambda arrays: 0)
             for c in range(0, leaf.shape[1], step)]
    sched = Scheduler(wants, workers=2)
    assert any(u.cluster for u in sched.units)
    failed = []
    sched.run(on_error=lambda lf, index, exc: failed.append((lf.path, index)))
    chunks = stored_chunks(leaf.shape, leaf.layout)
    bad = [i for i, c in enumerate(chunks) if c.offsets == (2, 4)]
    assert failed == [("layers/0/w", bad[0])], failed
