"""Many keys of one OCDBT database read by walking its B+tree once.

A point read of one key in an OCDBT database costs tensorstore time that
grows with the size of the B+tree node holding the key: orbax writes its
databases with `max_decoded_node_bytes` = 100 MB, so a checkpoint of 100,000
leaves is one leaf node of 200,000 entries, and reading each array's
`.zarray` by key took 0.45 ms per read there (against 0.02 ms in a
20,000-entry node): 68 s of CPU for `ckpt inspect` of 100k leaves, quadratic
in the leaf count. Walking the tree instead decodes each node once: the
manifest and interior nodes through tensorstore's own `ocdbt.dump`, the leaf
nodes (where the entries are) column by column (ocdbt_node.py: 0.3 s and
about 30 MB for that node, where dump's Python objects took 350 MB).

Values stored out of line come back as where they lie (data file, offset,
length), so the caller reads those bytes directly, without a point read.
"""
from __future__ import annotations

import bisect
import os
from typing import TYPE_CHECKING, Any, Callable

from .ocdbt_node import DEFAULT_MAX_DECODED_BYTES, IndirectValue, LeafNode, OcdbtNodeError, parse_location

if TYPE_CHECKING:
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
    """The database's B+tree is not one tensorstore would walk (a node at the wrong height, a damaged leaf node)."""


def decoded_limit(config: dict[str, Any] | None) -> int:
    """The most bytes a leaf node of a database with this (dumped) config may decompress to."""
    max_decoded = int((config or {}).get("max_decoded_node_bytes") or 0)
    # a node may exceed the configured size a little (the writer estimates it); never unboundedly
    return max(2 * max_decoded + 2**20, DEFAULT_MAX_DECODED_BYTES) if max_decoded else DEFAULT_MAX_DECODED_BYTES


def read_leaf(base: ts.KvStore, location: str, wait: Callable[[Any], Any], limit: int) -> LeafNode:
    """The leaf node at a dumped location ("btreenode:<base>:<file>:<offset>:<length>"), read by
    byte range and decoded; OcdbtNodeError when it is cut short or damaged."""
    where = parse_location(location)
    raw = wait(base.read(where.path, byte_range=slice(where.offset, where.offset + where.length)))
    if raw.state != "value" or len(raw.value) != where.length:
        got = len(raw.value) if raw.state == "value" else 0
        raise OcdbtNodeError(f"B+tree node {where.path} [{where.offset}, +{where.length}) holds {got} bytes")
    return LeafNode(raw.value, where, max_decoded=limit)


def read_keys(
    base: ts.KvStore, keys: list[str], wait: Callable[[Any], Any]
) -> tuple[dict[str, bytes], dict[str, IndirectValue]]:
    """(key -> inline value, key -> where its out-of-line value lies) for the wanted `keys` of the
    OCDBT database in `base` (the kvstore holding its manifest); a key in neither is absent.

    `wait(future)` waits for a tensorstore future (the caller's deadline and error wording).
    """
    import tensorstore as ts  # (a view of a database opened it already)

    wanted_list = sorted({k.encode() for k in keys})
    wanted = set(wanted_list)
    manifest = wait(ts.ocdbt.dump(base))
    versions = manifest.get("versions") or []
    if not wanted or not versions:
        return {}, {}
    root = versions[-1].get("root") or {}
    if "location" not in root:  # an empty database
        return {}, {}
    limit = decoded_limit(manifest.get("config"))
    found: dict[str, bytes] = {}
    indirect: dict[str, IndirectValue] = {}
    # (node location, its height, the key prefix of its entries, the end (exclusive) of its key range
    # or None); every child must be one level lower than its parent, so the walk ends on any input
    stack: list[tuple[str, int, bytes, bytes | None]] = [
        (root["location"], versions[-1].get("root_height", 0), b"", None)
    ]
    while stack:
        location, height, prefix, end = stack.pop()
        if height < 0:
            raise OcdbtTreeError(f"B+tree node {location} below the leaves")
        if height == 0:
            try:
                node = read_leaf(base, location, wait, limit)
                for key, value in node.lookup(wanted, prefix).items():
                    if isinstance(value, IndirectValue):
                        indirect[key.decode()] = value
                    else:
                        found[key.decode()] = value
            except OcdbtNodeError as exc:
                raise OcdbtTreeError(str(exc)) from None
            del node  # the decoded node is tens of MB: one at a time
            continue
        node_dump = wait(ts.ocdbt.dump(base, location))
        entries = node_dump.get("entries") or []
        if node_dump.get("height") != height:
            raise OcdbtTreeError(f"B+tree node {location} has height {node_dump.get('height')}, expected {height}")
        # an interior node: entry i's subtree holds the keys from its key up to the next entry's key
        for i, entry in enumerate(entries):
            low = prefix + entry["key"]
            high = prefix + entries[i + 1]["key"] if i + 1 < len(entries) else end
            j = bisect.bisect_left(wanted_list, low)
            if j < len(wanted_list) and (high is None or wanted_list[j] < high):
                stack.append((entry["location"], height - 1, prefix + entry.get("subtree_common_prefix", b""), high))
    return found, indirect
