"""The torch-free DCP writer, checked against real torch (torch is used only here).

A hand-built plan (uneven and multi-chunk tensors, a 0-d tensor, a zero-size
tensor, every common dtype, non-tensor values) is written from two threads in
random order, then read back by torch.distributed.checkpoint.load,
dcp_to_torch_save + torch.load, FileSystemReader.read_metadata and ckpt's own
reader. The archives inside the data files are compared byte for byte with
torch.save's, and the .metadata object graph with the one torch writes for
the same state dict.
"""
from __future__ import annotations

import io
import itertools
import json
import math
import os
import pickle
import pickletools
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ckpt_tool
from ckpt_tool.base.errors import CkptError, IncompleteCheckpointError
from ckpt_tool.machinery.torch_save import safe_pickle
from ckpt_tool.formats.dcp.write import DcpWriter, tensor_archive, value_archive
from ckpt_tool.machinery.torch_save.pickle_writer import dumps
from ckpt_tool.base import dtypes
from ckpt_tool.core.model import Chunk, ChunkList, RegularGrid
from ckpt_tool.storage import Storage
from ckpt_tool.core.write_plan import TargetArray, TargetValue, WritePlan

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

# torch warns that it assumes a single process when no process group exists
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ---------------------------------------------------------------------------
# The plan and its data
# ---------------------------------------------------------------------------
def _chunks(*pairs: tuple[tuple[int, ...], tuple[int, ...]]) -> ChunkList:
    return ChunkList(tuple(Chunk(o, s) for o, s in pairs))


def _with_specials(arr: np.ndarray) -> np.ndarray:
    """Put -0.0 and NaN in a float array: only a bit-exact copy keeps them."""
    flat = arr.reshape(-1)
    if flat.size >= 2:
        flat[0] = -0.0
        flat[1] = np.nan
    return arr


def _data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "model.layers.0.w": _with_specials(rng.standard_normal((6, 5)).astype(np.float32)),
        "model.layers.0.b": _with_specials(rng.standard_normal(7).astype(np.float32).astype(ml_dtypes.bfloat16)),
        "model.emb": _with_specials(rng.standard_normal((5, 3)).astype(np.float16)),
        "model.f8": rng.standard_normal((5, 2)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn),
        "opt.0.step_count": np.array(1234567890123, dtype=np.int64),
        "opt.0.idx": rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int32),
        "mask": rng.integers(0, 2, size=9).astype(bool),
        "raw": rng.integers(0, 256, size=(2, 3, 4), dtype=np.uint8),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


_KEYS: dict[str, tuple[Any, ...]] = {
    "model.layers.0.w": ("model", "layers", 0, "w"),
    "model.layers.0.b": ("model", "layers", 0, "b"),
    "model.emb": ("model", "emb"),
    "model.f8": ("model", "f8"),
    "opt.0.step_count": ("opt", 0, "step_count"),
    "opt.0.idx": ("opt", 0, "idx"),
    "mask": ("mask",),
    "raw": ("raw",),
    "empty": ("empty",),
}

_LAYOUTS = {
    # uneven chunks in both dimensions
    "model.layers.0.w": _chunks(((0, 0), (4, 5)), ((4, 0), (2, 3)), ((4, 3), (2, 2))),
    "model.layers.0.b": _chunks(((0,), (3,)), ((3,), (4,))),
    # a regular grid with cut edge chunks
    "model.emb": RegularGrid((2, 2)),
    "model.f8": _chunks(((0, 0), (5, 2))),
    "opt.0.step_count": _chunks(((), ())),
    "opt.0.idx": _chunks(((0, 0), (3, 1)), ((0, 1), (3, 3))),
    "mask": _chunks(((0,), (2,)), ((2,), (5,)), ((7,), (2,))),
    "raw": _chunks(((0, 0, 0), (1, 3, 4)), ((1, 0, 0), (1, 3, 4))),
    # a zero-size tensor whose grid has no chunks: the writer adds torch's one empty chunk
    "empty": RegularGrid((1, 3)),
}

VALUES: dict[str, tuple[tuple[Any, ...], Any]] = {
    "step": (("step",), 12),
    "lr": (("lr",), 0.5),
    "name": (("name",), "run-ä"),
    "opt.0.betas": (("opt", 0, "betas"), [0.9, 0.999]),
    "cfg": (("cfg",), {"a": 1, "b": [1, 2], "c": None, "d": (1, "x")}),
    "nothing": (("nothing",), None),
    "flag": (("flag",), True),
    "count": (("count",), np.int64(3)),  # numpy scalars are stored as Python scalars
}
# DCP's loader walks into dicts, so a dict value cannot be a leaf of a state dict given to dcp.load
_NOT_LOADABLE_BY_DCP = {"cfg"}


