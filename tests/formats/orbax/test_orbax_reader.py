"""The Orbax reader against orbax-checkpoint's own metadata and restore."""
from __future__ import annotations


import numpy as np
import pytest

import ckpt_tool
from ckpt_tool.core.model import ArrayLeaf
from ckpt_tool.storage import ReadLog

from conftest import ORBAX_FIXTURES, fixture_info, fixture_path
from library_reference import orbax_manager_reference, orbax_reference, orbax_values

PYTREE_FIXTURES = [n for n in ORBAX_FIXTURES if fixture_info(n).get("kind") != "manager"]


def _ours(ck) -> dict:
    out = {}
    for leaf in ck.leaves:
        if isinstance(leaf, ArrayLeaf):
            out[tuple(leaf.keys)] = (tuple(leaf.shape), leaf.dtype)
        elif leaf.value_type in ("scalar", "string"):
            out[tuple(leaf.keys)] = ((), leaf.dtype)
    return out


@pytest.mark.parametrize("name", PYTREE_FIXTURES)
def test_shapes_and_dtypes_match_orbax_metadata(name):
    ck = ckpt_tool.open(str(fixture_path(name)))
    assert ck.format == "orbax" and ck.committed
    assert _ours(ck) == orbax_reference(fixture_path(name))


def test_manager_root_matches_orbax():
    root = fixture_path("orbax_manager")
    ref = orbax_manager_reference(root)
    ck = ckpt_tool.open(str(root))
    committed = [s.step for s in ck.steps if s.committed]
    assert committed == ref["steps"]
    assert ck.step == ref["latest_step"]
    incomplete = [s.name for s in ck.steps if not s.committed]
    assert incomplete == ref["tmp_dirs"]
    for step in ref["steps"]:
        ck = ckpt_tool.open(str(root), step=step)
        expect = orbax_reference(root / str(step))
        ours = {k: v for k, v in _ours(ck).items() if k[0] != "config"}
        assert ours == expect


def test_manager_unknown_step_is_clear():
    # not-found, in the words every run root uses for a step it does not have
    with pytest.raises(ckpt_tool.CkptError, match=r"--step 99: no such step \(steps: 1, 2 committed; 3 in-progress\)"):
        ckpt_tool.open(str(fixture_path("orbax_manager")), step=99)


def test_incomplete_step_is_shown_as_uncommitted():
    root = fixture_path("orbax_manager")
    ck = ckpt_tool.open(str(root / fixture_info("orbax_manager")["incomplete_dirs"][0]))
    assert not ck.committed
    assert "uncommitted" in ck.notes[0]


@pytest.mark.parametrize("name", ORBAX_FIXTURES)
def test_values_match_orbax_restore(name):
    path = fixture_path(name)
    if fixture_info(name).get("kind") == "manager":
        ck = ckpt_tool.open(str(path), step=2)
        ref = orbax_values(path / "2")
    else:
        ck = ckpt_tool.open(str(path))
        ref = orbax_values(path)
    assert {tuple(leaf.keys) for leaf in ck.leaves} == set(ref)
    for leaf in ck.leaves:
        expected = ref[tuple(leaf.keys)]
        if isinstance(leaf, ArrayLeaf):
            got = leaf.read()
            assert got.dtype == np.asarray(expected).dtype, leaf.path
            np.testing.assert_array_equal(got, np.asarray(expected), err_msg=leaf.path)
        else:
            assert leaf.load() == expected, leaf.path


@pytest.mark.parametrize("name", PYTREE_FIXTURES)
def test_region_reads_match(name):
    ck = ckpt_tool.open(str(fixture_path(name)))
    for leaf in ck.arrays():
        if leaf.ndim == 0:
            continue
        full = leaf.read()
        region = tuple(slice(d // 3, max(d // 3 + 1, d - 1)) for d in leaf.shape)
        np.testing.assert_array_equal(leaf.read(region), full[region], err_msg=leaf.path)
        np.testing.assert_array_equal(leaf[0], full[0], err_msg=leaf.path)


@pytest.mark.parametrize("name", ORBAX_FIXTURES)
def test_open_reads_no_array_chunk(name):
    from ckpt_tool.formats import open_checkpoint

    log = ReadLog()
    open_checkpoint(str(fixture_path(name)), log=log)
    metadata_names = {"_CHECKPOINT_METADATA", "_METADATA", "_sharding", ".zarray", "zarr.json", "metadata"}
    for key in log.reads:
        assert key.rsplit("/", 1)[-1] in metadata_names, f"read a non-metadata key: {key}"


def test_sharding_recorded():
    ck = ckpt_tool.open(str(fixture_path("orbax_two_process")))
    named = [leaf for leaf in ck.arrays() if leaf.sharding and leaf.sharding.kind == "named"]
    assert named
    for leaf in named:
        assert leaf.sharding.mesh_shape == (2, 4)
        # CPU device ids of the second process start at 2048 in jax
        assert len(set(leaf.sharding.device_ids)) == 8
    assert ck.layout["processes"] == 2


def test_chunk_shape_is_per_device_shard():
    ck = ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr2")))
    for leaf in ck.arrays():
        s = leaf.sharding
        if s is None or s.kind != "named" or not leaf.shape:
            continue
        sizes = dict(zip(s.axis_names, s.mesh_shape))
        expect = []
        for dim, spec in zip(leaf.shape, list(s.partition_spec) + [None] * leaf.ndim):
            axes = spec if isinstance(spec, tuple) else (spec,) if spec else ()
            div = int(np.prod([sizes[a] for a in axes])) if axes else 1
            expect.append(dim // div)
        # the chunk is the per-device shard, further split along a dimension
        # when replicas write in parallel: it always divides the shard
        for got, want in zip(leaf.chunk_shape, expect):
            assert want % got == 0, leaf.path


def test_unmerged_ocdbt_still_reads(copy_fixture):
    path = copy_fixture("orbax_two_process")
    (path / "manifest.ocdbt").unlink()
    ck = ckpt_tool.open(str(path))
    assert ck.layout["ocdbt"] == "unmerged"
    assert any("unmerged" in n for n in ck.notes)
    assert ck.arrays()


def test_corrupt_metadata_is_one_clear_error(copy_fixture):
    path = copy_fixture("orbax_ocdbt_zarr2")
    (path / "_METADATA").write_text("{not json")
    with pytest.raises(ckpt_tool.CkptError, match=r"_METADATA: invalid JSON"):
        ckpt_tool.open(str(path))


def test_arrays_of_one_zarr_metadata_share_their_grid():
    """Arrays whose zarr metadata is one text share one RegularGrid, as they share its parse:
    inspect makes one text for leaves alike, found by their layout object (issue 46)."""
    ck = ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr3")))
    arrays = [leaf for leaf in ck.leaves if isinstance(leaf, ArrayLeaf)]
    by_shape: dict = {}
    for leaf in arrays:
        by_shape.setdefault((leaf.shape, leaf.dtype, leaf.layout.chunk_shape), []).append(leaf)
    alike = [group for group in by_shape.values() if len(group) > 1]
    assert alike, "the fixture has arrays saved alike"
    assert len({id(leaf.layout) for leaf in arrays}) < len(arrays)
    for group in alike:
        assert len({id(leaf.layout) for leaf in group}) == 1, [leaf.name for leaf in group]
