"""Shallow DCP validate: every storage entry holds exactly one whole item.

A `.metadata` storage entry (`_StorageInfo`: file, offset, length) moved or
resized by a few bytes so that it stays inside its data file and clear of its
neighbours used to pass shallow validate; torch's `dcp.load` fails on it
("failed finding central directory", "invalid load key", EOFError). These
are the fuzzer's remaining oracle-shallow failures, made here on purpose with
the fuzzer's own .metadata editor (fuzz_lib.edit_storage_entry) on the real
torch-written fixtures, and checked against torch itself (fuzz_oracle.check):
shallow validate must refuse each one, naming the item and its data file,
and torch must fail on the same input. The good side: archives torch loads
(every fixture, ckpt's own writer with its aligned gaps, a zip comment, the
legacy torch.save format) raise nothing.
"""
from __future__ import annotations

import io
import shutil
import os
import pickle
import struct
from pathlib import Path
from typing import Any, Callable

import pytest

import fuzz_lib as F
from conftest import FIXTURES, moto_s3_serving, run_ckpt, s3_client
from ckpt_tool.ops.validate import validate_checkpoint

torch = pytest.importorskip("torch")
from fuzz_oracle import check as oracle_check  # noqa: E402  (imports torch's DCP reader)

ZIP_FIXTURES = ["dcp_single", "dcp_multirank", "dcp_fsdp2_adam", "dcp_conj", "dcp_threads", "dcp_dups"]
ZSTD_FIXTURES = ["dcp_zstd", "dcp_dups_zstd"]


def _storage(name: str | Path) -> list[tuple[Any, Any]]:
    """(MetadataIndex, _StorageInfo) of a fixture's .metadata, by file and offset (our own fixture: trusted)."""
    path = Path(name) if isinstance(name, Path) else FIXTURES / name
    md = pickle.loads((path / ".metadata").read_bytes())
    return sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))


def _edit(root: Path, fqn: str, change: Callable[[Any], None], nth: int = 0) -> Any:
    """Rewrite root/.metadata with one storage entry changed, as the fuzzer's operators do; the entry."""
    new, info = F.edit_storage_entry((root / ".metadata").read_bytes(), fqn, change, nth)
    (root / ".metadata").write_bytes(new)
    return info


def _bound_errors(root: Path) -> list[Any]:
    report = validate_checkpoint(str(root))
    return [f for f in report.findings if f.severity == "error" and "does not hold one whole item" in f.message]


def _assert_refused(root: Path, fqn: str, data_file: str) -> None:
    """Shallow validate names the item and its data file; torch cannot load the checkpoint either."""
    found = _bound_errors(root)
    assert len(found) == 1, [f.to_json() for f in validate_checkpoint(str(root)).findings]
    f = found[0]
    assert f.code == "bad-metadata" and f.file == data_file and fqn in f.message, f.to_json()
    res = oracle_check("dcp", str(root))
    assert not res["library_ok"], res


def _first_of_each_kind(name: str) -> list[str]:
    """The fqn of the first tensor chunk and of the first non-tensor item in the fixture's storage_data."""
    tensor = next(idx.fqn for idx, _ in _storage(name) if idx.offset is not None)
    value = [idx.fqn for idx, _ in _storage(name) if idx.offset is None]
    return [tensor] + value[:1]


def _shorter(n: int) -> Callable[[Any], None]:
    def change(info: Any) -> None:
        info.length -= n
    return change


def _later(n: int) -> Callable[[Any], None]:
    def change(info: Any) -> None:  # same end: only the start moves inside the archive
        info.offset += n
        info.length -= n
    return change


def _length(n: int) -> Callable[[Any], None]:
    def change(info: Any) -> None:
        info.length = n
    return change


# a zip archive: its last byte gone, the end record cut; its first bytes gone (76: the
# distance from torch's zip64 end record to its EOCD, where a 32-bit-only check is fooled)
ZIP_CHANGES = {
    "length -1": _shorter(1),
    "length -22": _shorter(22),
    "offset +1": _later(1),
    "offset +76": _later(76),
    "length 1": _length(1),
    "length 30": _length(30),
}
# a zstd frame: torch loads one cut by its last 3 bytes (the frame's content is all
# decoded by then; validate still refuses: the entry is not the whole frame)
ZSTD_CHANGES = {
    "length -4": _shorter(4),
    "offset +1": _later(1),
    "length 1": _length(1),
    "length 5": _length(5),
}


