"""A source with data missing is never copied in part, inspected as whole or validated in part (issue 18).

Real checkpoints (the committed fixtures written by transformers, torch and
orbax; CheckpointManager roots written here by real orbax), damaged the way
they are in practice: a shard file missing from a partial download, a rank's
`.distcp` not copied, an OCDBT data file lost, a NaN in an older step.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import fixture_path, run_ckpt

SHARDED = "safetensors_llama_sharded"  # transformers save_pretrained(max_shard_size=...): 4 shards + index
MISSING_SHARD = "model-00003-of-00004.safetensors"


def _names_in(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def _refused_before_writing(r, dst: Path, *words: str) -> None:
    """Exit 1, one line on stderr naming the finding, and nothing written beside DST."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "the source is incomplete" in lines[0], lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "ckpt validate" in lines[0]
    assert not dst.exists()
    # not even a temporary directory was made (it would be removed, but nothing is written at all)
    assert not [n for n in os.listdir(dst.parent) if n.startswith(f".{dst.name}")], os.listdir(dst.parent)


@pytest.fixture
def partial_download(copy_fixture) -> Path:
    src = copy_fixture(SHARDED)
    (src / MISSING_SHARD).unlink()
    return src


@pytest.fixture
def dcp_without_rank_file(copy_fixture) -> Path:
    src = copy_fixture("dcp_multirank")
    (src / "__1_0.distcp").unlink()
    return src


@pytest.fixture
def orbax_lost_data_file(copy_fixture) -> Path:
    """An OCDBT step whose values live in ocdbt.process_0/d/ (the merged root points there): those files lost.

    The tree and array metadata (in the root's d/) still open; the array chunks are gone."""
    src = copy_fixture("orbax_ocdbt_zarr3")
    data = src / "ocdbt.process_0" / "d"
    assert list(data.iterdir())
    for f in data.iterdir():
        f.unlink()
    return src


# -- convert and reshard refuse before writing ---------------------------------------


def test_convert_of_a_partial_download_is_refused(partial_download, tmp_path):
    out = tmp_path / "out" / "dcp"
    out.parent.mkdir()
    r = run_ckpt("convert", str(partial_download), str(out), "--to", "dcp")
    _refused_before_writing(r, out, "missing-file", MISSING_SHARD)


@pytest.mark.parametrize("to", ["orbax", "safetensors"])
def test_convert_of_a_partial_download_is_refused_for_every_target(partial_download, tmp_path, to):
    out = tmp_path / "out" / to
    out.parent.mkdir()
    r = run_ckpt("convert", str(partial_download), str(out), "--to", to)
    _refused_before_writing(r, out, "missing-file", MISSING_SHARD)


def test_reshard_of_a_partial_download_is_refused(partial_download, tmp_path):
    out = tmp_path / "out" / "resharded"
    out.parent.mkdir()
    r = run_ckpt("reshard", str(partial_download), str(out), "--mesh", "data=1", "--devices", "1")
    _refused_before_writing(r, out, "missing-file", MISSING_SHARD)


def test_convert_and_reshard_of_a_dcp_without_a_rank_file_are_refused(dcp_without_rank_file, tmp_path):
    for argv, name in (
        (["convert", str(dcp_without_rank_file), "{}", "--to", "orbax"], "converted"),
        (["reshard", str(dcp_without_rank_file), "{}", "--mesh", "data=1", "--devices", "1"], "resharded"),
    ):
        out = tmp_path / name
        r = run_ckpt(*[a.format(out) if a == "{}" else a for a in argv])
        _refused_before_writing(r, out, "missing-file", "__1_0.distcp")


def test_convert_and_reshard_of_an_orbax_step_with_lost_ocdbt_data_are_refused(orbax_lost_data_file, tmp_path):
    # before: convert wrote a checkpoint and exited 0 (the lost chunks read as nothing)
    for argv, name in (
        (["convert", str(orbax_lost_data_file), "{}", "--to", "dcp"], "converted"),
        (["reshard", str(orbax_lost_data_file), "{}", "--mesh", "data=1", "--devices", "1"], "resharded"),
    ):
        out = tmp_path / name
        r = run_ckpt(*[a.format(out) if a == "{}" else a for a in argv])
        _refused_before_writing(r, out, "lost-process-data", "ocdbt.process_0/d/")


def test_an_orbax_step_whose_metadata_file_is_lost_names_the_finding(copy_fixture, tmp_path):
    """The merged root's own d/ file (tree nodes, zarr.json) gone: not the storage library's raw text."""
    src = copy_fixture("orbax_ocdbt_zarr3")
    for f in (src / "d").iterdir():
        f.unlink()
    out = tmp_path / "converted"
    r = run_ckpt("convert", str(src), str(out), "--to", "dcp")
    _refused_before_writing(r, out, "lost-process-data", "d/")
    assert "NOT_FOUND" not in r.stderr


