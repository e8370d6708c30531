"""OCDBT B+tree leaf nodes decoded into columns, for walks over many keys.

tensorstore's `ocdbt.dump` returns a node as one Python object per entry:
350 MB for the 200,000-entry leaf node orbax writes for 100,000 leaves, and
tensorstore's point reads cost time that grows with the node (see
ocdbt_bulk). A leaf node is stored column by column (tensorstore's format
document, kvstore/ocdbt/index.rst, "Leaf B+tree node format"): key prefix
and suffix lengths, key bytes, value lengths and kinds, then the data file
ids and offsets of values stored out of line, then the inline values. Those
columns decode here with numpy into a few arrays over the decompressed node
(about 30 MB for that node), and keys are rebuilt one at a time while
looking for the wanted ones, so no per-entry object outlives its lookup.

Interior nodes and manifests decode here too (interior_children, decode_manifest:
validate's walk, ocdbt_entries); the reader's walk of a database on an object
store (ocdbt_bulk) still takes its manifest and interior nodes from
tensorstore's dump, whose node locations carry the transitive base path a leaf
node's data file table is relative to.
"""
from __future__ import annotations

import itertools
import re
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import numpy as np
# (numpy is imported by the functions that decode a node: the storage layer is imported by every
# command, and a local DCP or safetensors inspect decodes no node and loads no numpy, issue 46)

BTREE_NODE_MAGIC = 0x0CDB20DE
MANIFEST_MAGIC = 0x0CDB3A2A
_HEADER = struct.Struct("<Q")  # the node's length, after the big-endian magic
_MAX_VARINT_BYTES = 10
# a leaf node's columns decode with numpy past this decompressed size even where numpy is not loaded
# (LeafNode): its import then costs less than the Python decode
_NUMPY_NODE_BYTES = 4 * 2**20
# a node no writer would make: tensorstore's writers keep a node under max_decoded_node_bytes (100 MB for orbax)
DEFAULT_MAX_DECODED_BYTES = 256 * 2**20
_READ_STEP = 4 * 2**20

# tensorstore's dump: "<kind>:<percent-encoded base path>:<percent-encoded relative path>:<offset>:<length>"
_LOCATION = re.compile(r"([^:]+):([^:]*):([^:]*):([0-9]+):([0-9]+)")
_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")


def _unquote(text: str) -> bytes:
    """urllib.parse.unquote_to_bytes, without importing urllib.parse (and with it ipaddress) at every
    start: each valid %XX escape is its byte, anything else stays as it is."""
    raw = text.encode("utf-8")
    return _PERCENT.sub(lambda m: bytes((int(m.group(1), 16),)), raw) if b"%" in raw else raw


# an absolute path, a '.' or '..' segment, an empty segment or a NUL
_ESCAPING_PATH = re.compile(r"^/|(^|/)\.{1,2}(/|$)|//|\x00")


class OcdbtNodeError(ValueError):
    """A stored B+tree node that tensorstore's decoder would refuse too."""


@dataclass(frozen=True, slots=True)
class Location:
    """Where an encoded node or value lies: the data file (its transitive base path, then the rest) and bytes."""

    base_path: str
    relative_path: str
    offset: int
    length: int

    @property
    def path(self) -> str:
        return self.base_path + self.relative_path


def parse_location(text: str) -> Location:
    """A location as tensorstore's `ocdbt.dump` writes it (kvstore/ocdbt/format/dump.cc)."""
    m = _LOCATION.fullmatch(text)
    if not m:
        raise OcdbtNodeError(f"invalid indirect data reference {text!r}")
    base = _unquote(m.group(2)).decode("utf-8", "surrogateescape")
    rel = _unquote(m.group(3)).decode("utf-8", "surrogateescape")
    return Location(base, rel, int(m.group(4)), int(m.group(5)))


@dataclass(frozen=True, slots=True)
class IndirectValue:
    """A value stored out of line: `length` bytes at `offset` of the data file at `path` (from the database root)."""

    path: str
    offset: int
    length: int


