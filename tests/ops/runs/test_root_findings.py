"""A run root's findings name the cause once, and the refusals name a step that works (issue 45
items 1 and 5).

1. A killed async Orbax save (`N.orbax-checkpoint-tmp`, or `-tmp-<timestamp>` / `-tmp-<n>` from
   older orbax) beside a committed step: `validate --step N` says `uncommitted-save` and nothing
   about the root (orbax's own `CheckpointManager.all_steps()` lists the committed step); a leftover
   tmp beside a finished save of the same number is a warning, not an error.
5. A damaged newest Orbax step: `convert ROOT` opens it (orbax's `latest_step()`) and refuses,
   naming the step `ckpt latest` prints (the newest that passes validate) and `--step` for it;
   `ckpt ls` marks a committed step that fails validate's cheap checks, by default.

Inputs are written by the real orbax-checkpoint: fixtures/runs_orbax (a CheckpointManager run whose
step-4 async save was SIGKILLed, fixtures/gen_runs.py) and fixtures/orbax_v0_5 (orbax 0.5's
CheckpointManager, whose temporary names carry a timestamp); orbax itself is the oracle for which
steps a root holds.
"""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import count_calls, fixture_path

# the temporary name each orbax version gives a step it is still writing (test_orbax_versions.py)
TMP_SUFFIXES = [".orbax-checkpoint-tmp", ".orbax-checkpoint-tmp-3", ".orbax-checkpoint-tmp-1796149675123456"]


def _orbax_steps(root) -> list[int]:
    """The oracle: the steps orbax's own CheckpointManager finds in `root` (opened read-only)."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(str(root), options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        return list(manager.all_steps())
    finally:
        manager.close()


@pytest.fixture
def killed_save(tmp_path):
    """A CheckpointManager root: step 1 committed, step 4's async save killed (what orbax left),
    under the temporary name `suffix`."""

    def make(suffix: str):
        src = fixture_path("runs_orbax")
        root = tmp_path / f"run{suffix}"
        root.mkdir()
        shutil.copytree(src / "1", root / "1")
        shutil.copytree(src / "4.orbax-checkpoint-tmp", root / f"4{suffix}")
        return root

    return make


# -- item 1: one finding for a killed async save ------------------------------------------------------

@pytest.mark.parametrize("suffix", TMP_SUFFIXES)
def test_a_killed_save_asked_for_is_one_error(ckpt, killed_save, suffix):
    root = killed_save(suffix)
    assert _orbax_steps(root) == [1]  # the oracle: step 1 is there, committed
    r = ckpt("validate", root, "--step", "4", "--json")
    assert r.returncode == 1, r.stdout
    doc = json.loads(r.stdout)
    assert [(f["severity"], f["code"], f["file"]) for f in doc["findings"]] == [
        ("error", "uncommitted-save", f"4{suffix}/")]
    r = ckpt("validate", root, "--step", "4")
    assert "no-steps" not in r.stdout and "no committed step" not in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith("FAILED: 1 error, 0 warnings"), r.stdout


def test_a_killed_save_asked_for_with_deep_claims_no_step_read(ckpt, killed_save):
    root = killed_save(".orbax-checkpoint-tmp")
    doc = json.loads(ckpt("validate", root, "--step", "4", "--deep", "--json").stdout)
    assert [f["code"] for f in doc["findings"]] == ["uncommitted-save"]
    assert "steps_deep_read" not in doc["checked"], doc["checked"]  # it holds nothing orbax wrote yet
    doc = json.loads(ckpt("validate", root, "--step", "1", "--deep", "--json").stdout)
    assert doc["ok"] and doc["checked"]["steps_deep_read"] == 1


@pytest.mark.parametrize("suffix", TMP_SUFFIXES)
def test_the_root_beside_a_killed_save_validates(ckpt, killed_save, suffix):
    root = killed_save(suffix)
    for args in ((), ("--step", "1"), ("--step", "latest"), ("--step", "all")):
        r = ckpt("validate", root, *args, "--json")
        assert r.returncode == 0, (args, r.stdout)
        findings = json.loads(r.stdout)["findings"]
        assert all(f["severity"] == "warning" for f in findings) and "no-steps" not in r.stdout, (args, findings)
    assert [f["code"] for f in json.loads(ckpt("validate", root, "--step", "1", "--json").stdout)["findings"]] == []


def test_no_committed_step_at_all_is_still_said(ckpt, killed_save):
    root = killed_save(".orbax-checkpoint-tmp")
    shutil.rmtree(root / "1")
    assert _orbax_steps(root) == []  # the oracle: nothing to restore
    r = ckpt("validate", root, "--json")
    assert r.returncode == 1
    assert "no-steps" in [f["code"] for f in json.loads(r.stdout)["findings"]]


def test_a_leftover_tmp_beside_the_same_step_committed_is_a_warning(ckpt, tmp_path):
    # orbax 0.5 named each try anew (`2.orbax-checkpoint-tmp-<timestamp>`): a save of step 2 killed
    # after its items were written, then step 2 saved again and committed; orbax lists 2 and
    # restores it, and never looks at the leftover
    root = tmp_path / "manager"
    shutil.copytree(fixture_path("orbax_v0_5") / "manager", root)
    shutil.copytree(root / "2", root / "2.orbax-checkpoint-tmp-1796149675123456")
    assert _orbax_steps(root) == [1, 2]
    for args in ((), ("--step", "2"), ("--step", "all")):
        r = ckpt("validate", root, *args, "--json")
        assert r.returncode == 0, (args, r.stdout)
        doc = json.loads(r.stdout)
        assert [(f["severity"], f["code"], f["file"]) for f in doc["findings"]] == [
            ("warning", "uncommitted-save", "2.orbax-checkpoint-tmp-1796149675123456/")], (args, doc["findings"])


# -- item 5: a damaged newest Orbax step -----------------------------------------------------------------

def _halve(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _damage(root, step: str) -> None:
    """Cut the OCDBT data file of `step` to half (a disk error, a copy cut short): the step's listing
    and commit records still say committed."""
    _halve(sorted((root / step / "default" / "d").glob("*"))[0])


@pytest.fixture
def damaged_newest(tmp_path):
    root = tmp_path / "runs_orbax"
    shutil.copytree(fixture_path("runs_orbax"), root)
    _damage(root, "3")
    return root


def _orbax_latest_step(root) -> int | None:
    """The oracle: the step orbax's own CheckpointManager restores by default."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(str(root), options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        return manager.latest_step()
    finally:
        manager.close()


