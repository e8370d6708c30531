"""OrbaxWriter output, restored by orbax-checkpoint itself and read back by ckpt.

Plans are built by hand (no engine): nested dicts and a list, every common
dtype, 0-d arrays and scalars, a string, uneven multi-chunk grids, and
NamedSharding leaves on a 4x2 ('data', 'model') mesh whose chunk grid is the
per-device shard. Regions are written from two threads in random order.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# orbax restores jax.Arrays onto the 8 CPU devices the shardings name; set
# before anything imports jax (pytest imports every test module first)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import ml_dtypes
import numpy as np
import pytest

import ckpt_tool
from ckpt_tool.base.errors import CkptError, IncompleteCheckpointError
from ckpt_tool.formats.orbax.write import OrbaxWriter, UnsupportedValueError, unsupported_reason
from ckpt_tool.core.model import ArrayLeaf, RegularGrid, Sharding
from ckpt_tool.storage import Storage
from ckpt_tool.ops.validate import validate_checkpoint
from ckpt_tool.core.write_plan import TargetArray, TargetValue, WritePlan

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
MESH_SHAPE = (4, 2)
AXES = ("data", "model")


def _named(*spec) -> Sharding:
    return Sharding("named", mesh_shape=MESH_SHAPE, axis_names=AXES, partition_spec=tuple(spec), device_ids=tuple(range(8)))


def _tree(with_string: bool) -> list[tuple[tuple, object, tuple | None, Sharding | None]]:
    """(keys, value, chunk shape, sharding): arrays carry a chunk shape, values None."""
    rng = np.random.default_rng(7)
    leaves = [
        # chunk = per-device shard of the named sharding
        (("params", "dense", "kernel"), rng.standard_normal((16, 8)).astype(np.float32), (4, 4), _named("data", "model")),
        (("params", "dense", "bias"), rng.standard_normal(8).astype(ml_dtypes.bfloat16), (4,), _named("model")),
        (("params", "conv"), rng.standard_normal((8, 6, 4)).astype(np.float32), (2, 6, 2), _named("data", None, "model")),
        (("params", "embed"), rng.standard_normal((30, 7)).astype(np.float16), (8, 3), None),  # uneven edges
        (("counters", "u8"), rng.integers(0, 255, (4, 8)).astype(np.uint8), (4, 4), _named(None, "model")),
        (("counters", "mask"), rng.random(13) > 0.5, (5,), None),
        (("layers", 0, "w"), rng.integers(-1000, 1000, (9, 5)).astype(np.int32), (4, 2), None),
        (("layers", 0, "b"), np.arange(8, dtype=np.int64) * (1 << 40), (8,), _named()),  # replicated
        (("layers", 1, "w"), rng.integers(-1000, 1000, (9, 5)).astype(np.int32), (9, 5), None),
        (("layers", 1, "b"), np.arange(7, dtype=np.int64) - 3, (3,), None),
        (("zero_d",), np.array(2.5, np.float32), (), _named()),
        (("step",), 1234, None, None),
        (("lr",), 0.125, None, None),
        (("flag",), True, None, None),
    ]
    if with_string:
        leaves.append((("name",), "run-ümlaut", None, None))
    return leaves


def _plan(leaves, process_index: int = 0, process_count: int = 1) -> WritePlan:
    targets = []
    for keys, value, chunks, sharding in leaves:
        name = ".".join(str(k) for k in keys)
        if chunks is None:
            targets.append(TargetValue(keys, name, value, "string" if isinstance(value, str) else "scalar"))
        else:
            arr = np.asarray(value)
            targets.append(TargetArray(keys, name, arr.shape, arr.dtype.name, RegularGrid(chunks), sharding))
    return WritePlan(targets, process_index=process_index, process_count=process_count)


def _chunks(shape: tuple, chunks: tuple):
    """(index, region) of every chunk of the grid, in C order."""
    grid = [range(0, s, c) for s, c in zip(shape, chunks)]
    for i, offsets in enumerate(np.ndindex(*[len(g) for g in grid]) if shape else [()]):
        yield i, tuple(slice(o * c, min((o + 1) * c, s)) for o, c, s in zip(offsets, chunks, shape))


def _tasks(plan: WritePlan, values: dict):
    return [
        (t, i, region, np.asarray(values[t.keys])[region])
        for t in plan.arrays() for i, region in _chunks(t.shape, t.layout.chunk_shape)
    ]


def _write(path, leaves, *, zarr3: bool = False, seed: int = 0) -> None:
    """Write a whole checkpoint in one process: regions from 2 threads, shuffled."""
    plan = _plan(leaves)
    values = {keys: value for keys, value, _, _ in leaves}
    writer = OrbaxWriter(Storage.create(str(path)), zarr3=zarr3)
    writer.begin(plan)
    tasks = _tasks(plan, values)
    random.Random(seed).shuffle(tasks)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda task: writer.write_array(*task), tasks))
    for value in plan.values():
        writer.write_value(value)
    writer.finish_process()
    writer.commit()


def _get(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def _same_bits(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.fixture(scope="module")
def jax_x64():
    """jax and orbax, with 64-bit types on (int64 leaves) for this module only."""
    jax = pytest.importorskip("jax")
    ocp = pytest.importorskip("orbax.checkpoint")
    if jax.device_count() != 8:
        pytest.skip("needs 8 CPU devices (jax was initialised before XLA_FLAGS was set)")
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield jax, ocp
    jax.config.update("jax_enable_x64", old)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{(variant): path}: the full tree in zarr v2 and v3, and the string-free tree."""
    root = tmp_path_factory.mktemp("orbax_writer")
    out = {}
    for name, with_string, zarr3 in [("zarr2", True, False), ("zarr3", True, True), ("standard", False, False)]:
        out[name] = root / name
        _write(out[name], _tree(with_string), zarr3=zarr3, seed=len(out))
    return out


