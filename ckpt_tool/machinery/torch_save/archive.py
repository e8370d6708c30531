"""torch.save archives written without torch: byte for byte what `torch.save` writes.

torch.save (torch 2.13) writes a zip through caffe2's PyTorchStreamWriter (miniz): the records
`<archive>/data.pkl` (the pickle, protocol 2), `.format_version`, `.storage_alignment`,
`byteorder`, then each storage as `<archive>/data/<key>` (keys "0", "1", ... in the order the
pickler met the storages), `version` and `.data/serialization_id`, every record STORED, its data
64-byte aligned by a padding extra field, sizes and CRC-32 in a data descriptor behind the data,
zip64 end records always. `<archive>` is "archive" when saving to a stream (DCP's items) and the
file's stem when saving to a path (`torch.save(obj, "fp32.pt")` names its records `fp32/...`).

Two ways to build one:

  * `archive_parts(pickle, storages, archive=...)`: the whole archive as a list of buffers, the
    storages' bytes among them (DCP's chunks: each archive is built in memory);
  * `StreamedArchive`: the layout of an archive whose storages are written later, piece by piece
    at their offsets (a multi-GB tensor streamed band by band), the records around them written
    once the storages' CRC-32s are known. Offsets do not depend on the CRCs, so the layout is
    computed up front from the sizes alone.

`tensor_reduce` is what torch's pickler writes for a tensor (`_rebuild_tensor_v2` over a
persistent-id storage); the pickle itself is emitted by pickle_writer.
"""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Any, Union

from ...base import dtypes
from ...base.checksum import crc32
from .pickle_writer import Global, PersistentId, Reduce, dumps

Buffer = Union[bytes, memoryview]


@dataclass(frozen=True)
class Hole:
    """The place of a record's data that is written later (StreamedArchive): its size only."""

    size: int


STREAM_ARCHIVE = "archive"  # torch.save to a stream names its archive "archive"
_ALIGNMENT = 64  # torch's kFieldAlignment: record data starts 64-byte aligned
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_FORMAT_VERSION = b"1"  # torch.serialization: .format_version
_STORAGE_ALIGNMENT = b"64"
_BYTEORDER = b"little"
_FILE_FORMAT_VERSION = b"3\n"  # caffe2 kProducedFileFormatVersion, written as "version"
_FLAG_DESCRIPTOR = 0x0008  # sizes and CRC follow the data (miniz always sets it for data)
_FLAG_UTF8 = 0x0800
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")


def _padding(cursor: int, name_len: int, size: int) -> int:
    """Bytes of 'Z' padding torch puts in its 'FB' extra field (caffe2 getPadding)."""
    start = cursor + _LOCAL.size + name_len + 4
    if size >= _U32 or cursor >= _U32:
        start += 4  # the zip64 extra field's header
        if size >= _U32:
            start += 16
        if cursor >= _U32:
            start += 8
    return -start % _ALIGNMENT


def _zip64_extra(fields: list[int]) -> bytes:
    return struct.pack(f"<HH{len(fields)}Q", 0x0001, 8 * len(fields), *fields) if fields else b""


def _hash_bytes(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s std::hash<std::string> on 64-bit (MurmurHash64A variant)."""
    mul = 0xC6A4A7935BD1E995
    n = len(data)
    aligned = n & ~7
    h = (seed ^ (n * mul)) & _U64
    for i in range(0, aligned, 8):
        v = (int.from_bytes(data[i : i + 8], "little") * mul) & _U64
        h ^= ((v ^ (v >> 47)) * mul) & _U64
        h = (h * mul) & _U64
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * mul) & _U64
    h = ((h ^ (h >> 47)) * mul) & _U64
    return h ^ (h >> 47)


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


def _next_bucket_count(n: int) -> int:
    """libstdc++'s _Prime_rehash_policy::_M_next_bkt (max load factor 1): the smallest listed prime >= n."""
    fast = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)
    if n < len(fast):
        return fast[n]
    for p in _GCC_PRIMES:
        if p >= n:
            return p
    # beyond the list's start copied here (a value of a million tensors): the next prime
    p = n
    while any(p % d == 0 for d in range(2, int(p**0.5) + 1)):
        p += 1
    return p


