"""`ckpt diff --cast-ok` checks a cast conversion (issue 18, item 13), and
`diff --json` records the step each side was read at (item 15).

The cast is a real `ckpt convert --to safetensors --dtype bfloat16`; the
expected differences are computed from the files as safetensors (torch)
loads them, not by ckpt.
"""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ckpt_tool
from ckpt_tool.ops import diff as diff_module
from ckpt_tool.cli.main import _run
from ckpt_tool.ops.diff import diff_checkpoints

from conftest import fixture_path

LLAMA = fixture_path("safetensors_llama_sharded")


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _run([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def _tensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors directory as float64, read by safetensors (torch: bfloat16 too)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for name in s.keys():
                out[name] = s.get_tensor(name).to(torch.float64).numpy()
    return out


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    dst = tmp_path_factory.mktemp("cast") / "llama_bf16"
    code, _, err = _cli("convert", LLAMA, dst, "--to", "safetensors", "--dtype", "bfloat16")
    assert code == 0, err
    return dst


def test_without_the_option_a_cast_is_21_dtype_differences(bf16):
    # today's behaviour, unchanged: the dtype change is the difference, values are not compared
    code, out, _ = _cli("diff", LLAMA, bf16, "--values", "--atol", "1e-2", "--json")
    assert code == 1
    doc = json.loads(out)
    assert [d["kind"] for d in doc["differences"]] == ["dtype"] * 21
    assert doc["casts"] == [] and doc["cast_ok"] is False


def test_cast_ok_within_tolerance_is_same(bf16):
    code, out, err = _cli("diff", LLAMA, bf16, "--values", "--cast-ok", "--atol", "1e-2")
    assert code == 0, out + err
    lines = out.strip().splitlines()
    # the dtype change once, then the verdict
    assert lines == [
        "cast     21 leaves float32 in A, bfloat16 in B (--cast-ok): compared by value in float64",
        "same: 21 leaves and values match",
    ]


def test_cast_ok_without_tolerance_names_the_value_differences(bf16):
    a, b = _tensors(LLAMA), _tensors(bf16)
    assert {n: v.dtype for n, v in a.items()} == {n: np.dtype("float64") for n in a}  # both read as float64
    code, out, err = _cli("diff", LLAMA, bf16, "--values", "--cast-ok", "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["casts"] == [{"a": "float32", "b": "bfloat16", "leaves": 21, "paths": sorted(n.replace(".", "/") for n in a)}]
    got = {d["path"]: d for d in doc["differences"]}
    assert {d["kind"] for d in got.values()} == {"values"}
    # exactly the leaves whose values the cast changed, with the counts and maxima numpy finds
    want = {n.replace(".", "/"): (a[n], b[n]) for n in a if not np.array_equal(a[n], b[n])}
    assert set(got) == set(want) and 0 < len(want) < 21
    for path, (va, vb) in want.items():
        d = got[path]
        assert d["mismatched"] == int(np.count_nonzero(va != vb))
        assert d["max_abs"] == pytest.approx(float(np.max(np.abs(va - vb))))
    # the same with an explicit --atol 0, in the text output
    code, out, _ = _cli("diff", LLAMA, bf16, "--values", "--cast-ok", "--atol", "0")
    assert code == 1
    line = next(l for l in out.splitlines() if l.startswith("values") and "model/layers/0/mlp/up_proj/weight" in l)
    va, vb = want["model/layers/0/mlp/up_proj/weight"]
    assert f"{np.count_nonzero(va != vb)} of {va.size} elements differ" in line


def test_cast_ok_a_tolerance_too_small_still_fails(bf16):
    # bfloat16 keeps 8 bits of mantissa: a relative tolerance below 2^-9 cannot hold for every element
    code, out, _ = _cli("diff", LLAMA, bf16, "--values", "--cast-ok", "--rtol", "1e-4")
    assert code == 1
    code, out, _ = _cli("diff", LLAMA, bf16, "--values", "--cast-ok", "--rtol", str(2.0**-8))
    assert code == 0, out


def test_cast_ok_structure_only_accepts_floating_changes_only(tmp_path):
    # an expected structure edited by hand: a float leaf recorded as bfloat16 is a cast,
    # an integer leaf recorded as float32 is not
    src = fixture_path("orbax_ocdbt_zarr2")
    code, out, _ = _cli("inspect", src, "--json")
    doc = json.loads(out)
    for leaf in doc["leaves"]:
        if leaf["keys"] == ["params", "dense", "kernel"]:
            leaf["dtype"] = "bfloat16"
        if leaf["keys"] == ["counters", "int64"]:
            leaf["dtype"] = "float64"
    expected = tmp_path / "expected.json"
    expected.write_text(json.dumps(doc))
    code, out, _ = _cli("diff", src, expected, "--cast-ok", "--json")
    assert code == 1
    report = json.loads(out)
    assert [(d["path"], d["kind"]) for d in report["differences"]] == [("counters/int64", "dtype")]
    assert report["casts"] == [{"a": "float32", "b": "bfloat16", "leaves": 1, "paths": ["params/dense/kernel"]}]


def test_cast_comparison_counts_its_float64_copies_in_the_budget(bf16, monkeypatch):
    """Every block of a cast pair is compared in float64 (no byte-equal shortcut): its
    working copies are the want's `extra`, within the budget; same-dtype pairs add none."""
    seen = []
    real = diff_module.Scheduler

    class Recording(real):  # type: ignore[misc,valid-type]
        def __init__(self, wants, **kw):
            seen.extend(wants)
            super().__init__(wants, **kw)

    monkeypatch.setattr(diff_module, "Scheduler", Recording)
    memory = 16 * 2**20
    a, b = ckpt_tool.open(str(LLAMA)), ckpt_tool.open(str(bf16))
    report = diff_checkpoints(a, b, values=True, cast_ok=True, atol=1e-2, memory=memory)
    assert report.same and len(report.casts) == 1
    assert len(seen) == 21 and all(0 < w.extra <= memory // 8 for w in seen)
    for w in seen:  # 56 bytes per element compared (float64 copies of both sides and the difference)
        (leaf, region), = w.parts[:1]
        n = int(np.prod([r.stop - r.start for r in region]))
        assert w.extra == n * diff_module._COMPARE_BYTES
    seen.clear()
    assert diff_checkpoints(a, a, values=True, memory=memory).same
    assert seen and all(w.extra == 0 for w in seen)


def test_compare_pieces_scale_with_the_budget():
    assert diff_module._compare_elements(16 * 2**20) * diff_module._COMPARE_BYTES <= 2 * 2**20
    assert diff_module._compare_elements(2**40) == diff_module._COMPARE_ELEMENTS


# --- steps in diff --json ------------------------------------------------------------


def test_diff_json_records_the_steps():
    root = fixture_path("orbax_manager")
    steps = [s.step for s in ckpt_tool.open(str(root)).steps if s.committed]
    latest = max(steps)
    code, out, err = _cli("diff", root, root, "--step-a", str(min(steps)), "--json")
    assert code in (0, 1), err
    doc = json.loads(out)
    assert doc["steps"] == {"a": {"requested": str(min(steps)), "step": min(steps)},
                            "b": {"requested": None, "step": latest}}
    code, out, err = _cli("diff", root, root, "--step", "latest", "--json")
    assert code == 0, err
    assert json.loads(out)["steps"] == {"a": {"requested": "latest", "step": latest},
                                         "b": {"requested": "latest", "step": latest}}
    # a checkpoint that is not a root: no step asked, none recorded
    code, out, _ = _cli("diff", LLAMA, LLAMA, "--json")
    assert json.loads(out)["steps"] == {"a": {"requested": None, "step": None}, "b": {"requested": None, "step": None}}
