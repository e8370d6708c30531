"""DCP storage transforms: torch's ZStandard extension, decoded as a stream.

torch.distributed.checkpoint's `FileSystemWriter(..., _extensions=[ZStandard()])`
pipes every stored item through a zstd compressor and records
`transform_descriptors=['stream.zstd/1']` in the item's `_StorageInfo`; on
load, torch applies the listed transforms in order to the item's byte range
(torch/distributed/checkpoint/_extension.py, filesystem.py). The decoded
bytes are the usual torch.save archive.

A zstd frame has no random access, so a decoded item is read forward only,
in blocks, and never held whole:

  * `DecodedEntry.scan()` decodes the item once to learn its decoded length
    and keep its first and last few KiB (the zip's local headers, data.pkl
    and central directory: all the archive parsing needs);
  * `DecodedEntry.fetch(start, end)` serves a byte range from those blocks,
    or else from a decoding cursor that skips forward to `start`. Cursors are
    kept in a small shared LRU, so reading a big chunk block by block, in
    order, decodes it about once more rather than once per block.

The decoded size is bounded by what `.metadata` says the item holds: a
stream that decodes to more is refused (a zstd bomb costs no more than the
bound), and memory stays at a few blocks whatever the item's size.
"""
from __future__ import annotations

import io
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

from ...base.errors import CkptError, CorruptMetadataError

Fetch = Callable[[int, int], bytes]

ZSTD = "stream.zstd"
KNOWN = (f"{ZSTD}/1",)
_BLOCK = 1 << 20  # raw bytes per storage read, decoded bytes per step
_KEEP = 64 << 10  # decoded head and tail kept by scan()
_MAX_CURSORS = 4  # live decoders kept across reads (each holds a zstd window, a few MiB)


class UnknownTransformError(CkptError):
    """A transform descriptor ckpt cannot undo (named in the message)."""


def check(descriptors: Sequence[str], where: str | None) -> None:
    """Refuse, by name, any transform other than torch's ZStandard (version 1.x)."""
    for desc in descriptors:
        name, _, version = desc.partition("/")
        if name != ZSTD or version.partition(".")[0] != "1":
            raise UnknownTransformError(
                f"stored with transform {desc!r}, which ckpt cannot decode "
                f"(it reads torch's ZStandard extension, {', '.join(KNOWN)})",
                where,
            )


def describe_unknown(descriptors: Sequence[str]) -> list[str]:
    """The descriptors `check` would refuse."""
    out = []
    for desc in descriptors:
        try:
            check([desc], None)
        except UnknownTransformError:
            out.append(desc)
    return out


class _RawStream(io.RawIOBase):
    """A forward-only file over fetch(start, end) of one storage entry."""

    def __init__(self, fetch: Fetch, length: int) -> None:
        super().__init__()
        self._fetch = fetch
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._length - self._pos, _BLOCK)
        if n <= 0:
            return 0
        data = self._fetch(self._pos, self._pos + n)
        if len(data) != n:
            raise CkptError(f"short read: wanted {n} bytes, got {len(data)}")
        buffer[:n] = data
        self._pos += n
        return n


def _open_decoder(fetch: Fetch, length: int, descriptors: Sequence[str]) -> Any:
    import zstandard  # the well-kept binding torch itself prefers

    stream: Any = _RawStream(fetch, length)
    for _ in descriptors:  # torch applies them in the recorded order on load
        stream = zstandard.ZstdDecompressor().stream_reader(stream, read_size=_BLOCK, closefd=False)
    return stream


class _Cursor:
    def __init__(self, fetch: Fetch, length: int, descriptors: Sequence[str]) -> None:
        self.reader = _open_decoder(fetch, length, descriptors)
        self.what = "+".join(descriptors)
        self.pos = 0

    def read(self, n: int, where: str) -> bytes:
        try:
            data = self.reader.read(n)
        except CkptError:
            raise
        except Exception as exc:  # zstandard.ZstdError and friends: the input's fault
            raise CorruptMetadataError(
                f"the {self.what} stream does not decode: {_first_line(exc)}", where
            ) from None
        self.pos += len(data)
        return data

    def read_into(self, buffer: memoryview, where: str) -> int:
        try:
            n = self.reader.readinto(buffer)
        except CkptError:
            raise
        except Exception as exc:
            raise CorruptMetadataError(
                f"the {self.what} stream does not decode: {_first_line(exc)}", where
            ) from None
        self.pos += n
        return n


_cursors: OrderedDict[tuple[Any, ...], _Cursor] = OrderedDict()
_cursor_lock = threading.Lock()
# Reads of one entry are serialised (a zstd stream decodes in order anyway):
# a worker asking for the next block waits for the cursor instead of
# decoding the stream again from its start. Striped: a lock per entry would
# grow with the checkpoint.
_ENTRY_LOCKS = tuple(threading.Lock() for _ in range(64))


