"""Python numbers saved by orbax <= 0.4, Flax msgpack and T5X stay Python numbers in every output (issue 18, item 7).

The fixtures (fixtures/gen_legacy_jax.py) save `step` as a Python int and
`lr` as a Python float (gen_legacy_jax._state). Newer Orbax records such
leaves as 'scalar' and ckpt converts them as numbers; here the older writers:

- orbax 0.4's PyTreeCheckpointer stores each one as a 0-d zarr array
  (ScalarHandler: np.asarray(7), int64) with no type recorded, so
  `convert --to dcp` used to give `tensor(4)` where the writer saved `4`;
- Flax msgpack keeps them inline as msgpack ints and floats;
- T5X keeps its format version (the int 3) beside the state: it was not
  shown at all, and its `checkpoint` file could not be opened by path.

Each output is read back by its own library: the DCP through torch
(`dcp_to_torch_save`, then `torch.load(weights_only=True)`), the Orbax
output through orbax's restore, safetensors through safe_open. Numpy scalars
(an `np.int32` optimizer count, T5X's step) stay 0-d arrays of their dtype.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import ckpt_tool
from ckpt_tool.core.model import ArrayLeaf, ValueLeaf
from conftest import FIXTURES
from library_reference import orbax_values

# fixture -> {key path: the Python number the writer saved}
NUMBERS = {
    "orbax_v0_4_plain": {("step",): 4, ("lr",): 0.5},
    "orbax_v0_4_ocdbt": {("step",): 3, ("lr",): 0.375},
    "orbax_v0_4_manager": {("state", "step"): 52, ("state", "lr"): 6.5},
    "flax_orbax": {("step",): 12, ("lr",): 1.5},
    "flax_msgpack": {("step",): 22, ("lr",): 2.75},
    "flax_to_bytes/state.msgpack": {("step",): 30, ("lr",): 3.75},
    "t5x": {("version",): 3},
    "t5x/checkpoint_1/checkpoint": {("version",): 3},
}
# numpy scalars the writers saved (np.int32): 0-d arrays, in every output
NUMPY_SCALARS = {
    "orbax_v0_4_plain": ("opt", "count"),
    "flax_msgpack": ("opt", "count"),
    "t5x": ("state", "step"),
}



def _torch_load(dcp_dir: Path, tmp_path: Path) -> dict:
    """The DCP checkpoint as torch gives it: consolidated by torch, loaded with weights_only=True."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "full.pt"
    dcp_to_torch_save(str(dcp_dir), str(out))
    return torch.load(out, weights_only=True)


def _at(tree: dict, keys: tuple) -> object:
    flat = ".".join(map(str, keys))
    if flat in tree:
        return tree[flat]
    for k in keys:
        tree = tree[k]
    return tree


@pytest.mark.parametrize("path", list(NUMBERS))
def test_inspect_gives_python_numbers(path):
    ck = ckpt_tool.open(str(FIXTURES / path))
    leaves = {tuple(leaf.keys): leaf for leaf in ck.leaves}
    for keys, number in NUMBERS[path].items():
        leaf = leaves[keys]
        assert isinstance(leaf, ValueLeaf) and leaf.value_type == "scalar", keys
        got = leaf.load()
        assert got == number and type(got) is type(number), keys


@pytest.mark.parametrize("path", list(NUMBERS))
def test_to_dcp_torch_loads_the_number(path, tmp_path, ckpt):
    import torch

    out = tmp_path / "dcp"
    r = ckpt("convert", FIXTURES / path, out, "--to", "dcp")
    assert r.returncode == 0, r.stderr
    loaded = _torch_load(out, tmp_path)
    for keys, number in NUMBERS[path].items():
        got = _at(loaded, keys)
        assert not isinstance(got, torch.Tensor), (keys, got)
        assert got == number and type(got) is type(number), keys
    numpy_scalar = NUMPY_SCALARS.get(path)
    if numpy_scalar:
        got = _at(loaded, numpy_scalar)
        assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.dtype == torch.int32


