"""Issue 45 item 10: the smaller things a new user trips on, each on inputs the real libraries wrote
(the committed fixtures, safetensors/torch written here) or a real ckpt run (a SIGKILLed convert).

1. an empty DST directory (made with `mkdir` first) is written into without --overwrite;
2. `ckpt ls PARENT` names each stale temporary output of a dead convert, its size and the command
   that removes it (a live owner's is not stale);
3. inspect/validate/diff headers show a path as the user typed it;
4. a DCP listing names the other files beside it, as safetensors and torch.save listings do;
5. `inspect --flat` lists leaves in the tree's order (sorted), DCP's included;
6. a folder of one torch.save file plus notes names the file;
7. validate's counts of arrays and values are inspect's;
8. `--step N` on one DCP checkpoint says that it is one checkpoint, not a root of steps;
9. a directory whose one sub-directory is a run root (a NeMo experiment directory) names it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    convert_until_owner_record,
    empty_dst_filled_meanwhile,
    fixture_path,
)


def _one_line(r) -> str:  # noqa: ANN001 - the ckpt fixture's result
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1, (r.returncode, r.stdout, r.stderr)
    return lines[0]


# -- 1. an empty DST directory ------------------------------------------------------------


def test_convert_into_an_empty_directory_needs_no_overwrite(tmp_path, ckpt):
    dst = tmp_path / "out"
    dst.mkdir()  # what people do first
    r = ckpt("convert", fixture_path("dcp_single"), dst, "--to", "dcp")
    assert r.returncode == 0, r.stderr
    assert "replaced" not in r.stdout  # nothing was replaced: the empty directory was written into
    assert (dst / ".metadata").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left beside it
    r = ckpt("validate", dst)
    assert r.returncode == 0, r.stdout + r.stderr
    # torch's own reader loads what was written, equal to what torch wrote in the fixture
    import torch
    import torch.distributed.checkpoint as dcp

    def load(path: Path) -> torch.Tensor:
        state = {"model": {"embed": {"weight": torch.empty(16, 8)}}}
        dcp.load(state, checkpoint_id=str(path))
        return state["model"]["embed"]["weight"]

    assert torch.equal(load(dst), load(fixture_path("dcp_single")))


def test_reshard_into_an_empty_directory_needs_no_overwrite(tmp_path, ckpt):
    dst = tmp_path / "resharded"
    dst.mkdir()
    r = ckpt("reshard", fixture_path("orbax_ocdbt_zarr2"), dst, "--mesh", "data=2", "--devices", "2")  # orbax wrote it
    assert r.returncode == 0, r.stderr
    assert (dst / "_CHECKPOINT_METADATA").is_file() and [p.name for p in tmp_path.iterdir()] == ["resharded"]
    assert ckpt("validate", dst).returncode == 0


def test_a_directory_that_is_not_empty_is_still_refused(tmp_path, ckpt):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine\n")
    line = _one_line(ckpt("convert", fixture_path("dcp_single"), dst, "--to", "dcp"))
    assert "destination exists" in line and "notes.txt" in line, line
    assert [p.name for p in dst.iterdir()] == ["notes.txt"]


def test_a_file_written_into_the_empty_directory_meanwhile_is_never_lost(tmp_path):
    """The rename onto the empty directory fails if anything appeared in it while the run wrote."""
    from ckpt_tool.ops.engine import ConvertOptions, convert
    from ckpt_tool.base.errors import CkptError

    dst, progress = empty_dst_filled_meanwhile(tmp_path)
    with pytest.raises(CkptError, match="destination appeared while converting"):
        convert(str(fixture_path("dcp_single")), str(dst), ConvertOptions(to="dcp"), progress=progress)
    assert [p.name for p in dst.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# -- 2. stale temporaries in `ckpt ls PARENT` -----------------------------------------------


def _started_convert(src: Path, dst: Path) -> tuple[subprocess.Popen, Path]:
    """A real convert into `dst`, stopped (SIGSTOP: alive) once its temporary output holds its owner record."""
    proc, temp = convert_until_owner_record(src, dst)
    if temp is None:
        proc.kill()
        raise AssertionError("the convert ended before it could be stopped")
    time.sleep(0.05)  # a few chunks in
    proc.send_signal(signal.SIGSTOP)
    return proc, temp


def test_ls_of_the_parent_names_a_killed_converts_temporary_and_how_to_remove_it(tmp_path, big_safetensors, ckpt):
    parent = tmp_path / "exports"
    parent.mkdir()
    proc, temp = _started_convert(big_safetensors, parent / "model")
    try:
        # its owner still runs (stopped, not dead): not stale, and a plain directory is no run root
        r = ckpt("ls", parent)
        assert r.returncode == 1 and "not a run root" in r.stderr and temp.name not in r.stdout + r.stderr, r
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.send_signal(signal.SIGCONT)
        proc.wait()
    assert temp.is_dir() and not (parent / "model").exists()
    size = sum(p.stat().st_size for p in temp.rglob("*") if p.is_file())

    r = ckpt("ls", parent)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{parent}  (not a run root; 1 stale temporary output)"), r.stdout
    named = [i for i, line in enumerate(lines) if temp.name in line and "rm -rf" not in line]
    assert len(named) == 1, r.stdout
    row = lines[named[0]]
    assert f"pid {proc.pid}" in row and "no longer running" in row, row
    command = lines[named[0] + 1].strip()
    assert command == f"rm -rf -- '{temp}'", command

    r = ckpt("ls", parent, "--json")
    assert r.returncode == 0, r.stderr
    (entry,) = json.loads(r.stdout)["stale_temporaries"]
    assert entry["name"] == temp.name and entry["bytes"] == size and entry["owner"]["pid"] == proc.pid
    assert entry["remove"] == command

    # the command does what it says, in a shell, and nothing else
    (parent / "notes.txt").write_text("mine\n")
    subprocess.run(["sh", "-c", command], check=True)
    assert sorted(p.name for p in parent.iterdir()) == ["notes.txt"]
    assert ckpt("ls", parent).returncode == 1  # back to: not a run root, nothing stale


def test_ls_of_a_run_root_names_its_stale_temporaries_below_the_table(tmp_path, big_safetensors, ckpt):
    run = tmp_path / "run"
    shutil.copytree(fixture_path("runs_orbax"), run)  # orbax's CheckpointManager wrote it
    proc, temp = _started_convert(big_safetensors, run / "7")
    proc.send_signal(signal.SIGKILL)
    proc.send_signal(signal.SIGCONT)
    proc.wait()
    r = ckpt("ls", run)
    assert r.returncode == 0, r.stderr
    assert "Orbax CheckpointManager" in r.stdout.splitlines()[0]
    assert "1 stale temporary output" in r.stdout and f"rm -rf -- '{temp}'" in r.stdout, r.stdout
    listing = json.loads(ckpt("ls", run, "--json").stdout)
    assert [t["name"] for t in listing["stale_temporaries"]] == [temp.name]
    assert temp.name not in [s["name"] for s in listing["steps"]]


# -- 3. paths as typed ----------------------------------------------------------------------


@pytest.fixture
def typed_files(tmp_path, monkeypatch) -> Path:
    """A torch.save file and a safetensors file, each written by its library, in the working directory."""
    import torch
    from safetensors.numpy import save_file

    sub = tmp_path / "sub"
    sub.mkdir()
    torch.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 3}, str(sub / "model.pt"))
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(sub / "x.safetensors"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("typed", ["sub/model.pt", "sub/x.safetensors", "./sub/model.pt", "sub"])
def test_headers_show_the_path_as_typed(typed_files, typed, ckpt, monkeypatch):
    if typed == "sub":
        os.remove("sub/x.safetensors")  # a directory of one torch.save file
    r = ckpt("inspect", typed)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == typed
    assert json.loads(ckpt("inspect", typed, "--json").stdout)["path"] == typed
    r = ckpt("validate", typed)
    assert r.returncode == 0 and r.stdout.splitlines()[0].split("  (")[0] == typed, r.stdout
    assert json.loads(ckpt("validate", typed, "--json").stdout)["path"] == typed
    doc = json.loads(ckpt("diff", typed, typed, "--json").stdout)
    assert (doc["a"], doc["b"]) == (typed, typed)
    # a bare name in its own directory: neither absolute nor `./name`
    monkeypatch.chdir("sub")
    name = os.path.basename(typed) if typed != "sub" else "model.pt"
    assert ckpt("inspect", name).stdout.splitlines()[0] == name
    assert ckpt("validate", name).stdout.splitlines()[0].split("  (")[0] == name


# -- 4-6. listings --------------------------------------------------------------------------


def test_a_dcp_listing_names_the_other_files(tmp_path, ckpt):
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_path("dcp_single"), src)  # torch's dcp.save wrote it
    r = ckpt("inspect", src)
    assert "other files" not in r.stdout
    (src / "notes.txt").write_text("lr sweep 3\n")
    (src / "train.log").write_text("...\n")
    r = ckpt("inspect", src)
    assert r.returncode == 0, r.stderr
    notes = [line.split("note", 1)[1].strip() for line in r.stdout.splitlines() if line.strip().startswith("note")]
    assert notes == ["other files (ignored): notes.txt, train.log"], r.stdout
    assert json.loads(ckpt("inspect", src, "--json").stdout)["layout"]["ignored"] == ["notes.txt", "train.log"]


@pytest.fixture(scope="module")
def dcp_out_of_order(tmp_path_factory) -> Path:
    """A DCP checkpoint torch's dcp.save wrote from a state dict in no sorted order, 12 layers."""
    import torch
    import torch.distributed.checkpoint as dcp

    layers = {str(i): {"w": torch.full((2,), float(i))} for i in (11, 2, 10, 0, 1)}
    state = {"optim": {"step": torch.tensor(3)}, "model": {"layers": layers, "embed": {"weight": torch.zeros(3, 2)}}}
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    dcp.save(state, checkpoint_id=str(path))
    return path