def test_the_api_refuses_too(partial_download, tmp_path):
    from ckpt_tool.ops.engine import ConvertOptions, convert
    from ckpt_tool.base.errors import IncompleteCheckpointError

    with pytest.raises(IncompleteCheckpointError, match=MISSING_SHARD):
        convert(str(partial_download), str(tmp_path / "out"), ConvertOptions(to="dcp"))
    assert not (tmp_path / "out").exists()


def test_a_whole_source_still_converts(tmp_path):
    out = tmp_path / "out"
    r = run_ckpt("convert", str(fixture_path(SHARDED)), str(out), "--to", "dcp", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["arrays"] == 21


# -- inspect: incomplete, never "committed" -------------------------------------------


def _status_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.strip().startswith("status"))


def test_inspect_of_a_partial_download_says_incomplete_and_what_is_missing(partial_download):
    index = json.loads((fixture_path(SHARDED) / "model.safetensors.index.json").read_text())["weight_map"]
    lost = sorted(name for name, file in index.items() if file == MISSING_SHARD)
    assert lost
    r = run_ckpt("inspect", str(partial_download))
    assert r.returncode == 0, r.stderr
    status = _status_line(r.stdout)
    assert "incomplete" in status and "committed" not in status, status
    assert f"{len(lost)} leaves" in status
    assert any(line.strip().startswith("missing") and MISSING_SHARD in line for line in r.stdout.splitlines())
    r = run_ckpt("inspect", str(partial_download), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["status"] == "incomplete"
    assert [m["file"] for m in doc["missing"]] == [MISSING_SHARD]
    assert sorted(doc["missing"][0]["leaves"]) == lost
    # the leaves that are there are listed; those of the missing shard are named in "missing" only
    assert sorted(leaf["name"] for leaf in doc["leaves"]) == sorted(set(index) - set(lost))


def test_inspect_of_a_dcp_without_a_rank_file_says_incomplete(dcp_without_rank_file):
    r = run_ckpt("inspect", str(dcp_without_rank_file))
    assert r.returncode == 0, r.stderr
    status = _status_line(r.stdout)
    assert "incomplete" in status and "committed" not in status, status
    doc = json.loads(run_ckpt("inspect", str(dcp_without_rank_file), "--json").stdout)
    assert doc["status"] == "incomplete"
    assert [m["file"] for m in doc["missing"]] == ["__1_0.distcp"]
    assert "model.w" in doc["missing"][0]["leaves"]


def test_inspect_of_a_dcp_with_a_truncated_rank_file_says_incomplete(copy_fixture):
    src = copy_fixture("dcp_multirank")
    data = src / "__0_0.distcp"
    whole = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(whole // 2)
    doc = json.loads(run_ckpt("inspect", str(src), "--json").stdout)
    assert doc["status"] == "incomplete"
    (m,) = doc["missing"]
    assert m["file"] == "__0_0.distcp" and f"{whole // 2:,} of the" in m["reason"]


@pytest.mark.parametrize("name", [SHARDED, "dcp_multirank", "orbax_ocdbt_zarr3"])
def test_inspect_of_a_whole_checkpoint_says_committed(name):
    doc = json.loads(run_ckpt("inspect", str(fixture_path(name)), "--json").stdout)
    assert doc["status"] == "committed" and doc["missing"] == [] and doc["committed"] is True


# -- validate --deep on a CheckpointManager root: every step it names -----------------


@pytest.fixture(scope="module")
def root_with_nan_in_an_older_step(tmp_path_factory) -> Path:
    """Three steps written by orbax's CheckpointManager; step 1 (not the latest) holds a NaN."""
    import numpy as np
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("deep_root") / "root"
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=None)) as mgr:
        for step in (1, 2, 3):
            w = np.arange(12, dtype=np.float32).reshape(3, 4) + step
            if step == 1:
                w[1, 2] = np.nan
            mgr.save(step, args=ocp.args.StandardSave({"params": {"w": w, "b": np.full(4, step, np.float32)}}))
        mgr.wait_until_finished()
        assert list(mgr.all_steps()) == [1, 2, 3]
    return root


def _validate_json(*args: str) -> tuple[int, dict]:
    r = run_ckpt("validate", *args, "--json")
    return r.returncode, json.loads(r.stdout)