def test_convert_of_a_damaged_newest_step_names_the_step_that_works(ckpt, damaged_newest, tmp_path):
    root = damaged_newest
    assert _orbax_latest_step(root) == 3  # what a resume (and convert ROOT) opens: the damaged step
    r = ckpt("latest", root)
    assert r.returncode == 0 and r.stdout == f"{root}/2\n"
    out = tmp_path / "out"
    r = ckpt("convert", root, out, "--to", "safetensors")
    assert r.returncode == 1 and r.stdout == "" and not out.exists()
    [line] = r.stderr.splitlines()
    assert line.startswith(f"ckpt: error: {root}: the source is incomplete: lost-process-data: "), line
    assert line.endswith("; 3 is the step Orbax CheckpointManager resumes from (CheckpointManager.latest_step()); "
                         "`ckpt latest` picks 2, the newest step that passes validate: --step 2"), line
    r = ckpt("convert", root, out, "--to", "safetensors", "--json")
    assert r.returncode == 1 and "--step 2" in json.loads(r.stdout)["error"]["message"]
    # the step named works
    r = ckpt("convert", root, out, "--to", "safetensors", "--step", "2")
    assert r.returncode == 0, r.stderr
    # asked for by --step, the damaged step is refused without a step named in its place
    r = ckpt("convert", root, tmp_path / "out3", "--to", "safetensors", "--step", "3")
    assert r.returncode == 1 and "ckpt latest" not in r.stderr and "--step 3" in r.stderr


def test_diff_and_inspect_name_the_step_that_works(ckpt, damaged_newest):
    root = damaged_newest
    r = ckpt("diff", root, fixture_path("runs_orbax"))
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1].endswith("`ckpt latest` picks 2, the newest step that passes validate: --step 2")
    # two damaged steps: the step before (by the listing) fails too; the one named is latest's pick
    _damage(root, "2")
    assert ckpt("latest", root).stdout == f"{root}/1\n"
    for args in (("inspect", root), ("convert", root, root.parent / "out", "--to", "dcp")):
        r = ckpt(*args)
        assert r.returncode == 1, args
        [line] = r.stderr.splitlines()
        assert line.endswith("`ckpt latest` picks 1, the newest step that passes validate: --step 1"), line
        assert "--step 2" not in line, line