def _flat_paths(stdout: str) -> list[str]:
    return [line.split()[0] for line in stdout.splitlines() if line and not line.startswith(" ")][1:]


def test_inspect_flat_lists_dcp_leaves_sorted_as_the_tree(dcp_out_of_order, ckpt):
    r = ckpt("inspect", dcp_out_of_order, "--flat")
    assert r.returncode == 0, r.stderr
    assert _flat_paths(r.stdout) == [
        "model/embed/weight", "model/layers/0/w", "model/layers/1/w", "model/layers/2/w", "model/layers/10/w",
        "model/layers/11/w", "optim/step"], r.stdout
    # the tree lists them in the same order
    text = ckpt("inspect", dcp_out_of_order).stdout
    tree = [line.split()[0] for line in text.split("\n\n", 1)[1].splitlines()[1:]]
    assert [k for k in tree if k.isdigit()] == ["0", "1", "2", "10", "11"], tree
    # the fixture's state dict order (model, then step, lr, ...) comes out sorted too, in the tree's order
    flat = _flat_paths(ckpt("inspect", fixture_path("dcp_single"), "--flat").stdout)
    assert flat[0] == "extra/done" and flat[-1] == "step" and flat.index("model/layers/0/b") < flat.index("model/layers/1/w")
    tree_order = sorted(flat, key=lambda p: [(not k.isdigit(), int(k) if k.isdigit() else 0, k) for k in p.split("/")])
    assert flat == tree_order


