"""`--overwrite` replaces a checkpoint, never the user's files beside it (issue 29).

Measured before the fix: `convert SRC DST --overwrite` onto a directory holding
a checkpoint AND notes.txt, train.py and a logs/ folder deleted all of them and
reported `"cleanup": []`. What belongs to the checkpoint now comes from the
format that recognised DST (formats.contents: the registry's claims and parts);
anything else there makes ckpt refuse, naming it, and leave DST as it was. A
run root of several steps is refused too; a replacement says what it replaced.

Real files: committed fixtures (written by torch, orbax, transformers and
DeepSpeed) copied into tmp_path, with a user's files added beside them.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import ckpt_tool
from ckpt_tool.ops.engine import ConvertOptions, convert
from ckpt_tool.base.errors import CkptError
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import FIXTURES, moto_s3_serving, run_ckpt, s3_client
from library_reference import _tensor_to_numpy, dcp_values

SRC = str(FIXTURES / "safetensors_numpy")  # 19 arrays, written by safetensors' numpy API


def _snapshot(path: Path) -> dict[str, str]:
    """Every entry under `path` (links not followed) with a hash of each file's bytes."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    return lines[0]


def _checkpoint(tmp_path: Path, fixture: str, name: str = "dst") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / fixture, dst, symlinks=True)
    (dst / "_reference.json").unlink(missing_ok=True)  # the generators' answers, not the checkpoint's
    return dst


def _add_users_files(dst: Path) -> None:
    (dst / "notes.txt").write_text("lr 3e-4 diverged at step 900\n")
    (dst / "train.py").write_text("print('training')\n")
    (dst / "logs").mkdir()
    (dst / "logs" / "run.log").write_text("step 1 loss 2.30\n")


def _temporaries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".ckpt-tmp" in p.name)


# -- a checkpoint beside a user's files ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["dcp_single", "orbax_ocdbt_zarr2", "safetensors_llama_bf16"])
def test_overwrite_refuses_a_checkpoint_beside_a_users_files_and_names_them(tmp_path, fixture):
    dst = _checkpoint(tmp_path, fixture)
    _add_users_files(dst)
    before = _snapshot(dst)
    line = _one_line(run_ckpt("convert", SRC, str(dst), "--to", "dcp", "--overwrite"))
    assert line.startswith(f"ckpt: error: {dst}: destination is a checkpoint ("), line
    assert "2 files and 1 directory (notes.txt, train.py, logs/) that are not part of it" in line, line
    assert "refusing to replace it" in line and "move the others out" in line, line
    r = run_ckpt("convert", SRC, str(dst), "--to", "orbax", "--overwrite", "--json")
    assert r.returncode == 1
    error = json.loads(r.stdout)["error"]
    assert error["code"] == "destination-exists" and "notes.txt" in error["message"], error
    # without --overwrite: no hint towards a flag that would be refused as well
    line = _one_line(run_ckpt("convert", SRC, str(dst), "--to", "dcp"))
    assert "destination exists and is a checkpoint" in line and "--overwrite" not in line, line
    assert _snapshot(dst) == before
    assert _temporaries(tmp_path) == []


def test_reshard_refuses_a_checkpoint_beside_a_users_files(tmp_path):
    dst = _checkpoint(tmp_path, "orbax_ocdbt_zarr2")
    _add_users_files(dst)
    before = _snapshot(dst)
    line = _one_line(run_ckpt("reshard", str(FIXTURES / "orbax_ocdbt_zarr2"), str(dst), "--mesh", "data=1",
                              "--devices", "1", "--overwrite"))
    assert "a checkpoint (orbax) beside" in line and "notes.txt, train.py, logs/" in line, line
    assert _snapshot(dst) == before and _temporaries(tmp_path) == []


def test_an_empty_folder_and_a_link_inside_a_checkpoint_are_not_its_own(tmp_path):
    """A listing of files shows neither an empty directory nor where a link points: the
    directory's own listing decides, and each is someone else's."""
    dst = _checkpoint(tmp_path, "dcp_single")
    (dst / "scratch").mkdir()
    elsewhere = tmp_path / "datasets"
    elsewhere.mkdir()
    (elsewhere / "shard0.txt").write_text("tokens\n")
    (dst / "data").symlink_to(elsewhere)
    before, before_elsewhere = _snapshot(dst), _snapshot(elsewhere)
    line = _one_line(run_ckpt("convert", SRC, str(dst), "--to", "dcp", "--overwrite"))
    assert "refusing to replace it" in line and "scratch/" in line and "data" in line, line
    assert _snapshot(dst) == before and _snapshot(elsewhere) == before_elsewhere


def test_a_file_written_into_the_checkpoint_during_the_run_is_kept(tmp_path):
    """DST is judged again on what is moved aside at the end: a checkpoint when the run started,
    a checkpoint beside a user's file when it ends."""
    dst = _checkpoint(tmp_path, "dcp_single")
    before = _snapshot(dst)

    def progress(what: str, done: int, total: int) -> None:
        if not (dst / "notes.txt").exists():
            (dst / "notes.txt").write_text("written while the convert ran\n")

    with pytest.raises(CkptError, match="refusing to replace it") as info:
        convert(SRC, str(dst), ConvertOptions(to="orbax", overwrite=True), progress=progress)
    assert "notes.txt" in str(info.value) and ".ckpt-tmp" not in str(info.value)
    assert _snapshot(dst) == {**before, "notes.txt": hashlib.sha256(b"written while the convert ran\n").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


# -- what is never replaced, whatever it holds -----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fixture, what", [
    ("orbax_manager", "a run root of 3 checkpoints (Orbax CheckpointManager: 1/, 2/, 3.orbax-checkpoint-tmp/)"),
    ("megatron_run", "a run root of 2 checkpoints (Megatron-LM: iter_0000010/, iter_0000020/)"),
    ("flax_msgpack", "a run root of 2 checkpoints (Flax checkpoint_N: checkpoint_1, checkpoint_2)"),
])
def test_a_run_root_of_several_steps_is_not_replaced(tmp_path, fixture, what):
    dst = _checkpoint(tmp_path, fixture)
    before = _snapshot(dst)
    line = _one_line(run_ckpt("convert", SRC, str(dst), "--to", "dcp", "--overwrite"))
    assert f"destination is {what}; refusing to replace it: replacing it would delete every step" in line, line
    assert _snapshot(dst) == before and _temporaries(tmp_path) == []


