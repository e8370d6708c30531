"""Decode one torch.save archive without torch.

torch.save writes a zip: `<stem>/data.pkl` (the pickled object, whose
tensors point at storages by key) and `<stem>/data/<key>` (each storage's
raw little-endian bytes, STORED and 64-byte aligned). The stem is usually
"archive" but is whatever the writer chose, so members are found by suffix.

The archive can be given as bytes, or as a fetch function over a byte range
(a DCP storage entry inside a `.distcp` file). The zip is parsed over a
lazily fetched file object that caches only the head and the tail of the
archive: the central directory (at the end) and `data.pkl` plus the
storage's local header (at the start) cost a couple of small reads, after
which just the needed bytes of the storage are read.

The zip structure is checked the way torch's reader does it
(PyTorchFileReader over miniz, then torch/serialization.py's `_load`), not
the lenient way of Python's zipfile: the end-of-central-directory and zip64
records, every central-directory entry (signature, sizes, disk numbers,
flags, bounds), the local header of each record read, one top-level
directory holding every member, the `version` (or `.data/version`) record
as a supported number, `byteorder` exactly "little" or "big",
`.storage_alignment` an integer, and the CRC-32 of every record torch reads
(`data.pkl`, `.format_version`, `byteorder`, `.storage_alignment`, the
version, `.data/serialization_id`; the storages' CRCs are checked when read).
An archive that passes here is one torch.load opens.
"""
from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np

from ...base import dtypes
from ...base.checksum import crc32
from ...base.errors import CkptError, CorruptMetadataError
from ...base.text import is_ascii_number
from . import safe_pickle
from .safe_pickle import StorageRef, TensorRef

Fetch = Callable[[int, int], bytes]  # bytes [start, end) of the archive
# read_region also takes a view of bytes already held (a member kept in memory): it only measures,
# checksums and wraps what it fetches
RegionFetch = Callable[[int, int], bytes | memoryview]
FetchInto = Callable[[int, Any], None]  # fill a writable buffer with the archive's bytes from a position
Region = tuple[slice, ...]
# a format's own stand-ins for the classes its writer pickles, beside the allow-list
# (safe_pickle: exact (module, name) pairs, data only); None: the allow-list alone
Allow = Optional[Mapping[tuple[str, str], Any]]

# An archive this small is read in one request; bigger ones as head + tail.
_WHOLE_BELOW = 64 << 10
WHOLE_FETCH_BELOW = _WHOLE_BELOW  # an archive this small is fetched whole by its first read (readers rely on it)
_HEAD = 16 << 10
_TAIL = 16 << 10
# A tensor claiming more than this many bytes is refused outright: a stride-0
# tensor can claim any size over a one-element storage.
MAX_TENSOR_BYTES = 1 << 40

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_CENTRAL_SIGNATURE = 0x02014B50
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_EOCD_SIGNATURE = 0x06054B50
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_ZIP64_LOCATOR_SIGNATURE = 0x07064B50
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_ZIP64_EOCD_SIGNATURE = 0x06064B50
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
# general-purpose flags miniz refuses: encrypted, compressed patch, strong
# encryption, masked local headers
_REFUSED_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000
# torch's caffe2/serialize/versions.h: kMinSupportedFileFormatVersion and
# kMaxSupportedFileFormatVersion (torch 2.13 reads 1 to 10, writes 3)
_MIN_FILE_VERSION, _MAX_FILE_VERSION = 1, 10
# the records torch reads (and so CRC-checks) besides data.pkl and the storages
_SMALL_RECORDS = (".format_version", "byteorder", ".storage_alignment", ".data/serialization_id")
_MAX_RECORD_BYTES = 1 << 10


@dataclass(frozen=True)
class _Member:
    """One central-directory entry (the fields torch's reader uses)."""

    filename: str  # latin-1 decoded: one character per byte, as miniz compares them
    header_offset: int
    compress_size: int
    file_size: int
    CRC: int
    flag_bits: int
    compress_type: int


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


