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
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, fixture_path

OWNER = ".ckpt-owner.json"


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


def test_a_directory_that_is_not_empty_is_still_refused(tmp_path, ckpt):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine\n")
    line = _one_line(ckpt("convert", fixture_path("dcp_single"), dst, "--to", "dcp"))
    assert "destination exists" in line and "notes.txt" in line, line
    assert [p.name for p in dst.iterdir()] == ["notes.txt"]


def test_a_file_written_into_the_empty_directory_meanwhile_is_never_lost(tmp_path):
    """The rename onto the empty directory fails if anything appeared in it while the run wrote."""
    from ckpt_tool.engine import ConvertOptions, convert
    from ckpt_tool.errors import CkptError

    dst = tmp_path / "out"
    dst.mkdir()

    def progress(what: str, done: int, total: int) -> None:
        if not (dst / "notes.txt").exists():
            (dst / "notes.txt").write_text("written while the convert ran\n")

    with pytest.raises(CkptError, match="destination appeared while converting"):
        convert(str(fixture_path("dcp_single")), str(dst), ConvertOptions(to="dcp"), progress=progress)
    assert [p.name for p in dst.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# -- 2. stale temporaries in `ckpt ls PARENT` -----------------------------------------------


@pytest.fixture(scope="module")
def big_safetensors(tmp_path_factory) -> Path:
    """16 MiB in 16 tensors (the safetensors library's own writer): a convert that runs long enough to stop."""
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    rng = np.random.default_rng(0)
    save_file({f"w{i}": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(16)}, str(path))
    return path


def _started_convert(src: Path, dst: Path) -> tuple[subprocess.Popen, Path]:
    """A real convert into `dst`, stopped (SIGSTOP: alive) once its temporary output holds its owner record."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_tool", "convert", str(src), str(dst), "--to", "dcp", "--chunk-mb", "0.01",
         "--workers", "1"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        found = [p for p in dst.parent.glob(f".{dst.name}.ckpt-tmp-*") if (p / OWNER).exists()]
        if found:
            time.sleep(0.05)  # a few chunks in
            proc.send_signal(signal.SIGSTOP)
            return proc, found[0]
        time.sleep(0.005)
    proc.kill()
    raise AssertionError("the convert ended before it could be stopped")


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
