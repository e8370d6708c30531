"""Streaming decoders for stored chunks too large to decode whole within the memory budget.

A stored chunk's compressed bytes are read in windows (byte-range reads
through the Storage layer: local files, OCDBT databases and object stores
alike) and run through the codec's own streaming decoder, so that memory
holds one window of compressed bytes and one band of decoded bytes,
whatever the chunk's size. The scheduler (scheduler/streaming.py) hands the bands out
in C order to the regions they feed.

Codecs: zarr v2 chunks compressed with zstd (orbax's default), gzip, zlib,
or not at all, with no filters and C order; zarr v3 chunks of `bytes` then
zstd or gzip, plain or in a shard of one inner chunk (as orbax writes zarr
v3: the inner chunk's byte range comes from the shard's index). Others
(blosc, whose blocks are not a stream; filters; Fortran order; transposes;
shards of several chunks) have no streaming decoder: the scheduler then
says which `--memory` would decode the chunk whole.
"""
from __future__ import annotations

import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

from ..base import dtypes
from ..base.bufferpool import POOL
from ..base.errors import CkptError
from ..storage import Storage

if TYPE_CHECKING:  # (numpy is imported where a chunk is decoded: inspect asks codecs about arrays and decodes none)
    import numpy as np

# compressed bytes fetched per range read (at most; smaller under a small budget)
WINDOW_BYTES = 8 * 2**20


