"""`--step` of inspect, validate and convert on every run root `ckpt ls` lists (issue 22 item 5):
roots whose format reader has no step rules of its own (torchtitan's step-N/, HF Trainer's
checkpoint-N/, NeMo 2, verl) go through the run layouts' table (runs.step_path), as diff does.

The roots are the committed fixtures/runs_* (fixtures/gen_runs.py: the real writers where they
install here, each with a newest step torn mid-save; NeMo 2 and verl by their documented layouts).
"""
from __future__ import annotations

import json

import pytest

from conftest import fixture_path

import ckpt_tool
from ckpt_tool.base.errors import NotFoundError
from ckpt_tool.ops.validate import validate_checkpoint

NEMO = "runs_nemo2/checkpoints"
NEMO_4 = "megatron_gpt--val_loss=2.90-step=4-consumed_samples=32.0"
NEMO_9_LAST = "megatron_gpt--val_loss=2.80-step=9-consumed_samples=72.0-last"

# root -> [(--step, the directory it names, relative to the root)]; "latest" skips the torn step
STEPS = {
    "runs_torchtitan": [("20", "step-20"), ("step-10", "step-10"), ("latest", "step-30")],
    # (not "latest": the Trainer resumes from the torn checkpoint-6, and validate fails on it)
    "runs_hf_trainer": [("2", "checkpoint-2"), ("4", "checkpoint-4")],
    "runs_verl": [("2", "global_step_2/actor"), ("latest", "global_step_4/actor")],
    NEMO: [("4", NEMO_4), ("latest", NEMO_9_LAST)],
}
CASES = [(root, step, where) for root, steps in STEPS.items() for step, where in steps]


@pytest.mark.parametrize("root,step,where", CASES)
def test_open_with_step_is_the_step_directory(root, step, where):
    path = str(fixture_path(root))
    by_step = ckpt_tool.open(path, step=step)
    direct = ckpt_tool.open(f"{path}/{where}")
    assert by_step.format == direct.format
    assert len(direct) > 0
    assert [(x.path, x.shape, x.dtype) for x in by_step] == [(x.path, x.shape, x.dtype) for x in direct]


@pytest.mark.parametrize("root,step,where", CASES)
def test_validate_with_step_checks_that_step(root, step, where):
    path = str(fixture_path(root))
    report = validate_checkpoint(path, step=step)
    assert report.path == f"{path}/{where}"
    assert report.ok(), [f.to_json() for f in report.findings]
    assert report.checked == validate_checkpoint(f"{path}/{where}").checked


def test_cli_inspect_and_validate_with_step(ckpt):
    root = str(fixture_path("runs_torchtitan"))
    r = ckpt("inspect", root, "--step", "20", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # the step's own values: torchtitan's train_state records the step it was saved at
    assert doc["path"] == f"{root}/step-20"
    r = ckpt("validate", root, "--step", "latest", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == f"{root}/step-30"
    # the torn step: validate names what is missing, exit 1
    r = ckpt("validate", root, "--step", "40")
    assert r.returncode == 1 and "step-40" in r.stdout + r.stderr


def test_unknown_step_is_one_not_found_line(ckpt):
    # a step that is not there is like a path that is not there: not-found, exit 1, on every root
    # (tests/ops/runs/test_run_roots_default.py checks the same line on each framework's root)
    root = str(fixture_path("runs_hf_trainer"))
    with pytest.raises(NotFoundError, match="--step 99: no such step"):
        ckpt_tool.open(root, step=99)
    for cmd in ("inspect", "validate"):
        r = ckpt(cmd, root, "--step", "99")
        assert r.returncode == 1 and "--step 99: no such step" in r.stderr and "Traceback" not in r.stderr


def test_convert_with_step(ckpt, tmp_path):
    root = str(fixture_path("runs_hf_trainer"))
    out = tmp_path / "out"
    r = ckpt("convert", root, str(out), "--to", "safetensors", "--step", "2")
    assert r.returncode == 0, r.stderr
    r = ckpt("diff", f"{root}/checkpoint-2", str(out), "--values")
    assert r.returncode == 0, r.stdout + r.stderr
    r = ckpt("diff", f"{root}/checkpoint-4", str(out), "--values")
    assert r.returncode == 1  # trained between steps 2 and 4: the step chosen is step 2


def test_reader_step_rules_are_kept():
    # Orbax CheckpointManager roots keep their reader's own --step rules (the layout's own_root)
    root = str(fixture_path("runs_orbax"))
    assert ckpt_tool.open(root, step=2).step == 2
    assert ckpt_tool.open(root).step == 3
