"""What every Megatron-Core save holds beside its sharded tensors, read the same way by both
backends (torch_dist, save.py; zarr, zarr_backend.py) and the legacy rank files: key names
(split_name) and `common.pt`'s leaves.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from ...base.errors import IncompleteCheckpointError
from ...core.model import Key, Leaf, ValueLeaf
from ...storage import Storage
from . import pickled
from .detection import COMMON_FILE


SHARD_SUFFIX = re.compile(r"^(?P<key>.+)/(?P<shard>shard_[0-9.]+_[0-9.-]+)$")


def split_name(name: str) -> tuple[Key, ...]:
    """A Megatron key as a key path: split at dots outside parentheses (the distributed optimizer's
    `dtype_(torch.bfloat16, torch.float32)` stays one key), a ShardedObject's shard suffix one key."""
    m = SHARD_SUFFIX.match(name)
    head, tail = (m.group("key"), (m.group("shard"),)) if m else (name, ())
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in head:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == "." and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return tuple(parts) + tail


def plain_loader(load: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: pickled.plain(load())


def common_leaves(storage: Storage, taken: set[tuple[Key, ...]]) -> list[Leaf]:
    """common.pt's leaves at the top of the tree (under `common/` only where a key is taken)."""
    if not storage.exists(COMMON_FILE):
        raise IncompleteCheckpointError(f"no {COMMON_FILE} (rank 0 writes it with every save)", storage.url)
    from ...machinery.torch_save import reading as ts

    tree = ts.file_tree(ts.Archive(storage, COMMON_FILE, pickled.ALLOW))
    if tree.paths == [()] and tree.values[0] in ({}, None):
        return []  # an empty common state (dist_checkpointing.save of sharded tensors only)
    leaves = ts.leaves_of(tree)
    clash = any(leaf.keys in taken or any(leaf.keys[:n] in taken for n in range(1, len(leaf.keys)))
                for leaf in leaves)
    if clash:
        leaves = ts.leaves_of(tree, ("common",))
    for leaf in leaves:
        leaf.extra["file"] = COMMON_FILE
        if isinstance(leaf, ValueLeaf) and leaf.loader is not None:
            leaf.loader = plain_loader(leaf.loader)
            if leaf.value_type == "object":
                leaf.extra["pickled"] = True
    return leaves
