"""`ckpt validate` on good DCP fixtures and on a corpus of damaged copies.

Damaged `.metadata` files are made the way a broken save or a careless edit
would make them: the fixture's own Metadata is loaded with real pickle and
torch (our own trusted fixture), modified, and pickled again. ckpt_tool
itself never imports torch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ckpt_tool.cli.main import cli
from ckpt_tool.base.findings import Findings
from ckpt_tool.formats import dcp as dcp_reader
from ckpt_tool.machinery.torch_save import payload as torch_payload
from ckpt_tool.core.model import Chunk
from ckpt_tool.storage import Storage
import ckpt_tool
from ckpt_tool.ops.validate import validate_checkpoint
from ckpt_tool.machinery.dcp.checks import _check_geometry, _overlapping_pairs, _Tensor, _tiles_exactly, _uncovered, _MAX_GAP_BOXES

from conftest import DCP_FIXTURES, fixture_path, mutate_bytes

# one-process torch saves warn that they assume no process group
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def codes(report, severity: str = "error") -> list[tuple[str, str | None, str | None]]:
    return [(f.code, f.leaf, f.file) for f in report.findings if f.severity == severity]


def only(report, code: str):
    [finding] = [f for f in report.findings if f.code == code]
    return finding


# ---------------------------------------------------------------------------
# helpers: rewrite .metadata with real torch
# ---------------------------------------------------------------------------
def edit_metadata(path: Path, change: Callable[[Any], None]) -> None:
    """Load .metadata with torch's own classes, apply `change`, write it back as torch would."""
    pytest.importorskip("torch")
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own committed fixture: trusted
    change(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=4)


def set_chunk(md: Any, fqn: str, i: int, offsets: list[int], sizes: list[int]) -> None:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    md.state_dict_metadata[fqn].chunks[i] = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def storage_key(md: Any, fqn: str, offsets: list[int] | None) -> Any:
    return next(
        k for k in md.storage_data
        if k.fqn == fqn and (k.offset is None if offsets is None else list(k.offset) == offsets)
    )


def flip_data_byte(path: Path, fqn: str, at: int = 5) -> None:
    """Flip one byte inside the first chunk's raw tensor data (not its zip headers or pickle)."""
    leaf = next(leaf for leaf in dcp_reader.read(Storage.open(str(path))).arrays() if leaf.name == fqn)
    entry = leaf.extra["storage"][0]  # {"file", "offset", "length"} of the chunk's torch.save archive
    data_file = path / entry["file"]
    blob = bytearray(data_file.read_bytes())
    archive = bytes(blob[entry["offset"] : entry["offset"] + entry["length"]])
    payload = torch_payload.open_payload(archive, "test").tensor()
    assert at < payload.data_length
    blob[entry["offset"] + payload.data_offset + at] ^= 0x01
    data_file.write_bytes(bytes(blob))


# ---------------------------------------------------------------------------
# good checkpoints
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", DCP_FIXTURES)
@pytest.mark.parametrize("deep", [False, True])
def test_good_fixture_has_no_finding(name, deep):
    report = validate_checkpoint(str(fixture_path(name)), deep=deep)
    assert report.format == "dcp"
    assert report.findings == []
    assert report.ok(strict=True)


def test_counts():
    single = validate_checkpoint(str(fixture_path("dcp_single"))).checked
    assert single == {"tensors": 13, "chunks": 13, "bytes_items": 10, "files": 1}
    multi = validate_checkpoint(str(fixture_path("dcp_multirank"))).checked
    # 17 chunks include model.tiny's empty chunk on rank 1 (legal: it covers nothing)
    assert multi == {"tensors": 10, "chunks": 17, "bytes_items": 6, "files": 2}


# ---------------------------------------------------------------------------
# data files
# ---------------------------------------------------------------------------
def test_empty_rank_file_names_the_file_and_its_items(copy_fixture):
    # seed 002: one host's data file written empty
    path = copy_fixture("dcp_multirank")
    (path / "__1_0.distcp").write_bytes(b"")
    report = validate_checkpoint(str(path))
    assert codes(report) == [("empty-file", None, "__1_0.distcp")]
    message = report.findings[0].message
    assert "16 items in it" in message
    # tensor chunks by fqn and region, non-tensor items by fqn
    for item in ("model.w[3:6, 0:4]", "model.tiny[1:1, 0:3]", "model.rep[0:6]", "optim.param_groups.0.lr", "run.world_size"):
        assert item in message
    assert "model.w[0:3, 0:4]" not in message  # rank 0's chunk is in __0_0.distcp


