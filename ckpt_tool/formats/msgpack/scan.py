"""A bounded, offset-recording msgpack scanner for checkpoint files.

Flax (`flax.serialization.to_bytes`, `save_checkpoint` with orbax off),
orbax-checkpoint <= 0.4 (the `checkpoint` aggregate file) and T5X keep a
checkpoint's tree in one msgpack document, with numpy arrays inline as
msgpack ext types. Loading such a file with `msgpack.unpackb` holds the
whole file (arrays included) in memory, so this module walks the document
instead: it reads the file through the storage layer in small windows,
decodes the structure (maps, arrays, keys, numbers, short strings) and, for
every inline array, records its dtype, shape and the byte offset of its
data, without reading that data.

Nothing in the file is executed: msgpack has no code, and the ext types are
decoded here by their documented layouts only (flax.serialization /
orbax msgpack_utils):

    ext 1  ndarray        msgpack (shape list, dtype name, raw C-order bytes)
    ext 2  native complex msgpack (real, imag)
    ext 3  numpy scalar   like ext 1, shape ()
    ext 4  tuple          msgpack list (orbax msgpack_utils only)

Bounds (a hostile file is refused before anything is allocated for it):
nesting deeper than MAX_DEPTH, more than MAX_NODES values, a length that
runs past the end of the file, keys longer than MAX_KEY_BYTES.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Union

from ...base.errors import CkptError, CorruptMetadataError
from ...storage import Storage

MAX_DEPTH = 128  # real trees nest a few dozen levels at most; T5X specs add 4
MAX_NODES = 5_000_000  # values in one document (keys included)
MAX_KEY_BYTES = 64 * 1024
MAX_INLINE_STR = 1 << 20  # longer strings and bins are recorded by offset, read on request
MAX_DIMS = 64
_WINDOW = 1 << 20

EXT_NDARRAY = 1
EXT_COMPLEX = 2
EXT_NPSCALAR = 3
EXT_TUPLE = 4


class TruncatedMsgpack(CorruptMetadataError):
    """The file ends inside a value."""


@dataclass
class MapNode:
    items: list[tuple[Any, "Node"]]


@dataclass
class ListNode:
    items: list["Node"]
    tuple_ext: bool = False  # orbax's ext 4 tuple


@dataclass
class Scalar:
    value: Any  # None, bool, int, float, complex, short str or bytes


@dataclass
class LazyBytes:
    """A long str or bin value, left in the file."""

    offset: int
    length: int
    is_str: bool


@dataclass
class InlineArray:
    """An ext 1 / ext 3 numpy array: data at [offset, offset + length) of the file."""

    dtype: str  # the numpy dtype name flax wrote (float32, bfloat16, ...)
    shape: tuple[int, ...]
    offset: int
    length: int
    scalar: bool  # ext 3: flax restores it as a numpy scalar
    at: int  # offset of the ext value itself, for messages


@dataclass
class UnknownExt:
    code: int
    offset: int
    length: int


Node = Union[MapNode, ListNode, Scalar, LazyBytes, InlineArray, UnknownExt]


@dataclass
class _Frame:
    node: MapNode | ListNode
    remaining: int  # values still to read (a map counts keys and values)
    end: int | None = None  # an ext 4 payload must end exactly here
    key: Any = field(default=None)
    want_key: bool = False
    # a map's keys so far: a key met twice is refused (msgpack_restore keeps the last value only)
    seen: set[str] | None = None


class _Reader:
    """Sequential reads of one stored file through a bounded window."""

    def __init__(self, storage: Storage, key: str, size: int) -> None:
        self.storage = storage
        self.key = key
        self.size = size
        self.pos = 0
        self._buf = b""
        self._buf_start = 0

    def where(self) -> str:
        return f"{self.storage.url}/{self.key}"

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise TruncatedMsgpack(
                f"truncated msgpack: {what} at byte {self.pos} needs {n} bytes, the file has {self.size - self.pos} left",
                self.where(),
            )

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        start = self.pos - self._buf_start
        if start < 0 or start + n > len(self._buf):
            if n > _WINDOW:
                data = self.storage.read_range(self.key, self.pos, self.pos + n)
                self.pos += n
                return data
            end = min(self.size, self.pos + max(n, _WINDOW))
            self._buf = self.storage.read_range(self.key, self.pos, end)
            self._buf_start = self.pos
            start = 0
        self.pos += n
        return self._buf[start : start + n]

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n


_FIXED = {
    0xCC: (">B", 1), 0xCD: (">H", 2), 0xCE: (">I", 4), 0xCF: (">Q", 8),
    0xD0: (">b", 1), 0xD1: (">h", 2), 0xD2: (">i", 4), 0xD3: (">q", 8),
    0xCA: (">f", 4), 0xCB: (">d", 8),
}


def sniff(head: bytes) -> bool:
    """Whether a file starting with `head` looks like a msgpack map with str keys (a saved tree)."""
    if not head:
        return False
    b = head[0]
    if 0x81 <= b <= 0x8F:
        rest = head[1:]
    elif b == 0xDE:
        rest = head[3:] if len(head) >= 3 and head[1:3] != b"\0\0" else b""
    elif b == 0xDF:
        rest = head[5:] if len(head) >= 5 and head[1:5] != b"\0\0\0\0" else b""
    else:
        return head == b"\x80"  # an empty tree
    # the first key: a str (fixstr, str8/16/32); pickles (0x80 0x0N) and JSON fail here
    return bool(rest) and (0xA0 <= rest[0] <= 0xBF or rest[0] in (0xD9, 0xDA, 0xDB))


def scan(storage: Storage, key: str) -> Node:
    """The document stored at `key`, with inline arrays recorded by offset."""
    try:
        size = storage.size(key)
    except OSError as exc:
        raise CkptError(f"cannot read: {exc.strerror or exc}", f"{storage.url}/{key}") from exc
    r = _Reader(storage, key, size)
    if size == 0:
        raise TruncatedMsgpack("empty file: no msgpack document", r.where())
    root = _scan(r, r.size)
    if r.pos != r.size:
        raise CorruptMetadataError(
            f"not one msgpack document: {r.size - r.pos} extra bytes after byte {r.pos}", r.where()
        )
    return root


def scan_tree(storage: Storage, key: str) -> MapNode:
    """The saved tree at `key`: a document whose root is a map (what flax's to_state_dict and
    orbax's aggregate file always write; a damaged file whose root is anything else is
    refused here, not read as one nameless leaf)."""
    root = scan(storage, key)
    if not isinstance(root, MapNode):
        raise CorruptMetadataError(f"the msgpack document's root is {_kind(root)}, not a map: not a saved tree",
                                   f"{storage.url}/{key}")
    return root


def _scan(r: _Reader, end: int) -> Node:
    """One value from r.pos (iterative: nesting costs no Python stack)."""
    stack: list[_Frame] = []
    nodes = 0
    while True:
        nodes += 1
        if nodes > MAX_NODES:
            raise CorruptMetadataError(f"more than {MAX_NODES:,} msgpack values: refused", r.where())
        at = r.pos
        value, container = _value(r, stack, end)
        if container is not None:
            node, count, frame_end = container
            if count:
                if len(stack) >= MAX_DEPTH:
                    raise CorruptMetadataError(
                        f"msgpack nesting deeper than {MAX_DEPTH} levels at byte {at}: refused", r.where()
                    )
                stack.append(_Frame(node, count, frame_end, want_key=isinstance(node, MapNode)))
                continue
            value = node
        # attach the finished value to its parent, closing every container it completes
        while True:
            if not stack:
                return value
            top = stack[-1]
            if isinstance(top.node, MapNode) and top.want_key:
                top.key = _as_key(value, r, at)
                if top.seen is None:
                    top.seen = set()
                if top.key in top.seen:
                    # flax's and orbax's msgpack_restore build a dict: the earlier value would be lost
                    # without a word, and two leaves would share one key path here
                    raise CorruptMetadataError(
                        f"map key {top.key!r} at byte {at} appears twice in one map: flax and orbax keep "
                        "only its last value", r.where(),
                    )
                top.seen.add(top.key)
                top.want_key = False
                top.remaining -= 1
                break
            if isinstance(top.node, MapNode):
                top.node.items.append((top.key, value))
                top.want_key = True
            else:
                top.node.items.append(value)
            top.remaining -= 1
            if top.remaining:
                break
            stack.pop()
            if top.end is not None and r.pos != top.end:
                raise CorruptMetadataError(
                    f"msgpack tuple payload does not end where its ext header says (byte {top.end})", r.where()
                )
            value = top.node


def _as_key(value: Any, r: _Reader, at: int) -> Any:
    """A map key: str, or bin (decoded). Anything else is refused as flax and orbax refuse it:
    their msgpack_restore unpacks with msgpack's default strict_map_key, under which a key
    that is not str or bytes fails the whole file ("int is not allowed for map key")."""
    if isinstance(value, Scalar) and isinstance(value.value, str):
        return value.value
    if isinstance(value, Scalar) and isinstance(value.value, bytes):
        return value.value.decode("utf-8", "surrogateescape")
    raise CorruptMetadataError(
        f"map key at byte {at} is {_kind(value)}, not a string: flax and orbax refuse the file "
        "(msgpack's strict_map_key)", r.where(),
    )


def _kind(node: Any) -> str:
    """What a scanned value is, for messages ("an int", "a list", ...)."""
    if isinstance(node, Scalar):
        v = node.value
        name = "None" if v is None else type(v).__name__
        return f"an {name}" if name[0] in "aeiou" else f"a {name}"
    if isinstance(node, MapNode):
        return "a map"
    if isinstance(node, ListNode):
        return "a list"
    if isinstance(node, LazyBytes):
        return "a long str" if node.is_str else "a long bin value"
    if isinstance(node, InlineArray):
        return "an array"
    return f"a msgpack ext type {getattr(node, 'code', '?')} value"


def _length(r: _Reader, n: int, what: str) -> int:
    return int.from_bytes(r.take(n, what), "big")


def _value(r: _Reader, stack: list[_Frame], end: int) -> tuple[Any, tuple[Any, int, int | None] | None]:
    """(leaf node, None) or (None, (container, value count, payload end))."""
    b = r.take(1, "a value")[0]
    remaining = r.size - r.pos
    if b <= 0x7F:
        return Scalar(b), None
    if b >= 0xE0:
        return Scalar(b - 0x100), None
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        n = b & 0x0F if b <= 0x8F else _length(r, 2 if b == 0xDE else 4, "a map header")
        if 2 * n > remaining:
            raise CorruptMetadataError(f"map of {n:,} entries at byte {r.pos} is longer than the file", r.where())
        return None, (MapNode([]), 2 * n, None)
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        n = b & 0x0F if b <= 0x9F else _length(r, 2 if b == 0xDC else 4, "an array header")
        if n > remaining:
            raise CorruptMetadataError(f"array of {n:,} values at byte {r.pos} is longer than the file", r.where())
        return None, (ListNode([]), n, None)
    if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB, 0xC4, 0xC5, 0xC6):
        is_str = not 0xC4 <= b <= 0xC6
        if 0xA0 <= b <= 0xBF:
            n = b & 0x1F
        else:
            n = _length(r, {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}[b], "a length")
        start = r.pos
        r.need(n, "a string" if is_str else "a bin value")
        wants_key = bool(stack) and isinstance(stack[-1].node, MapNode) and stack[-1].want_key
        if wants_key and n > MAX_KEY_BYTES:
            raise CorruptMetadataError(f"map key of {n:,} bytes at byte {start}: refused", r.where())
        if n > MAX_INLINE_STR:
            r.skip(n, "a long value")
            return LazyBytes(start, n, is_str), None
        data = r.take(n, "a string")
        if is_str:
            try:
                return Scalar(data.decode("utf-8")), None
            except UnicodeDecodeError:
                raise CorruptMetadataError(f"string at byte {start} is not UTF-8", r.where()) from None
        return Scalar(bytes(data)), None
    if b == 0xC0:
        return Scalar(None), None
    if b == 0xC2:
        return Scalar(False), None
    if b == 0xC3:
        return Scalar(True), None
    if b in _FIXED:
        fmt, n = _FIXED[b]
        return Scalar(struct.unpack(fmt, r.take(n, "a number"))[0]), None
    if b in (0xD4, 0xD5, 0xD6, 0xD7, 0xD8, 0xC7, 0xC8, 0xC9):
        at = r.pos - 1
        if b >= 0xD4:
            n = 1 << (b - 0xD4)
        else:
            n = _length(r, {0xC7: 1, 0xC8: 2, 0xC9: 4}[b], "an ext length")
        code = struct.unpack(">b", r.take(1, "an ext type"))[0]
        r.need(n, f"ext type {code}")
        start = r.pos
        if code == EXT_TUPLE:
            # orbax: a tuple is a msgpack list inside the ext payload
            payload_end = start + n
            b2 = r.take(1, "a tuple")[0] if n else None
            if b2 is None or not (0x90 <= b2 <= 0x9F or b2 in (0xDC, 0xDD)):
                raise CorruptMetadataError(f"ext 4 (tuple) at byte {at} does not hold a list", r.where())
            count = b2 & 0x0F if b2 <= 0x9F else _length(r, 2 if b2 == 0xDC else 4, "an array header")
            if count > payload_end - r.pos:
                raise CorruptMetadataError(f"tuple of {count:,} values at byte {at} is longer than its payload", r.where())
            if count == 0:
                if r.pos != payload_end:
                    raise CorruptMetadataError(f"ext 4 (tuple) at byte {at} has trailing bytes", r.where())
                return ListNode([], tuple_ext=True), None
            return None, (ListNode([], tuple_ext=True), count, payload_end)
        if code in (EXT_NDARRAY, EXT_NPSCALAR):
            return _ndarray(r, start, n, code == EXT_NPSCALAR, at), None
        if code == EXT_COMPLEX:
            if n > 64:
                raise CorruptMetadataError(f"ext 2 (complex) at byte {at} is {n} bytes", r.where())
            return Scalar(_complex(r.take(n, "a complex"), r, at)), None
        r.skip(n, f"ext type {code}")
        return UnknownExt(code, start, n), None
    raise CorruptMetadataError(f"byte 0x{b:02x} at {r.pos - 1} is not a msgpack value", r.where())


def _ndarray(r: _Reader, start: int, n: int, scalar: bool, at: int) -> InlineArray:
    """Parse ext 1/3's inner (shape, dtype name, bytes) header; leave the bytes in the file."""
    end = start + n
    what = f"the array at byte {at}"

    def bad(msg: str) -> CorruptMetadataError:
        return CorruptMetadataError(f"{what}: {msg}", r.where())

    def small_int() -> int:
        b = r.take(1, what)[0]
        if b <= 0x7F:
            return b
        if b in (0xCC, 0xCD, 0xCE, 0xCF):
            return _length(r, {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}[b], what)
        raise bad("a dimension is not a non-negative integer")

    def list_len() -> int:
        b = r.take(1, what)[0]
        if 0x90 <= b <= 0x9F:
            return b & 0x0F
        if b == 0xDC:
            return _length(r, 2, what)
        if b == 0xDD:
            return _length(r, 4, what)
        raise bad("header is not a list")

    def raw() -> tuple[int, int]:
        b = r.take(1, what)[0]
        if 0xA0 <= b <= 0xBF:
            size = b & 0x1F
        elif b in (0xD9, 0xDA, 0xDB, 0xC4, 0xC5, 0xC6):
            size = _length(r, {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}[b], what)
        else:
            raise bad("dtype name or data is not a string or bin value")
        return r.pos, size

    if list_len() != 3:
        raise bad("header is not (shape, dtype, data)")
    ndim = list_len()
    if ndim > MAX_DIMS:
        raise bad(f"{ndim} dimensions")
    shape = tuple(small_int() for _ in range(ndim))
    name_at, name_len = raw()
    if name_len > 64 or r.pos + name_len > end:
        raise bad("dtype name too long")
    dtype = r.take(name_len, what).decode("ascii", "replace")
    data_at, data_len = raw()
    if data_at + data_len != end:
        raise bad(f"data of {data_len:,} bytes does not fill the ext value ({end - data_at:,} bytes left)")
    r.skip(data_len, what)
    if scalar and shape:
        raise bad("a numpy scalar with a shape")
    if math.prod(shape) > (1 << 62):
        raise bad(f"shape {list(shape)} is absurd")
    del name_at
    return InlineArray(dtype, shape, data_at, data_len, scalar, at)


def _complex(data: bytes, r: _Reader, at: int) -> complex:
    """msgpack.packb((real, imag)): a 2-list of floats or ints."""
    bad = CorruptMetadataError(f"ext 2 (complex) at byte {at} is not (real, imag)", r.where())
    if not data or data[0] != 0x92:
        raise bad
    parts: list[float] = []
    pos = 1
    for _ in range(2):
        if pos >= len(data):
            raise bad
        b = data[pos]
        if b <= 0x7F or b >= 0xE0:
            parts.append(b if b <= 0x7F else b - 0x100)
            pos += 1
        elif b in _FIXED and pos + 1 + _FIXED[b][1] <= len(data):
            fmt, n = _FIXED[b]
            parts.append(struct.unpack(fmt, data[pos + 1 : pos + 1 + n])[0])
            pos += 1 + n
        else:
            raise bad
    if pos != len(data):
        raise bad
    return complex(parts[0], parts[1])
