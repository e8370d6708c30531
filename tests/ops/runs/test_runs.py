"""Run roots (issue 22 items 1-3, 5): each framework's steps listed with their status by the
writer's rule, the newest one a launcher may resume from, and diff across steps.

The roots are the real writers' (fixtures/gen_runs.py: orbax, torch DCP as torchtitan lays it
out, the transformers Trainer, each with a newest step torn by SIGKILL mid-save; Megatron,
DeepSpeed, Flax and T5X from their generators) or documented layouts (verl, NeMo 2); where the
library installs here, its own answer is the oracle.
"""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import fixture_path

import ckpt_tool
from ckpt_tool.ops import runs
from ckpt_tool.base.errors import NotFoundError
from ckpt_tool.formats import roots

NEMO = "runs_nemo2/checkpoints"
NEMO_9 = "megatron_gpt--val_loss=2.80-step=9-consumed_samples=72.0"
NEMO_14 = "megatron_gpt--val_loss=2.60-step=14-consumed_samples=112.0"

# root -> (layout, [(entry, status)], the entry latest() returns)
ROOTS = {
    "runs_orbax": ("orbax", [("1", "committed"), ("2", "committed"), ("3", "committed"),
                             ("4.orbax-checkpoint-tmp", "in-progress")], "3"),
    "runs_torchtitan": ("torchtitan", [("step-10", "committed"), ("step-20", "committed"),
                                       ("step-30", "committed"), ("step-40", "incomplete")], "step-30"),
    "runs_hf_trainer": ("hf-trainer", [("checkpoint-2", "committed"), ("checkpoint-4", "committed"),
                                       ("checkpoint-6", "incomplete")], "checkpoint-4"),
    "runs_verl": ("verl", [("global_step_2", "committed"), ("global_step_4", "committed"),
                           ("global_step_6", "incomplete")], "global_step_4"),
    NEMO: ("nemo2", [(f"megatron_gpt--val_loss=2.90-step=4-consumed_samples=32.0", "committed"),
                     (NEMO_9, "committed"), (f"{NEMO_9}-last", "committed"), (NEMO_14, "in-progress")],
           f"{NEMO_9}-last"),
    "megatron_run": ("megatron", [("iter_0000010", "committed"), ("iter_0000020", "committed")], "iter_0000020"),
    "deepspeed_z1_fp32": ("deepspeed", [("global_step2", "committed")], "global_step2"),
    "flax_msgpack": ("flax", [("checkpoint_1", "committed"), ("checkpoint_2", "committed")], "checkpoint_2"),
    "t5x": ("t5x", [("checkpoint_1", "committed")], "checkpoint_1"),
    "orbax_manager": ("orbax", [("1", "committed"), ("2", "committed"), ("3.orbax-checkpoint-tmp", "in-progress")], "2"),
}


@pytest.mark.parametrize("name", list(ROOTS))
def test_ls_and_latest_on_each_root(name):
    layout, rows, newest = ROOTS[name]
    root = str(fixture_path(name))
    listing = runs.list_run(root)
    assert listing.layout.name == layout
    assert [(s.name, s.status) for s in listing.steps] == rows
    assert [s.step for s in listing.steps] == sorted(s.step for s in listing.steps)
    for s in listing.steps:
        assert s.size and s.size > 0 and s.files > 0 and s.mtime is not None
        assert (s.reason is None) == (s.status == "committed")
    found = ckpt_tool.latest(root)
    assert found.path == f"{root}/{newest}"
    # every newer step is passed over, saying why
    newer = [n for n, _ in rows[[n for n, _ in rows].index(newest) + 1:]]
    assert [s["name"] for s in found.skipped] == newer[::-1]


def test_listing_reads_nothing_but_the_pointer(monkeypatch):
    """ls without --check: a listing (and the pointer file), no metadata file read."""
    from ckpt_tool.storage import Storage

    read = []
    for method in ("read", "read_range", "read_many", "start_reads"):
        original = getattr(Storage, method)

        def spy(self, key, *args, _original=original, **kw):
            read.append(key)
            return _original(self, key, *args, **kw)

        monkeypatch.setattr(Storage, method, spy)
    for name in ROOTS:
        runs.list_run(str(fixture_path(name)))
    assert sorted(set(read)) == ["latest", "latest_checkpointed_iteration.txt"]


