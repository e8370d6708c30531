"""Decode one torch.save archive without torch.

torch.save writes a zip: `<stem>/data.pkl` (the pickled object, whose
tensors point at storages by key) and `<stem>/data/<key>` (each storage's
raw little-endian bytes, STORED and 64-byte aligned). The stem is usually
"archive" but is whatever the writer chose, so members are found by suffix.

The archive can be given as bytes, or as a fetch function over a byte range
(a DCP storage entry inside a `.distcp` file). In the ranged case the zip is
parsed by the stdlib zipfile over a lazily fetched file object that caches
only the head and the tail of the archive: the central directory (at the
end) and `data.pkl` plus the storage's local header (at the start) cost a
couple of small reads, after which just the needed bytes of the storage are
read.
"""
from __future__ import annotations

import io
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import dtypes
from ..checksum import crc32
from ..errors import CkptError, CorruptMetadataError
from . import safe_pickle
from .safe_pickle import StorageRef, TensorRef

Fetch = Callable[[int, int], bytes]  # bytes [start, end) of the archive
FetchInto = Callable[[int, Any], None]  # fill a writable buffer with the archive's bytes from a position
Region = tuple[slice, ...]

# An archive this small is read in one request; bigger ones as head + tail.
_WHOLE_BELOW = 64 << 10
_HEAD = 16 << 10
_TAIL = 16 << 10
# A tensor claiming more than this many bytes is refused outright: a stride-0
# tensor can claim any size over a one-element storage.
MAX_TENSOR_BYTES = 1 << 40

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50


@dataclass(frozen=True)
class TensorPayload:
    """Where a tensor's bytes are inside its archive, and how to view them."""

    dtype: str  # canonical dtype name
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # elements
    storage_offset: int  # elements
    data_offset: int  # byte position of the storage member's data in the archive
    data_length: int  # bytes of the storage member
    data_crc: int  # CRC-32 of the storage member (0: not recorded)
    big_endian: bool = False
    # torch's lazy view bits: the stored values are to be conjugated / negated
    conj: bool = False
    neg: bool = False

    @property
    def itemsize(self) -> int:
        return dtypes.get(self.dtype).itemsize

    def span(self, region: Region | None = None) -> tuple[int, int] | None:
        """Byte range [start, end) of the archive holding `region`; None if empty."""
        region = _full_region(self.shape) if region is None else region
        if any(r.stop <= r.start for r in region):
            return None
        first = self.storage_offset + sum(r.start * s for r, s in zip(region, self.stride))
        last = first + sum((r.stop - 1 - r.start) * s for r, s in zip(region, self.stride))
        size = self.itemsize
        return self.data_offset + first * size, self.data_offset + (last + 1) * size