def _varints(buf: np.ndarray | bytes | bytearray, pos: int, count: int) -> tuple[np.ndarray | list[int], int]:
    """`count` LEB128 varints from `buf[pos:]` as uint64, and the position after them; from bytes
    (a manifest: a few dozen varints) one by one, as ints, without numpy."""
    if isinstance(buf, (bytes, bytearray)):
        return _varints_of_bytes(buf, pos, count)
    import numpy as np

    if count == 0:
        return np.zeros(0, dtype=np.uint64), pos
    window = buf[pos : pos + _MAX_VARINT_BYTES * count]
    ends = np.flatnonzero(window < 0x80)[:count]
    if len(ends) < count:
        raise OcdbtNodeError("node ends inside a varint column")
    stop = int(ends[-1]) + 1
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_VARINT_BYTES:
        raise OcdbtNodeError("varint longer than 10 bytes")
    if np.any(window[ends[lengths == _MAX_VARINT_BYTES]] > 1):
        raise OcdbtNodeError("varint overflows 64 bits")
    shifts = (np.arange(stop, dtype=np.int64) - np.repeat(starts, lengths)) * 7
    parts = (window[:stop] & 0x7F).astype(np.uint64) << shifts.astype(np.uint64)
    return np.add.reduceat(parts, starts), pos + stop  # the parts of one varint share no bits: sum = or


def _varints_of_bytes(buf: bytes | bytearray, pos: int, count: int) -> tuple[list[int], int]:
    """_varints over bytes, in Python: the same values, and the same refusal in the same order (the
    terminators counted within 10 bytes a varint first, then each varint's length, then overflow)."""
    window = buf[pos : pos + _MAX_VARINT_BYTES * count]
    if count and len(window.translate(None, _CONTINUATION_BYTES)) < count:
        raise OcdbtNodeError("node ends inside a varint column")
    values: list[int] = []
    overflow = False
    for _ in range(count):
        value = shift = 0
        for length in range(1, _MAX_VARINT_BYTES + 1):
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        else:
            raise OcdbtNodeError("varint longer than 10 bytes")
        overflow = overflow or (length == _MAX_VARINT_BYTES and byte > 1)
        values.append(value)
    if overflow:
        raise OcdbtNodeError("varint overflows 64 bits")
    return values, pos


_CONTINUATION_BYTES = bytes(range(0x80, 0x100))


def _one_varint(buf: np.ndarray | bytes | bytearray, pos: int) -> tuple[int, int]:
    values, pos = _varints(buf, pos, 1)
    return int(values[0]), pos


def _take(buf: np.ndarray | bytes | bytearray, pos: int, n: int, what: str) -> tuple[bytes, int]:
    if n < 0 or pos + n > len(buf):
        raise OcdbtNodeError(f"node ends inside its {what}")
    return bytes(buf[pos : pos + n]), pos + n


def _data_file_table(buf: np.ndarray, pos: int, transitive: str) -> tuple[list[str], int]:
    """The node's data files as paths from the database root (format document, "Data file table format")."""
    entries, pos = _data_file_entries(buf, pos, transitive)
    return [full for _base, _relative, full in entries], pos


def _data_file_entries(buf: np.ndarray | bytes | bytearray, pos: int, transitive: str) -> tuple[list[tuple[str, str, str]], int]:
    """The table's data files as (transitive path + base path, relative path, full path): a node read
    from one takes the first as the transitive path of its own table."""
    n, pos = _one_varint(buf, pos)
    if n > len(buf):
        raise OcdbtNodeError(f"data file table claims {n} files")
    prefix_len, pos = _varints(buf, pos, max(0, n - 1))
    suffix_len, pos = _varints(buf, pos, n)
    base_len, pos = _varints(buf, pos, n)
    paths: list[tuple[str, str, str]] = []
    prev = b""
    for i in range(n):
        keep = int(prefix_len[i - 1]) if i else 0
        if keep > len(prev):
            raise OcdbtNodeError("data file path prefix longer than the previous path")
        suffix, pos = _take(buf, pos, int(suffix_len[i]), "data file paths")
        path = prev[:keep] + suffix
        if int(base_len[i]) > len(path) or len(path) > 65535:
            raise OcdbtNodeError("data file base path longer than its path")
        cut = int(base_len[i])
        base = transitive + path[:cut].decode("utf-8", "surrogateescape")
        relative = path[cut:].decode("utf-8", "surrogateescape")
        full = transitive + path.decode("utf-8", "surrogateescape")
        if _ESCAPING_PATH.search(full):
            # read by byte range from the base store: a path that climbs out would read outside the
            # database (tensorstore's writers never make one; its reader refuses them too)
            raise OcdbtNodeError(f"data file path {full!r} leaves the database directory")
        paths.append((base, relative, full))
        prev = path
    return paths, pos