def _check_restored(restored, leaves) -> None:
    for keys, value, _, sharding in leaves:
        got = _get(restored, keys)
        if isinstance(value, (str, bool, int, float)):
            assert got == value and type(got) is type(value), keys
            continue
        _same_bits(got, value)
        if sharding is not None:
            # restored without a target: the sharding recorded in _sharding
            assert tuple(got.sharding.spec) == sharding.partition_spec, keys
            assert got.sharding.mesh.axis_names == AXES and got.sharding.mesh.devices.shape == MESH_SHAPE


@pytest.mark.parametrize("variant", ["zarr2", "zarr3"])
def test_pytree_checkpointer_restores_everything(written, jax_x64, variant):
    _, ocp = jax_x64
    restored = ocp.PyTreeCheckpointer().restore(str(written[variant]))
    _check_restored(restored, _tree(True))


def test_standard_checkpointer_restores_without_and_with_target(written, jax_x64):
    jax, ocp = jax_x64
    path = str(written["standard"])
    leaves = _tree(False)
    _check_restored(ocp.StandardCheckpointer().restore(path), leaves)

    # onto the 8-device mesh with shardings unlike the saved ones
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(MESH_SHAPE), AXES)
    P = jax.sharding.PartitionSpec
    target: dict = {}
    want_specs = {}
    for keys, value, chunks, _ in leaves:
        if chunks is None:
            leaf = value
        else:
            arr = np.asarray(value)
            spec = P("model") if arr.ndim and arr.shape[0] % 2 == 0 else P()
            want_specs[keys] = spec
            leaf = jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
        _set(target, keys, leaf)
    restored = ocp.StandardCheckpointer().restore(path, target)
    for keys, value, chunks, _ in leaves:
        got = _get(restored, keys)
        if chunks is None:
            assert got == value
            continue
        _same_bits(got, value)
        assert isinstance(got, jax.Array) and got.sharding.spec == want_specs[keys], keys


