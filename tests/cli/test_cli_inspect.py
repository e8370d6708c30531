"""`ckpt inspect` as a user runs it: output, --json contract, errors, exit codes."""
from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from ckpt_tool.cli.main import cli

from conftest import SAMPLE_FIXTURES, fixture_path, run_ckpt

LEAF_FIELDS = {"keys", "name", "kind", "shape", "dtype", "nbytes", "chunk_shape", "chunks", "sharding"}


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.mark.parametrize("name", SAMPLE_FIXTURES)
def test_json_contract(name):
    result = invoke("inspect", str(fixture_path(name)), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["format"] in ("orbax", "dcp")
    assert {"path", "format", "layout", "leaves", "summary"} <= set(doc)
    assert doc["leaves"]
    for leaf in doc["leaves"]:
        assert LEAF_FIELDS <= set(leaf), leaf
        assert leaf["kind"] in ("array", "value")
        if leaf["kind"] == "array":
            assert isinstance(leaf["shape"], list) and isinstance(leaf["nbytes"], int)
    s = doc["summary"]
    arrays = [l for l in doc["leaves"] if l["kind"] == "array"]
    assert s["arrays"] == len(arrays)
    assert s["bytes"] == sum(l["nbytes"] for l in arrays)


def test_tree_output_plain_when_piped():
    result = invoke("inspect", str(fixture_path("orbax_ocdbt_zarr2")))
    assert result.exit_code == 0
    out = result.output
    assert "Orbax, OCDBT + zarr2" in out
    assert "committed" in out
    assert "kernel  float32[16, 8]" in out
    assert "P(data, model)" in out
    assert "\x1b[" not in out  # no colour codes in a pipe


def test_flat_and_filter():
    result = invoke("inspect", str(fixture_path("orbax_ocdbt_zarr2")), "--flat", "--filter", "params/**/kernel")
    assert result.exit_code == 0
    body = [l for l in result.output.splitlines() if l.startswith("params/")]
    assert body == [l for l in body if "kernel" in l] and body


def test_filter_star_stays_within_one_key():
    doc = json.loads(invoke("inspect", str(fixture_path("orbax_ocdbt_zarr2")), "--json", "--filter", "params/*").output)
    assert all(len(l["keys"]) == 2 for l in doc["leaves"])


def test_depth_collapses():
    result = invoke("inspect", str(fixture_path("orbax_ocdbt_zarr2")), "--depth", "1")
    assert "... " in result.output and "leaves," in result.output


def test_values_decodes_scalars_and_strings():
    doc = json.loads(invoke("inspect", str(fixture_path("orbax_ocdbt_zarr3")), "--json", "--values").output)
    values = {l["name"]: l.get("value") for l in doc["leaves"] if l["kind"] == "value"}
    assert values and all(v is not None for v in values.values())


def test_manager_steps_listed():
    doc = json.loads(invoke("inspect", str(fixture_path("orbax_manager")), "--json").output)
    assert doc["step"] == 2
    assert [s["committed"] for s in doc["steps"]] == [True, True, False]
    doc1 = json.loads(invoke("inspect", str(fixture_path("orbax_manager")), "--json", "--step", "1").output)
    assert doc1["step"] == 1


@pytest.mark.slow
def test_missing_path_one_line_exit_1(tmp_path):
    r = run_ckpt("inspect", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"ckpt: error: {tmp_path / 'nope'}: no such directory"]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_unknown_layout(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    r = run_ckpt("inspect", str(tmp_path))
    assert r.returncode == 1
    from ckpt_tool import formats

    assert formats.titles_joined().startswith("Orbax, torch.distributed.checkpoint (DCP), safetensors")
    assert f"not an {formats.titles_joined()} checkpoint" in r.stderr  # every format the registry reads
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_debug_shows_traceback(tmp_path):
    r = run_ckpt("inspect", str(tmp_path / "nope"), env={"CKPT_DEBUG": "1"})
    assert r.returncode == 1 and "Traceback" in r.stderr


@pytest.mark.slow
def test_usage_error_exit_2():
    r = run_ckpt("inspect")
    assert r.returncode == 2
    r = run_ckpt("inspect", str(fixture_path("orbax_ocdbt_zarr2")), "--depth", "0")
    assert r.returncode == 2


def test_every_command_has_help_and_a_docs_page():
    from conftest import ROOT

    names = cli.list_commands(None)
    assert {"inspect", "validate", "diff", "convert"} <= set(names)
    for name in names:
        command = cli.get_command(None, name)
        result = invoke(name, "--help")
        assert result.exit_code == 0 and command.help, name
        page = ROOT / "docs" / "commands" / f"{name}.md"
        assert page.read_text().startswith(f"# ckpt {name}\n"), name


@pytest.mark.parametrize("name", SAMPLE_FIXTURES)
def test_inspect_imports_neither_jax_nor_torch(name):
    code = (
        # _run, not main: main ends a read-only command with os._exit before
        # any check after it could run
        "import sys, ckpt_tool.cli.main as m\n"
        f"for argv in (['inspect', {str(fixture_path(name))!r}, '--json', '--values'],\n"
        f"             ['validate', {str(fixture_path(name))!r}, '--deep']):\n"
        "    code = m._run(argv)\n"
        "    assert code == 0, (argv, code)\n"
        "bad = sorted(x for x in sys.modules if x.split('.')[0] in ('jax', 'jaxlib', 'torch', 'orbax'))\n"
        "assert not bad, bad\n"
    )
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_python_module_entry_point():
    r = run_ckpt("inspect", str(fixture_path("orbax_ocdbt_zarr2")), "--flat")
    assert r.returncode == 0 and "params/dense/kernel" in r.stdout


def test_hostile_metadata_refused_by_name_and_nothing_runs(tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(Exploit(), protocol=4))
    (ckpt / "__0_0.distcp").write_bytes(b"")
    r = run_ckpt("inspect", str(ckpt))
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    assert "refused to unpickle global posix.system" in line and ".metadata" in line
    assert not marker.exists()


def test_json_leaves_render_each_sharding_as_its_own_and_keep_the_contract_order():
    """InspectResult.to_json finds a Sharding met again by its object (issue 46: DCP's tens of
    thousands of leaves share one) or by its value; each leaf still gets its own sharding's JSON,
    and an array leaf's fields come in the documented order."""
    from ckpt_tool.ops.inspect import InspectResult
    from ckpt_tool.core.model import ArrayLeaf, Checkpoint, Chunk, ChunkList, RegularGrid, Sharding

    shared = Sharding(kind="chunks", chunks=1)
    named = Sharding(kind="named", mesh_shape=(2,), axis_names=("d",), partition_spec=("d",), device_ids=(0, 1))
    listed = Sharding(kind="named", mesh_shape=(2,), axis_names=("d",), partition_spec=[["d"]], device_ids=(0, 1))
    one = ChunkList((Chunk((0,), (4,)),))
    leaves = [
        ArrayLeaf(("a",), "a", (4,), "float32", one, shared),
        ArrayLeaf(("b",), "b", (4,), "float32", one, shared),  # the same object
        ArrayLeaf(("c",), "c", (4, 2), "bfloat16", RegularGrid((2, 2)), named),
        ArrayLeaf(("d",), "d", (4, 2), "bfloat16", RegularGrid((2, 2)),
                  Sharding(kind="named", mesh_shape=(2,), axis_names=("d",), partition_spec=("d",), device_ids=(0, 1))),
        ArrayLeaf(("e",), "e", (4,), "int8", one, listed),  # unhashable (a list in a field): by object
        ArrayLeaf(("f",), "f", (4,), "int8", one, None),
    ]
    doc = InspectResult(Checkpoint("p", "dcp", {}, leaves), leaves, None, {}).to_json()
    got = doc["leaves"]
    assert [leaf["sharding"] for leaf in got] == [
        (l.sharding.to_json() if l.sharding is not None else None) for l in leaves]
    assert [list(leaf) for leaf in got] == [
        ["keys", "name", "kind", "shape", "dtype", "nbytes", "chunk_shape", "chunks", "sharding"]] * len(leaves)
    assert got[2] == {"keys": ["c"], "name": "c", "kind": "array", "shape": [4, 2], "dtype": "bfloat16",
                      "nbytes": 16, "chunk_shape": [2, 2], "chunks": 2, "sharding": named.to_json()}
