"""The step a resume opens is the step checked (issue 44 items 5, 6 and 7).

5. Each framework's own resume rule picks the step validate of the root checks by default, judged
   by the framework's own rules: Trainer's get_last_checkpoint (the highest checkpoint-N/, and its
   trainer_state.json as TrainerState.load_from_json reads it), verl's tracker, NeMo's newest
   `-last` copy, a rank's `.pt` that torch.load must read. When that step is torn, validate fails.
6. `ckpt latest` prints the newest step that validates; where the framework would pick another
   (a broken pointer, a torn or damaged newest step) stderr says so, `--strict` exits 1, and
   `--json` carries both.
7. validate of the root gives every other step a cheap check and warns about damage there,
   naming the step and `--step all`.

Inputs are the committed fixtures written by the real libraries (fixtures/gen_runs.py and the
per-format generators), torn the way their writers leave a killed save, or damaged on disk.
"""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import count_calls

NEMO = "runs_nemo2/checkpoints"
NEMO_9 = "megatron_gpt--val_loss=2.80-step=9-consumed_samples=72.0"
NEMO_9_LAST = NEMO_9 + "-last"
NEMO_4 = "megatron_gpt--val_loss=2.90-step=4-consumed_samples=32.0"


@pytest.fixture
def root_of(tmp_path):
    def make(name: str):
        from conftest import fixture_path

        root = tmp_path / name.replace("/", "_")
        shutil.copytree(fixture_path(name), root, symlinks=True)
        return root

    return make


