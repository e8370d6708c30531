"""The Orbax writer's zarr metadata (formats/orbax/zarr_metadata.py) is byte for byte what
tensorstore writes for each array: generated without tensorstore for orbax's specs (every dtype,
odd shapes, zarr v2 and zarr3), and for any other spec (or with CKPT_ZARR_METADATA=tensorstore)
derived per kind of array, asking tensorstore a few times, not once per array. 0-d values are
written without tensorstore and restored by orbax."""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from ckpt_tool.core.model import RegularGrid
from ckpt_tool.core.write_plan import TargetArray, TargetValue, WritePlan
from ckpt_tool.formats.orbax import write, zarr_metadata
from ckpt_tool.formats.orbax.write import OrbaxWriter, _Leaf
from ckpt_tool.storage import Storage


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
    monkeypatch.setenv("CKPT_ZARR_METADATA", "tensorstore")  # (the derivation, for specs generate() does not know)
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
    monkeypatch.setenv("CKPT_ZARR_METADATA", "tensorstore")  # (the derivation, for specs generate() does not know)
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
    monkeypatch.setenv("CKPT_ZARR_METADATA", "tensorstore")  # (the derivation, for specs generate() does not know)
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


# -- generated without tensorstore (zarr_metadata.generate) -------------------------------------------

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
          "float32", "float64", "bfloat16", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
          "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz"]
# (shape, chunks): 0-d, zero-length dimensions, a chunk larger than its array, large extents, rank 7
SHAPES = [((), ()), ((1,), (1,)), ((3, 5), (3, 5)), ((0,), (1,)), ((0, 4), (2, 9)), ((7,), (100,)),
          ((2**40, 3), (2**31, 1)), ((5, 0, 3), (2, 1, 3)), ((1, 2, 1, 2, 1, 2, 1), (1, 1, 1, 1, 1, 1, 1))]


def _spec(zarr3: bool, dtype: str, shape: tuple, chunks: tuple, name: str = "a") -> dict:
    leaf = _Leaf(keys=(name,), name=name, value_type="jax.Array", shape=shape, dtype=dtype, chunk_shape=chunks,
                 sharding=None)
    return write._memory_spec(leaf, zarr3)


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr2", "zarr3"])
def test_generated_metadata_is_tensorstores_for_every_dtype_and_shape(zarr3):
    specs = {f"{dtype}{i}": _spec(zarr3, dtype, shape, chunks)
             for dtype in DTYPES for i, (shape, chunks) in enumerate(SHAPES)}
    theirs = zarr_metadata.from_tensorstore(specs, zarr3)
    for name, spec in specs.items():
        assert zarr_metadata.generate(spec, zarr3) == theirs[name], name


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr2", "zarr3"])
def test_a_spec_of_another_form_is_asked_of_tensorstore(zarr3, monkeypatch):
    """generate() writes orbax's specs only: another key, level, dtype or shape type goes to
    tensorstore, whose answer metadata() returns."""
    base = _spec(zarr3, "float32", (4, 6), (2, 3))
    meta = base["metadata"]
    others = {
        "int4": _spec(zarr3, "int4", (4, 6), (2, 3)),  # a dtype left to tensorstore
        "fill": {**base, "metadata": {**meta, "fill_value": 1.5, **({"data_type": "float32"} if zarr3 else {"dtype": "<f4"})}},
        "attrs": {**base, "metadata": {**meta, "attributes": {"a": 1}} if zarr3 else {**meta, "order": "F"}},
        "driver_key": {**base, "recheck_cached_data": False},
    }
    if zarr3:
        conf = meta["codecs"][0]["configuration"]
        others["level"] = {**base, "metadata": {**meta, "codecs": [{**meta["codecs"][0], "configuration": {
            **conf, "codecs": [conf["codecs"][0], {"name": "zstd", "configuration": {"level": 5}}]}}]}}
        others["big_endian"] = {**base, "metadata": {**meta, "codecs": [{**meta["codecs"][0], "configuration": {
            **conf, "codecs": [{"name": "bytes", "configuration": {"endian": "big"}}, conf["codecs"][1]]}}]}}
    else:
        others["level"] = {**base, "metadata": {**meta, "compressor": {"id": "zstd", "level": 5}}}
        others["blosc"] = {**base, "metadata": {**meta, "compressor": {"id": "blosc", "cname": "lz4", "clevel": 5,
                                                                        "shuffle": 1}}}
    assert zarr_metadata.generate(base, zarr3) is not None
    for name, spec in others.items():
        assert zarr_metadata.generate(spec, zarr3) is None, name
    asked: list[str] = []
    real = zarr_metadata.from_tensorstore

    def counting(s, z):
        asked.extend(s)
        return real(s, z)

    monkeypatch.setattr(zarr_metadata, "from_tensorstore", counting)
    zarr_metadata._KINDS.templates.clear()
    got = zarr_metadata.metadata({"base": base, **others}, zarr3)
    assert got == real({"base": base, **others}, zarr3)
    assert "base" not in asked and set(others) <= set(asked)


