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


def _alike(n: int):
    """n array leaves of two shapes, each with its own Sharding object of one of two values, and
    a value leaf: what an Orbax reader gives inspect."""
    from ckpt_tool.core.model import ArrayLeaf, Checkpoint, RegularGrid, Sharding, ValueLeaf, constant_loader

    grids = [RegularGrid((4, 8)), RegularGrid((2,))]
    leaves: list = []
    for i in range(n):
        sharding = Sharding("named", mesh_shape=(2, 1), axis_names=("data", "model"),
                            partition_spec=("data" if i % 2 else None, None), device_ids=(0, 1))
        leaves.append(ArrayLeaf(("layers", str(i), "w"), f"layers.{i}.w", (4, 8) if i % 3 else (2,),
                                "float32" if i % 5 else "bfloat16", grids[0] if i % 3 else grids[1], sharding))
    leaves.append(ValueLeaf(("step",), "step", value_type="scalar", dtype="int64", loader=constant_loader(1)))
    ck = Checkpoint(path="memory://alike", format="orbax", layout={}, leaves=leaves, committed=True)
    return ck, leaves


def test_inspect_json_renders_equal_shardings_and_alike_leaves_once(monkeypatch):
    """inspect --json in a pipe writes each distinct sharding value once (json.dumps of its
    to_json()) and each distinct (shape, dtype, layout, sharding) text once: 300 leaves of 2
    sharding values and 4 kinds were 300 to_json calls and 600 nbytes/chunk_count property calls
    (issue 46). The text is still json.dumps' own."""
    import json

    from ckpt_tool.core.model import ArrayLeaf, Sharding
    from ckpt_tool.ops.inspect import InspectResult

    ck, leaves = _alike(300)
    expected = json.dumps({"ok": True, **InspectResult(ck, leaves, None, {}).to_json()}, default=str,
                          ensure_ascii=True)
    calls = {"to_json": 0, "nbytes": 0}
    real_to_json, real_nbytes = Sharding.to_json, ArrayLeaf.nbytes

    def to_json(self):
        calls["to_json"] += 1
        return real_to_json(self)

    def nbytes(self):
        calls["nbytes"] += 1
        return real_nbytes.fget(self)

    monkeypatch.setattr(Sharding, "to_json", to_json)
    monkeypatch.setattr(ArrayLeaf, "nbytes", property(nbytes))
    got = InspectResult(ck, leaves, None, {}).to_json_text({"ok": True}, {})
    assert got == expected
    assert calls["to_json"] == 2
    # by_dtype: one per (dtype, shape), 4; the leaves' texts: one per (shape, dtype, layout, sharding), 8
    assert calls["nbytes"] <= 12


def test_the_summary_counts_every_leaf_as_each_leaf_says():
    """The summary counted by (dtype, shape) and (layout, shape) is the per-leaf sum, dtypes in the
    order the leaves first name them; with a subclass of ArrayLeaf among them, it is summed leaf by leaf."""
    from ckpt_tool.core.model import ArrayLeaf, ChunkList, Chunk
    from dataclasses import dataclass
    from ckpt_tool.ops.inspect import InspectResult

    ck, leaves = _alike(97)
    leaves.append(ArrayLeaf(("c",), "c", (6,), "int8", ChunkList((Chunk((0,), (3,)), Chunk((3,), (3,))))))

    def by_hand(leaves):
        arrays = [leaf for leaf in leaves if isinstance(leaf, ArrayLeaf)]
        dtypes: dict = {}
        for leaf in arrays:
            t = dtypes.setdefault(leaf.dtype, {"leaves": 0, "parameters": 0, "bytes": 0})
            t["leaves"] += 1
            t["parameters"] += leaf.size
            t["bytes"] += leaf.nbytes
        return {"leaves": len(leaves), "arrays": len(arrays), "values": len(leaves) - len(arrays),
                "parameters": sum(leaf.size for leaf in arrays), "bytes": sum(leaf.nbytes for leaf in arrays),
                "chunks": sum(leaf.chunk_count for leaf in arrays),
                "by_dtype": dict(sorted(dtypes.items(), key=lambda kv: -kv[1]["bytes"]))}

    summary = InspectResult(ck, leaves, None, {}).summary
    assert summary == by_hand(leaves) and list(summary["by_dtype"]) == list(by_hand(leaves)["by_dtype"])
    assert summary["chunks"] == 97 + 2
    @dataclass(slots=True)
    class Other(ArrayLeaf):  # (whose size or bytes the summary cannot assume)
        pass

    mixed = [Other(("u",), "u", (3,), "float64", ChunkList((Chunk((0,), (3,)),)))] + leaves
    assert InspectResult(ck, mixed, None, {}).summary == by_hand(mixed)
