"""Reading: `ckpt inspect --json` agrees with the writing library's own reader (keys, kinds, shapes,
dtypes), every value ckpt reads is the value that library restores (or restored, where it is
recorded beside the fixture), and `ckpt validate --strict` / `--deep --strict` pass, on every fixture of every
registered format (catalogue.cases())."""
from __future__ import annotations

import pytest

import catalogue as C
import references as R
from ckpt_inproc import ckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CASES = C.cases()


def _step_args(e: C.Entry) -> list[str]:
    return ["--step", e.step] if e.step else []


def inspect_agrees(e: C.Entry, root=C.FIXTURES) -> None:  # noqa: ANN001
    """The property, callable on any entry (also the throwaway format's)."""
    r = ckpt("inspect", "--json", e.full(root), *_step_args(e))
    assert r.returncode == 0, r.stderr
    doc = r.json()
    assert doc["committed"] is True
    want = e.reference(e.full(root), e.step)
    assert want, f"the reference of {e.id} is empty"
    named = any(k[0] == "name" and len(k) == 2 for k in want) and all(len(k) == 2 and k[0] == "name" for k in want)
    got = {}
    for leaf in doc["leaves"]:
        if named:
            key = ("name", leaf["name"])
        elif e.str_keys:
            key = tuple(str(k) for k in leaf["keys"])
        else:
            key = tuple(leaf["keys"])
        got[key] = leaf
    assert sorted(got, key=repr) == sorted(want, key=repr)
    for key, ref in want.items():
        leaf = got[key]
        assert leaf["kind"] == ref.kind, key
        if ref.kind == "array":
            assert (tuple(leaf["shape"]), leaf["dtype"]) == (ref.shape, ref.dtype), key
        elif ref.dtype is not None:
            assert leaf["dtype"] == ref.dtype, key


@pytest.mark.parametrize("entry", CASES, ids=[f"{e.format}-{e.id}" for e in CASES])
def test_inspect_agrees_with_the_writing_library(entry):
    inspect_agrees(entry)


def values_agree(e: C.Entry, root=C.FIXTURES) -> None:  # noqa: ANN001
    import ckpt_tool

    load = e.library_values()
    assert load is not None, f"{e.id}: no library values loader"
    want = load(e.full(root), e.step)
    assert want, f"{e.id}: the library restored nothing"
    named = all(len(k) == 2 and k[0] == "name" for k in want)
    ours = {}
    for leaf in ckpt_tool.open(str(e.full(root)), step=e.step).leaves:
        key = R.by_name(leaf.name) if named else tuple(str(k) for k in leaf.keys) if e.str_keys else tuple(leaf.keys)
        value = leaf.read() if leaf.kind == "array" else leaf.load()
        if key not in want and R.empty_subtree(value) and e.drops_empty:
            continue  # the library (jax's tree flattening) restores no leaf for None / empty containers
        ours[key] = value
    assert sorted(ours, key=repr) == sorted(want, key=repr)
    for key, value in want.items():
        assert R.equal(ours[key], value), (key, ours[key], value)


@pytest.mark.parametrize("entry", CASES, ids=[f"{e.format}-{e.id}" for e in CASES])
def test_values_agree_with_the_writing_library(entry):
    values_agree(entry)


def validate_passes(e: C.Entry, deep: bool, root=C.FIXTURES) -> None:  # noqa: ANN001
    r = ckpt("validate", "--strict", *(["--deep"] if deep else []), e.full(root), *_step_args(e))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not r.stderr.strip()


@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
@pytest.mark.parametrize("entry", CASES, ids=[f"{e.format}-{e.id}" for e in CASES])
def test_validate_strict_passes(entry, deep):
    validate_passes(entry, deep)