@pytest.mark.parametrize("path", ["orbax_v0_4_plain", "orbax_v0_4_manager", "flax_msgpack", "t5x"])
def test_to_orbax_they_are_orbax_scalars(path, tmp_path, ckpt):
    out = tmp_path / "orbax"
    r = ckpt("convert", FIXTURES / path, out, "--to", "orbax")
    assert r.returncode == 0, r.stderr
    restored = orbax_values(out)
    meta = json.loads((out / "_METADATA").read_text())["tree_metadata"]
    for keys, number in NUMBERS[path].items():
        got = restored[keys]
        assert got == number and type(got) is type(number), keys
        assert meta[str(keys)]["value_metadata"]["value_type"] == "scalar", keys
    numpy_scalar = NUMPY_SCALARS.get(path)
    if numpy_scalar:
        assert meta[str(numpy_scalar)]["value_metadata"]["value_type"] == "np.ndarray"


@pytest.mark.parametrize("path", ["orbax_v0_4_ocdbt", "flax_to_bytes/state.msgpack", "t5x"])
def test_to_safetensors_and_back_they_are_numbers(path, tmp_path, ckpt):
    from safetensors import safe_open

    out = tmp_path / "st"
    r = ckpt("convert", FIXTURES / path, out, "--to", "safetensors")
    assert r.returncode == 0, r.stderr
    with safe_open(str(out / "model.safetensors"), framework="np") as f:
        recorded = json.loads(f.metadata()["ckpt.python_scalars"])
        for keys in NUMBERS[path]:
            name = ".".join(keys)
            assert name in recorded and f.get_tensor(name).shape == ()
    back = ckpt_tool.open(str(out))
    for keys, number in NUMBERS[path].items():
        got = back["/".join(keys)].load()
        assert got == number and type(got) is type(number), keys


def _view(ck) -> list:
    out = []
    for leaf in ck.leaves:
        if isinstance(leaf, ArrayLeaf):
            out.append((tuple(leaf.keys), "array", leaf.dtype, tuple(leaf.shape), leaf.read().tobytes()))
        else:
            out.append((tuple(leaf.keys), "value", leaf.value_type, leaf.dtype, leaf.load()))
    return out


def test_t5x_directory_and_checkpoint_file_show_the_same_leaves(ckpt):
    root = FIXTURES / "t5x"
    by_root = _view(ckpt_tool.open(str(root)))
    by_step = _view(ckpt_tool.open(str(root / "checkpoint_1")))
    by_file = _view(ckpt_tool.open(str(root / "checkpoint_1" / "checkpoint")))
    assert by_root == by_step == by_file
    assert by_file[0] == (("version",), "value", "scalar", "int64", 3)
    # the file validates as its step directory does (arrays beside it included), shallow and deep
    for args in ((), ("--deep",)):
        r = ckpt("validate", root / "checkpoint_1" / "checkpoint", "--json", *args)
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        # as inspect counts them: the 5 external arrays, 2 in the msgpack file, and T5X's version
        assert doc["format"] == "t5x" and (doc["checked"]["arrays"], doc["checked"]["values"]) == (7, 1), doc
    r = ckpt("inspect", root / "checkpoint_1" / "checkpoint", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["format"] == "t5x"


def test_orbax_0_4_item_checkpoint_file_is_its_directory():
    item = FIXTURES / "orbax_v0_4_plain"
    assert _view(ckpt_tool.open(str(item / "checkpoint"))) == _view(ckpt_tool.open(str(item)))


def test_a_jax_array_scalar_stays_an_array(tmp_path):
    """Only names `_sharding` does not list can be Python numbers: a listed 0-d int64 is a jax.Array."""
    import shutil

    item = tmp_path / "item"
    shutil.copytree(FIXTURES / "orbax_v0_4_plain", item)
    sharding = json.loads((item / "_sharding").read_text())
    sharding["step"] = ""  # as orbax 0.4 records a single-device jax.Array
    (item / "_sharding").write_text(json.dumps(sharding))
    leaf = ckpt_tool.open(str(item))["step"]
    assert isinstance(leaf, ArrayLeaf) and leaf.shape == () and leaf.dtype == "int64"
