"""OCDBT databases encoded by ckpt: B+tree nodes and a single-file manifest, as tensorstore reads them.

The inverse of ocdbt_node.py, following tensorstore's format document
(kvstore/ocdbt/index.rst): every node is a big-endian magic, its length
(uint64le), format version 0 and a compression method (varints), the body
(zstd-compressed when the database's config says so) and a CRC-32C footer.

A database here is written once, whole, by one writer: one version
(generation 1) whose B+tree holds every key. tensorstore's writer makes a new
version per commit and rewrites the nodes it touches; writing the finished
key set once costs one pass over the entries instead (see
ocdbt_writer.py for why ckpt writes its Orbax output this way).

The tree is built bottom up: sorted entries are cut into leaf nodes of at
most `max_decoded_node_bytes` decoded, then interior levels over them until
one node is left, the root. Interior entries keep each child's full first
key (`subtree_common_prefix_length` 0), so every node's keys are the
database's own keys: simpler, and what tensorstore's reader accepts.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import zstandard

from ..base.checksum import crc32c

MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_NODE_MAGIC = 0x0CDB20DE
FORMAT_VERSION = 0
COMPRESSION_NONE = 0
COMPRESSION_ZSTD = 1
MANIFEST_KIND_SINGLE = 0


_ONE_BYTE = [bytes([n]) for n in range(0x80)]


def varint(n: int) -> bytes:
    """n as an unsigned LEB128 varint."""
    if 0 <= n < 0x80:  # (most of a node's lengths and prefix lengths: 200,000 of them for 40,000 keys)
        return _ONE_BYTE[n]
    if n < 0:
        raise ValueError(f"varint of a negative number {n}")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varints(values: Sequence[int]) -> bytes:
    if not values or min(values) < 0:
        return b"".join(varint(v) for v in values)  # (a negative one: varint says so)
    top = max(values)
    if top < 0x80:
        return bytes(values)  # each its own single byte (a node's kinds, most key lengths)
    if len(values) < 64 or top >= 1 << 64:
        return b"".join(varint(v) for v in values)
    return _varints_at_once(values)


def _varints_at_once(values: Sequence[int]) -> bytes:
    """A long column of varints (a leaf's 40,000 offsets or lengths), each byte position at once:
    0.05 s a column value by value, 0.005 s this way."""
    a = np.asarray(values, dtype=np.uint64)
    width = np.ones(len(a), dtype=np.int64)  # bytes per value
    for k in range(1, 10):
        width += a >= np.uint64(1 << (7 * k))
    starts = np.cumsum(width) - width
    out = np.empty(int(width.sum()), dtype=np.uint8)
    for k in range(int(width.max())):
        sel = width > k
        low = (a[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (width[sel] > k + 1).astype(np.uint64) << np.uint64(7)  # the continuation bit
        out[starts[sel] + k] = low | more
    return out.tobytes()


def _common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix (by bisection over slice compares: 40,000 keys of a
    256-device layout byte by byte in Python cost 0.15 s)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class DataFile:
    """A data file as a node's table names it: `base_path` + `relative_path`, from the database root.

    The base path is the part a child node's own table is relative to (the
    per-process databases orbax's root references: base "ocdbt.process_0/",
    relative "d/<name>")."""

    base_path: str
    relative_path: str

    @property
    def path(self) -> str:
        return self.base_path + self.relative_path


@dataclass(frozen=True, slots=True)
class ValueRef:
    """A value stored out of line: `length` bytes at `offset` of `file`."""

    file: DataFile
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class NodeRef:
    """An encoded node written at `offset` of `file`, and what its subtree holds."""

    file: DataFile
    offset: int
    length: int
    height: int
    first_key: bytes
    num_keys: int
    num_tree_bytes: int
    num_indirect_value_bytes: int


@dataclass(frozen=True, slots=True)
class Config:
    """The database's configuration, as the manifest records it (orbax's values by default)."""

    uuid: bytes
    max_inline_value_bytes: int = 1024
    max_decoded_node_bytes: int = 100_000_000
    version_tree_arity_log2: int = 4
    zstd_level: int = 0  # tensorstore's default: the library's own level

    @staticmethod
    def new(**kw: int) -> "Config":
        return Config(uuid=os.urandom(16), **kw)


def data_file_table(files: Sequence[DataFile]) -> bytes:
    """The table format (format document, "Data file table format"): paths prefix-compressed in order."""
    parts = [varint(len(files))]
    paths = [f.path.encode() for f in files]
    bases = [len(f.base_path.encode()) for f in files]
    prefixes = []
    for i in range(1, len(files)):
        keep = _common_prefix(paths[i - 1], paths[i])
        if files[i].base_path != files[i - 1].base_path:
            # a shared prefix may not run past either base path unless the base paths are equal
            keep = min(keep, bases[i], bases[i - 1])
        prefixes.append(keep)
    suffixes = [paths[0]] + [paths[i][prefixes[i - 1]:] for i in range(1, len(files))] if files else []
    parts.append(_varints(prefixes))
    parts.append(_varints([len(s) for s in suffixes]))
    parts.append(_varints(bases))
    parts.extend(suffixes)
    return b"".join(parts)


def _key_columns(keys: Sequence[bytes]) -> tuple[bytes, bytes, bytes]:
    """Prefix lengths (one fewer than keys), suffix lengths and the suffixes, as the node formats store keys."""
    prefixes = [_common_prefix(keys[i - 1], keys[i]) for i in range(1, len(keys))]
    suffixes = [keys[0]] + [keys[i][prefixes[i - 1]:] for i in range(1, len(keys))] if keys else []
    return _varints(prefixes), _varints([len(s) for s in suffixes]), b"".join(suffixes)


def _table_of(files: Sequence[DataFile]) -> tuple[list[DataFile], dict[DataFile, int]]:
    ordered = sorted(set(files), key=lambda f: (f.path, f.base_path))
    return ordered, {f: i for i, f in enumerate(ordered)}


def leaf_body(entries: Sequence[tuple[bytes, bytes | ValueRef]]) -> bytes:
    """A leaf node's decoded body: height 0, its data file table, then the entry columns."""
    files, index = _table_of([v.file for _, v in entries if isinstance(v, ValueRef)])
    keys = [k for k, _ in entries]
    prefix, suffix_len, suffixes = _key_columns(keys)
    lengths = [v.length if isinstance(v, ValueRef) else len(v) for _, v in entries]
    kinds = [1 if isinstance(v, ValueRef) else 0 for _, v in entries]
    refs = [v for _, v in entries if isinstance(v, ValueRef)]
    return b"".join([
        b"\x00", data_file_table(files), varint(len(entries)),
        prefix, suffix_len, suffixes, _varints(lengths), _varints(kinds),
        _varints([index[r.file] for r in refs]), _varints([r.offset for r in refs]),
        *[v for _, v in entries if not isinstance(v, ValueRef)],
    ])