@pytest.mark.parametrize("change", list(ZIP_CHANGES))
@pytest.mark.parametrize("name", ZIP_FIXTURES)
def test_zip_entry_not_a_whole_archive_fails_shallow_validate(tmp_path, name, change):
    for i, fqn in enumerate(_first_of_each_kind(name)):  # a tensor chunk, then a non-tensor item
        root = F.copy_fixture(name, tmp_path / str(i) / name)
        info = _edit(root, fqn, ZIP_CHANGES[change])
        _assert_refused(root, fqn, info.relative_path)


@pytest.mark.parametrize("change", list(ZSTD_CHANGES))
@pytest.mark.parametrize("name", ZSTD_FIXTURES)
def test_zstd_entry_not_a_whole_frame_fails_shallow_validate(tmp_path, name, change):
    for i, fqn in enumerate(_first_of_each_kind(name)):
        root = F.copy_fixture(name, tmp_path / str(i) / name)
        info = _edit(root, fqn, ZSTD_CHANGES[change])
        _assert_refused(root, fqn, info.relative_path)


def _sweep_cases() -> list[tuple[str, str, int, str]]:
    out = []
    for name in ("dcp_single", "dcp_zstd"):
        seen: dict[str, int] = {}
        for idx, _ in _storage(name):
            nth = seen.get(idx.fqn, 0)
            seen[idx.fqn] = nth + 1
            for how in ("ends inside", "starts inside"):
                out.append((name, idx.fqn, nth, how))
    return out


@pytest.mark.parametrize("name, fqn, nth, how", _sweep_cases(),
                         ids=[f"{n}-{q}-{i}-{h}" for n, q, i, h in _sweep_cases()])
def test_every_entry_moved_inside_its_item_is_refused(tmp_path, name, fqn, nth, how):
    """No entry of a fixture escapes: each one cut at its end, or started later, is refused and torch fails."""
    root = F.copy_fixture(name, tmp_path / name)
    zstd = name.endswith("zstd")
    change = (_shorter(4 if zstd else 1) if how == "ends inside" else _later(1))
    info = _edit(root, fqn, change, nth)
    _assert_refused(root, fqn, info.relative_path)


def test_an_offset_moved_onto_another_item_of_another_size_is_refused(tmp_path):
    """Small tensor archives all have one length (64-byte alignment): an offset moved onto another
    item's start overlaps nothing and the archive there is whole, but it holds another tensor."""
    name = "dcp_fsdp2_adam"
    entries = _storage(name)
    md = pickle.loads((FIXTURES / name / ".metadata").read_bytes())

    def sizes(idx: Any) -> Any:
        item = md.state_dict_metadata[idx.fqn]
        return next((tuple(c.sizes) for c in getattr(item, "chunks", ()) if tuple(c.offsets) == tuple(idx.offset)), None)

    pairs = [(a, b) for a in entries for b in entries
             if a[1].relative_path == b[1].relative_path and a[1].length == b[1].length and a[0] != b[0]
             and a[0].offset is not None and b[0].offset is not None and sizes(a[0]) != sizes(b[0])]
    assert pairs, "the fixture has no two same-length archives of different tensors"
    (idx, _), (other_idx, other) = pairs[0]
    root = F.copy_fixture(name, tmp_path / name)
    nth = [i for i, _ in entries if i.fqn == idx.fqn].index(idx)
    _edit(root, idx.fqn, lambda info: setattr(info, "offset", other.offset), nth)
    report = validate_checkpoint(str(root))
    found = [f for f in report.findings if "both point at bytes" in f.message]
    assert len(found) == 1 and found[0].code == "bad-metadata" and found[0].file == other.relative_path, \
        [f.to_json() for f in report.findings]
    assert idx.fqn in found[0].message and other_idx.fqn in found[0].message
    assert not oracle_check("dcp", str(root))["library_ok"]