def _body(raw: bytes | memoryview, max_decoded: int, magic_wanted: int = BTREE_NODE_MAGIC) -> bytes | bytearray:
    """The decompressed body of an encoded node (or manifest), after checking its header and CRC-32C footer."""
    if len(raw) < 4 + 8 + 2 + 4:
        raise OcdbtNodeError(f"node of {len(raw)} bytes is shorter than its header and footer")
    (magic,) = struct.unpack_from(">I", raw, 0)
    if magic != magic_wanted:
        raise OcdbtNodeError(f"B+tree node magic 0x{magic:08x}, expected 0x{magic_wanted:08x}")
    (length,) = _HEADER.unpack_from(raw, 4)
    if length != len(raw):
        raise OcdbtNodeError(f"B+tree node header says {length} bytes, its reference {len(raw)}")
    (crc,) = struct.unpack_from("<I", raw, len(raw) - 4)
    view = memoryview(raw)
    from ..base.checksum import crc32c

    if crc32c(view[:-4]) != crc:
        raise OcdbtNodeError("B+tree node fails its crc32c check")
    head = bytes(view[: min(len(raw) - 4, 32)])
    version, pos = _one_varint(head, 12)
    if version != 0:
        raise OcdbtNodeError(f"B+tree node format version {version}, expected 0")
    compression, pos = _one_varint(head, pos)
    body = view[pos:-4]  # (no copies of a node of tens of MB: they added up to the walk's peak)
    if compression == 0:
        return body.tobytes()
    if compression != 1:
        raise OcdbtNodeError(f"B+tree node compression {compression} (0 = none, 1 = zstd)")
    import zstandard

    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True)
        size = zstandard.frame_content_size(body.tobytes() if len(body) < 18 else body[:18].tobytes())
        if 0 <= size <= max_decoded:
            # the size the frame declares: decoded into one buffer, then nothing may follow
            out: bytes | bytearray = bytearray(size)
            got = 0
            while got < size:
                n = reader.readinto(memoryview(out)[got:])
                if not n:
                    break
                got += n
            if got < size:
                raise OcdbtNodeError(f"B+tree node decompresses to {got} bytes, its frame declares {size}")
            if reader.read(1):
                raise OcdbtNodeError(f"B+tree node decompresses to more than the {size} bytes its frame declares")
        else:  # no declared size (tensorstore's writer streams its frames): a few MiB at a time, bounded
            # (one read of the bound would allocate all of it: 256 MiB for a 43 MB node)
            out = bytearray()
            while len(out) <= max_decoded:
                part = reader.read(min(_READ_STEP, max_decoded + 1 - len(out)))
                if not part:
                    break
                out += part
    except zstandard.ZstdError as exc:
        raise OcdbtNodeError(f"B+tree node does not decompress: {exc}") from None
    if len(out) > max_decoded:
        raise OcdbtNodeError(f"B+tree node decompresses to more than {max_decoded} bytes")
    return out


@dataclass(frozen=True, slots=True)
class ManifestRoot:
    """What a walk needs of a manifest: its B+tree root (a leaf node) and the decoded size bound."""

    root: Location
    max_decoded_node_bytes: int


@dataclass(frozen=True, slots=True)
class TreeRoot:
    """A manifest's latest version: its B+tree root, the root's height, and the decoded size bound."""

    root: Location
    height: int
    max_decoded_node_bytes: int


def single_leaf_manifest(raw: bytes | memoryview) -> ManifestRoot | None:
    """The latest version's root of a manifest of the kind orbax's databases have: one file, every
    version inline, the root a leaf node (a database of up to ~10^5 arrays fits one node of 100 MB).
    None for any other (a numbered manifest, version tree nodes, a root above the leaves) or one that
    does not decode: tensorstore's own reader is asked then, and says what is wrong with it."""
    tree = single_manifest_root(raw)
    if tree is None or tree.height != 0:
        return None
    return ManifestRoot(tree.root, tree.max_decoded_node_bytes)


