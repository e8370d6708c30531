"""Converting: every fixture of every registered format, converted to every format with a writer,
(1) says `same` to `ckpt diff --values` against its source and is a good checkpoint itself;
also (2) the target library's own
loader (orbax restore / dcp_to_torch_save + torch.load / safetensors safe_open) reads exactly
the values ckpt reads from it, and (3) converted back to the source's format it says `same`.

Leaves a target cannot hold (e.g. a string in safetensors) are left out with --skip-unsupported:
they must be non-array leaves, and exactly the leaves `diff` reports as only in the source.
Each (fixture, target) is converted once per session (the `converted` fixture)."""
from __future__ import annotations

import re

import numpy as np
import pytest

import catalogue as C
import references as R
from ckpt_inproc import ckpt

CASES = C.cases()
TARGETS = C.writable()
# (entry, target) pairs the target holds; the way back needs a writer of the source's format that
# takes the target's checkpoints (msgpack has none: its fixtures go one way)
PAIRS = [(e, to) for e in CASES for to in TARGETS if to not in C.refusals(e)]
BACK = [(e, to) for e, to in PAIRS if e.format in TARGETS and C.takes(e.format, to) and C.converts_exactly(e, to)]


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)


def _step(e: C.Entry, flag: str = "--step") -> list[str]:
    return [flag, e.step] if e.step else []


class Conversions:
    def __init__(self, base) -> None:  # noqa: ANN001
        self.base = base
        self.done: dict[tuple, tuple] = {}

    def get(self, e: C.Entry, to: str, root=C.FIXTURES):  # noqa: ANN001, ANN201
        """(convert's JSON summary, output path) of entry e converted to `to` (cached)."""
        key = (str(root), e.id, to)
        if key not in self.done:
            dst = self.base / f"{_safe(e.id)}--{to}"
            r = ckpt("convert", e.full(root), dst, "--to", to, "--skip-unsupported", "--json", *_step(e))
            assert r.returncode == 0, r.stderr
            self.done[key] = (r.json(), dst)
        return self.done[key]

    def back(self, e: C.Entry, to: str, root=C.FIXTURES):  # noqa: ANN001, ANN201
        key = (str(root), e.id, to, "back")
        if key not in self.done:
            _, mid = self.get(e, to, root)
            dst = self.base / f"{_safe(e.id)}--{to}--back-{e.format}"
            r = ckpt("convert", mid, dst, "--to", e.format, "--skip-unsupported", "--json")
            assert r.returncode == 0, r.stderr
            self.done[key] = (r.json(), dst)
        return self.done[key]


@pytest.fixture(scope="session")
def conversions(tmp_path_factory):
    return Conversions(tmp_path_factory.mktemp("conformance-convert"))


def _kinds(path, step=None) -> dict[str, str]:  # noqa: ANN001
    r = ckpt("inspect", "--json", path, *(["--step", step] if step else []))
    assert r.returncode == 0, r.stderr
    return {leaf["name"]: leaf["kind"] for leaf in r.json()["leaves"]} | {
        "/".join(map(str, leaf["keys"])): leaf["kind"] for leaf in r.json()["leaves"]}


def diff_says_same(src, dst, summary: dict, e: C.Entry) -> None:  # noqa: ANN001
    """`ckpt diff --values SRC DST`: same, or only the leaves convert reported skipped (only in SRC)."""
    skipped = sorted(s["leaf"] for s in summary["skipped"])
    kinds = _kinds(src, e.step)
    assert all(kinds.get(s) == "value" for s in skipped), f"arrays left out: {skipped}"
    r = ckpt("diff", "--values", "--json", src, dst, *_step(e, "--step-a"))
    doc = r.json()
    if not skipped:
        assert r.returncode == 0 and doc["same"], doc["differences"]
    else:
        assert sorted((d["path"], d["kind"]) for d in doc["differences"]) == [(s, "only_a") for s in skipped]


@pytest.mark.slow
@pytest.mark.parametrize("to", TARGETS)
@pytest.mark.parametrize("entry", CASES, ids=[f"{e.format}-{e.id}" for e in CASES])
def test_converted_says_same_and_validates(entry, to, conversions, tmp_path):
    refusal = C.refusals(entry).get(to)
    if refusal is not None:  # an array (or a source) the target cannot take: refused in one line, nothing written
        r = ckpt("convert", entry.full(), tmp_path / "out", "--to", to, "--skip-unsupported", *_step(entry))
        assert r.returncode == 1 and len(r.stderr_lines) == 1 and refusal in r.stderr, r.stderr
        assert not list(tmp_path.iterdir())
        return
    summary, dst = conversions.get(entry, to)
    assert summary["target_format"] == to
    if C.converts_exactly(entry, to):
        diff_says_same(entry.full(), dst, summary, entry)
    r = ckpt("validate", "--strict", "--deep", dst)
    assert r.returncode == 0, r.stdout + r.stderr


def library_reads_what_ckpt_reads(fmt: str, path) -> int:  # noqa: ANN001
    """The target library's values of `path` == ckpt's; the number of leaves compared."""
    import ckpt_tool

    lib = C.library(fmt)
    got = lib.load(path)
    ours = {}
    for leaf in ckpt_tool.open(str(path)).leaves:
        key = R.by_name(leaf.name) if lib.named else tuple(leaf.keys)
        ours[key] = leaf.read() if leaf.kind == "array" else leaf.load()
        if lib.drops_empty and R.empty_subtree(ours[key]):
            del ours[key]  # a library that restores no leaf for None, [], {}, () (jax's tree flattening)
    assert sorted(got, key=repr) == sorted(ours, key=repr)
    for key, want in ours.items():
        value = got[key]
        if isinstance(want, np.ndarray) and not isinstance(value, np.ndarray):
            value = np.asarray(value, dtype=want.dtype)
        assert R.equal(value, want), key
    return len(ours)


@pytest.mark.slow
@pytest.mark.parametrize("entry, to", PAIRS, ids=[f"{e.format}-{e.id}-{to}" for e, to in PAIRS])
def test_target_library_loads_the_same_values(entry, to, conversions):
    _, dst = conversions.get(entry, to)
    assert library_reads_what_ckpt_reads(to, dst) > 0


@pytest.mark.parametrize("entry, to", BACK, ids=[f"{e.format}-{e.id}-{to}" for e, to in BACK])
def test_and_back_says_same(entry, to, conversions):
    first, _ = conversions.get(entry, to)
    summary, back = conversions.back(entry, to)
    lost = {s["leaf"] for s in first["skipped"]}
    summary = dict(summary, skipped=[*first["skipped"], *summary["skipped"]]) if lost else summary
    diff_says_same(entry.full(), back, summary, entry)