@pytest.mark.slow
def test_the_cli_exits_1_with_one_line_naming_item_and_file(tmp_path):
    root = F.copy_fixture("dcp_multirank", tmp_path / "dcp_multirank")
    fqn = _first_of_each_kind("dcp_multirank")[0]
    info = _edit(root, fqn, _shorter(1))
    r = run_ckpt("validate", str(root))
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    lines = [ln for ln in r.stdout.splitlines() if "does not hold one whole item" in ln]
    assert len(lines) == 1 and fqn in lines[0] and info.relative_path in lines[0], r.stdout
    r = run_ckpt("validate", "--format", "github", str(root))
    assert r.returncode == 1 and "does not hold one whole item" in r.stdout and info.relative_path in r.stdout


# ---------------------------------------------------------------------------
# no false alarm: what torch loads passes
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if (p / ".metadata").is_file()))
def test_every_dcp_fixture_passes_strict(name):
    report = validate_checkpoint(str(FIXTURES / name))
    assert report.ok(True), [f.to_json() for f in report.findings]


def _rebuild(root: Path, fqn: str, transform: Callable[[bytes], bytes]) -> None:
    """Rewrite the data file holding `fqn` with that item's bytes replaced by transform(bytes),
    every entry of the file moved to match (as a writer storing that archive would have)."""
    md = pickle.loads((root / ".metadata").read_bytes())
    key = next(k for k in md.storage_data if k.fqn == fqn)
    name = md.storage_data[key].relative_path
    data = (root / name).read_bytes()
    out = bytearray()
    for k, v in sorted(((k, v) for k, v in md.storage_data.items() if v.relative_path == name),
                       key=lambda kv: kv[1].offset):
        item = data[v.offset : v.offset + v.length]
        if k == key:
            item = transform(item)
        v.offset, v.length = len(out), len(item)
        out += item
    (root / name).write_bytes(bytes(out))
    (root / ".metadata").write_bytes(pickle.dumps(md, protocol=4))


def _with_comment(archive: bytes) -> bytes:
    comment = b"saved by a zip tool that writes a comment"
    assert archive[-22:-18] == b"PK\x05\x06" and archive[-2:] == b"\x00\x00"
    return archive[:-2] + struct.pack("<H", len(comment)) + comment


