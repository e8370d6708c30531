"""Every entry of an OCDBT database read by ckpt (storage/ocdbt_entries.py), and a database written
over entries that lie in other databases (ocdbt_writer.write_database): the two halves of the
Orbax writer's multi-process merge. Checked against tensorstore's own
reading of the same databases, including trees above the leaves and tensorstore's subtree
common prefixes, which an Orbax output's per-process databases have only past 100 MB of node."""
from __future__ import annotations

import os

import pytest
import tensorstore as ts

from ckpt_tool.base.errors import CkptError
from ckpt_tool.storage import Storage
from ckpt_tool.storage.ocdbt_encode import Config, ValueRef
from ckpt_tool.storage.ocdbt_entries import database_entries
from ckpt_tool.storage.ocdbt_writer import OcdbtDatabaseWriter, write_database


def _values(directory: str, path: str = "") -> dict[bytes, bytes]:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": directory + "/" + path}}).result()
    return {k: kv.read(k).result().value for k in kv.list().result()}


def _tensorstore_database(directory: str, keys: list[str], *, node_bytes: int = 600) -> None:
    """A database tensorstore writes, its nodes small: interior levels, common prefixes, values in
    line and out of line (over 24 bytes)."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": directory + "/"},
                          "config": {"max_decoded_node_bytes": node_bytes, "max_inline_value_bytes": 24}}).result()
    txn = ts.Transaction()
    for i, key in enumerate(keys):
        kv.with_transaction(txn)[key] = (f"{key}=" * (1 + i % 9)).encode()
    txn.commit_async().result()


def _ckpt_database(directory: str, keys: list[str], *, node_bytes: int = 600) -> None:
    writer = OcdbtDatabaseWriter(Storage.create(directory),
                                 Config.new(max_inline_value_bytes=24, max_decoded_node_bytes=node_bytes))
    for i, key in enumerate(keys):
        writer.put(key.encode(), (f"{key}=" * (1 + i % 9)).encode())
    writer.finish()


def _keys(tag: str, n: int) -> list[str]:
    return [f"params.layer_{i % 7}.{tag}/{i}.0" for i in range(n)]


@pytest.mark.parametrize("make", [_tensorstore_database, _ckpt_database], ids=["tensorstore", "ckpt"])
def test_every_entry_reads_as_tensorstore_reads_it(tmp_path, make):
    make(str(tmp_path / "db"), _keys("w", 300))
    dumped = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/db/").result()).result()
    assert dumped["versions"][-1]["root_height"] >= 2  # interior levels over the leaves
    storage = Storage.open(str(tmp_path))
    entries = database_entries(storage, "db/")
    assert [k for k, _ in entries] == sorted(k for k, _ in entries)
    want = _values(str(tmp_path / "db"))
    assert len(entries) == len(want) == 300
    out_of_line = 0
    for key, value in entries:
        if isinstance(value, ValueRef):
            out_of_line += 1
            assert value.file.base_path.startswith("db/") and value.file.relative_path.startswith("d/")
            value = storage.read_range(value.file.path, value.offset, value.offset + value.length)
        assert value == want[key], key
    assert 0 < out_of_line < 300


def test_a_database_over_others_entries_reads_as_their_union(tmp_path):
    """Three databases, one of tensorstore's and two of ckpt's, merged into the root one: its node
    file and manifest alone are new, its values where they lie in the three."""
    root = str(tmp_path)
    _tensorstore_database(f"{root}/ocdbt.process_0", _keys("a", 200))
    _ckpt_database(f"{root}/ocdbt.process_1", _keys("b", 150))
    _ckpt_database(f"{root}/ocdbt.process_2", _keys("c", 1))
    storage = Storage.create(root)
    entries = [e for i in range(3) for e in database_entries(storage, f"ocdbt.process_{i}/")]
    before = {p for p in os.listdir(root)}
    write_database(storage, Config.new(max_decoded_node_bytes=900), entries)
    assert {p for p in os.listdir(root)} - before == {"manifest.ocdbt", "d"}
    assert len(os.listdir(f"{root}/d")) == 1  # the B+tree's one node file
    want = {}
    for i in range(3):
        want.update(_values(root, f"ocdbt.process_{i}/"))
    assert _values(root) == want and len(want) == 351
    dumped = ts.ocdbt.dump(ts.KvStore.open(f"file://{root}/").result()).result()
    assert [v["generation_number"] for v in dumped["versions"]] == [1]


def test_a_key_in_two_databases_is_one_line(tmp_path):
    _ckpt_database(str(tmp_path / "p0"), ["x/0.0", "x/1.0"])
    _ckpt_database(str(tmp_path / "p1"), ["x/1.0"])
    storage = Storage.create(str(tmp_path))
    entries = database_entries(storage, "p0/") + database_entries(storage, "p1/")
    with pytest.raises(CkptError, match=r"key 'x/1.0' is in two of the databases merged"):
        write_database(storage, Config.new(), entries)
    assert not (tmp_path / "manifest.ocdbt").exists()


def test_a_damaged_node_is_one_line(tmp_path):
    _ckpt_database(str(tmp_path / "db"), _keys("w", 40), node_bytes=100_000)
    dumped = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/db/").result()).result()
    node = dumped["versions"][-1]["root"]["location"].split(":")[2].removeprefix("d/")  # (btreenode::d/<name>:...)
    raw = bytearray((tmp_path / "db" / "d" / node).read_bytes())
    raw[-5] ^= 1
    (tmp_path / "db" / "d" / node).write_bytes(bytes(raw))
    with pytest.raises(CkptError, match=r"cannot read OCDBT B\+tree: B\+tree node fails its crc32c check") as exc:
        database_entries(Storage.open(str(tmp_path)), "db/")
    assert str(exc.value).count("\n") == 0 and f"db/d/{node}" in str(exc.value)