def test_the_switch_back_asks_tensorstore(monkeypatch):
    """CKPT_ZARR_METADATA=tensorstore: every array's metadata from tensorstore, as before (A/B)."""
    specs = {f"{dtype}": _spec(False, dtype, (3, 5), (3, 5)) for dtype in DTYPES}
    asked: list[str] = []
    real = zarr_metadata.from_tensorstore
    monkeypatch.setattr(zarr_metadata, "from_tensorstore", lambda s, z: asked.extend(s) or real(s, z))
    zarr_metadata._KINDS.templates.clear()
    assert zarr_metadata.metadata(specs, False) == real(specs, False)
    assert asked == []
    monkeypatch.setenv("CKPT_ZARR_METADATA", "tensorstore")
    assert zarr_metadata.metadata(specs, False) == real(specs, False)
    assert asked


# 0-d values of every kind the writer stores: numbers (orbax's ScalarHandler) and 0-d arrays
SCALARS = [("flag", True), ("count", 7), ("lr", 0.5), ("z", complex(1, -2)), ("i8", np.int8(-3)),
           ("u64", np.uint64(2**63 + 5)), ("f16", np.float16(1.5)), ("f64", np.float64("nan")),
           ("i16", np.int16(-300)), ("u32", np.uint32(4_000_000_000)), ("c128", np.complex128(3 - 4j))]
ZERO_D = [("bf16", np.array(2.5, ml_dtypes.bfloat16)), ("f8", np.array(0.5, ml_dtypes.float8_e4m3fn)),
          ("f32", np.array(-1.25, np.float32)), ("b", np.array(False)), ("u8", np.array(200, np.uint8))]


def _write_zero_d(path) -> None:
    targets: list = [TargetValue((k,), k, v, "scalar") for k, v in SCALARS]
    targets += [TargetArray((k,), k, (), v.dtype.name, RegularGrid(()), None) for k, v in ZERO_D]
    targets.append(TargetArray(("w",), "w", (3, 4), "float32", RegularGrid((2, 4)), None))
    plan = WritePlan(targets)
    writer = OrbaxWriter(Storage.create(str(path)), zarr3=path.name.endswith("3"))
    writer.begin(plan)
    for k, v in ZERO_D:
        writer.write_array(next(t for t in plan.arrays() if t.keys == (k,)), 0, (), v)
    w = next(t for t in plan.arrays() if t.keys == ("w",))
    writer.write_array(w, 0, (slice(0, 2), slice(0, 4)), np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_array(w, 1, (slice(2, 3), slice(0, 4)), np.arange(8, 12, dtype=np.float32).reshape(1, 4))
    for value in plan.values():
        writer.write_value(value)
    writer.finish_process()
    writer.commit()


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr2", "zarr3"])
def test_zero_d_values_are_written_without_tensorstore_and_restored_by_orbax(zarr3, tmp_path, monkeypatch):
    """The metadata and the one chunk of each 0-d value are ckpt's (no ts.open in the writer), byte
    for byte the database tensorstore's path writes (CKPT_ZARR_METADATA=tensorstore), and orbax
    restores every value."""
    import tensorstore as ts

    from tests.library_reference import orbax_values

    suffix = "3" if zarr3 else "2"
    monkeypatch.setenv("CKPT_ZARR_METADATA", "tensorstore")
    _write_zero_d(tmp_path / f"ts{suffix}")
    monkeypatch.delenv("CKPT_ZARR_METADATA")
    opened: list = []
    real_open = ts.open
    monkeypatch.setattr(ts, "open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    _write_zero_d(tmp_path / f"ckpt{suffix}")
    monkeypatch.setattr(ts, "open", real_open)
    assert opened == []

    def entries(root) -> dict[bytes, bytes]:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{root}/"}).result()
        return {k: kv.read(k).result().value for k in kv.list().result()}

    theirs, ours = entries(tmp_path / f"ts{suffix}"), entries(tmp_path / f"ckpt{suffix}")
    assert sorted(ours) == sorted(theirs)
    zero_d = [k for k in theirs if k.split(b"/")[-1] in (b"0", b"c", b".zarray", b"zarr.json")
              and not k.startswith(b"w/")]
    assert len(zero_d) == 2 * (len(SCALARS) + len(ZERO_D))
    for key in zero_d:
        assert ours[key] == theirs[key], key
    got = orbax_values(tmp_path / f"ckpt{suffix}")
    for k, v in [*SCALARS, *ZERO_D]:  # (orbax gives numbers back as Python's: compared in the stored dtype)
        want = np.asarray(v)
        assert np.asarray(got[(k,)]).astype(want.dtype).tobytes() == want.tobytes(), k
    assert np.asarray(got[("w",)]).tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