def test_empty_file_with_one_leaf_names_the_leaf(tmp_path):
    path = save_with_torch(tmp_path, {"w": ("float32", (4, 4))})
    (path / "__0_0.distcp").write_bytes(b"")
    report = validate_checkpoint(str(path))
    assert codes(report) == [("empty-file", "w", "__0_0.distcp")]
    assert "w[0:4, 0:4]" in report.findings[0].message


def test_truncated_file_names_size_and_items_past_the_end(copy_fixture):
    path = copy_fixture("dcp_single")
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:30000])
    report = validate_checkpoint(str(path))
    assert codes(report) == [("truncated-file", None, "__0_0.distcp")]
    message = report.findings[0].message
    assert "has 30000 bytes" in message and "needs 34071" in message
    # entries [29276, 30853) model.temperature (0-d), [30853, 32494) model.conv and
    # [32494, 34071) history.0 end past byte 30000; model.fp8 ends at 29276
    assert "3 items past its end: model.temperature, model.conv[0:2, 0:3, 0:4], history.0[0:3]" in message
    assert "model.fp8" not in message


def test_missing_data_file(copy_fixture):
    path = copy_fixture("dcp_multirank")
    (path / "__0_0.distcp").unlink()
    report = validate_checkpoint(str(path))
    assert codes(report) == [("missing-file", None, "__0_0.distcp")]
    assert "model.w[0:3, 0:4]" in report.findings[0].message


def test_stray_data_file_is_a_warning(copy_fixture):
    path = copy_fixture("dcp_multirank")
    (path / "__9_0.distcp").write_bytes(b"PK\x03\x04 left over")
    report = validate_checkpoint(str(path))
    assert codes(report) == []
    assert codes(report, "warning") == [("stray-file", None, "__9_0.distcp")]
    assert report.ok() and not report.ok(strict=True)


def test_symlink_out_of_the_checkpoint_is_path_escape(copy_fixture, tmp_path):
    path = copy_fixture("dcp_multirank")
    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes((path / "__1_0.distcp").read_bytes())
    (path / "__1_0.distcp").unlink()
    (path / "__1_0.distcp").symlink_to(outside)
    report = validate_checkpoint(str(path))
    assert codes(report) == [("path-escape", None, "__1_0.distcp")]
    assert "outside the checkpoint" in report.findings[0].message


def test_fifo_data_file_is_path_escape_and_is_not_opened(copy_fixture):
    path = copy_fixture("dcp_multirank")
    (path / "__1_0.distcp").unlink()
    os.mkfifo(path / "__1_0.distcp")  # opening it for reading would block forever
    report = validate_checkpoint(str(path))
    assert codes(report) == [("path-escape", None, "__1_0.distcp")]
    assert "not a regular file" in report.findings[0].message


# ---------------------------------------------------------------------------
# .metadata itself
# ---------------------------------------------------------------------------
def test_missing_metadata_lists_the_data_files(copy_fixture):
    path = copy_fixture("dcp_multirank")
    (path / ".metadata").unlink()
    report = validate_checkpoint(str(path))
    assert report.format == "dcp"
    assert codes(report) == [("missing-metadata", None, ".metadata")]
    message = report.findings[0].message
    assert "shared directory" in message and "__0_0.distcp, __1_0.distcp" in message


def test_leftover_metadata_tmp_beside_metadata_is_a_warning(copy_fixture):
    path = copy_fixture("dcp_single")
    (path / ".metadata.tmp").write_bytes((path / ".metadata").read_bytes()[:100])
    report = validate_checkpoint(str(path))
    assert codes(report) == []
    assert codes(report, "warning") == [("stray-file", None, ".metadata.tmp")]


def test_metadata_tmp_never_renamed_is_an_uncommitted_save(copy_fixture):
    path = copy_fixture("dcp_single")
    (path / ".metadata").rename(path / ".metadata.tmp")
    report = validate_checkpoint(str(path))
    assert codes(report) == [("uncommitted-save", None, ".metadata.tmp"), ("missing-metadata", None, ".metadata")]


