"""Two leaves, one name (issue 44, item 1): keys never merge.

A key may hold a `/` (a safetensors tensor `a/b`, a torch.save or DCP key `a/b`,
an Orbax or msgpack tree key `a/b`) beside the leaf `a.b` or the nested `a`/`b`.
Joined with `/` unescaped, both leaves had the path `a/b`: convert wrote one's
values under the other's name with exit 0, and diff compared one and dropped
the other. Now:

- a leaf is its tuple of keys; its one-string spelling (display, --json,
  --filter, --rename) escapes `%` and `/` in a key as `%25` and `%2F`, the same
  in every format (ckpt_tool/base/names.py, docs/filters.md);
- every output keeps each source name as its loader expects it, with its own
  values (checked with the real library's loader);
- where the target cannot hold two names apart, convert refuses in one line
  naming both; diff never pairs two different leaves nor leaves one out.

Every input is written by the real library (safetensors, torch, torch DCP,
orbax-checkpoint and its msgpack serializer); the DeepSpeed input is the
committed fixture with one module parameter renamed to a name torch itself
accepts (`register_parameter` refuses only '.' and '').
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES

ZEROS = np.zeros(3, np.float32)
ONES = np.ones(3, np.float32)


# -- sources, each written by its own library ------------------------------------------------------
# each returns (path, {flat name the loader sees: values}); the names `a.b` and `a/b` always hold
# different values, so a leaf written with the other's data shows

def _safetensors(d: Path) -> tuple[Path, dict[str, np.ndarray]]:
    from safetensors.numpy import save_file

    save_file({"a.b": ZEROS, "a/b": ONES}, str(d / "x.safetensors"))
    return d / "x.safetensors", {"a.b": ZEROS, "a/b": ONES}


def _torch_save(d: Path) -> tuple[Path, dict[str, np.ndarray]]:
    torch = pytest.importorskip("torch")
    torch.save({"a.b": torch.zeros(3), "a/b": torch.ones(3)}, d / "x.pt")
    return d / "x.pt", {"a.b": ZEROS, "a/b": ONES}


def _torch_save_nested(d: Path) -> tuple[Path, dict[str, np.ndarray]]:
    torch = pytest.importorskip("torch")
    torch.save({"a/b": torch.zeros(3), "a": {"b": torch.ones(3)}}, d / "nested.pt")
    return d / "nested.pt", {"a/b": ZEROS, "a.b": ONES}


def _dcp(d: Path) -> tuple[Path, dict[str, np.ndarray]]:
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        # (the fqns `a/b` and `a.b`; beside a top-level `a.b` torch refuses it: "duplicated flatten key")
        dcp.save({"a/b": torch.zeros(3), "a": {"b": torch.ones(3)}}, checkpoint_id=str(d / "dcp"))
    return d / "dcp", {"a/b": ZEROS, "a.b": ONES}


def _orbax(d: Path) -> tuple[Path, dict[str, np.ndarray]]:
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.StandardCheckpointer() as c:
        c.save(d / "orbax", {"a/b": ZEROS, "a": {"b": ONES}})
        c.wait_until_finished()
    return d / "orbax", {"a/b": ZEROS, "a.b": ONES}


def _msgpack(d: Path) -> tuple[Path, dict[str, np.ndarray]]:
    from orbax.checkpoint import msgpack_utils  # flax's msgpack_serialize, as orbax ships it

    (d / "flax").mkdir()
    (d / "flax" / "checkpoint_1").write_bytes(msgpack_utils.msgpack_serialize({"a/b": ZEROS, "a": {"b": ONES}}))
    return d / "flax", {"a/b": ZEROS, "a.b": ONES}


def _deepspeed(d: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The committed ZeRO-1 fixture, its module parameter `layers.1.up.weight` named
    `layers.0/up.weight` (a module `0/up`, which torch accepts) in the module state and
    the parameter shapes, as DeepSpeed saves a model that names it so."""
    torch = pytest.importorskip("torch")
    root = d / "deepspeed"
    shutil.copytree(FIXTURES / "deepspeed_z1_fp32", root)
    path = root / "global_step2" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)

    def rename(od: dict) -> collections.OrderedDict:
        return collections.OrderedDict(("layers.0/up.weight" if k == "layers.1.up.weight" else k, v)
                                       for k, v in od.items())

    state["module"] = rename(state["module"])
    state["param_shapes"] = [rename(g) for g in state["param_shapes"]]
    torch.save(state, path)
    module = state["module"]
    return root, {k: module[k].float().numpy() for k in ("layers.0.up.weight", "layers.0/up.weight")}


