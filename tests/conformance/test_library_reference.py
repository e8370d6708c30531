"""Smoke tests: the library-reference helpers work on the sample fixtures (conftest.SAMPLE_FIXTURES).

These need jax / orbax-checkpoint / torch (the [test] extra); they are skipped
where those are missing.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from conftest import SAMPLE_FIXTURES, fixture_info
from library_reference import (
    dcp_chunks,
    dcp_keys,
    dcp_reference,
    dcp_storage,
    dcp_values,
    fixture_path,
    orbax_manager_reference,
    orbax_reference,
    orbax_values,
)

# the sample of the fixture catalogue (conftest.SAMPLE_FIXTURES), with each one's facts
SAMPLE = [fixture_info(name) for name in SAMPLE_FIXTURES]
ORBAX = [f for f in SAMPLE if f["format"] == "orbax"]
DCP = [f for f in SAMPLE if f["format"] == "dcp"]


def _ids(entries):
    return [e["name"] for e in entries]


def test_the_sample_lists_existing_fixtures():
    assert {f["format"] for f in SAMPLE} == {"orbax", "dcp"}
    for f in SAMPLE:
        assert os.path.isdir(fixture_path(f["name"])), f["name"]


def _orbax_targets(entry):
    """Directories that orbax_reference / orbax_values accept for a fixture."""
    root = fixture_path(entry["name"])
    if entry.get("kind") == "manager":
        steps = [os.path.join(root, str(s)) for s in entry["steps"]]
        items = [os.path.join(root, d) for d in entry["item_dirs"]]
        return steps + items
    return [root]


def _check_value_matches(ref, val):
    shape, dtype = ref
    if dtype == "string":
        assert isinstance(val, str)
        return
    arr = np.asarray(val)
    assert arr.shape == shape
    if isinstance(val, np.ndarray):
        assert arr.dtype.name == dtype
    else:  # python scalar restored from a ScalarMetadata
        assert np.dtype(dtype).kind == arr.dtype.kind or (
            np.dtype(dtype).kind in "iu" and arr.dtype.kind in "iu"
        )


@pytest.fixture(scope="module")
def _needs_orbax():
    pytest.importorskip("jax")
    pytest.importorskip("orbax.checkpoint")


@pytest.fixture(scope="module")
def _needs_torch():
    pytest.importorskip("torch")


@pytest.mark.parametrize("entry", ORBAX, ids=_ids(ORBAX))
def test_orbax_reference_and_values(entry, _needs_orbax):
    for target in _orbax_targets(entry):
        ref = orbax_reference(target)
        vals = orbax_values(target)
        assert ref, target
        assert vals, target
        # every metadata leaf restores, with the advertised shape and dtype
        assert set(ref) <= set(vals), set(ref) ^ set(vals)
        for k, r in ref.items():
            _check_value_matches(r, vals[k])
        dtypes = {d for _, d in ref.values()}
        assert {"float32", "bfloat16", "int64", "bool"} <= dtypes, dtypes
        if entry.get("strings") and entry.get("kind") != "manager":
            assert "string" in dtypes
        # list indices are ints
        assert any(isinstance(e, int) for k in ref for e in k)


def test_orbax_manager_reference(_needs_orbax):
    (entry,) = [e for e in ORBAX if e.get("kind") == "manager"]
    info = orbax_manager_reference(fixture_path(entry["name"]))
    assert info["steps"] == entry["steps"]
    assert info["latest_step"] == max(entry["steps"])
    assert info["tmp_dirs"] == entry["incomplete_dirs"]
    assert info["root_metadata"]
    # the unfinished step is still readable through the step-dir helper
    ref = orbax_reference(os.path.join(fixture_path(entry["name"]), entry["incomplete_dirs"][0]))
    assert ref


def test_orbax_two_process_restores_on_one_process(_needs_orbax):
    vals = orbax_values(fixture_path("orbax_two_process"))
    kernel = vals[("params", "dense", "kernel")]
    assert kernel.shape == (16, 8) and kernel.dtype == np.float32
    assert np.isfinite(kernel).all() and kernel.std() > 0


@pytest.mark.parametrize("entry", DCP, ids=_ids(DCP))
def test_dcp_reference_and_values(entry, _needs_torch):
    path = fixture_path(entry["name"])
    ref = dcp_reference(path)
    vals = dcp_values(path)
    chunks = dcp_chunks(path)
    keys = dcp_keys(path)
    storage = dcp_storage(path)
    assert ref and vals and chunks and storage
    assert set(ref) == set(vals)
    assert set(keys.values()) == set(ref)
    files = {f for f, _, _ in storage.values()}
    assert files == set(entry["files"])
    for fqn, kp in keys.items():
        r = ref[kp]
        if r is None:
            assert fqn not in chunks
            continue
        shape, dtype = r
        v = vals[kp]
        assert v.shape == shape and v.dtype.name == dtype, (fqn, v.shape, v.dtype)
        # chunks lie inside the tensor; non-overlapping chunks tile it
        vol = 0
        for offs, sizes in chunks[fqn]:
            assert len(offs) == len(sizes) == len(shape)
            assert all(o + s <= d or s == 0 for o, s, d in zip(offs, sizes, shape))
            vol += math.prod(sizes)
        assert vol == math.prod(shape), (fqn, chunks[fqn])
    dtypes = {r[1] for r in ref.values() if r}
    assert {"float32", "bfloat16", "float16", "int64", "bool"} <= dtypes
    assert any(r is None for r in ref.values())


def test_dcp_list_index_keys(_needs_torch):
    ref = dcp_reference(fixture_path("dcp_single"))
    assert ("history", 0) in ref and ref[("history", 0)] == ((3,), "float32")
    assert ("model", "layers", "0", "w") in ref  # dict key '0' stays a str
    assert ref[("milestones",)] is None  # list without tensors: one bytes item
    assert ref[("model", "fp8")] == ((4, 4), "float8_e4m3fn")
    vals = dcp_values(fixture_path("dcp_single"))
    assert vals[("milestones",)] == [100, 200]
    assert vals[("name",)] == "dcp-single-run"


def test_dcp_multirank_chunks(_needs_torch):
    path = fixture_path("dcp_multirank")
    chunks = dcp_chunks(path)
    assert sorted(chunks["model.uneven"]) == [((0, 0), (3, 3)), ((3, 0), (2, 3))]
    assert sorted(chunks["model.col"]) == [((0, 0), (3, 2)), ((0, 2), (3, 2))]
    assert len(chunks["model.rep"]) == 1
    assert ((1, 0), (0, 3)) in chunks["model.tiny"]  # empty shard on rank 1
    ref = dcp_reference(path)
    assert ("optim", "state", "model.w", "exp_avg") in ref
    vals = dcp_values(path)
    assert vals[("optim", "param_groups", 0, "betas")] == (0.9, 0.99)
