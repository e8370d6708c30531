"""check_ocdbt walks an OCDBT database with ckpt's own decoder (storage/ocdbt_node.py), reading the
manifest and nodes through Storage (issue 46: a local convert's preflight imported tensorstore for
this walk alone): the keys it lists are tensorstore's, on every database orbax and tensorstore wrote
(a merged root, a process's, orbax <= 0.4's, a many-level tree with version tree nodes, a numbered
manifest, which alone is read through tensorstore), locally and on an object store; a damaged node
is one finding."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import tensorstore as ts

from conftest import FIXTURES

from ckpt_tool.base.findings import Findings
from ckpt_tool.machinery.arrays.checks import check_ocdbt
from ckpt_tool.storage import Storage


def _tensorstore_keys(path) -> set[str]:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    return {k.decode() for k in kv.list().result()}


@pytest.mark.parametrize("fixture, db", [
    ("orbax_ocdbt_zarr2", ""), ("orbax_ocdbt_zarr3", ""), ("orbax_two_process", ""),
    ("orbax_two_process", "ocdbt.process_1"), ("flax_orbax", "checkpoint_2"), ("orbax_v0_4_ocdbt", ""),
])
def test_keys_are_tensorstores(fixture, db):
    findings = Findings()
    keys = check_ocdbt(Storage.open(str(FIXTURES / fixture)), db, findings, where="")
    assert not findings.errors, [f.message for f in findings.errors]
    assert keys == _tensorstore_keys(FIXTURES / fixture / db) and keys


def _write_database(path, **config) -> set[str]:
    base = {"driver": "ocdbt", "base": f"file://{path}/", "config": {"max_decoded_node_bytes": 300, **config}}
    for i in range(12):
        kv = ts.KvStore.open(base).result()
        kv.write(f"arr{i:02d}/.zarray", b"{}" * 40).result()
        kv.write(f"arr{i:02d}/0", bytes(range(256)) * (i + 1)).result()
    return _tensorstore_keys(path)


@pytest.mark.parametrize("manifest_kind", ["single", "numbered"])
def test_a_many_level_tree_and_a_numbered_manifest(tmp_path, manifest_kind):
    """Many generations (version tree nodes), a root three levels up; a numbered manifest's versions
    (in manifest.<generation>) through tensorstore's reader, its nodes through ckpt's."""
    src = tmp_path / "db"
    expected = _write_database(src, manifest_kind=manifest_kind, version_tree_arity_log2=1)
    dump = ts.ocdbt.dump(ts.KvStore.open(f"file://{src}/").result()).result()
    assert dump["versions"][-1]["root_height"] >= 2 and dump["version_tree_nodes"]
    assert (manifest_kind == "numbered") == any(p.name.startswith("manifest.0") for p in src.iterdir())
    findings, stored = Findings(), [0]
    assert check_ocdbt(Storage.open(str(src)), "", findings, where="", stored=stored) == expected
    assert not findings.errors and stored[0] > 0


def test_on_an_object_store_the_walk_reads_through_storage(tmp_path):
    """The same keys from a memory:// copy (byte ranges through the store, no local file)."""
    src = FIXTURES / "orbax_ocdbt_zarr2"
    store = Storage.create("memory://check-ocdbt/")
    for p in sorted(src.rglob("*")):
        if p.is_file():
            store.write(str(p.relative_to(src)), p.read_bytes())
    findings = Findings()
    assert check_ocdbt(Storage.open("memory://check-ocdbt/"), "", findings, where="") == _tensorstore_keys(src)
    assert not findings.errors


def test_a_damaged_node_is_one_finding(tmp_path):
    """A byte of the root leaf node changed (the file keeps its length): its CRC-32C fails, and that
    is one finding naming the data file, as tensorstore refuses the node too."""
    root = tmp_path / "orbax"
    shutil.copytree(FIXTURES / "orbax_ocdbt_zarr2", root)
    (index,) = (root / "d").iterdir()
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0xFF
    index.write_bytes(bytes(data))
    with pytest.raises(ValueError):  # (the damage is real)
        _tensorstore_keys(root)
    findings = Findings()
    keys = check_ocdbt(Storage.open(str(root)), "", findings, where="")
    (finding,) = findings.errors
    assert (finding.code, finding.file) == ("lost-process-data", f"d/{index.name}")
    assert "unreadable B-tree node" in finding.message and keys == set()


def test_a_manifest_cut_short_says_so_in_its_own_words(tmp_path):
    root = tmp_path / "orbax"
    shutil.copytree(FIXTURES / "orbax_ocdbt_zarr2", root)
    size = (root / "manifest.ocdbt").stat().st_size
    os.truncate(root / "manifest.ocdbt", 30)
    findings = Findings()
    assert check_ocdbt(Storage.open(str(root)), "", findings, where="") == set()
    (finding,) = findings.errors
    assert finding.message == f"manifest.ocdbt is cut short: it has 30 of the {size} bytes its header gives"


def test_a_data_file_linked_out_of_the_checkpoint_is_its_path_escape_alone(tmp_path):
    """The database's directory is guarded as when tensorstore opened it: a data file that is a
    symlink out of the checkpoint is validate's one path-escape finding, not also a lost file."""
    from click.testing import CliRunner

    from ckpt_tool.cli.main import cli

    root = tmp_path / "orbax"
    shutil.copytree(FIXTURES / "orbax_ocdbt_zarr2", root)
    (index,) = (root / "d").iterdir()
    outside = tmp_path / "outside"
    shutil.move(index, outside)
    index.symlink_to(outside)
    r = CliRunner().invoke(cli, ["validate", "--json", str(root)], catch_exceptions=False)
    assert r.exit_code == 1
    errors = [(f["code"], f["file"]) for f in json.loads(r.output)["findings"] if f["severity"] == "error"]
    assert errors == [("path-escape", f"d/{index.name}")]
