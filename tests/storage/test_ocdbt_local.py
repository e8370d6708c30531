"""A local OCDBT database of the kind orbax writes (one manifest file, its root a leaf node) is read
without tensorstore (issue 46): ckpt's own decoder reads the manifest and the leaf, by pread. Its
reading of each manifest equals tensorstore's dump; a database of another kind, or a damaged
manifest, is tensorstore's to read (and to word the error of) as before."""
from __future__ import annotations

import glob
import os
import shutil

import pytest
import tensorstore as ts

from conftest import FIXTURES

from ckpt_tool.base.errors import CkptError
from ckpt_tool.storage import Storage, ocdbt_node


def _manifests() -> list[str]:
    found = sorted(glob.glob(str(FIXTURES / "**" / "manifest.ocdbt"), recursive=True))
    assert len(found) > 20
    return found


def _dump(directory: str) -> dict:
    kv = ts.KvStore.open({"driver": "file", "path": directory + "/"}).result()
    return ts.ocdbt.dump(kv).result()


def test_every_fixture_manifest_reads_as_tensorstore_dumps_it():
    for path in _manifests():
        directory = os.path.dirname(path)
        md = _dump(directory)
        mine = ocdbt_node.single_leaf_manifest(open(path, "rb").read())
        assert mine is not None, path  # (orbax's: one file, inline versions, a leaf at the root)
        assert mine.root == ocdbt_node.parse_location(md["versions"][-1]["root"]["location"]), path
        assert mine.max_decoded_node_bytes == md["config"]["max_decoded_node_bytes"], path


def test_a_deep_tree_is_left_to_tensorstore(tmp_path):
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(tmp_path) + "/"},
                          "config": {"max_decoded_node_bytes": 500}}).result()
    txn = ts.Transaction()
    for i in range(400):
        kv.with_transaction(txn)[f"k{i:04d}"] = b"v" * 20
    txn.commit_async().result()
    assert _dump(str(tmp_path))["versions"][-1]["root_height"] > 0
    assert ocdbt_node.single_leaf_manifest((tmp_path / "manifest.ocdbt").read_bytes()) is None
    view = Storage.open(str(tmp_path)).ocdbt()
    assert view.backend.local_tree is None
    got = view.read_many([f"k{i:04d}" for i in range(0, 400, 7)] + ["absent"])
    assert got["absent"] is None and all(v == b"v" * 20 for k, v in got.items() if k != "absent")


def test_an_orbax_database_is_read_without_opening_tensorstore():
    view = Storage.open(str(FIXTURES / "orbax_ocdbt_zarr2")).ocdbt()
    assert view.backend.local_tree is not None
    keys = [k for k in view.backend.kvstore.list().result()]  # (tensorstore's own listing, for the check)
    keys = [k.decode() for k in keys]
    fresh = Storage.open(str(FIXTURES / "orbax_ocdbt_zarr2")).ocdbt()
    got = fresh.read_many(keys + ["no/such/key"])
    assert fresh.backend._kvstore is None  # nothing opened through tensorstore
    want = {k: bytes(view.backend.kvstore.read(k).result().value) for k in keys}
    assert {k: v for k, v in got.items() if k in want} == want and got["no/such/key"] is None


@pytest.mark.parametrize("damage", ["crc", "magic", "truncated"])
def test_a_damaged_manifest_is_tensorstores_to_refuse(tmp_path, damage):
    db = tmp_path / "db"
    shutil.copytree(FIXTURES / "orbax_ocdbt_zarr2", db)
    path = db / "manifest.ocdbt"
    raw = bytearray(path.read_bytes())
    if damage == "crc":
        raw[-1] ^= 1
    elif damage == "magic":
        raw[0] ^= 0xFF
    else:
        raw = raw[: len(raw) // 2]
    path.write_bytes(bytes(raw))
    assert ocdbt_node.single_leaf_manifest(bytes(raw)) is None
    view = Storage.open(str(db)).ocdbt()
    assert view.backend.local_tree is None  # tensorstore's, as before: its error when read
    with pytest.raises(CkptError):
        view.read_many([f"k{i}" for i in range(300)])


def test_a_root_leaf_cut_short_is_the_walks_own_error(tmp_path):
    db = tmp_path / "db"
    shutil.copytree(FIXTURES / "orbax_ocdbt_zarr2", db)
    root = ocdbt_node.single_leaf_manifest((db / "manifest.ocdbt").read_bytes()).root
    node_file = db / root.path
    os.truncate(node_file, root.offset + root.length // 2)
    view = Storage.open(str(db)).ocdbt()
    with pytest.raises(CkptError) as local:
        view.read_many([f"k{i}" for i in range(3)])
    # the words of tensorstore's read of that node (the walk before, validate's finding)
    assert str(local.value) == (f"{node_file}: OCDBT data file has {root.offset + root.length // 2} bytes but "
                                f"the database needs {root.offset + root.length}")
    os.remove(node_file)
    with pytest.raises(CkptError, match=r"cannot read OCDBT B\+tree: B\+tree node .* holds 0 bytes"):
        Storage.open(str(db)).ocdbt().read_many([f"k{i}" for i in range(3)])
