"""Many keys of an OCDBT database read by one walk of its B+tree (ckpt_tool/storage/ocdbt_bulk.py):
the same answers as tensorstore's point reads, on trees tensorstore writes (several levels, values in
line and out of line, keys absent) and on every Orbax fixture with an OCDBT database."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tensorstore as ts

from ckpt_tool.storage import Storage, ocdbt_bulk

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "fixtures")


def _write_db(path: str, n: int, node_bytes: int) -> dict[str, bytes]:
    """An OCDBT database written by tensorstore with small nodes (a tree of several levels); every
    third value too large to be stored in line."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": path + "/"},
                          "config": {"max_decoded_node_bytes": node_bytes, "max_inline_value_bytes": 64}}).result()
    values = {f"layer{i // 100}/p{i:05d}/.zarray": (b"v%d" % i) * (40 if i % 3 == 0 else 1) for i in range(n)}
    txn = ts.Transaction()
    for key, value in values.items():
        kv.with_transaction(txn)[key] = value
    txn.commit_async().result()
    return values


def _point_reads(view: Storage, keys: list[str]) -> dict[str, bytes | None]:
    out = {}
    for key in keys:
        r = view.backend.kvstore.read(key).result()
        out[key] = bytes(r.value) if r.state == "value" else None
    return out


def test_walk_equals_point_reads_on_a_deep_tree(tmp_path):
    values = _write_db(str(tmp_path / "db"), 1500, node_bytes=600)
    base = ts.KvStore.open({"driver": "file", "path": str(tmp_path / "db") + "/"}).result()
    height = ts.ocdbt.dump(base).result()["versions"][-1]["root_height"]
    assert height >= 2  # the walk crosses interior nodes and their key prefixes
    wanted = sorted(values)[::7] + ["layer3/p99999/.zarray", "aaa", "zzz"]  # some absent, before and after all
    inline, indirect = ocdbt_bulk.read_keys(base, wanted, lambda f: f.result())
    # an out-of-line value is where the walk says it is: the bytes there are the value
    for key, ref in indirect.items():
        got = base.read(ref.path, byte_range=slice(ref.offset, ref.offset + ref.length)).result().value
        assert bytes(got) == values[key]
    assert indirect and inline  # both kinds of value were met
    assert set(inline) | set(indirect) == {k for k in wanted if k in values}
    assert all(inline[k] == values[k] for k in inline)
    assert all(len(values[k]) > 64 for k in indirect)


def test_storage_bulk_reads_equal_point_reads(tmp_path, monkeypatch):
    values = _write_db(str(tmp_path / "db"), 600, node_bytes=2000)
    view = Storage.open(str(tmp_path / "db")).ocdbt()
    keys = sorted(values)[::3] + ["layer0/nothing/.zarray"]
    monkeypatch.setattr(ocdbt_bulk, "BULK_MIN_KEYS", 1)
    pending = view.start_reads(keys)
    # (Storage counts the bytes of what it hands back: the backend's reads inside that count)
    assert isinstance(pending._reads, __import__("ckpt_tool.storage.ocdbt_view", fromlist=["x"]).OcdbtBulkReads)
    assert pending.result() == _point_reads(view, keys)
    # a view one directory down the database: keys relative to it
    sub = view.child("layer1")
    sub_keys = [k[len("layer1/"):] for k in keys if k.startswith("layer1/")]
    assert sub.start_reads(sub_keys).result() == {k: values["layer1/" + k] for k in sub_keys}


def _ckpt_json(args: list[str], env: dict[str, str]) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "ckpt_tool", *args, "--json"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["orbax_ocdbt_zarr2", "orbax_ocdbt_zarr3", "orbax_two_process", "orbax_v0_4_ocdbt",
                                  "orbax_v0_11/standard", "orbax_v0_11/manager", "orbax_manager"])
def test_fixtures_read_the_same_through_the_walk(name):
    """inspect and validate --deep of each OCDBT fixture: the same JSON whether every metadata read
    walks the tree (CKPT_OCDBT_BULK_MIN_KEYS=1) or reads each key."""
    path = os.path.join(FIXTURES, name)
    point = {**os.environ, "CKPT_OCDBT_BULK_MIN_KEYS": "1000000000"}
    walk = {**os.environ, "CKPT_OCDBT_BULK_MIN_KEYS": "1"}
    for args in (["inspect", path], ["validate", "--deep", path]):
        rc_a, a = _ckpt_json(args, point)
        rc_b, b = _ckpt_json(args, walk)
        assert (rc_a, a) == (rc_b, b)
        assert rc_a == 0


# -- the leaf-node decoder (ckpt_tool/storage/ocdbt_node.py) against tensorstore's own dump ----------