@dataclass(frozen=True)
class DistinctValues:
    """The values a view that repeats stored elements draws from, as a view of its own.

    A view whose logical elements outnumber the storage elements it spans
    (torch's `expand`: stride 0; `as_strided` with strides below the
    contiguous ones: elements that overlap) costs its logical size to read
    but holds no more values than its storage. `shape`/`stride` (elements;
    from the same storage offset) give those values: the view with its
    stride-0 and size-1 dimensions dropped, which the view repeats exactly
    `repeats` times (an expand); or, when what is left still overlaps, the
    span of storage elements it reaches, flat, which it repeats unevenly
    (`repeats` None).
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    repeats: int | None


def span_elements(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Storage elements from a view's first element to its last (0 for an empty view)."""
    if any(n <= 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def distinct_values(shape: tuple[int, ...], stride: tuple[int, ...]) -> DistinctValues | None:
    """For a view that repeats stored elements, the values it draws from (DistinctValues); None for a
    view with no more elements than the storage it spans (reading it costs its stored bytes)."""
    numel = math.prod(shape)
    if numel <= span_elements(shape, stride):
        return None
    kept = [(n, s) for n, s in zip(shape, stride) if n > 1 and s != 0]
    kept_shape = tuple(n for n, _ in kept)
    kept_stride = tuple(s for _, s in kept)
    # (logical counts of the view are those of the kept view, `repeats` times over: dropping
    # stride-0 dimensions is exact whatever the kept view holds)
    repeats = numel // math.prod(kept_shape)
    span = span_elements(kept_shape, kept_stride)
    if math.prod(kept_shape) <= span:
        return DistinctValues(kept_shape, kept_stride, repeats)
    return DistinctValues((span,), (1,), None)


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

    def __init__(self, source: bytes | tuple[Fetch, int], where: str, allow: Allow = None) -> None:
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
        infos = self._central_directory()
        self._members: dict[str, _Member] = {}
        for info in infos:
            if info.filename in self._members:
                raise CorruptMetadataError(f"zip archive lists {info.filename} twice", where)
            self._members[info.filename] = info
        self.prefix = self._find_prefix(infos)
        self.big_endian = self._byteorder() == "big"
        self.obj, self.storages = safe_pickle.load_payload(self._member_bytes("data.pkl"), where, allow)
        # (after the pickle, so that a hostile one is named as such even in an archive torch would refuse)
        self._check_records()

    # -- the zip structure, as miniz reads it ------------------------------
    def _damaged(self, what: str) -> CorruptMetadataError:
        return CorruptMetadataError(f"damaged zip archive: {what} (torch cannot open it)", self.where)

    def _end_records(self) -> tuple[int, int, int]:
        """(central directory offset, its size, entry count) from the end records, checked as miniz does."""
        n = self.length
        if n < _EOCD.size:
            raise self._damaged("too short for an end-of-central-directory record")
        # miniz finds the last EOCD signature with a whole record after it,
        # searching back ~64 KiB; torch writes it at the very end
        lo = n - _EOCD.size
        tail = self._file.get(lo, n)
        at = 0 if tail.startswith(b"PK\x05\x06") else -1
        if at < 0:
            lo = max(0, n - (_U16 + _EOCD.size))
            tail = self._file.get(lo, n)
            at = tail.rfind(b"PK\x05\x06", 0, len(tail) - _EOCD.size + 4)
        if at < 0:
            raise self._damaged("no end-of-central-directory record")
        eocd = lo + at
        _, disk, cd_disk, entries_here, entries, cd_size, cd_offset, _ = _EOCD.unpack(tail[at:at + _EOCD.size])
        if eocd >= _ZIP64_LOCATOR.size + _ZIP64_EOCD.size:
            loc = self._file.get(eocd - _ZIP64_LOCATOR.size, eocd)
            sig, _, z64_offset, disks = _ZIP64_LOCATOR.unpack(loc)
            if sig == _ZIP64_LOCATOR_SIGNATURE:
                if z64_offset > n - _ZIP64_EOCD.size:
                    raise self._damaged("zip64 end record outside the archive")
                rec = _ZIP64_EOCD.unpack(self._file.get(z64_offset, z64_offset + _ZIP64_EOCD.size))
                if rec[0] == _ZIP64_EOCD_SIGNATURE:  # otherwise miniz keeps the 32-bit values
                    if rec[1] < _ZIP64_EOCD.size - 12:
                        raise self._damaged("zip64 end record too small")
                    if disks != 1:
                        raise self._damaged("multi-disk archive")
                    if rec[7] > _U32:
                        raise self._damaged("too many entries")
                    disk, cd_disk, entries_here, entries, cd_size, cd_offset = rec[4:10]
        if entries != entries_here or ((disk | cd_disk) != 0 and (disk != 1 or cd_disk != 1)):
            raise self._damaged("multi-disk archive")
        if cd_size < entries * _CENTRAL.size or cd_offset + cd_size > n:
            raise self._damaged("central directory outside the archive")
        if entries == 0:
            raise self._damaged("no members")
        return cd_offset, cd_size, entries

    def _central_directory(self) -> list[_Member]:
        cd_offset, cd_size, entries = self._end_records()
        cd = self._file.get(cd_offset, cd_offset + cd_size)
        out: list[_Member] = []
        p = 0
        for _ in range(entries):
            if cd_size - p < _CENTRAL.size:
                raise self._damaged("central directory entry cut short")
            (sig, _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len, comment_len,
             disk_start, _, external_attr, offset) = _CENTRAL.unpack_from(cd, p)
            if sig != _CENTRAL_SIGNATURE:
                raise self._damaged("bad central directory entry signature")
            end = p + _CENTRAL.size + name_len + extra_len + comment_len
            if end > cd_size:
                raise self._damaged("central directory entry runs past the directory")
            raw_name = cd[p + _CENTRAL.size : p + _CENTRAL.size + name_len]
            try:
                raw_name.decode("utf-8")  # torch.load lists every record name as a str
            except UnicodeDecodeError:
                raise self._damaged(f"member name {raw_name[:60]!r} is not UTF-8") from None
            name = raw_name.decode("latin-1")
            if _U32 in (csize, usize, offset):
                usize, csize, offset = self._zip64_extra(
                    cd[p + _CENTRAL.size + name_len : p + _CENTRAL.size + name_len + extra_len], usize, csize, offset, name
                )
            if (method == 0 and usize != csize) or (usize and not csize):
                raise self._damaged(f"member {name} has inconsistent sizes")
            if disk_start == _U16 or disk_start not in (0, 1):
                raise self._damaged(f"member {name} is on another disk")
            if offset + _LOCAL_HEADER.size + csize > self.length:
                raise self._damaged(f"member {name} lies outside the archive")
            if flags & _REFUSED_FLAGS:
                raise self._damaged(f"member {name} is encrypted or patched (flags 0x{flags:04x})")
            if name.endswith("/") or external_attr & 0x10:
                # miniz extracts nothing for a directory: torch would leave the storage uninitialised
                raise self._damaged(f"member {name} is marked as a directory")
            out.append(_Member(name, offset, csize, usize, crc, flags, method))
            p = end
        return out

    def _zip64_extra(self, extra: bytes, usize: int, csize: int, offset: int, name: str) -> tuple[int, int, int]:
        """The zip64 extended-information field's 8-byte values for the 32-bit fields that are 0xFFFFFFFF."""
        pos = 0
        while pos + 4 <= len(extra):
            field_id, size = struct.unpack_from("<HH", extra, pos)
            if pos + 4 + size > len(extra):
                break
            if field_id == 0x0001:
                values = list(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
                out = []
                for v in (usize, csize, offset):
                    if v == _U32:
                        if not values:
                            raise self._damaged(f"member {name}: zip64 field too short")
                        v = values.pop(0)
                    out.append(v)
                return out[0], out[1], out[2]
            pos += 4 + size
        raise self._damaged(f"member {name}: 32-bit size or offset overflowed without a zip64 field")

    def _check_records(self) -> None:
        """The records torch reads before the pickle, with the checks it makes on them."""
        if self._info(".data/version") is not None:
            raw = self._member_bytes(".data/version", limit=_MAX_RECORD_BYTES)
        elif self._info("version") is not None:
            raw = self._member_bytes("version", limit=_MAX_RECORD_BYTES)
        else:
            raise self._damaged(f"no {self.prefix}version record")
        text = raw.decode("latin-1").strip()
        if not is_ascii_number(text) or not _MIN_FILE_VERSION <= int(text) <= _MAX_FILE_VERSION:
            raise CorruptMetadataError(
                f"torch.save file format version {text[:20]!r} is not one torch reads "
                f"({_MIN_FILE_VERSION} to {_MAX_FILE_VERSION})",
                self.where,
            )
        for record in _SMALL_RECORDS:
            if self._info(record) is not None:
                raw = self._member_bytes(record, limit=_MAX_RECORD_BYTES)
                if record == ".storage_alignment":
                    try:
                        int(raw)  # what torch.load does with it
                    except ValueError:
                        raise CorruptMetadataError(f"storage alignment record {raw[:20]!r} is not a number",
                                                   self.where) from None

    # -- members ---------------------------------------------------------
    def _find_prefix(self, infos: list[_Member]) -> str:
        """The archive stem ('archive/'): torch takes the first member's directory, and every member must be in it."""
        first = infos[0].filename
        if "/" not in first:
            raise self._damaged(f"member {first!r} is not in the archive's directory")
        prefix = first[: first.index("/") + 1]
        stray = [i.filename for i in infos if not i.filename.startswith(prefix)]
        if stray:
            raise self._damaged(f"member {stray[0]!r} is outside the archive's directory {prefix}")
        if prefix + "data.pkl" not in self._members:
            raise CorruptMetadataError(f"expected one data.pkl in the torch.save archive, found none", self.where)
        return prefix

    def _info(self, suffix: str) -> _Member | None:
        return self._members.get(self.prefix + suffix)

    def _member_position(self, info: _Member) -> tuple[int, int]:
        """(data start, size) of a STORED member, from its local header."""
        if info.flag_bits & 0x1:
            raise CorruptMetadataError(f"member {info.filename} is encrypted", self.where)
        if info.compress_type != 0:
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

    def pickle_bytes(self) -> bytes:
        """The archive's data.pkl (CRC-checked): for writers that re-save what they loaded."""
        return self._member_bytes("data.pkl")

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
        order = self._member_bytes("byteorder", limit=16).decode("ascii", "replace")
        if order not in ("little", "big"):  # (torch compares the bytes exactly)
            raise CorruptMetadataError(f"unknown byteorder record {order!r}", self.where)
        return order

    # -- tensors ---------------------------------------------------------
    def claim_problem(self, ref: TensorRef) -> str | None:
        """What is wrong with a tensor's claim on its storage member, judged from the
        central directory alone (no read): a missing member, a size other than the
        storage's, a view reaching past its end. None when the claim holds."""
        if ref.load_problem is not None:
            return ref.load_problem
        problem = view_geometry_problem(ref)
        if problem is not None:
            return problem
        storage: StorageRef = ref.storage
        info = self._info(f"data/{storage.key}")
        if info is None:
            return f"storage {storage.key!r} is missing from the archive"
        size = info.file_size
        if size != storage.nbytes:
            return f"storage {storage.key!r} declares {storage.nbytes} bytes but the archive holds {size}"
        itemsize = dtypes.get(ref.dtype).itemsize
        numel = math.prod(ref.size)
        if numel * itemsize > MAX_TENSOR_BYTES:
            return f"tensor of shape {list(ref.size)} is implausibly large"
        if numel:
            last = ref.storage_offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))
            if (last + 1) * itemsize > size:
                return (f"{ref.dtype}{list(ref.size)} with stride {list(ref.stride)} at offset {ref.storage_offset} "
                        f"needs {(last + 1) * itemsize} bytes but its storage has {size}")
        if info.compress_type != 0:
            # (what _member_position says when the member is read; torch's reader fails on a
            # method miniz does not know, so the claim is judged here, from the directory alone)
            return (f"member {info.filename} is compressed (method {info.compress_type}); torch.save stores "
                    "members uncompressed")
        return None

    def storage_members(self) -> dict[str, tuple[int, int]]:
        """Every storage member: key -> (size in bytes, recorded CRC-32), from the central directory."""
        prefix = self.prefix + "data/"
        return {name[len(prefix):]: (m.file_size, m.CRC) for name, m in self._members.items()
                if name.startswith(prefix) and "/" not in name[len(prefix):]}

    def member_payload(self, key: str) -> TensorPayload:
        """Storage member `key` as a flat uint8 payload (for its CRC-32), located by its local header."""
        info = self._info(f"data/{key}")
        if info is None:
            raise CorruptMetadataError(f"storage {key!r} is missing from the archive", self.where)
        data_start, size = self._member_position(info)
        return TensorPayload("uint8", (size,), (1,), 0, data_start, size, info.CRC, False)

    def locate(self, ref: TensorRef) -> TensorPayload:
        """Validate a TensorRef against its storage member and say where its bytes are."""
        problem = self.claim_problem(ref)
        if problem is not None:
            raise CorruptMetadataError(problem, self.where)
        info = self._info(f"data/{ref.storage.key}")
        assert info is not None  # (claim_problem found it)
        data_start, size = self._member_position(info)
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


