"""A .zarray of the plain form tensorstore and orbax write is checked without tensorstore (issue 46:
an Orbax inspect then imports none): every such form is one tensorstore accepts, both as a spec and
as a stored file; any other form is still given to tensorstore, whose words the error keeps."""
from __future__ import annotations

import itertools
import json

import pytest
import tensorstore as ts

from conftest import FIXTURES

from ckpt_tool.machinery.arrays import schema


def _tensorstore_accepts(zmeta: dict) -> bool:
    try:
        ts.Spec({"driver": "zarr", "kvstore": {"driver": "memory"}, "metadata": zmeta})
    except ValueError:
        return False
    return schema._stored_metadata_problem("zarr", json.dumps(zmeta, sort_keys=True)) is None


def _forms():
    for dtype, comp, order, sep, (shape, chunks) in itertools.product(
            sorted(schema._PLAIN_ZARR2_DTYPES),
            [None, {"id": "zstd", "level": 0}, {"id": "zstd", "level": 1}, {"id": "zstd", "level": 22}],
            ["C", "F"], [None, ".", "/"],
            [([], []), ([64, 64], [64, 64]), ([3, 5, 7], [2, 5, 1]), ([0], [1]), ([10**9], [1 << 20]),
             ([2] * 32, [1] * 32)]):
        z = {"zarr_format": 2, "shape": shape, "chunks": chunks, "dtype": dtype, "compressor": comp,
             "fill_value": None, "order": order, "filters": None}
        if sep is not None:
            z["dimension_separator"] = sep
        yield z


def test_every_plain_form_is_one_tensorstore_opens():
    plain = 0
    for z in _forms():
        if schema._plain_zarr2(z):
            plain += 1
            assert _tensorstore_accepts(z), z
    assert plain > 1000


@pytest.mark.parametrize("change", [
    {"fill_value": 0}, {"fill_value": "NaN"}, {"filters": []}, {"compressor": {"id": "blosc", "cname": "lz4"}},
    {"compressor": {"id": "zstd", "level": 23}}, {"compressor": {"id": "zstd", "level": True}},
    {"compressor": {"id": "zstd"}}, {"dtype": ">f4"}, {"chunks": [1 << 16, 1 << 16]}, {"zarr_format": 2.0},
])
def test_other_forms_are_tensorstores_to_check(change):
    z = {"zarr_format": 2, "shape": [1 << 16, 1 << 16], "chunks": [64, 64], "dtype": "<f4",
         "compressor": {"id": "zstd", "level": 1}, "fill_value": None, "order": "C", "filters": None, **change}
    assert not schema._plain_zarr2(z) or not isinstance(z["zarr_format"], int)


def test_a_fixtures_zarray_files_are_plain():
    found = sorted(FIXTURES.glob("**/.zarray"))
    assert found
    for path in found:
        z = json.loads(path.read_text())
        if schema._plain_zarr2(z):
            assert _tensorstore_accepts({k: v for k, v in z.items() if k in schema._ZARR2_MEMBERS}), path


def test_a_bad_zarray_is_still_worded_by_tensorstore():
    z = {"zarr_format": 2, "shape": [4], "chunks": [4], "dtype": "<f4", "compressor": {"id": "zstd", "level": "x"},
         "fill_value": None, "order": "C", "filters": None}
    with pytest.raises(schema.SchemaError, match="tensorstore rejects it"):
        schema.parse_zarray(z, ".zarray")


# -- zarr3 (_plain_zarr3): the zarr.json tensorstore writes for orbax's one-chunk shards ------------------

def _zarr3_written_by_tensorstore(dtype: str, shape: list, chunks: list, level: int) -> dict:
    """The zarr.json tensorstore's zarr3 driver writes for orbax's spec of an array."""
    item = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": level}}]
    spec = {"driver": "zarr3", "kvstore": {"driver": "memory"}, "dtype": dtype, "metadata": {
        "shape": shape, "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": chunks, "codecs": item, "index_location": "end",
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]}}
    context = ts.Context()
    ts.open(spec, create=True, context=context).result()
    kv = ts.KvStore.open({"driver": "memory"}, context=context).result()
    return json.loads(kv.read("zarr.json").result().value)


def _zarr3_accepts(zmeta: dict) -> bool:
    try:
        ts.Spec({"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": zmeta})
    except ValueError:
        return False
    return schema._stored_metadata_problem("zarr3", json.dumps(zmeta, sort_keys=True)) is None


def test_every_zarr3_form_tensorstore_writes_for_orbax_is_plain_and_opened():
    n = 0
    for dtype, level, (shape, chunks) in itertools.product(
            sorted(schema._PLAIN_ZARR3_DTYPES), [0, 1, 3, 22],
            [([], []), ([64, 64], [64, 64]), ([3, 5, 7], [2, 5, 1]), ([0], [1]), ([10**9], [1 << 20]),
             ([2] * 31, [1] * 31)]):
        z = _zarr3_written_by_tensorstore(dtype, shape, chunks, level)
        assert schema._plain_zarr3(z), z
        assert _zarr3_accepts(z), z
        n += 1
    assert n == len(schema._PLAIN_ZARR3_DTYPES) * 4 * 6


@pytest.mark.parametrize("change", [
    lambda z: z.update(fill_value=1.0), lambda z: z.update(fill_value=0), lambda z: z.update(fill_value="NaN"),
    lambda z: z.update(attributes={}), lambda z: z.update(dimension_names=["a", "b"]),
    lambda z: z.update(data_type="float8_e3m4"), lambda z: z.update(zarr_format=3.0),
    lambda z: z.update(chunk_key_encoding={"name": "v2"}),
    lambda z: z["codecs"][0]["configuration"]["codecs"][1]["configuration"].update(level=23),
    lambda z: z["codecs"][0]["configuration"]["codecs"][1]["configuration"].update(checksum=True),
    lambda z: z["codecs"][0]["configuration"]["codecs"][0]["configuration"].update(endian="big"),
    lambda z: z["codecs"][0]["configuration"].update(chunk_shape=[2, 2]),
    lambda z: z["codecs"][0]["configuration"].update(index_location="start"),
    lambda z: z["chunk_grid"]["configuration"].update(chunk_shape=[1 << 16, 1 << 16]),
    lambda z: z.update(shape=[2] * 32) or z["chunk_grid"]["configuration"].update(chunk_shape=[1] * 32)
    or z["codecs"][0]["configuration"].update(chunk_shape=[1] * 32),  # (sharding_indexed's rank is at most 31)
])
def test_other_zarr3_forms_are_tensorstores_to_check(change):
    z = _zarr3_written_by_tensorstore("float32", [1 << 16, 1 << 16], [64, 64], 3)
    assert schema._plain_zarr3(z)
    change(z)
    assert not schema._plain_zarr3(z)


def test_a_bad_zarr_json_is_still_worded_by_tensorstore():
    z = _zarr3_written_by_tensorstore("float32", [4], [4], 3)
    z["codecs"][0]["configuration"]["codecs"][1]["configuration"]["level"] = "x"
    with pytest.raises(schema.SchemaError, match="tensorstore rejects it"):
        schema.parse_zarr_json(z, "zarr.json")