def _leaves(path: str):
    """(location text, key prefix, dumped entries) of every leaf node of the database at `path`."""
    base = ts.KvStore.open({"driver": "file", "path": path + "/"}).result()
    version = ts.ocdbt.dump(base).result()["versions"][-1]
    stack = [(version["root"]["location"], b"")]
    while stack:
        location, prefix = stack.pop()
        node = ts.ocdbt.dump(base, location).result()
        if node["height"]:
            stack += [(e["location"], prefix + e["subtree_common_prefix"]) for e in node["entries"]]
        else:
            yield base, location, prefix, node["entries"]


def test_leaf_nodes_decode_as_tensorstore_dumps_them(tmp_path):
    from ckpt_tool.storage import ocdbt_node

    _write_db(str(tmp_path / "db"), 1500, node_bytes=600)
    seen = {"inline": 0, "indirect": 0}
    for base, location, prefix, dumped in _leaves(str(tmp_path / "db")):
        where = ocdbt_node.parse_location(location)
        raw = base.read(where.path, byte_range=slice(where.offset, where.offset + where.length)).result().value
        node = ocdbt_node.LeafNode(raw, where)
        got = [(key, node.value(i)) for key, i in node.entries(prefix)]
        want = []
        for e in dumped:
            if "inline_value" in e:
                want.append((prefix + e["key"], e["inline_value"]))
                seen["inline"] += 1
            else:
                ref = ocdbt_node.parse_location(e["indirect_value"])
                want.append((prefix + e["key"], ocdbt_node.IndirectValue(ref.path, ref.offset, ref.length)))
                seen["indirect"] += 1
        assert got == want
    assert seen["inline"] and seen["indirect"]


