"""DCP saves other writers make (fixtures/gen_dcp_variants.py, real torch 2.13):
conj/neg views, the ZStandard extension, kept replicated duplicates, thread_count=4.

Every value is compared with what torch itself loads (`dcp_to_torch_save` +
`torch.load`, views resolved with torch's own resolve_conj/resolve_neg), and
after convert with what orbax restores / torch loads from ckpt's output.
"""
from __future__ import annotations

import json
import os
import pickle
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import cli
from ckpt_tool.machinery.torch_save import payload as torch_payload
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import fixture_path, run_ckpt
from library_reference import _tensor_to_numpy, dcp_chunks, dcp_keys, dcp_reference, orbax_values

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

VARIANTS = ["dcp_conj", "dcp_zstd", "dcp_dups", "dcp_dups_replicated", "dcp_dups_zstd", "dcp_threads"]
runner = CliRunner()


def ckpt(*args: str) -> tuple[int, str]:
    result = runner.invoke(cli, list(args))
    return result.exit_code, result.output


def torch_values(path) -> dict[tuple, object]:
    """{key path: value} as torch loads the checkpoint: dcp_to_torch_save, torch.load, views resolved."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    keys = dcp_keys(path)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(os.fspath(path), os.path.join(tmp, "full.pt"))
        sd = torch.load(os.path.join(tmp, "full.pt"), weights_only=False)
    out = {}
    for kp in keys.values():
        obj = sd
        for k in kp:
            obj = obj[k]
        if isinstance(obj, torch.Tensor):
            obj = _tensor_to_numpy(obj.resolve_conj().resolve_neg())
        out[kp] = obj
    return out


def dcp_load_values(path, template: dict) -> dict[tuple, np.ndarray]:
    """torch.distributed.checkpoint.load into zero tensors shaped like `template` (key path -> numpy)."""
    import torch.distributed.checkpoint as dcp

    state: dict = {}
    for kp, arr in template.items():
        node = state
        for k in kp[:-1]:
            node = node.setdefault(k, {})
        node[kp[-1]] = torch.zeros(arr.shape, dtype=_torch_dtype(arr.dtype))
    dcp.load(state, checkpoint_id=os.fspath(path))
    out = {}
    for kp in template:
        node = state
        for k in kp:
            node = node[k]
        out[kp] = _tensor_to_numpy(node)
    return out


def _torch_dtype(dtype: np.dtype):
    return getattr(torch, "bfloat16" if dtype.name == "bfloat16" else dtype.name)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def ckpt_arrays(path) -> dict[tuple, np.ndarray]:
    return {tuple(leaf.keys): leaf.read() for leaf in ckpt_tool.open(str(path)).arrays()}


# ---------------------------------------------------------------------------
# the fixtures are what they claim to be
# ---------------------------------------------------------------------------
def test_fixtures_hold_the_variants():
    conj = _rebuild_metadata(fixture_path("dcp_conj"))
    assert conj["model.conj"] == {"conj": True}
    assert conj["model.neg_real"] == {"neg": True}
    assert conj["model.conj_neg"] == {"conj": True, "neg": True}
    assert conj["model.plain"] is None

    from torch.distributed.checkpoint import FileSystemReader

    zstd = FileSystemReader(str(fixture_path("dcp_zstd"))).read_metadata()
    assert {tuple(i.transform_descriptors) for i in zstd.storage_data.values()} == {("stream.zstd/1",)}
    chunks = dcp_chunks(fixture_path("dcp_dups"))
    assert chunks["model.rep"] == [((0, 0), (4, 3))] * 2  # the same chunk once per rank
    sizes = {f: os.path.getsize(fixture_path("dcp_threads") / f) for f in os.listdir(fixture_path("dcp_threads"))}
    assert sorted(f for f, n in sizes.items() if n == 0) == ["__0_2.distcp", "__0_3.distcp"]


def _rebuild_metadata(path: Path) -> dict[str, dict | None]:
    """fqn -> the metadata dict torch.save appended to the chunk's rebuild call (None: none)."""
    import io
    import pickletools
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        if index.offset is None:
            continue
        blob = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(pkl)]
        keys = [arg for i, (name, arg) in enumerate(ops) if name == "BINUNICODE" and arg in ("conj", "neg")]
        out[index.fqn] = {k: True for k in keys} or None
    return out