def window_bytes(budget: int) -> int:
    """The compressed window under a memory budget: a stream holds three at a
    time (scheduler/streaming.py counts them), so a small budget gets small windows."""
    return max(256 * 2**10, min(WINDOW_BYTES, budget // 32))


class ByteStream(Protocol):
    def readinto(self, buffer: Any) -> int: ...


# one read-ahead thread per process: a streamed chunk runs alone (scheduler/streaming.py)
_READ_AHEAD = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-read-ahead")


class _WindowedSource:
    """A stored value read front to back in byte-range windows (a file-like .read for the decoders).

    The next window is fetched while the decoder works on this one (the
    read and the decode each took a third of a 2 GiB streamed convert, one
    after the other); memory holds two windows.
    """

    def __init__(self, storage: Storage, key: str, size: int, window: int = WINDOW_BYTES, start: int = 0,
                 tee: Callable[[bytes], None] | None = None) -> None:
        self._storage = storage
        self._key = key
        self._size = size  # the end of the bytes read (a shard's inner chunk ends before its index)
        self._pos = start
        self._window = window
        self._ahead: tuple[int, int, Future[bytes]] | None = None  # (start, end, fetch)
        self._tee = tee  # given every window read, in order (a chunk copied as it is stored)

    def _fetch(self, start: int, end: int) -> Future[bytes]:
        return _READ_AHEAD.submit(self._storage.read_range, self._key, start, end)

    def read(self, n: int = -1) -> bytes:
        if self._pos >= self._size:
            return b""
        want = self._window if n is None or n < 0 else max(1, min(n, self._window))
        end = min(self._size, self._pos + want)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == self._pos and ahead[1] >= end:
            data = ahead[2].result()
            end = ahead[1]
        else:
            if ahead is not None:
                ahead[2].cancel()
            data = self._storage.read_range(self._key, self._pos, end)
        self._pos = end
        if end < self._size:
            nxt = min(self._size, end + self._window)
            self._ahead = (end, nxt, self._fetch(end, nxt))
        if self._tee is not None:
            self._tee(data)
        return data

    def close(self) -> None:
        """Drop a window fetched ahead and not used (the stream stopped early)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead[2].cancel():
            try:
                ahead[2].result()
            except Exception:  # noqa: BLE001 - nobody wants these bytes
                pass

    @property
    def consumed(self) -> int:
        return self._pos


class _Raw:
    def __init__(self, src: _WindowedSource) -> None:
        self._src = src
        self._left = b""

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        got = 0
        while got < view.nbytes:
            if not self._left:
                self._left = self._src.read(view.nbytes - got)
                if not self._left:
                    break
            n = min(len(self._left), view.nbytes - got)
            view[got : got + n] = self._left[:n]
            self._left = self._left[n:]
            got += n
        return got


class _Zlib:
    """zlib / gzip: decompressobj with a bounded output per call (a small window can expand a lot)."""

    def __init__(self, src: _WindowedSource, wbits: int) -> None:
        self._src = src
        self._d = zlib.decompressobj(wbits)
        self._pending = b""  # compressed bytes not yet fed

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        got = 0
        while got < view.nbytes:
            if not self._pending:
                if self._d.eof:
                    break
                self._pending = self._d.unconsumed_tail or self._src.read()
                if not self._pending:
                    break
            out = self._d.decompress(self._pending, view.nbytes - got)
            self._pending = self._d.unconsumed_tail
            if self._d.eof:
                self._pending = b""
            view[got : got + len(out)] = out
            got += len(out)
        return got


def _zstd(src: _WindowedSource, window: int) -> ByteStream:
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(src, read_size=window, read_across_frames=False)


def zarr2_stream_problem(zmeta: dict[str, Any]) -> str | None:
    """Why a zarr v2 array's chunks cannot be decoded as a stream, or None."""
    if zmeta.get("filters"):
        return "its zarr filters"
    if zmeta.get("order", "C") != "C":
        return "Fortran order"
    comp = zmeta.get("compressor")
    cid = comp.get("id") if isinstance(comp, dict) else None
    if cid not in (None, "zstd", "gzip", "zlib"):
        return f"its {cid} compressor (no streaming decoder)"
    return None


def _zarr3_codecs(zmeta: dict[str, Any]) -> tuple[str | None, Literal["<", ">"], bool] | str:
    """A zarr v3 array's chunk codecs as (compressor or None, endian, sharded), or why they cannot stream.

    Streamable: `bytes` then optionally `zstd` or `gzip`; or, as orbax writes
    zarr v3, `sharding_indexed` holding ONE inner chunk of the whole chunk's
    shape with those codecs, its index (bytes + crc32c) at the end.
    """
    codecs = zmeta.get("codecs")
    if not isinstance(codecs, list) or not codecs or not all(isinstance(c, dict) for c in codecs):
        return "its codecs"
    sharded = codecs[0].get("name") == "sharding_indexed"
    if sharded:
        conf = codecs[0].get("configuration") or {}
        outer = ((zmeta.get("chunk_grid") or {}).get("configuration") or {}).get("chunk_shape")
        if len(codecs) != 1 or conf.get("chunk_shape") != outer:
            return "a shard of several inner chunks"
        if conf.get("index_location", "end") != "end":
            return "a shard index at the start"
        index = [c.get("name") for c in conf.get("index_codecs") or [] if isinstance(c, dict)]
        if index != ["bytes", "crc32c"]:
            return f"shard index codecs {index}"
        codecs = conf.get("codecs")
        if not isinstance(codecs, list) or not all(isinstance(c, dict) for c in codecs):
            return "its codecs"
    names = [c.get("name") for c in codecs]
    if not names or names[0] != "bytes" or len(names) > 2 or (len(names) == 2 and names[1] not in ("zstd", "gzip")):
        return f"its codecs {names} (streamed: bytes, then zstd or gzip)"
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    return (names[1] if len(names) == 2 else None), ("<" if endian == "little" else ">"), sharded


def zarr3_stream_problem(zmeta: dict[str, Any]) -> str | None:
    """Why a zarr v3 array's chunks cannot be decoded as a stream, or None."""
    found = _zarr3_codecs(zmeta)
    return found if isinstance(found, str) else None


class ChunkStream:
    """The decoded bytes of one stored zarr chunk (v2, or v3 as orbax writes it), read front to back."""

    def __init__(self, storage: Storage, key: str, zmeta: dict[str, Any], stored_nbytes: int,
                 zarr3: bool = False, window: int = WINDOW_BYTES, tee: Callable[[bytes], None] | None = None) -> None:
        problem = zarr3_stream_problem(zmeta) if zarr3 else zarr2_stream_problem(zmeta)
        if problem:
            raise CkptError(f"cannot decode as a stream: {problem}", key)
        self.key = key
        self.expected = stored_nbytes
        size = self.stored_size = storage.size(key)  # (the whole value: a shard's index included)
        start = 0
        if zarr3:
            codecs = _zarr3_codecs(zmeta)
            if isinstance(codecs, str):  # (not after zarr3_stream_problem above: the types only)
                raise CkptError(f"cannot decode as a stream: {codecs}", key)
            cid, endian, sharded = codecs
            if sharded:
                start, size = _one_chunk_shard(storage, key, size)
            self._np_dtype = _zarr3_numpy_dtype(zmeta, endian)
        else:
            comp = zmeta.get("compressor")
            cid = comp.get("id") if isinstance(comp, dict) else None
            self._np_dtype = _zarr2_numpy_dtype(zmeta)
        self.start, self.end = start, size  # the chunk's bytes within the stored value
        self._src = _WindowedSource(storage, key, size, window=window, start=start, tee=tee)
        self.codec = cid or "raw"
        if cid == "zstd":
            self._stream: ByteStream = _zstd(self._src, window)
        elif cid == "gzip":
            self._stream = _Zlib(self._src, 16 + zlib.MAX_WBITS)
        elif cid == "zlib":
            self._stream = _Zlib(self._src, zlib.MAX_WBITS)
        else:
            if size - start != stored_nbytes:
                raise CkptError(f"uncompressed chunk holds {size - start} bytes, its shape needs {stored_nbytes}",
                                storage._where(key))
            self._stream = _Raw(self._src)
        self._where = storage._where(key)
        self.decoded = 0

    def read_band(self, shape: tuple[int, ...]) -> np.ndarray:
        """The next band of decoded elements, as a native-order array of `shape`."""
        import numpy as np

        out = POOL.empty(shape, self._np_dtype)
        self._decode_into(out.reshape(-1).view(np.uint8).data if out.nbytes else memoryview(b""))
        if not out.dtype.isnative:
            out = out.astype(out.dtype.newbyteorder("="))
        return out

    def _decode_into(self, view: memoryview) -> None:
        """Fill `view` with the next decoded bytes; an error if the chunk ends first or does not decode."""
        want = view.nbytes
        got = 0
        try:
            while got < want:
                n = self._stream.readinto(view[got:])
                if not n:
                    break
                got += n
        except CkptError:
            raise
        except Exception as exc:  # zstd / zlib errors: a damaged chunk
            raise CkptError(f"chunk does not decode ({self.codec}): {exc}", self._where) from None
        self.decoded += got
        if got < want:
            raise CkptError(
                f"chunk decodes to {self.decoded} bytes, its shape needs {self.expected} ({self.codec})", self._where
            )

    def close(self) -> None:
        """Stop reading (after the last band, or a pass that needed fewer)."""
        self._src.close()

    def check(self, scratch: memoryview) -> None:
        """Decode the whole chunk into `scratch` (reused: the values are not kept), then finish():
        the check that it decodes to exactly the bytes its shape needs."""
        while self.decoded < self.expected:
            self._decode_into(scratch[: min(scratch.nbytes, self.expected - self.decoded)])
        self.finish()
        # what the decoder did not need (the window's tail) is fetched and handed on too
        while self._src.read():
            pass

    def finish(self) -> None:
        """After the last band: nothing may follow (a chunk decoding to more than its shape is damaged)."""
        extra = bytearray(1)
        try:
            more = self._stream.readinto(extra)
        except Exception as exc:  # noqa: BLE001
            raise CkptError(f"chunk does not decode ({self.codec}): {exc}", self._where) from None
        if more:
            raise CkptError(f"chunk decodes to more than the {self.expected} bytes its shape needs ({self.codec})", self._where)


# decoded bytes per call when a copied chunk is checked (a reused buffer: nothing of it is kept)
_CHECK_BYTES = 1 << 20
_SCRATCH = threading.local()


def copy_stored_chunk(storage: Storage, key: str, zmeta: dict[str, Any], zarr3: bool, stored_nbytes: int,
                      write: Callable[[bytes], None], window: int = WINDOW_BYTES) -> int:
    """Hand a stored zarr chunk's bytes to `write`, as they are stored, window by window; returns
    how many. Each window is decoded as it passes (into a reused buffer), as the check that the
    chunk holds what its metadata claims: a damaged chunk raises CkptError (what was written
    before it is the caller's to drop). Memory: the windows, whatever the chunk's size.

    A one-chunk shard (zarr v3) is copied whole, index included: its inner chunk is checked."""
    scratch = getattr(_SCRATCH, "buffer", None)
    if scratch is None:
        scratch = _SCRATCH.buffer = memoryview(bytearray(_CHECK_BYTES))
    copied = 0

    def tee(data: bytes) -> None:
        nonlocal copied
        write(data)
        copied += len(data)

    stream = ChunkStream(storage, key, zmeta, stored_nbytes, zarr3=zarr3, window=window, tee=tee)
    size = stream.stored_size
    try:
        if stream.start:  # (bytes before a shard's inner chunk: orbax's shards have none)
            tee(storage.read_range(key, 0, stream.start))
        stream.check(scratch)
    finally:
        stream.close()
    for start in range(stream.end, size, window):  # a shard's index and checksum
        tee(storage.read_range(key, start, min(size, start + window)))
    if copied != size:
        raise CkptError(f"copied {copied} of the chunk's {size} stored bytes", storage._where(key))
    return copied


def _one_chunk_shard(storage: Storage, key: str, size: int) -> tuple[int, int]:
    """Where the one inner chunk of a zarr v3 shard lies: (start, end), from the shard's index."""
    where = storage._where(key)
    if size < 20:
        raise CkptError(f"shard of {size} bytes has no room for its 20-byte index", where)
    index = storage.read_range(key, size - 20, size)
    from ..base.checksum import crc32c

    if crc32c(index[:16]) != int.from_bytes(index[16:], "little"):
        raise CkptError("shard index fails its crc32c check", where)
    offset, nbytes = int.from_bytes(index[:8], "little"), int.from_bytes(index[8:16], "little")
    if offset == nbytes == 2**64 - 1:
        raise CkptError("shard holds no chunk (its index marks it missing)", where)
    if offset + nbytes > size - 20:
        raise CkptError(f"shard index points at bytes [{offset}, {offset + nbytes}) of a {size - 20}-byte shard", where)
    return offset, offset + nbytes


def _zarr3_numpy_dtype(zmeta: dict[str, Any], endian: Literal["<", ">"]) -> np.dtype:
    native = dtypes.numpy_dtype(dtypes.from_zarr3(zmeta["data_type"]).name)
    return native.newbyteorder(endian) if native.itemsize > 1 else native


def _zarr2_numpy_dtype(zmeta: dict[str, Any]) -> np.dtype:
    """The stored element type with its byte order ('<f4', '>i2', 'bfloat16', ...)."""
    native = dtypes.numpy_dtype(dtypes.from_zarr2(zmeta["dtype"]).name)
    text = zmeta["dtype"]
    if isinstance(text, str) and text[:1] in "<>" and native.itemsize > 1:
        return native.newbyteorder("<" if text[0] == "<" else ">")
    return native


class _InMemory:
    """One stored value already in memory, offered to ChunkStream as the Storage calls it makes
    (size, read_range, _where): a small chunk found by an OCDBT walk decodes as a streamed one does."""

    __slots__ = ("_data", "_where_text")

    def __init__(self, data: bytes | memoryview, where: str) -> None:
        self._data = data
        self._where_text = where

    def size(self, key: str) -> int:
        return len(self._data)

    def read_range(self, key: str, start: int, end: int) -> bytes | memoryview:
        if start < 0 or end > len(self._data) or start > end:
            raise CkptError(f"truncated: needed bytes [{start}, {end}) but it has {len(self._data)} bytes",
                            self._where_text)
        return self._data[start:end]

    def _where(self, key: str) -> str:
        return self._where_text


def stored_itemsize(zmeta: dict[str, Any], zarr3: bool) -> int:
    """Bytes per element of a zarr array's stored chunks (the table's: asked per array by inspect,
    which makes no numpy dtype, nor imports ml_dtypes for one)."""
    if zarr3:
        return dtypes.from_zarr3(zmeta["data_type"]).itemsize
    return dtypes.from_zarr2(zmeta["dtype"]).itemsize


def decode_chunk(data: bytes | memoryview, zmeta: dict[str, Any], zarr3: bool, chunk_shape: tuple[int, ...],
                 where: str) -> np.ndarray:
    """A whole stored chunk held in memory, decoded (native byte order, the chunk's full shape) by the
    same decoders and checks as a chunk streamed from storage (ChunkStream)."""
    import numpy as np

    nbytes = int(np.prod(chunk_shape, dtype=np.int64)) * stored_itemsize(zmeta, zarr3)
    if not zarr3 and nbytes <= _WHOLE_BYTES:
        fast = _zarr2_whole(data, zmeta, nbytes)
        if fast is not None:
            out = np.frombuffer(fast, dtype=_zarr2_numpy_dtype(zmeta)).reshape(chunk_shape)
            return out.astype(out.dtype.newbyteorder("=")) if not out.dtype.isnative else out.copy()
    stream = ChunkStream(_InMemory(data, where), where, zmeta, nbytes, zarr3=zarr3,  # type: ignore[arg-type]
                         window=max(1, len(data)))
    try:
        out = stream.read_band(tuple(chunk_shape))
        stream.finish()
    finally:
        stream.close()
    return out


_THREAD = threading.local()
# chunks up to this size are decoded in one call (then copied into a writable array); larger ones
# are decoded by ChunkStream straight into their array, with no second copy
_WHOLE_BYTES = 1 << 20


def _zarr2_whole(data: bytes | memoryview, zmeta: dict[str, Any], nbytes: int) -> bytes | memoryview | None:
    """The decoded bytes of a small zarr v2 chunk (raw, or one zstd frame that declares exactly
    `nbytes` and has nothing after it), in one call (3 us against ChunkStream's 27 us for a
    256-byte chunk: 100,000 of them per validate of a 100k-leaf save); None for anything else,
    which ChunkStream then decodes or refuses in its own words."""
    comp = zmeta.get("compressor")
    cid = comp.get("id") if isinstance(comp, dict) else None
    if cid is None:
        return data if len(data) == nbytes else None
    if cid != "zstd":
        return None
    import zstandard

    dctx = getattr(_THREAD, "zstd", None)
    if dctx is None:  # a decompression context is not shared between threads
        dctx = _THREAD.zstd = zstandard.ZstdDecompressor()
    try:
        if zstandard.frame_content_size(data) != nbytes:
            return None
        obj = dctx.decompressobj()
        out = obj.decompress(data)
    except zstandard.ZstdError:
        return None
    if not obj.eof or obj.unused_data or len(out) != nbytes:
        return None
    return out