@pytest.mark.parametrize("damage", ["magic", "length", "crc", "body"])
def test_a_damaged_leaf_node_is_refused(tmp_path, damage):
    from ckpt_tool.storage import ocdbt_node

    _write_db(str(tmp_path / "db"), 50, node_bytes=100_000)
    base, location, _, _ = next(_leaves(str(tmp_path / "db")))
    where = ocdbt_node.parse_location(location)
    raw = bytearray(base.read(where.path, byte_range=slice(where.offset, where.offset + where.length)).result().value)
    if damage == "magic":
        raw[0] ^= 0xFF
    elif damage == "length":
        raw[4] ^= 0x01
    elif damage == "crc":
        raw[-1] ^= 0x01
    else:  # a flipped bit in the compressed body, the CRC recomputed: the decoder itself must refuse or differ
        import google_crc32c

        raw[len(raw) // 2] ^= 0x10
        raw[-4:] = google_crc32c.value(bytes(raw[:-4])).to_bytes(4, "little")
    try:
        node = ocdbt_node.LeafNode(bytes(raw), where)
        list(node.entries())
    except ocdbt_node.OcdbtNodeError:
        return
    assert damage == "body"  # a flip inside an inline value decodes (the value's own codec catches it)


def test_a_node_claiming_a_huge_body_is_refused_before_decompressing_it(tmp_path):
    import zstandard
    import google_crc32c

    from ckpt_tool.storage import ocdbt_node

    body = zstandard.ZstdCompressor().compress(b"\0" * (4 * 2**20))  # 4 MiB of zeros in a few hundred bytes
    head = ocdbt_node.BTREE_NODE_MAGIC.to_bytes(4, "big")
    total = 4 + 8 + 2 + len(body) + 4
    raw = head + total.to_bytes(8, "little") + b"\x00\x01" + body
    raw += google_crc32c.value(raw).to_bytes(4, "little")
    where = ocdbt_node.Location("", "d/x", 0, len(raw))
    with pytest.raises(ocdbt_node.OcdbtNodeError, match="more than"):
        ocdbt_node.LeafNode(raw, where, max_decoded=2**20)


# -- chunks located by the walk and decoded by ckpt (machinery/arrays/reading.py LocatedZarrRegionReader) ------

OCDBT_FIXTURES = ["orbax_ocdbt_zarr2", "orbax_ocdbt_zarr3", "orbax_v0_4_ocdbt", "orbax_two_process", "flax_orbax"]


@pytest.mark.parametrize("batch_keys", [8192, 3])  # 3: walks of a few keys, cut inside arrays and across them
@pytest.mark.parametrize("name", OCDBT_FIXTURES)
def test_located_chunks_equal_tensorstore_reads(name, batch_keys, monkeypatch):
    import itertools

    import numpy as np

    import ckpt_tool
    from ckpt_tool.machinery.arrays import reading
    from ckpt_tool.machinery.arrays.reading import LocatedZarrRegionReader, ZarrRegionReader, chunk_keys

    monkeypatch.setattr(reading, "LOCATED_BATCH_KEYS", batch_keys)
    walked_keys = []
    real_locate = Storage.locate_values
    monkeypatch.setattr(Storage, "locate_values", lambda self, keys: (walked_keys.append(len(keys)), real_locate(self, keys))[1])
    ck = ckpt_tool.open(os.path.join(FIXTURES, name))
    located = chunks = 0
    for leaf in ck.leaves:
        reader = getattr(leaf, "reader", None)
        if not isinstance(reader, LocatedZarrRegionReader):
            continue
        located += 1
        shape, chunk = reader._shape, reader._chunk_shape
        # the reader's numbering of its chunks is the grid order chunk_keys gives
        grid_keys = [key for _, key in chunk_keys(reader._name, shape, chunk, reader._zarr3, reader._zmeta)]
        assert reader.chunk_keys(0, reader.chunk_count) == grid_keys
        if len(grid_keys) >= 3:
            assert reader.chunk_keys(1, 3) == grid_keys[1:3]
        for index in itertools.product(*[range(-(-n // c)) for n, c in zip(shape, chunk)]):
            region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, chunk, shape))
            assert reader._whole_chunk(region) == index
            walked = reader.read(region)
            direct = ZarrRegionReader.start_read(reader, region)()  # the same region through tensorstore
            assert walked.dtype == direct.dtype and walked.shape == direct.shape, leaf.name
            assert np.array_equal(walked, direct, equal_nan=True), leaf.name
            chunks += 1
        # a region that is not one chunk goes through tensorstore, with the same values
        whole = tuple(slice(0, n) for n in shape)
        if shape and reader._whole_chunk(whole) is None:
            assert np.array_equal(reader.read(whole), np.asarray(ZarrRegionReader.start_read(reader, whole)()), equal_nan=True)
    if name in ("orbax_ocdbt_zarr2", "orbax_ocdbt_zarr3"):  # (the others' arrays are unmerged, or not decodable here)
        assert located and chunks > located, "no array of several chunks took the walk"
    assert all(n <= batch_keys for n in walked_keys), walked_keys  # one walk's keys stay bounded


def test_a_damaged_small_chunk_fails_validate_deep_in_one_line(tmp_path):
    import shutil

    import zstandard

    src = tmp_path / "ck"
    shutil.copytree(os.path.join(FIXTURES, "orbax_ocdbt_zarr2"), src)
    # rewrite one small array's chunk through tensorstore as bytes that are no zstd frame
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(src) + "/"}}).result()
    keys = [k.decode() for k in kv.list().result()]
    metas = {k.rsplit("/", 1)[0]: json.loads(kv[k]) for k in keys if k.endswith("/.zarray")}
    name = next(n for n, z in metas.items() if all(c >= s for c, s in zip(z["chunks"], z["shape"]))
                and (z.get("compressor") or {}).get("id") == "zstd")
    chunk = next(k for k in keys if k.startswith(name + "/") and not k.endswith(".zarray"))
    assert zstandard.frame_content_size(kv[chunk]) > 0
    kv[chunk] = b"\x28\xb5\x2f\xfd" + b"\xff" * 12
    proc = subprocess.run([sys.executable, "-m", "ckpt_tool", "validate", "--deep", str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert name in proc.stdout + proc.stderr


@pytest.mark.parametrize("path", [b"../x", b"d/../../x", b"/etc/passwd", b"d//x"])
def test_a_data_file_path_that_leaves_the_database_is_refused(path):
    """Out-of-line values are read by byte range from the base store: a node's data file table must
    not point outside the database (tensorstore's writers never write such a path)."""
    import numpy as np

    from ckpt_tool.storage import ocdbt_node

    # one file: count 1, no prefix lengths, suffix length, base path length 0, the path
    table = bytes([1, len(path), 0]) + path
    with pytest.raises(ocdbt_node.OcdbtNodeError, match="leaves the database"):
        ocdbt_node._data_file_table(np.frombuffer(table, dtype=np.uint8), 0, "")
    paths, end = ocdbt_node._data_file_table(np.frombuffer(bytes([1, 3, 0]) + b"d/x", dtype=np.uint8), 0, "")
    assert paths == ["d/x"] and end == 6


def test_a_location_is_unescaped_as_urllib_unescapes_it():
    """parse_location decodes a location's %XX escapes itself (no urllib.parse, and its ipaddress, at
    every start): the paths urllib.parse.unquote_to_bytes gives, on valid, cut and invalid escapes."""
    import itertools
    from urllib.parse import unquote_to_bytes

    from ckpt_tool.storage import ocdbt_node

    pieces = ["%", "%2", "%41", "%e9", "%C3%A9", "%G1", "%%", "a", "/", "é", "€", "4"]
    for n in range(4):
        for combo in itertools.product(pieces, repeat=n):
            text = "".join(combo)
            where = ocdbt_node.parse_location(f"value:{text}:d/{text}x:3:4")
            assert where.base_path == unquote_to_bytes(text).decode("utf-8", "surrogateescape"), text
            assert where.relative_path == unquote_to_bytes(f"d/{text}x").decode("utf-8", "surrogateescape"), text
            assert (where.offset, where.length) == (3, 4)
