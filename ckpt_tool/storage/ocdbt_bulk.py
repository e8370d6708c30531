"""Many keys of one OCDBT database read by walking its B+tree once.

A point read of one key in an OCDBT database costs tensorstore time that
grows with the size of the B+tree node holding the key: orbax writes its
databases with `max_decoded_node_bytes` = 100 MB, so a checkpoint of 100,000
leaves is one leaf node of 200,000 entries, and reading each array's
`.zarray` by key took 0.45 ms per read there (against 0.02 ms in a
20,000-entry node): 68 s of CPU for `ckpt inspect` of 100k leaves, quadratic
in the leaf count. Walking the tree instead decodes each node once, through
tensorstore's own `ocdbt.dump` (the manifest, then only the nodes whose key
range holds a wanted key): one decode of that node, 0.4 s.

Values stored out of line (larger than the database's max_inline_value_bytes;
never a zarr metadata file in practice) are not read here: their keys are
returned for the caller's point reads.
"""
from __future__ import annotations

import bisect
import os
from typing import Any, Callable

import tensorstore as ts


def _min_keys() -> int:
    # CKPT_OCDBT_BULK_MIN_KEYS=1 sends every read through the walk (the tests and the fuzz suite's small fixtures)
    try:
        return max(1, int(os.environ.get("CKPT_OCDBT_BULK_MIN_KEYS", "256")))
    except ValueError:
        return 256


# below this many keys the point reads are cheap enough, and a walk would decode
# whole nodes to find a handful of keys
BULK_MIN_KEYS = _min_keys()


class OcdbtTreeError(ValueError):
    """The database's B+tree is not one tensorstore would walk (a node at the wrong height)."""


def read_keys(
    base: ts.KvStore, keys: list[str], wait: Callable[[Any], Any]
) -> tuple[dict[str, bytes], list[str]]:
    """(key -> inline value, keys whose values are stored out of line) for the wanted `keys` of the
    OCDBT database in `base` (the kvstore holding its manifest); a key in neither is absent.

    `wait(future)` waits for a tensorstore future (the caller's deadline and error wording).
    """
    wanted = sorted({k.encode() for k in keys})
    manifest = wait(ts.ocdbt.dump(base))
    versions = manifest.get("versions") or []
    if not wanted or not versions:
        return {}, []
    root = versions[-1].get("root") or {}
    if "location" not in root:  # an empty database
        return {}, []
    found: dict[str, bytes] = {}
    indirect: list[str] = []
    # (node location, its height, the key prefix of its entries, the end (exclusive) of its key range
    # or None); every child must be one level lower than its parent, so the walk ends on any input
    stack: list[tuple[str, int, bytes, bytes | None]] = [
        (root["location"], versions[-1].get("root_height", 0), b"", None)
    ]
    while stack:
        location, height, prefix, end = stack.pop()
        node = wait(ts.ocdbt.dump(base, location))
        entries = node.get("entries") or []
        if node.get("height") != height or height < 0:
            raise OcdbtTreeError(f"B+tree node {location} has height {node.get('height')}, expected {height}")
        if height == 0:
            for entry in entries:
                full = prefix + entry["key"]
                i = bisect.bisect_left(wanted, full)
                if i == len(wanted) or wanted[i] != full:
                    continue
                if "inline_value" in entry:
                    found[full.decode()] = entry["inline_value"]
                else:
                    indirect.append(full.decode())
            del node, entries  # a leaf node's entries can be hundreds of MB as Python objects
            continue
        # an interior node: entry i's subtree holds the keys from its key up to the next entry's key
        for i, entry in enumerate(entries):
            low = prefix + entry["key"]
            high = prefix + entries[i + 1]["key"] if i + 1 < len(entries) else end
            j = bisect.bisect_left(wanted, low)
            if j < len(wanted) and (high is None or wanted[j] < high):
                stack.append((entry["location"], height - 1, prefix + entry.get("subtree_common_prefix", b""), high))
    return found, indirect
