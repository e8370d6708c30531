"""`ckpt diff`: identical copies compare equal; one altered chunk is named exactly; an
`inspect --json` document as one side checks structure (and layout, when asked)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorstore as ts
from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import _run, cli
from ckpt_tool.ops.diff import diff_checkpoints
from ckpt_tool.ops.structure import MAX_DOCUMENT_BYTES, is_inspect_json_file, load_structure

from conftest import ROOT, SAMPLE_FIXTURES, fixture_path, run_ckpt


@pytest.mark.parametrize("name", SAMPLE_FIXTURES)
def test_copy_has_no_difference(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(fixture_path(name), dst)
    result = CliRunner().invoke(cli, ["diff", str(fixture_path(name)), str(dst), "--values", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["same"] and doc["compared"] > 0


def test_one_altered_chunk_is_named(copy_fixture):
    path = copy_fixture("orbax_ocdbt_zarr2")
    arr = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{path}/", "path": "layers.1.w/"}}).result()
    arr[2, 3] = np.float32(arr[2, 3].read().result()) + np.float32(0.5)
    runner = CliRunner()
    result = runner.invoke(cli, ["diff", str(fixture_path("orbax_ocdbt_zarr2")), str(path), "--values", "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert [(d["path"], d["kind"], d["mismatched"]) for d in doc["differences"]] == [("layers/1/w", "values", 1)]
    assert doc["differences"][0]["max_abs"] == pytest.approx(0.5, abs=1e-5)
    # within tolerance: same
    ok = runner.invoke(cli, ["diff", str(fixture_path("orbax_ocdbt_zarr2")), str(path), "--values", "--atol", "0.6"])
    assert ok.exit_code == 0, ok.output
    # structure only: same
    assert runner.invoke(cli, ["diff", str(fixture_path("orbax_ocdbt_zarr2")), str(path)]).exit_code == 0


def test_structure_differences_and_rename():
    a = ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr2")))
    b = ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr3")))
    report = diff_checkpoints(a, b)
    assert [(d.path, d.kind) for d in report.differences] == [("name", "only_b")]
    renamed = diff_checkpoints(a, b, rename=[r"^params/=weights/"])
    kinds = {d.kind for d in renamed.differences}
    assert kinds == {"only_a", "only_b"}
    assert any(d.path.startswith("weights/") for d in renamed.differences)


def test_bad_rename_is_usage_error():
    r = CliRunner().invoke(cli, ["diff", str(fixture_path("orbax_ocdbt_zarr2")), str(fixture_path("orbax_ocdbt_zarr2")), "--rename", "noequals"])
    assert r.exit_code != 0


# --- `ckpt diff CKPT EXPECTED.json`: an inspect --json document as one side ---


def _inspect_json(path, *args) -> dict:
    r = CliRunner().invoke(cli, ["inspect", str(path), "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _write(tmp_path, doc, name="expected.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(p)


def _diff(*args: str):
    """(exit code, stdout, stderr) of `ckpt diff ...` through the CLI's own error handling."""
    return _run_cli("diff", *args)