def make_plan(process_index: int = 0, process_count: int = 1) -> WritePlan:
    data = _data()
    targets: list[Any] = []
    for name, arr in data.items():
        targets.append(TargetArray(_KEYS[name], name, arr.shape, dtypes.from_numpy(arr.dtype).name, _LAYOUTS[name]))
    for name, (keys, value) in VALUES.items():
        targets.append(TargetValue(keys, name, value, "object"))
    return WritePlan(targets, info={"destination": "test"}, process_index=process_index, process_count=process_count)


def chunk_list(target: TargetArray) -> list[Chunk]:
    """The chunks in the order their indices count (a grid in C order, as the engine does)."""
    if isinstance(target.layout, ChunkList):
        return list(target.layout.chunks)
    shape, grid = tuple(target.shape), target.layout.chunk_shape
    ranges = [range(0, n, c) for n, c in zip(shape, grid)]
    return [
        Chunk(tuple(off), tuple(min(c, n - o) for o, c, n in zip(off, grid, shape)))
        for off in itertools.product(*ranges)
    ]


def write(
    path: str,
    *,
    file_mb: float = 64.0,
    process_index: int = 0,
    process_count: int = 1,
    seed: int = 0,
    commit: bool = True,
) -> DcpWriter:
    """Write the plan's chunks owned by this process from 2 threads in random order."""
    plan = make_plan(process_index, process_count)
    data = _data()
    writer = DcpWriter(Storage.create(path), file_mb=file_mb)
    writer.begin(plan)
    tasks = []
    n = 0
    for target in plan.arrays():
        for i, c in enumerate(chunk_list(target)):
            if n % process_count == process_index:
                tasks.append((target, i, c))
            n += 1
    random.Random(seed).shuffle(tasks)

    def put(task: tuple[TargetArray, int, Chunk]) -> None:
        target, i, c = task
        writer.write_array(target, i, c.region, data[target.name][c.region])

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(put, tasks))
    if process_index == 0:
        for value in plan.values():
            writer.write_value(value)
    writer.finish_process()
    if commit and process_index == 0:
        writer.commit()
    return writer


def zeros_state_dict(*, skip: set[str] = frozenset()) -> dict[str, Any]:
    """A nested state dict with the plan's structure: zero tensors and placeholder values."""
    out: dict[str, Any] = {}

    def put(keys: tuple[Any, ...], value: Any) -> None:
        node: Any = out
        for k, nxt in zip(keys[:-1], keys[1:]):
            container: Any = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                while len(node) <= k:
                    node.append(None)
                if node[k] is None:
                    node[k] = container
                node = node[k]
            else:
                node = node.setdefault(k, container)
        if isinstance(node, list):
            while len(node) <= keys[-1]:
                node.append(None)
        node[keys[-1]] = value

    for name, arr in _data().items():
        put(_KEYS[name], torch.zeros(arr.shape, dtype=getattr(torch, dtypes.from_numpy(arr.dtype).torch)))
    for name, (keys, _) in VALUES.items():
        if name not in skip:
            put(keys, "placeholder")
    return out


def get(tree: Any, keys: tuple[Any, ...]) -> Any:
    for k in keys:
        tree = tree[k]
    return tree


def as_bytes(t: Any) -> np.ndarray:
    """A tensor's or array's raw bytes, for bit-exact comparison."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def to_torch(arr: np.ndarray) -> Any:
    """A tensor with the array's exact bytes (numpy has no bfloat16/float8 torch understands)."""
    t = torch.empty(arr.shape, dtype=getattr(torch, dtypes.from_numpy(arr.dtype).torch))
    if arr.size:
        t.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(as_bytes(arr).copy()))
    return t


def expected_value(name: str) -> Any:
    value = VALUES[name][1]
    return value.item() if isinstance(value, np.generic) else value


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    write(str(path))
    return path


# ---------------------------------------------------------------------------
# Read back by torch
# ---------------------------------------------------------------------------
def test_torch_dcp_load_is_bit_exact(written: Path) -> None:
    sd = zeros_state_dict(skip=_NOT_LOADABLE_BY_DCP)
    dcp.load(sd, checkpoint_id=str(written))
    for name, arr in _data().items():
        t = get(sd, _KEYS[name])
        assert tuple(t.shape) == arr.shape, name
        assert str(t.dtype) == f"torch.{dtypes.from_numpy(arr.dtype).torch}", name
        np.testing.assert_array_equal(as_bytes(t), as_bytes(arr), err_msg=name)
    for name, (keys, _) in VALUES.items():
        if name not in _NOT_LOADABLE_BY_DCP:
            assert get(sd, keys) == expected_value(name), name