_INT64_LIMIT = 1 << 63


def view_geometry_problem(ref: TensorRef) -> str | None:
    """What torch's `Tensor.set_(storage, offset, size, stride)` refuses whatever the storage holds.

    Its sizes, strides and offset are int64: 2**63 or more fails to unpack ("Overflow when
    unpacking long long"); and it counts elements as a uint64 product of the sizes that fails
    on any overflow along the way, even when a later size is 0 ("numel: integer
    multiplication overflow"). The byte-size checks never see either on an empty or
    one-element view (it touches no or one element).
    """
    for what, values in (("storage offset", (ref.storage_offset,)), ("size", ref.size), ("stride", ref.stride)):
        for value in values:
            if value >= _INT64_LIMIT:
                return (f"{ref.dtype}{list(ref.size)} has a {what} of {value}, at least 2**63: torch.load fails "
                        "(its sizes are 64-bit)")
    product = 1
    for n in ref.size:
        product *= n
        if product >= 1 << 64:
            break
    if product >= _INT64_LIMIT:
        return (f"{ref.dtype}{list(ref.size)}: the product of its sizes overflows 64 bits: torch.load fails "
                "(it counts elements in 64 bits, and an overflow counts even before a size of 0)")
    return None


def open_payload(data: bytes, where: str, allow: Allow = None) -> PayloadArchive:
    """A whole torch.save archive held in memory."""
    return PayloadArchive(data, where, allow)


