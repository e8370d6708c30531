"""validate's shallow checks of zarr arrays as TensorStore writes them: each array's chunks all
stored (and none empty), its claimed size plausible for the bytes stored, its sharding sound, and
an OCDBT database's manifest and B-tree naming only data files that are there and long enough.
Shared machinery: the Orbax, msgpack (orbax <= 0.4, T5X) and Megatron zarr checks use it.
"""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ...base import dtypes
from ...base.errors import CkptError, UnreadableFileError
from ...base.findings import Findings
from ...storage import Storage, ocdbt_bulk
from ...storage.ocdbt_node import OcdbtNodeError, parse_location
from .reading import ROOT_MANIFEST, chunk_keys

if TYPE_CHECKING:
    import tensorstore as ts


# tensorstore's words for a manifest file shorter than its header says (kvstore/ocdbt/format/manifest.cc)
_MANIFEST_CUT = re.compile(r"Length in header \((\d+)\) does not match actual length \((\d+)\)")

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
    """Walk an OCDBT database's manifest and B-tree: every referenced data file present and long enough.

    `lost` (with `list_keys`): filled with the keys that lost data files take with them."""
    base_where = f"{where}{db + '/' if db else ''}"
    manifest_key = f"{db}/{ROOT_MANIFEST}" if db else ROOT_MANIFEST
    if not storage.exists(manifest_key):
        findings.error("lost-process-data", f"{ROOT_MANIFEST} missing", file=base_where + ROOT_MANIFEST)
        if lost is not None and list_keys:
            lost.ranges.append((base_where + ROOT_MANIFEST, b"", None))  # it takes every key
        return set()
    # tensorstore is imported where an OCDBT database is walked, not with this module: checks of
    # arrays stored as plain files, and the modules that only import this one, load none of it
    import tensorstore as ts

    # storage.wait: the storage layer's deadline, so a remote store that stops answering fails, never hangs
    base_kv = storage.wait(ts.KvStore.open(storage.kvstore_spec(db + "/" if db else ""), context=storage.context),
                           "cannot open the OCDBT database", base_where or ".")
    needed: dict[str, int] = {}  # data file (relative to the database dir) -> bytes needed

    def need(location: str) -> tuple[str, int, int] | None:
        # the base path is relative to the database directory: empty for its own files,
        # "ocdbt.process_0/" for a merged root's values that stay in a process database
        try:
            where = parse_location(location)
        except OcdbtNodeError:
            return None
        needed[where.path] = max(needed.get(where.path, 0), where.offset + where.length)
        return where.path, where.offset, where.length

    # data file -> the bytes it has (None: missing or unreadable), for each file found lost
    lost_files: dict[str, int | None] = {}
    try:
        manifest = storage.wait(ts.ocdbt.dump(base_kv, context=storage.context), "unreadable manifest", base_where)
    except CkptError as exc:  # tensorstore raises ValueError with a status text
        cut = _MANIFEST_CUT.search(exc.message)
        message = (f"{ROOT_MANIFEST} is cut short: it has {cut.group(2)} of the {cut.group(1)} bytes its header gives"
                   if cut and int(cut.group(2)) < int(cut.group(1)) else exc.message)
        findings.error("lost-process-data", message, file=base_where + ROOT_MANIFEST)
        if lost is not None and list_keys:
            lost.ranges.append((base_where + ROOT_MANIFEST, b"", None))  # it takes every key
        return set()
    versions = manifest.get("versions") or []
    latest = versions[-1] if versions and isinstance(versions[-1], dict) else {}
    root = latest.get("root")
    root = root if isinstance(root, dict) else {}
    # (location, the node's height when known, the key prefix of its entries, the range of keys its
    # subtree holds): the latest version's tree is what a reader sees
    stack: list[tuple[str, int | None, bytes, bytes, bytes | None]] = [
        (root["location"], latest.get("root_height"), b"", b"", None)] if isinstance(root.get("location"), str) else []
    # the version tree (a database of more than 2^arity generations) holds the older versions' roots:
    # its nodes' files are checked for size, their trees not walked
    for n in manifest.get("version_tree_nodes") or []:
        if isinstance(n, dict) and isinstance(n.get("location"), str):
            need(n["location"])
    limit = ocdbt_bulk.decoded_limit(manifest.get("config"))
    lost_nodes: list[tuple[str, bytes, bytes | None]] = []  # (data file, first key, end key) of each lost node
    opened: set[str] = set()  # data files found readable (an open each, once)
    leaf_nodes: list[tuple[str, bytes]] = []  # (location, key prefix) of each leaf node read

    def wait(f: Any) -> Any:
        return storage.wait(f, "unreadable B-tree node", base_where)

    seen = 0
    while stack:
        loc, height, prefix, first, end = stack.pop()
        ref = need(loc)
        if ref is None:
            continue
        file = ref[0]
        if file in lost_files or not _file_long_enough(storage, db, file, ref[1] + ref[2], findings, base_where, lost_files,
                                                       opened):
            lost_nodes.append((file, first, end))
            continue
        if not list_keys:
            # a per-process database beside a merged root: readers go through
            # the root, whose walk covers the values; here the manifest's own
            # node files are enough (walking every leaf again doubles the cost)
            continue
        if height == 0 and loc.startswith("btreenode:"):
            # a leaf node: decoded column by column (storage/ocdbt_node.py), not as one Python object per
            # entry (350 MB for orbax's 200,000-entry node of a 100k-leaf save)
            try:
                leaf = ocdbt_bulk.read_leaf(
                    base_kv, loc, lambda f: storage.wait(f, f"unreadable B-tree node {loc}", base_where), limit)
            except CkptError as exc:
                findings.error("lost-process-data", exc.message, file=base_where + file)
                lost_nodes.append((file, first, end))
                continue
            except OcdbtNodeError as exc:
                findings.error("lost-process-data", f"unreadable B-tree node {loc}: {exc}", file=base_where + file)
                lost_nodes.append((file, first, end))
                continue
            seen += 1
            leaf_nodes.append((loc, prefix))
            for path, last in leaf.indirect_extents().items():
                needed[path] = max(needed.get(path, 0), last)
            continue
        try:
            node = storage.wait(ts.ocdbt.dump(base_kv, loc, context=storage.context), f"unreadable B-tree node {loc}", base_where)
        except CkptError as exc:
            findings.error("lost-process-data", exc.message, file=base_where + file)
            lost_nodes.append((file, first, end))
            continue
        seen += 1
        child_height = node["height"] - 1 if isinstance(node.get("height"), int) and node["height"] > 0 else None
        entries = node.get("entries", [])
        for i, entry in enumerate(entries):
            if "inline_value" in entry:
                continue  # stored inside the node itself: nothing else to find
            # an interior entry's subtree holds the keys from its key up to the next entry's key
            key = entry.get("key")
            child_first, child_end, child_prefix = first, end, prefix
            if isinstance(key, bytes):
                child_first = prefix + key
                after = entries[i + 1].get("key") if i + 1 < len(entries) else None
                child_end = prefix + after if isinstance(after, bytes) else end
                common = entry.get("subtree_common_prefix", b"")
                child_prefix = prefix + (common if isinstance(common, bytes) else b"")
            for field_ in ("node", "location", "indirect_value"):
                value = entry.get(field_)
                if isinstance(value, str):
                    if value.startswith("btreenode:"):
                        stack.append((value, child_height, child_prefix, child_first, child_end))
                    elif value.startswith("value:"):
                        need(value)
    # (on an object store each size is a round trip or more: all of them in flight together)
    storage.prefetch_shortfalls({f"{db}/{file}" if db else file: last for file, last in needed.items() if file not in lost_files})
    for file, last in sorted(needed.items()):
        if file not in lost_files:
            _file_long_enough(storage, db, file, last, findings, base_where, lost_files, opened)
    findings.count("ocdbt_files", len(needed))
    if stored is not None:
        stored[0] += sum(needed.values())
    if not list_keys:
        return set()
    if not lost_files and not lost_nodes:
        try:
            return set(storage.ocdbt(db).list())
        except CkptError as exc:
            findings.error("lost-process-data", f"cannot list the database: {exc.message}", file=base_where + ROOT_MANIFEST)
            return set()
    # a lost file: what it takes is said once, by its finding; the keys that are left are those of
    # the leaf nodes that could be read (a listing through a lost node fails as a whole)
    keys, taken = _keys_left(base_kv, leaf_nodes, lost_files, wait, limit)
    if lost is not None:
        lost.ranges += [(base_where + file, first, end) for file, first, end in lost_nodes]
        for key, file in sorted(taken.items()):
            lost.keys.append(key)
            lost.key_files.append(base_where + file)
    return keys


def _keys_left(
    base_kv: ts.KvStore, leaf_nodes: list[tuple[str, bytes]], lost_files: dict[str, int | None],
    wait: Callable[[Any], Any], limit: int,
) -> tuple[set[str], dict[bytes, str]]:
    """(every key of the leaf nodes that can be read, key -> the lost data file its value lay in).
    Only on damage: each leaf node is read and decoded a second time."""
    keys: set[str] = set()
    taken: dict[bytes, str] = {}
    for loc, prefix in leaf_nodes:
        try:
            node = ocdbt_bulk.read_leaf(base_kv, loc, wait, limit)
        except (CkptError, OcdbtNodeError):
            continue  # read a moment ago: a file changing under the check
        keys.update(key.decode("utf-8", "surrogateescape") for key, _ in node.entries(prefix))
        hit = {file for file, last in node.indirect_extents().items()
               if file in lost_files and (lost_files[file] is None or last > (lost_files[file] or 0))}
        if hit:
            for key, value in node.out_of_line(prefix):
                has = lost_files.get(value.path, -1)
                if value.path in hit and (has is None or value.offset + value.length > has):
                    taken[key] = value.path
        del node  # tens of MB for a large save: one at a time
    return keys, taken


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