def test_orbax_root_latest_agrees_with_orbax():
    ocp = pytest.importorskip("orbax.checkpoint")
    root = fixture_path("runs_orbax")
    mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
    assert mngr.all_steps() == [1, 2, 3] and mngr.latest_step() == 3  # the torn step 4 is not one
    assert ckpt_tool.latest(str(root)).chosen.step == 3


def test_torchtitan_torn_step_is_what_torch_cannot_load():
    torch_dcp = pytest.importorskip("torch.distributed.checkpoint")
    root = fixture_path("runs_torchtitan")
    torch_dcp.FileSystemReader(str(root / "step-30")).read_metadata()
    with pytest.raises(Exception):
        torch_dcp.FileSystemReader(str(root / "step-40")).read_metadata()
    assert ckpt_tool.latest(str(root)).chosen.step == 30


def test_hf_trainer_get_last_checkpoint_takes_the_torn_one():
    """transformers' own get_last_checkpoint picks checkpoint-6, whose trainer_state.json the Trainer
    never wrote (resuming from it fails); latest() returns checkpoint-4."""
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    from transformers import TrainerState

    root = fixture_path("runs_hf_trainer")
    assert trainer_utils.get_last_checkpoint(str(root)).endswith("checkpoint-6")
    with pytest.raises(FileNotFoundError):
        TrainerState.load_from_json(str(root / "checkpoint-6" / "trainer_state.json"))
    assert TrainerState.load_from_json(str(root / "checkpoint-4" / "trainer_state.json")).global_step == 4
    assert ckpt_tool.latest(str(root)).path.endswith("checkpoint-4")


def test_pointer_files_and_agreement():
    listing = runs.list_run(str(fixture_path("runs_verl")))
    assert (listing.pointer_file, listing.pointer_names, listing.pointer_problem) == (
        "latest_checkpointed_iteration.txt", "global_step_4", None)
    by = {s.name: s for s in listing.steps}
    assert by["global_step_4"].pointer and by["global_step_4"].pointer_agrees
    assert by["global_step_6"].pointer_agrees is True  # newer, but incomplete: the pointer is right
    assert by["global_step_2"].pointer_agrees is None


def test_megatron_step_newer_than_the_tracker_is_in_progress(copy_fixture):
    root = copy_fixture("megatron_run")
    shutil.copytree(root / "iter_0000020", root / "iter_0000030")  # complete files, tracker still at 20
    shutil.copytree(root / "iter_0000020", root / "iter_0000040", ignore=shutil.ignore_patterns("metadata.json"))
    listing = runs.list_run(str(root))
    by = {s.name: s for s in listing.steps}
    assert by["iter_0000030"].status == "in-progress" and "newer than latest_checkpointed_iteration.txt" in by["iter_0000030"].reason
    assert by["iter_0000030"].pointer_agrees is False  # complete files beyond the pointer
    assert by["iter_0000040"].status == "incomplete" and "metadata.json" in by["iter_0000040"].reason
    assert by["iter_0000020"].pointer and not by["iter_0000020"].pointer_agrees
    assert ckpt_tool.latest(str(root)).path == f"{root}/iter_0000020"


def test_pointer_target_failing_validate_is_reported_not_returned(copy_fixture):
    root = copy_fixture("megatron_run")
    victim = root / "iter_0000020" / "__1_1.distcp"
    victim.write_bytes(victim.read_bytes()[:100])  # truncated: its chunks run past the end
    found = ckpt_tool.latest(str(root))
    assert found.path == f"{root}/iter_0000010"
    [skipped] = found.skipped
    assert skipped["name"] == "iter_0000020" and skipped["pointer"] and skipped["status"] == "fails validate"
    assert "__1_1.distcp" in skipped["reason"]


def test_deepspeed_latest_tag_rules(copy_fixture):
    root = copy_fixture("deepspeed_z1_fp32")
    shutil.copytree(root / "global_step2", root / "global_step3")  # saved, but `latest` not moved yet
    listing = runs.list_run(str(root))
    assert [(s.name, s.status) for s in listing.steps] == [("global_step2", "committed"), ("global_step3", "in-progress")]
    assert ckpt_tool.latest(str(root)).path.endswith("global_step2")
    (root / "latest").write_text("global_step9")
    listing = runs.list_run(str(root))
    assert listing.pointer_problem == "names global_step9, which is not a step here"
    # no usable pointer: the files decide
    assert [s.status for s in listing.steps] == ["committed", "committed"]
    assert ckpt_tool.latest(str(root)).path.endswith("global_step3")