def test_deep_on_a_root_reads_the_step_a_resume_opens(root_with_nan_in_an_older_step):
    """Without --step, validate ROOT checks the step CheckpointManager.latest_step() restores (the
    newest committed one), and names the other steps: the NaN in older step 1 is not read."""
    code, doc = _validate_json(str(root_with_nan_in_an_older_step), "--deep")
    assert code == 0 and doc["ok"], doc["findings"]
    assert doc["checked"]["steps"] == 1 and doc["checked"]["steps_deep_read"] == 1
    assert not [f for f in doc["findings"] if f["code"] == "non-finite"]
    opened = doc["opened"]
    assert (opened["name"], opened["chosen_by"]) == ("3", "newest-complete")
    assert [(s["name"], s["status"]) for s in opened["steps"]] == [
        ("1", "committed"), ("2", "committed"), ("3", "committed")]
    r = run_ckpt("validate", str(root_with_nan_in_an_older_step), "--deep")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == (
        f"opened 3 of {root_with_nan_in_an_older_step} (the newest of 3 complete steps)")
    assert "1 step deep read" in r.stdout


@pytest.mark.slow
def test_deep_reads_every_step_of_a_root_with_step_all(root_with_nan_in_an_older_step):
    extra = ["--step", "all"]
    code, doc = _validate_json(str(root_with_nan_in_an_older_step), "--deep", *extra)
    assert doc["checked"]["steps"] == 3 and doc["checked"]["steps_deep_read"] == 3
    nan = [(f["severity"], f["leaf"], f["file"]) for f in doc["findings"] if f["code"] == "non-finite"]
    assert nan == [("warning", "params/w", "1/")]  # found, and named with its step
    assert code == 0  # non-finite is a warning (the documented contract): --strict makes it fail
    code, doc = _validate_json(str(root_with_nan_in_an_older_step), "--deep", "--strict", *extra)
    assert code == 1 and not doc["ok"]
    r = run_ckpt("validate", str(root_with_nan_in_an_older_step), "--deep", *extra)
    assert "3 steps deep read" in r.stdout and "1/" in r.stdout


@pytest.mark.parametrize("step, nan", [("1", True), ("3", False), ("latest", False)])
def test_deep_reads_one_step_when_asked(root_with_nan_in_an_older_step, step, nan):
    code, doc = _validate_json(str(root_with_nan_in_an_older_step), "--deep", "--step", step)
    assert doc["checked"]["steps"] == 1 and doc["checked"]["steps_deep_read"] == 1
    assert any(f["code"] == "non-finite" for f in doc["findings"]) == nan


def test_deep_on_a_root_reports_progress_step_by_step_within_memory(root_with_nan_in_an_older_step):
    from ckpt_tool.ops.validate import validate_checkpoint

    calls: list[str] = []
    report = validate_checkpoint(str(root_with_nan_in_an_older_step), step="all", deep=True, memory=16 * 2**20,
                                 progress=lambda what, done, total: calls.append(what))
    assert report.checked["steps_deep_read"] == 3
    # one step after another: each step's progress ends before the next begins
    order = [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]
    assert order == ["step 1 (1 of 3)", "step 2 (2 of 3)", "step 3 (3 of 3)"]


@pytest.mark.parametrize("name, steps", [("orbax_manager", 2), ("flax_msgpack", 2), ("orbax_v0_4_manager", 2)])
def test_deep_on_the_fixture_roots_reads_each_committed_step(name, steps):
    code, doc = _validate_json(str(fixture_path(name)), "--deep", "--step", "all")
    assert code == 0, doc["findings"]
    assert doc["checked"]["steps_deep_read"] == steps


def test_a_nan_in_an_older_flax_step_is_found(copy_fixture):
    """Flax checkpoint_N files: an older file's float leaf made NaN (its bytes, in place)."""
    import numpy as np

    import ckpt_tool

    root = copy_fixture("flax_msgpack")
    older = ckpt_tool.open(str(root), step=1)
    leaf = next(l for l in older.arrays() if l.dtype == "float32" and l.size)
    raw = (root / "checkpoint_1").read_bytes()
    value = np.asarray(leaf.read()).reshape(-1)[:1].tobytes()
    assert raw.count(value) >= 1
    at = raw.index(value)
    (root / "checkpoint_1").write_bytes(raw[:at] + np.float32(np.nan).tobytes() + raw[at + 4:])
    code, doc = _validate_json(str(root), "--deep", "--step", "all")
    assert doc["checked"]["steps_deep_read"] == 2
    assert [f["file"] for f in doc["findings"] if f["code"] == "non-finite"] == ["checkpoint_1"]


# -- a folder of checkpoints is not one checkpoint ---------------------------------------


@pytest.fixture(scope="module")
def orbax_saves(tmp_path_factory) -> Path:
    """Two independent saves by orbax's StandardCheckpointer, and a CheckpointManager root with named items."""
    import numpy as np
    import orbax.checkpoint as ocp

    base = tmp_path_factory.mktemp("orbax_saves")
    for name, bump in (("a", 0.0), ("b", 1.0)):
        with ocp.StandardCheckpointer() as ck:
            ck.save(base / "saves" / name, {"w": np.arange(4.0) + bump, "step": 3})
    with ocp.CheckpointManager(base / "items_root", item_names=("state", "extra")) as mgr:
        mgr.save(1, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"w": np.arange(6.0)}),
            extra=ocp.args.StandardSave({"lr": np.float32(0.1), "v": np.ones(2)}),
        ))
        mgr.wait_until_finished()
    return base


