"""Run roots behave alike on every framework (issue 30 items 1 and 6).

Without --step, inspect, validate, diff and convert open the step the framework resumes from
(its pointer file's, else the newest complete one by its writer's rule) and say which in their
output (inspect's `opened` header row, validate's, diff's and convert's first line) and in --json's
`opened`, never on stderr: a command that fails prints its one error line alone. A step that is not
there is the same not-found line, exit 1, on every root; a torn step has one state name (committed
/ incomplete / in-progress) in ls, inspect, validate and their --json, and validate of the root
warns about it (exit 0) while `--step all` checks every step.

The roots are the committed fixtures written by the real libraries (fixtures/gen_runs.py and the
per-format generators), copied into tmp_path and torn the way each writer leaves a killed save.
"""
from __future__ import annotations

import json
import shutil

import pytest

NEMO = "runs_nemo2/checkpoints"
NEMO_9_LAST = "megatron_gpt--val_loss=2.80-step=9-consumed_samples=72.0-last"


def _flax(root):
    shutil.copy(root / "checkpoint_2", root / "checkpoint_tmp")  # flax writes it, then renames it


def _t5x(root):
    # checkpoint_2/ of a save killed before its `checkpoint` tree file (written last)
    shutil.copytree(root / "checkpoint_1", root / "checkpoint_2", ignore=shutil.ignore_patterns("checkpoint"))


def _megatron(root):
    # iter 30 killed before rank 0's metadata.json; the tracker, moved after a save, still says 20
    shutil.copytree(root / "iter_0000020", root / "iter_0000030", ignore=shutil.ignore_patterns("metadata.json"))


def _hf(root):
    # transformers' staged save (tmp-checkpoint-N/, renamed when written), killed: get_last_checkpoint
    # does not match it. (A torn checkpoint-6/ itself is the step the Trainer resumes from, and
    # validate of the root fails on it: tests/ops/runs/test_resume_rules.py.)
    (root / "checkpoint-6").rename(root / "tmp-checkpoint-6")


def _deepspeed(root):
    # a tag directory with one rank's optimizer file and no model states; `latest` still global_step2
    (root / "global_step3").mkdir()
    shutil.copy(root / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", root / "global_step3")


# fixture -> (how to tear its newest step, the torn entry, its state, the entry opened by default)
ROOTS = {
    "runs_orbax": (None, "4.orbax-checkpoint-tmp", "in-progress", "3"),
    "flax_msgpack": (_flax, "checkpoint_tmp", "in-progress", "checkpoint_2"),
    "t5x": (_t5x, "checkpoint_2", "incomplete", "checkpoint_1"),
    "runs_torchtitan": (None, "step-40", "incomplete", "step-30"),
    "runs_hf_trainer": (_hf, "tmp-checkpoint-6", "in-progress", "checkpoint-4"),
    "megatron_run": (_megatron, "iter_0000030", "incomplete", "iter_0000020"),
    NEMO: (None, "megatron_gpt--val_loss=2.60-step=14-consumed_samples=112.0", "in-progress", NEMO_9_LAST),
    "deepspeed_z1_fp32": (_deepspeed, "global_step3", "incomplete", "global_step2"),
    "runs_verl": (None, "global_step_6", "incomplete", "global_step_4"),
}


@pytest.fixture
def torn_root(tmp_path):
    def make(name: str):
        from conftest import fixture_path

        root = tmp_path / name.replace("/", "_")
        shutil.copytree(fixture_path(name), root, symlinks=True)
        tear = ROOTS[name][0]
        if tear is not None:
            tear(root)
        return root

    return make


def _opened_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("opened ")]
    assert len(lines) == 1, stdout
    return lines[0]


def _inspect_opened_row(stdout: str) -> str:
    return next(line.strip() for line in stdout.splitlines() if line.strip().startswith("opened "))


