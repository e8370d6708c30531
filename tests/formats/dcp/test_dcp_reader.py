"""The DCP reader against torch.distributed.checkpoint's own metadata and loads.

Checkpoints come from torch itself: written here into tmp dirs (one process,
and two gloo processes for DTensor shards) and the committed fixtures. torch
is imported only by the tests, never by ckpt_tool.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
import tempfile
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckpt_tool  # noqa: E402
from ckpt_tool import formats  # noqa: E402
from ckpt_tool.base.errors import (  # noqa: E402
    CkptError,
    CorruptMetadataError,
    IncompleteCheckpointError,
    PathEscapeError,
    UnsafePickleError,
)
from ckpt_tool.formats import dcp as dcp_reader  # noqa: E402
from ckpt_tool.machinery.torch_save import payload as torch_payload  # noqa: E402
from ckpt_tool.core.model import ArrayLeaf, ChunkList, ValueLeaf  # noqa: E402
from ckpt_tool.storage import Storage  # noqa: E402

from conftest import DCP_FIXTURES, fixture_path, free_port, mutate_bytes  # noqa: E402

# one-process saves and loads: torch warns that it assumes no process group
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# every dtype ckpt maps from torch, as torch.save writes it (v2 typed storages
# and v3 untyped storage + dtype for float8 and uint16+)
DTYPES = [
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128",
    "int8", "uint8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
]


def _tensor(dtype_name: str, shape: tuple[int, ...], seed: int):
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    if dtype_name == "bool":
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**40)), min(info.max, 2**40)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def _single_state() -> dict:
    state = {
        "dtypes": {name: _tensor(name, (3, 5), i) for i, name in enumerate(DTYPES)},
        "scalar0d": torch.tensor(2.5),
        "empty": torch.zeros((0, 3)),
        # non-contiguous chunk: torch.save keeps the transpose's strides
        "transposed": torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),
        "cube": _tensor("float32", (4, 5, 6), 99),
        # > 64 KiB, so it is located by ranged head/tail reads
        "big": _tensor("float32", (300, 200), 7),
        "list": [torch.ones(2), 3, "x"],
        "step": 12,
        "lr": 1e-3,
        "name": "run",
        "flag": True,
        "nothing": None,
        "pair": (1, 2.5),
        "cfg": {"a": [1, 2], "b": {"c": "d"}},
        "blob": b"\x00\x01bytes",
        "tags": {"x", "y"},
        "np_scalar": np.float64(1.25),
        "np_array": np.arange(6, dtype=np.uint32).reshape(2, 3),
    }
    return state


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "single"
    dcp.save(_single_state(), checkpoint_id=str(path))
    return path




def _multirank_worker(rank: int, world: int, path: str, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def shard(t, placement):
        # every rank builds the same tensor, so no scatter (gloo has no float8)
        return distribute_tensor(t, mesh, [placement], src_data_rank=None)

    state = {
        "rows": shard(_tensor("float32", (257, 190), 1), Shard(0)),  # > 64 KiB per shard, uneven
        "cols": shard(_tensor("bfloat16", (6, 9), 2), Shard(1)),
        "f8": shard(_tensor("float8_e5m2", (8, 3), 3), Shard(0)),
        "rep": shard(_tensor("int64", (5,), 4), Replicate()),
        "meta": {"world": world},
    }
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def multirank_ckpt(tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    path = tmp_path_factory.mktemp("dcp") / "multirank"
    mp.spawn(_multirank_worker, args=(2, str(path), free_port()), nprocs=2, join=True)
    return path


CHECKPOINTS = ["single_ckpt", "multirank_ckpt"] + [f"fixture:{n}" for n in DCP_FIXTURES]


@pytest.fixture(params=CHECKPOINTS)
def ckpt_path(request) -> Path:
    if request.param.startswith("fixture:"):
        path = fixture_path(request.param.split(":", 1)[1])
        if not (path / ".metadata").exists():
            pytest.skip(f"{path} not generated")
        return path
    return request.getfixturevalue(request.param)


# -- references from torch -----------------------------------------------------
def _torch_metadata(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata()


def _to_numpy(t) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if hasattr(ml_dtypes, name) and not hasattr(np, name):  # bfloat16, float8_*
        bits = {1: torch.uint8, 2: torch.int16}[t.element_size()]
        return t.view(bits).numpy().view(getattr(ml_dtypes, name))
    return t.numpy().copy()


_LOADED: dict[str, dict] = {}


def _torch_values(path: Path) -> dict[str, object]:
    """{fqn: value} as torch loads the whole checkpoint (tensors as numpy)."""
    key = str(path)
    if key not in _LOADED:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        md = _torch_metadata(path)
        with tempfile.TemporaryDirectory(prefix="ckpt-dcp-ref-") as tmp:
            out_file = os.path.join(tmp, "full.pt")
            dcp_to_torch_save(str(path), out_file)
            sd = torch.load(out_file, weights_only=False)
        values = {}
        for fqn in md.state_dict_metadata:
            obj = sd
            for k in md.planner_data.get(fqn, (fqn,)):
                obj = obj[k]
            values[fqn] = _to_numpy(obj) if isinstance(obj, torch.Tensor) else obj
        _LOADED[key] = values
    return _LOADED[key]


def assert_same_array(ours: np.ndarray, ref: np.ndarray, what: str = "") -> None:
    assert ours.shape == ref.shape, what
    assert ours.dtype == ref.dtype, what
    # bitwise: NaNs and float8 encodings must survive exactly
    assert np.ascontiguousarray(ours).tobytes() == np.ascontiguousarray(ref).tobytes(), what


def _open(path: Path):
    storage = Storage.open(str(path))
    return dcp_reader.read(storage), storage


# -- metadata ------------------------------------------------------------------
@pytest.mark.slow
def test_detected_and_opened_through_the_registry(ckpt_path):
    storage = Storage.open(str(ckpt_path))
    assert formats.detect(storage) is dcp_reader
    ck = ckpt_tool.open(str(ckpt_path))
    assert ck.format == "dcp" and ck.committed and ck.saved_at is None


def test_opening_reads_only_metadata(ckpt_path):
    ck, storage = _open(ckpt_path)
    assert len(ck.leaves) > 0
    assert dict(storage.log.reads) == {".metadata": 1}


def test_leaves_match_torch_metadata(ckpt_path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _torch_metadata(ckpt_path)
    ck, _ = _open(ckpt_path)
    assert [leaf.name for leaf in ck.leaves] == list(md.state_dict_metadata)
    for leaf in ck.leaves:
        item = md.state_dict_metadata[leaf.name]
        assert leaf.keys == tuple(md.planner_data[leaf.name])
        if isinstance(item, TensorStorageMetadata):
            assert isinstance(leaf, ArrayLeaf)
            assert leaf.shape == tuple(item.size)
            assert leaf.dtype == str(item.properties.dtype).removeprefix("torch.")
            assert isinstance(leaf.layout, ChunkList)
            assert [(c.offsets, c.sizes) for c in leaf.layout.chunks] == [
                (tuple(c.offsets), tuple(c.sizes)) for c in item.chunks
            ]
            assert leaf.sharding.kind == "chunks" and leaf.sharding.chunks == len(item.chunks)
            storage = [
                {"file": info.relative_path, "offset": info.offset, "length": info.length}
                for idx, info in md.storage_data.items()
                if idx.fqn == leaf.name
            ]
            assert sorted(leaf.extra["storage"], key=str) == sorted(storage, key=str)
        else:
            assert isinstance(leaf, ValueLeaf) and leaf.value_type == "bytes"


def test_layout_counts_files_and_ranks(ckpt_path):
    md = _torch_metadata(ckpt_path)
    files = {info.relative_path for info in md.storage_data.values()}
    ck, _ = _open(ckpt_path)
    assert ck.layout["files"] == len(files)
    assert ck.layout["ranks"] == len({f.split("_")[2] for f in files})
    assert ck.layout["version"] == md.version
    assert ck.notes == []


def test_list_indices_stay_ints(single_ckpt):
    ck, _ = _open(single_ckpt)
    assert ck["list/0"].keys == ("list", 0)
    assert ck["list/1"].keys == ("list", 1)
    assert ck["dtypes/bfloat16"].keys == ("dtypes", "bfloat16")


# -- data ------------------------------------------------------------------------
def test_full_reads_match_torch(ckpt_path):
    ref = _torch_values(ckpt_path)
    ck, _ = _open(ckpt_path)
    for leaf in ck.arrays():
        assert_same_array(leaf.read(), ref[leaf.name], leaf.name)
        assert_same_array(np.asarray(leaf), ref[leaf.name], leaf.name)


def test_all_dtypes_present_and_exact(single_ckpt):
    ref = _torch_values(single_ckpt)
    ck, _ = _open(single_ckpt)
    for name in DTYPES:
        leaf = ck[f"dtypes/{name}"]
        assert leaf.dtype == name
        assert_same_array(leaf.read(), ref[f"dtypes.{name}"], name)


def _regions(shape: tuple[int, ...], rng: np.random.Generator, count: int):
    for _ in range(count):
        region = []
        for n in shape:
            a = int(rng.integers(0, n + 1))
            b = int(rng.integers(a, n + 1))
            region.append(slice(a, b))
        yield tuple(region)


def test_sub_region_reads_match_torch(ckpt_path):
    ref = _torch_values(ckpt_path)
    ck, _ = _open(ckpt_path)
    rng = np.random.default_rng(0)
    for leaf in ck.arrays():
        full = ref[leaf.name]
        if leaf.ndim == 0:
            assert_same_array(leaf[()], full)
            continue
        for region in _regions(leaf.shape, rng, 6):
            assert_same_array(leaf.read(region), full[region], f"{leaf.name} {region}")
        # integer indexing drops the dimension, as numpy does
        if leaf.shape[0] > 0:
            last = leaf.shape[0] - 1
            assert_same_array(leaf[last], full[last], leaf.name)
            assert_same_array(leaf[-1, ...], full[-1, ...], leaf.name)


def test_region_across_shard_boundary(multirank_ckpt):
    ref = _torch_values(multirank_ckpt)["rows"]
    ck, _ = _open(multirank_ckpt)
    leaf = ck["rows"]
    assert leaf.chunk_count == 2
    split = leaf.layout.chunks[1].offsets[0]
    region = (slice(split - 3, split + 2), slice(17, 150))
    assert_same_array(leaf.read(region), ref[region])


def test_region_in_one_chunk_reads_only_that_chunks_file(multirank_ckpt):
    ck, storage = _open(multirank_ckpt)
    leaf = ck["rows"]
    first, second = leaf.extra["storage"]
    assert first["file"] != second["file"]
    leaf.read((slice(0, 2), slice(None)))
    reads = dict(storage.log.reads)
    assert first["file"] in reads and second["file"] not in reads


def test_ranged_reads_fetch_only_what_the_region_needs(single_ckpt):
    ck, storage = _open(single_ckpt)
    calls: list[tuple[str, int, int]] = []
    real = storage.read_range
    real_into = storage.read_range_into

    def spy(key, start, end):
        calls.append((key, start, end))
        return real(key, start, end)

    def spy_into(key, start, buffer):
        calls.append((key, start, start + memoryview(buffer).nbytes))
        return real_into(key, start, buffer)

    storage.read_range = spy  # type: ignore[method-assign]
    storage.read_range_into = spy_into  # type: ignore[method-assign]
    leaf = ck["big"]
    entry = leaf.extra["storage"][0]
    out = leaf[10:12, 3:7]
    assert out.shape == (2, 4)
    # locate (zip head + central directory) and the data span: a few small reads
    assert len(calls) <= 3
    assert sum(e - s for _, s, e in calls) < entry["length"] / 4
    calls.clear()
    leaf[100:101, :]
    # the chunk's location is cached: one read of one row's bytes
    assert len(calls) == 1 and calls[0][2] - calls[0][1] == 200 * 4
    # nothing outside the leaf's own entry was touched
    assert all(entry["offset"] <= s and e <= entry["offset"] + entry["length"] for _, s, e in calls)


def test_non_contiguous_chunk(single_ckpt):
    ck, storage = _open(single_ckpt)
    expect = np.arange(24, dtype=np.float32).reshape(4, 6).T
    leaf = ck["transposed"]
    assert_same_array(leaf.read(), expect)
    assert_same_array(leaf.read((slice(1, 5), slice(1, 3))), expect[1:5, 1:3])


def test_empty_and_zero_d(single_ckpt):
    ck, _ = _open(single_ckpt)
    assert ck["empty"].read().shape == (0, 3)
    assert ck["scalar0d"].read().shape == ()
    assert float(ck["scalar0d"].read()) == 2.5


def test_bytes_items_match_torch(ckpt_path):
    ref = _torch_values(ckpt_path)
    ck, _ = _open(ckpt_path)
    for leaf in ck.leaves:
        if isinstance(leaf, ValueLeaf):
            value = leaf.load()
            expect = ref[leaf.name]
            if isinstance(expect, np.ndarray):
                assert_same_array(value, expect, leaf.name)
            else:
                assert value == expect and type(value) is type(expect), leaf.name


def test_value_loaded_only_on_request(single_ckpt):
    ck, storage = _open(single_ckpt)
    leaf = ck["cfg/b/c"]
    assert dict(storage.log.reads) == {".metadata": 1}
    assert leaf.load() == "d"
    assert sum(storage.log.reads.values()) == 2


# -- crafted checkpoints -----------------------------------------------------------
def _rewrite_metadata(path: Path, edit) -> None:
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _find_index(md, fqn):
    return next(idx for idx in md.storage_data if idx.fqn == fqn)


def test_storage_offset_chunk(tmp_path):
    """A chunk saved as a view into a larger storage (storage_offset > 0)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    path = tmp_path / "ckpt"
    dcp.save({"v": torch.zeros(4)}, checkpoint_id=str(path))
    base = torch.arange(10, dtype=torch.float32) * 1.5
    buf = io.BytesIO()
    torch.save(base[3:7], buf)  # storage of 10 floats, offset 3
    data_file = path / "__0_0.distcp"
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(buf.getvalue())

    def edit(md):
        idx = _find_index(md, "v")
        md.storage_data[idx] = _StorageInfo("__0_0.distcp", offset, len(buf.getvalue()))

    _rewrite_metadata(path, edit)
    # torch itself reads it back this way
    loaded = {"v": torch.empty(4)}
    dcp.load(loaded, checkpoint_id=str(path))
    assert torch.equal(loaded["v"], base[3:7])

    ck, _ = _open(path)
    assert_same_array(ck["v"].read(), base[3:7].numpy())
    assert_same_array(ck["v"][1:3], base[4:6].numpy())


