"""Validate agrees with the msgpack libraries on damaged Flax / orbax <= 0.4 / T5X trees (issue 18, item 8).

Each mutant is a committed fixture with one msgpack file re-encoded by the
`msgpack` package: a root that is not a map, a map key that is not a string
(at the root or deep in the tree), a leaf stored under an ext type no flax or
orbax writer uses. The library's verdict comes from the library itself:
flax's and orbax's `msgpack_restore` are `msgpack.unpackb` with their ext hook
and msgpack's default `strict_map_key`, and orbax's is installed here
(`orbax.checkpoint.msgpack_utils`; flax is not), so each test first asserts
that orbax's loader refuses the mutant, then that ckpt does not pass it:
`validate` exits 1 with a finding naming the file, and `inspect` of the root
says what is wrong with the latest step instead of silently showing the older
one.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgpack
import pytest

from conftest import FIXTURES



def _load(data: bytes):
    """The document as plain Python, ext values kept as msgpack.ExtType (any key type allowed)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)


def _dump(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def orbax_restore(data: bytes):
    """orbax's own msgpack loader (flax's msgpack_restore is the same call, its ext hook without tuples)."""
    from orbax.checkpoint import msgpack_utils

    return msgpack_utils.msgpack_restore(data)


def _root_int(tree):
    return 7


def _root_list(tree):
    return [tree["step"], tree["lr"]]


def _int_key_first(tree):
    # the document's first key an int: the file no longer even starts like a saved tree
    return {116: tree["step"], **tree}


def _int_key_inside(tree):
    tree["opt"][116] = tree["opt"].pop("count")
    return tree


def _unknown_ext(tree):
    embed = tree["params"]["embed"]
    tree["params"]["embed"] = msgpack.ExtType(42, embed.data)
    return tree


MUTANTS = {
    "root-int": (_root_int, "root is an int, not a map"),
    "root-list": (_root_list, "root is a list, not a map"),
    "int-key-first": (_int_key_first, "is an int, not a string"),
    "int-key-inside": (_int_key_inside, "is an int, not a string"),
}


def _mutate(path: Path, change) -> bytes:
    data = change(_load(path.read_bytes()))
    raw = _dump(data)
    path.write_bytes(raw)
    return raw


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _findings(out: str) -> list[dict]:
    return json.loads(out)["findings"]


@pytest.mark.parametrize("kind", list(MUTANTS))
def test_damaged_newest_flax_step_is_a_finding_not_skipped(kind, tmp_path, ckpt):
    change, says = MUTANTS[kind]
    root = _copy(tmp_path, "flax_msgpack")
    raw = _mutate(root / "checkpoint_2", change)
    if kind.startswith("int-key"):
        with pytest.raises(ValueError, match="int is not allowed for map key"):
            orbax_restore(raw)

    r = ckpt("validate", root, "--json")
    assert r.returncode == 1, r.stdout
    found = [f for f in _findings(r.stdout) if f["file"] == "checkpoint_2"]
    assert [f["code"] for f in found] == ["bad-metadata"] and says in found[0]["message"]

    # inspect goes where the library goes (the newest step by name) and says what is wrong
    r = ckpt("inspect", root)
    assert r.returncode == 1 and r.stdout == ""
    assert "checkpoint_2" in r.stderr and says in r.stderr and "--step 1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

    # the older step still reads, and the listing names both
    r = ckpt("inspect", root, "--step", "1", "--json")
    assert r.returncode == 0
    assert [s["name"] for s in json.loads(r.stdout)["steps"]] == ["checkpoint_1", "checkpoint_2"]
    r = ckpt("validate", root, "--step", "1")
    assert r.returncode == 0, r.stdout


def test_damaged_older_flax_step_is_a_finding(tmp_path, ckpt):
    root = _copy(tmp_path, "flax_msgpack")
    _mutate(root / "checkpoint_1", _root_int)
    r = ckpt("inspect", root, "--json")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    assert doc["step"] == 2 and [s["step"] for s in doc["steps"]] == [1, 2]
    # validate of the root checks the step a resume opens (checkpoint_2); --step all every step
    r = ckpt("validate", root, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["opened"]["name"] == "checkpoint_2"
    r = ckpt("validate", root, "--step", "all", "--json")
    assert r.returncode == 1
    assert [(f["code"], f["file"]) for f in _findings(r.stdout)] == [("bad-metadata", "checkpoint_1")]


def test_int_key_inside_a_single_file_is_an_error(tmp_path, ckpt):
    """`ckpt inspect FILE` used to show such a key as a leaf `opt/116`."""
    root = _copy(tmp_path, "flax_msgpack")
    raw = _mutate(root / "checkpoint_1", _int_key_inside)
    with pytest.raises(ValueError, match="int is not allowed for map key"):
        orbax_restore(raw)
    r = ckpt("inspect", root / "checkpoint_1")
    assert r.returncode == 1 and "opt/116" not in r.stdout
    assert "map key at byte" in r.stderr and "not a string" in r.stderr
    r = ckpt("validate", root / "checkpoint_1", "--json")
    assert r.returncode == 1 and [f["code"] for f in _findings(r.stdout)] == ["bad-metadata"]


def test_unknown_ext_type_fails_validate_and_deep(tmp_path, ckpt):
    root = _copy(tmp_path, "flax_msgpack")
    raw = _mutate(root / "checkpoint_2", _unknown_ext)
    with pytest.raises(ValueError, match="Unsupported msgpack code: 42"):
        orbax_restore(raw)
    # flax's own hook (the same without orbax's tuple) hands back the raw ExtType: no array
    flax_like = msgpack.unpackb(raw, raw=False, ext_hook=lambda code, data: msgpack.ExtType(code, data)
                                if code not in (1, 2, 3) else None)
    assert isinstance(flax_like["params"]["embed"], msgpack.ExtType)

    for deep in ((), ("--deep",)):
        r = ckpt("validate", root, "--json", *deep)
        assert r.returncode == 1, (deep, r.stdout)
        found = _findings(r.stdout)
        assert [(f["code"], f["leaf"], f["file"]) for f in found] == [("bad-metadata", "params/embed", "checkpoint_2")]
        assert "ext type 42" in found[0]["message"]
    # inspect still lists the leaf (nothing dropped); reading it is refused
    r = ckpt("inspect", root, "--json")
    assert r.returncode == 0
    leaf = next(x for x in json.loads(r.stdout)["leaves"] if x["name"] == "params.embed")
    assert leaf["value_type"] == "msgpack-ext-42"


def test_damaged_item_of_an_orbax_0_4_manager_step(tmp_path, ckpt):
    root = _copy(tmp_path, "orbax_v0_4_manager")
    raw = _mutate(root / "2" / "state" / "checkpoint", _int_key_first)
    with pytest.raises(ValueError, match="int is not allowed for map key"):
        orbax_restore(raw)
    r = ckpt("validate", root, "--json")
    assert r.returncode == 1
    assert [(f["code"], f["file"]) for f in _findings(r.stdout)] == [("bad-metadata", "2/state/checkpoint")]
    r = ckpt("inspect", root)
    assert r.returncode == 1 and "2/state/checkpoint" in r.stderr and "--step 1" in r.stderr
    assert ckpt("inspect", root, "--step", "1").returncode == 0


def test_int_key_in_a_t5x_tree(tmp_path, ckpt):
    root = _copy(tmp_path, "t5x")

    def change(tree):
        tree["optimizer"]["state"][3] = tree["optimizer"]["state"].pop("step")
        return tree

    raw = _mutate(root / "checkpoint_1" / "checkpoint", change)
    with pytest.raises(ValueError, match="int is not allowed for map key"):
        orbax_restore(raw)
    r = ckpt("validate", root, "--json")
    assert r.returncode == 1
    assert [(f["code"], f["file"]) for f in _findings(r.stdout)] == [("bad-metadata", "checkpoint_1/checkpoint")]
    r = ckpt("inspect", root)
    assert r.returncode == 1 and "not a string" in r.stderr


def test_bytes_keys_are_still_read(tmp_path, ckpt):
    """msgpack's strict_map_key allows bytes keys (flax restores them): not an error."""
    root = _copy(tmp_path, "flax_msgpack")
    raw = _mutate(root / "checkpoint_2", lambda t: {**t, b"extra": 1})
    assert orbax_restore(raw)[b"extra"] == 1
    assert ckpt("validate", root).returncode == 0


def test_fuzz_msgpack_mutator_classes_are_refused(tmp_path, ckpt):
    """`make fuzz`'s msgpack operator (tests/fuzz_lib.mutate_msgpack) makes each class above; every
    structure / ext mutant of the newest step is a validate error (the library refuses it, or
    gives no tree), nesting included past the 128 levels ckpt reads."""
    import random

    import fuzz_lib as F

    seen = set()
    for seed in range(40):
        root = tmp_path / f"m{seed}"
        shutil.copytree(FIXTURES / "flax_msgpack", root)
        target = root / "checkpoint_2"
        new, desc = F.mutate_msgpack(random.Random(seed), target.read_bytes())
        if not desc.startswith("msgpack "):
            continue  # a byte-level mutation (the operator's fallback)
        kind = "root" if "root replaced" in desc else "key" if " key " in desc else \
            "nest" if "nested" in desc else "ext"
        seen.add(kind)
        target.write_bytes(new)
        if kind == "nest" and int(desc.split("nested ")[1].split()[0]) <= 127:
            continue  # within flax's and ckpt's nesting limits: a valid tree
        if kind == "root":
            assert not isinstance(orbax_restore(new), dict)  # no tree: nothing a restore can use
        elif kind != "nest":
            with pytest.raises(ValueError):  # strict_map_key, or "Unsupported msgpack code"
                orbax_restore(new)
        r = ckpt("validate", root, "--deep")
        assert r.returncode == 1, (desc, r.stdout)
    assert seen == {"root", "key", "nest", "ext"}
