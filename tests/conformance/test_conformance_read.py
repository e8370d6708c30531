"""Reading: `ckpt inspect --json` agrees with the writing library's own reader (keys, kinds, shapes,
dtypes), and `ckpt validate --strict` / `--deep --strict` pass, on every fixture of every
registered format (catalogue.cases())."""
from __future__ import annotations

import pytest

import catalogue as C
from ckpt_inproc import ckpt

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


def validate_passes(e: C.Entry, deep: bool, root=C.FIXTURES) -> None:  # noqa: ANN001
    r = ckpt("validate", "--strict", *(["--deep"] if deep else []), e.full(root), *_step_args(e))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not r.stderr.strip()


@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
@pytest.mark.parametrize("entry", CASES, ids=[f"{e.format}-{e.id}" for e in CASES])
def test_validate_strict_passes(entry, deep):
    validate_passes(entry, deep)