def _run_cli(*args: str):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _run(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", SAMPLE_FIXTURES)
def test_inspect_json_round_trip_matches(name, tmp_path):
    doc = _inspect_json(fixture_path(name))
    expected = _write(tmp_path, doc)
    ckpt = str(fixture_path(name))
    for args in ([ckpt, expected], [expected, ckpt], [ckpt, expected, "--layout"], [expected, ckpt, "--layout"]):
        code, out, err = _diff(*args, "--json")
        assert code == 0, (args, out, err)
        report = json.loads(out)
        assert report["same"] and report["compared"] == len(doc["leaves"]) > 0
        json_side = "b" if args[1] == expected else "a"
        assert report["sources"][json_side] == "inspect-json"
        assert report["sources"]["ab".replace(json_side, "")] == "checkpoint"
    code, out, _ = _diff(ckpt, expected)
    assert code == 0 and out.strip() == f"same: {len(doc['leaves'])} leaves (structure, shapes, dtypes) match"


def test_inspect_json_of_a_step_applies_to_the_checkpoint_side(tmp_path):
    root = str(fixture_path("orbax_manager"))
    doc = _inspect_json(root, "--step", "1")
    assert doc["step"] == 1
    expected = _write(tmp_path, doc)
    assert _diff(root, expected, "--step", "1")[0] == 0
    assert _diff(expected, root, "--step", "1", "--layout")[0] == 0
    assert _diff(root, expected, "--step-a", "1")[0] == 0
    assert _diff(root, expected)[0] == 0  # the latest step (2) has the same structure
    # the step is the checkpoint's: a step the root does not have fails there
    code, _, err = _diff(root, expected, "--step", "7")
    assert code == 1 and "7" in err and len(err.strip().splitlines()) == 1
    # a step for the JSON side is a usage error
    code, _, err = _diff(root, expected, "--step-b", "1")
    assert code == 2 and "--step-b" in err and "inspect JSON" in err
    code, _, err = _diff(expected, expected, "--step", "1")
    assert code == 2 and "no checkpoint" in err
    code, _, err = _diff(root, expected, "--step", "1", "--step-a", "1")
    assert code == 2


def _edited(doc: dict) -> dict:
    """The inspect document of orbax_ocdbt_zarr2 with one change of each kind."""
    doc = json.loads(json.dumps(doc))
    by_path = {"/".join(str(k) for k in leaf["keys"]): leaf for leaf in doc["leaves"]}
    by_path["params/dense/kernel"]["dtype"] = "bfloat16"
    by_path["params/proj"]["shape"] = [8, 32]
    by_path["step"]["kind"] = "array"
    by_path["step"]["shape"] = [1]
    doc["leaves"].remove(by_path["layers/0/b"])
    doc["leaves"].append({"keys": ["params", "new", "kernel"], "name": "params.new.kernel", "kind": "array",
                          "shape": [4, 4], "dtype": "float32"})
    return doc


def test_modified_expected_json_names_each_difference(tmp_path):
    ckpt = str(fixture_path("orbax_ocdbt_zarr2"))
    expected = _write(tmp_path, _edited(_inspect_json(ckpt)))
    code, out, err = _diff(ckpt, expected)
    assert code == 1, err
    assert out.splitlines() == [
        "only_a   layers/0/b: only in A",
        "dtype    params/dense/kernel: dtype float32 in A, bfloat16 in B",
        "only_b   params/new/kernel: only in B",
        "shape    params/proj: shape [8, 16] in A, [8, 32] in B",
        "kind     step: value in A, array in B",
        "different: 5 differences in 18 common leaves",
    ]
    # the other way round, and as JSON (the diff contract)
    code, out, _ = _diff(expected, ckpt, "--json")
    assert code == 1
    report = json.loads(out)
    assert not report["same"] and report["a"] == expected and report["b"] == ckpt
    assert [(d["path"], d["kind"], d["message"]) for d in report["differences"]] == [
        ("layers/0/b", "only_b", "only in B"),
        ("params/dense/kernel", "dtype", "dtype bfloat16 in A, float32 in B"),
        ("params/new/kernel", "only_a", "only in A"),
        ("params/proj", "shape", "shape [8, 32] in A, [8, 16] in B"),
        ("step", "kind", "array in A, value in B"),
    ]


def test_rename_applies_to_a_whichever_side_is_json(tmp_path):
    ckpt = str(fixture_path("orbax_ocdbt_zarr2"))
    doc = _inspect_json(ckpt)
    for leaf in doc["leaves"]:
        if leaf["keys"][0] == "params":
            leaf["keys"][0] = "model"
    expected = _write(tmp_path, doc)
    assert _diff(ckpt, expected)[0] == 1
    assert _diff(ckpt, expected, "--rename", "^params/=model/")[0] == 0
    assert _diff(expected, ckpt, "--rename", "^model/=params/")[0] == 0


def test_resharded_checkpoint_matches_unless_layout_is_asked(tmp_path):
    src = fixture_path("orbax_ocdbt_zarr2")
    dst = tmp_path / "resharded"
    r = CliRunner().invoke(cli, ["reshard", str(src), str(dst), "--mesh", "data=2", "--devices", "2"])
    assert r.exit_code == 0, r.output
    expected = _write(tmp_path, _inspect_json(src))
    assert _diff(str(dst), expected)[0] == 0
    code, out, _ = _diff(str(dst), expected, "--layout", "--json")
    assert code == 1
    diffs = {(d["path"], d["kind"]): d["message"] for d in json.loads(out)["differences"]}
    assert diffs[("params/dense/kernel", "chunks")] == "chunks [8, 8] x2 in A, [4, 4] x8 in B"
    assert diffs[("params/dense/kernel", "sharding")] == (
        "sharding mesh(data=2) P(data) in A, mesh(data=4,model=2) P(data, model) in B"
    )
    # the resharded checkpoint's own document matches it with --layout
    assert _diff(str(dst), _write(tmp_path, _inspect_json(dst), "resharded.json"), "--layout")[0] == 0


def test_layout_compares_only_what_the_expected_file_records(tmp_path):
    ckpt = str(fixture_path("dcp_multirank"))
    doc = _inspect_json(ckpt)
    # a hand-written expected file: keys, kind, shape and dtype only
    minimal = {"schema": 1, "leaves": [
        {k: leaf[k] for k in ("keys", "kind", "shape", "dtype") if k in leaf} if leaf["kind"] == "array"
        else {"keys": leaf["keys"], "kind": "value"}
        for leaf in doc["leaves"]
    ]}
    assert _diff(ckpt, _write(tmp_path, minimal), "--layout")[0] == 0
    # a recorded device-id change with the same mesh and spec is named in full
    z2 = str(fixture_path("orbax_ocdbt_zarr2"))
    doc = _inspect_json(z2)
    kernel = next(leaf for leaf in doc["leaves"] if leaf["name"] == "params.dense.kernel")
    kernel["sharding"] = dict(kernel["sharding"], device_ids=[7, 6, 5, 4, 3, 2, 1, 0])
    code, out, _ = _diff(z2, _write(tmp_path, doc, "ids.json"), "--layout")
    assert code == 1
    assert out.splitlines()[0] == (
        "sharding params/dense/kernel: sharding mesh(data=4,model=2) P(data, model): "
        "device_ids [0, 1, 2, 3, 4, 5, 6, 7] in A, [7, 6, 5, 4, 3, 2, 1, 0] in B"
    )
    kernel["chunks"] = 4
    code, out, _ = _diff(z2, _write(tmp_path, doc, "ids.json"), "--layout")
    assert out.splitlines()[0] == "chunks   params/dense/kernel: chunks [4, 4] x8 in A, [4, 4] x4 in B"


def test_filtered_inspect_json_and_diff_filter(tmp_path):
    ckpt = str(fixture_path("orbax_ocdbt_zarr2"))
    doc = _inspect_json(ckpt, "--filter", "params/**")
    expected = _write(tmp_path, doc)
    # a filtered document has fewer leaves: the others are only in the checkpoint
    code, out, _ = _diff(ckpt, expected, "--json")
    report = json.loads(out)
    assert code == 1 and {d["kind"] for d in report["differences"]} == {"only_a"}
    assert not any(d["path"].startswith("params/") for d in report["differences"])
    # the same --filter on diff compares just those leaves
    code, out, _ = _diff(ckpt, expected, "--filter", "params/**", "--json")
    assert code == 0 and json.loads(out)["compared"] == len(doc["leaves"]) == 6


def test_values_with_a_json_side_is_a_usage_error(tmp_path):
    ckpt = str(fixture_path("dcp_single"))
    expected = _write(tmp_path, _inspect_json(ckpt, "--values"))
    for args in ([ckpt, expected], [expected, ckpt]):
        code, out, err = _diff(*args, "--values")
        assert code == 2 and out == ""
        assert "--values" in err and "inspect JSON document" in err and "no array data" in err
    # the core refuses too (Python API)
    with pytest.raises(ckpt_tool.CkptError, match="no array data"):
        diff_checkpoints(ckpt_tool.open(ckpt), load_structure(expected), values=True)


def _leaf_doc(**leaf) -> dict:
    base = {"keys": ["a"], "kind": "array", "shape": [2], "dtype": "float32"}
    base.update(leaf)
    return {"schema": 1, "leaves": [{k: v for k, v in base.items() if v is not ...}]}


DAMAGED = [
    ("not-json", "not json at all", "not valid JSON: Expecting value at line 1 column 1"),
    ("truncated", '{"schema": 1, "leaves": [', "not valid JSON: Expecting value at line 1 column 26"),
    ("top-list", [1, 2], "not an inspect JSON document: the top level is a list, not an object"),
    ("no-schema", {"leaves": []}, "not an inspect JSON document (`ckpt inspect --json`): no 'schema' field"),
    ("diff-output", {"a": "x", "b": "y", "same": True, "differences": []},
     "no 'schema' field; this is `ckpt diff --json` output"),
    ("schema-2", {"schema": 2, "leaves": []}, "schema 2 (written by a newer ckpt); this ckpt reads inspect JSON schema 1"),
    ("schema-str", {"schema": "1", "leaves": []}, "schema: expected an integer, got a string"),
    ("no-leaves", {"schema": 1}, "no 'leaves' field"),
    ("leaves-dict", {"schema": 1, "leaves": {}}, "leaves: expected a list, got an object"),
    ("leaf-str", {"schema": 1, "leaves": ["a"]}, "leaves[0]: expected an object, got a string"),
    ("no-keys", {"schema": 1, "leaves": [{"kind": "array"}]}, "leaves[0]: no 'keys' field"),
    ("keys-bad", _leaf_doc(keys=[["a"]]), "leaves[0].keys: expected a list of strings and integers"),
    ("keys-bool", _leaf_doc(keys=[True]), "leaves[0].keys: expected a list of strings and integers"),
    ("no-kind", _leaf_doc(kind=...), "leaves[0] (a): no 'kind' field"),
    ("kind-bad", _leaf_doc(kind="tensor"), "leaves[0] (a).kind: expected 'array' or 'value', got 'tensor'"),
    ("no-shape", _leaf_doc(shape=...), "leaves[0] (a): an array leaf without 'shape'"),
    ("shape-str", _leaf_doc(shape="2"), "leaves[0] (a).shape: expected a list of non-negative integers, got '2'"),
    ("shape-neg", _leaf_doc(shape=[-1]), "leaves[0] (a).shape: expected a list of non-negative integers, got [-1]"),
    ("shape-float", _leaf_doc(shape=[2.0]), "leaves[0] (a).shape: expected a list of non-negative integers, got [2.0]"),
    ("shape-huge", _leaf_doc(shape=[2**40, 2**40]), "has more elements than any storage holds"),
    ("dtype-int", _leaf_doc(dtype=4), "leaves[0] (a).dtype: expected a string, got an integer"),
    ("dtype-unknown", _leaf_doc(dtype="float23"), "leaves[0] (a).dtype: unknown dtype 'float23'"),
    ("chunk-rank", _leaf_doc(chunk_shape=[1, 1]), "leaves[0] (a).chunk_shape: rank 2, the shape has rank 1"),
    ("chunks-neg", _leaf_doc(chunks=-3), "leaves[0] (a).chunks: expected a non-negative integer, got -3"),
    ("sharding-list", _leaf_doc(sharding=[]), "leaves[0] (a).sharding: expected an object or null, got a list"),
    ("sharding-spec", _leaf_doc(sharding={"kind": "named", "partition_spec": [1]}),
     "leaves[0] (a).sharding.partition_spec[0]: expected null, an axis name or a list of them, got 1"),
    ("duplicate", {"schema": 1, "leaves": [_leaf_doc()["leaves"][0], {"keys": ["a"], "kind": "value"}]},
     "leaves[1]: leaf 'a' is listed twice (also leaves[0])"),
    ("nested", '{"schema": 1, "leaves": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "not an inspect JSON document: nested too deeply"),
    ("utf16", "\ufeff{}".encode("utf-16-le"), "not an inspect JSON document: not UTF-8 text (byte 0xff at offset 0)"),
    ("bigint", '{"schema": 1' + "0" * 5000 + "}", "not valid JSON: an integer with thousands of digits"),
]


@pytest.mark.parametrize("label,content,message", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_damaged_expected_json_is_one_line(label, content, message, tmp_path):
    path = tmp_path / "expected.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    ckpt = str(fixture_path("dcp_single"))
    for args in ([ckpt, str(path)], [str(path), ckpt]):
        code, out, err = _diff(*args)
        assert code == 1 and out == ""
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"ckpt: error: {path}: ") and message in err, err
        assert "Traceback" not in err and "internal error" not in err


def test_damaged_json_as_a_whole_process(tmp_path):
    path = _write(tmp_path, {"schema": 1, "leaves": [{"keys": ["a"], "kind": "array", "shape": [2]}]})
    r = run_ckpt("diff", str(fixture_path("dcp_single")), path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f"ckpt: error: {path}: leaves[0] (a): an array leaf without 'dtype'"]


def test_oversized_and_missing_expected_json(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:  # sparse: refused by its size before a byte is read
        f.truncate(MAX_DOCUMENT_BYTES + 1)
    code, _, err = _diff(str(fixture_path("dcp_single")), str(path))
    assert code == 1 and err.splitlines() == [
        f"ckpt: error: {path}: {MAX_DOCUMENT_BYTES + 1:,} bytes, over the 256 MiB an inspect JSON document "
        "may have (it holds metadata only)"
    ]
    missing = str(tmp_path / "nothing.json")
    code, _, err = _diff(str(fixture_path("dcp_single")), missing)
    assert code == 1 and err.strip() == f"ckpt: error: {missing}: no such file"


def test_what_counts_as_an_inspect_json_side(tmp_path):
    doc = json.dumps({"schema": 1, "leaves": []})
    (tmp_path / "expected").write_text("\n  " + doc)  # no .json suffix: recognised by its content
    assert is_inspect_json_file(str(tmp_path / "expected"))
    assert is_inspect_json_file(str(tmp_path / "missing.json"))  # then "no such file"
    assert not is_inspect_json_file(str(tmp_path / "missing"))
    assert not is_inspect_json_file(str(fixture_path("dcp_single")))  # a directory
    assert not is_inspect_json_file("file://" + str(tmp_path / "expected"))  # a URL is a checkpoint
    assert not is_inspect_json_file(str(fixture_path("dcp_single") / ".metadata"))  # a pickle
    # a safetensors file whose header length starts with '{' (123 bytes) is binary, not JSON
    header = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'.ljust(123)
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    assert not is_inspect_json_file(str(tmp_path / "model.safetensors"))
    # an empty expected document: every leaf of the checkpoint is only in A
    code, out, _ = _diff(str(fixture_path("dcp_single")), str(tmp_path / "expected"), "--json")
    report = json.loads(out)
    assert code == 1 and report["compared"] == 0 and {d["kind"] for d in report["differences"]} == {"only_a"}


def test_diff_against_json_imports_neither_jax_nor_torch(tmp_path):
    # one process for every fixture, both ways round; _run (not main) returns
    # instead of ending the process, so the module check below does run
    cases = []
    for name in SAMPLE_FIXTURES:
        expected = _write(tmp_path, _inspect_json(fixture_path(name)), f"{name}.json")
        cases += [[str(fixture_path(name)), expected], [expected, str(fixture_path(name)), "--layout"]]
    code = (
        "import sys, ckpt_tool.cli.main as m\n"
        f"for args in {cases!r}:\n"
        "    assert m._run(['diff', *args]) == 0, args\n"
        "bad = sorted(x for x in sys.modules if x.split('.')[0] in ('jax', 'jaxlib', 'torch', 'orbax'))\n"
        "assert not bad, bad\n"
        "print('checked', len(" f"{cases!r}" "))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(f"checked {len(cases)}")