def test_missing_metadata_is_an_incomplete_save(single_ckpt, tmp_path):
    path = tmp_path / "partial"
    shutil.copytree(single_ckpt, path)
    (path / ".metadata").unlink()
    storage = Storage.open(str(path))
    assert dcp_reader.detect(storage)
    with pytest.raises(IncompleteCheckpointError, match="no .metadata: an incomplete or uncommitted DCP save"):
        dcp_reader.read(storage)


def test_hostile_metadata_is_refused(tmp_path):
    path = tmp_path / "evil"
    path.mkdir()
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(
        b"cposix\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    )
    (path / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(UnsafePickleError) as err:
        ckpt_tool.open(str(path))
    assert (err.value.module, err.value.name) == ("posix", "system")
    assert str(path) in str(err.value)
    assert not marker.exists()


def test_path_escape_in_storage_data(single_ckpt, tmp_path):
    path = tmp_path / "escape"
    shutil.copytree(single_ckpt, path)
    shutil.copy(path / "__0_0.distcp", tmp_path / "outside.distcp")

    def edit(md):
        idx = _find_index(md, "step")
        info = md.storage_data[idx]
        info.relative_path = "../outside.distcp"

    _rewrite_metadata(path, edit)
    ck, _ = _open(path)  # metadata alone is fine
    assert [m.file for m in ck.missing] == ["../outside.distcp"]  # named, not there: incomplete
    with pytest.raises(PathEscapeError):
        ck["step"].load()


def test_transforms_are_refused_clearly(single_ckpt, tmp_path):
    path = tmp_path / "zstd"
    shutil.copytree(single_ckpt, path)

    def edit(md):
        md.storage_data[_find_index(md, "dtypes.float32")].transform_descriptors = ["stream.zstd/1"]

    _rewrite_metadata(path, edit)
    ck, _ = _open(path)
    assert any("stream.zstd/1" in note for note in ck.notes)
    with pytest.raises(CkptError, match="stream.zstd/1"):
        ck["dtypes/float32"].read()


def test_garbage_and_truncated_data_files(single_ckpt, tmp_path):
    path = tmp_path / "damaged"
    shutil.copytree(single_ckpt, path)
    ck, _ = _open(path)
    small = ck["dtypes/float32"].extra["storage"][0]
    data_file = path / small["file"]
    raw = bytearray(data_file.read_bytes())
    raw[small["offset"] : small["offset"] + 4] = b"JUNK"
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CorruptMetadataError, match=r"not a torch.save zip archive") as err:
        ck["dtypes/float32"].read()
    assert small["file"] in str(err.value) and "dtypes.float32" in str(err.value)
    # cut the file in the middle of the big tensor
    big = ck["big"].extra["storage"][0]
    data_file.write_bytes(bytes(raw[: big["offset"] + big["length"] // 2]))
    with pytest.raises(CkptError, match="truncated"):
        ck["big"].read()


def test_payload_metadata_mismatch(single_ckpt, tmp_path):
    path = tmp_path / "mismatch"
    shutil.copytree(single_ckpt, path)

    def edit(md):
        # point float32 at the int32 chunk (same shape, other dtype)
        md.storage_data[_find_index(md, "dtypes.float32")] = md.storage_data[_find_index(md, "dtypes.int32")]

    _rewrite_metadata(path, edit)
    ck, _ = _open(path)
    with pytest.raises(CorruptMetadataError, match=r"payload holds int32\[3, 5\] but .metadata says float32"):
        ck["dtypes/float32"].read()


def test_chunk_without_storage_entry(single_ckpt, tmp_path):
    path = tmp_path / "nostorage"
    shutil.copytree(single_ckpt, path)
    _rewrite_metadata(path, lambda md: md.storage_data.pop(_find_index(md, "cube")))
    with pytest.raises(CorruptMetadataError, match=r"\[cube\]: no storage_data entry"):
        _open(path)


# -- torch.save archives decoded directly ------------------------------------------
def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rezip(archive: bytes, replace: dict[str, bytes], compress: set[str] = frozenset()) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            suffix = info.filename.split("/", 1)[1]
            data = replace.get(suffix, src.read(info.filename))
            method = zipfile.ZIP_DEFLATED if suffix in compress else zipfile.ZIP_STORED
            dst.writestr(info.filename.replace("archive/", "other_stem/"), data, compress_type=method)
    return out.getvalue()


def test_archive_stem_is_found_by_suffix():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    archive = _rezip(_saved(t), {})
    payload = torch_payload.open_payload(archive, "mem")
    assert payload.prefix == "other_stem/"
    assert_same_array(payload.read_tensor(payload.tensor()), t.numpy())


def test_big_endian_archive_matches_torch():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5
    archive = _rezip(_saved(t), {"byteorder": b"big", "data/0": t.numpy().astype(">f4").tobytes()})
    assert torch.equal(torch.load(io.BytesIO(archive), weights_only=True), t)
    payload = torch_payload.open_payload(archive, "mem")
    assert_same_array(payload.read_tensor(payload.tensor()), t.numpy())


def test_compressed_member_is_refused():
    archive = _rezip(_saved(torch.zeros(64)), {}, compress={"data/0"})
    payload = torch_payload.open_payload(archive, "mem [x]")
    with pytest.raises(CorruptMetadataError, match="compressed"):
        payload.tensor()


def test_declared_size_larger_than_storage_is_refused_before_allocating():
    archive = _saved(torch.zeros(4))
    pkl = zipfile.ZipFile(io.BytesIO(archive)).read("archive/data.pkl")
    size_op = b"K\x04\x85"  # BININT1 4, TUPLE1: the size (4,)
    assert pkl.count(size_op) == 1
    huge = pkl.replace(size_op, b"J" + struct.pack("<i", 10**9) + b"\x85")
    payload = torch_payload.open_payload(_rezip(archive, {"data.pkl": huge}), "mem [x]")
    with pytest.raises(CorruptMetadataError, match="needs 4000000000 bytes but its storage has 16"):
        payload.tensor()


def test_storage_size_mismatch_is_refused():
    archive = _saved(torch.zeros(4))
    payload = torch_payload.open_payload(_rezip(archive, {"data/0": b"\x00" * 8}), "mem [x]")
    with pytest.raises(CorruptMetadataError, match="declares 16 bytes but the archive holds 8"):
        payload.tensor()


def test_crc_mismatch_is_detected_on_full_read():
    t = torch.arange(4, dtype=torch.float32)
    archive = bytearray(_saved(t))
    payload = torch_payload.open_payload(bytes(archive), "mem")
    where = payload.tensor()
    archive[where.data_offset] ^= 0xFF
    damaged = torch_payload.open_payload(bytes(archive), "mem [x]")
    with pytest.raises(CorruptMetadataError, match="CRC"):
        damaged.read_tensor(damaged.tensor())


def test_parameter_and_nested_tensors_in_a_value():
    with_attr = torch.full((2,), 7, dtype=torch.int16)
    with_attr.note = "tensor attributes are pickled through _rebuild_from_type_v2"
    value = {
        "p": torch.nn.Parameter(torch.ones(2, 2)),
        "l": [torch.arange(3)],
        "n": np.float32(2.0),
        "a": with_attr,
    }
    out = torch_payload.load_value(_saved(value), "mem")
    assert_same_array(out["p"], np.ones((2, 2), np.float32))
    assert_same_array(out["a"], np.full((2,), 7, np.int16))
    assert_same_array(out["l"][0], np.arange(3, dtype=np.int64))
    assert out["n"] == np.float32(2.0) and out["n"].dtype == np.float32


# -- fuzz: damaged .metadata never escapes as anything but a CkptError -------------

@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "fuzz"
    dcp.save(
        {"w": torch.randn(4, 3), "h": torch.ones(5, dtype=torch.float16), "n": 3, "s": "x"},
        checkpoint_id=str(path),
    )
    (path / ".metadata.orig").write_bytes((path / ".metadata").read_bytes())
    return path


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6))
def test_fuzz_mutated_metadata_through_the_reader(fuzz_dir, edits):
    (fuzz_dir / ".metadata").write_bytes(mutate_bytes((fuzz_dir / ".metadata.orig").read_bytes(), edits))
    try:
        ck = dcp_reader.read(Storage.open(str(fuzz_dir)))
        for leaf in ck.leaves:
            leaf.read() if isinstance(leaf, ArrayLeaf) else leaf.load()
    except CkptError:
        pass