class _RunsCommand:
    """A pickle that would run a shell command when loaded by pickle.load."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_metadata_pickling_os_system_is_refused_and_nothing_runs(copy_fixture, tmp_path):
    path = copy_fixture("dcp_single")
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}"), protocol=4))
    report = validate_checkpoint(str(path), deep=True)
    assert ("unsafe-pickle", None, ".metadata") in codes(report)
    assert "system" in only(report, "unsafe-pickle").message  # names the refused global (posix.system)
    assert not marker.exists()


def test_metadata_fifo_is_refused_without_blocking(copy_fixture):
    path = copy_fixture("dcp_single")
    (path / ".metadata").unlink()
    os.mkfifo(path / ".metadata")  # reading it would block forever
    report = validate_checkpoint(str(path))
    assert codes(report) == [("path-escape", None, ".metadata")]


def test_unparseable_metadata(copy_fixture):
    path = copy_fixture("dcp_single")
    (path / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    report = validate_checkpoint(str(path))
    assert codes(report) == [("bad-metadata", None, ".metadata")]


def test_metadata_of_the_wrong_type(copy_fixture):
    path = copy_fixture("dcp_single")
    (path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}, protocol=4))
    report = validate_checkpoint(str(path))
    assert codes(report) == [("bad-metadata", None, ".metadata")]
    assert "expected a DCP Metadata object" in report.findings[0].message


# ---------------------------------------------------------------------------
# chunk geometry, from a re-pickled .metadata
# ---------------------------------------------------------------------------
def test_removed_chunk_is_a_coverage_gap_with_its_exact_region(copy_fixture):
    path = copy_fixture("dcp_multirank")
    edit_metadata(path, lambda md: md.state_dict_metadata["model.w"].chunks.pop(1))
    report = validate_checkpoint(str(path))
    assert codes(report) == [("coverage-gap", "model/w", ".metadata")]
    assert "region [3:6, 0:4] is covered by no chunk (12 of 24 elements)" in report.findings[-1].message
    # its storage entry now belongs to nothing
    assert codes(report, "warning") == [("orphan-storage-entry", "model/w", ".metadata")]


def test_shrunk_chunk_leaves_a_partial_gap(copy_fixture):
    path = copy_fixture("dcp_multirank")
    # model.col is bfloat16 3x4 split by columns: [0:3, 0:2] and [0:3, 2:4]
    edit_metadata(path, lambda md: set_chunk(md, "model.col", 1, [0, 2], [2, 1]))
    report = validate_checkpoint(str(path))
    assert codes(report) == [("coverage-gap", "model/col", ".metadata")]
    # the uncovered L-shape, as two disjoint boxes
    assert "regions [0:3, 3:4], [2:3, 2:3] are covered by no chunk (4 of 12 elements)" in report.findings[0].message


def test_overlapping_chunks(copy_fixture):
    path = copy_fixture("dcp_multirank")
    edit_metadata(path, lambda md: set_chunk(md, "model.w", 0, [0, 0], [4, 4]))
    report = validate_checkpoint(str(path))
    assert codes(report) == [("chunk-overlap", "model/w", ".metadata")]
    message = report.findings[0].message
    assert "offsets [0, 0] sizes [4, 4]" in message and "offsets [3, 0] sizes [3, 4]" in message
    assert "both cover [3:4, 0:4]" in message


def test_chunk_past_the_bounds(copy_fixture):
    path = copy_fixture("dcp_multirank")
    edit_metadata(path, lambda md: set_chunk(md, "model.uneven", 1, [3, 0], [3, 3]))
    report = validate_checkpoint(str(path))
    assert codes(report) == [("chunk-out-of-bounds", "model/uneven", ".metadata")]
    assert "region [3:6, 0:3]" in report.findings[0].message and "shape [5, 3]" in report.findings[0].message


def test_empty_chunk_is_legal_but_needs_its_entry(copy_fixture):
    path = copy_fixture("dcp_multirank")
    edit_metadata(path, lambda md: md.storage_data.pop(storage_key(md, "model.tiny", [1, 0])))
    report = validate_checkpoint(str(path))
    assert codes(report) == [("missing-storage-entry", "model/tiny", ".metadata")]
    assert "offsets [1, 0], sizes [0, 3]" in report.findings[0].message


def test_removed_storage_entry(copy_fixture):
    path = copy_fixture("dcp_multirank")

    def drop(md: Any) -> None:
        md.storage_data.pop(storage_key(md, "model.uneven", [3, 0]))
        md.storage_data.pop(storage_key(md, "step", None))

    edit_metadata(path, drop)
    report = validate_checkpoint(str(path))
    assert codes(report) == [
        ("missing-storage-entry", "model/uneven", ".metadata"),
        ("missing-storage-entry", "step", ".metadata"),
    ]
    assert "model.uneven[3:5, 0:3]" in report.findings[0].message


def test_malformed_storage_entry_is_reported_once(copy_fixture):
    path = copy_fixture("dcp_multirank")

    def corrupt(md: Any) -> None:
        key = storage_key(md, "model.half", [0, 3])
        md.storage_data[key] = dataclasses.replace(md.storage_data[key], length=-1)

    edit_metadata(path, corrupt)
    report = validate_checkpoint(str(path))
    # bad-metadata for the entry, not also missing-storage-entry for its chunk
    assert codes(report) == [("bad-metadata", "model/half", ".metadata")]
    assert "invalid byte range" in report.findings[0].message


def test_storage_entry_climbing_out_is_path_escape(copy_fixture, tmp_path):
    path = copy_fixture("dcp_multirank")
    # a real file is there, so the refusal is about the path, not a missing file
    (tmp_path / "x.distcp").write_bytes((path / "__1_0.distcp").read_bytes())

    def escape(md: Any) -> None:
        key = storage_key(md, "model.w", [3, 0])
        md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path="../x.distcp")

    edit_metadata(path, escape)
    for deep in (False, True):
        report = validate_checkpoint(str(path), deep=deep)
        assert ("path-escape", "model/w", "../x.distcp") in codes(report)
        assert "model.w[3:6, 0:4]" in only(report, "path-escape").message
        assert all(f.file != "x.distcp" for f in report.findings)


def test_entry_in_a_file_that_the_listing_lacks_is_missing_file(copy_fixture):
    path = copy_fixture("dcp_single")

    def move(md: Any) -> None:
        key = storage_key(md, "step", None)
        md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path="__3_0.distcp")

    edit_metadata(path, move)
    assert codes(validate_checkpoint(str(path))) == [("missing-file", "step", "__3_0.distcp")]


# ---------------------------------------------------------------------------
# --deep: flipped bytes in a chunk's raw data, caught by the zip member's CRC-32
# ---------------------------------------------------------------------------
def test_flipped_byte_in_chunk_data_is_caught_by_deep_only(copy_fixture):
    path = copy_fixture("dcp_multirank")
    flip_data_byte(path, "model.uneven")  # rank 0's chunk
    assert validate_checkpoint(str(path)).findings == []
    deep = validate_checkpoint(str(path), deep=True)
    assert [(c, leaf) for c, leaf, _ in codes(deep)] == [("bad-chunk", "model/uneven")]
    assert "CRC-32" in deep.findings[0].message


def save_with_torch(tmp_path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> Path:
    """A real one-process DCP save of the given float tensors, in tmp_path/ckpt."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(0)
    state = {name: torch.rand(shape, generator=gen).to(getattr(torch, dtype)) for name, (dtype, shape) in tensors.items()}
    path = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=str(path))
    return path