def _set(tree, keys, value) -> None:
    """Put value at keys, creating dicts and lists on the way."""
    node = tree
    for k, nxt in zip(keys[:-1], keys[1:]):
        if isinstance(node, list):
            while len(node) <= k:
                node.append(None)
            if node[k] is None:
                node[k] = [] if isinstance(nxt, int) else {}
            node = node[k]
        else:
            node = node.setdefault(k, [] if isinstance(nxt, int) else {})
    last = keys[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def test_restore_as_numpy(written, jax_x64):
    _, ocp = jax_x64
    leaves = _tree(True)
    restore_args: dict = {}
    for keys, _, chunks, _ in leaves:
        _set(restore_args, keys, ocp.RestoreArgs(restore_type=np.ndarray) if chunks is not None else ocp.RestoreArgs())
    restored = ocp.PyTreeCheckpointer().restore(
        str(written["zarr2"]), args=ocp.args.PyTreeRestore(restore_args=restore_args)
    )
    for keys, value, chunks, _ in leaves:
        got = _get(restored, keys)
        if chunks is None:
            assert got == value
        else:
            assert type(got) is np.ndarray, keys
            _same_bits(got, value)


@pytest.mark.parametrize("variant", ["zarr2", "zarr3"])
def test_ckpt_reads_it_back_and_validates_clean(written, variant):
    path = str(written[variant])
    ck = ckpt_tool.open(path)
    assert ck.committed and ck.format == "orbax"
    assert ck.layout["zarr"] == (3 if variant == "zarr3" else 2) and ck.layout["ocdbt"] == "merged"
    for keys, value, chunks, sharding in _tree(True):
        leaf = ck[list(keys)]
        if chunks is None:
            assert leaf.load() == value
            continue
        assert isinstance(leaf, ArrayLeaf) and leaf.chunk_shape == chunks
        _same_bits(leaf.read(), value)
        assert leaf.sharding == sharding
    report = validate_checkpoint(path, deep=True)
    assert report.findings == [], [f.to_json() for f in report.findings]
    # counted as inspect counts them: 11 arrays, and the scalars and the string as values
    assert (report.checked["arrays"], report.checked["values"]) == (11, 4)


def test_layout_matches_orbax(written):
    """The files and metadata text orbax 0.12.8 writes, beside a real fixture's."""
    path = written["zarr2"]
    names = sorted(os.listdir(path))
    assert names == [
        "_CHECKPOINT_METADATA", "_METADATA", "_sharding", "_strings.json", "array_metadatas",
        "commit_success.txt", "d", "manifest.ocdbt", "ocdbt.process_0",
    ]
    step = json.loads((path / "_CHECKPOINT_METADATA").read_text())
    assert list(step) == ["item_handlers", "metrics", "performance_metrics", "init_timestamp_nsecs",
                          "commit_timestamp_nsecs", "custom_metadata"]
    assert step["item_handlers"].endswith("PyTreeCheckpointHandler")
    assert json.loads((written["standard"] / "_CHECKPOINT_METADATA").read_text())["item_handlers"].endswith(
        "StandardCheckpointHandler"
    )
    meta = json.loads((path / "_METADATA").read_text())
    entry = meta["tree_metadata"]["('layers', '0', 'w')"]
    assert entry["key_metadata"][1] == {"key": "0", "key_type": 1}
    assert entry["value_metadata"] == {"value_type": "np.ndarray", "skip_deserialize": False}
    assert meta["tree_metadata"]["('params', 'dense', 'kernel')"]["value_metadata"]["write_shape"] == [4, 4]
    assert {k: meta[k] for k in meta if k != "tree_metadata"} == {
        "use_ocdbt": True, "use_zarr3": False, "store_array_data_equal_to_fill_value": True, "custom_metadata": None,
    }
    # same _sharding text as orbax for the same sharding
    fixture = json.loads((FIXTURES / "orbax_ocdbt_zarr3" / "_sharding").read_text())
    ours = json.loads((path / "_sharding").read_text())
    assert ours["cGFyYW1zLmRlbnNlLmtlcm5lbA=="] == fixture["cGFyYW1zLmRlbnNlLmtlcm5lbA=="]
    arrays = json.loads((path / "array_metadatas/process_0").read_text())["array_metadatas"]
    assert {"param_name": "params.dense.kernel", "write_shape": [4, 4], "chunk_shape": [4, 4],
            "ext_metadata": None} in [a["array_metadata"] for a in arrays]
    assert len(arrays) == 6  # jax.Array leaves only, as orbax


def test_two_processes_restore_in_one(tmp_path, jax_x64):
    _, ocp = jax_x64
    leaves = _tree(True)
    values = {keys: value for keys, value, _, _ in leaves}
    path = str(tmp_path / "two")
    writers = [OrbaxWriter(Storage.create(path)) for _ in range(2)]
    plans = [_plan(leaves, i, 2) for i in range(2)]
    for writer, plan in zip(writers, plans):
        writer.begin(plan)
    tasks = [(n % 2, task) for n, task in enumerate(_tasks(plans[0], values))]
    random.Random(3).shuffle(tasks)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda pt: writers[pt[0]].write_array(*pt[1]), tasks))
    for value in plans[0].values():
        writers[0].write_value(value)
    for writer in writers:
        writer.finish_process()
    with pytest.raises(CkptError, match="primary"):
        writers[1].commit()
    writers[0].commit()
    assert {"ocdbt.process_0", "ocdbt.process_1", "manifest.ocdbt"} <= set(os.listdir(path))
    assert sorted(os.listdir(os.path.join(path, "array_metadatas"))) == ["process_0", "process_1"]
    _check_restored(ocp.PyTreeCheckpointer().restore(path), leaves)
    assert validate_checkpoint(path, deep=True).findings == []