# the start of libstdc++'s __prime_list (src/shared/hashtable-aux.cc) from 17,
# where _M_next_bkt's lower_bound begins
_GCC_PRIMES = (
    17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103, 109, 113, 127, 137,
    139, 149, 157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313, 337, 359, 383, 409, 439, 467,
    503, 541, 577, 619, 661, 709, 761, 823, 887, 953, 1031, 1109, 1193, 1289, 1381, 1493, 1613, 1741,
    1879, 2029, 2179, 2357, 2549, 2753, 2971, 3209, 3469, 3739, 4027, 4349, 4703, 5087, 5503, 5953,
    6427, 6949, 7517, 8123, 8783, 9497, 10273, 11113, 12011, 12983, 14033, 15173, 16411, 17749, 19183,
    20753, 22447, 24281, 26267, 28411, 30727, 33223, 35933, 38873, 42043, 45481, 49201, 53201, 57557,
    62233, 67307, 72817, 78779, 85229, 92203, 99733, 107897, 116731, 126271, 136607, 147793, 159871,
    172933, 187091, 202409, 218971, 236897, 256279, 277261, 299951, 324503, 351061, 379787, 410857,
    444487, 480881, 520241, 562841, 608903, 658753, 712697, 771049, 834181, 902483, 976369, 1056323,
)


def _unordered_set_order(hashes: list[int]) -> list[int]:
    """The iteration order of a libstdc++ std::unordered_set<std::string> after inserting
    strings with these hashes in this order (torch's files_written_).

    The set is one linked list in which each bucket's nodes are contiguous: a
    node goes to the front of the list when its bucket is empty, else to the
    front of its bucket's run; a rehash relinks the nodes, in list order, the
    same way. So the list is the buckets in order of first use, newest first,
    each bucket's nodes newest first. The first insertion allocates 13
    buckets (11 asked for, then the next listed prime); the count grows to the
    next listed prime >= twice it when the elements would outnumber it.
    """
    runs: dict[int, list[int]] = {}  # bucket -> its nodes, oldest first (read reversed)
    firsts: list[int] = []  # buckets in order of first use, oldest first (read reversed)
    buckets = 1
    next_resize = 0

    def insert(h: int) -> None:
        b = h % buckets
        run = runs.get(b)
        if run is None:
            runs[b] = [h]
            firsts.append(b)
        else:
            run.append(h)

    def order() -> list[int]:
        return [h for b in reversed(firsts) for h in reversed(runs[b])]

    for i, h in enumerate(hashes):
        if i + 1 > next_resize:
            min_buckets = max(i + 1, 0 if next_resize else 11)
            if min_buckets >= buckets:
                nodes = order()
                buckets = _next_bucket_count(max(min_buckets + 1, buckets * 2))
                runs.clear()
                firsts.clear()
                for node in nodes:
                    insert(node)
            next_resize = buckets
        insert(h)
    return order()