@pytest.mark.parametrize("name", ROOTS)
def test_inspect_and_validate_open_the_newest_complete_step_and_say_so(ckpt, torn_root, name):
    _, torn, _, opened = ROOTS[name]
    root = torn_root(name)
    r = ckpt("inspect", root)
    assert r.returncode == 0 and r.stderr == "", (r.stdout, r.stderr)
    assert _inspect_opened_row(r.stdout).startswith(f"opened      {opened} (")
    r = ckpt("validate", root)
    assert r.returncode == 0 and r.stderr == "", (r.stdout, r.stderr)
    assert r.stdout.splitlines()[0].startswith(f"opened {opened} of {root} (")
    for command in ("inspect", "validate"):
        r = ckpt(command, root, "--json")
        assert r.returncode == 0, (command, r.stdout, r.stderr)
        doc = json.loads(r.stdout)
        assert doc["ok"] and doc["opened"]["name"] == opened and doc["opened"]["status"] == "committed"
        assert doc["opened"]["chosen_by"] in ("newest-complete", "pointer")
    # --step latest is the same step
    r = ckpt("inspect", root, "--step", "latest", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["opened"]["name"] == opened


@pytest.mark.parametrize("name", ROOTS)
def test_a_missing_step_is_the_same_line_and_exit_on_every_root(ckpt, torn_root, name):
    root = torn_root(name)
    for command in ("inspect", "validate"):
        r = ckpt(command, root, "--step", "99")
        assert r.returncode == 1, (command, r.stdout, r.stderr)
        assert r.stderr.startswith(f"ckpt: error: {root}: --step 99: no such step (steps: "), r.stderr
        r = ckpt(command, root, "--step", "99", "--json")
        assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "not-found"


@pytest.mark.parametrize("name", ROOTS)
def test_one_state_name_for_the_torn_step(ckpt, torn_root, name):
    _, torn, state, _ = ROOTS[name]
    root = torn_root(name)
    r = ckpt("ls", root, "--json")
    assert r.returncode == 0, r.stderr
    assert {s["name"]: s["status"] for s in json.loads(r.stdout)["steps"]}[torn] == state
    for command in ("inspect", "validate"):
        doc = json.loads(ckpt(command, root, "--json").stdout)
        assert {s["name"]: s["status"] for s in doc["opened"]["steps"]}[torn] == state
    r = ckpt("inspect", root)
    steps_row = next(line for line in r.stdout.splitlines() if line.strip().startswith("steps "))
    assert f"{torn} ({state})" in steps_row
    assert f"{torn} is {state}: " in _inspect_opened_row(r.stdout)  # the newest step passed over, by its state
    # validate of the root: the step opened is checked, the torn one is a warning naming its state
    doc = json.loads(ckpt("validate", root, "--json").stdout)
    assert doc["ok"] and any(f["severity"] == "warning" and (f["file"] or "").rstrip("/").endswith(torn)
                             for f in doc["findings"]), doc["findings"]


def test_missing_step_message_never_suggests_a_torn_step(ckpt, torn_root):
    root = torn_root("runs_torchtitan")
    for n in (10, 20, 30):
        (root / f"step-{n}" / ".metadata").unlink()
    r = ckpt("inspect", root)
    # nothing complete to open: exit 1, one line, naming the torn step only as torn
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"ckpt: error: {root}: no complete step to open (step-40 is incomplete: no .metadata: DCP "
                        "writes it last, once every rank's .distcp is written); `ckpt ls` lists the steps, "
                        "--step N opens one anyway\n")