@pytest.mark.parametrize("ocdbt_writer", ["ckpt", "tensorstore"])
def test_more_processes_than_chunks_merge_into_one_database(tmp_path, monkeypatch, jax_x64, ocdbt_writer):
    """8 processes, 6 chunks: the primary's merge (ckpt's own, or tensorstore's with the switch)
    makes one root database over the 6 process databases written; the 2 processes that owned no
    chunk write none (ckpt's writer refused an empty database before), and orbax restores it."""
    _, ocp = jax_x64
    monkeypatch.setenv("CKPT_OCDBT_WRITER", ocdbt_writer)
    path = str(tmp_path / "eight")
    arr = np.random.default_rng(5).standard_normal((768, 512)).astype(np.float32)
    target = TargetArray(("a",), "a", arr.shape, "float32", RegularGrid((128, 512)))
    writers = [OrbaxWriter(Storage.create(path)) for _ in range(8)]
    for i, writer in enumerate(writers):
        writer.begin(WritePlan([target], process_index=i, process_count=8))
    for c in range(6):  # chunk c by process c: the chunks are stored out of line (256 KiB each)
        writers[c].write_array(target, c, (slice(c * 128, (c + 1) * 128), slice(0, 512)), arr[c * 128:(c + 1) * 128])
    for writer in writers:
        writer.finish_process()
    writers[0].commit()
    assert sorted(p for p in os.listdir(path) if p.startswith("ocdbt.")) == [f"ocdbt.process_{i}" for i in range(6)]
    _same_bits(ocp.PyTreeCheckpointer().restore(path)["a"], arr)
    assert validate_checkpoint(path, deep=True).findings == []


def test_lost_chunk_refuses_commit(tmp_path):
    path = tmp_path / "lost"
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    target = TargetArray(("a",), "a", (3, 4), "float32", RegularGrid((2, 4)))
    writer = OrbaxWriter(Storage.create(str(path)))
    writer.begin(WritePlan([target]))
    writer.write_array(target, 0, (slice(0, 2), slice(0, 4)), arr[:2])
    # mid-write the step reads as an uncommitted save
    assert not ckpt_tool.open(str(path)).committed
    writer.finish_process()
    with pytest.raises(IncompleteCheckpointError, match=r"1 of 2 chunks .* chunk \[1, 0\], region \[2:3, 0:4\]"):
        writer.commit()
    assert not (path / "commit_success.txt").exists() and not (path / "manifest.ocdbt").exists()
    assert not validate_checkpoint(str(path)).ok()