def single_manifest_root(raw: bytes | memoryview, transitive: str = "") -> TreeRoot | None:
    """The latest version's root of a single-file manifest with every version inline (what ckpt's
    writer makes, and tensorstore's for orbax until its versions outgrow the manifest), at any
    height; None for any other manifest or one that does not decode. `transitive`: the database's
    directory as seen from where its paths are wanted ("ocdbt.process_1/" from an Orbax step).

    The layout (tensorstore's format document, "Manifest format"), as ocdbt_encode.manifest writes it:
    the config (uuid, manifest kind, max inline value bytes, max decoded node bytes, version tree
    arity, compression and its level), the data file table, the inline versions' columns, then the
    count of version tree nodes."""
    try:
        # decoded from bytes, without numpy: a manifest holds a few dozen varints, and an inspect or
        # validate of a local Orbax checkpoint decodes no other node (issue 46: numpy's import was a
        # third of such an inspect of 3,000 leaves)
        body = _body(raw, 1 << 20, MANIFEST_MAGIC)
        pos = 16  # the uuid
        kind, pos = _one_varint(body, pos)
        _inline, pos = _one_varint(body, pos)
        max_decoded, pos = _one_varint(body, pos)
        pos += 1  # version tree arity (log2)
        compression, pos = _one_varint(body, pos)
        if kind != 0 or compression not in (0, 1) or not max_decoded:
            return None
        pos += 4 if compression == 1 else 0  # the zstd level
        files, pos = _data_file_entries(body, pos, transitive)
        n, pos = _one_varint(body, pos)
        if not 1 <= n <= 1 << 16:
            return None
        _generations, pos = _varints(body, pos, n)
        heights = list(body[pos : pos + n])
        pos += n
        file_ids, pos = _varints(body, pos, n)
        offsets, pos = _varints(body, pos, n)
        lengths, pos = _varints(body, pos, n)
        _stats, pos = _varints(body, pos, 3 * n)  # num_keys, num_tree_bytes, num_indirect_value_bytes
        pos += 8 * n  # commit times
        version_nodes, pos = _one_varint(body, pos)
        if version_nodes != 0 or pos != len(body) or len(heights) != n:
            return None
        file_id, offset, length = int(file_ids[-1]), int(offsets[-1]), int(lengths[-1])
        if file_id >= len(files) or not length:
            return None
    except (OcdbtNodeError, IndexError, ValueError):
        return None
    # the manifest's table is relative to the database root (transitive path ""): the node it names
    # takes its entry's base path as the transitive path of its own table
    base, relative, _full = files[file_id]
    return TreeRoot(Location(base, relative, offset, length), int(heights[-1]), int(max_decoded))


@dataclass(frozen=True, slots=True)
class ChildNode:
    """One entry of an interior node: where the child node lies, its height, the key prefix its
    own keys are stored without, and its first key (whole)."""

    location: Location
    height: int
    key_prefix: bytes
    first_key: bytes


def interior_children(raw: bytes | memoryview, location: Location, height: int, key_prefix: bytes = b"", *,
                      max_decoded: int = DEFAULT_MAX_DECODED_BYTES) -> list[ChildNode]:
    """The children of the interior node at `location` (expected at `height`, its keys stored
    without `key_prefix`), in key order (format document, "Interior B+tree node format": height,
    data file table, entry count, key prefix and suffix lengths, subtree common prefix lengths, key
    suffixes, then each child's data file, offset, length and three statistics)."""
    import numpy as np

    buf = np.frombuffer(_body(raw, max_decoded), dtype=np.uint8)
    if len(buf) < 1 or int(buf[0]) != height or height < 1:
        raise OcdbtNodeError(f"B+tree node has height {int(buf[0]) if len(buf) else '?'}, expected {height}")
    files, pos = _data_file_entries(buf, 1, location.base_path)
    n, pos = _one_varint(buf, pos)
    if not 1 <= n <= len(buf):
        raise OcdbtNodeError(f"interior node claims {n} entries in {len(buf)} bytes")
    prefix_len, pos = _varints(buf, pos, n - 1)
    suffix_len, pos = _varints(buf, pos, n)
    common_len, pos = _varints(buf, pos, n)
    keys: list[bytes] = []
    prev = b""
    for i in range(n):
        keep = int(prefix_len[i - 1]) if i else 0
        if keep > len(prev):
            raise OcdbtNodeError("interior key prefix longer than the previous key")
        suffix, pos = _take(buf, pos, int(suffix_len[i]), "keys")
        key = prev[:keep] + suffix
        if i and key <= prev:
            raise OcdbtNodeError("interior node keys out of order")
        keys.append(key)
        prev = key
    file_ids, pos = _varints(buf, pos, n)
    offsets, pos = _varints(buf, pos, n)
    lengths, pos = _varints(buf, pos, n)
    _stats, pos = _varints(buf, pos, 3 * n)
    if pos != len(buf):
        raise OcdbtNodeError(f"interior node holds {len(buf) - pos} bytes after its entries")
    out = []
    for i, key in enumerate(keys):
        if int(file_ids[i]) >= len(files):
            raise OcdbtNodeError(f"child in data file {int(file_ids[i])} of a {len(files)}-file table")
        if int(common_len[i]) > len(key):
            raise OcdbtNodeError("subtree common prefix longer than its key")
        base, relative, _full = files[int(file_ids[i])]
        out.append(ChildNode(Location(base, relative, int(offsets[i]), int(lengths[i])), height - 1,
                             key_prefix + key[: int(common_len[i])], key_prefix + key))
    return out


