"""Orbax items and rules read as orbax itself reads them (issue 18, items 7 and 8).

Every checkpoint here is written at test time by the installed orbax-checkpoint
(0.12: its v1 API is `orbax.checkpoint.experimental.v1`), then read back by
orbax and compared with what ckpt shows, converts and validates:

- items of orbax's JSON handlers (v1 `save_checkpointables` with JsonHandler:
  `<item>/data.json`) appear in inspect, `--values`, diff and convert, as the
  leaves orbax's load gives (a dict flattened the way every nested value is);
  a step holding only such an item opens; an item of a handler ckpt does not
  read is named in a note, never dropped without a word;
- a step whose `_CHECKPOINT_METADATA` lacks `commit_timestamp_nsecs` is
  committed when its directory has its final name (orbax lists and restores
  it: step.py decides by the name);
- a `_METADATA` mixing sequence and dict keys at one level of the tree is an
  error finding (orbax's restore fails sorting the key paths).
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import cli
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import run_ckpt
from library_reference import _flatten, dcp_values

ocp = pytest.importorskip("orbax.checkpoint")
v1 = pytest.importorskip("orbax.checkpoint.experimental.v1")

runner = CliRunner()

METADATA = {"a": 1, "b": {"c": "x"}}
CONFIG = {"lr": 0.25, "layers": [64, 10], "name": "run", "opt": {"nesterov": False, "eps": None}, "empty": {}}
STATE = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}


def cli_run(*args: str):
    return runner.invoke(cli, list(args), catch_exceptions=False)


def cli_ok(*args: str) -> str:
    result = cli_run(*args)
    assert result.exit_code == 0, result.output
    return result.output


def _json_context(*names: str):
    """A v1 Context whose registry saves the named checkpointables with orbax's JsonHandler."""
    registry = v1.handlers.local_registry()
    for name in names:
        registry.add(v1.handlers.JsonHandler, checkpointable_name=name)
    ctx = v1.Context()
    ctx.checkpointables.registry = registry
    return ctx


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints written once per module by the real orbax."""
    from google.protobuf import timestamp_pb2

    base = tmp_path_factory.mktemp("orbax_items")
    out = {}
    with _json_context("metadata", "config"):
        out["v1"] = base / "v1"
        v1.save_checkpointables(out["v1"], {"state": STATE, "metadata": METADATA, "config": CONFIG})
        out["json_only"] = base / "json_only"
        v1.save_checkpointables(out["json_only"], {"metadata": METADATA})
        out["proto"] = base / "proto"
        v1.save_checkpointables(out["proto"], {"metadata": METADATA, "stamp": timestamp_pb2.Timestamp(seconds=5)})
    # a CheckpointManager root of two steps (orbax's v0 API)
    out["manager"] = base / "manager"
    with ocp.CheckpointManager(out["manager"]) as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.StandardSave({**STATE, "step": step}))
        mgr.wait_until_finished()
    # a single save whose tree holds a list (for the key-type cases)
    out["listed"] = base / "listed"
    with ocp.StandardCheckpointer() as ck:
        ck.save(out["listed"], {"a": [np.arange(3.0), np.ones(2)], "b": np.zeros(1)})
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _orbax_load(path: Path) -> dict:
    """orbax's own v1 load of every checkpointable (the handlers come from _CHECKPOINT_METADATA)."""
    return v1.load_checkpointables(path)


def _ours(path: Path, **kw) -> dict:
    ck = ckpt_tool.open(str(path), **kw)
    return {tuple(leaf.keys): (leaf.read() if leaf.kind == "array" else leaf.load()) for leaf in ck.leaves}


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b


def _assert_values(ours: dict, want: dict) -> None:
    assert set(ours) == set(want)
    for k in want:
        assert _same(ours[k], want[k]), (k, ours[k], want[k])


def _plain_leaves(value, prefix: tuple = ()) -> dict:
    """A loaded JSON value as {key path: leaf}: dict keys, list indices; an empty container is a leaf."""
    if isinstance(value, dict) and value:
        return {k: v for key, sub in value.items() for k, v in _plain_leaves(sub, prefix + (key,)).items()}
    if isinstance(value, list) and value:
        return {k: v for i, sub in enumerate(value) for k, v in _plain_leaves(sub, prefix + (i,)).items()}
    return {prefix: value}