def test_flipped_byte_in_a_large_chunk_read_by_ranges(tmp_path):
    # a 256 KiB chunk is bigger than the reader's whole-archive read: its data
    # comes from a separate ranged read, which must still be CRC-checked
    path = save_with_torch(tmp_path, {"big": ("float32", (256, 256)), "small": ("float32", (3,))})
    assert validate_checkpoint(str(path), deep=True).findings == []
    flip_data_byte(path, "big", at=200_000)
    assert validate_checkpoint(str(path)).findings == []
    deep = validate_checkpoint(str(path), deep=True)
    assert [(c, leaf) for c, leaf, _ in codes(deep)] == [("bad-chunk", "big")]


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------
def test_cli_exit_code_and_json(copy_fixture):
    runner = CliRunner()
    good = runner.invoke(cli, ["validate", str(fixture_path("dcp_multirank"))])
    assert good.exit_code == 0 and "OK: 0 errors" in good.output
    path = copy_fixture("dcp_multirank")
    (path / "__1_0.distcp").write_bytes(b"")
    bad = runner.invoke(cli, ["validate", str(path)])
    assert bad.exit_code == 1 and "FAILED: 1 error" in bad.output and "empty-file" in bad.output
    result = runner.invoke(cli, ["validate", str(path), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert doc["ok"] is False and doc["format"] == "dcp"
    assert doc["findings"] == [{
        "severity": "error", "code": "empty-file", "leaf": None, "file": "__1_0.distcp",
        "message": doc["findings"][0]["message"],
    }]
    assert doc["checked"] == {"tensors": 10, "chunks": 17, "bytes_items": 6, "files": 2}


# ---------------------------------------------------------------------------
# fuzz: a damaged .metadata becomes findings, never an exception
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_copy(tmp_path_factory) -> Path:
    import shutil

    path = tmp_path_factory.mktemp("fuzz") / "dcp_multirank"
    shutil.copytree(fixture_path("dcp_multirank"), path)
    return path


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6))
@example(edits=[(0, 456271, 67)])  # a memory_format that unpickles as a list (unhashable): was a TypeError
def test_fuzz_mutated_metadata_never_raises(fuzz_copy, edits):
    (fuzz_copy / ".metadata").write_bytes(mutate_bytes((fixture_path("dcp_multirank") / ".metadata").read_bytes(), edits))
    report = validate_checkpoint(str(fuzz_copy))
    assert report.format == "dcp"


