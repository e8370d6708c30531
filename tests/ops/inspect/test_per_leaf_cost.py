"""Per-leaf work of reading metadata (issue 46): what inspect does once per leaf is the work that
scales; text made for an error that is never raised, or a value parsed again per leaf, is not."""
from __future__ import annotations

from ckpt_tool.machinery.arrays import schema


def _tree(n: int) -> dict:
    return {"tree_metadata": {
        f"('layers', '{i}')": {"key_metadata": [{"key": "layers", "key_type": 2}, {"key": str(i), "key_type": 2}],
                               "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                                  "write_shape": [4, 8]}}
        for i in range(n)}}


def test_a_valid_tree_formats_no_error_text(monkeypatch):
    """orbax writes write_shape for every jax.Array: naming the field where an error would say it
    cost a formatted key (short_repr) per leaf, for an error never raised."""
    calls = []
    real = schema.short_repr
    monkeypatch.setattr(schema, "short_repr", lambda *a, **k: calls.append(a) or real(*a, **k))
    tree = schema.parse_tree_metadata(_tree(50), "_METADATA")
    assert len(tree.entries) == 50 and tree.entries[0][1].write_shape == (4, 8)
    assert calls == []


def test_the_error_still_names_the_field():
    doc = _tree(1)
    doc["tree_metadata"]["('layers', '0')"]["value_metadata"]["write_shape"] = [4, "x"]
    try:
        schema.parse_tree_metadata(doc, "_METADATA")
    except schema.SchemaError as exc:
        assert str(exc) == ("_METADATA: tree_metadata[\"('layers', '0')\"].write_shape: "
                            "entry 1 must be a non-negative integer, got 'x'")
        assert exc.field == "tree_metadata[\"('layers', '0')\"].write_shape"
    else:
        raise AssertionError("no SchemaError")


def test_the_fast_memory_bound_is_the_byte_count_bound_without_numpy():
    """fast_memory_bound counts cost classes with bytes.translate/count (no numpy on a DCP inspect):
    the same sum as numpy's per-byte-value count times each byte value's cost."""
    import os

    import numpy as np

    from ckpt_tool.machinery.torch_save import safe_pickle as sp

    cost = np.array(sp._FAST_COST, dtype=np.int64)
    for data in (b"", b"\x80\x04.", os.urandom(1000), os.urandom((1 << 22) + 17), bytes(range(256)) * 300):
        want = int(np.bincount(np.frombuffer(data, np.uint8), minlength=256) @ cost)
        want += sp.MAX_STACK_DEPTH * sp._SLOT + 2 * len(data)
        assert sp.fast_memory_bound(data) == want
        assert sp.fast_memory_bound(bytearray(data)) == want


def test_the_stored_itemsize_is_numpys_without_making_a_numpy_dtype():
    """codecs.stored_itemsize, asked per array by inspect, answers from the dtype table (no numpy
    dtype made, no ml_dtypes imported): the same size numpy gives, for every dtype in the table."""
    from ckpt_tool.core import codecs
    from ckpt_tool.base import dtypes

    for d in dtypes._TABLE:
        want = dtypes.numpy_dtype(d.name).itemsize
        if d.zarr2:
            assert codecs.stored_itemsize({"dtype": d.zarr2}, False) == want, d.name
        if d.zarr3:
            assert codecs.stored_itemsize({"data_type": d.zarr3}, True) == want, d.name