class LeafNode:
    """A decoded leaf node: its columns (Python lists) over the decompressed body, keys rebuilt on lookup."""

    __slots__ = ("_buf", "_files", "_file_parts", "_prefix", "_suffix_len", "_key_bytes", "_value_len", "_kind", "_file_id",
                 "_file_offset", "_inline_start", "_indirect_index", "n")

    def __init__(self, raw: bytes | memoryview, location: Location, *,
                 max_decoded: int = DEFAULT_MAX_DECODED_BYTES) -> None:
        body = _body(raw, max_decoded)
        if len(body) < 1:
            raise OcdbtNodeError("empty B+tree node body")
        if body[0] != 0:
            raise OcdbtNodeError(f"B+tree node has height {body[0]}, expected a leaf (0)")
        # The varint columns decode with numpy once it is loaded, or for a node past _NUMPY_NODE_BYTES
        # (5x faster); else in Python. An inspect or validate of a local Orbax checkpoint of 3,000
        # leaves decodes one node of 16,500 entries: 19 ms in Python against 4 ms with numpy, whose
        # import took 60-90 ms of that 0.22 s run (issue 46).
        buf: Any = body
        if "numpy" in sys.modules or len(body) > _NUMPY_NODE_BYTES:
            import numpy as np

            buf = np.frombuffer(body, dtype=np.uint8)
        # the node's own base path is the transitive path its data file table is relative to
        table, pos = _data_file_entries(buf, 1, location.base_path)
        self._files = [full for _base, _relative, full in table]
        self._file_parts = [(base, relative) for base, relative, _full in table]
        n, pos = _one_varint(buf, pos)
        if n > len(body):
            raise OcdbtNodeError(f"leaf node claims {n} entries in {len(body)} bytes")
        self.n = n
        prefix, pos = _varints(buf, pos, max(0, n - 1))
        suffix_len, pos = _varints(buf, pos, n)
        self._prefix, self._suffix_len = _ints(prefix), _ints(suffix_len)
        total_key = sum(self._suffix_len)
        if pos + total_key > len(body):
            raise OcdbtNodeError("node ends inside its keys")
        self._key_bytes = (pos, total_key)
        pos += total_key
        value_len, pos = _varints(buf, pos, n)
        kind, pos = _varints(buf, pos, n)
        self._value_len, self._kind = _ints(value_len), _ints(kind)
        if any(k > 1 for k in self._kind):
            raise OcdbtNodeError("leaf entry value kind other than 0 (inline) or 1 (out of line)")
        indirect = sum(self._kind)
        file_id, pos = _varints(buf, pos, indirect)
        file_offset, pos = _varints(buf, pos, indirect)
        self._file_id, self._file_offset = _ints(file_id), _ints(file_offset)
        if indirect and max(self._file_id) >= len(self._files):
            raise OcdbtNodeError(f"value in data file {max(self._file_id)} of a {len(self._files)}-file table")
        inline_len = [0 if k else length for k, length in zip(self._kind, self._value_len)]
        total_inline = sum(inline_len)
        if pos + total_inline != len(body):
            raise OcdbtNodeError(
                f"leaf node holds {len(body) - pos} bytes of inline values, its entries need {total_inline}")
        # entry i's inline value starts here (cumulative over the inline entries before it)
        self._inline_start = list(itertools.accumulate(inline_len[:-1], initial=pos)) if n else []
        # entry i -> its row in the out-of-line columns
        self._indirect_index = [i - 1 for i in itertools.accumulate(self._kind)]
        self._buf = memoryview(body)

    def entries(self, key_prefix: bytes = b"") -> Iterable[tuple[bytes, int]]:
        """(full key, entry index) for every entry in key order; keys are built one at a time."""
        start, total = self._key_bytes
        prefix = self._prefix
        raw = self._buf[start : start + total].tobytes()
        pos = 0
        prev = b""
        for i, slen in enumerate(self._suffix_len):
            keep = prefix[i - 1] if i else 0
            if keep > len(prev):
                raise OcdbtNodeError("leaf key prefix longer than the previous key")
            key = prev[:keep] + raw[pos : pos + slen]
            pos += slen
            if i and key <= prev:
                raise OcdbtNodeError("leaf node keys out of order")
            prev = key
            yield key_prefix + key, i

    def value(self, i: int) -> bytes | IndirectValue:
        """Entry i's inline value, or where its out-of-line value lies."""
        length = self._value_len[i]
        if self._kind[i] == 0:
            start = self._inline_start[i]
            return self._buf[start : start + length].tobytes()
        row = self._indirect_index[i]
        return IndirectValue(self._files[self._file_id[row]], self._file_offset[row], length)

    def out_of_line(self, key_prefix: bytes = b"") -> Iterable[tuple[bytes, IndirectValue]]:
        """(full key, where its value lies) of every entry stored out of line, in key order."""
        kind, row, length = self._kind, self._indirect_index, self._value_len
        for key, i in self.entries(key_prefix):
            if kind[i] == 1:
                r = row[i]
                yield key, IndirectValue(self._files[self._file_id[r]], self._file_offset[r], length[i])

    def all_entries(self, key_prefix: bytes = b"") -> Iterable[tuple[bytes, bytes | tuple[str, str, int, int]]]:
        """Every entry in key order: (full key, its inline value, or where its out-of-line value lies
        as (base path, relative path, offset, length): the split a node referring to it keeps)."""
        kind, length, start, row = self._kind, self._value_len, self._inline_start, self._indirect_index
        file_id, offset = self._file_id, self._file_offset
        body = self._buf
        for key, i in self.entries(key_prefix):
            if kind[i] == 0:
                yield key, body[start[i] : start[i] + length[i]].tobytes()
            else:
                base, relative = self._file_parts[file_id[row[i]]]
                yield key, (base, relative, offset[row[i]], length[i])

    def indirect_extents(self) -> dict[str, int]:
        """Each data file holding out-of-line values of this node: the end of the last byte they need."""
        ends: dict[int, int] = {}
        lengths = (length for k, length in zip(self._kind, self._value_len) if k == 1)
        for f, offset, length in zip(self._file_id, self._file_offset, lengths):
            if offset + length > ends.get(f, -1):
                ends[f] = offset + length
        return {self._files[f]: ends[f] for f in sorted(ends)}

    def lookup(self, wanted: set[bytes], key_prefix: bytes = b"") -> dict[bytes, bytes | IndirectValue]:
        """The values of the wanted full keys this node holds."""
        out: dict[bytes, bytes | IndirectValue] = {}
        kind, length, start = self._kind, self._value_len, self._inline_start
        body = self._buf
        for key, i in self.entries(key_prefix):
            if key in wanted:
                out[key] = body[start[i] : start[i] + length[i]].tobytes() if kind[i] == 0 else self.value(i)
        return out