def test_no_step_that_works_is_said(ckpt, tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    shutil.copytree(fixture_path("runs_orbax") / "3", root / "3")
    _damage(root, "3")
    r = ckpt("convert", root, tmp_path / "out", "--to", "dcp")
    assert r.returncode == 1
    assert r.stderr.rstrip().endswith("and no step passes validate (`ckpt latest` finds none)"), r.stderr


def test_ls_marks_a_committed_step_that_fails_the_cheap_check(ckpt, damaged_newest):
    root = damaged_newest
    r = ckpt("ls", root)
    assert r.returncode == 0, r.stderr  # a listing: --check is the one that exits 1
    lines = r.stdout.splitlines()
    assert [line.split()[:4] for line in lines[2:6]] == [
        ["1", "1", "orbax", "committed"], ["2", "2", "orbax", "committed"], ["3", "3", "orbax", "committed"],
        ["4", "4.orbax-checkpoint-tmp", "orbax", "in-progress"]]
    marked = [line for line in lines if "fails validate" in line]
    assert len(marked) == 1 and marked[0].startswith(
        f"  3: fails validate (`ckpt latest` passes over it; `ckpt validate {root} --step 3` for every finding): "
        "lost-process-data: OCDBT data file has "), marked
    doc = json.loads(ckpt("ls", root, "--json").stdout)
    fails = {s["name"]: s["fails"] for s in doc["steps"]}
    assert fails["1"] is None and fails["2"] is None and fails["4.orbax-checkpoint-tmp"] is None
    assert fails["3"].startswith("lost-process-data: ") and doc["ok"] is True
    assert all(s["check"] is None for s in doc["steps"])  # (validate's whole verdict: --check)
    # --no-check: the listing alone; --check: every step, in its column, exit 1
    r = ckpt("ls", root, "--no-check")
    assert r.returncode == 0 and "fails validate" not in r.stdout
    r = ckpt("ls", root, "--check")
    assert r.returncode == 1 and "fails validate" not in r.stdout and "FAILED: lost-process-data" in r.stdout
    # an undamaged root: no step marked
    assert "fails validate" not in ckpt("ls", fixture_path("runs_orbax")).stdout


def test_ls_cheap_checks_are_in_flight_together_and_read_no_array_data(damaged_newest, monkeypatch):
    from ckpt_tool.ops import runs
    from ckpt_tool.ops import validate as validate_mod

    root = damaged_newest
    for n in (5, 6, 7):  # more steps: copies of a step orbax wrote
        shutil.copytree(root / "2", root / str(n))
    seen = count_calls(monkeypatch, validate_mod, "_validate_one", hold_s=0.2)
    listing = runs.list_run(str(root), screen=True)
    assert {s.name: s.fails is not None for s in listing.steps} == {
        "1": False, "2": False, "3": True, "4.orbax-checkpoint-tmp": False, "5": False, "6": False, "7": False}
    # each committed step alone, shallow (no chunk read), never the save in progress
    calls = [(path, kw["step"], kw["deep"]) for path, kw in seen.calls]
    assert sorted(calls) == sorted((f"{root}/{n}", None, False) for n in (1, 2, 3, 5, 6, 7))
    assert seen.peak >= 2, seen.peak


# -- on object stores: the same marks from the same cheap checks ---------------------------------------

def _ls_marks(doc: dict) -> dict[str, bool]:
    return {s["name"]: s["fails"] is not None for s in doc["steps"]}


@pytest.mark.slow
def test_ls_marks_and_convert_hint_on_s3(damaged_newest, tmp_path):
    from conftest import moto_s3_serving, run_ckpt

    local = json.loads(run_ckpt("ls", str(damaged_newest), "--json").stdout)
    with moto_s3_serving("ckpt-root-findings", [], trees={"run": damaged_newest}) as env:
        url = "s3://ckpt-root-findings/run"
        r = run_ckpt("ls", url, "--json", env=env)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        doc = json.loads(r.stdout)
        assert _ls_marks(doc) == _ls_marks(local) == {"1": False, "2": False, "3": True, "4.orbax-checkpoint-tmp": False}
        assert doc["steps"][2]["fails"].startswith("lost-process-data: ")
        r = run_ckpt("ls", url, env=env)
        assert r.returncode == 0 and f"  3: fails validate (`ckpt latest` passes over it; `ckpt validate {url} --step 3`" in r.stdout
        r = run_ckpt("convert", url, str(tmp_path / "out"), "--to", "dcp", env=env)
        assert r.returncode == 1 and r.stderr.rstrip().endswith(
            "`ckpt latest` picks 2, the newest step that passes validate: --step 2"), r.stderr


@pytest.mark.slow
def test_ls_marks_on_gcs(damaged_newest):
    from conftest import fake_gcs_serving, gcs_create_bucket, gcs_upload_tree, run_ckpt

    with fake_gcs_serving() as env:
        gcs_create_bucket(env["CKPT_TEST_GCS"], "ckpt-root-findings")
        url = gcs_upload_tree(env["CKPT_TEST_GCS"], "ckpt-root-findings", damaged_newest, "run")
        r = run_ckpt("ls", url, "--json", env=env)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert _ls_marks(json.loads(r.stdout)) == {"1": False, "2": False, "3": True, "4.orbax-checkpoint-tmp": False}
        r = run_ckpt("latest", url, env=env)
        assert r.returncode == 0 and r.stdout == f"{url}/2\n", r.stderr
