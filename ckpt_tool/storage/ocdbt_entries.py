"""Every entry of an OCDBT database, read by ckpt from its manifest and B+tree nodes.

A writer's multi-process commit (the Orbax writer's) builds the step's root database from the
per-process ones: every key of every process's database, values stored out of line kept
where they lie (`ocdbt.process_<i>/d/...`), as orbax's merge (tensorstore's
`experimental_copy_range_to`) leaves them. The nodes are read by byte range through Storage, so
on a local root and on gs:// / s3:// alike, and decoded by ocdbt_node.py; what comes back is what
ocdbt_writer.write_database takes.

Only a single-file manifest with its versions inline is read (what ckpt's writer makes, and
tensorstore's for orbax while its versions fit the manifest); any other is said as one line.
"""
from __future__ import annotations

from ..base.errors import CkptError
from .core import Storage
from .ocdbt_bulk import decoded_limit
from .ocdbt_encode import DataFile, ValueRef
from .ocdbt_node import Location, OcdbtNodeError, interior_children, single_manifest_root, LeafNode

MANIFEST = "manifest.ocdbt"

Entry = tuple[bytes, bytes | ValueRef]


def database_entries(storage: Storage, database: str) -> list[Entry]:
    """Every (key, value) of the database whose manifest is `database` + manifest.ocdbt in `storage`
    (`database`: its directory with a trailing "/", or "" for the root), in key order; a value stored
    out of line as where it lies, its data file named from `storage`'s root."""
    manifest_key = database + MANIFEST
    tree = single_manifest_root(storage.read(manifest_key), database)
    if tree is None:
        raise CkptError("not an OCDBT manifest ckpt reads (one file, its versions inline)", _where(storage, manifest_key))
    limit = decoded_limit({"max_decoded_node_bytes": tree.max_decoded_node_bytes})
    files: dict[tuple[str, str], DataFile] = {}  # one DataFile a data file (the B+tree's tables compare them)
    out: list[Entry] = []
    # (where the node lies, its height, the key prefix its keys are stored without); a child is one
    # level below its parent, so the walk ends on any input. Children are pushed last-first: the
    # entries come out in key order.
    stack: list[tuple[Location, int, bytes]] = [(tree.root, tree.height, b"")]
    while stack:
        where, height, prefix = stack.pop()
        raw = storage.read_range(where.path, where.offset, where.offset + where.length)
        try:
            if len(raw) != where.length:
                raise OcdbtNodeError(f"B+tree node [{where.offset}, +{where.length}) holds {len(raw)} bytes")
            if height == 0:
                for key, value in LeafNode(raw, where, max_decoded=limit).all_entries(prefix):
                    if isinstance(value, bytes):
                        out.append((key, value))
                        continue
                    base, relative, offset, length = value
                    file = files.get((base, relative))
                    if file is None:
                        file = files[(base, relative)] = DataFile(base, relative)
                    out.append((key, ValueRef(file, offset, length)))
            else:
                children = interior_children(raw, where, height, prefix, max_decoded=limit)
                stack.extend((c.location, c.height, c.key_prefix) for c in reversed(children))
        except OcdbtNodeError as exc:
            raise CkptError(f"cannot read OCDBT B+tree: {exc}", _where(storage, where.path)) from None
        del raw
    return out


def _where(storage: Storage, key: str) -> str:
    return f"{storage.url.rstrip('/')}/{key}"