def _ints(column: Any) -> list[int]:
    """A decoded varint column as Python ints (a numpy column converted once, not per entry)."""
    return column if isinstance(column, list) else column.tolist()


@dataclass(frozen=True, slots=True)
class Manifest:
    """What validate's walk needs of a manifest: the latest version's B+tree root (None for an empty
    tree), its height, where the version tree nodes lie (their files are checked, not their trees)
    and the decoded size bound. `numbered`: a config-only manifest whose versions lie in numbered
    manifest files (manifest.<16 hex digits>), none of the rest read."""

    root: Location | None
    height: int
    version_tree_nodes: tuple[Location, ...]
    max_decoded_node_bytes: int
    numbered: bool = False


def manifest_declared_length(raw: bytes | memoryview) -> int | None:
    """The length a manifest's header gives (None where the magic and header are not there)."""
    if len(raw) < 12 or struct.unpack_from(">I", raw, 0)[0] != MANIFEST_MAGIC:
        return None
    return int(_HEADER.unpack_from(raw, 4)[0])


_MISSING = 2**64 - 1  # a version's root at this offset and length: an empty tree (tensorstore's Missing())


def decode_manifest(raw: bytes | memoryview) -> Manifest:
    """Any manifest.ocdbt (format document, "Manifest format"): config, data file table, the
    versions stored inline, then the version tree nodes that hold older versions; OcdbtNodeError
    when it does not decode (said in ckpt's words). Decoded from bytes, without numpy (see
    single_manifest_root)."""
    declared = manifest_declared_length(raw)
    if declared is not None and declared != len(raw):
        raise OcdbtNodeError(f"manifest header gives {declared} bytes, the file has {len(raw)}")
    try:
        body = _body(raw, 1 << 24, MANIFEST_MAGIC)
    except OcdbtNodeError as exc:
        raise OcdbtNodeError(str(exc).replace("B+tree node", "manifest")) from None
    pos = 16  # the uuid
    if len(body) < pos:
        raise OcdbtNodeError("manifest ends inside its config")
    kind, pos = _one_varint(body, pos)
    _inline, pos = _one_varint(body, pos)
    max_decoded, pos = _one_varint(body, pos)
    if pos >= len(body):
        raise OcdbtNodeError("manifest ends inside its config")
    arity_log2 = int(body[pos])
    pos += 1
    compression, pos = _one_varint(body, pos)
    if compression not in (0, 1) or not 1 <= arity_log2 <= 16:
        raise OcdbtNodeError(f"manifest config has compression {compression}, version tree arity 2^{arity_log2}")
    pos += 4 if compression == 1 else 0  # the zstd level
    if kind == 1:  # numbered: this file holds the config alone
        return Manifest(None, 0, (), int(max_decoded), numbered=True)
    if kind != 0:
        raise OcdbtNodeError(f"manifest kind {kind} (0 = single, 1 = numbered)")
    files, pos = _data_file_entries(body, pos, "")
    n, pos = _one_varint(body, pos)
    if not 1 <= n <= 1 << arity_log2:
        raise OcdbtNodeError(f"manifest holds {n} versions inline (at most {1 << arity_log2})")
    _generations, pos = _varints(body, pos, n)
    if pos + n > len(body):
        raise OcdbtNodeError("manifest ends inside its versions")
    heights = list(body[pos : pos + n])
    pos += n
    file_ids, pos = _varints(body, pos, n)
    offsets, pos = _varints(body, pos, n)
    lengths, pos = _varints(body, pos, n)
    _stats, pos = _varints(body, pos, 3 * n)  # num_keys, num_tree_bytes, num_indirect_value_bytes
    pos += 8 * n  # commit times
    if pos > len(body):
        raise OcdbtNodeError("manifest ends inside its versions")
    m, pos = _one_varint(body, pos)
    if m > 64:
        raise OcdbtNodeError(f"manifest claims {m} version tree nodes")
    _node_generations, pos = _varints(body, pos, m)
    node_files, pos = _varints(body, pos, m)
    node_offsets, pos = _varints(body, pos, m)
    node_lengths, pos = _varints(body, pos, m)
    _counts, pos = _varints(body, pos, m)
    pos += 8 * m + m  # commit times, heights
    if pos != len(body):
        raise OcdbtNodeError(f"manifest holds {len(body) - pos} bytes after its versions" if pos < len(body)
                             else "manifest ends inside its version tree nodes")

    def location(file_id: int, offset: int, length: int) -> Location:
        if file_id >= len(files):
            raise OcdbtNodeError(f"manifest refers to data file {file_id} of a {len(files)}-file table")
        if offset + length >= 2**64:
            raise OcdbtNodeError(f"invalid offset/length pair ({offset}, {length})")
        base, relative, _full = files[file_id]
        return Location(base, relative, offset, length)

    nodes = tuple(location(int(f), int(o), int(n_)) for f, o, n_ in zip(node_files, node_offsets, node_lengths))
    offset, length = int(offsets[-1]), int(lengths[-1])
    if offset == _MISSING and length == _MISSING:
        return Manifest(None, int(heights[-1]), nodes, int(max_decoded))
    # the manifest's table is relative to the database root (transitive path ""): the node it names
    # takes its entry's base path as the transitive path of its own table
    return Manifest(location(int(file_ids[-1]), offset, length), int(heights[-1]), nodes, int(max_decoded))
