"""An OCDBT leaf node and manifest decode in Python where numpy is not loaded, and with numpy where it
is (storage/ocdbt_node.py): the same entries, values and refusals either way.

Python's decode spares an inspect or validate of a local Orbax checkpoint numpy's import (issue 46);
numpy's is faster once loaded. The two must not differ in anything a reader sees."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, fixture_path

from ckpt_tool.storage import ocdbt_node
from ckpt_tool.storage.ocdbt_node import OcdbtNodeError


def _outcome(buf, pos: int, count: int):
    try:
        values, end = ocdbt_node._varints(buf, pos, count)
        return "ok", [int(v) for v in values], end
    except OcdbtNodeError as exc:
        return "refused", str(exc)


def test_varint_columns_decode_alike_from_bytes_and_from_numpy():
    rng = random.Random(46)
    refused = 0
    for _ in range(20000):
        # continuation bytes (>= 0x80) often, so that long, overflowing and cut varints all occur
        data = bytes(rng.choice([rng.randrange(256), rng.randrange(128, 256), 0, 1, 2, 0x81]) for _ in range(rng.randrange(48)))
        pos, count = rng.randrange(len(data) + 1), rng.randrange(7)
        got = _outcome(data, pos, count)
        assert got == _outcome(np.frombuffer(data, dtype=np.uint8), pos, count), (data.hex(), pos, count)
        refused += got[0] == "refused"
    assert 1000 < refused < 19000  # (both outcomes were exercised)


# what a reader asks of a node (every entry, the out-of-line ones, the data files' extents, a lookup,
# each value), as JSON; run here (numpy loaded) and in a fresh process (numpy not loaded)
_FACTS = r'''
def facts(node):
    def where(v):
        return v.hex() if isinstance(v, bytes) else [v.path, v.offset, v.length]

    entries = [(k.decode("latin-1"), v.hex() if isinstance(v, bytes) else list(v)) for k, v in node.all_entries()]
    keys = {k.encode("latin-1") for k, _ in entries[::3]}
    return {"entries": entries,
            "out_of_line": [(k.decode("latin-1"), where(v)) for k, v in node.out_of_line()],
            "extents": node.indirect_extents(),
            "lookup": sorted((k.decode("latin-1"), where(v)) for k, v in node.lookup(keys).items()),
            "values": [where(node.value(i)) for i in range(node.n)]}
'''

_IN_A_FRESH_PROCESS = _FACTS + r'''
import json, sys
from ckpt_tool.storage import ocdbt_node
raw = open(sys.argv[1], "rb").read()
node = ocdbt_node.LeafNode(raw, ocdbt_node.Location("", "d/x", 0, len(raw)))
assert "numpy" not in sys.modules, "numpy was imported"
print(json.dumps(facts(node)))
'''


@pytest.mark.parametrize("name", ["orbax_ocdbt_zarr2", "orbax_ocdbt_zarr3"])
def test_a_leaf_node_reads_alike_without_numpy(name, tmp_path):
    from ckpt_tool.storage import Storage

    storage = Storage.open(str(fixture_path(name)))
    manifest = ocdbt_node.decode_manifest(storage.read("manifest.ocdbt"))
    assert manifest.root is not None
    loc = manifest.root
    raw = storage.read_range(loc.path, loc.offset, loc.offset + loc.length)
    node_file = tmp_path / "node"
    node_file.write_bytes(raw)
    here = ocdbt_node.LeafNode(raw, ocdbt_node.Location("", "d/x", 0, len(raw)))
    assert here.n > 0
    r = subprocess.run([sys.executable, "-c", _IN_A_FRESH_PROCESS, str(node_file)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    namespace: dict = {}
    exec(_FACTS, namespace)  # noqa: S102 - the same function as the fresh process runs
    assert json.loads(r.stdout) == json.loads(json.dumps(namespace["facts"](here)))