@pytest.mark.slow
def test_a_symlink_to_a_checkpoint_is_not_replaced(tmp_path):
    target = _checkpoint(tmp_path, "dcp_single", "real")
    link = tmp_path / "latest"
    link.symlink_to(target)
    before = _snapshot(target)
    line = _one_line(run_ckpt("convert", SRC, str(link), "--to", "dcp", "--overwrite"))
    assert "a symlink" in line and "refusing to replace it" in line, line
    assert link.is_symlink() and _snapshot(target) == before


@pytest.mark.slow
@pytest.mark.parametrize("where", ["same", "inside"])
def test_the_source_or_a_folder_inside_it_is_never_the_destination(tmp_path, where):
    src = _checkpoint(tmp_path, "dcp_single", "src")
    dst = src if where == "same" else src / "converted"
    before = _snapshot(src)
    line = _one_line(run_ckpt("convert", str(src), str(dst), "--to", "orbax", "--overwrite"))
    assert "destination is the source or inside it" in line, line
    assert _snapshot(src) == before


# -- what is replaced, and the summary saying so ----------------------------------------------


@pytest.mark.slow
def test_overwrite_says_what_it_replaced(tmp_path):
    dst = _checkpoint(tmp_path, "dcp_single")
    r = run_ckpt("convert", SRC, str(dst), "--to", "orbax", "--overwrite", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cleanup"] == [
        f"replaced a checkpoint (dcp) at {dst}: 2 entries (.metadata, __0_0.distcp)"]
    r = run_ckpt("convert", SRC, str(dst), "--to", "dcp", "--overwrite")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith("replaced ")]
    assert len(said) == 1 and said[0].startswith(f"replaced a checkpoint (orbax) at {dst}: "), r.stdout
    assert "_METADATA" in said[0] and "d/" in said[0], said
    # the output is what torch's own loader reads, equal to the source as safetensors loads it
    from safetensors.torch import load_file

    want = {k: _tensor_to_numpy(v) for k, v in load_file(str(Path(SRC) / "model.safetensors")).items()}
    got = {".".join(map(str, k)): v for k, v in dcp_values(dst).items()}
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


@pytest.mark.slow
@pytest.mark.parametrize("source, args", [
    ("safetensors_numpy", ("--to", "orbax")),
    ("safetensors_numpy", ("--to", "orbax", "--zarr3")),
    ("safetensors_numpy", ("--to", "dcp")),
    ("safetensors_llama_bf16", ("--to", "safetensors")),  # with the model's config.json copied beside it
    ("deepspeed_z1_fp32", ("--to", "deepspeed-universal")),
], ids=["orbax", "orbax-zarr3", "dcp", "safetensors-hf", "deepspeed-universal"])
def test_ckpts_own_output_is_replaced_whole(tmp_path, source, args):
    dst = tmp_path / "out"
    src = str(FIXTURES / source)
    assert run_ckpt("convert", src, str(dst), *args).returncode == 0
    written = sorted(os.listdir(dst))
    r = run_ckpt("convert", src, str(dst), *args, "--overwrite", "--json")
    assert r.returncode == 0, r.stderr
    [said] = json.loads(r.stdout)["cleanup"]
    assert said.startswith(f"replaced a checkpoint (") and f"{len(written)} entr" in said, said
    assert sorted(os.listdir(dst)) == written and validate_checkpoint(str(dst)).ok()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert ckpt_tool.open(str(dst)).arrays()


# -- object stores: the same rule for a prefix ------------------------------------------------


@pytest.mark.slow
def test_overwrite_on_s3_refuses_a_checkpoint_beside_other_objects():
    bucket = "ckpt-overwrite-foreign"
    with moto_s3_serving(bucket, ["dcp_single"]) as env:
        s3 = s3_client(env["AWS_ENDPOINT_URL"])
        s3.put_object(Bucket=bucket, Key="run/dcp_single/notes.txt", Body=b"my notes")
        url = f"s3://{bucket}/run/dcp_single"
        line = _one_line(run_ckpt("convert", SRC, url, "--to", "dcp", "--overwrite", env=env))
        assert "a checkpoint (dcp) beside 1 file (notes.txt) that is not part of it" in line, line
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"])
        assert keys == ["run/dcp_single/.metadata", "run/dcp_single/__0_0.distcp", "run/dcp_single/notes.txt"]
        s3.delete_object(Bucket=bucket, Key="run/dcp_single/notes.txt")
        r = run_ckpt("convert", SRC, url, "--to", "dcp", "--overwrite", "--json", env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["cleanup"] == [
            f"replaced a checkpoint (dcp) at {url}: 2 entries (.metadata, __0_0.distcp)"]