# ---------------------------------------------------------------------------
# inspect and validate
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", VARIANTS)
def test_inspect_matches_torch_metadata(name):
    code, out = ckpt("inspect", str(fixture_path(name)), "--json")
    assert code == 0, out
    doc = json.loads(out)
    ref = dcp_reference(fixture_path(name))
    got = {
        tuple(leaf["keys"]): (tuple(leaf["shape"]), leaf["dtype"]) if leaf["kind"] == "array" else None
        for leaf in doc["leaves"]
    }
    assert got == ref
    # chunk counts are the distinct chunks torch lists (a kept duplicate counts once)
    chunks = dcp_chunks(fixture_path(name))
    for leaf in doc["leaves"]:
        if leaf["kind"] == "array":
            assert leaf["chunks"] == len(set(chunks[leaf["name"]])), leaf["name"]


def test_inspect_notes_duplicates_and_zstd():
    notes = ckpt_tool.open(str(fixture_path("dcp_dups"))).notes
    assert any("listed more than once" in n for n in notes), notes
    rep = ckpt_tool.open(str(fixture_path("dcp_dups")))["model/rep"]
    assert rep.extra["duplicate_chunks"] == 1 and len(rep.layout.chunks) == 1
    notes = ckpt_tool.open(str(fixture_path("dcp_zstd"))).notes
    assert any("stream.zstd/1" in n and "not readable" not in n for n in notes), notes


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("deep", [False, True])
def test_validate_strict_passes(name, deep):
    args = ["validate", str(fixture_path(name)), "--strict", "--json"] + (["--deep"] if deep else [])
    code, out = ckpt(*args)
    doc = json.loads(out)
    assert code == 0 and doc["findings"] == [], doc
    if deep and name.startswith("dcp_dups"):
        assert doc["checked"]["duplicate_copies_compared"] == 2  # both dropped copies found and compared


