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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
        r = view._kv.read(key).result()
        out[key] = bytes(r.value) if r.state == "value" else None
    return out


def test_walk_equals_point_reads_on_a_deep_tree(tmp_path):
    values = _write_db(str(tmp_path / "db"), 1500, node_bytes=600)
    base = ts.KvStore.open({"driver": "file", "path": str(tmp_path / "db") + "/"}).result()
    height = ts.ocdbt.dump(base).result()["versions"][-1]["root_height"]
    assert height >= 2  # the walk crosses interior nodes and their key prefixes
    wanted = sorted(values)[::7] + ["layer3/p99999/.zarray", "aaa", "zzz"]  # some absent, before and after all
    inline, indirect = ocdbt_bulk.read_keys(base, wanted, lambda f: f.result())
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
    assert isinstance(pending, __import__("ckpt_tool.storage.core", fromlist=["x"]).OcdbtBulkReads)
    assert pending.result() == _point_reads(view, keys)
    # a view one directory down the database: keys relative to it
    sub = view.child("layer1")
    sub_keys = [k[len("layer1/"):] for k in keys if k.startswith("layer1/")]
    assert sub.start_reads(sub_keys).result() == {k: values["layer1/" + k] for k in sub_keys}


def _ckpt_json(args: list[str], env: dict[str, str]) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "ckpt_tool", *args, "--json"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    return proc.returncode, json.loads(proc.stdout)


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