def _folder_of_checkpoints(orbax_saves: Path, tmp_path: Path) -> Path:
    import shutil

    folder = tmp_path / "folder"
    shutil.copytree(orbax_saves / "saves", folder)
    shutil.copytree(fixture_path("dcp_single"), folder / "c")
    return folder


@pytest.mark.slow
def test_a_folder_of_checkpoints_is_refused_listing_them(orbax_saves, tmp_path):
    folder = _folder_of_checkpoints(orbax_saves, tmp_path)
    for argv in (["inspect", str(folder)], ["validate", str(folder)],
                 ["convert", str(folder), str(tmp_path / "out"), "--to", "dcp"]):
        r = run_ckpt(*argv)
        assert r.returncode == 1, (argv, r.stdout, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert "a directory of 3 checkpoints, not one" in line, line
        for listed in ("a/ (orbax)", "b/ (orbax)", "c/ (dcp)"):
            assert listed in line, line
    assert not (tmp_path / "out").exists()


def test_two_orbax_saves_side_by_side_are_refused(orbax_saves):
    # no _CHECKPOINT_METADATA at the top; each save has its own: not items of one step
    r = run_ckpt("inspect", str(orbax_saves / "saves"))
    assert r.returncode == 1
    assert "a directory of 2 checkpoints, not one: a/ (orbax), b/ (orbax)" in r.stderr


def test_an_items_only_step_beside_a_safetensors_dir_is_refused(copy_fixture, tmp_path):
    """orbax 0.5 writes no _CHECKPOINT_METADATA: its item beside a safetensors model is no step either."""
    import shutil

    folder = tmp_path / "mixed"
    shutil.copytree(fixture_path("orbax_v0_5") / "manager" / "1" / "default", folder / "state")
    shutil.copytree(fixture_path("safetensors_numpy"), folder / "model")
    r = run_ckpt("inspect", str(folder))
    assert r.returncode == 1
    assert "model/ (safetensors)" in r.stderr and "state/ (orbax)" in r.stderr


@pytest.mark.slow
def test_a_multi_item_step_still_reads_as_one_checkpoint(orbax_saves):
    import orbax.checkpoint as ocp

    root = orbax_saves / "items_root"
    with ocp.CheckpointManager(root, item_names=("state", "extra")) as mgr:
        restored = mgr.restore(1, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), extra=ocp.args.StandardRestore()))
    for path in (root, root / "1"):
        doc = json.loads(run_ckpt("inspect", str(path), "--json").stdout)
        assert doc["status"] == "committed" and sorted(doc["layout"]["items"]) == ["extra", "state"]
        keys = sorted(tuple(leaf["keys"]) for leaf in doc["leaves"])
        assert keys == sorted((item, k) for item in ("state", "extra") for k in restored[item])
    code, report = _validate_json(str(root / "1"))
    assert code == 0, report["findings"]


@pytest.mark.parametrize("name", ["orbax_manager", "orbax_manager/1", "orbax_v0_5/manager", "orbax_v0_5/manager/1",
                                  "orbax_v0_11/manager/1"])
def test_the_manager_fixtures_still_read(name):
    r = run_ckpt("inspect", str(fixture_path(name)), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layout"]["items"]


@pytest.mark.slow
def test_a_root_is_checked_at_the_step_being_copied(root_with_nan_in_an_older_step, tmp_path):
    """Damage in an older step does not stop a copy of the latest; a copy of that step is refused."""
    import shutil

    root = tmp_path / "root"
    shutil.copytree(root_with_nan_in_an_older_step, root)
    lost = sorted((root / "1" / "default" / "ocdbt.process_0" / "d").iterdir())
    assert lost
    for f in lost:
        f.unlink()
    r = run_ckpt("convert", str(root), str(tmp_path / "latest"), "--to", "dcp")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "older"
    r = run_ckpt("convert", str(root), str(out), "--to", "dcp", "--step", "1")
    _refused_before_writing(r, out, "lost-process-data", "1/default/ocdbt.process_0/d/", "--step 1")


def test_a_truncated_rank_file_is_refused(copy_fixture, tmp_path):
    src = copy_fixture("dcp_multirank")
    with open(src / "__1_0.distcp", "r+b") as f:
        f.truncate(100)
    out = tmp_path / "out"
    r = run_ckpt("convert", str(src), str(out), "--to", "orbax")
    _refused_before_writing(r, out, "truncated-file", "__1_0.distcp")
