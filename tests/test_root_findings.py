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

from conftest import fixture_path

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
