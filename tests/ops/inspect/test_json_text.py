"""inspect --json in a pipe: InspectResult.to_json_text writes the leaves' text from their fields
(issue 46), and must be byte for byte what json.dumps makes of to_json()'s dicts."""
from __future__ import annotations

import json

import pytest

from ckpt_tool.core.model import ArrayLeaf, Checkpoint, ChunkList, Chunk, RegularGrid, Sharding, ValueLeaf, constant_loader
from ckpt_tool.ops.inspect import InspectResult, inspect_checkpoint

from conftest import SAMPLE_FIXTURES, fixture_path


def _both(result: InspectResult) -> tuple[str, str]:
    before, after = {"ok": True}, {"opened": {"name": "1", "why": "x"}}
    expected = json.dumps({**before, **result.to_json(), **after}, default=str, ensure_ascii=True)
    return expected, result.to_json_text(before, after)


@pytest.mark.parametrize("name", SAMPLE_FIXTURES)
def test_every_sampled_fixture_is_written_as_json_dumps_writes_it(name):
    expected, got = _both(inspect_checkpoint(str(fixture_path(name))))
    assert got == expected


def test_odd_leaves_are_written_as_json_dumps_writes_them():
    chunk = Chunk((0, 0), (2, 3))
    leaves = [
        ArrayLeaf(("a\udc80", "\x1b[31m", "é"), "a.\n", (2, 3), "float32", ChunkList((chunk,)), Sharding("chunks", chunks=1)),
        ArrayLeaf(("list", 0), "list.0", (), "bfloat16", RegularGrid(()), None),  # an int key: through the dicts
        ArrayLeaf(("named",), "named", (8, 4), "int8", RegularGrid((4, 4)),
                  Sharding("named", mesh_shape=(2, 1), axis_names=("data", "model"), partition_spec=(("data", "model"), None),
                           device_ids=(0, 1))),
        ArrayLeaf(("\"leaves\": \"\\u0000leaves\\u0000\"",), "x", (1,), "float32", RegularGrid((1,)), None),
        ValueLeaf(("step",), "step", value_type="int", loader=constant_loader(3)),
    ]
    ck = Checkpoint(path="memory://x \"leaves\": \"\\u0000leaves\\u0000\"", format="dcp", layout={}, leaves=leaves,
                    committed=True, notes=['"leaves": "\x00leaves\x00"'])
    result = InspectResult(ck, leaves, {"step": 3}, {})
    expected, got = _both(result)
    assert got == expected
    json.loads(got)