def test_no_step_qualifies(copy_fixture):
    root = copy_fixture("runs_torchtitan")
    for step in ("step-10", "step-20", "step-30"):
        (root / step / ".metadata").unlink()
    found = ckpt_tool.latest(str(root))
    assert found.path is None and [s["status"] for s in found.skipped] == ["incomplete"] * 4


def test_not_a_run_root():
    with pytest.raises(NotFoundError, match="not a run root"):
        runs.list_run(str(fixture_path("dcp_single")))


def test_check_validates_each_step():
    listing = runs.list_run(str(fixture_path("runs_torchtitan")), check=True)
    checks = {s.name: s.check for s in listing.steps}
    assert all(checks[f"step-{n}"]["ok"] for n in (10, 20, 30))
    assert not checks["step-40"]["ok"] and checks["step-40"]["first"].startswith("missing-metadata")


def test_latest_deep_decodes(copy_fixture):
    root = copy_fixture("runs_torchtitan")
    torch_dcp = pytest.importorskip("torch.distributed.checkpoint")
    import torch

    state = {"model": {"0.weight": torch.empty(16, 8)}}
    torch_dcp.load(state, checkpoint_id=str(root / "step-30"))
    data = root / "step-30" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    at = raw.find(state["model"]["0.weight"].numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 0x01  # one flipped bit in a weight: DCP's torch.save archives carry CRC-32s
    data.write_bytes(bytes(raw))
    assert ckpt_tool.latest(str(root)).chosen.name == "step-30"  # shallow: sizes and metadata agree
    deep = ckpt_tool.latest(str(root), deep=True)
    assert deep.chosen.name == "step-20" and deep.skipped[-1]["name"] == "step-30"


def test_every_layout_is_in_the_run_roots_table():
    from conftest import ROOT

    section = (ROOT / "docs" / "run-roots.md").read_text()
    for layout in roots.LAYOUTS:
        assert f"| {layout.title} |" in section, layout.title


def test_every_layout_has_its_rules_through_the_registry():
    """A layout's rules are its own or those of the one format package whose FormatInfo.run_roots
    names it (roots.py imports no format package: tests/imports/test_import_layers.py)."""
    from ckpt_tool.core import contract
    from ckpt_tool.formats import registered

    names = [layout.name for layout in roots.LAYOUTS]
    for info in registered():
        assert set(info.run_roots) <= set(names), info.name
    for layout in roots.LAYOUTS:
        holders = [info.name for info in registered() if layout.name in info.run_roots]
        assert len(holders) == (0 if layout.rules is not None else 1), (layout.name, holders)
        assert isinstance(roots.rules_of(layout, registered()), contract.RunRules), layout.name
        assert roots.rules_of(layout, []) is (layout.rules if layout.rules is not None else None)


# -- diff and validate across steps ------------------------------------------------------------

# root -> (step A, step B)
STEP_PAIRS = {
    "runs_orbax": ("1", "3"), "runs_torchtitan": ("10", "30"), "runs_hf_trainer": ("2", "4"),
    "runs_verl": ("2", "4"), NEMO: ("4", "9"), "megatron_run": ("10", "20"),
    "deepspeed_z1_fp32": ("2", "global_step2"), "flax_msgpack": ("1", "2"), "t5x": ("1", "1"),
}


@pytest.mark.parametrize("name", list(STEP_PAIRS))
def test_diff_across_steps_of_every_root(ckpt, name):
    a, b = STEP_PAIRS[name]
    root = str(fixture_path(name))
    r = ckpt("diff", root, "--step-a", a, "--step-b", b, "--json")
    assert r.returncode in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    assert doc["compared"] > 0 and "error" not in doc, doc
    if a == b or name == "deepspeed_z1_fp32":
        assert doc["same"]


def test_diff_steps_values_differ_and_latest_step(ckpt):
    root = str(fixture_path("runs_torchtitan"))
    r = ckpt("diff", root, "--step-a", "10", "--step-b", "latest", "--values")
    assert r.returncode == 1 and "model/0.weight: 128 of 128" in r.stdout  # trained between steps 10 and 30
    assert "train_state/step: 10 != 30" in r.stdout  # latest: step-30 (step-40 is torn)
    r = ckpt("diff", root, "--step-a", "30", "--step-b", "step-30", "--values")
    assert r.returncode == 0, r.stdout + r.stderr
    r = ckpt("diff", root, "--step-a", "40", "--step-b", "30")
    assert r.returncode == 1 and "step-40" in r.stderr and ".metadata" in r.stderr  # the torn step: one line
    r = ckpt("diff", root, "--step-a", "99", "--step-b", "30")
    assert r.returncode == 1 and "--step 99: no such step" in r.stderr  # not-found, as on every root


@pytest.mark.parametrize("name,step", [("megatron_run", "10"), ("deepspeed_z1_fp32", "2"), ("runs_orbax", "2"),
                                       ("flax_msgpack", "1")])
def test_validate_one_step_of_a_root(ckpt, name, step):
    r = ckpt("validate", str(fixture_path(name)), "--step", step, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["ok"]


def test_temporary_names_of_each_writer(copy_fixture, tmp_path):
    """What each writer leaves while a save is under way: listed as in progress, never returned."""
    flax = copy_fixture("flax_msgpack")
    shutil.copy(flax / "checkpoint_2", flax / "checkpoint_tmp")  # flax writes checkpoint_tmp, then renames it
    listing = runs.list_run(str(flax))
    assert [(s.name, s.step, s.status) for s in listing.steps][-1] == ("checkpoint_tmp", None, "in-progress")
    assert ckpt_tool.latest(str(flax)).path.endswith("checkpoint_2")

    t5x = copy_fixture("t5x")
    shutil.copytree(t5x / "checkpoint_1", t5x / "checkpoint_2.tmp-1700000000")  # t5x's staging directory
    shutil.copytree(t5x / "checkpoint_1", t5x / "checkpoint_3", ignore=shutil.ignore_patterns("checkpoint"))
    listing = runs.list_run(str(t5x))
    assert [(s.name, s.status) for s in listing.steps] == [
        ("checkpoint_1", "committed"), ("checkpoint_2.tmp-1700000000", "in-progress"), ("checkpoint_3", "incomplete")]
    assert ckpt_tool.latest(str(t5x)).path.endswith("checkpoint_1")

    hf = copy_fixture("runs_hf_trainer")
    shutil.copytree(hf / "checkpoint-4", hf / "tmp-checkpoint-8")  # transformers 4.36's staged save
    by = {s.name: s for s in runs.list_run(str(hf)).steps}
    assert by["tmp-checkpoint-8"].status == "in-progress" and by["tmp-checkpoint-8"].step == 8

    megatron = copy_fixture("megatron_run")
    (megatron / "latest_checkpointed_iteration.txt").write_text("not a number")
    listing = runs.list_run(str(megatron))
    assert listing.pointer_problem == "'not a number' is not an iteration number (or 'release')"
    assert [s.status for s in listing.steps] == ["committed", "committed"]  # the files decide then


def test_step_path_resolves_names_numbers_and_latest():
    root = str(fixture_path("runs_verl"))
    assert runs.step_path(root, "4") == (f"{root}/global_step_4/actor", None)
    assert runs.step_path(root, "global_step_2") == (f"{root}/global_step_2/actor", None)
    assert runs.step_path(root, "latest") == (f"{root}/global_step_4/actor", None)
    nemo = str(fixture_path(NEMO))
    assert runs.step_path(nemo, "9")[0] == f"{nemo}/{NEMO_9}"  # the step's own directory before its -last copy
    megatron = str(fixture_path("megatron_run"))
    assert runs.step_path(megatron, "10") == (megatron, 10)  # the root, at the step the table found
    single = str(fixture_path("dcp_single"))
    assert runs.step_path(single, "3") == (single, "3")  # not a run root: the reader says what --step means


def test_deepspeed_tag_of_any_name(copy_fixture):
    root = copy_fixture("deepspeed_z1_fp32")
    shutil.copytree(root / "global_step2", root / "best")  # save_checkpoint(tag="best")
    (root / "latest").write_text("best")
    listing = runs.list_run(str(root))
    assert [(s.name, s.step, s.pointer) for s in listing.steps] == [("global_step2", 2, False), ("best", None, True)]
    assert ckpt_tool.latest(str(root)).path == f"{root}/best"
