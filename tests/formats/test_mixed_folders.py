"""A folder of checkpoint sub-folders plus a loose checkpoint file is several checkpoints (issue 29).

A single-file format (torch.save, safetensors) claims a directory by its loose
files; beside sub-directories that are checkpoints themselves, that file is one
checkpoint among several, and reading it alone ignored the others in silence
(inspect, validate and convert all reported success on the `.pt` alone). Now
ckpt says the folder holds several checkpoints and asks for one, as it does
for a folder of checkpoint sub-folders alone. A real one-checkpoint layout (a
Hugging Face folder with config.json, a `model.pt` beside `logs/`, torch's
consolidated safetensors beside its `sharded/` files) opens as before, and
reads what the library itself loads.

Fixtures: committed checkpoints copied into tmp_path; the loose files written
here by torch.save and safetensors, or copied from committed fixtures.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import ckpt_tool
from conftest import FIXTURES, run_ckpt


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    return lines[0]


def _torch_save(path: Path) -> dict[str, np.ndarray]:
    """A state dict written by the real torch.save; its values as numpy."""
    import torch

    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3, 4, generator=gen), "b": torch.arange(4, dtype=torch.float32)}
    torch.save(state, path)
    return {k: v.numpy() for k, v in state.items()}


def _torch_load(path: Path) -> dict[str, np.ndarray]:
    """What torch.load gives, as numpy (bfloat16 as its 16-bit patterns: numpy has no bfloat16)."""
    import torch

    return {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).contiguous().numpy()
            for k, v in torch.load(path, weights_only=True).items()}


def _checkpoint_folders(root: Path) -> Path:
    """A folder holding two checkpoint sub-folders (a DCP save, an Orbax save)."""
    root.mkdir(parents=True)
    shutil.copytree(FIXTURES / "dcp_single", root / "dcp_run")
    shutil.copytree(FIXTURES / "orbax_ocdbt_zarr2", root / "orbax_run")
    return root


def _loose_pt(root: Path) -> str:
    _torch_save(root / "model.pt")
    return "model.pt"


def _loose_safetensors(root: Path) -> str:
    shutil.copy(FIXTURES / "safetensors_numpy" / "model.safetensors", root / "weights.safetensors")
    return "weights.safetensors"


def _loose_bin(root: Path) -> str:
    shutil.copy(FIXTURES / "torch_hf_bin_single" / "pytorch_model.bin", root / "pytorch_model.bin")
    return "pytorch_model.bin"


@pytest.mark.slow
@pytest.mark.parametrize("loose", [_loose_pt, _loose_safetensors, _loose_bin], ids=["pt", "safetensors", "bin"])
def test_a_loose_file_beside_checkpoint_folders_is_one_of_several(tmp_path, loose):
    root = _checkpoint_folders(tmp_path / "checkpoints")
    name = loose(root)
    for command in (("inspect", str(root)), ("validate", str(root)),
                    ("convert", str(root), str(tmp_path / "out"), "--to", "dcp")):
        line = _one_error_line(run_ckpt(*command))
        assert "a directory of 3 checkpoints, not one" in line, line
        assert name in line and "dcp_run/ (dcp)" in line and "orbax_run/ (orbax)" in line, line
        assert f"open one, e.g. ckpt inspect {root}/" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # convert wrote nothing
    with pytest.raises(ckpt_tool.CkptError, match="3 checkpoints"):
        ckpt_tool.open(str(root))
    # each one still opens by its own path
    assert ckpt_tool.open(str(root / name)).arrays()
    assert ckpt_tool.open(str(root / "dcp_run")).format == "dcp"


def test_a_pt_beside_a_logs_folder_still_opens_as_torch_load_reads_it(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "train.log").write_text("step 1 loss 2.3\n")
    (run / "logs" / "events.json").write_text("{}\n")
    _torch_save(run / "model.pt")
    want = _torch_load(run / "model.pt")
    ck = ckpt_tool.open(str(run))
    assert ck.format == "torch"
    got = {leaf.name: leaf.read() for leaf in ck.arrays()}
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)
    assert run_ckpt("validate", str(run)).returncode == 0


def test_a_hugging_face_folder_with_checkpoint_sub_folders_reads_its_top_model(tmp_path):
    """transformers' from_pretrained(folder) loads the top pytorch_model.bin whatever sub-folders
    (a Trainer's checkpoint-N/) sit beside it: config.json makes the folder one model."""
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / "torch_hf_bin_single", model)
    (model / "_reference.json").unlink()
    shutil.copytree(FIXTURES / "safetensors_llama_bf16", model / "checkpoint-500")
    ck = ckpt_tool.open(str(model))
    assert ck.format == "torch"
    want = _torch_load(model / "pytorch_model.bin")
    got = {leaf.name: leaf for leaf in ck.arrays()}
    assert set(got) == set(want)
    for name, value in want.items():
        read = got[name].read()
        assert read.shape == value.shape and read.tobytes() == value.tobytes(), name


def test_torch_consolidated_safetensors_beside_its_sharded_folder_is_one_checkpoint():
    """torch's HuggingFaceStorageWriter(enable_consolidation=True): the consolidated files and their
    index at the top, the per-rank files under sharded/ (a safetensors checkpoint too)."""
    path = FIXTURES / "safetensors_dcp_consolidated"
    assert (path / "sharded").is_dir() and (path / "model.safetensors.index.json").is_file()
    from safetensors.numpy import load_file

    want: dict[str, np.ndarray] = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        want.update(load_file(str(shard)))
    ck = ckpt_tool.open(str(path))
    got = {leaf.name: leaf.read() for leaf in ck.arrays()}
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)