def test_an_explicit_torn_step_opens_and_says_its_state(ckpt, torn_root):
    root = torn_root("runs_torchtitan")
    r = ckpt("validate", root, "--step", "40", "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["opened"]["name"] == "step-40" and doc["opened"]["status"] == "incomplete"
    assert "it is incomplete: no .metadata" in doc["opened"]["line"] and r.stderr == ""
    r = ckpt("validate", root, "--step", "40")
    assert r.returncode == 1 and r.stderr == ""
    assert "it is incomplete: no .metadata" in _opened_line(r.stdout)


@pytest.mark.parametrize("name,pointer,text", [("megatron_run", "latest_checkpointed_iteration.txt", "30"),
                                               ("deepspeed_z1_fp32", "latest", "global_step3")])
def test_a_pointer_naming_a_torn_step_opens_it_as_the_framework_would(ckpt, torn_root, name, pointer, text):
    # Megatron's load_checkpoint and DeepSpeed's load_checkpoint open what the pointer names, and
    # fail there: ckpt opens the same step and says it is torn (validate fails: exit 1)
    root = torn_root(name)
    (root / pointer).write_text(text)
    torn = ROOTS[name][1]
    r = ckpt("validate", root)
    assert r.returncode == 1 and r.stderr == "", r.stdout + r.stderr
    line = _opened_line(r.stdout)
    assert line.startswith(f"opened {torn} of {root} (named by {pointer}, the step ")
    assert f"it is incomplete: " in line and f"the newest complete step is {ROOTS[name][3]}" in line


def test_diff_and_convert_open_the_default_step(ckpt, torn_root, tmp_path):
    root = torn_root("runs_torchtitan")
    r = ckpt("diff", root, root / "step-30", "--values")
    assert r.returncode == 0 and r.stdout.startswith("same: "), r.stdout + r.stderr
    # diff's stdout is the differences and the verdict: the step is said on stderr once it is done
    assert r.stderr.startswith(f"ckpt: opened step-30 of {root} (") and len(r.stderr.splitlines()) == 1
    doc = json.loads(ckpt("diff", root, root / "step-20", "--json").stdout)
    assert doc["opened"]["a"]["name"] == "step-30" and doc["opened"]["b"] is None
    hf = torn_root("runs_hf_trainer")
    out = tmp_path / "out"
    r = ckpt("convert", hf, out, "--to", "safetensors")
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert _opened_line(r.stdout).startswith(f"opened checkpoint-4 of {hf} (")
    r = ckpt("diff", out, hf / "checkpoint-4", "--values")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", ROOTS)
def test_validate_step_all_checks_every_step_on_every_root(ckpt, torn_root, name):
    # (was a usage error, exit 2, on torchtitan, HF Trainer, NeMo 2 and verl roots)
    _, torn, _, _ = ROOTS[name]
    root = torn_root(name)
    r = ckpt("validate", root, "--step", "all", "--json")
    assert r.returncode in (0, 1) and r.stderr == "", (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    steps = json.loads(ckpt("ls", root, "--json").stdout)["steps"]
    # every complete step checked (the readers' own counts differ on steps still being written;
    # Flax's counts files)
    complete = sum(s["status"] == "committed" for s in steps)
    assert doc["checked"].get("steps", doc["checked"].get("files")) >= complete, doc["checked"]
    assert any((f["file"] or "").startswith(torn) for f in doc["findings"]), doc["findings"]
    assert not any(f["code"] == "no-steps" for f in doc["findings"]), doc["findings"]  # 'all' is understood


@pytest.mark.parametrize("name,older", [("runs_torchtitan", "step-10/__0_0.distcp"),
                                        ("runs_hf_trainer", "checkpoint-2/model.safetensors"),
                                        ("runs_verl", "global_step_2/actor/model_world_size_2_rank_0.pt")])
def test_damage_in_an_older_step_is_found_by_step_all_only(ckpt, torn_root, name, older):
    # validate ROOT checks the step a resume opens; --step all finds a damaged older one too
    root = torn_root(name)
    victim = root / older
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert ckpt("validate", root).returncode == 0
    r = ckpt("validate", root, "--step", "all", "--json")
    assert r.returncode == 1, r.stdout
    rel = victim.relative_to(root).as_posix()
    assert any(f["severity"] == "error" and f["file"] == rel for f in json.loads(r.stdout)["findings"]), (rel, r.stdout)


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_step_that_fails_to_open_is_one_error_line_alone(ckpt, torn_root, tmp_path, command):
    # the step opened by default is named by the error line itself, never in a second line
    root = torn_root("flax_msgpack")
    data = (root / "checkpoint_2").read_bytes()
    (root / "checkpoint_2").write_bytes(b"\x81\x01" + data[1:])  # a map whose first key is an int
    args = [tmp_path / "out", "--to", "safetensors"] if command == "convert" else []
    r = ckpt(command, root, *args)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    [line] = r.stderr.splitlines()
    assert line.startswith(f"ckpt: error: {root}/checkpoint_2: ") and "opened" not in line
    # validate: a finding about the step it opened (stdout), nothing on stderr
    r = ckpt("validate", root)
    assert r.returncode == 1 and r.stderr == "" and r.stdout.startswith("opened checkpoint_2 of ")
    assert "error bad-metadata: unreadable msgpack: map key at byte 1 is an int" in r.stdout


def test_an_empty_step_is_a_usage_error(ckpt, torn_root):
    root = torn_root("runs_torchtitan")
    r = ckpt("inspect", root, "--step", "")
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        "Error: --step '': empty; give a step number, a step's name or 'latest'")
