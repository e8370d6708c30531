"""validate's shallow checks of zarr arrays as TensorStore writes them: each array's chunks all
stored (and none empty), its claimed size plausible for the bytes stored, its sharding sound, and
an OCDBT database's manifest and B-tree naming only data files that are there and long enough.
Shared machinery: the Orbax, msgpack (orbax <= 0.4, T5X) and Megatron zarr checks use it.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from ...base import dtypes
from ...base.errors import CkptError, UnreadableFileError
from ...base.findings import Findings
from ...storage import Storage, ocdbt_bulk
from ...storage.ocdbt_node import (
    LeafNode, Location, Manifest, OcdbtNodeError, decode_manifest, interior_children, manifest_declared_length,
    parse_location,
)
from .reading import ROOT_MANIFEST, chunk_keys

# more chunks than this per array are not enumerated key by key; the count is compared instead
_MAX_ENUMERATED_CHUNKS = 1_000_000


def read_array_metadata(
    storage: Storage, use_ocdbt: bool, files: list[str], process_dbs: list[str], names: list[str], meta_key: str
) -> dict[str, bytes]:
    """`<name>/<meta_key>` for every name, from wherever the item keeps its arrays."""
    if not use_ocdbt:
        views = [storage]
    elif ROOT_MANIFEST in files:
        views = [storage.ocdbt("")]
    else:
        views = [storage.ocdbt(d) for d in process_dbs]
    out: dict[str, bytes] = {}
    remaining = list(names)
    for view in views:
        if not remaining:
            break
        try:
            got = view.read_many(f"{n}/{meta_key}" for n in remaining)
        except CkptError:
            # one unreadable value (e.g. a FIFO or a lost data file) should not hide the others
            got = {}
            for n in remaining:
                try:
                    got[f"{n}/{meta_key}"] = view.read(f"{n}/{meta_key}")
                except CkptError:
                    got[f"{n}/{meta_key}"] = None
        for n in remaining:
            data = got.get(f"{n}/{meta_key}")
            if data is not None:
                out[n] = data
        remaining = [n for n in remaining if n not in out]
    return out


@dataclass
class LostKeys:
    """What the lost data files of an OCDBT database take with them: a lost B-tree node every key
    of its subtree, a cut-short or missing data file the values stored in its lost bytes. The files
    are named as their lost-process-data finding names them, so that the arrays those keys belong to
    join that finding (Findings.file_problem) instead of a finding each."""

    # (file, first key, end key (exclusive) or None) of each B-tree node that cannot be read
    ranges: list[tuple[str, bytes, bytes | None]] = field(default_factory=list)
    # the keys whose out-of-line values lie in lost bytes, sorted, and the file of each
    keys: list[bytes] = field(default_factory=list)
    key_files: list[str] = field(default_factory=list)

    def file_of(self, name: str) -> str | None:
        """The lost file that takes (part of) the array stored under `name/`, or None."""
        low, high = name.encode() + b"/", name.encode() + b"0"  # ('0' follows '/'): the keys name/...
        for file, first, end in self.ranges:
            if first < high and (end is None or end > low):
                return file
        i = bisect.bisect_left(self.keys, low)
        if i < len(self.keys) and self.keys[i] < high:
            return self.key_files[i]
        return None

    def __bool__(self) -> bool:
        return bool(self.ranges or self.keys)


def check_ocdbt(
    storage: Storage, db: str, findings: Findings, *, where: str, list_keys: bool = True, stored: list[int] | None = None,
    lost: LostKeys | None = None,
) -> set[str]:
    """Walk an OCDBT database's manifest and B-tree: every referenced data file present and long
    enough; the keys it holds (with `list_keys`).

    The manifest and every node are read by byte range through `storage` (a local root, gs://,
    s3://) and decoded by ckpt (storage/ocdbt_node.py), tensorstore not imported: a local convert's
    preflight of an Orbax source loads none of it (issue 46). The one layout left to tensorstore is
    a numbered manifest (_numbered_manifest).

    `lost` (with `list_keys`): filled with the keys that lost data files take with them."""
    base_where = f"{where}{db + '/' if db else ''}"
    db_dir = f"{db}/" if db else ""
    manifest_key = db_dir + ROOT_MANIFEST

    def lost_manifest(message: str) -> set[str]:
        findings.error("lost-process-data", message, file=base_where + ROOT_MANIFEST)
        if lost is not None and list_keys:
            lost.ranges.append((base_where + ROOT_MANIFEST, b"", None))  # it takes every key
        return set()

    if not storage.exists(manifest_key):
        return lost_manifest(f"{ROOT_MANIFEST} missing")
    # a symlink out of the checkpoint, a loop, a FIFO in the database's directory: PathEscapeError, as
    # when tensorstore opened it (validate reports the path itself as path-escape, once)
    storage.guard(db_dir)
    try:
        raw = storage.read(manifest_key)
    except CkptError as exc:
        return lost_manifest(f"unreadable manifest: {exc.message}")
    try:
        manifest = decode_manifest(raw)
    except OcdbtNodeError as exc:
        declared = manifest_declared_length(raw)
        return lost_manifest(
            f"{ROOT_MANIFEST} is cut short: it has {len(raw)} of the {declared} bytes its header gives"
            if declared is not None and len(raw) < declared else f"unreadable manifest: {exc}")
    del raw
    if manifest.numbered:
        try:
            manifest = _numbered_manifest(storage, db_dir, base_where)
        except CkptError as exc:
            return lost_manifest(exc.message)
    needed: dict[str, int] = {}  # data file (relative to the database dir) -> bytes needed

    def need(at: Location) -> None:
        # the path is relative to the database directory: its own files ("d/..."), or for a merged
        # root's values that stay in a process database, "ocdbt.process_0/d/..."
        needed[at.path] = max(needed.get(at.path, 0), at.offset + at.length)

    # data file -> the bytes it has (None: missing or unreadable), for each file found lost
    lost_files: dict[str, int | None] = {}
    # (where the node lies, its height, the key prefix its keys are stored without, the range of
    # keys its subtree holds): the latest version's tree is what a reader sees. A child is one level
    # below its parent (the decoder checks each node's height), so the walk ends on any input.
    stack: list[tuple[Location, int, bytes, bytes, bytes | None]] = (
        [(manifest.root, manifest.height, b"", b"", None)] if manifest.root is not None else [])
    # the version tree (a database of more than 2^arity generations) holds the older versions' roots:
    # its nodes' files are checked for size, their trees not walked
    for node in manifest.version_tree_nodes:
        need(node)
    limit = ocdbt_bulk.decoded_limit({"max_decoded_node_bytes": manifest.max_decoded_node_bytes})
    lost_nodes: list[tuple[str, bytes, bytes | None]] = []  # (data file, first key, end key) of each lost node
    opened: set[str] = set()  # data files found readable (an open each, once)
    leaf_nodes: list[tuple[Location, bytes]] = []  # (location, key prefix) of each leaf node read
    keys: set[str] = set()
    while stack:
        at, height, prefix, first, end = stack.pop()
        need(at)
        file = at.path
        if file in lost_files or not _file_long_enough(storage, db, file, at.offset + at.length, findings, base_where,
                                                       lost_files, opened):
            lost_nodes.append((file, first, end))
            continue
        if not list_keys:
            # a per-process database beside a merged root: readers go through
            # the root, whose walk covers the values; here the manifest's own
            # node files are enough (walking every leaf again doubles the cost)
            continue
        try:
            if height == 0:
                # a leaf node: decoded column by column, not as one Python object per entry
                leaf = LeafNode(_read_node(storage, db_dir, at), at, max_decoded=limit)
                names = [key.decode("utf-8", "surrogateescape") for key, _ in leaf.entries(prefix)]
                extents = leaf.indirect_extents()
                del leaf  # (tens of MB for a large save: one at a time)
                keys.update(names)
                leaf_nodes.append((at, prefix))
                for path, last in extents.items():
                    needed[path] = max(needed.get(path, 0), last)
                continue
            children = interior_children(_read_node(storage, db_dir, at), at, height, prefix, max_decoded=limit)
        except CkptError as exc:
            findings.error("lost-process-data", exc.message, file=base_where + file)
            lost_nodes.append((file, first, end))
            continue
        except OcdbtNodeError as exc:
            findings.error("lost-process-data", f"unreadable B-tree node {_node_name(at)}: {exc}", file=base_where + file)
            lost_nodes.append((file, first, end))
            continue
        # a child's subtree holds the keys from its first key up to the next child's
        for i, child in reversed(list(enumerate(children))):
            child_end = children[i + 1].first_key if i + 1 < len(children) else end
            stack.append((child.location, child.height, child.key_prefix, child.first_key, child_end))
    # (on an object store each size is a round trip or more: all of them in flight together)
    storage.prefetch_shortfalls({db_dir + file: last for file, last in needed.items() if file not in lost_files})
    for file, last in sorted(needed.items()):
        if file not in lost_files:
            _file_long_enough(storage, db, file, last, findings, base_where, lost_files, opened)
    findings.count("ocdbt_files", len(needed))
    if stored is not None:
        stored[0] += sum(needed.values())
    if not list_keys:
        return set()
    if (lost_files or lost_nodes) and lost is not None:
        # a lost file: what it takes is said once, by its finding; the keys that are left are those
        # of the leaf nodes that could be read
        lost.ranges += [(base_where + file, first, end) for file, first, end in lost_nodes]
        for key, file in sorted(_keys_taken(storage, db_dir, leaf_nodes, lost_files, limit).items()):
            lost.keys.append(key)
            lost.key_files.append(base_where + file)
    return keys


def _node_name(at: Location) -> str:
    return f"{at.path} [{at.offset}, +{at.length})"


def _read_node(storage: Storage, db_dir: str, at: Location) -> bytes:
    """The encoded node at `at`, read by byte range through `storage` (OcdbtNodeError if short)."""
    raw = storage.read_range(db_dir + at.path, at.offset, at.offset + at.length)
    if len(raw) != at.length:
        raise OcdbtNodeError(f"B+tree node {_node_name(at)} holds {len(raw)} bytes")
    return raw


def _numbered_manifest(storage: Storage, db_dir: str, where: str) -> Manifest:
    """The latest version of a database with a numbered manifest (manifest.ocdbt holds its config
    alone, the versions lie in manifest.<generation> files), as tensorstore's reader finds it: the one
    layout ckpt's decoder leaves to tensorstore (no Orbax or ckpt writer makes it). Its nodes are
    then read by ckpt as any other's."""
    import tensorstore as ts

    # storage.wait: the storage layer's deadline, so a remote store that stops answering fails, never hangs
    kv = storage.wait(ts.KvStore.open(storage.kvstore_spec(db_dir), context=storage.context),
                      "cannot open the OCDBT database", where or ".")
    dump = storage.wait(ts.ocdbt.dump(kv, context=storage.context), "unreadable manifest", where)
    versions = dump.get("versions") or []
    latest = versions[-1] if versions and isinstance(versions[-1], dict) else {}
    root: dict[str, Any] = latest["root"] if isinstance(latest.get("root"), dict) else {}
    try:
        nodes = tuple(parse_location(n["location"]) for n in dump.get("version_tree_nodes") or []
                      if isinstance(n, dict) and isinstance(n.get("location"), str))
        at = parse_location(root["location"]) if isinstance(root.get("location"), str) else None
    except OcdbtNodeError as exc:
        raise CkptError(f"unreadable manifest: {exc}", where) from None
    config = dump.get("config") if isinstance(dump.get("config"), dict) else {}
    return Manifest(at, int(latest.get("root_height") or 0), nodes, int(config.get("max_decoded_node_bytes") or 0))


def _keys_taken(
    storage: Storage, db_dir: str, leaf_nodes: list[tuple[Location, bytes]], lost_files: dict[str, int | None], limit: int,
) -> dict[bytes, str]:
    """key -> the lost data file its value lay in, for the leaf nodes that could be read. Only on
    damage: each leaf node that refers to a lost file is read and decoded a second time."""
    taken: dict[bytes, str] = {}
    for at, prefix in leaf_nodes:
        try:
            node = LeafNode(_read_node(storage, db_dir, at), at, max_decoded=limit)
            hit = {file for file, last in node.indirect_extents().items()
                   if file in lost_files and (lost_files[file] is None or last > (lost_files[file] or 0))}
            if hit:
                for key, value in node.out_of_line(prefix):
                    has = lost_files.get(value.path, -1)
                    if value.path in hit and (has is None or value.offset + value.length > has):
                        taken[key] = value.path
        except (CkptError, OcdbtNodeError):
            continue  # read a moment ago: a file changing under the check
        del node  # tens of MB for a large save: one at a time
    return taken


def _file_long_enough(
    storage: Storage, db: str, file: str, end: int, findings: Findings, where: str, lost: dict[str, int | None],
    opened: set[str],
) -> bool:
    """Whether the data file holds `end` bytes and can be opened for reading (an open, once per file,
    no read: a local file's permissions; nothing on an object store); else its one finding."""
    key = f"{db}/{file}" if db else file
    try:
        size = storage.shortfall(key, end)
    except (CkptError, FileNotFoundError, OSError):
        lost[file] = None
        findings.error("lost-process-data", "OCDBT data file missing: the arrays stored in it cannot be read", file=where + file)
        return False
    if size is not None:
        lost[file] = size
        # (the root database and a process's name the same data file: said once)
        if not any(f.code == "lost-process-data" and f.file == where + file for f in findings.errors):
            findings.error("lost-process-data", f"OCDBT data file has {size} bytes but the database needs {end}",
                           file=where + file)
        return False
    if key not in opened:
        try:
            storage.check_readable(key)
        except UnreadableFileError as exc:
            lost[file] = None
            if not any(f.file == where + file for f in findings.errors):
                why = exc.message.split(": ", 1)[-1]  # ("cannot read: Permission denied")
                findings.error("unreadable-file", f"OCDBT data file cannot be read ({why})", file=where + file)
            return False
        except (CkptError, OSError):
            pass  # (not a regular file, gone since: the containment check and the reads say so)
        opened.add(key)
    return True


def check_sharding(sharding: Any, shape: tuple[int, ...], findings: Findings, leaf: str, file: str) -> None:
    if sharding.kind != "named":
        return
    sizes = dict(zip(sharding.axis_names or (), sharding.mesh_shape or ()))
    if sharding.device_ids is not None and len(sharding.device_ids) != math.prod(sharding.mesh_shape or ()):
        findings.error(
            "bad-sharding",
            f"mesh shape {list(sharding.mesh_shape)} needs {math.prod(sharding.mesh_shape)} devices but lists {len(sharding.device_ids)}",
            leaf=leaf, file=file,
        )
    if sharding.device_ids is not None and len(set(sharding.device_ids)) != len(sharding.device_ids):
        findings.error("bad-sharding", "a device id appears twice in the mesh", leaf=leaf, file=file)
    # Ids outside 0..N-1 are no finding: real saves have them (jax's CPU
    # devices of process 1 start at 2048; a sub-mesh of a bigger job), and
    # every restore without target shardings needs the saving topology anyway.
    spec = list(sharding.partition_spec or ())
    if len(spec) > len(shape):
        findings.error("bad-sharding", f"partition spec has {len(spec)} entries for a rank-{len(shape)} array", leaf=leaf, file=file)
        return
    used: list[str] = []
    for dim, entry in enumerate(spec):
        axes = entry if isinstance(entry, (tuple, list)) else (entry,) if entry is not None else ()
        for axis in axes:
            if axis not in sizes:
                findings.error("bad-sharding", f"axis {axis!r} is not in the mesh {list(sizes)}", leaf=leaf, file=file)
                return
            if axis in used:
                findings.error("bad-sharding", f"axis {axis!r} is used twice", leaf=leaf, file=file)
            used.append(axis)
        div = math.prod(sizes[a] for a in axes) if axes else 1
        if shape[dim] % div:
            findings.error(
                "bad-sharding",
                f"dimension {dim} (size {shape[dim]}) is not divisible by {'x'.join(axes)}={div}",
                leaf=leaf, file=file,
            )


def check_empty_chunk_files(
    storage: Storage, name: str, leaf: str, keys: set[str], meta_key: str, findings: Findings, where: str,
    *, raw_size: int | None = None,
) -> int:
    """Per-array directories: a zero-byte chunk file is a write that never happened. The bytes stored.

    `raw_size`: the size every chunk file has when the array is stored
    uncompressed (zarr v2 with no compressor): another size cannot decode.
    """
    total = 0
    for key in sorted(k for k in keys if k.startswith(name + "/") and not k.endswith("/" + meta_key)):
        try:
            size = storage.size(key)
        except (CkptError, OSError):
            continue
        total += size
        if size == 0:
            findings.error("empty-chunk", "chunk file has no bytes", leaf=leaf, file=where + key)
        elif raw_size is not None and size != raw_size:
            findings.error(
                "bad-chunk", f"{meta_key} says uncompressed, so each chunk holds {raw_size} bytes, but this one has {size}",
                leaf=leaf, file=where + key,
            )
    return total


# The most a stored byte can decode to: zstd packs a run of one byte at about
# 1:32,768 (an RLE block of 128 KiB in a few bytes), far beyond gzip's 1:1,032
# or blosc's. An array claiming more than that of its stored bytes (and more
# than a small floor, for arrays of fill values) cannot be what was saved;
# refusing it here also keeps --deep from decoding a claimed size.
MAX_DECODE_RATIO = 2**15


_SIZE_FLOOR = 2**30


def size_plausible(
    shape: tuple[int, ...], dtype: str, stored: int, findings: Findings, leaf: str, file: str,
) -> bool:
    itemsize = dtypes.get(dtype).itemsize
    claimed = math.prod(shape) * itemsize
    limit = max(_SIZE_FLOOR, stored * MAX_DECODE_RATIO)
    if claimed > limit:
        findings.error(
            "bad-array-metadata",
            f"shape {list(shape)} claims {claimed:,} bytes, but only {stored:,} bytes are stored "
            f"(at most {limit:,} bytes can decode from them)",
            leaf=leaf, file=file,
        )
        return False
    return True


def check_chunks(
    name: str, leaf: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...], zarr3: bool,
    zmeta: dict[str, Any], keys: set[str], fills_zeros: bool, findings: Findings, where: str,
) -> None:
    total = math.prod(-(-s // c) if c else 0 for s, c in zip(shape, chunk_shape)) if shape else 1
    findings.count("chunks", total)
    if total > _MAX_ENUMERATED_CHUNKS:
        stored = sum(1 for k in keys if k.startswith(name + "/") and not k.endswith((".zarray", "zarr.json")))
        if stored < total:
            findings.error("missing-chunk", f"{total - stored} of {total} chunks are not stored", leaf=leaf, file=f"{where}{name}/")
        return
    missing = [(idx, key) for idx, key in chunk_keys(name, shape, chunk_shape, zarr3, zmeta) if key not in keys]
    if not missing:
        return
    consequence = (
        "this checkpoint predates store_array_data_equal_to_fill_value, so orbax restores the region as zeros without an error"
        if fills_zeros else "restore will fail or return fill values there"
    )
    for idx, key in missing[:20]:
        region = ", ".join(f"{i * c}:{min((i + 1) * c, s)}" for i, c, s in zip(idx, chunk_shape, shape))
        findings.error(
            "missing-chunk",
            f"chunk {list(idx)} (region [{region}]) is not stored; {consequence}",
            leaf=leaf, file=f"{where}{key}",
        )
    if len(missing) > 20:
        findings.error("missing-chunk", f"... and {len(missing) - 20} more chunks missing ({len(missing)} of {total})", leaf=leaf, file=f"{where}{name}/")
