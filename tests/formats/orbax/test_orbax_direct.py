"""OCDBT databases written by ckpt itself (storage/ocdbt_encode.py, ocdbt_writer.py, formats/orbax/direct.py).

tensorstore is the oracle: it reads every key ckpt's encoder wrote, and the Orbax writer's direct
output holds the same keys as tensorstore's own, the metadata byte for byte and every chunk
decoding to the same bytes, edge padding included. orbax's restores of the direct output are
tests/formats/orbax/test_orbax_writer.py's (local roots write directly).
"""
from __future__ import annotations

import os
import random
import struct

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zstandard

from ckpt_tool.base.errors import CkptError
from ckpt_tool.formats.orbax.write import OrbaxWriter
from ckpt_tool.core.model import RegularGrid
from ckpt_tool.storage import Storage
from ckpt_tool.storage.ocdbt_encode import Config, varint
from ckpt_tool.storage.ocdbt_writer import OcdbtDatabaseWriter
from ckpt_tool.core.write_plan import TargetArray, TargetValue, WritePlan


def _kv(path) -> ts.KvStore:
    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()


def _all(kv: ts.KvStore) -> dict[bytes, bytes]:
    return {bytes(k): bytes(kv.read(k).result().value) for k in kv.list().result()}


def test_varint():
    assert [varint(n) for n in (0, 1, 127, 128, 300, 2**64 - 1)] == [
        b"\x00", b"\x01", b"\x7f", b"\x80\x01", b"\xac\x02", b"\xff" * 9 + b"\x01"]