class DecodedEntry:
    """The decoded bytes of one transformed storage entry."""

    def __init__(
        self, fetch: Fetch, raw_length: int, descriptors: Sequence[str], where: str, *,
        max_decoded: int, key: tuple[Any, ...] | None = None, length: int | None = None,
    ) -> None:
        check(descriptors, where)
        self._fetch = fetch
        self._raw_length = raw_length
        self._descriptors = tuple(descriptors)
        self.where = where
        self.max_decoded = max_decoded
        self._key = key  # identifies the entry in the cursor cache (None: never cached)
        self.length = length  # decoded bytes; None until scan()
        self._head = b""
        self._tail = b""

    def scan(self) -> int:
        """Decode the whole entry once (bounded memory): its length, head and tail."""
        if self._raw_length <= 0:
            raise CorruptMetadataError(f"empty storage entry (length {self._raw_length})", self.where)
        cursor = _Cursor(self._fetch, self._raw_length, self._descriptors)
        head = bytearray()
        tail = bytearray()
        for block in self._decoded_blocks(cursor):
            if len(head) < _KEEP:
                head += block[: _KEEP - len(head)]
            tail += block
            if len(tail) > 2 * _KEEP:
                del tail[: len(tail) - _KEEP]
        self.length = cursor.pos
        self._head = bytes(head)
        self._tail = bytes(tail[-_KEEP:]) if tail else b""
        return self.length

    def fetch(self, start: int, end: int) -> bytes:
        """Decoded bytes [start, end)."""
        length = self.length if self.length is not None else self.scan()
        if start < 0 or end > length or end < start:
            raise CorruptMetadataError(f"read of [{start}, {end}) past the decoded item's {length} bytes", self.where)
        if end <= len(self._head):
            return self._head[start:end]
        tail_start = length - len(self._tail)
        if start >= tail_start and self._tail:
            return self._tail[start - tail_start : end - tail_start]
        out = bytearray(end - start)
        self.fetch_into(start, out)
        return out  # type: ignore[return-value]  # (bytes-like: callers only slice and buffer it)

    def fetch_into(self, start: int, buffer: Any) -> None:
        """Decode bytes [start, start + len(buffer)) straight into `buffer` (no second copy of a big region)."""
        length = self.length if self.length is not None else self.scan()
        view = memoryview(buffer).cast("B")
        if start < 0 or start + len(view) > length:
            raise CorruptMetadataError(
                f"read of [{start}, {start + len(view)}) past the decoded item's {length} bytes", self.where
            )
        lock = _ENTRY_LOCKS[hash(self._key) % len(_ENTRY_LOCKS)] if self._key is not None else None
        if lock is not None:
            lock.acquire()
        try:
            self._decode_into(start, view)
        finally:
            if lock is not None:
                lock.release()

    def _decode_into(self, start: int, view: memoryview) -> None:
        cursor = self._take_cursor(start)
        while cursor.pos < start:  # skip forward (decoded and dropped block by block)
            if not cursor.read(min(_BLOCK, start - cursor.pos), self.where):
                raise CorruptMetadataError("zstd stream ended early", self.where)
        out = view
        filled = 0
        while filled < len(out):
            n = cursor.read_into(out[filled : filled + _BLOCK], self.where)
            if not n:
                raise CorruptMetadataError("zstd stream ended early", self.where)
            filled += n
        # back to the pool after a whole read only: a failed cursor is not reused
        self._give_cursor(cursor)

    def read_all(self) -> bytes:
        """The whole decoded item (for small bytes items), at most max_decoded bytes."""
        cursor = _Cursor(self._fetch, self._raw_length, self._descriptors)
        return b"".join(self._decoded_blocks(cursor))

    def _decoded_blocks(self, cursor: _Cursor) -> Iterator[bytes]:
        """The cursor's blocks to the end of the stream, never past max_decoded bytes (a zstd bomb stops early)."""
        while True:
            block = cursor.read(_BLOCK, self.where)
            if not block:
                return
            if cursor.pos > self.max_decoded:
                raise CorruptMetadataError(
                    f"zstd stream decodes to more than {self.max_decoded} bytes, more than .metadata "
                    "says this item holds",
                    self.where,
                )
            yield block

    def _take_cursor(self, start: int) -> _Cursor:
        if self._key is not None:
            with _cursor_lock:
                cursor = _cursors.pop(self._key, None)
            if cursor is not None and cursor.pos <= start:
                return cursor
        return _Cursor(self._fetch, self._raw_length, self._descriptors)

    def _give_cursor(self, cursor: _Cursor) -> None:
        if self._key is None or cursor.pos >= (self.length or 0):
            return
        with _cursor_lock:
            _cursors[self._key] = cursor
            _cursors.move_to_end(self._key)
            while len(_cursors) > _MAX_CURSORS:
                _cursors.popitem(last=False)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]