def _library_flat(path: Path) -> dict:
    """orbax's load, flattened to {key path: value} (arrays to numpy)."""
    out = {}
    for name, value in _orbax_load(path).items():
        if name == "state":  # the pytree item
            out.update({(name, *k): np.asarray(v) for k, v in _flatten(value).items()})
        else:
            out.update(_plain_leaves(value, (name,)))
    return out


# -- JSON items ----------------------------------------------------------------------


def test_v1_json_item_is_what_orbax_writes_and_loads(saves):
    path = saves["v1"]
    # what orbax 0.12's v1 API puts on disk for a JSON checkpointable
    assert json.loads((path / "metadata" / "data.json").read_text()) == METADATA
    handlers = json.loads((path / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert handlers["metadata"].endswith("json_handler.JsonHandler")
    loaded = _orbax_load(path)
    assert loaded["metadata"] == METADATA and loaded["config"] == CONFIG


def test_v1_json_items_appear_in_inspect_with_orbax_values(saves):
    path = saves["v1"]
    ours = _ours(path)
    _assert_values(ours, _library_flat(path))
    assert ours[("metadata", "a")] == 1 and ours[("metadata", "b", "c")] == "x"
    assert ours[("config", "layers", 1)] == 10 and ours[("config", "empty")] == {}
    doc = json.loads(cli_ok("inspect", str(path), "--json", "--values"))
    assert doc["layout"]["items"] == ["config", "metadata", "state"]
    values = {"/".join(map(str, leaf["keys"])): leaf.get("value") for leaf in doc["leaves"] if leaf["kind"] == "value"}
    assert values["metadata/a"] == 1 and values["metadata/b/c"] == "x" and values["config/opt/eps"] is None
    text = cli_ok("inspect", str(path), "--values")
    assert "items: config, metadata, state" in text and "c  json = 'x'" in text


def test_v1_json_item_in_diff(saves, tmp_path):
    path = saves["v1"]
    same = _copy(path, tmp_path / "same")
    assert cli_run("diff", str(path), str(same), "--values").exit_code == 0
    changed = _copy(path, tmp_path / "changed")
    (changed / "metadata" / "data.json").write_text(json.dumps({"a": 1, "b": {"c": "y"}}))
    assert _orbax_load(changed)["metadata"]["b"]["c"] == "y"
    result = cli_run("diff", str(path), str(changed), "--values", "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output)
    assert [d["path"] for d in doc["differences"]] == ["metadata/b/c"]


def test_v1_json_item_converts_to_dcp_as_orbax_loads_it(saves, tmp_path):
    path = saves["v1"]
    dst = tmp_path / "dcp"
    cli_ok("convert", str(path), str(dst), "--to", "dcp")
    # torch's own load: every JSON value a Python value, as orbax's load gave it
    loaded = {k: v for key, value in dcp_values(dst).items()
              for k, v in (_plain_leaves(value, key).items() if not isinstance(value, np.ndarray) else [(key, value)])}
    _assert_values(loaded, _library_flat(path))
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dst), str(tmp_path / "full.pt"))
    sd = torch.load(tmp_path / "full.pt", weights_only=False)
    assert sd["metadata"] == METADATA and sd["config"] == CONFIG


def test_v1_json_item_converts_to_orbax_and_orbax_restores_it(saves, tmp_path):
    path = saves["v1"]
    dst = tmp_path / "orbax"
    cli_ok("convert", str(path), str(dst), "--to", "orbax")
    with ocp.PyTreeCheckpointer() as ck:
        tree = ck.restore(dst)
    assert tree["metadata"] == {"a": 1, "b": {"c": "x"}}
    assert tree["config"]["layers"] == [64, 10] and tree["config"]["opt"] == {"nesterov": False, "eps": None}
    assert cli_run("diff", str(path), str(dst), "--values").exit_code == 0


def test_v1_json_item_to_safetensors_is_refused_with_the_hint(saves, tmp_path):
    path = saves["v1"]
    result = run_ckpt("convert", str(path), str(tmp_path / "st"), "--to", "safetensors")
    assert result.returncode != 0 and "--skip-unsupported" in result.stderr
    assert not (tmp_path / "st").exists()
    cli_ok("convert", str(path), str(tmp_path / "st2"), "--to", "safetensors", "--skip-unsupported")


def test_step_holding_only_a_json_item_opens(saves):
    path = saves["json_only"]
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == ["metadata"]
    assert _orbax_load(path) == {"metadata": METADATA}
    _assert_values(_ours(path), {("metadata", "a"): 1, ("metadata", "b", "c"): "x"})
    report = validate_checkpoint(str(path))
    assert report.findings == [] and report.checked["json_items"] == 1
    assert cli_run("validate", str(path), "--strict").exit_code == 0


def test_item_of_an_unknown_handler_is_named_not_dropped(saves, tmp_path):
    path = saves["proto"]
    handlers = json.loads((path / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert handlers["stamp"].endswith("ProtoHandler")
    ck = ckpt_tool.open(str(path))
    assert [leaf.path for leaf in ck.leaves] == ["metadata/a", "metadata/b/c"]
    [note] = [n for n in ck.notes if "'stamp'" in n]
    assert "ProtoHandler" in note and "not read" in note
    assert "ProtoHandler" in cli_ok("inspect", str(path))
    report = validate_checkpoint(str(path))
    assert report.findings == [] and report.checked["unchecked_items"] == 1
    # convert: a copy without it would be partial, so it is refused like any unsupported leaf
    result = run_ckpt("convert", str(path), str(tmp_path / "out"), "--to", "dcp")
    assert result.returncode == 1 and "stamp" in result.stderr and "--skip-unsupported" in result.stderr
    assert not (tmp_path / "out").exists()
    out = cli_ok("convert", str(path), str(tmp_path / "out2"), "--to", "dcp", "--skip-unsupported")
    assert "skipped stamp" in out and "ProtoHandler" in out
    cli_ok("convert", str(path), str(tmp_path / "out3"), "--to", "dcp", "--exclude", "stamp")
    assert dcp_values(tmp_path / "out3") == {("metadata", "a"): 1, ("metadata", "b", "c"): "x"}


def test_damaged_json_item_is_an_error_as_orbax_fails_on_it(saves, tmp_path):
    path = _copy(saves["v1"], tmp_path / "bad")
    (path / "metadata" / "data.json").write_text('{"a": 1, "b": ')
    with pytest.raises(Exception):
        _orbax_load(path)
    report = validate_checkpoint(str(path))
    assert [(f.severity, f.code, f.file) for f in report.findings] == [("error", "bad-metadata", "metadata/data.json")]
    result = run_ckpt("inspect", str(path))
    assert result.returncode == 1 and "data.json" in result.stderr
    # a JSON handler recorded, its file renamed: orbax's load finds none of its names
    (path / "metadata" / "data.json").rename(path / "metadata" / "data.txt")
    with pytest.raises(Exception):  # noqa: B017 - orbax: "Unable to parse JSON file ... Recognized filenames"
        _orbax_load(path)
    report = validate_checkpoint(str(path))
    assert [(f.code, f.file) for f in report.findings] == [("missing-metadata", "metadata/")]


# -- commit_timestamp_nsecs ------------------------------------------------------------


def _drop_timestamp(step_dir: Path) -> None:
    meta_file = step_dir / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    del meta["commit_timestamp_nsecs"]
    meta_file.write_text(json.dumps(meta))


def test_step_without_commit_timestamp_is_committed_as_orbax_lists_it(saves, tmp_path):
    root = _copy(saves["manager"], tmp_path / "root")
    _drop_timestamp(root / "2")
    # orbax: listed, the latest, restored
    with ocp.CheckpointManager(root) as mgr:
        assert list(mgr.all_steps()) == [1, 2] and mgr.latest_step() == 2
        restored = mgr.restore(2, args=ocp.args.StandardRestore())
    assert int(restored["step"]) == 2
    doc = json.loads(cli_ok("inspect", str(root), "--json"))
    assert doc["step"] == 2 and doc["committed"] is True
    assert [(s["step"], s["committed"]) for s in doc["steps"]] == [(1, True), (2, True)]
    assert "status      committed" in cli_ok("inspect", str(root))
    assert validate_checkpoint(str(root)).findings == []
    dst = tmp_path / "dcp"
    cli_ok("convert", str(root), str(dst), "--to", "dcp")
    got = dcp_values(dst)
    assert got[("step",)] == 2 or int(got[("step",)]) == 2
    assert np.array_equal(got[("w",)], STATE["w"])
    # the step on its own, too
    assert ckpt_tool.open(str(root / "2")).committed is True


def test_tmp_named_step_without_timestamp_stays_uncommitted(saves, tmp_path):
    root = _copy(saves["manager"], tmp_path / "root")
    _drop_timestamp(root / "2")
    (root / "2").rename(root / "2.orbax-checkpoint-tmp")
    with ocp.CheckpointManager(root) as mgr:
        assert list(mgr.all_steps()) == [1]
    doc = json.loads(cli_ok("inspect", str(root), "--json"))
    assert doc["step"] == 1 and [s["committed"] for s in doc["steps"]] == [True, False]
    result = run_ckpt("convert", str(root / "2.orbax-checkpoint-tmp"), str(tmp_path / "out"), "--to", "dcp")
    assert result.returncode == 1 and "uncommitted" in result.stderr


# -- key types within one level ------------------------------------------------------------


def _set_key_types(path: Path, types: dict[str, int]) -> None:
    """Set the key_type of the second key of the named `_METADATA` entries."""
    meta = json.loads((path / "_METADATA").read_text())
    for flat, kt in types.items():
        meta["tree_metadata"][flat]["key_metadata"][1]["key_type"] = kt
    (path / "_METADATA").write_text(json.dumps(meta))


def test_mixed_key_types_are_an_error_as_orbax_restore_fails(saves, tmp_path):
    path = _copy(saves["listed"], tmp_path / "mixed")
    # list element 0 recorded as a dict key '0', element 1 as a sequence index
    _set_key_types(path, {"('a', '0')": 2})
    with pytest.raises(TypeError, match="not supported between instances"):
        with ocp.StandardCheckpointer() as ck:
            ck.restore(path)
    result = run_ckpt("validate", str(path))
    assert result.returncode == 1 and "bad-metadata" in result.stdout, result.stdout
    report = validate_checkpoint(str(path))
    [finding] = report.findings
    assert (finding.severity, finding.code, finding.file) == ("error", "bad-metadata", "_METADATA")
    assert "sequence index" in finding.message and "dict key" in finding.message
    result = run_ckpt("inspect", str(path))
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1


def test_consistent_key_types_stay_ok_as_orbax_restores_them(saves, tmp_path):
    path = _copy(saves["listed"], tmp_path / "dict")
    # both elements recorded as dict keys: orbax restores a dict {'0': ..., '1': ...}
    _set_key_types(path, {"('a', '0')": 2, "('a', '1')": 2})
    with ocp.StandardCheckpointer() as ck:
        tree = ck.restore(path)
    assert sorted(tree["a"]) == ["0", "1"]
    assert validate_checkpoint(str(path)).findings == []
    ours = _ours(path)
    assert set(ours) == {("a", "0"), ("a", "1"), ("b",)}
    assert np.array_equal(ours[("a", "1")], tree["a"]["1"])


def test_fuzz_key_type_mutator_finds_what_orbax_refuses(saves, tmp_path):
    import fuzz_lib as F

    src = saves["listed"]
    kinds = set()
    for seed in range(12):
        path = _copy(src, tmp_path / f"m{seed}")
        data, desc = F.mutate_key_types(random.Random(seed), (path / "_METADATA").read_bytes())
        (path / "_METADATA").write_bytes(data)
        kinds.add(desc.split(":")[0])
        ok = validate_checkpoint(str(path)).ok()
        try:
            with ocp.StandardCheckpointer() as ck:
                ck.restore(path)
            restored = True
        except Exception:  # noqa: BLE001 - orbax's refusal is the answer
            restored = False
        # the contract: validate passes only what orbax restores
        assert not ok or restored, desc
    assert len(kinds) >= 2, kinds