@pytest.mark.parametrize("max_node", [100_000_000, 600])
def test_database_reads_back_through_tensorstore_and_ckpts_walk(tmp_path, max_node):
    """Inline and out-of-line values, values put in parts, data files rolled over, and (small
    nodes) a B+tree of several levels: tensorstore and ckpt's own walk read every key."""
    rng = np.random.default_rng(3)
    db = OcdbtDatabaseWriter(Storage.create(str(tmp_path)), Config.new(max_decoded_node_bytes=max_node),
                             target_data_file_size=200_000)
    want = {}
    for i in range(600):
        key = f"layer{i % 9}/{i}.{i % 4}".encode()
        n = int(rng.integers(1, 40_000)) if i % 3 else int(rng.integers(0, 1024))
        value = rng.integers(0, 255, n, dtype=np.uint8).tobytes()
        want[key] = value
        if i % 5 == 0:
            db.put_parts(key, [value[: n // 3], value[n // 3:]])
        else:
            db.put(key, value)
    db.finish()
    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/").result()).result()
    (version,) = manifest["versions"]
    assert (version["root_height"] == 0) if max_node > 10**6 else (version["root_height"] >= 2)
    assert version["root"]["statistics"]["num_keys"] == 600
    assert _all(_kv(tmp_path)) == want
    assert len(os.listdir(tmp_path / "d")) > 10  # rolled over at 200 kB (and one node file)

    view = Storage.open(str(tmp_path)).ocdbt()
    located = view.locate_values(sorted(k.decode() for k in want))
    assert len(located) == 600
    for key, where in located.items():
        got = where if isinstance(where, bytes) else bytes(view.read_located(key, where))
        assert got == want[key.encode()]


def test_repeated_key_is_one_line_and_nothing_claims_to_be_a_database(tmp_path):
    db = OcdbtDatabaseWriter(Storage.create(str(tmp_path)), Config.new())
    db.put(b"a/0", b"x" * 2000)
    db.put(b"a/0", b"y")
    with pytest.raises(CkptError, match="repeated"):
        db.finish()
    assert not (tmp_path / "manifest.ocdbt").exists()


def test_discard_leaves_no_manifest(tmp_path):
    db = OcdbtDatabaseWriter(Storage.create(str(tmp_path)), Config.new())
    db.put(b"a/0", b"x" * 5000)
    db.discard()
    assert not (tmp_path / "manifest.ocdbt").exists()
    with pytest.raises(CkptError, match="discarded"):
        db.put(b"a/1", b"x" * 5000)


# -- the Orbax writer: direct output against tensorstore's ------------------------------------------

LEAVES = [  # (keys, value, chunk shape); chunk None: a scalar value
    (("w",), np.random.default_rng(1).standard_normal((37, 20)).astype(np.float32), (8, 6)),  # edges both ways
    (("b",), np.random.default_rng(2).standard_normal(9).astype(ml_dtypes.bfloat16), (4,)),
    (("big",), np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32), (64, 32)),
    # chunks of 1 MiB and more are compressed as a stream (direct.STREAM_MIN_BYTES)
    (("huge",), np.random.default_rng(4).standard_normal((700, 500)).astype(np.float32), (512, 512)),
    (("tiny",), np.arange(6, dtype=np.int8).reshape(2, 3), (2, 3)),  # inline
    (("zero_d",), np.array(1.5, np.float16), ()),
    (("step",), 7, None),
    (("lr",), 0.5, None),
]


def _write(path, *, zarr3: bool, blocks: bool) -> None:
    targets = []
    for keys, value, chunks in LEAVES:
        if chunks is None:
            targets.append(TargetValue(keys, keys[0], value, "scalar"))
        else:
            targets.append(TargetArray(keys, keys[0], value.shape, value.dtype.name, RegularGrid(chunks), None))
    plan = WritePlan(targets)
    writer = OrbaxWriter(Storage.create(str(path)), zarr3=zarr3)
    writer.begin(plan)
    tasks = []
    for keys, value, chunks in LEAVES:
        if chunks is None:
            continue
        target = next(t for t in plan.arrays() if t.keys == keys)
        if blocks and keys == ("w",):  # blocks of whole chunks, as core/blocks.py hands them over
            for r0 in range(0, 37, 16):
                region = (slice(r0, min(r0 + 16, 37)), slice(0, 20))
                tasks.append((target, 0, region, value[region]))
            continue
        grid = [range(0, s, c) for s, c in zip(value.shape, chunks)]
        for i, offsets in enumerate(np.ndindex(*[len(g) for g in grid]) if value.shape else [()]):
            region = tuple(slice(o * c, min((o + 1) * c, s)) for o, c, s in zip(offsets, chunks, value.shape))
            tasks.append((target, i, region, np.array(value[region])))
    random.Random(5).shuffle(tasks)
    for task in tasks:
        writer.write_array(*task)
    for value in plan.values():
        writer.write_value(value)
    writer.finish_process()
    writer.commit()


def _decoded(key: bytes, value: bytes, zarr3: bool) -> bytes:
    if key.endswith((b".zarray", b"zarr.json")):
        return value
    if zarr3:
        offset, length = struct.unpack_from("<QQ", value, len(value) - 20)
        value = value[offset: offset + length]
    return zstandard.ZstdDecompressor().decompressobj().decompress(value)


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr2", "zarr3"])
@pytest.mark.parametrize("blocks", [False, True], ids=["chunks", "blocks"])
def test_same_database_as_tensorstores(tmp_path, monkeypatch, zarr3, blocks):
    monkeypatch.setenv("CKPT_OCDBT_WRITER", "tensorstore")
    _write(tmp_path / "ts", zarr3=zarr3, blocks=blocks)
    monkeypatch.setenv("CKPT_OCDBT_WRITER", "ckpt")
    _write(tmp_path / "ckpt", zarr3=zarr3, blocks=blocks)
    for db in ("", "ocdbt.process_0"):
        theirs = _all(_kv(tmp_path / "ts" / db))
        ours = _all(_kv(tmp_path / "ckpt" / db))
        assert sorted(ours) == sorted(theirs)
        for key in theirs:
            assert _decoded(key, ours[key], zarr3) == _decoded(key, theirs[key], zarr3), key
    # the root database's tree is one node in its own d/ over the process's tree, whose values it
    # finds in the process's data files (tensorstore's merge copies the tree instead)
    base = ts.KvStore.open(f"file://{tmp_path}/ckpt/").result()
    root = ts.ocdbt.dump(base).result()["versions"][0]["root"]["location"]
    assert root.startswith("btreenode::d/")
    (child,) = ts.ocdbt.dump(base, root).result()["entries"]
    assert child["location"].startswith("btreenode:ocdbt.process_0/:d/")
    leaf = ts.ocdbt.dump(base, child["location"]).result()
    indirect = [e["indirect_value"] for e in leaf["entries"] if "indirect_value" in e]
    assert indirect and all(v.startswith("value:ocdbt.process_0/:d/") for v in indirect)
    # tensorstore's zarr driver reads every array back
    for keys, value, chunks in LEAVES:
        if chunks is None:
            continue
        spec = {"driver": "zarr3" if zarr3 else "zarr",
                "kvstore": {"driver": "ocdbt", "base": f"file://{tmp_path}/ckpt/", "path": keys[0] + "/"}}
        got = ts.open(spec, open=True).result().read().result()
        assert np.asarray(got).tobytes() == np.asarray(value).tobytes(), keys


def test_object_stores_keep_tensorstores_writer():
    """memory:// keeps tensorstore's writer (gs:// and s3:// are written by ckpt itself:
    tests/formats/orbax/test_remote_orbax_direct.py)."""
    writer = OrbaxWriter(Storage.create("memory://direct_test/"))
    assert not writer._writes_directly
    assert writer.pending_bytes_limit > 0


@pytest.mark.parametrize("zarr3, zmeta", [
    (False, {}), (False, {"dimension_separator": "/"}),
    (True, {}), (True, {"chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}}}),
    (True, {"chunk_key_encoding": {"name": "v2"}}),
    (True, {"chunk_key_encoding": {"name": "v2", "configuration": {"separator": "/"}}}),
])
def test_a_block_of_chunks_is_named_as_each_chunk_is(zarr3, zmeta) -> None:
    """A block's keys (spelled at once for its thousands of chunks) are each chunk's own key, in
    C order; so is the whole grid's listing; a 0-d array's one chunk has its own name."""
    from ckpt_tool.machinery.arrays.reading import block_chunk_keys, chunk_key, chunk_keys

    first, counts = (3, 0, 12), (2, 4, 3)
    want = [chunk_key("a.b", tuple(f + o for f, o in zip(first, offsets)), zarr3, zmeta) for offsets in np.ndindex(*counts)]
    assert block_chunk_keys("a.b", first, counts, zarr3, zmeta) == want and len(set(want)) == 24
    grid = list(chunk_keys("a.b", (5, 7), (2, 3), zarr3, zmeta))
    assert [k for _, k in grid] == [chunk_key("a.b", idx, zarr3, zmeta) for idx, _ in grid] and len(grid) == 9
    assert block_chunk_keys("a.b", (), (), zarr3, zmeta) == [chunk_key("a.b", (), zarr3, zmeta)]
    assert chunk_key("a.b", (), zarr3, zmeta) == ("a.b/c" if zarr3 and "v2" not in str(zmeta) else "a.b/0")
    assert chunk_key("a.b", (1, 2), False, {}) == "a.b/1.2" and chunk_key("a.b", (1, 2), True, {}) == "a.b/c/1/2"


def test_a_long_column_of_varints_is_each_value_s_varint() -> None:
    """Columns of varints are written at once (all one byte, or a long column through numpy): the
    bytes are each value's LEB128 varint, back to back, at every width up to 2**64 - 1."""
    from ckpt_tool.storage.ocdbt_encode import _varints

    rng = random.Random(5)
    for n in (1, 63, 64, 65, 1000):
        for top in (0x80, 1 << 14, 1 << 35, 1 << 64):
            values = [rng.randrange(top) for _ in range(n)] + [0, 127, 128, top - 1]
            assert _varints(values) == b"".join(varint(v) for v in values), (n, top)
    assert _varints([]) == b"" and _varints([5, 0, 127]) == bytes([5, 0, 127])
    with pytest.raises(ValueError, match="negative"):
        _varints([1, -1] * 40)


@pytest.mark.parametrize("level", [1, 3])
def test_rows_compressed_at_once_are_each_rows_own_frame(level, monkeypatch) -> None:
    """A block's chunks are compressed in one call (multi_compress_to_buffer): each frame is the
    bytes compress() makes of that row alone, in row order, and decodes back to it; without that
    call (another zstandard backend) the rows are compressed one by one to the same bytes."""
    from ckpt_tool.formats.orbax.direct import compress_rows

    rng = np.random.default_rng(level)
    rows = rng.standard_normal((37, 4096)).astype(ml_dtypes.bfloat16).view(np.uint8).reshape(37, -1)
    rows[3] = 0  # (a chunk of zeros: a frame far shorter than its neighbours)
    compressor = zstandard.ZstdCompressor(level=level)
    want = [compressor.compress(row.tobytes()) for row in rows]
    got = compress_rows(compressor, rows)
    assert [bytes(memoryview(f)) for f in got] == want
    assert [zstandard.ZstdDecompressor().decompress(bytes(memoryview(f))) for f in got] == [r.tobytes() for r in rows]
    assert [bytes(memoryview(f)) for f in compress_rows(compressor, rows[:1])] == want[:1]

    class OneByOne:  # a compressor without multi_compress_to_buffer
        compress = staticmethod(compressor.compress)

    assert [bytes(memoryview(f)) for f in compress_rows(OneByOne(), rows)] == want  # type: ignore[arg-type]