@pytest.mark.parametrize("ocdbt_writer", ["ckpt", "tensorstore"])
def test_process_database_is_fsynced_whole_before_the_commit(tmp_path, monkeypatch, ocdbt_writer):
    """Every file and directory of a process's OCDBT database is fsynced before anything marks the
    checkpoint committed. tensorstore writes it without an fsync per commit, so finish_process
    fsyncs the whole tree; ckpt's own writer fsyncs each file as it closes it (finish_process then
    fsyncs the directories), and its manifest goes through Storage.write, which fsyncs it (as
    `manifest.ocdbt.__lock`) before renaming it into place. After the marker, only the marker's
    own directory is fsynced (its rename made durable)."""
    import ckpt_tool.storage.local as storage_local  # fsync_tree lives there

    monkeypatch.setenv("CKPT_OCDBT_WRITER", ocdbt_writer)
    path = tmp_path / "synced"
    synced: set[str] = set()
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        assert not (path / "commit_success.txt").exists() or target == str(path), "fsync after the commit marker"
        synced.add(target)
        real_fsync(fd)

    monkeypatch.setattr(storage_local.os, "fsync", spy)
    _write(path, _tree(with_string=False))
    db = path / "ocdbt.process_0"
    wanted = {str(p) for p in db.rglob("*")} | {str(db)}
    assert len([p for p in wanted if os.path.isfile(p)]) >= 2  # the manifest and data files
    if ocdbt_writer == "ckpt":
        wanted.discard(str(db / "manifest.ocdbt"))
    assert wanted <= synced, sorted(wanted - synced)
    assert (path / "commit_success.txt").exists()


def test_unsupported_and_malformed_plans_fail_before_writing(tmp_path):
    storage = Storage.create(str(tmp_path / "bad"))
    grid = RegularGrid((2,))
    ok = TargetArray(("x",), "x", (2,), "float32", grid)
    bad_value = TargetValue(("cfg",), "cfg", {"a": 1}, "object")
    assert "dict" in unsupported_reason(bad_value)
    assert unsupported_reason(TargetValue(("e",), "e", [], "object")) is None  # orbax's empty List
    with pytest.raises(UnsupportedValueError, match="cfg: a dict value has no Orbax leaf type"):
        OrbaxWriter(storage).begin(WritePlan([ok, bad_value]))
    sparse = TargetArray(("l", 1), "l.1", (2,), "float32", grid)
    with pytest.raises(CkptError, match=r"l: list has indices \[1\] but not \[0\]"):
        OrbaxWriter(storage).begin(WritePlan([ok, sparse]))
    with pytest.raises(CkptError, match="both a leaf and a container"):
        OrbaxWriter(storage).begin(WritePlan([ok, TargetArray(("x", "y"), "x.y", (2,), "float32", grid)]))
    assert os.listdir(tmp_path / "bad") == []
    writer = OrbaxWriter(storage)
    writer.begin(WritePlan([ok]))
    with pytest.raises(CkptError, match="dtype float64 for an array of dtype float32"):
        writer.write_array(ok, 0, (slice(0, 2),), np.zeros(2))
    with pytest.raises(CkptError, match="outside the array shape"):
        writer.write_array(ok, 0, (slice(1, 3),), np.zeros(2, np.float32))
    writer.abort()


def test_memory_storage():
    """memory:// output (shared tensorstore context) reads back through ckpt."""
    leaves = _tree(True)
    _write("memory://orbax-writer-test", leaves, zarr3=True)
    ck = ckpt_tool.open("memory://orbax-writer-test")
    for keys, value, chunks, _ in leaves:
        if chunks is not None:
            _same_bits(ck[list(keys)].read(), value)


def test_single_device_sharding_restores_on_that_device(tmp_path, jax_x64):
    jax, ocp = jax_x64
    device = jax.devices()[3]
    arr = np.arange(6, dtype=np.float32)
    target = TargetArray(("a",), "a", (6,), "float32", RegularGrid((4,)), Sharding("single_device", device=str(device)))
    writer = OrbaxWriter(Storage.create(str(tmp_path / "sd")))
    writer.begin(WritePlan([target]))
    for i, region in _chunks((6,), (4,)):
        writer.write_array(target, i, region, arr[region])
    writer.finish_process()
    writer.commit()
    got = ocp.StandardCheckpointer().restore(str(tmp_path / "sd"))["a"]
    assert got.sharding.device_set == {device}
    _same_bits(got, arr)


def test_writer_imports_neither_jax_nor_orbax():
    code = (
        "import sys, ckpt_tool.formats.orbax.write\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'orbax', 'torch')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