_ODD_PATHS = ["../x.distcp", "/etc/passwd", "a\x00b", "", "sub/__0_0.distcp", "__7_0.distcp", "__1_0.distcp", 5]
_ODD_INTS = st.one_of(st.integers(-3, 12), st.just(1 << 62))


@st.composite
def metadata_edits(draw) -> list[tuple]:
    """Structural damage to a Metadata object: what a buggy writer or a hand edit could produce."""
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["chunk", "drop-chunk", "drop-entry", "path", "range", "size", "junk"]))
        edits.append((kind, draw(st.integers(0, 1000)), draw(st.lists(_ODD_INTS, min_size=0, max_size=3)),
                      draw(st.sampled_from(_ODD_PATHS))))
    return edits


def _apply(md: Any, edits: list[tuple]) -> None:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    for kind, pick, ints, path in edits:
        tensors = [k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
        keys = list(md.storage_data)
        item = md.state_dict_metadata[tensors[pick % len(tensors)]]
        if kind == "chunk" and item.chunks:
            i = pick % len(item.chunks)
            old = item.chunks[i]
            offsets = list(old.offsets)
            offsets[: len(ints)] = ints[: len(offsets)]
            item.chunks[i] = ChunkStorageMetadata(torch.Size(offsets), old.sizes if pick % 2 else torch.Size(offsets))
        elif kind == "drop-chunk" and item.chunks:
            item.chunks.pop(pick % len(item.chunks))
        elif kind == "drop-entry" and keys:
            md.storage_data.pop(keys[pick % len(keys)])
        elif kind == "path" and keys:
            key = keys[pick % len(keys)]
            md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path=path)
        elif kind == "range" and keys and ints:
            key = keys[pick % len(keys)]
            md.storage_data[key] = dataclasses.replace(md.storage_data[key], offset=ints[0], length=ints[-1])
        elif kind == "size":
            item.size = torch.Size([abs(v) % 9 for v in ints])
        elif kind == "junk":
            md.state_dict_metadata[tensors[pick % len(tensors)]] = [None, path] if pick % 2 else item.chunks


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata_edits())
def test_fuzz_structurally_damaged_metadata_never_raises(fuzz_copy, edits):
    pytest.importorskip("torch")  # unpickling the fixture needs torch's classes
    with open(fixture_path("dcp_multirank") / ".metadata", "rb") as f:
        md = pickle.load(f)
    _apply(md, edits)
    with open(fuzz_copy / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=4)
    report = validate_checkpoint(str(fuzz_copy))
    assert report.format == "dcp"


# ---------------------------------------------------------------------------
# the geometry helpers against brute force
# ---------------------------------------------------------------------------
@st.composite
def shapes_and_boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        box = []
        for n in shape:
            lo = draw(st.integers(0, n - 1))
            box.append((lo, draw(st.integers(lo + 1, n))))
        boxes.append(tuple(box))
    return shape, boxes


