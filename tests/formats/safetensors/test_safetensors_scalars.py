"""Numbers to safetensors and back (issue 18, item 14).

A training state converted to safetensors used to stop on its step counter
("safetensors holds tensors only"). Numbers (Python and numpy ints, floats,
bools) are now 0-d tensors, which every safetensors reader loads; the names of
the Python numbers are recorded in `__metadata__` (`ckpt.python_scalars`), so
ckpt reads them back as Python numbers and a conversion onwards keeps them so.
Strings and bytes are still refused, with the --skip-unsupported hint.

The source is written by real orbax in the test; the output is read by
safetensors' own numpy and torch loaders, and the round trip by orbax's
restore.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import ckpt_tool
from ckpt_tool.core.model import ArrayLeaf, ValueLeaf
from conftest import FIXTURES, run_ckpt
from library_reference import orbax_values

pytest.importorskip("safetensors")


def _state() -> dict:
    return {
        "params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)},
        "step": 7,
        "lr": 0.25,
        "done": True,
        # orbax saves a numpy scalar as a 'scalar' leaf too, and restores it as a Python int
        "count": np.int32(3),
    }


@pytest.fixture(scope="module")
def orbax_state(tmp_path_factory) -> Path:
    """A training state saved by orbax itself: Python numbers are orbax 'scalar' leaves."""
    import orbax.checkpoint as ocp

    path = tmp_path_factory.mktemp("src") / "state"
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), _state())
    return path


def _convert(src: Path, dst: Path, *args: str) -> None:
    from click.testing import CliRunner

    from ckpt_tool.cli.main import cli

    res = CliRunner().invoke(cli, ["convert", str(src), str(dst), *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output


def test_training_state_converts_and_safetensors_loads_0d_tensors(orbax_state, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    dst = tmp_path / "st"
    _convert(orbax_state, dst, "--to", "safetensors")
    got = load_file(str(dst / "model.safetensors"))
    assert sorted(got) == ["count", "done", "lr", "params.b", "params.w", "step"]
    for name, dtype, value in [("step", np.int64, 7), ("lr", np.float64, 0.25), ("done", np.bool_, True),
                               ("count", np.int64, 3)]:
        assert got[name].shape == () and got[name].dtype == dtype and got[name][()] == value, name
    assert got["params.w"].tobytes() == _state()["params"]["w"].tobytes()
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert f.get_tensor("step").dim() == 0 and int(f.get_tensor("step")) == 7
    # the record of what were Python numbers (as orbax restores them)
    assert json.loads(meta["ckpt.python_scalars"]) == ["count", "done", "lr", "step"]


def test_numpy_scalars_stay_0d_arrays_of_their_dtype(tmp_path):
    """A Flax msgpack's numpy scalar (ext 3, flax restores np.int32) keeps its dtype and is no Python number."""
    from safetensors import safe_open

    dst = tmp_path / "st"
    _convert(FIXTURES / "flax_to_bytes" / "state.msgpack", dst, "--to", "safetensors")
    # (safe_open per tensor: the file holds bfloat16, which safetensors.numpy.load_file cannot load)
    with safe_open(str(dst / "model.safetensors"), framework="np") as f:
        count, step = f.get_tensor("opt.count"), f.get_tensor("step")
        assert json.loads(f.metadata()["ckpt.python_scalars"]) == ["lr", "step"]
    assert count.shape == () and count.dtype == np.int32 and step.shape == () and step.dtype == np.int64
    ck = ckpt_tool.open(str(dst))
    assert isinstance(ck["opt/count"], ArrayLeaf) and ck["opt/count"].dtype == "int32"
    assert ck["step"].load() == 30 and type(ck["step"].load()) is int


