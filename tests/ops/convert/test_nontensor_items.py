"""Non-tensor items of real torch training checkpoints through convert, checked in torch and orbax.

The fixture (fixtures/gen_fsdp2.py) is an FSDP2 model with its Adam state
from `get_state_dict`: param_groups hold `foreach: None`, `fused: None`, a
`betas` tuple and a `params` list of strings; `extra` adds None, [], {}, a
tuple of tensors, a list of tensors and a tuple of empty values. Orbax gets
them as orbax itself saves such a pytree (None and empty containers as empty
values, tuples recorded in `value_metadata_tree`), and DCP gets back what
torch had (a tuple is one bytes item, tensors inside, byte for byte what
torch.save writes).
"""
from __future__ import annotations

import io
import json
import os
import sys
import zipfile

import numpy as np
import pytest
from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import cli
from ckpt_tool.ops.diff import diff_checkpoints
from ckpt_tool.formats.dcp.write import value_archive

from conftest import FIXTURES, fixture_path, run_ckpt
from library_reference import _tensor_to_numpy, dcp_storage

SRC = fixture_path("dcp_fsdp2_adam")
runner = CliRunner()


def convert(*args: str) -> dict:
    result = runner.invoke(cli, ["convert", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


# -- what the libraries themselves give -----------------------------------------------


def _numpy_tree(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return _tensor_to_numpy(obj)
    if isinstance(obj, dict):
        return {k: _numpy_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_numpy_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_numpy_tree(v) for v in obj)
    return obj


def torch_tree(path, tmp_path) -> dict:
    """torch's own view: dcp_to_torch_save, then torch.load(weights_only=True); tensors as numpy."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{os.path.basename(str(path))}-{len(os.listdir(tmp_path))}.pt"
    dcp_to_torch_save(str(path), str(out))
    return _numpy_tree(torch.load(str(out), weights_only=True))


def as_lists(obj):
    """What orbax's default restore gives for a tree holding tuples: lists (it records sequences as lists)."""
    if isinstance(obj, dict):
        return {k: as_lists(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and obj:  # the empty tuple is its own empty value ("Tuple")
        return [as_lists(v) for v in obj]
    if isinstance(obj, list):
        return [as_lists(v) for v in obj]
    return obj


def same(a, b, where="") -> None:
    """Equal in structure, container types, scalar types, dtypes, shapes and bits."""
    if isinstance(a, np.generic):
        a = a.item()
    if isinstance(b, np.generic):
        b = b.item()
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__} ({a!r} vs {b!r})"
    if isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def orbax_restore(path, *, rich: bool = False, target=None):
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.metadata import pytree_metadata_options as pmo

    options = pmo.PyTreeMetadataOptions(support_rich_types=rich)
    handler = ocp.PyTreeCheckpointHandler(pytree_metadata_options=options)
    with ocp.Checkpointer(handler) as ckptr:
        if target is None:
            return ckptr.restore(os.path.abspath(path))
        return ckptr.restore(os.path.abspath(path), args=ocp.args.PyTreeRestore(item=target))


@pytest.fixture(scope="module")
def hops(tmp_path_factory):
    """DCP -> Orbax -> DCP, with no flags; and torch's view of the source."""
    tmp = tmp_path_factory.mktemp("hops")
    orbax_dir, dcp_dir = tmp / "orbax", tmp / "dcp"
    to_orbax = convert(str(SRC), str(orbax_dir), "--to", "orbax")
    to_dcp = convert(str(orbax_dir), str(dcp_dir), "--to", "dcp")
    return {"orbax": orbax_dir, "dcp": dcp_dir, "to_orbax": to_orbax, "to_dcp": to_dcp,
            "source": torch_tree(SRC, tmp), "tmp": tmp}


# -- the fixture is what the issue describes ------------------------------------------------


def test_fixture_is_a_real_fsdp2_adam_state(hops):
    src = hops["source"]
    group = src["optim"]["param_groups"][0]
    assert group["foreach"] is None and group["fused"] is None
    assert type(group["betas"]) is tuple and type(group["params"]) is list
    assert set(src["optim"]["state"]) == set(group["params"]) == set(src["model"])
    extra = src["extra"]
    assert extra["nothing"] is None and extra["empty_list"] == [] and "empty_dict" not in extra  # DCP drops {}
    assert type(extra["pair"]) is tuple and all(isinstance(t, np.ndarray) for t in extra["pair"])
    assert type(extra["tensors"]) is list and all(isinstance(t, np.ndarray) for t in extra["tensors"])
    assert extra["mixed"] == ({}, None, [], (), 3)
    ck = ckpt_tool.open(str(SRC))
    assert ck["optim/state/0.weight/exp_avg"].chunk_count == 2  # FSDP2 shards on both ranks
    assert sum(f.stat().st_size for f in SRC.iterdir()) < 200_000


# -- DCP -> Orbax -------------------------------------------------------------------------------


def test_to_orbax_needs_no_flag_and_skips_nothing(hops):
    assert hops["to_orbax"]["skipped"] == [] and hops["to_dcp"]["skipped"] == []


def test_orbax_restore_without_target_gives_the_structure(hops):
    # orbax's default restore reads tree_metadata, where every sequence is a
    # list: a tuple comes back as a list, as for tuples orbax saved itself
    same(orbax_restore(hops["orbax"]), as_lists(hops["source"]))


def test_orbax_rich_types_restore_gives_the_tuples_back(hops):
    same(orbax_restore(hops["orbax"], rich=True), hops["source"])


def test_orbax_restore_with_a_target_tree(hops):
    target = hops["source"]
    restored = orbax_restore(hops["orbax"], target=target)
    same(restored, target)


def test_standard_checkpointer_restores_it(hops):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(os.path.abspath(hops["orbax"]))
    same(restored, as_lists(hops["source"]))


def test_metadata_is_what_orbax_writes_for_the_same_tree(hops, tmp_path):
    """Save the restored tree with orbax itself (rich types on) and compare _METADATA."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.metadata import pytree_metadata_options as pmo

    tree = orbax_restore(hops["orbax"], rich=True)
    handler = ocp.PyTreeCheckpointHandler(pytree_metadata_options=pmo.PyTreeMetadataOptions(support_rich_types=True))
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(str(tmp_path / "by_orbax"), args=ocp.args.PyTreeSave(tree))
    ours = json.loads((hops["orbax"] / "_METADATA").read_text())
    theirs = json.loads((tmp_path / "by_orbax" / "_METADATA").read_text())
    assert ours["value_metadata_tree"] == theirs["value_metadata_tree"]
    assert ours["tree_metadata"] == theirs["tree_metadata"]
    types = {v["value_metadata"]["value_type"] for v in ours["tree_metadata"].values()}
    assert {"None", "Dict", "List", "Tuple", "np.ndarray", "scalar", "string"} <= types


def test_a_tree_without_tuples_has_no_rich_metadata(tmp_path):
    # the DCP fixtures without tuples convert to exactly orbax's default _METADATA keys
    dst = tmp_path / "out"
    convert(str(fixture_path("dcp_single")), str(dst), "--to", "orbax")
    assert "value_metadata_tree" not in json.loads((dst / "_METADATA").read_text())


# -- Orbax -> DCP -----------------------------------------------------------------------------


def test_back_to_dcp_loads_in_torch_as_the_source(hops):
    same(torch_tree(hops["dcp"], hops["tmp"]), hops["source"])


def test_back_to_dcp_loads_with_dcp_load_into_the_state_dict(hops):
    import torch
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(FIXTURES))
    try:
        from gen_fsdp2 import extra_items
    finally:
        sys.path.remove(str(FIXTURES))
    extra = extra_items()
    # a state dict shaped as the one saved, with other values in it
    state = {
        "extra": {
            "nothing": 5, "empty_list": ["x"], "empty_dict": {},
            "pair": tuple(torch.zeros_like(t) for t in extra["pair"]),
            "tensors": [torch.zeros_like(t) for t in extra["tensors"]],
            "mixed": (1,),
        },
        "optim": {"param_groups": [{"betas": [0.0, 0.0], "foreach": True, "params": []}]},
    }
    dcp.load(state, checkpoint_id=str(hops["dcp"]), no_dist=True)
    got = _numpy_tree(state)
    want = hops["source"]
    for key in ("nothing", "empty_list", "pair", "tensors", "mixed"):
        same(got["extra"][key], want["extra"][key], key)
    group = got["optim"]["param_groups"][0]
    same(group["betas"], want["optim"]["param_groups"][0]["betas"], "betas")
    assert group["foreach"] is None and group["params"] == want["optim"]["param_groups"][0]["params"]


def test_tuple_of_tensors_is_the_bytes_torch_saved(hops, tmp_path):
    """The `extra.pair` bytes item, back from Orbax and straight from DCP, byte for byte as torch wrote it."""
    direct = tmp_path / "direct"
    convert(str(SRC), str(direct), "--to", "dcp")

    def item_bytes(path, fqn):
        rel, offset, length = dcp_storage(path)[(fqn, None)]
        with open(os.path.join(path, rel), "rb") as f:
            f.seek(offset)
            return f.read(length)

    for fqn in ("extra.pair", "extra.mixed", "optim.param_groups.0.betas", "optim.param_groups.0.foreach"):
        want = item_bytes(SRC, fqn)
        assert item_bytes(hops["dcp"], fqn) == want, fqn
        assert item_bytes(direct, fqn) == want, fqn


def test_diff_reports_equal_for_both_hops(hops, tmp_path):
    src = ckpt_tool.open(str(SRC))
    back = ckpt_tool.open(str(hops["dcp"]))
    report = diff_checkpoints(src, back, values=True)
    assert report.same, [d.to_json() for d in report.differences]
    assert report.compared == len(src.leaves)
    # the Orbax hop: Orbax -> DCP -> Orbax gives the same Orbax leaves and values
    again = tmp_path / "orbax_again"
    convert(str(hops["dcp"]), str(again), "--to", "orbax")
    report = diff_checkpoints(ckpt_tool.open(str(hops["orbax"])), ckpt_tool.open(str(again)), values=True)
    assert report.same, [d.to_json() for d in report.differences]
    assert json.loads((again / "_METADATA").read_text())["value_metadata_tree"] == \
        json.loads((hops["orbax"] / "_METADATA").read_text())["value_metadata_tree"]
    r = run_ckpt("diff", str(SRC), str(hops["dcp"]), "--values")
    assert r.returncode == 0, r.stdout + r.stderr


def test_orbax_to_orbax_keeps_the_tuples(hops, tmp_path):
    dst = tmp_path / "copy"
    convert(str(hops["orbax"]), str(dst), "--to", "orbax")
    assert json.loads((dst / "_METADATA").read_text()) == json.loads((hops["orbax"] / "_METADATA").read_text())
    same(orbax_restore(dst, rich=True), hops["source"])


def test_reshard_keeps_the_tuples(hops, tmp_path):
    dst = tmp_path / "resharded"
    result = runner.invoke(cli, ["reshard", str(SRC), str(dst), "--mesh", "data=1", "--devices", "1"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output

    def host(obj):  # reshard makes DCP tensors jax.Arrays (on the new mesh); compare their values
        if isinstance(obj, dict):
            return {k: host(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(host(v) for v in obj)
        return np.asarray(obj) if hasattr(obj, "addressable_shards") else obj

    same(host(orbax_restore(dst, rich=True)), hops["source"])


def test_diff_across_formats_compares_a_bytes_item_with_its_orbax_subtree(hops):
    # DCP's one bytes item (betas, params, pair) against the Orbax leaves below it (betas/0, betas/1)
    for values in (False, True):
        report = diff_checkpoints(ckpt_tool.open(str(SRC)), ckpt_tool.open(str(hops["orbax"])), values=values)
        assert report.same, [d.to_json() for d in report.differences]
        back = diff_checkpoints(ckpt_tool.open(str(hops["orbax"])), ckpt_tool.open(str(SRC)), values=values)
        assert back.same, [d.to_json() for d in back.differences]


def test_validate_strict_on_both_outputs(hops):
    for path in (hops["orbax"], hops["dcp"]):
        r = run_ckpt("validate", str(path), "--strict", "--deep")
        assert r.returncode == 0, r.stdout + r.stderr


def test_dcp_to_dcp_keeps_every_item(tmp_path):
    dst = tmp_path / "out"
    summary = convert(str(SRC), str(dst), "--to", "dcp")
    assert summary["skipped"] == []
    same(torch_tree(dst, tmp_path), torch_tree(SRC, tmp_path))
    assert diff_checkpoints(ckpt_tool.open(str(SRC)), ckpt_tool.open(str(dst)), values=True).same


# -- Orbax sources written by orbax itself ------------------------------------------------------


def _orbax_save(path, tree, *, rich: bool) -> None:
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.metadata import pytree_metadata_options as pmo

    handler = ocp.PyTreeCheckpointHandler(pytree_metadata_options=pmo.PyTreeMetadataOptions(support_rich_types=rich))
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(str(path), args=ocp.args.PyTreeSave(tree))


ORBAX_TREE = {
    "pair": (np.arange(3, dtype=np.float32), np.ones((2, 2), np.int32)),
    "betas": (0.9, 0.99),
    "nested": [(1, "a"), {"n": None, "e": {}, "l": [], "t": ()}],
    "params": [np.zeros(2, np.float32), np.ones(3, np.float32)],
}


@pytest.mark.parametrize("rich", [True, False])
def test_orbax_saved_tree_to_dcp(tmp_path, rich):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _orbax_save(src, ORBAX_TREE, rich=rich)
    convert(str(src), str(dst), "--to", "dcp")
    got = torch_tree(dst, tmp_path)
    # with rich types orbax recorded the tuples: torch gets them as tuples
    # (one bytes item each); without, orbax itself only knows lists
    want = ORBAX_TREE if rich else as_lists(ORBAX_TREE)
    same(got, want)
    md_keys = {fqn for fqn, _ in dcp_storage(dst)}
    # a tuple is one item; a list holding a dict is traversed, one holding only values is one item
    if rich:
        assert {"pair", "betas", "nested.0", "nested.1.n"} <= md_keys and "pair.0" not in md_keys
    else:
        assert {"pair.0", "pair.1", "betas", "nested.0", "nested.1.n"} <= md_keys


# -- what still has no Orbax equivalent --------------------------------------------------------


def test_skip_unsupported_still_covers_what_has_no_equivalent(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "src"
    # bytes have no Orbax type; a dict with int keys would come back with str keys
    dcp.save({"w": torch.ones(2), "blob": b"raw", "t": ("ok", b"x", {0: 1.0}), "n": None},
             checkpoint_id=str(src), no_dist=True)
    work = tmp_path / "work"
    work.mkdir()
    r = run_ckpt("convert", str(src), str(work / "out"), "--to", "orbax")
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    assert "blob" in line and "bytes value has no Orbax leaf type" in line and "--skip-unsupported" in line
    assert not list(work.iterdir())
    summary = convert(str(src), str(work / "out"), "--to", "orbax", "--skip-unsupported")
    assert {s["leaf"] for s in summary["skipped"]} == {"blob", "t/1", "t/2"}
    restored = orbax_restore(work / "out", rich=True)
    assert restored["n"] is None and restored["t"] == ("ok",)
    np.testing.assert_array_equal(restored["w"], np.ones(2, np.float32))


def test_tuples_of_many_tensors_are_torch_save_bytes():
    """torch.save's archive record order and serialization id, for tuples that rehash torch's record-name set."""
    import torch

    for n in (0, 1, 8, 9, 23, 60, 130, 300):
        values = tuple(torch.full((2,), float(i)) for i in range(n)) + (torch.tensor(1.5), torch.zeros(0, 3))
        buf = io.BytesIO()
        torch.save(values, buf)
        parts, length = value_archive(tuple(t.numpy() for t in values), "x")
        got = b"".join(bytes(p) for p in parts)
        assert len(got) == length
        assert got == buf.getvalue(), n
        assert len(zipfile.ZipFile(io.BytesIO(got)).namelist()) == n + 8