def test_dcp_to_torch_save_then_torch_load(written: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "model.pt"
    dcp_to_torch_save(str(written), str(out))
    sd = torch.load(out, weights_only=False)
    for name, arr in _data().items():
        np.testing.assert_array_equal(as_bytes(get(sd, _KEYS[name])), as_bytes(arr), err_msg=name)
    for name, (keys, _) in VALUES.items():
        assert get(sd, keys) == expected_value(name), name


def test_read_metadata_shows_the_planned_chunks(written: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = FileSystemReader(str(written)).read_metadata()
    plan = make_plan()
    assert md.version == "1.0.0"
    assert set(md.state_dict_metadata) == {t.name for t in plan.targets}
    for target in plan.arrays():
        item = md.state_dict_metadata[target.name]
        assert isinstance(item, TensorStorageMetadata)
        assert item.size == torch.Size(target.shape)
        assert item.properties.dtype == getattr(torch, dtypes.get(target.dtype).torch)
        assert item.properties.layout == torch.strided
        assert item.properties.memory_format == torch.contiguous_format
        assert item.properties.requires_grad is False and item.properties.pin_memory is False
        want = [(tuple(c.offsets), tuple(c.sizes)) for c in chunk_list(target)] or [((0, 0), (0, 3))]
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks] == want, target.name
        assert all(type(c.offsets) is torch.Size for c in item.chunks)
        assert md.planner_data[target.name] == target.keys
    for value in plan.values():
        assert isinstance(md.state_dict_metadata[value.name], BytesStorageMetadata)
        assert md.planner_data[value.name] == value.keys
    # one storage entry per chunk and value, each inside an existing data file
    n_chunks = sum(len(c.chunks) for c in md.state_dict_metadata.values() if isinstance(c, TensorStorageMetadata))
    assert len(md.storage_data) == n_chunks + len(plan.values())
    for index, info in md.storage_data.items():
        assert info.relative_path.startswith("__0_") and info.relative_path.endswith(".distcp")
        assert info.offset + info.length <= (written / info.relative_path).stat().st_size
        assert info.transform_descriptors is None
    assert md.storage_meta.save_id and md.storage_meta.checkpoint_id == "test"


def test_archives_are_byte_identical_to_torch_save(written: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(written)).read_metadata()
    data = _data()
    for index, info in md.storage_data.items():
        with open(written / info.relative_path, "rb") as f:
            f.seek(info.offset)
            stored = f.read(info.length)
        buf = io.BytesIO()
        if index.offset is None:  # a bytes item: torch.save of the value
            torch.save(expected_value(index.fqn), buf)
        else:
            item = md.state_dict_metadata[index.fqn]
            chunk = next(c for c in item.chunks if c.offsets == index.offset)
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            torch.save(to_torch(np.asarray(data[index.fqn][region])), buf)
        assert stored == buf.getvalue(), index


def test_metadata_matches_what_torch_writes(written: Path, tmp_path: Path) -> None:
    """Same objects when unpickled by torch, and no global torch does not use itself."""
    sd = zeros_state_dict(skip=_NOT_LOADABLE_BY_DCP)
    ref_dir = tmp_path / "ref"
    # torch saves a state dict of whole tensors; ours has the same fqns, shapes and dtypes
    data = _data()
    for name, arr in data.items():
        get(sd, _KEYS[name][:-1])[_KEYS[name][-1]] = to_torch(arr)
    for name, (keys, _) in VALUES.items():
        if name not in _NOT_LOADABLE_BY_DCP:
            get(sd, keys[:-1])[keys[-1]] = expected_value(name)
    dcp.save(sd, checkpoint_id=str(ref_dir))
    ours_raw = (written / ".metadata").read_bytes()
    ref_raw = (ref_dir / ".metadata").read_bytes()
    ours, ref = pickle.loads(ours_raw), pickle.loads(ref_raw)
    assert type(ours) is type(ref)
    for fqn, item in ref.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        assert type(mine) is type(item), fqn
        if hasattr(item, "properties"):
            assert mine.properties == item.properties, fqn
            assert mine.size == item.size, fqn
            if len(mine.chunks) == 1:  # torch saved whole tensors: compare where our layout agrees
                assert [(c.offsets, c.sizes) for c in mine.chunks] == [(c.offsets, c.sizes) for c in item.chunks], fqn
        assert ours.planner_data[fqn] == ref.planner_data[fqn], fqn
    assert ours.version == ref.version
    assert type(ours.storage_meta) is type(ref.storage_meta)
    assert {type(k) for k in ours.storage_data} == {type(k) for k in ref.storage_data}
    assert {type(v) for v in ours.storage_data.values()} == {type(v) for v in ref.storage_data.values()}
    # every global we name, torch names too (torch adds pathlib for its checkpoint_id)

    def globals_of(raw: bytes) -> set[tuple[str, str]]:
        ops = list(pickletools.genops(raw))
        assert all(op.name != "GLOBAL" for op, _, _ in ops)
        found: set[tuple[str, str]] = set()
        # STACK_GLOBAL takes its module and name from the stack: track just the
        # strings pushed, directly or from the memo, to resolve them
        stack: list[Any] = []
        memo: list[Any] = []
        for op, arg, _ in ops:
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE"):
                stack.append(arg)
            elif op.name == "MEMOIZE":
                memo.append(stack[-1] if stack else None)
            elif op.name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif op.name == "STACK_GLOBAL":
                name, module = stack.pop(), stack.pop()
                found.add((module, name))
                stack.append((module, name))
            else:
                stack.append(None)
        return found

    assert globals_of(ours_raw) <= globals_of(ref_raw)
    assert pickletools.genops(ours_raw).__next__()[0].name == "PROTO"
    assert ours_raw[1] == 4


def test_metadata_loads_through_the_allow_list(written: Path) -> None:
    md = safe_pickle.load_metadata((written / ".metadata").read_bytes(), "test")
    assert isinstance(md, safe_pickle.Metadata)
    assert set(md.state_dict_metadata) == {t.name for t in make_plan().targets}


# ---------------------------------------------------------------------------
# Read back by ckpt
# ---------------------------------------------------------------------------
def test_ckpt_reader_reads_the_same_values(written: Path) -> None:
    ck = ckpt_tool.open(str(written))
    assert ck.format == "dcp" and not ck.notes
    for name, arr in _data().items():
        leaf = ck[name]
        assert leaf.keys == _KEYS[name]
        assert leaf.shape == arr.shape and leaf.dtype == dtypes.from_numpy(arr.dtype).name
        np.testing.assert_array_equal(as_bytes(leaf.read()), as_bytes(arr), err_msg=name)
    region = ck["model.layers.0.w"][3:6, 1:4]  # spans three uneven chunks
    np.testing.assert_array_equal(as_bytes(region), as_bytes(_data()["model.layers.0.w"][3:6, 1:4]))
    for name, (keys, _) in VALUES.items():
        leaf = ck[name]
        assert leaf.keys == keys
        assert leaf.load() == expected_value(name), name


def test_memory_storage() -> None:
    url = "memory://dcp-writer-test/one"
    write(url)
    ck = ckpt_tool.open(url)
    np.testing.assert_array_equal(as_bytes(ck["raw"].read()), as_bytes(_data()["raw"]))
    assert ck["cfg"].load() == VALUES["cfg"][1]


def test_memory_storage_archives_over_file_mb() -> None:
    # each archive at least file_mb: a file of its own, assembled in memory from the archive's
    # parts (a filled template's include a bytearray)
    url = "memory://dcp-writer-test/own-files"
    write(url, file_mb=1 / 2**20)
    ck = ckpt_tool.open(url)
    for name, data in _data().items():
        np.testing.assert_array_equal(as_bytes(ck[name].read()), as_bytes(data))


def test_object_store_files_are_uploaded_behind_the_copy_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sealed data file bound for an object store is uploaded by the writer's upload threads, at
    most REMOTE_UPLOADS at once, not by the copy thread that sealed it: that thread waited for each
    upload, and an 8 GiB convert to gs:// kept about 4.5 uploads busy of its 8 threads (50 s against
    28.6 s for a plain parallel upload of the same objects; 30.5 s with the uploads behind)."""
    from ckpt_tool.formats.dcp import write as dcp_write

    lock = threading.Lock()
    threads: list[str] = []
    running, most = [0], [0]
    real = Storage.write

    def slow_write(self: Storage, key: str, data: bytes | bytearray) -> None:
        if not key.endswith(".distcp"):
            return real(self, key, data)
        with lock:
            threads.append(threading.current_thread().name)
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.01)
            return real(self, key, data)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(Storage, "write", slow_write)
    url = "memory://dcp-writer-test/uploads"
    write(url, file_mb=1 / 2**20)  # each archive a file of its own
    assert len(threads) > dcp_write.REMOTE_UPLOADS
    assert all(name.startswith("ckpt-dcp-upload") for name in threads), set(threads)
    assert 1 < most[0] <= dcp_write.REMOTE_UPLOADS
    ck = ckpt_tool.open(url)
    for name, data in _data().items():
        np.testing.assert_array_equal(as_bytes(ck[name].read()), as_bytes(data))


def test_a_failed_upload_fails_the_process_and_nothing_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Storage.write

    def failing(self: Storage, key: str, data: bytes | bytearray) -> None:
        if key.endswith(".distcp"):
            raise CkptError("upload corrupted: test", key)
        return real(self, key, data)

    monkeypatch.setattr(Storage, "write", failing)
    url = "memory://dcp-writer-test/failed-upload"
    with pytest.raises(CkptError, match="upload corrupted: test"):
        write(url, file_mb=1 / 2**20)
    assert not Storage.open(url).exists(".metadata")


# ---------------------------------------------------------------------------
# Several processes, file rollover
# ---------------------------------------------------------------------------
def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    path = tmp_path / "two"
    write(str(path), process_index=1, process_count=2, seed=1)
    assert (path / ".ckpt-entries.1").exists() and not (path / ".metadata").exists()
    write(str(path), process_index=0, process_count=2, seed=2)
    names = sorted(os.listdir(path))
    assert ".ckpt-entries.1" not in names  # read and removed by commit
    assert ".metadata" in names
    assert any(n.startswith("__0_") for n in names) and any(n.startswith("__1_") for n in names)
    sd = zeros_state_dict(skip=_NOT_LOADABLE_BY_DCP)
    dcp.load(sd, checkpoint_id=str(path))
    for name, arr in _data().items():
        np.testing.assert_array_equal(as_bytes(get(sd, _KEYS[name])), as_bytes(arr), err_msg=name)
    from torch.distributed.checkpoint import FileSystemReader

    files = {info.relative_path for info in FileSystemReader(str(path)).read_metadata().storage_data.values()}
    assert any(f.startswith("__1_") for f in files)


def test_two_processes_on_memory_storage() -> None:
    url = "memory://dcp-writer-test/two"
    write(url, process_index=1, process_count=2)
    write(url, process_index=0, process_count=2)
    storage = Storage.open(url)
    assert not storage.exists(".ckpt-entries.1")
    ck = ckpt_tool.open(url)
    np.testing.assert_array_equal(as_bytes(ck["mask"].read()), as_bytes(_data()["mask"]))


def test_commit_refuses_when_a_process_did_not_finish(tmp_path: Path) -> None:
    path = tmp_path / "half"
    writer = write(str(path), process_index=0, process_count=2, commit=False)
    with pytest.raises(IncompleteCheckpointError, match="process 1 did not finish"):
        writer.commit()
    assert not (path / ".metadata").exists()


def test_commit_refuses_missing_chunks(tmp_path: Path) -> None:
    plan = make_plan()
    writer = DcpWriter(Storage.create(str(tmp_path / "missing")))
    writer.begin(plan)
    writer.finish_process()
    with pytest.raises(IncompleteCheckpointError, match="nothing was written for chunk 0 of 'model.layers.0.w'"):
        writer.commit()


@pytest.mark.parametrize("threads", [2, 8])
def test_files_roll_over_at_file_mb(tmp_path: Path, threads: int) -> None:
    path = tmp_path / "roll"
    limit_mb = 4096 / 2**20  # a 4 KiB limit: a few small archives per file
    plan = WritePlan([
        TargetArray(("small",), "small", (40,), "float32", RegularGrid((4,))),
        TargetArray(("big",), "big", (4, 1024), "float32", RegularGrid((2, 1024))),  # 8 KiB chunks
    ])
    data = {"small": np.arange(40, dtype=np.float32), "big": np.arange(4096, dtype=np.float32).reshape(4, 1024)}
    writer = DcpWriter(Storage.create(str(path)), file_mb=limit_mb)
    writer.begin(plan)
    tasks = [(t, i, c) for t in plan.arrays() for i, c in enumerate(chunk_list(t))]
    random.Random(3).shuffle(tasks)

    def put(task: tuple[TargetArray, int, Chunk]) -> None:
        target, i, c = task
        writer.write_array(target, i, c.region, data[target.name][c.region])

    with ThreadPoolExecutor(max_workers=threads) as pool:  # files created while others write into them
        list(pool.map(put, tasks))
    writer.finish_process()
    writer.commit()

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    by_file: dict[str, list[Any]] = {}
    for index, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index.fqn, info))
    assert len(by_file) > 4
    for name, items in by_file.items():
        size = (path / name).stat().st_size
        assert size == sum(info.length for _, info in items)  # archives back to back, nothing else
        assert size <= 4096 or len(items) == 1, name  # over the limit only for a lone big archive
        if any(fqn == "big" for fqn, _ in items):
            assert len(items) == 1
    sd = {"small": torch.zeros(40), "big": torch.zeros(4, 1024)}
    dcp.load(sd, checkpoint_id=str(path))
    np.testing.assert_array_equal(sd["small"].numpy(), data["small"])
    np.testing.assert_array_equal(sd["big"].numpy(), data["big"])


# ---------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------
def _one_array_writer(tmp_path: Path, dtype: str = "float32") -> tuple[DcpWriter, TargetArray]:
    target = TargetArray(("x",), "x", (4,), dtype, _chunks(((0,), (2,)), ((2,), (2,))))
    writer = DcpWriter(Storage.create(str(tmp_path / "one")))
    writer.begin(WritePlan([target]))
    return writer, target


def test_rejects_bad_chunks(tmp_path: Path) -> None:
    writer, target = _one_array_writer(tmp_path)
    ok = np.zeros(2, dtype=np.float32)
    with pytest.raises(CkptError, match="is not chunk 0"):
        writer.write_array(target, 0, (slice(1, 3),), ok)
    with pytest.raises(CkptError, match="chunk index 5"):
        writer.write_array(target, 5, (slice(0, 2),), ok)
    with pytest.raises(CkptError, match="is float64, expected float32"):
        writer.write_array(target, 0, (slice(0, 2),), ok.astype(np.float64))
    with pytest.raises(CkptError, match="has shape"):
        writer.write_array(target, 0, (slice(0, 2),), np.zeros(3, dtype=np.float32))
    writer.write_array(target, 0, (slice(0, 2),), ok)
    with pytest.raises(CkptError, match="written twice"):
        writer.write_array(target, 0, (slice(0, 2),), ok)


def test_big_endian_and_strided_input_are_stored_little_endian(tmp_path: Path) -> None:
    writer, target = _one_array_writer(tmp_path)
    src = np.array([[1.5, 9.0], [-2.25, 9.0]], dtype=">f4")
    writer.write_array(target, 0, (slice(0, 2),), src[:, 0])  # big-endian and strided
    writer.write_array(target, 1, (slice(2, 4),), np.array([3.0, 4.0], dtype=np.float32))
    writer.finish_process()
    writer.commit()
    sd = {"x": torch.zeros(4)}
    dcp.load(sd, checkpoint_id=str(tmp_path / "one"))
    assert sd["x"].tolist() == [1.5, -2.25, 3.0, 4.0]


def test_rejects_unsupported_dtypes_and_values(tmp_path: Path) -> None:
    writer = DcpWriter(Storage.create(str(tmp_path / "bad")))
    with pytest.raises(CkptError, match="no torch equivalent"):
        writer.begin(WritePlan([TargetArray(("x",), "x", (2,), "float8_e4m3b11fnuz", RegularGrid((2,)))]))
    writer = DcpWriter(Storage.create(str(tmp_path / "bad2")))
    target = TargetValue(("v",), "v", {1, 2})
    writer.begin(WritePlan([target]))
    with pytest.raises(CkptError, match="a set value cannot be stored"):
        writer.write_value(target)
    with pytest.raises(CkptError, match="two targets share"):
        DcpWriter(Storage.create(str(tmp_path / "bad3"))).begin(WritePlan([target, target]))


def test_call_order_is_enforced(tmp_path: Path) -> None:
    writer, target = _one_array_writer(tmp_path)
    with pytest.raises(CkptError, match="expected finished"):
        writer.commit()
    writer.abort()
    with pytest.raises(CkptError, match="aborted"):
        writer.write_array(target, 0, (slice(0, 2),), np.zeros(2, dtype=np.float32))
    other = DcpWriter(Storage.create(str(tmp_path / "rank1")))
    other.begin(WritePlan([], process_index=1, process_count=2))
    other.finish_process()
    with pytest.raises(CkptError, match="primary process"):
        other.commit()


# ---------------------------------------------------------------------------
# The emitters on their own
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [2, 4])
def test_pickle_emitter_matches_cpython_for_plain_values(protocol: int) -> None:
    values = [
        0, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31), 2**31, -(2**100), 2**2100,
        1.5, float("nan"), -0.0, True, False, None, "", "é" * 200, "x" * 300, b"", b"\xff\x00", b"q" * 70000,
        (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), [], [1], list(range(1001)), {}, {"a": 1},
        {str(i): i for i in range(2000)},
        {"big": [1.0] * 20000, "s": "z" * 70000, "t": [("k", i) for i in range(3000)]},
    ]
    for value in values:
        assert dumps(value, protocol) == pickle.dumps(value, protocol=protocol), repr(value)[:60]


def test_value_archives_match_torch_save() -> None:
    for value in [5, "x", None, [1, (2.5, "y")], {"a": {"b": [True, None]}}, b"raw\xff", 2**70]:
        buf = io.BytesIO()
        torch.save(value, buf)
        parts, length = value_archive(value, "test")
        got = b"".join(bytes(p) for p in parts)
        assert len(got) == length and got == buf.getvalue(), value


@pytest.mark.parametrize("torch_dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64",
                                         "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
                                         "float64", "complex64"])
def test_tensor_archives_match_torch_save(torch_dtype: str) -> None:
    dt = dtypes.from_torch(torch_dtype)
    rng = np.random.default_rng(1)
    for shape in [(), (0, 3), (3, 1, 2), (70,)]:
        raw = rng.integers(0, 256, size=math.prod(shape) * dt.itemsize, dtype=np.uint8)
        arr = raw.view(dt.numpy).reshape(shape) if dt.name != "bool" else (raw % 2).astype(bool).reshape(shape)
        buf = io.BytesIO()
        torch.save(to_torch(arr), buf)
        parts, length = tensor_archive(dt, arr)
        got = b"".join(bytes(p) for p in parts)
        assert len(got) == length and got == buf.getvalue(), (torch_dtype, shape)


def test_sidecar_is_plain_json(tmp_path: Path) -> None:
    path = tmp_path / "side"
    write(str(path), process_index=1, process_count=2)
    doc = json.loads((path / ".ckpt-entries.1").read_text())
    assert doc["process_index"] == 1 and doc["entries"]
    assert all(row[2].startswith("__1_") for row in doc["entries"])


def test_lists_of_plain_values_become_one_item(tmp_path: Path) -> None:
    """torch saves a list holding no tensor and no dict as one item; an Orbax-style plan has its elements apart."""
    path = tmp_path / "lists"
    x = np.arange(3, dtype=np.float32)
    targets: list[Any] = [
        TargetValue(("cfg", "layers", 0), "cfg.layers.0", 64),
        TargetArray(("cfg", "w"), "cfg.w", (3,), "float32", RegularGrid((3,))),
        TargetValue(("cfg", "layers", 1), "cfg.layers.1", np.int64(32)),
        TargetValue(("cfg", "layers", 2), "cfg.layers.2", 10),
        TargetValue(("nested", 0, 0), "nested.0.0", "a"),
        TargetValue(("nested", 0, 1), "nested.0.1", "b"),
        TargetValue(("nested", 1, 0), "nested.1.0", None),
        # a list holding a tensor is walked into by torch: its elements stay apart
        TargetArray(("mixed", 0), "mixed.0", (3,), "float32", RegularGrid((3,))),
        TargetValue(("mixed", 1), "mixed.1", 5),
    ]
    plan = WritePlan(targets)
    writer = DcpWriter(Storage.create(str(path)))
    writer.begin(plan)
    for target in plan.arrays():
        writer.write_array(target, 0, (slice(0, 3),), x)
    for value in plan.values():
        writer.write_value(value)
    writer.finish_process()
    writer.commit()

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    md = FileSystemReader(str(path)).read_metadata()
    assert list(md.state_dict_metadata) == ["cfg.layers", "cfg.w", "nested", "mixed.0", "mixed.1"]
    assert md.planner_data["cfg.layers"] == ("cfg", "layers")
    sd = {"cfg": {"layers": [0, 0, 0], "w": torch.zeros(3)}, "nested": [], "mixed": [torch.zeros(3), 0]}
    dcp.load(sd, checkpoint_id=str(path))
    assert sd["cfg"]["layers"] == [64, 32, 10]
    assert sd["nested"] == [["a", "b"], [None]]
    assert sd["mixed"][1] == 5 and sd["mixed"][0].tolist() == [0.0, 1.0, 2.0]
    out = tmp_path / "lists.pt"
    dcp_to_torch_save(str(path), str(out))
    assert torch.load(out, weights_only=False)["cfg"]["layers"] == [64, 32, 10]
    assert ckpt_tool.open(str(path))["cfg.layers"].load() == [64, 32, 10]


def test_incomplete_lists_are_left_apart() -> None:
    from ckpt_tool.formats.dcp.write import _list_groups

    # an element filtered out: the list cannot be rebuilt faithfully
    gap = [TargetValue(("gap", 0), "gap.0", 1), TargetValue(("gap", 2), "gap.2", 3)]
    assert _list_groups(gap) == []
    # a dict inside a list makes torch walk into the list
    with_dict = [TargetValue(("l", 0), "l.0", 1), TargetValue(("l", 1, "a"), "l.1.a", 2)]
    assert _list_groups(with_dict) == []
    groups = _list_groups([TargetValue(("l", 1), "l.1", 1), TargetValue(("l", 0), "l.0", 2)])
    assert [(g.target.name, g.target.keys, list(g.members)) for g in groups] == [("l", ("l",), ["l.1", "l.0"])]


def test_list_elements_split_over_processes_are_refused(tmp_path: Path) -> None:
    plan = WritePlan([TargetValue(("l", 0), "l.0", 1), TargetValue(("l", 1), "l.1", 2)], process_count=1)
    writer = DcpWriter(Storage.create(str(tmp_path / "split")))
    writer.begin(plan)
    writer.write_value(plan.values()[0])
    with pytest.raises(CkptError, match="only 1 of the 2 elements of list 'l'"):
        writer.finish_process()


def test_list_merging_can_be_turned_off(tmp_path: Path) -> None:
    plan = WritePlan([TargetValue(("l", 0), "l.0", 1), TargetValue(("l", 1), "l.1", 2)])
    writer = DcpWriter(Storage.create(str(tmp_path / "apart")), merge_value_lists=False)
    writer.begin(plan)
    for value in plan.values():
        writer.write_value(value)
    writer.finish_process()
    writer.commit()
    ck = ckpt_tool.open(str(tmp_path / "apart"))
    assert [(leaf.keys, leaf.load()) for leaf in ck] == [(("l", 0), 1), (("l", 1), 2)]


def test_writer_does_not_import_torch(tmp_path: Path) -> None:
    script = f"""