def interior_body(height: int, children: Sequence[NodeRef]) -> bytes:
    """An interior node's decoded body over `children` (each keyed by its full first key)."""
    files, index = _table_of([c.file for c in children])
    prefix, suffix_len, suffixes = _key_columns([c.first_key for c in children])
    return b"".join([
        bytes([height]), data_file_table(files), varint(len(children)),
        prefix, suffix_len, _varints([0] * len(children)), suffixes,
        _varints([index[c.file] for c in children]), _varints([c.offset for c in children]),
        _varints([c.length for c in children]), _varints([c.num_keys for c in children]),
        _varints([c.num_tree_bytes for c in children]), _varints([c.num_indirect_value_bytes for c in children]),
    ])


def encode(magic: int, body: bytes, config: Config) -> bytes:
    """A node or manifest: header, the body (zstd-compressed), CRC-32C footer."""
    payload = zstandard.ZstdCompressor(level=config.zstd_level).compress(body)
    head = varint(FORMAT_VERSION) + varint(COMPRESSION_ZSTD)
    length = 4 + 8 + len(head) + len(payload) + 4
    out = struct.pack(">I", magic) + struct.pack("<Q", length) + head + payload
    return out + struct.pack("<I", crc32c(out))


def leaf_entry_bytes(key: bytes, value: bytes | ValueRef) -> int:
    """A bound on what one entry adds to a leaf node's decoded body (for cutting nodes)."""
    stored = 30 if isinstance(value, ValueRef) else len(value) + 10
    return len(key) + stored + 10