@st.composite
def grids_with_damage(draw):
    """A tiling as torch shards (per-dimension partitions, every combination once), maybe damaged."""
    import itertools

    shape, partitions = [], []
    for _ in range(draw(st.integers(1, 3))):
        cuts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))  # interval widths
        edges = [0, *itertools.accumulate(cuts)]
        shape.append(edges[-1])
        partitions.append(list(zip(edges, edges[1:])))
    boxes = list(itertools.product(*partitions))
    damage = draw(st.sampled_from(["none", "drop", "duplicate", "grow", "shrink"]))
    i = draw(st.integers(0, len(boxes) - 1))
    if damage == "drop":
        boxes.pop(i)
    elif damage == "duplicate":
        boxes.append(boxes[i])
    elif damage in ("grow", "shrink"):
        d = draw(st.integers(0, len(shape) - 1))
        lo, hi = boxes[i][d]
        hi = min(shape[d], hi + 1) if damage == "grow" else max(lo + 1, hi - 1)
        boxes[i] = boxes[i][:d] + ((lo, hi),) + boxes[i][d + 1:]
    return tuple(shape), boxes


def _mask(shape, boxes) -> np.ndarray:
    mask = np.zeros(shape, dtype=int)
    for box in boxes:
        mask[tuple(slice(lo, hi) for lo, hi in box)] += 1
    return mask


@settings(max_examples=200, deadline=None)
@given(shapes_and_boxes())
def test_uncovered_regions_are_exact(case):
    shape, boxes = case
    missing, regions, more = _uncovered(shape, boxes)
    free = _mask(shape, boxes) == 0
    assert missing == int(free.sum())
    listed = _mask(shape, regions)
    if more:
        # the gaps fell into more boxes than are listed: the listed ones are
        # disjoint and free, and some free elements are left unlisted
        assert len(regions) == _MAX_GAP_BOXES
        assert listed.max() == 1 and not listed[~free].any()
        assert listed.sum() < free.sum()
    else:
        # the regions are disjoint and cover exactly the free elements
        assert np.array_equal(listed, free.astype(int))


@settings(max_examples=200, deadline=None)
@given(shapes_and_boxes())
def test_overlap_sweep_finds_exactly_the_overlapping_pairs(case):
    shape, boxes = case
    chunks = [(Chunk(tuple(lo for lo, _ in b), tuple(hi - lo for lo, hi in b)), b) for b in boxes]
    found = {(a, b) for a, b, _ in _overlapping_pairs(chunks)}
    found = {frozenset((a, b)) if a != b else frozenset((a,)) for a, b in found}
    expected = set()
    for i, (ca, ba) in enumerate(chunks):
        for cb, bb in chunks[i + 1:]:
            if all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(ba, bb)):
                expected.add(frozenset((ca, cb)) if ca != cb else frozenset((ca,)))
    assert found == expected


@settings(max_examples=300, deadline=None)
@given(st.one_of(shapes_and_boxes(), grids_with_damage()))
def test_geometry_findings_match_brute_force(case):
    shape, boxes = case
    chunks = [Chunk(tuple(lo for lo, _ in b), tuple(hi - lo for lo, hi in b)) for b in boxes]
    findings = Findings()
    _check_geometry(_Tensor("t", "t", shape, chunks), findings)
    found = {f.code for f in findings.items}
    mask = _mask(shape, boxes)
    assert ("coverage-gap" in found) == bool((mask == 0).any())
    assert ("chunk-overlap" in found) == bool((mask > 1).any())
    # the fast path is sufficient, never wrong (a non-grid tiling takes the slow path)
    if _tiles_exactly(shape, boxes):
        assert (mask == 1).all()


def test_deep_checks_crc_of_chunks_read_in_blocks(tmp_path, monkeypatch):
    """A chunk bigger than the deep block size is decoded in blocks; its CRC is still checked."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpt_tool.ops.validate import deep

    path = tmp_path / "big"
    dcp.save({"w": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)}, checkpoint_id=str(path))
    monkeypatch.setattr(deep, "BLOCK_BYTES", 1024)  # the 16 KiB chunk is read in 16 blocks
    assert validate_checkpoint(str(path), deep=True).ok()
    leaf = ckpt_tool.open(str(path))["w"]
    entry = leaf.extra["storage"][0]
    data_file = path / entry["file"]
    raw = bytearray(data_file.read_bytes())
    # flip a bit in the middle of the tensor data: -0.0 vs 0.0 style changes still decode fine
    middle = entry["offset"] + entry["length"] // 2
    raw[middle] ^= 0x01
    data_file.write_bytes(bytes(raw))
    report = validate_checkpoint(str(path), deep=True)
    assert [(f.code, f.leaf) for f in report.findings if f.severity == "error"] == [("bad-chunk", "w")]
    assert "CRC-32" in report.findings[0].message
