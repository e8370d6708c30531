"""The Orbax writer's zarr metadata, derived per kind of array (formats/orbax/zarr_metadata.py),
is byte for byte what tensorstore writes for each array, and asks tensorstore a few times, not
once per array."""
from __future__ import annotations

import itertools

import pytest

from ckpt_tool.formats.orbax import write, zarr_metadata
from ckpt_tool.formats.orbax.write import _Leaf


def _specs(zarr3: bool, dtype: str, rank: int, count: int, base: int = 0) -> dict[str, dict]:
    out = {}
    for i in range(count):
        shape = tuple(((7 * i + 3 * d + base) % 41) * (1 + d) for d in range(rank))  # zero-length dims too
        chunks = tuple(max(1, (s + 1) // 2) for s in shape)
        leaf = _Leaf(keys=("p", str(i)), name=f"{dtype}.r{rank}.{base}.{i}", value_type="jax.Array",
                     shape=shape, dtype=dtype, chunk_shape=chunks, sharding=None)
        out[leaf.name] = write._memory_spec(leaf, zarr3)
    return out


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr2", "zarr3"])
def test_derived_metadata_is_tensorstores_for_every_array(zarr3, monkeypatch):
    zarr_metadata._KINDS.templates.clear()
    specs: dict[str, dict] = {}
    for dtype, rank in itertools.product(["bfloat16", "float32", "int32", "bool", "uint8"], [1, 2, 3]):
        specs.update(_specs(zarr3, dtype, rank, 12))
    specs.update(_specs(zarr3, "float32", 4, 1))  # a kind of one: asked with a probe of other shapes
    asked: list[int] = []
    real = zarr_metadata.from_tensorstore

    def counting(s, z):
        asked.append(len(s))
        return real(s, z)

    monkeypatch.setattr(zarr_metadata, "from_tensorstore", counting)
    got = zarr_metadata.metadata(specs, zarr3)
    monkeypatch.setattr(zarr_metadata, "from_tensorstore", real)
    assert got == real(specs, zarr3)
    assert sum(asked) == 16 * 2, asked  # two arrays of each kind, not 181
    # later arrays of a kind learnt are derived without asking again
    more = _specs(zarr3, "bfloat16", 2, 5, base=5)
    monkeypatch.setattr(zarr_metadata, "from_tensorstore", counting)
    asked.clear()
    assert zarr_metadata.metadata(more, zarr3) == real(more, zarr3)
    assert asked == []


def test_a_kind_whose_derivation_fails_its_check_is_asked_array_by_array(monkeypatch):
    """Were tensorstore's answer to depend on the shape beyond the shape fields, the second
    array's check catches it, and every array of the kind is asked of tensorstore."""
    zarr_metadata._KINDS.templates.clear()
    specs = _specs(False, "float32", 2, 6)
    real = zarr_metadata.from_tensorstore

    def shape_dependent(s, z):  # a stand-in tensorstore writing the shape's product in a field
        out = {}
        for name, data in real(s, z).items():
            n = 1
            for d in s[name]["metadata"]["shape"]:
                n *= d
            out[name] = data.replace(b'"order":"C"', f'"order":"C","n":{n}'.encode())
        return out

    monkeypatch.setattr(zarr_metadata, "from_tensorstore", shape_dependent)
    got = zarr_metadata.metadata(specs, False)
    assert got == shape_dependent(specs, False)
    assert zarr_metadata._KINDS.templates == {next(iter(zarr_metadata._KINDS.templates)): None}


def test_arrays_asked_one_at_a_time_are_derived_after_the_first(monkeypatch):
    """The planner asks array by array (stored_chunk_encoding): the first of a kind is checked on a
    probe of other shapes, and the rest of the kind is derived, still tensorstore's bytes."""
    zarr_metadata._KINDS.templates.clear()
    specs = _specs(True, "bfloat16", 2, 6)
    real = zarr_metadata.from_tensorstore
    asked: list[int] = []

    def counting(s, z):
        asked.append(len(s))
        return real(s, z)

    monkeypatch.setattr(zarr_metadata, "from_tensorstore", counting)
    got = {name: zarr_metadata.metadata({name: spec}, True)[name] for name, spec in specs.items()}
    monkeypatch.setattr(zarr_metadata, "from_tensorstore", real)
    assert got == real(specs, True)
    assert asked == [2]  # the first array and its probe, once