def cut_leaves(entries: Sequence[tuple[bytes, bytes | ValueRef]], max_bytes: int) -> list[list[tuple[bytes, bytes | ValueRef]]]:
    """Sorted entries cut into runs whose leaf nodes stay under `max_bytes` decoded (one run at least).

    A run's size counts its entries and its data file table (each distinct file: its path and a
    few varints)."""
    runs: list[list[tuple[bytes, bytes | ValueRef]]] = [[]]
    files: set[DataFile] = set()
    # the file of the entry before, in the run's table already: neighbours mostly share a file, and
    # hashing a DataFile (its two strings, each time) twice per entry was a third of this for 40,000 keys
    last: DataFile | None = None
    size = 0

    def cost(key: bytes, value: bytes | ValueRef) -> int:
        n = leaf_entry_bytes(key, value)
        if isinstance(value, ValueRef) and value.file is not last and value.file not in files:
            n += len(value.file.path.encode()) + 10  # its row of the data file table
        return n

    for key, value in entries:
        n = cost(key, value)
        if runs[-1] and size + n > max_bytes:
            runs.append([])
            files, last = set(), None
            size = 0
            n = cost(key, value)  # (its file's row of the table again, in the new run's table)
        size += n
        runs[-1].append((key, value))
        if isinstance(value, ValueRef) and value.file is not last:
            files.add(value.file)
            last = value.file
    return runs


def manifest(config: Config, root: NodeRef, commit_time_ns: int) -> bytes:
    """A single-file manifest: the config and one version (generation 1) whose B+tree root is `root`.

    The version is stored inline (format document, "Manifest version tree"):
    its columns, each of one value, then no version tree nodes."""
    body = [
        config.uuid, varint(MANIFEST_KIND_SINGLE), varint(config.max_inline_value_bytes),
        varint(config.max_decoded_node_bytes), bytes([config.version_tree_arity_log2]),
        varint(COMPRESSION_ZSTD), struct.pack("<i", config.zstd_level),
        data_file_table([root.file]), varint(1), varint(1), bytes([root.height]), varint(0),
        varint(root.offset), varint(root.length), varint(root.num_keys), varint(root.num_tree_bytes),
        varint(root.num_indirect_value_bytes), struct.pack("<Q", commit_time_ns),
        varint(0),
    ]
    return encode(MANIFEST_MAGIC, b"".join(body), config)


def _interior_entry_bytes(ref: NodeRef) -> int:
    return len(ref.first_key) + 60


def build_tree(entries: Sequence[tuple[bytes, bytes | ValueRef]], config: Config, node_file: DataFile
               ) -> tuple[bytes, NodeRef]:
    """Every node of the B+tree over `entries` (sorted by key, unique, at least one), encoded back
    to back as the content of `node_file`, and the root's reference."""
    if not entries:
        raise ValueError("an OCDBT B+tree needs at least one entry")
    for i in range(1, len(entries)):
        if entries[i - 1][0] >= entries[i][0]:
            raise ValueError(f"OCDBT keys out of order or repeated: {entries[i - 1][0]!r}, {entries[i][0]!r}")
    budget = max(512, config.max_decoded_node_bytes - 64)  # (a node holds one entry at least)
    content: list[bytes] = []
    offset = 0

    def emit(node: bytes) -> tuple[int, int]:
        nonlocal offset
        start = offset
        content.append(node)
        offset += len(node)
        return start, len(node)

    level: list[NodeRef] = []
    for run in cut_leaves(entries, budget):
        start, length = emit(encode(BTREE_NODE_MAGIC, leaf_body(run), config))
        level.append(NodeRef(node_file, start, length, 0, run[0][0], len(run), length,
                             sum(v.length for _, v in run if isinstance(v, ValueRef))))
    height = 0
    while len(level) > 1:
        height += 1
        groups: list[list[NodeRef]] = [[]]
        size = 0
        for ref in level:
            n = _interior_entry_bytes(ref)
            if groups[-1] and size + n > budget:
                groups.append([])
                size = 0
            groups[-1].append(ref)
            size += n
        level = []
        for group in groups:
            start, length = emit(encode(BTREE_NODE_MAGIC, interior_body(height, group), config))
            level.append(NodeRef(node_file, start, length, height, group[0].first_key,
                                 sum(c.num_keys for c in group), length + sum(c.num_tree_bytes for c in group),
                                 sum(c.num_indirect_value_bytes for c in group)))
    return b"".join(content), level[0]