def _halve(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _first(directory, pattern: str):
    return sorted(directory.glob(pattern))[0]


# -- item 5: the framework's own pick, by its own rules --------------------------------------------

def test_an_empty_trainer_state_is_no_commit(ckpt, root_of):
    from transformers.trainer_callback import TrainerState

    root = root_of("runs_hf_trainer")
    shutil.rmtree(root / "checkpoint-6")
    shutil.copytree(root / "checkpoint-4", root / "checkpoint-6")
    state = root / "checkpoint-6" / "trainer_state.json"
    state.write_bytes(b"")  # the Trainer killed while writing it, the last file of its save
    with pytest.raises(json.JSONDecodeError):  # the oracle: what the Trainer's resume does with it
        TrainerState.load_from_json(str(state))
    r = ckpt("validate", root)
    assert r.returncode == 1, r.stdout
    assert r.stdout.startswith(f"opened checkpoint-6 of {root} (the step Hugging Face Trainer resumes from")
    assert "error uncommitted-save: checkpoint-6 is incomplete: trainer_state.json is empty" in r.stdout
    r = ckpt("latest", root)
    assert r.returncode == 0 and r.stdout == f"{root}/checkpoint-4\n", r.stderr
    # a trainer_state.json cut short is the same
    state.write_bytes((root / "checkpoint-4" / "trainer_state.json").read_bytes()[:40])
    with pytest.raises(json.JSONDecodeError):
        TrainerState.load_from_json(str(state))
    assert ckpt("validate", root).returncode == 1
    assert ckpt("latest", root).stdout == f"{root}/checkpoint-4\n"


def test_a_torn_step_the_trainer_picks_fails_validate(ckpt, root_of):
    from transformers.trainer_utils import get_last_checkpoint

    root = root_of("runs_hf_trainer")  # checkpoint-6: killed before trainer_state.json
    assert get_last_checkpoint(str(root)).endswith("checkpoint-6")  # the oracle: what a resume opens
    r = ckpt("validate", root, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["opened"]["name"] == "checkpoint-6"
    assert doc["opened"]["chosen_by"] == "resume-rule" and doc["opened"]["status"] == "incomplete"
    # the staged save of transformers 4.36 (tmp-checkpoint-N/) is no step get_last_checkpoint matches
    (root / "checkpoint-6").rename(root / "tmp-checkpoint-6")
    assert get_last_checkpoint(str(root)).endswith("checkpoint-4")
    assert ckpt("validate", root).returncode == 0


def test_an_empty_checkpoint_dir_is_the_trainers_pick(ckpt, root_of):
    from transformers.trainer_utils import get_last_checkpoint

    root = root_of("runs_hf_trainer")
    (root / "checkpoint-8").mkdir()  # the save killed right after its makedirs
    assert get_last_checkpoint(str(root)).endswith("checkpoint-8")  # the oracle
    r = ckpt("validate", root)
    assert r.returncode == 1 and r.stdout.startswith(f"opened checkpoint-8 of {root} ("), r.stdout + r.stderr
    assert "error uncommitted-save: checkpoint-8 is incomplete: no trainer_state.json" in r.stdout
    r = ckpt("latest", root)
    assert r.returncode == 0 and r.stdout == f"{root}/checkpoint-4\n" and "would resume from checkpoint-8 (" in r.stderr
    r = ckpt("inspect", root)
    assert r.returncode == 1 and "(the step Hugging Face Trainer resumes from; --step 4 reads the one before)" in r.stderr


def test_a_tracker_naming_a_torn_verl_step_fails_validate(ckpt, root_of):
    root = root_of("runs_verl")  # global_step_6: a rank's optimizer file missing
    (root / "latest_checkpointed_iteration.txt").write_text("6")
    r = ckpt("validate", root)
    assert r.returncode == 1, r.stdout
    assert r.stdout.startswith(f"opened global_step_6 of {root} (named by latest_checkpointed_iteration.txt")
    assert "error uncommitted-save: global_step_6 is incomplete: actor/optim_world_size_2_rank_1.pt missing" in r.stdout
    assert "(--step 4)" in r.stdout


def test_nemo_resumes_from_its_last_copy_and_validate_checks_it(ckpt, root_of):
    root = root_of(NEMO)
    (root / NEMO_9_LAST / "weights" / "metadata.json").unlink()  # the -last copy torn
    r = ckpt("validate", root, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["opened"]["name"] == NEMO_9_LAST, doc["opened"]
    assert doc["opened"]["status"] == "incomplete"
    r = ckpt("latest", root)
    assert r.returncode == 0 and r.stdout == f"{root}/{NEMO_9}\n"
    assert f"NeMo 2 would resume from {NEMO_9_LAST} (" in r.stderr


def test_a_step_named_copy_beside_torchtitan_steps_is_its_pick(ckpt, root_of):
    # torchtitan's _find_load_step searches names for `step-(\d+)` unanchored: a copy step-50.bak/
    # holding .metadata makes it take step 50 and open step-50/
    root = root_of("runs_torchtitan")
    shutil.copytree(root / "step-30", root / "step-50.bak")
    r = ckpt("validate", root)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"ckpt: error: {root}: step-50.bak holds .metadata, so torchtitan's "
                               "_find_load_step takes step 50 and opens step-50, which is not there")
    r = ckpt("latest", root)
    assert r.returncode == 0 and r.stdout == f"{root}/step-30\n"
    assert "torchtitan (DCP) would resume from no step: step-50.bak holds .metadata" in r.stderr
    assert ckpt("latest", root, "--strict").returncode == 1
    # step-50/ there but torn: that is what the resume opens, and validate fails on it
    shutil.copytree(root / "step-40", root / "step-50")
    r = ckpt("validate", root, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["opened"]["name"] == "step-50"
    assert ckpt("validate", root, "--step", "30").returncode == 0


@pytest.mark.parametrize("name,victim", [
    ("runs_verl", "global_step_4/actor/model_world_size_2_rank_1.pt"),
    ("deepspeed_z1_fp32", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("megatron_legacy", "iter_0000005/mp_rank_01/model_optim_rng.pt"),
])
def test_an_empty_rank_file_fails(ckpt, root_of, name, victim):
    import torch

    root = root_of(name)
    (root / victim).write_bytes(b"")  # a rank killed before its first byte
    with pytest.raises(EOFError):  # the oracle: the framework's load
        torch.load(root / victim, weights_only=True)
    for args in ((), ("--deep",)):
        r = ckpt("validate", root, *args)
        assert r.returncode == 1 and "error empty-file: 0 bytes" in r.stdout, r.stdout
    r = ckpt("latest", root)
    assert not r.stdout.startswith(f"{root}/{victim.split('/')[0]}\n"), r.stdout


@pytest.mark.parametrize("victim", ["rng_state.pth", "optimizer.pt", "scheduler.pt"])
def test_an_empty_torch_file_of_the_trainers_step_fails(ckpt, root_of, victim):
    import torch

    root = root_of("runs_hf_trainer")
    (root / "checkpoint-6").rename(root / "tmp-checkpoint-6")  # checkpoint-4: the Trainer's pick
    (root / "checkpoint-4" / victim).write_bytes(b"")
    with pytest.raises(EOFError):  # the oracle: what the Trainer's resume does with it
        torch.load(root / "checkpoint-4" / victim, weights_only=True)
    r = ckpt("validate", root)
    assert r.returncode == 1, r.stdout
    assert f"error uncommitted-save: checkpoint-4 is incomplete: {victim} is empty" in r.stdout
    r = ckpt("latest", root)
    assert r.returncode == 0 and r.stdout == f"{root}/checkpoint-2\n"
    assert "Hugging Face Trainer would resume from checkpoint-4 (" in r.stderr


# -- item 6: latest says what the framework would pick -----------------------------------------------

def _orbax(root):
    _halve(_first(root / "3" / "default" / "d", "*"))


def _flax(root):
    _halve(root / "checkpoint_2")


def _titan(root):
    _halve(root / "step-30" / "__0_0.distcp")


def _megatron(root):
    (root / "latest_checkpointed_iteration.txt").write_text("99")


def _nemo(root):
    (root / NEMO_9_LAST / "weights" / "metadata.json").unlink()


def _deepspeed(root):
    (root / "latest").write_text("global_step9")


def _verl(root):
    (root / "latest_checkpointed_iteration.txt").write_text("6")


# fixture -> (damage, the framework's own pick (None: none), the step latest prints)
DIFFERS = {
    "runs_orbax": (_orbax, "3", "2"),
    "flax_msgpack": (_flax, "checkpoint_2", "checkpoint_1"),
    "runs_torchtitan": (_titan, "step-30", "step-20"),
    "runs_hf_trainer": (None, "checkpoint-6", "checkpoint-4"),
    "megatron_run": (_megatron, None, "iter_0000020"),
    NEMO: (_nemo, NEMO_9_LAST, NEMO_9),
    "deepspeed_z1_fp32": (_deepspeed, None, "global_step2"),
    "runs_verl": (_verl, "global_step_6", "global_step_4"),
}


@pytest.mark.parametrize("name", DIFFERS)
def test_latest_says_what_the_framework_would_pick(ckpt, root_of, name):
    damage, pick, printed = DIFFERS[name]
    root = root_of(name)
    if damage is not None:
        damage(root)
    r = ckpt("latest", root)
    assert r.returncode == 0 and r.stdout == f"{root}/{printed}\n", (r.stdout, r.stderr)
    line = r.stderr.splitlines()[-1]
    would = "would resume from no step: " if pick is None else f"would resume from {pick} ("
    assert line.startswith("ckpt: latest: ") and would in line and f"; pass {printed} explicitly (" in line, line
    r = ckpt("latest", root, "--strict")
    assert r.returncode == 1 and r.stdout == "", r.stdout
    [line] = r.stderr.splitlines()
    assert line.startswith(f"ckpt: error: {root}: ") and line.endswith("(--strict)")
    doc = json.loads(ckpt("latest", root, "--json").stdout)
    assert doc["ok"] and doc["name"] == printed and doc["differs"] is True
    assert doc["framework"]["name"] == pick and doc["framework"]["problem"]
    doc = json.loads(ckpt("latest", root, "--json", "--strict").stdout)
    assert doc["ok"] is False and doc["name"] == printed


@pytest.mark.parametrize("name", ["runs_torchtitan", "runs_orbax", "megatron_run", "runs_verl", NEMO])
def test_latest_is_quiet_when_the_framework_picks_the_same_step(ckpt, root_of, name):
    root = root_of(name)
    r = ckpt("latest", root, "--strict")
    assert r.returncode == 0 and "would resume from" not in r.stderr, r.stderr
    doc = json.loads(ckpt("latest", root, "--json").stdout)
    assert doc["differs"] is False and doc["framework"]["name"] == doc["name"]


# -- item 7: the other steps get a cheap check -------------------------------------------------------

def _deepspeed_two_steps(root):
    # a second tag as DeepSpeed writes one (its files, renamed), `latest` naming the newer
    shutil.copytree(root / "global_step2", root / "global_step3")
    (root / "latest").write_text("global_step3")


# fixture -> (prepare, the older step damaged, the file halved)
OLDER = {
    "runs_orbax": (None, "1", lambda root: _first(root / "1" / "default" / "d", "*")),
    "flax_msgpack": (None, "checkpoint_1", lambda root: root / "checkpoint_1"),
    "runs_torchtitan": (None, "step-10", lambda root: root / "step-10" / "__0_0.distcp"),
    "runs_hf_trainer": (lambda root: (root / "checkpoint-6").rename(root / "tmp-checkpoint-6"), "checkpoint-2",
                        lambda root: root / "checkpoint-2" / "model.safetensors"),
    "megatron_run": (None, "iter_0000010", lambda root: root / "iter_0000010" / "__0_0.distcp"),
    NEMO: (None, NEMO_4, lambda root: root / NEMO_4 / "weights" / "__0_0.distcp"),
    "deepspeed_z1_fp32": (_deepspeed_two_steps, "global_step2",
                          lambda root: root / "global_step2" / "mp_rank_00_model_states.pt"),
    "runs_verl": (None, "global_step_2", lambda root: root / "global_step_2" / "actor" / "model_world_size_2_rank_0.pt"),
}


@pytest.mark.parametrize("name", OLDER)
def test_damage_in_another_step_is_a_warning(ckpt, root_of, name):
    prepare, older, victim = OLDER[name]
    root = root_of(name)
    if prepare is not None:
        prepare(root)
    assert ckpt("validate", root).returncode == 0
    _halve(victim(root))
    r = ckpt("validate", root, "--json")
    assert r.returncode == 0, r.stdout
    doc = json.loads(r.stdout)
    assert doc["opened"]["name"] != older
    hits = [f for f in doc["findings"] if f["severity"] == "warning"
            and f["message"].startswith(f"{older} fails validate: ") and "--step all" in f["message"]]
    assert hits and (hits[0]["file"] or "").rstrip("/").endswith(older), doc["findings"]
    assert ckpt("validate", root, "--strict").returncode == 1
    assert ckpt("validate", root, "--step", "all").returncode == 1


def test_the_other_steps_are_checked_at_once(root_of, monkeypatch):
    # the cheap checks of the other steps are in flight together (on an object store each is a few
    # requests), never array data, and the step opened is checked once, as before
    from ckpt_tool.ops import validate as validate_mod

    root = root_of("runs_torchtitan")
    for n in (50, 60):  # more steps: each a copy of one torch's dcp.save wrote
        shutil.copytree(root / "step-30", root / f"step-{n}")
    seen = count_calls(monkeypatch, validate_mod, "_validate_one", hold_s=0.3)
    report = validate_mod.validate_checkpoint(str(root), deep=True)
    assert report.ok()
    calls = [(path, kw["deep"]) for path, kw in seen.calls]
    opened = [c for c in calls if c[0].endswith("step-60")]
    others = [c for c in calls if not c[0].endswith("step-60")]
    assert opened == [(f"{root}/step-60", True)]
    assert sorted(p for p, _ in others) == [f"{root}/step-{n}" for n in (10, 20, 30, 50)]
    assert not any(deep for _, deep in others)  # the cheap check reads no array data, even under --deep
    assert seen.peak >= 2, seen.peak


@pytest.mark.slow
def test_damage_in_another_step_is_a_warning_on_s3(root_of):
    from conftest import moto_s3_serving, run_ckpt

    root = root_of("runs_torchtitan")
    _halve(root / "step-10" / "__0_0.distcp")
    with moto_s3_serving("ckpt-resume", [], trees={"run": root}) as env:
        r = run_ckpt("validate", "s3://ckpt-resume/run", "--json", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert doc["opened"]["name"] == "step-30"
        assert any(f["severity"] == "warning" and f["message"].startswith("step-10 fails validate: ")
                   and "--step all" in f["message"] for f in doc["findings"]), doc["findings"]


# -- fuzz: pointer and tracker files, step-named entries beside a checkpoint -------------------------

def test_run_root_mutants_keep_the_contract(tmp_path):
    # a short seeded run of fuzz_lib's run-root mutators (make fuzz runs many more, as processes)
    import random

    import fuzz_lib as F

    kinds = set()
    for i in range(24):
        work = tmp_path / f"m{i}"
        work.mkdir()
        m = F.make_run_root_mutant(random.Random(f"resume-rules:{i}"), work)
        kinds.add(m.kind)
        outcome = F.evaluate_run_root(m, runner="inprocess")
        assert not outcome.violations, (m.label(), [(v.cls, v.command, v.detail) for v in outcome.violations])
    assert kinds == {"pointer", "step-entry"}


@pytest.mark.parametrize("fixture,text", [("megatron_run", b"99"), ("runs_verl", b""), ("deepspeed_z1_fp32", b"global_step9"),
                                          ("megatron_legacy", b"\xff\xfe"), ("runs_verl", b"4\n6")])
def test_a_pointer_naming_no_step_fails_validate(ckpt, root_of, fixture, text):
    import fuzz_lib as F

    root = root_of(fixture)
    pointer = F.RUN_ROOT_FIXTURES[fixture]
    (root / pointer).write_bytes(text)
    assert F._pointer_target(pointer, text, verl=fixture == "runs_verl") is None or \
        not (root / F._pointer_target(pointer, text, verl=fixture == "runs_verl")).is_dir()
    for args in ((), ("--deep",)):
        r = ckpt("validate", root, *args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
    r = ckpt("latest", root, "--strict")
    assert r.returncode == 1 and r.stdout == ""


def test_latest_from_python_carries_both_picks(root_of):
    import ckpt_tool

    root = root_of("runs_hf_trainer")
    found = ckpt_tool.latest(str(root))
    assert found.path == f"{root}/checkpoint-4" and found.step == 4
    assert found.differs and found.pick is not None and found.pick.name == "checkpoint-6"
    assert found.framework_line().startswith("Hugging Face Trainer would resume from checkpoint-6 (")
    (root / "checkpoint-6").rename(root / "tmp-checkpoint-6")
    found = ckpt_tool.latest(str(root))
    assert not found.differs and found.framework_line() is None and found.pick.name == "checkpoint-4"


@pytest.mark.parametrize("name,remove,explicit", [
    ("megatron_run", "latest_checkpointed_iteration.txt", "--ckpt-step STEP"),
    ("runs_verl", "latest_checkpointed_iteration.txt", "trainer.resume_from_path=PATH"),
    (NEMO, NEMO_9_LAST, "AutoResume(resume_from_path=PATH)"),
])
def test_a_root_the_framework_resumes_nothing_from_says_so(ckpt, root_of, name, remove, explicit):
    # no tracker (Megatron, verl) or no `-last` copy (NeMo): the framework opens no step by itself;
    # validate checks the newest complete one and warns that it must be passed explicitly
    root = root_of(name)
    victim = root / remove
    shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
    r = ckpt("validate", root, "--json")
    assert r.returncode == 0, r.stdout
    doc = json.loads(r.stdout)
    assert doc["opened"]["chosen_by"] == "newest-complete"
    warned = [f for f in doc["findings"] if f["code"] == "missing-metadata" and "would resume from no step" in f["message"]]
    assert warned and explicit in warned[0]["message"], doc["findings"]
    assert ckpt("validate", root, "--strict").returncode == 1
    r = ckpt("latest", root)
    assert r.returncode == 0 and "would resume from no step: " in r.stderr