@pytest.mark.slow
def test_ckpt_reads_python_numbers_back_as_such(orbax_state, tmp_path):
    dst = tmp_path / "st"
    _convert(orbax_state, dst, "--to", "safetensors")
    ck = ckpt_tool.open(str(dst))
    by = {leaf.path: leaf for leaf in ck.leaves}
    for path, value in [("step", 7), ("lr", 0.25), ("done", True), ("count", 3)]:
        leaf = by[path]
        assert isinstance(leaf, ValueLeaf) and leaf.value_type == "scalar"
        got = leaf.load()
        assert got == value and type(got) is type(value), path
    # the whole thing agrees with the source, values included, and validates deep
    res = run_ckpt("diff", str(orbax_state), str(dst), "--values")
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_ckpt("validate", str(dst), "--deep")
    assert res.returncode == 0, res.stdout + res.stderr


def test_back_to_orbax_the_step_is_an_orbax_scalar(orbax_state, tmp_path):
    st, back = tmp_path / "st", tmp_path / "back"
    _convert(orbax_state, st, "--to", "safetensors")
    _convert(st, back, "--to", "orbax")
    restored = orbax_values(back)
    assert restored[("step",)] == 7 and type(restored[("step",)]) is int
    assert restored[("lr",)] == 0.25 and type(restored[("lr",)]) is float
    meta = json.loads((back / "_METADATA").read_text())["tree_metadata"]
    step = next(v for k, v in meta.items() if "step" in k)
    assert step["value_metadata"]["value_type"] == "scalar"


def test_to_dcp_from_safetensors_the_step_is_a_python_int(orbax_state, tmp_path):
    from library_reference import dcp_values

    st, dcp = tmp_path / "st", tmp_path / "dcp"
    _convert(orbax_state, st, "--to", "safetensors")
    _convert(st, dcp, "--to", "dcp")
    values = dcp_values(dcp)
    assert values[("step",)] == 7 and type(values[("step",)]) is int


def test_strings_and_bytes_are_still_refused(tmp_path):
    """dcp_multirank holds a str (run.name) and a tuple (betas) beside its numbers."""
    src = FIXTURES / "dcp_multirank"
    res = run_ckpt("convert", str(src), str(tmp_path / "o"), "--to", "safetensors")
    assert res.returncode == 1 and "--skip-unsupported" in res.stderr and not (tmp_path / "o").exists()
    _convert(src, tmp_path / "o", "--to", "safetensors", "--skip-unsupported")
    ck = ckpt_tool.open(str(tmp_path / "o"))
    values = {leaf.path: leaf.load() for leaf in ck.leaves if isinstance(leaf, ValueLeaf)}
    # the numbers came through; the str, tuple and list did not
    assert values == {"step": 3, "run/world_size": 2, "optim/param_groups/0/lr": 0.01}


def test_no_record_without_numbers(tmp_path):
    from safetensors import safe_open

    _convert(FIXTURES / "safetensors_numpy", tmp_path / "o", "--to", "safetensors")
    with safe_open(str(tmp_path / "o" / "model.safetensors"), framework="np") as f:
        assert "ckpt.python_scalars" not in (f.metadata() or {})


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sharded_output_numbers_in_their_files(orbax_state, tmp_path, processes):
    """Numbers land in the file their position puts them in, written by the process owning that file."""
    import sys

    from safetensors.numpy import load_file

    from conftest import run_two_processes

    dst = tmp_path / "st"
    args = ["convert", str(orbax_state), str(dst), "--to", "safetensors", "--max-shard-size", "40B"]
    if processes == 1:
        _convert(orbax_state, dst, *args[3:])
    else:
        run_two_processes([sys.executable, "-m", "ckpt_tool", *args], dict(os.environ))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert {"step", "lr", "done", "count"} <= set(index["weight_map"])
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    got = {}
    for f in files:
        got.update(load_file(str(dst / f)))
    assert sorted(got) == sorted(index["weight_map"])
    assert got["step"][()] == 7 and got["step"].shape == () and got["done"][()]
    ck = ckpt_tool.open(str(dst))
    assert ck["step"].load() == 7 and type(ck["step"].load()) is int
    res = run_ckpt("diff", str(orbax_state), str(dst), "--values")
    assert res.returncode == 0, res.stdout + res.stderr