def test_validate_deep_of_zstd_imports_neither_torch_nor_jax():
    # inspect / validate of a zstd save must not pull in torch or jax
    import subprocess
    import sys

    code = (
        "import sys, ckpt_tool; from ckpt_tool.ops.validate import validate_checkpoint; "
        f"r = validate_checkpoint({str(fixture_path('dcp_zstd'))!r}, deep=True); assert r.ok(strict=True); "
        "assert 'torch' not in sys.modules and 'jax' not in sys.modules, [m for m in sys.modules if m.split('.')[0] in ('torch', 'jax')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------
# values: ckpt's read == torch's load
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", VARIANTS)
def test_values_equal_torch(name):
    want = torch_values(fixture_path(name))
    ck = ckpt_tool.open(str(fixture_path(name)))
    for leaf in ck.leaves:
        expected = want[tuple(leaf.keys)]
        if leaf.kind == "array":
            assert same(leaf.read(), expected), leaf.path
        else:
            assert leaf.load() == expected, leaf.path


def test_conj_views_read_conjugated():
    """The old reader returned the stored (unconjugated, unnegated) values: this fails on it."""
    ck = ckpt_tool.open(str(fixture_path("dcp_conj")))
    plain = ck["model/plain"].read()
    assert np.array_equal(ck["model/conj"].read(), np.conj(plain))
    assert np.array_equal(ck["model/conj_t"].read(), np.conj(plain.T))
    want = torch_values(fixture_path("dcp_conj"))
    for path in ("model/conj", "model/conj_t", "model/neg_complex", "model/conj_neg", "model/neg_real"):
        got = ck[path].read()
        assert same(got, want[tuple(path.split("/"))]), path
        stored = _stored_values(fixture_path("dcp_conj"), path.replace("/", "."))
        assert not np.array_equal(got, stored), path  # the bits changed something


def _stored_values(path: Path, fqn: str) -> np.ndarray:
    """The chunk's stored values with its view bits ignored (what the reader used to return)."""
    leaf = next(l for l in ckpt_tool.open(str(path)).arrays() if l.name == fqn)
    entry = leaf.extra["storage"][0]
    blob = (path / entry["file"]).read_bytes()[entry["offset"] : entry["offset"] + entry["length"]]
    archive = torch_payload.open_payload(blob, "test")
    payload = archive.tensor()
    import dataclasses

    return archive.read_tensor(dataclasses.replace(payload, conj=False, neg=False))


def test_region_reads_of_conj_and_zstd_chunks():
    want = torch_values(fixture_path("dcp_conj"))
    leaf = ckpt_tool.open(str(fixture_path("dcp_conj")))["model/conj_t"]
    assert same(leaf[1:4, 2:3], want[("model", "conj_t")][1:4, 2:3])
    # a zstd chunk decoding to ~300 KiB: regions from its middle and end
    want = torch_values(fixture_path("dcp_zstd"))[("model", "big")]
    leaf = ckpt_tool.open(str(fixture_path("dcp_zstd")))["model/big"]
    for region in [(slice(150, 152), slice(None)), (slice(10, 290), slice(3, 200)), (slice(299, 300), slice(250, 256))]:
        assert same(leaf[region], want[region]), region


def test_conj_region_reads_only_the_regions_bytes(monkeypatch):
    from ckpt_tool.storage import Storage

    ck = ckpt_tool.open(str(fixture_path("dcp_conj")))
    leaf = ck["model/conj"]
    leaf.read((slice(0, 1), slice(0, 1)))  # locate the chunk (zip headers) first
    reads: list[int] = []
    real_range, real_into = Storage.read_range, Storage.read_range_into

    def spy_range(self, key, start, end):
        reads.append(end - start)
        return real_range(self, key, start, end)

    def spy_into(self, key, start, buffer):
        reads.append(memoryview(buffer).nbytes)
        return real_into(self, key, start, buffer)

    monkeypatch.setattr(Storage, "read_range", spy_range)
    monkeypatch.setattr(Storage, "read_range_into", spy_into)
    got = leaf.read((slice(2, 3), slice(1, 3)))
    # 2 complex64 elements: 16 bytes read (the chunk is 4x6, 192 bytes)
    assert reads == [16], reads
    assert np.array_equal(got, np.conj(ck["model/plain"].read()[2:3, 1:3]))


def test_diff_sees_the_conjugation(tmp_path):
    """diff against torch's own materialised copy: the same; against the stored values (bits ignored): differs."""
    import torch.distributed.checkpoint as dcp

    from ckpt_tool.ops.diff import diff_checkpoints

    src = fixture_path("dcp_conj")
    resolved = {"model": {}, "step": 7}
    stored = {"model": {}, "step": 7}
    for kp, value in torch_values(src).items():
        if isinstance(value, np.ndarray):
            resolved["model"][kp[1]] = torch.from_numpy(value.copy())
            stored["model"][kp[1]] = torch.from_numpy(_stored_values(src, ".".join(kp)).copy())
    dcp.save(resolved, checkpoint_id=str(tmp_path / "resolved"))
    dcp.save(stored, checkpoint_id=str(tmp_path / "stored"))
    assert diff_checkpoints(ckpt_tool.open(str(src)), ckpt_tool.open(str(tmp_path / "resolved")), values=True).same
    report = diff_checkpoints(ckpt_tool.open(str(src)), ckpt_tool.open(str(tmp_path / "stored")), values=True)
    assert sorted(d.path for d in report.differences) == [
        "model/conj", "model/conj_neg", "model/conj_t", "model/neg_complex", "model/neg_real"
    ]


# ---------------------------------------------------------------------------
# convert: orbax restores, torch loads the round trip
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each variant converted to orbax and to DCP (once per module: the conversions are the slow part)."""
    base = tmp_path_factory.mktemp("converted")
    out = {}
    for name in VARIANTS:
        for to in ("orbax", "dcp"):
            dst = base / f"{name}.{to}"
            code, text = ckpt("convert", str(fixture_path(name)), str(dst), "--to", to)
            assert code == 0, text
            out[(name, to)] = dst
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_convert_to_orbax_restores_torchs_values(name, converted):
    want = torch_values(fixture_path(name))
    got = orbax_values(converted[(name, "orbax")])
    arrays = {kp: v for kp, v in want.items() if isinstance(v, np.ndarray)}
    for kp, expected in arrays.items():
        assert same(np.asarray(got[kp]), expected), kp
    assert validate_checkpoint(str(converted[(name, "orbax")]), deep=True).ok(strict=True)


@pytest.mark.parametrize("name", VARIANTS)
def test_convert_to_dcp_loads_in_torch(name, converted):
    dst = converted[(name, "dcp")]
    want = torch_values(fixture_path(name))
    # structure: the same keys, shapes and dtypes as torch sees in the source
    assert dcp_reference(dst) == dcp_reference(fixture_path(name))
    # values through torch's own loaders: the full-state converter and dcp.load into tensors
    assert {kp: v for kp, v in torch_values(dst).items()}.keys() == want.keys()
    for kp, value in torch_values(dst).items():
        if isinstance(value, np.ndarray):
            assert same(value, want[kp]), kp
        else:
            assert value == want[kp], kp
    arrays = {kp: v for kp, v in want.items() if isinstance(v, np.ndarray)}
    for kp, value in dcp_load_values(dst, arrays).items():
        assert same(value, arrays[kp]), kp
    # no duplicate chunk is written out, no empty thread file left
    for fqn, chunks in dcp_chunks(dst).items():
        assert len(chunks) == len(set(chunks)), fqn
    assert all(os.path.getsize(dst / f) > 0 for f in os.listdir(dst))


def test_round_trip_back_to_dcp_through_orbax(tmp_path, converted):
    back = tmp_path / "back"
    code, text = ckpt("convert", str(converted[("dcp_conj", "orbax")]), str(back), "--to", "dcp")
    assert code == 0, text
    want = torch_values(fixture_path("dcp_conj"))
    got = torch_values(back)
    assert got.keys() == want.keys()
    for kp, value in want.items():
        assert same(got[kp], value) if isinstance(value, np.ndarray) else got[kp] == value, kp


# ---------------------------------------------------------------------------
# duplicates: identical is fine, different is duplicate-mismatch, partial overlap stays an error
# ---------------------------------------------------------------------------
def _dropped_copy(path: Path, shape=(4, 3)) -> tuple[str, int, int]:
    """(file, start, end) of the model.rep copy .metadata does not point at.

    Found independently of ckpt: the byte ranges no storage entry references
    (torch's own metadata), split after each end-of-central-directory record,
    and the piece torch.load reads as a tensor of model.rep's shape.
    """
    import io

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    spans: dict[str, list[tuple[int, int]]] = {}
    for info in md.storage_data.values():
        spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    for name in sorted(f for f in os.listdir(path) if f.endswith(".distcp")):
        ranges = spans.get(name, [])
        data = (path / name).read_bytes()
        gaps, pos = [], 0
        for a, b in sorted(ranges):
            if a > pos:
                gaps.append((pos, a))
            pos = b
        if pos < len(data):
            gaps.append((pos, len(data)))
        for a, b in gaps:
            while a < b:
                end = data.index(b"PK\x05\x06", a) + 22
                if tuple(torch.load(io.BytesIO(data[a:end]), weights_only=True).shape) == shape:
                    return name, a, end
                a = end
    raise AssertionError("no unreferenced copy")


def test_diverged_replica_is_duplicate_mismatch(copy_fixture):
    path = copy_fixture("dcp_dups")
    name, start, end = _dropped_copy(path)
    # what a rank whose replica drifted would have written: torch.save of other values, same shape
    import io

    buf = io.BytesIO()
    torch.save(torch.full((4, 3), 0.5), buf)
    assert len(buf.getvalue()) == end - start
    blob = bytearray((path / name).read_bytes())
    blob[start:end] = buf.getvalue()
    (path / name).write_bytes(bytes(blob))
    # torch still loads it (it reads the other copy): only --deep can tell
    assert same(torch_values(path)[("model", "rep")], torch_values(fixture_path("dcp_dups"))[("model", "rep")])
    assert validate_checkpoint(str(path)).ok(strict=True)
    report = validate_checkpoint(str(path), deep=True)
    [finding] = report.findings
    assert (finding.severity, finding.code, finding.leaf, finding.file) == ("error", "duplicate-mismatch", "model/rep", name)
    assert "model.rep[0:4, 0:3]" in finding.message and "holds other values" in finding.message
    code, _ = ckpt("validate", str(path), "--deep")
    assert code == 1


def test_flipped_byte_in_a_dropped_copy_is_duplicate_mismatch(copy_fixture):
    path = copy_fixture("dcp_dups")
    name, start, end = _dropped_copy(path)
    blob = bytearray((path / name).read_bytes())
    payload = torch_payload.open_payload(bytes(blob[start:end]), "test").tensor()
    blob[start + payload.data_offset + 5] ^= 0x01
    (path / name).write_bytes(bytes(blob))
    report = validate_checkpoint(str(path), deep=True)
    assert [(f.code, f.leaf) for f in report.findings] == [("duplicate-mismatch", "model/rep")]


def test_diverged_zstd_replica_is_duplicate_mismatch(copy_fixture):
    """The dropped copies of a ZStandard save are zstd frames: one re-compressed from other values is found and compared."""
    import io

    import zstandard

    path = copy_fixture("dcp_dups_zstd")
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    ranges = sorted((i.offset, i.offset + i.length) for i in md.storage_data.values() if i.relative_path == "__0_0.distcp")
    data = (path / "__0_0.distcp").read_bytes()
    gap_start = next(b for (a, b), (c, _) in zip(ranges, ranges[1:]) if c > b) if len(ranges) > 1 else ranges[0][1]
    gap_end = next(c for (_, b), (c, _) in zip(ranges, ranges[1:]) if c > b)
    # the gap holds the two dropped copies as zstd frames: decode each with zstandard, find model.rep's
    reader = zstandard.ZstdDecompressor()
    frames, pos = [], gap_start
    while pos < gap_end:
        obj = reader.decompressobj()
        archive = obj.decompress(data[pos:gap_end])
        end = gap_end - len(obj.unused_data)
        frames.append((pos, end, archive))
        pos = end
    [(start, end, _)] = [
        (a, b, arc) for a, b, arc in frames if tuple(torch.load(io.BytesIO(arc), weights_only=True).shape) == (4, 3)
    ]
    buf = io.BytesIO()
    torch.save(torch.full((4, 3), 2.0), buf)
    frame = zstandard.ZstdCompressor().compress(buf.getvalue())
    blob = data[:start] + frame + data[end:]
    (path / "__0_0.distcp").write_bytes(blob)
    # .metadata's offsets after the replaced frame move with it
    delta = len(frame) - (end - start)
    for info in md.storage_data.values():
        if info.relative_path == "__0_0.distcp" and info.offset >= end:
            info.offset += delta
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=4)
    assert validate_checkpoint(str(path)).ok(strict=True)
    report = validate_checkpoint(str(path), deep=True)
    assert [(f.code, f.leaf, f.file) for f in report.findings] == [("duplicate-mismatch", "model/rep", "__0_0.distcp")]
    assert "holds other values" in report.findings[0].message


def test_partial_overlap_is_still_an_error(copy_fixture):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    path = copy_fixture("dcp_dups")
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own committed fixture: trusted
    chunks = md.state_dict_metadata["model.rep"].chunks
    chunks[1] = ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([3, 3]))  # overlaps [1:4] of the other copy
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=4)
    report = validate_checkpoint(str(path))
    assert ("error", "chunk-overlap", "model/rep") in [(f.severity, f.code, f.leaf) for f in report.findings]


def test_whole_unreferenced_file_of_copies_is_checked(copy_fixture):
    """Data parallel: every item rank 0 wrote is a copy, so .metadata references none of its file."""
    path = copy_fixture("dcp_dups_replicated")
    assert {entry[0] for entry in _storage_files(path)} == {"__1_0.distcp"}
    name, start, end = _dropped_copy(path, shape=(6, 2))
    assert name == "__0_0.distcp"
    import io

    buf = io.BytesIO()
    torch.save(torch.zeros(6, 2), buf)
    blob = bytearray((path / name).read_bytes())
    assert len(buf.getvalue()) == end - start
    blob[start:end] = buf.getvalue()
    (path / name).write_bytes(bytes(blob))
    assert validate_checkpoint(str(path)).ok(strict=True)
    report = validate_checkpoint(str(path), deep=True)
    assert [(f.code, f.leaf, f.file) for f in report.findings] == [("duplicate-mismatch", "model/w", name)]


def _storage_files(path: Path) -> set[tuple[str, int, int]]:
    from library_reference import dcp_storage

    return set(dcp_storage(path).values())


def test_unreferenced_files_that_are_not_copies_stay_stray(copy_fixture):
    path = copy_fixture("dcp_dups_replicated")
    (path / "__7_0.distcp").write_bytes(b"junk from elsewhere")  # not an item at all: shallow says so
    import io

    buf = io.BytesIO()
    torch.save(torch.zeros(5, 5), buf)  # a torch.save archive, but of no duplicated chunk: --deep says so
    (path / "__8_0.distcp").write_bytes(buf.getvalue())
    report = validate_checkpoint(str(path))
    assert [(f.severity, f.code, f.file) for f in report.findings] == [("warning", "stray-file", "__7_0.distcp")]
    report = validate_checkpoint(str(path), deep=True)
    assert sorted((f.severity, f.code, f.file) for f in report.findings) == [
        ("warning", "stray-file", "__7_0.distcp"), ("warning", "stray-file", "__8_0.distcp")
    ]


def test_nonempty_unreferenced_file_is_still_stray(copy_fixture):
    path = copy_fixture("dcp_threads")
    (path / "__0_3.distcp").write_bytes(b"leftover")
    report = validate_checkpoint(str(path))
    assert [(f.severity, f.code, f.file) for f in report.findings] == [("warning", "stray-file", "__0_3.distcp")]


# ---------------------------------------------------------------------------
# refusals: never a silent read
# ---------------------------------------------------------------------------
def _set_transforms(path: Path, descriptors: list[str]) -> None:
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.transform_descriptors = descriptors
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=4)


@pytest.mark.slow
def test_unknown_transform_is_a_clear_error_everywhere(copy_fixture, tmp_path):
    path = copy_fixture("dcp_zstd")
    _set_transforms(path, ["stream.rot13/1"])
    report = validate_checkpoint(str(path))  # shallow: not a silent OK
    assert not report.ok()
    assert any(f.code == "bad-metadata" and "stream.rot13/1" in f.message for f in report.findings)
    code, out = ckpt("validate", str(path), "--deep")
    assert code == 1 and "stream.rot13/1" in out
    with pytest.raises(ckpt_tool.CkptError, match="stream.rot13/1"):
        ckpt_tool.open(str(path))["model/w"].read()
    result = run_ckpt("convert", str(path), str(tmp_path / "out"), "--to", "orbax")
    assert result.returncode == 1 and "stream.rot13/1" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    # a newer zstd extension version is unknown too (torch's from_descriptor refuses it as well)
    _set_transforms(path, ["stream.zstd/2"])
    with pytest.raises(ckpt_tool.CkptError, match="stream.zstd/2"):
        ckpt_tool.open(str(path))["model/w"].read()


def test_zstd_bomb_is_refused_before_decoding_it_all(copy_fixture):
    """An entry whose zstd stream decodes to far more than .metadata says the chunk holds."""
    import zstandard

    path = copy_fixture("dcp_zstd")
    leaf = ckpt_tool.open(str(path))["model/ids"]  # 40 int64: a 320-byte tensor
    entry = leaf.extra["storage"][0]
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    blob = bytearray((path / entry["file"]).read_bytes())
    blob[entry["offset"] : entry["offset"] + entry["length"]] = bomb
    (path / entry["file"]).write_bytes(bytes(blob))
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    delta = len(bomb) - entry["length"]
    for index, info in md.storage_data.items():
        if index.fqn == "model.ids":
            info.length = len(bomb)
        elif info.relative_path == entry["file"] and info.offset > entry["offset"]:
            info.offset += delta
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=4)
    with pytest.raises(ckpt_tool.CkptError, match="decodes to more than"):
        ckpt_tool.open(str(path))["model/ids"].read()
    report = validate_checkpoint(str(path), deep=True)
    assert [(f.code, f.leaf) for f in report.findings] == [("bad-chunk", "model/ids")]


def test_unknown_view_bit_and_quantized_tensors_are_refused_by_name(copy_fixture):
    path = copy_fixture("dcp_conj")
    leaf = ckpt_tool.open(str(path))["model/neg_real"]
    entry = leaf.extra["storage"][0]
    blob = bytearray((path / entry["file"]).read_bytes())
    archive = bytes(blob[entry["offset"] : entry["offset"] + entry["length"]])
    # same length: 'neg' -> 'nop' in data.pkl (its CRC is fixed up below)
    patched = _patch_member(archive, b"X\x03\x00\x00\x00neg", b"X\x03\x00\x00\x00nop")
    blob[entry["offset"] : entry["offset"] + entry["length"]] = patched
    (path / entry["file"]).write_bytes(bytes(blob))
    with pytest.raises(ckpt_tool.CkptError, match="'nop'") as info:
        ckpt_tool.open(str(path))["model/neg_real"].read()
    assert "model.neg_real" in str(info.value)
    report = validate_checkpoint(str(path), deep=True)
    assert [(f.code, f.leaf) for f in report.findings] == [("bad-chunk", "model/neg_real")]
    assert "'nop'" in report.findings[0].message


def _patch_member(archive: bytes, old: bytes, new: bytes) -> bytes:
    """Replace bytes inside data.pkl of a torch.save archive and fix its CRC-32 (local descriptor + central dir)."""
    import struct
    import zipfile
    import zlib
    import io

    assert len(old) == len(new) and archive.count(old) == 1
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
        old_pkl = z.read(info)
    new_pkl = old_pkl.replace(old, new)
    out = archive.replace(old_pkl, new_pkl)
    old_crc, new_crc = struct.pack("<I", zlib.crc32(old_pkl)), struct.pack("<I", zlib.crc32(new_pkl))
    return out.replace(old_crc, new_crc)


def test_quantized_tensor_in_a_payload_is_refused_by_name():
    import io

    buf = io.BytesIO()
    torch.save(torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), buf)
    with pytest.raises(ckpt_tool.CkptError, match="quantized tensor") as info:
        torch_payload.open_payload(buf.getvalue(), "q.distcp [model.q]")
    assert "model.q" in str(info.value) and "allow-list" not in str(info.value)


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda: torch.randn(3, 3).to_sparse(), "sparse tensor"),
        (lambda: torch.randn(3, 3).to_sparse_csr(), "sparse tensor"),
        (lambda: torch.empty(3, device="meta"), "meta-device tensor"),
        (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "nested tensor"),
    ],
    ids=["sparse_coo", "sparse_csr", "meta", "nested"],
)
def test_tensors_ckpt_cannot_honour_are_refused_by_name(make, what):
    """torch.save's other rebuilds (DCP cannot save these, but a bytes item or another writer's archive can hold them)."""
    import io

    buf = io.BytesIO()
    torch.save(make(), buf)
    with pytest.raises(ckpt_tool.CkptError, match=what) as info:
        torch_payload.open_payload(buf.getvalue(), "x.distcp [model.t]")
    assert "model.t" in str(info.value) and "allow-list" not in str(info.value)


def test_quantized_dcp_save_is_refused_by_name(tmp_path):
    """A real dcp.save of a quantized tensor: validate says so, inspect and read refuse in one line."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "q"
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    dcp.save({"q": q, "w": torch.ones(2)}, checkpoint_id=str(path))
    report = validate_checkpoint(str(path))
    assert [(f.severity, f.code, f.leaf) for f in report.findings] == [("error", "bad-metadata", "q")]
    assert "qint8" in report.findings[0].message
    result = run_ckpt("inspect", str(path))
    assert result.returncode == 1 and "qint8" in result.stderr and "[q]" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_sparse_layout_in_metadata_is_refused_on_read(copy_fixture):
    path = copy_fixture("dcp_threads")
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata["w"].properties.layout = torch.sparse_coo
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=4)
    with pytest.raises(ckpt_tool.CkptError, match="sparse_coo") as info:
        ckpt_tool.open(str(path))["w"].read()
    assert "[w]" in str(info.value)
    report = validate_checkpoint(str(path))
    assert [(f.code, f.leaf) for f in report.findings] == [("bad-metadata", "w")]
    assert "sparse_coo" in report.findings[0].message