def open_payload_range(fetch: Fetch, length: int, where: str, allow: Allow = None) -> PayloadArchive:
    """A torch.save archive of `length` bytes read on demand through `fetch(start, end)`."""
    if length <= 0:
        raise CorruptMetadataError(f"empty storage entry (length {length})", where)
    return PayloadArchive((fetch, length), where, allow)


def load_value(data: bytes, where: str, allow: Allow = None) -> Any:
    """Decode a DCP bytes item (torch.save of a Python object) to its value."""
    return open_payload(data, where, allow).value()


def read_region(
    payload: TensorPayload,
    region: Region | None,
    fetch: RegionFetch,
    where: str,
    fetch_into: FetchInto | None = None,
    on_span: Callable[[int, int, int], None] | None = None,
) -> np.ndarray:
    """Read `region` (slices local to the tensor) of a located tensor into numpy.

    Only the byte span from the region's first to its last element is fetched;
    strides (non-contiguous tensors) and the storage offset are applied here.
    Given `fetch_into`, a region whose bytes lie contiguous and in C order
    (the usual case: a whole chunk) is read straight into the result. A read
    of the whole storage member is checked against its CRC-32 here; of a part
    of it, `on_span(start, end, crc)` is told the CRC-32 of the bytes read, so
    the caller can check the member once its parts tile it (a chunk read in
    bands is then never read a second time only for its checksum).
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
        if payload.data_crc and on_span is not None and not whole_storage:
            on_span(start, end, crc32(flat))  # before the view bits change the buffer
        return _apply_view_bits(_to_native(out) if payload.big_endian else out, payload)
    raw = fetch(start, end)
    if len(raw) != end - start:
        raise CorruptMetadataError(f"short read: wanted {end - start} bytes, got {len(raw)}", where)
    # the CRC can be checked whenever the whole storage was read anyway
    if payload.data_crc and whole_storage:
        if crc32(raw) != payload.data_crc:
            raise CorruptMetadataError("tensor data fails its CRC-32 check", where)
    elif payload.data_crc and on_span is not None:
        on_span(start, end, crc32(raw))
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