SOURCES = {
    "safetensors": _safetensors, "torch": _torch_save, "torch-nested": _torch_save_nested, "dcp": _dcp,
    "orbax": _orbax, "msgpack": _msgpack, "deepspeed": _deepspeed,
}


# -- the loaders of the outputs -------------------------------------------------------------------

def _load_safetensors(out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for f in glob.glob(str(out / "*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _load_dcp(out: Path) -> dict[str, np.ndarray]:
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(out))
    meta = reader.read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader)
    return {k: v.numpy() for k, v in sd.items()}


LOADERS = {"safetensors": _load_safetensors, "dcp": _load_dcp}
EXTRA = {"deepspeed": ["--skip-unsupported"]}  # (its optimizer's param_groups are lists: no tensor)


@pytest.mark.parametrize("target", sorted(LOADERS))
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_convert_keeps_each_name_with_its_own_values(source, target, tmp_path, ckpt):
    """Both names come back as the loader expects them, each with its own values
    (before: the leaf `a.b` was written with the values of `a/b`, exit 0)."""
    src, expected = SOURCES[source](tmp_path)
    out = tmp_path / "out"
    r = ckpt("convert", src, out, "--to", target, *EXTRA.get(source, []))
    assert r.returncode == 0, r.stderr
    got = LOADERS[target](out)
    for name, want in expected.items():
        assert name in got, (name, sorted(got))
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@pytest.mark.parametrize("source", ["safetensors", "torch", "dcp", "orbax", "msgpack"])
def test_keys_spelled_with_one_reversible_escape(source, tmp_path, ckpt):
    """inspect's listing, its tree and --json; `a/b` as a key is `a%2Fb`, the same in every format."""
    src, _ = SOURCES[source](tmp_path)
    flat = ckpt("inspect", src, "--flat")
    assert flat.returncode == 0, flat.stderr
    rows = [line.split()[0] for line in flat.stdout.splitlines() if "float32[3]" in line]
    # (DCP keeps a top-level fqn whole: `a.b`; the others split it, or nest it: `a/b`)
    assert len(rows) == 2 and "a%2Fb" in rows and ("a/b" in rows or "a.b" in rows), flat.stdout
    tree = ckpt("inspect", src)
    assert "  a%2Fb  float32[3]" in tree.stdout, tree.stdout
    doc = json.loads(ckpt("inspect", src, "--json").stdout)
    keys = [tuple(leaf["keys"]) for leaf in doc["leaves"]]
    assert ("a/b",) in keys and len(set(keys)) == 2, keys


def test_filter_picks_the_key_it_spells(tmp_path, ckpt):
    """`a/b` is the keys a, b (the tensor `a.b`); the tensor `a/b` is `a%2Fb` (before: `a/b`
    picked both, and `a%2Fb` none)."""
    src, _ = _safetensors(tmp_path)
    for pattern, want in (("a/b", "a/b"), ("a%2Fb", "a%2Fb"), ("a%2F*", "a%2Fb")):
        r = ckpt("inspect", src, "--flat", "--filter", pattern)
        assert r.returncode == 0, (pattern, r.stderr)
        rows = [line.split()[0] for line in r.stdout.splitlines() if "float32[3]" in line]
        assert rows == [want], (pattern, r.stdout)
    doc = json.loads(ckpt("inspect", src, "--json", "--filter", "a%2Fb").stdout)
    assert [leaf["name"] for leaf in doc["leaves"]] == ["a/b"]


@pytest.mark.parametrize("source", ["safetensors", "torch", "dcp", "msgpack"])
def test_rename_reads_the_escaped_key(source, tmp_path, ckpt):
    """--rename sees `a%2Fb`: renamed, the key no longer holds a '/', and Orbax (which writes a
    parameter name as a path) takes both leaves, each with its values (before: the rule
    matched nothing, or both leaves)."""
    ocp = pytest.importorskip("orbax.checkpoint")
    src, expected = SOURCES[source](tmp_path)
    out = tmp_path / "out"
    r = ckpt("convert", src, out, "--to", "orbax", "--rename", "a%2Fb=a_slash_b")
    assert r.returncode == 0, r.stderr
    with ocp.StandardCheckpointer() as c:
        tree = c.restore(out)
    np.testing.assert_array_equal(tree["a_slash_b"], expected["a/b"])
    # (DCP keeps its fqn `a.b` whole: one key; the others split or nest it)
    np.testing.assert_array_equal(tree["a.b"] if "a.b" in tree else tree["a"]["b"], expected["a.b"])


@pytest.mark.parametrize("target", ["orbax", "deepspeed-universal"])
def test_a_name_the_target_cannot_hold_is_refused_in_one_line(target, tmp_path, ckpt):
    """Orbax writes a parameter name as a path, and a universal checkpoint a parameter as a
    directory: a '/' in a name is refused, naming the key, and nothing is written."""
    src, _ = _deepspeed(tmp_path) if target == "deepspeed-universal" else _safetensors(tmp_path)
    out = tmp_path / "out"
    r = ckpt("convert", src, out, "--to", target)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "0/up.weight" in lines[0] if target == "deepspeed-universal" else "'a/b'" in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("target", ["safetensors", "dcp", "orbax"])
def test_two_leaves_one_target_name_refused_naming_both(target, tmp_path, ckpt):
    """`a.b` and the nested `a`/`b` are one flat name in every target (torch's DCP refuses
    such a state dict itself: "duplicated flatten key"): refused, naming both leaves."""
    torch = pytest.importorskip("torch")
    torch.save({"a.b": torch.zeros(3), "a": {"b": torch.ones(3)}}, tmp_path / "x.pt")
    out = tmp_path / "out"
    r = ckpt("convert", tmp_path / "x.pt", out, "--to", target)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "two leaves map to 'a.b'" in r.stderr and "'a.b'" in r.stderr and "'a/b'" in r.stderr, r.stderr
    assert not out.exists()


# -- diff ---------------------------------------------------------------------------------------------

def test_diff_compares_each_leaf(tmp_path, ckpt):
    """Two files that differ only in `a.b`: before, `a/b` took its place in the pairing and
    diff said "same" with exit 0."""
    from safetensors.numpy import save_file

    save_file({"a.b": ZEROS, "a/b": ONES}, str(tmp_path / "a.safetensors"))
    save_file({"a.b": ZEROS + 5, "a/b": ONES}, str(tmp_path / "b.safetensors"))
    r = ckpt("diff", "--values", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--json")
    assert r.returncode == 1, r.stdout
    doc = json.loads(r.stdout)
    assert doc["compared"] == 2, doc
    assert [d["path"] for d in doc["differences"]] == ["a/b"], doc["differences"]


def test_diff_never_drops_a_leaf(tmp_path, ckpt):
    """The leaf only one side has is an `only in` line, under its escaped key (before: it
    shared the other leaf's path and vanished from the report)."""
    from safetensors.numpy import save_file

    save_file({"a.b": ZEROS, "a/b": ONES}, str(tmp_path / "a.safetensors"))
    save_file({"a.b": ZEROS}, str(tmp_path / "b.safetensors"))
    r = ckpt("diff", "--values", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert r.returncode == 1
    assert "a%2Fb: only in A" in r.stdout, r.stdout


@pytest.mark.parametrize("source", ["torch", "dcp", "orbax", "msgpack", "deepspeed"])
def test_diff_of_a_conversion_pairs_each_leaf_with_itself(source, tmp_path, ckpt):
    """A conversion diffed against its source: same, every leaf compared once; one leaf
    changed is that leaf's difference, and no other's."""
    from ckpt_tool.base.names import split_path

    src, expected = SOURCES[source](tmp_path)
    out = tmp_path / "out"
    assert ckpt("convert", src, out, "--to", "safetensors", *EXTRA.get(source, [])).returncode == 0
    from safetensors.numpy import save_file

    # the output with the leaf `a.b` (or the layer's) changed: diff must see it
    tensors = _load_safetensors(out)
    name = sorted(expected)[0]
    tensors[name] = tensors[name] + 1
    changed = tmp_path / "changed.safetensors"
    save_file(tensors, str(changed))
    if source != "deepspeed":  # (its optimizer's lists are left out of the output)
        same = ckpt("diff", "--values", src, out)
        assert same.returncode == 0 and same.stdout.startswith("same: 2 leaves"), same.stdout
    # (re-saved by safetensors.numpy, the output's scalars lose ckpt's record of them: arrays only)
    r = ckpt("diff", "--values", out, changed, "--json", *(["--filter", "layers/**"] if source == "deepspeed" else []))
    assert r.returncode == 1, r.stdout
    paths = [d["path"] for d in json.loads(r.stdout)["differences"]]
    assert [".".join(split_path(p)) for p in paths] == [name], paths


def test_diff_rename_that_merges_two_leaves_is_refused(tmp_path, ckpt):
    """--rename making two of A's paths one would leave one out: refused, naming both."""
    from safetensors.numpy import save_file

    save_file({"a.b": ZEROS, "a/b": ONES}, str(tmp_path / "a.safetensors"))
    r = ckpt("diff", tmp_path / "a.safetensors", tmp_path / "a.safetensors", "--rename", "a%2Fb=a/b")
    assert r.returncode == 1
    assert "'a/b'" in r.stderr and "'a%2Fb'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- readers: keys that are one key as text -------------------------------------------------------------

def test_torch_dict_of_int_and_str_keys_is_one_value(tmp_path, ckpt):
    """{0: a, "0": b}: torch.load gives both; as a subtree both would be the key `0`."""
    torch = pytest.importorskip("torch")
    torch.save({"m": {0: torch.zeros(3), "0": torch.ones(3)}, "w": torch.ones(2)}, tmp_path / "x.pt")
    r = ckpt("inspect", tmp_path / "x.pt", "--flat")
    assert r.returncode == 0, r.stderr
    rows = [line.split()[0] for line in r.stdout.splitlines()[-2:]]
    assert sorted(rows) == ["m", "w"], r.stdout


def test_torch_list_index_and_dotted_key_stay_apart(tmp_path, ckpt):
    """{"l": [t], "l.0": u}: split at its dot, `l.0` would be the list's `l/0`."""
    torch = pytest.importorskip("torch")
    torch.save({"l": [torch.zeros(2)], "l.0": torch.ones(2)}, tmp_path / "x.pt")
    r = ckpt("inspect", tmp_path / "x.pt", "--flat")
    rows = sorted(line.split()[0] for line in r.stdout.splitlines() if "float32[2]" in line)
    assert rows == ["l.0", "l/0"], r.stdout


def test_msgpack_map_with_a_key_twice_is_refused(tmp_path, ckpt):
    """msgpack_restore keeps a map key's last value: the first would be lost unseen."""
    import msgpack
    from orbax.checkpoint import msgpack_utils

    raw = msgpack_utils.msgpack_serialize({"a": {"b": ONES, "c": ZEROS}})
    doc = msgpack.unpackb(raw, raw=False, ext_hook=msgpack.ExtType)
    # the same map with its key `c` written as `b`, as msgpack.Packer packs pairs given in order
    packer = msgpack.Packer(use_bin_type=True)
    inner = doc["a"]
    body = packer.pack_map_header(1) + packer.pack("a") + packer.pack_map_header(2)
    body += packer.pack("b") + packer.pack(inner["b"]) + packer.pack("b") + packer.pack(inner["c"])
    assert msgpack_utils.msgpack_restore(body)["a"]["b"].tolist() == [0.0, 0.0, 0.0]  # the library: last wins
    (tmp_path / "flax").mkdir()
    (tmp_path / "flax" / "checkpoint_1").write_bytes(body)
    r = ckpt("inspect", tmp_path / "flax")
    assert r.returncode == 1
    assert "map key 'b'" in r.stderr and "twice" in r.stderr, r.stderr
    v = ckpt("validate", tmp_path / "flax")
    assert v.returncode == 1 and "twice" in v.stdout, v.stdout


def test_inspect_tree_shows_a_leaf_beside_its_subtree(tmp_path, ckpt):
    """The safetensors tensors `a` and `a.b` are the leaf `a` and the leaf `a/b` (before: an
    internal error in the tree view)."""
    from safetensors.numpy import save_file

    save_file({"a": ZEROS, "a.b": ONES}, str(tmp_path / "x.safetensors"))
    r = ckpt("inspect", tmp_path / "x.safetensors")
    assert r.returncode == 0, r.stderr
    assert "  a  float32[3]" in r.stdout and "    b  float32[3]" in r.stdout, r.stdout


def test_escape_round_trips() -> None:
    from ckpt_tool.base.names import join_keys, key_text, split_path

    # (the one path no escape tells apart: () and ("",) are both "", the root of a bare tensor and
    # a lone key "", which never meet in one checkpoint: a root leaf is its only leaf)
    cases = [(), ("a/b",), ("a", "b"), ("a.b",), ("%2F",), ("%",), ("a", "", "b"), ("", "a"), ("a", ""),
             (0, "x/y%z"), ("a%2Fb", "c"), ("%252F",)]
    spelled = {join_keys(k) for k in cases}
    assert len(spelled) == len(cases)
    for k in cases:
        assert split_path(join_keys(k)) == key_text(k)


def test_dcp_planner_data_that_makes_a_value_a_container_is_refused(tmp_path, ckpt):
    """planner_data putting the key `m/w/x` under the value `m/w` (found by the key-space fuzzer):
    torch's dcp_to_torch_save fails on it, so validate must not say OK (before: exit 0)."""
    import pickle

    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"m": {"w": torch.zeros(3), "x": torch.ones(3)}}, checkpoint_id=str(tmp_path / "dcp"))
    meta = tmp_path / "dcp" / ".metadata"
    md = pickle.loads(meta.read_bytes())
    md.state_dict_metadata = {("m.w.x" if k == "m.x" else k): v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {(dataclasses.replace(k, fqn="m.w.x") if k.fqn == "m.x" else k): v
                       for k, v in md.storage_data.items()}
    md.planner_data = {("m.w.x" if k == "m.x" else k): (("m", "w", "x") if k == "m.x" else v)
                       for k, v in md.planner_data.items()}
    meta.write_bytes(pickle.dumps(md))
    with pytest.raises(BaseException), warnings.catch_warnings():  # the library cannot load it (CheckpointException)
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "out.pt"))
    r = ckpt("validate", tmp_path / "dcp")
    assert r.returncode == 1 and "both a value and the container" in r.stdout, r.stdout
    i = ckpt("inspect", tmp_path / "dcp")
    assert i.returncode == 1 and len(i.stderr.strip().splitlines()) == 1, i.stderr


def test_dcp_planner_data_list_with_a_gap_is_refused(tmp_path, ckpt):
    """A list whose element 0 is gone from .metadata (its key renamed away, as the fuzzer did):
    torch's load fills the gap with None and then finds no entry for it; validate must not pass."""
    import pickle

    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"l": [torch.zeros(3), torch.ones(3)], "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"))
    meta = tmp_path / "dcp" / ".metadata"
    md = pickle.loads(meta.read_bytes())
    md.state_dict_metadata = {("l%2F0" if k == "l.0" else k): v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {(dataclasses.replace(k, fqn="l%2F0") if k.fqn == "l.0" else k): v
                       for k, v in md.storage_data.items()}
    md.planner_data = {("l%2F0" if k == "l.0" else k): (("l%2F0",) if k == "l.0" else v)
                       for k, v in md.planner_data.items()}
    meta.write_bytes(pickle.dumps(md))
    with pytest.raises(BaseException), warnings.catch_warnings():  # the library cannot load it
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "out.pt"))
    r = ckpt("validate", tmp_path / "dcp")
    assert r.returncode == 1 and "has no element 0" in r.stdout, r.stdout