class _RangeFile(io.RawIOBase):
    """A read-only file over `fetch`, caching what it fetched (for zipfile)."""

    def __init__(self, fetch: Fetch, length: int) -> None:
        super().__init__()
        self._fetch = fetch
        self._length = length
        self._pos = 0
        self._segments: list[tuple[int, bytes]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        pos = base + offset
        if pos < 0:
            raise OSError("seek before the start of the archive")
        self._pos = pos
        return pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        data = self.get(self._pos, self._pos + n)
        buffer[:n] = data
        self._pos += n
        return n

    def get(self, start: int, end: int) -> bytes:
        """Bytes [start, end), from the cache when it holds them, else a block around them."""
        return self._get(start, end, exact=False)

    def get_exact(self, start: int, end: int) -> bytes:
        """Bytes [start, end), from the cache or else by a read of exactly that range."""
        return self._get(start, end, exact=True)

    def _get(self, start: int, end: int, *, exact: bool) -> bytes:
        for seg_start, seg in self._segments:
            if seg_start <= start and end <= seg_start + len(seg):
                return seg[start - seg_start : end - seg_start]
        if exact:
            lo, hi = start, end
        elif self._length <= _WHOLE_BELOW:
            lo, hi = 0, self._length
        elif end > self._length - _TAIL:
            lo, hi = min(start, self._length - _TAIL), self._length
        elif start < _HEAD:
            lo, hi = 0, max(end, _HEAD)
        else:  # rarely needed: a header beyond the head block
            lo, hi = start, min(self._length, max(end, start + _HEAD))
        data = self._fetch(lo, hi)
        if len(data) != hi - lo:
            raise CkptError(f"short read: wanted {hi - lo} bytes, got {len(data)}")
        # only header blocks are kept; tensor data is the caller's
        if not exact:
            self._segments.append((lo, data))
        return data[start - lo : end - lo]


class PayloadArchive:
    """One torch.save archive: its unpickled object and access to its storages."""

    def __init__(self, source: bytes | tuple[Fetch, int], where: str) -> None:
        self.where = where
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            self.length = len(data)
            self._file = _RangeFile(lambda a, b: data[a:b], len(data))
        else:
            fetch, length = source
            self.length = length
            self._file = _RangeFile(fetch, length)
        if self.length < 4 or self._file.get(0, 4) != b"PK\x03\x04":
            raise CorruptMetadataError(
                "not a torch.save zip archive (DCP saved with another serialization, "
                "e.g. safetensors, is not supported)",
                where,
            )
        try:
            self._zip = zipfile.ZipFile(self._file)
            infos = self._zip.infolist()
        except CkptError:
            raise
        except Exception as exc:
            raise CorruptMetadataError(f"damaged zip archive: {_first_line(exc)}", where) from None
        self._members = {info.filename: info for info in infos}
        self.prefix = self._find_prefix()
        self.big_endian = self._byteorder() == "big"
        self.obj, self.storages = safe_pickle.load_payload(self._member_bytes("data.pkl"), where)

    # -- members ---------------------------------------------------------
    def _find_prefix(self) -> str:
        """The archive stem ('archive/'): the directory holding the top-level data.pkl."""
        pickles = [n for n in self._members if n.endswith("data.pkl") and n.count("/") <= 1
                   and (n == "data.pkl" or n.endswith("/data.pkl"))]
        if len(pickles) != 1:
            found = "none" if not pickles else ", ".join(sorted(pickles))
            raise CorruptMetadataError(f"expected one data.pkl in the torch.save archive, found {found}", self.where)
        return pickles[0][: -len("data.pkl")]

    def _info(self, suffix: str) -> zipfile.ZipInfo | None:
        return self._members.get(self.prefix + suffix)

    def _member_position(self, info: zipfile.ZipInfo) -> tuple[int, int]:
        """(data start, size) of a STORED member, from its local header."""
        if info.flag_bits & 0x1:
            raise CorruptMetadataError(f"member {info.filename} is encrypted", self.where)
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptMetadataError(
                f"member {info.filename} is compressed (method {info.compress_type}); torch.save stores members uncompressed",
                self.where,
            )
        if info.compress_size != info.file_size:
            raise CorruptMetadataError(f"member {info.filename} has inconsistent sizes", self.where)
        start = info.header_offset
        if start < 0 or start + _LOCAL_HEADER.size > self.length:
            raise CorruptMetadataError(f"member {info.filename} lies outside the archive", self.where)
        header = self._file.get(start, start + _LOCAL_HEADER.size)
        signature, *_, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        if signature != _LOCAL_SIGNATURE:
            raise CorruptMetadataError(f"bad local header for member {info.filename}", self.where)
        data_start = start + _LOCAL_HEADER.size + name_len + extra_len
        if data_start + info.file_size > self.length:
            raise CorruptMetadataError(
                f"member {info.filename} ({info.file_size} bytes at {data_start}) runs past the "
                f"archive's {self.length} bytes",
                self.where,
            )
        return data_start, info.file_size

    def _member_bytes(self, suffix: str, limit: int = safe_pickle.MAX_PAYLOAD_PICKLE_BYTES) -> bytes:
        info = self._info(suffix)
        if info is None:
            raise CorruptMetadataError(f"torch.save archive has no {self.prefix}{suffix}", self.where)
        if info.file_size > limit:
            raise CorruptMetadataError(f"member {info.filename} is {info.file_size} bytes (limit {limit})", self.where)
        start, size = self._member_position(info)
        data = self._file.get(start, start + size)
        # torch can be told not to compute CRCs (they are then 0)
        if info.CRC and crc32(data) != info.CRC:
            raise CorruptMetadataError(f"member {info.filename} fails its CRC-32 check", self.where)
        return data

    def _byteorder(self) -> str:
        # archives from torch < 2.1 have no byteorder record: little-endian
        if self._info("byteorder") is None:
            return "little"
        order = self._member_bytes("byteorder", limit=16).decode("ascii", "replace").strip()
        if order not in ("little", "big"):
            raise CorruptMetadataError(f"unknown byteorder record {order!r}", self.where)
        return order

    # -- tensors ---------------------------------------------------------
    def locate(self, ref: TensorRef) -> TensorPayload:
        """Validate a TensorRef against its storage member and say where its bytes are."""
        storage: StorageRef = ref.storage
        info = self._info(f"data/{storage.key}")
        if info is None:
            raise CorruptMetadataError(f"storage {storage.key!r} is missing from the archive", self.where)
        data_start, size = self._member_position(info)
        if size != storage.nbytes:
            raise CorruptMetadataError(
                f"storage {storage.key!r} declares {storage.nbytes} bytes but the archive holds {size}", self.where
            )
        itemsize = dtypes.get(ref.dtype).itemsize
        numel = math.prod(ref.size)
        if numel * itemsize > MAX_TENSOR_BYTES:
            raise CorruptMetadataError(f"tensor of shape {list(ref.size)} is implausibly large", self.where)
        if numel:
            last = ref.storage_offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))
            if (last + 1) * itemsize > size:
                raise CorruptMetadataError(
                    f"{ref.dtype}{list(ref.size)} with stride {list(ref.stride)} at offset {ref.storage_offset} "
                    f"needs {(last + 1) * itemsize} bytes but its storage has {size}",
                    self.where,
                )
        return TensorPayload(
            dtype=ref.dtype,
            shape=ref.size,
            stride=ref.stride,
            storage_offset=ref.storage_offset,
            data_offset=data_start,
            data_length=size,
            data_crc=info.CRC,
            big_endian=self.big_endian,
            conj=ref.conj,
            neg=ref.neg,
        )

    def tensor(self) -> TensorPayload:
        """The archive's object as a tensor payload (a DCP tensor chunk)."""
        if not isinstance(self.obj, TensorRef):
            raise CorruptMetadataError(
                f"expected a tensor in the archive, found {type(self.obj).__name__}", self.where
            )
        return self.locate(self.obj)

    def read_bytes(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the archive (from what is already fetched when possible)."""
        return self._file.get_exact(start, end)

    def read_tensor(self, payload: TensorPayload, region: Region | None = None) -> np.ndarray:
        """Read a tensor (or a region of it) through this archive's cache."""
        return read_region(payload, region, self.read_bytes, self.where)

    def value(self) -> Any:
        """The archive's object with every tensor read into a numpy array."""
        return safe_pickle.finalize(self.obj, self.where, lambda ref: self.read_tensor(self.locate(ref)))


def open_payload(data: bytes, where: str) -> PayloadArchive:
    """A whole torch.save archive held in memory."""
    return PayloadArchive(data, where)


def open_payload_range(fetch: Fetch, length: int, where: str) -> PayloadArchive:
    """A torch.save archive of `length` bytes read on demand through `fetch(start, end)`."""
    if length <= 0:
        raise CorruptMetadataError(f"empty storage entry (length {length})", where)
    return PayloadArchive((fetch, length), where)


def load_value(data: bytes, where: str) -> Any:
    """Decode a DCP bytes item (torch.save of a Python object) to its value."""
    return open_payload(data, where).value()


def read_region(
    payload: TensorPayload, region: Region | None, fetch: Fetch, where: str, fetch_into: FetchInto | None = None
) -> np.ndarray:
    """Read `region` (slices local to the tensor) of a located tensor into numpy.

    Only the byte span from the region's first to its last element is fetched;
    strides (non-contiguous tensors) and the storage offset are applied here.
    Given `fetch_into`, a region whose bytes lie contiguous and in C order
    (the usual case: a whole chunk) is read straight into the result.
    """
    region = _full_region(payload.shape) if region is None else region
    dtype = dtypes.numpy_dtype(payload.dtype)
    out_shape = tuple(r.stop - r.start for r in region)
    span = payload.span(region)
    if span is None:
        return np.empty(out_shape, dtype=dtype)
    start, end = span
    if start < payload.data_offset or end > payload.data_offset + payload.data_length:
        raise CorruptMetadataError("tensor region lies outside its storage", where)
    whole_storage = (start, end) == (payload.data_offset, payload.data_offset + payload.data_length)
    if fetch_into is not None and _contiguous_c_order(payload, end - start, math.prod(out_shape) * dtype.itemsize):
        out = np.empty(out_shape, dtype=dtype)
        flat = out.reshape(-1).view(np.uint8)
        fetch_into(start, flat)
        if payload.data_crc and whole_storage and crc32(flat) != payload.data_crc:
            raise CorruptMetadataError("tensor data fails its CRC-32 check", where)
        return _apply_view_bits(_to_native(out) if payload.big_endian else out, payload)
    raw = fetch(start, end)
    if len(raw) != end - start:
        raise CorruptMetadataError(f"short read: wanted {end - start} bytes, got {len(raw)}", where)
    # the CRC can be checked whenever the whole storage was read anyway
    if payload.data_crc and whole_storage:
        if crc32(raw) != payload.data_crc:
            raise CorruptMetadataError("tensor data fails its CRC-32 check", where)
    itemsize = dtype.itemsize
    # stride over opaque items: as_strided goes through __array_interface__,
    # which cannot spell some ml_dtypes (float8 variants); view back after copying
    flat = np.frombuffer(raw, dtype=np.dtype(f"V{itemsize}"))
    view = np.lib.stride_tricks.as_strided(
        flat, shape=out_shape, strides=tuple(s * itemsize for s in payload.stride), writeable=False
    )
    out = np.array(view, copy=True).view(dtype)  # owns its memory, C order
    return _apply_view_bits(_to_native(out) if payload.big_endian else out, payload)


def _apply_view_bits(arr: np.ndarray, payload: TensorPayload) -> np.ndarray:
    """What torch's resolve_conj() / resolve_neg() give: the values the tensor
    stands for, not its stored ones (elementwise, so any region reads right)."""
    if payload.conj:
        np.conjugate(arr, out=arr)
    if payload.neg:
        np.negative(arr, out=arr)
    return arr


def _contiguous_c_order(payload: TensorPayload, span_bytes: int, region_bytes: int) -> bool:
    """Whether a region's span holds exactly its elements, in C order."""
    if span_bytes != region_bytes:
        return False  # gaps between the region's rows, or overlapping (stride 0) elements
    expected = 1
    for n, stride in zip(reversed(payload.shape), reversed(payload.stride)):
        if n > 1 and stride != expected:
            return False  # transposed or otherwise permuted storage
        expected *= n
    return True


def verify_crc(payload: TensorPayload, fetch: Fetch, where: str, block_bytes: int = 8 * 2**20) -> None:
    """Check the storage member's CRC-32 by streaming it in blocks (bounded memory)."""
    if not payload.data_crc:
        return  # torch was told not to record CRCs
    crc = 0
    end = payload.data_offset + payload.data_length
    for start in range(payload.data_offset, end, block_bytes):
        stop = min(end, start + block_bytes)
        raw = fetch(start, stop)
        if len(raw) != stop - start:
            raise CorruptMetadataError(f"short read: wanted {stop - start} bytes, got {len(raw)}", where)
        crc = crc32(raw, crc)
    if crc != payload.data_crc:
        raise CorruptMetadataError("tensor data fails its CRC-32 check", where)


def _to_native(arr: np.ndarray) -> np.ndarray:
    """Byte-swap a big-endian storage's values (ml_dtypes have no byte order of their own)."""
    size = arr.dtype.itemsize
    if size == 1:
        return arr
    lane = size // 2 if arr.dtype.kind == "c" else size  # complex: swap each component
    flat = np.ascontiguousarray(arr).reshape(-1)  # views that change itemsize need >= 1 dim
    return flat.view(np.dtype(f"u{lane}")).byteswap().view(arr.dtype).reshape(arr.shape)


def _full_region(shape: tuple[int, ...]) -> Region:
    return tuple(slice(0, n) for n in shape)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]