class _ZipBuilder:
    """One torch.save archive laid out exactly as caffe2's PyTorchStreamWriter (miniz) does."""

    def __init__(self, archive: str = STREAM_ARCHIVE) -> None:
        self.prefix = archive + "/"
        self.parts: list[Buffer | Hole] = []
        self.pos = 0
        self.central: list[bytes] = []
        self.names: list[str] = []
        self.combined_crc = 0

    def add(self, name: str, data: Buffer | Hole, crc: int | None = None) -> None:
        """One record; `data` a Hole when its bytes are written later (then `crc` is given)."""
        size = data.size if isinstance(data, Hole) else len(data) if isinstance(data, bytes) else data.nbytes
        if crc is None:
            assert not isinstance(data, Hole), "a record written later needs its CRC-32 given"
            crc = _small_crc(data) if type(data) is bytes and size <= 4096 else crc32(data)
        full = (self.prefix + name).encode("utf-8")
        ofs = self.pos
        zip64 = size >= _U32 or ofs >= _U32
        # zip64 extra fields: (uncompressed, compressed) sizes when the record is
        # 4 GiB or more, the header offset when it lies beyond 4 GiB; the local
        # copy is written before the data, when miniz's compressed size is still 0
        local_extra = _zip64_extra(([size, 0] if size >= _U32 else []) + ([ofs] if ofs >= _U32 else []))
        central_extra = _zip64_extra(([size, size] if size >= _U32 else []) + ([ofs] if ofs >= _U32 else []))
        pad = _padding(ofs, len(full), size)
        fb_extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        # miniz sets the data-descriptor flag only when there is data to describe
        flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if size else 0)
        # the local header carries no sizes or CRC: they follow in the data descriptor
        header = _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(local_extra) + len(fb_extra))
        self._emit(header + full + local_extra + fb_extra)
        if size:
            self._emit(data, size)
            if zip64:
                self._emit(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
            else:
                self._emit(struct.pack("<IIII", 0x08074B50, crc, size, size))
            # PyTorchStreamWriter folds in the CRC of every data descriptor it writes
            self.combined_crc = _hash_combine(self.combined_crc, crc)
        self.central.append(
            _CENTRAL.pack(
                0x02014B50, 0, 0, flags, 0, 0, 0, crc if size else 0, min(size, _U32), min(size, _U32),
                len(full), len(central_extra), 0, 0, 0, 0, min(ofs, _U32),
            )
            + full
            + central_extra
        )
        self.names.append(name)

    def _emit(self, part: Buffer | Hole, size: int | None = None) -> None:
        self.parts.append(part)
        self.pos += len(part) if size is None else size  # type: ignore[arg-type]

    def finish(self) -> tuple[list[Any], int]:
        # PyTorchStreamWriter::writeSerializationId: a hash of the record names,
        # in its unordered_set's iteration order (see _unordered_set_order; the
        # tests compare whole archives with torch.save's), then the hash of the
        # data-descriptor CRCs
        name_hash = _names_hash(tuple(self.names))
        self.add(".data/serialization_id", f"{name_hash:020d}{self.combined_crc:020d}".encode("ascii"))
        cd_ofs = self.pos
        central = b"".join(self.central)
        n = len(self.central)
        eocd64_ofs = cd_ofs + len(central)
        # miniz is opened with MZ_ZIP_FLAG_WRITE_ZIP64, so the zip64 end records are always written
        tail = (
            central
            + _ZIP64_EOCD.pack(0x06064B50, _ZIP64_EOCD.size - 12, 0x031E, 0x002D, 0, 0, n, n, len(central), cd_ofs)
            + _ZIP64_LOCATOR.pack(0x07064B50, 0, eocd64_ofs, 1)
            + _EOCD.pack(
                0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(len(central), _U32), min(cd_ofs, _U32), 0
            )
        )
        self._emit(tail)
        return self.parts, self.pos


# every archive of a checkpoint repeats the same few small records (data.pkl of one
# dtype and shape, the version records) and the same record names: computed once
@functools.lru_cache(maxsize=512)  # at most 2 MiB of records kept
def _small_crc(data: bytes) -> int:
    return crc32(data)


@functools.lru_cache(maxsize=256)
def _names_hash(names: tuple[str, ...]) -> int:
    """The record-name half of writeSerializationId (see _ZipBuilder.finish)."""
    name_hash = 0
    for h in _unordered_set_order([_hash_bytes(name.encode("utf-8")) for name in names]):
        name_hash = _hash_combine(name_hash, h)
    return name_hash


def archive_parts(pickle_bytes: bytes, storage: tuple[Any, int] | list[tuple[Any, int]] | None,
                  archive: str = STREAM_ARCHIVE) -> tuple[list[Any], int]:
    """A torch.save archive: data.pkl plus its storages (keys "0", "1", ... in that order), each
    (bytes or a Hole, CRC-32); (parts, length). Holes stay Holes among the parts."""
    storages = [] if storage is None else [storage] if isinstance(storage, tuple) else storage
    z = _ZipBuilder(archive)
    z.add("data.pkl", pickle_bytes)
    z.add(".format_version", _FORMAT_VERSION)
    z.add(".storage_alignment", _STORAGE_ALIGNMENT)
    z.add("byteorder", _BYTEORDER)
    for key, (data, crc) in enumerate(storages):
        z.add(f"data/{key}", data, crc)
    z.add("version", _FILE_FORMAT_VERSION)
    return z.finish()


_REBUILD_V2 = Global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_V3 = Global("torch._utils", "_rebuild_tensor_v3")
_UNTYPED_STORAGE = Global("torch.storage", "UntypedStorage")
_ORDERED_DICT = Global("collections", "OrderedDict")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's strides for a contiguous tensor (size-0 and size-1 dims count as 1)."""
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def tensor_reduce(dtype: dtypes.DType, shape: tuple[int, ...], key: str, *, stride: tuple[int, ...] | None = None,
                  storage_offset: int = 0, storage_numel: int | None = None, requires_grad: bool = False,
                  storage_id: Any = None) -> Reduce:
    """What torch's pickler saves for a CPU tensor whose storage is `key` (contiguous unless
    `stride` says otherwise; its storage as long as the tensor unless `storage_numel` says).

    `storage_id`: the persistent-id tuple to use (torch makes a new tuple for every tensor,
    but pickles the same "storage", location and key strings: pass a tuple built by
    `storage_pid` for each tensor, with the key string shared by the tensors of one storage).
    """
    numel = math.prod(shape) if storage_numel is None else storage_numel
    hooks = Reduce(_ORDERED_DICT, ())
    stride = _contiguous_strides(shape) if stride is None else tuple(stride)
    if dtype.torch_storage is not None:
        # typed legacy storage: numel counts elements, the dtype is the storage's
        pid = PersistentId(storage_id if storage_id is not None else storage_pid(dtype, key, numel))
        args: tuple[Any, ...] = (pid, storage_offset, shape, stride, requires_grad, hooks)
        return Reduce(_REBUILD_V2, args)
    # dtypes without a legacy storage class: untyped storage (numel counts bytes) plus the dtype
    assert dtype.torch is not None
    pid = PersistentId(storage_id if storage_id is not None else storage_pid(dtype, key, numel))
    args = (pid, storage_offset, shape, stride, requires_grad, hooks, Global("torch", dtype.torch))
    return Reduce(_REBUILD_V3, args)


_STORAGE = "storage"  # torch's persistent id strings: one object each, as torch's literals are
_CPU = "cpu"


def storage_pid(dtype: dtypes.DType, key: str, numel: int) -> tuple[Any, ...]:
    """A storage's persistent id as torch.save makes it: ('storage', class, key, 'cpu', size)."""
    if dtype.torch_storage is not None:
        return (_STORAGE, Global("torch", dtype.torch_storage), key, _CPU, numel)
    return (_STORAGE, _UNTYPED_STORAGE, key, _CPU, numel * dtype.itemsize)


def _tensor_reduce(dtype: dtypes.DType, shape: tuple[int, ...], key: str) -> Reduce:
    return tensor_reduce(dtype, shape, key)


@functools.lru_cache(maxsize=4096)  # chunks of one array share their shape
def tensor_pickle(dtype: dtypes.DType, shape: tuple[int, ...]) -> bytes:
    """torch.save's data.pkl for a contiguous tensor in storage "0"."""
    return dumps(_tensor_reduce(dtype, shape, "0"), 2)


_archive = archive_parts  # (the DCP writer's name for it)


class StreamedArchive:
    """A torch.save archive whose storages are written after its layout is fixed.

    `offsets[i]` is where storage i's bytes go in the file and `length` the file's size, from the
    pickle and the storages' sizes alone; once every storage is written and its CRC-32 known,
    `records(crcs)` gives the rest of the file as (offset, bytes) pieces.
    """

    def __init__(self, pickle_bytes: bytes, sizes: list[int], archive: str) -> None:
        self._pickle = pickle_bytes
        self._sizes = list(sizes)
        self._archive = archive
        parts, self.length = archive_parts(pickle_bytes, [(Hole(n), 0) for n in sizes], archive)
        self.offsets: list[int] = []
        at = 0
        for part in parts:
            if isinstance(part, Hole):
                self.offsets.append(at)
                at += part.size
            else:
                at += len(part)
        # a storage of 0 bytes has no data (and no Hole): its place is its record's end
        if len(self.offsets) != sum(1 for n in sizes if n):
            raise AssertionError("archive layout: holes and storages disagree")
        full = iter(self.offsets)
        self.offsets = [next(full) if n else 0 for n in sizes]

    def records(self, crcs: list[int]) -> list[tuple[int, bytes]]:
        """Everything but the storages' bytes, as (offset, bytes) runs, given each storage's CRC-32."""
        parts, length = archive_parts(self._pickle, [(Hole(n), c) for n, c in zip(self._sizes, crcs)],
                                      self._archive)
        assert length == self.length
        out: list[tuple[int, bytes]] = []
        at = 0
        run: list[bytes] = []
        run_at = 0
        for part in parts:
            if isinstance(part, Hole):
                if run:
                    out.append((run_at, b"".join(run)))
                    run = []
                at += part.size
                continue
            if not run:
                run_at = at
            run.append(bytes(part))
            at += len(part)
        if run:
            out.append((run_at, b"".join(run)))
        return out