import sys
import threading
import time
sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
import ml_dtypes  # noqa: F401 - numpy's "bfloat16" (tensorstore, which registered it, is no longer loaded here)
import numpy as np
from ckpt_tool.formats.dcp.write import DcpWriter
from ckpt_tool.core.model import RegularGrid
from ckpt_tool.storage import Storage
from ckpt_tool.core.write_plan import TargetArray, TargetValue, WritePlan
plan = WritePlan([TargetArray(("w",), "w", (3,), "bfloat16", RegularGrid((3,))), TargetValue(("s",), "s", 1)])
w = DcpWriter(Storage.create({str(tmp_path / "nt")!r}))
w.begin(plan)
w.write_array(plan.targets[0], 0, (slice(0, 3),), np.zeros(3, dtype="bfloat16"))
w.write_value(plan.targets[1])
w.finish_process()
w.commit()
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch was imported"
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    sd = {"w": torch.ones(3, dtype=torch.bfloat16), "s": 0}
    dcp.load(sd, checkpoint_id=str(tmp_path / "nt"))
    assert sd["w"].tolist() == [0.0, 0.0, 0.0] and sd["s"] == 1


def test_failed_data_write_then_abort_leaves_no_file_open(tmp_path: Path, monkeypatch) -> None:
    from ckpt_tool.storage import LocalFileWriter

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    writer, target = _one_array_writer(tmp_path)
    # files of 8 bytes: each chunk seals its own file, so the failing write is a file's last
    writer._file_bytes = 8
    real = LocalFileWriter.write_at
    calls = {"n": 0}

    def failing_second(self, offset, parts, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise CkptError("cannot write: No space left on device", self.where)
        return real(self, offset, parts, **kw)

    monkeypatch.setattr(LocalFileWriter, "write_at", failing_second)
    writer.write_array(target, 0, (slice(0, 2),), np.zeros(2, dtype=np.float32))
    with pytest.raises(CkptError, match="No space left"):
        writer.write_array(target, 1, (slice(2, 4),), np.zeros(2, dtype=np.float32))
    writer.abort()
    assert open_fds() == before


def test_a_data_file_that_cannot_be_created_fails_every_write_into_it(tmp_path: Path, monkeypatch) -> None:
    """A data file after the first is created outside the writer's lock, by the thread that
    opened it; a thread that placed its archive there meanwhile gets the same error, and a file
    that is not ckpt's, in the way of the name, is left as it was."""
    out = tmp_path / "out"
    small = TargetArray(("s",), "s", (8,), "float32", RegularGrid((4,)))
    big = TargetArray(("b",), "b", (32768,), "float32", RegularGrid((32768,)))  # 128 KiB: written, not gathered
    writer = DcpWriter(Storage.create(str(out)))
    writer.begin(WritePlan([small, big]))
    writer.write_array(small, 0, (slice(0, 4),), np.zeros(4, dtype=np.float32))  # the first file, made in place
    (out / "__0_1.distcp").write_bytes(b"not ckpt's")  # the next file's name is taken
    writer._current = None  # the next archive opens a new file
    gate = threading.Event()
    real = Storage.create_local_file

    def held(self, key, **kw):
        assert gate.wait(10)
        return real(self, key, **kw)

    def until(cond) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline
            time.sleep(0.005)

    monkeypatch.setattr(Storage, "create_local_file", held)
    with ThreadPoolExecutor(max_workers=2) as pool:
        opener = pool.submit(writer.write_array, small, 1, (slice(4, 8),), np.ones(4, dtype=np.float32))
        until(lambda: len(writer._files) == 2)
        other = pool.submit(writer.write_array, big, 0, (slice(0, 32768),), np.ones(32768, dtype=np.float32))
        until(lambda: writer._files[1].writing > 0)  # placed in the file being created, waiting for it
        gate.set()
        for fut in (opener, other):
            with pytest.raises(CkptError, match=r"__0_1\.distcp: cannot create: File exists"):
                fut.result(10)
    writer.abort()
    assert (out / "__0_1.distcp").read_bytes() == b"not ckpt's"


def test_a_failure_while_placing_never_leaves_a_file_waited_for(tmp_path: Path, monkeypatch) -> None:
    """The thread that opens a data file creates it after the lock; if placing its archive fails
    first, the file is never created, and an archive placed in it since gets that error (no wait
    forever for a create that will not come)."""
    from ckpt_tool.formats.dcp import write as dcp_write

    small = TargetArray(("s",), "s", (8,), "float32", RegularGrid((4,)))
    big = TargetArray(("b",), "b", (32768,), "float32", RegularGrid((32768,)))
    writer = DcpWriter(Storage.create(str(tmp_path / "out")))
    writer.begin(WritePlan([small, big]))
    writer.write_array(small, 0, (slice(0, 4),), np.zeros(4, dtype=np.float32))  # the first file, made in place
    writer._current = None  # the next archive opens a new file
    real = dcp_write._Entry

    def failing(*args):
        raise RuntimeError("placing failed")

    monkeypatch.setattr(dcp_write, "_Entry", failing)
    with pytest.raises(RuntimeError, match="placing failed"):
        writer.write_array(small, 1, (slice(4, 8),), np.ones(4, dtype=np.float32))
    opened = writer._files[1]
    assert opened.opened is not None and opened.opened.is_set() and opened.local is None
    monkeypatch.setattr(dcp_write, "_Entry", real)
    got: list[BaseException] = []

    def late() -> None:  # into the same file, still the current one
        try:
            writer.write_array(big, 0, (slice(0, 32768),), np.ones(32768, dtype=np.float32))
        except BaseException as exc:  # noqa: BLE001 - what it raised is the point
            got.append(exc)

    thread = threading.Thread(target=late, daemon=True)  # (a daemon: a regression hangs it, not the suite)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and len(got) == 1 and "placing failed" in str(got[0])
    writer.abort()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["__0_0.distcp"]