def _legacy(archive: bytes) -> bytes:
    value = torch.load(io.BytesIO(archive), weights_only=True)
    buf = io.BytesIO()
    torch.save(value, buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


@pytest.mark.parametrize("how", ["zip comment", "legacy torch.save format"])
def test_archives_torch_loads_in_other_shapes_raise_nothing(tmp_path, how):
    root = F.copy_fixture("dcp_single", tmp_path / "dcp_single")
    fqns = _first_of_each_kind("dcp_single")
    for fqn in fqns:
        _rebuild(root, fqn, _with_comment if how == "zip comment" else _legacy)
    res = oracle_check("dcp", str(root))
    assert res["library_ok"], res  # torch loads them: validate must not call them damaged
    assert _bound_errors(root) == []
    if how == "zip comment":  # (ckpt's own reader takes no legacy archive: --deep would say so)
        report = validate_checkpoint(str(root), deep=True)
        assert report.ok(True), [f.to_json() for f in report.findings]


def test_ckpt_writer_output_with_aligned_gaps_passes_strict(tmp_path):
    """ckpt's DCP writer puts large archives on 4 KiB boundaries (O_DIRECT), zeros between them."""
    import numpy as np

    from ckpt_tool.base import directio
    from ckpt_tool.formats.dcp.write import DcpWriter
    from ckpt_tool.core.model import RegularGrid
    from ckpt_tool.storage import Storage
    from ckpt_tool.core.write_plan import TargetArray, WritePlan

    rng = np.random.default_rng(3)
    arrays = {"big": rng.standard_normal((700, 300)).astype(np.float32),
              "small": rng.standard_normal((3, 5)).astype(np.float32)}
    grids = {"big": (600, 200), "small": (3, 5)}
    targets = [TargetArray((k,), k, a.shape, str(a.dtype), RegularGrid(grids[k])) for k, a in arrays.items()]
    out = tmp_path / "dcp"
    writer = DcpWriter(Storage.create(str(out)))
    writer.begin(WritePlan(targets))
    for t in targets:
        a, g = arrays[t.name], grids[t.name]
        i = 0
        for r0 in range(0, a.shape[0], g[0]):
            for c0 in range(0, a.shape[1], g[1]):
                region = (slice(r0, min(r0 + g[0], a.shape[0])), slice(c0, min(c0 + g[1], a.shape[1])))
                writer.write_array(t, i, region, a[region])
                i += 1
    writer.finish_process()
    writer.commit()
    if directio.supported(str(tmp_path)):
        spans = sorted((v.offset, v.offset + v.length) for _, v in _storage(out))
        assert any(b[0] > a[1] for a, b in zip(spans, spans[1:])), spans  # there are gaps to get wrong
    report = validate_checkpoint(str(out))
    assert report.ok(True), [f.to_json() for f in report.findings]
    assert oracle_check("dcp", str(out))["library_ok"]


# ---------------------------------------------------------------------------
# remote storage: the same checks through S3 (reads issued concurrently)
# ---------------------------------------------------------------------------
@pytest.mark.slow
def test_over_s3_a_cut_entry_is_refused_and_good_ones_pass(tmp_path):
    pytest.importorskip("moto")
    bad_zip = F.copy_fixture("dcp_multirank", tmp_path / "bad_zip")
    zip_fqn = _first_of_each_kind("dcp_multirank")[1]
    zip_info = _edit(bad_zip, zip_fqn, _later(1))
    bad_zstd = F.copy_fixture("dcp_zstd", tmp_path / "bad_zstd")
    zstd_fqn = _first_of_each_kind("dcp_zstd")[0]
    zstd_info = _edit(bad_zstd, zstd_fqn, _shorter(4))
    with moto_s3_serving("ckpt-bounds", ["dcp_multirank", "dcp_zstd"]) as env:
        s3 = s3_client(env["AWS_ENDPOINT_URL"])
        for d in (bad_zip, bad_zstd):
            for f in os.listdir(d):
                s3.upload_file(str(d / f), "ckpt-bounds", f"run/{d.name}/{f}")
        for good in ("dcp_multirank", "dcp_zstd"):
            r = run_ckpt("validate", "--strict", f"s3://ckpt-bounds/run/{good}", env=env)
            assert r.returncode == 0, (r.stdout, r.stderr)
        for d, fqn, info in ((bad_zip, zip_fqn, zip_info), (bad_zstd, zstd_fqn, zstd_info)):
            r = run_ckpt("validate", f"s3://ckpt-bounds/run/{d.name}", env=env)
            lines = [ln for ln in r.stdout.splitlines() if "does not hold one whole item" in ln]
            assert r.returncode == 1 and len(lines) == 1, (r.stdout, r.stderr)
            assert fqn in lines[0] and info.relative_path in lines[0], lines[0]


@pytest.fixture(scope="module")
def big_zstd(tmp_path_factory) -> Path:
    """torch's ZStandard extension on an 8 MiB tensor that hardly compresses: a frame of 64 blocks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    path = tmp_path_factory.mktemp("big_zstd") / "dcp"
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.rand((2 << 20,), generator=g), "step": 7}
    dcp.save(state, storage_writer=FileSystemWriter(str(path), _extensions=[ZStandard()]), no_dist=True)
    return path


def test_a_long_zstd_frame_is_walked_to_its_end(big_zstd, tmp_path):
    report = validate_checkpoint(str(big_zstd))
    assert report.ok(True) and "zstd_frames_too_long_to_walk" not in report.checked, report.to_json()
    root = tmp_path / "cut"
    shutil.copytree(big_zstd, root)
    info = _edit(root, "w", _shorter(4))
    assert info.length > 64 * 4096  # the walk needs many reads past the first one
    _assert_refused(root, "w", info.relative_path)


def test_a_frame_too_long_for_the_read_budget_is_counted_not_refused(big_zstd, monkeypatch):
    from ckpt_tool.machinery.dcp import checks as dcp_checks

    monkeypatch.setattr(dcp_checks, "_ENTRY_READS_LOCAL", 2)
    report = validate_checkpoint(str(big_zstd))
    assert report.ok(True) and report.checked.get("zstd_frames_too_long_to_walk") == 1, report.to_json()