def test_a_folder_of_one_torch_file_and_notes_names_the_file(tmp_path, ckpt):
    import torch

    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"w": torch.ones(2, 2)}, str(folder / "final.pt"))
    (folder / "notes.md").write_text("# best run\n")
    r = ckpt("inspect", folder)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split() == ["format", "torch.save", "(final.pt)"], r.stdout
    assert "other files (ignored): notes.md" in r.stdout


# -- 7. validate's counts are inspect's -------------------------------------------------------


@pytest.mark.parametrize("name", ["orbax_plain_zarr2", "orbax_ocdbt_zarr2", "orbax_manager", "orbax_v0_11/standard",
                                  "flax_msgpack", "flax_orbax", "t5x", "orbax_v0_4_manager", "orbax_v0_4_plain"])
def test_validate_counts_arrays_and_values_as_inspect_does(name, ckpt):
    listed = json.loads(ckpt("inspect", fixture_path(name), "--json").stdout)["summary"]
    r = ckpt("validate", fixture_path(name), "--json")
    assert r.returncode == 0, r.stdout
    checked = json.loads(r.stdout)["checked"]
    assert (checked.get("arrays", 0), checked.get("values", 0)) == (listed["arrays"], listed["values"]), checked
    assert "leaves" not in checked  # (one count of each kind, not a third)


# -- 8. --step on one DCP checkpoint ------------------------------------------------------------


def test_step_on_one_dcp_checkpoint_says_it_is_one_checkpoint(ckpt):
    for command in ("inspect", "convert"):
        args = (command, fixture_path("dcp_single")) + (("/tmp/never-written", "--to", "dcp") if command == "convert" else ())
        r = ckpt(*args, "--step", "5")
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "--step 5 given, but this is one torch.distributed.checkpoint (DCP) checkpoint, not a run root of steps" \
            in r.stderr and "open the step's own directory" not in r.stderr, r.stderr
    assert not Path("/tmp/never-written").exists()
    # a safetensors directory said the same as DCP did: the same words as DCP's now
    r = ckpt("inspect", fixture_path("safetensors_numpy"), "--step", "5")  # safetensors' numpy API wrote it
    assert r.returncode == 2 and "this is one safetensors checkpoint, not a run root of steps" in r.stderr, r.stderr


# -- 9. a run root one level down ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_a_nemo_experiment_directory_names_its_checkpoints_directory(command, ckpt):
    exp = fixture_path("runs_nemo2")  # NeMo 2's experiment directory, its run root under checkpoints/
    line = _one_line(ckpt(command, exp))
    assert "found only directories" not in line
    assert f"checkpoints/ (NeMo 2, 4 steps); try {exp}/checkpoints" in line, line


def test_an_experiment_directory_of_another_framework_names_its_run_root(tmp_path, ckpt):
    exp = tmp_path / "exp"
    exp.mkdir()
    shutil.copytree(fixture_path("runs_torchtitan"), exp / "checkpoint")  # torchtitan's dcp.save wrote it
    (exp / "config.toml").write_text("[job]\n")
    line = _one_line(ckpt("inspect", exp))
    assert f"checkpoint/ (torchtitan (DCP), 4 steps); try {exp}/checkpoint" in line, line
    # and what it names opens
    assert ckpt("inspect", exp / "checkpoint").returncode == 0


@pytest.mark.parametrize("command", ["ls", "latest"])
def test_ls_of_a_nemo_experiment_directory_names_its_checkpoints_directory(command, ckpt):
    exp = fixture_path("runs_nemo2")
    line = _one_line(ckpt(command, exp))
    assert "not a run root: no step directories" in line, line
    assert line.endswith(f"; checkpoints/ in it is one (NeMo 2, 4 steps): try {exp}/checkpoints"), line
    assert ckpt(command, exp / "checkpoints").returncode == 0
