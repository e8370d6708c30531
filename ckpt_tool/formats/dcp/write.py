"""torch.distributed.checkpoint (DCP) writer, without torch.

Writes what torch 2.13's FileSystemWriter writes, so that
`torch.distributed.checkpoint.load`, `dcp_to_torch_save` and ckpt's own
reader all read the output:

  * data files `__{rank}_{n}.distcp`: each tensor chunk (and each non-tensor
    value) is one complete torch.save zip archive stored back to back; the
    archives are byte-for-byte what `torch.save` gives for a contiguous
    tensor (records, 64-byte alignment padding, data descriptors, zip64 end
    records and serialization id included);
  * `.metadata`, written last by the primary process: a protocol-4 pickle of
    `Metadata` with the same classes and pickle form torch writes, emitted
    opcode by opcode (pickle_writer) since those classes cannot be imported.

A data file is written as one kvstore value once it holds `file_mb` of
archives (a bigger archive gets a file of its own), so at most one open file
plus the files being flushed by the writing threads are in memory.

Like torch, the writer stores a list holding only plain values as one item
named after the list (torch's loaders look for it there), even when the plan
gives its elements separately, as Orbax sources do. A non-tensor value may
hold numpy arrays (a tuple of tensors, which torch's traversal keeps as one
bytes item): they are stored as the tensors of that item's torch.save
archive, storages "0", "1", ... in pickling order, as torch.save does.

In a multi-process run, every process but the primary leaves its storage
entries in a `.ckpt-entries.{rank}` JSON sidecar when it finishes; commit()
on the primary reads them, deletes them and writes `.metadata`.
"""
from __future__ import annotations

import functools
import json
import math
import struct
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

import numpy as np

from ...base import dtypes
from ...core import values
from ...base.checksum import crc32
from ...base.errors import CkptError, CorruptMetadataError, IncompleteCheckpointError, NotFoundError, UnsupportedLeafError, a_type
from ...core.model import Chunk, ChunkList, Key, Region, RegularGrid, grid_chunks, split_to_cap
from ...storage import FileCloser, LocalFileWriter, Storage, place_range
from ...core.contract import CheckpointWriter
from ...core.write_plan import PlanContext, TargetArray, TargetValue, WritePlan
from ...machinery.torch_save.archive import _CENTRAL, _U32, _archive, _hash_combine, _names_hash, _tensor_reduce, tensor_pickle
from ...machinery.torch_save.pickle_writer import Global, Obj, PickleWriteError, Reduce, dumps

METADATA_FILE = ".metadata"
SIDECAR_PREFIX = ".ckpt-entries."
DEFAULT_FILE_MB = 32  # files buffered at once: the one filling plus those being flushed
# on an object store a data file is assembled in memory and uploaded whole once sealed, while the
# copy threads (storage.remote.in_flight of them) fill the next ones: 32 MiB files held 1.1 GiB at
# once in a 1 GiB convert to gs://, smaller ones bound that (and a tensor larger than that still
# goes as one object of its own)
REMOTE_FILE_MB = 8
# sealed files being uploaded or waiting for it, beyond those the copy threads fill: uploaded by
# the copy thread that sealed it, an 8 GiB convert to gs:// kept about 4.5 uploads busy of its 8
# threads (50 s against 28.6 s for a plain parallel upload of the same objects); behind them, 6
# at once took it to 30.5 s, its peak RSS from 331 to 364 MiB (8 at once: 33 s, 402 MiB)
REMOTE_UPLOADS = 6
# archives under COALESCE_BELOW bytes are gathered and written COALESCE_BYTES at a time
# (13,500 archives of 1 to 16 KiB each: one pwritev per archive cost more than the copy);
# below directio.MIN_DIRECT_BYTES, so they are placed back to back, unaligned
COALESCE_BELOW = 64 * 1024
COALESCE_BYTES = 1 << 20
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.metadata version torch 2.13 writes

Buffer = Union[bytes, bytearray, memoryview]


class DcpWriteError(CkptError):
    """The plan or the data given to the DCP writer cannot be written."""


# ---------------------------------------------------------------------------
# torch.save archives
# ---------------------------------------------------------------------------
# the records, the zip layout, the serialization id and a tensor's pickle: torch.save's, shared
# with the other torch.save writers (ckpt_tool/machinery/torch_save/archive.py)


def plain_value(value: Any, where: str, storages: list[tuple[memoryview, int]] | None = None) -> Any:
    """`value` with numpy scalars made Python scalars; an error for anything not plain.

    With `storages`, numpy arrays become tensors (torch.save of a tuple of
    tensors, which DCP stores as one bytes item): each array's bytes are
    appended to `storages`, in the order torch's pickler meets the tensors.
    """
    # each object once (values.nodes, values.transform): shared lists stay shared in the
    # pickle, an array at two places is one tensor at both (as torch.save keeps them)
    for node in values.nodes(value):
        if values.is_container(node) and type(node) not in (list, tuple, dict):
            _plain_atom(node, where, storages)  # a set, a subclass: refused by name
    return values.transform(value, lambda v: _plain_atom(v, where, storages), where)


def _plain_atom(value: Any, where: str, storages: list[tuple[memoryview, int]] | None) -> Any:
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, np.generic) and not isinstance(value, np.void):
        return _plain_atom(value.item(), where, None)  # numpy scalars load without numpy
    if isinstance(value, np.ndarray) and storages is not None:
        return _tensor_value(value, where, storages)
    raise DcpWriteError(
        f"{a_type(value)} value cannot be stored (only None, bool, int, float, str, bytes, list, tuple, dict"
        + (", numpy arrays)" if storages is not None else ")"),
        where,
    )


def _tensor_value(arr: np.ndarray, where: str, storages: list[tuple[memoryview, int]]) -> Reduce:
    try:
        dt = dtypes.from_numpy(arr.dtype)
    except CkptError:
        dt = None
    if dt is None or dt.torch is None:
        raise DcpWriteError(f"a {arr.dtype} array has no torch dtype", where)
    # torch saves little-endian, C-contiguous storage bytes
    # (np.require, not ascontiguousarray: that one makes a 0-d array 1-d)
    arr = np.require(arr.astype(arr.dtype.newbyteorder("<"), copy=False), requirements="C")
    raw = arr.reshape(-1).view(np.uint8).data
    storages.append((raw, crc32(raw)))
    return _tensor_reduce(dt, tuple(int(n) for n in arr.shape), str(len(storages) - 1))


def value_archive(value: Any, where: str) -> tuple[list[Buffer], int]:
    """torch.save of a plain Python value (tensors inside it as numpy arrays), as DCP stores non-tensor items."""
    storages: list[tuple[memoryview, int]] = []
    try:
        pkl = dumps(plain_value(value, where, storages), 2)
    except RecursionError:
        raise DcpWriteError("value nested too deeply to store", where) from None
    except PickleWriteError as exc:
        raise DcpWriteError(exc.message, where) from None
    return _archive(pkl, storages)


def tensor_archive(dtype: dtypes.DType, data: np.ndarray) -> tuple[list[Buffer], int]:
    """torch.save of a tensor holding `data` (C-contiguous, little-endian, of `dtype`)."""
    raw = data.reshape(-1).view(np.uint8).data
    crc = crc32(raw)
    if not raw.nbytes or raw.nbytes >= _U32:  # no data descriptor, or zip64 records: built in full
        return _archive(tensor_pickle(dtype, tuple(data.shape)), (raw, crc))
    return _archive_template(dtype, tuple(data.shape)).fill(raw, crc)


@dataclass
class _ArchiveTemplate:
    """The archive of one dtype and shape with the data's CRC left open.

    Every chunk of an array (13,500 chunks of 3,000 leaves) has the same
    archive but for its data, the data's CRC (in its data descriptor and
    central record) and the serialization id (which folds that CRC in) with
    its own CRC: built once by _ZipBuilder, then filled in per chunk.
    """

    head: bytes  # the records before the data, and the data's local header
    size: int
    between: bytes  # after the data descriptor: the version record, the id's local header
    central: bytes  # the central directory, the zip64 records and the end record
    data_crc_at: int  # where in `central` the data's and the id's CRC go
    id_crc_at: int
    crc_before: int  # the combined CRC up to the data's
    version_crc: int
    name_hash: int

    def fill(self, raw: memoryview, crc: int) -> tuple[list[Buffer], int]:
        combined = _hash_combine(_hash_combine(self.crc_before, crc), self.version_crc)
        ident = f"{self.name_hash:020d}{combined:020d}".encode("ascii")
        ident_crc = crc32(ident)
        central = bytearray(self.central)
        struct.pack_into("<I", central, self.data_crc_at, crc)
        struct.pack_into("<I", central, self.id_crc_at, ident_crc)
        parts: list[Buffer] = [
            self.head, raw, struct.pack("<IIII", 0x08074B50, crc, self.size, self.size), self.between,
            ident + struct.pack("<IIII", 0x08074B50, ident_crc, len(ident), len(ident)), central,
        ]
        return parts, len(self.head) + self.size + 16 + len(self.between) + len(ident) + 16 + len(central)


@functools.lru_cache(maxsize=1024)
def _archive_template(dtype: dtypes.DType, shape: tuple[int, ...]) -> _ArchiveTemplate:
    size = math.prod(shape) * dtype.itemsize
    parts, _ = _archive(tensor_pickle(dtype, shape), (np.broadcast_to(np.zeros(1, np.uint8), (size,)).data, 0))
    # the data is the one memoryview among the parts (see _ZipBuilder.add)
    idx = next(i for i, p in enumerate(parts) if isinstance(p, memoryview))
    joined = [b"" if i == idx else bytes(p) for i, p in enumerate(parts)]
    head = b"".join(joined[:idx])
    # after the data: its descriptor (16 bytes), the version record's header, data and
    # descriptor, the id's local header, the id, its descriptor, then the central directory
    after = joined[idx + 1:]
    assert len(after[0]) == 16  # the data's descriptor
    between = b"".join(after[1:5])  # version: header, data, descriptor; the id's header
    assert len(after[5]) == 40 and len(after[6]) == 16  # the id and its descriptor
    central = after[7]
    # central records in order: data.pkl, .format_version, .storage_alignment, byteorder, data/0, version, id
    at = 0
    offsets = []
    for _ in range(7):
        offsets.append(at)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", central, at + 28)
        at += _CENTRAL.size + name_len + extra_len + comment_len
    crcs = [struct.unpack_from("<I", central, o + 16)[0] for o in offsets]
    crc_before = 0
    for c in crcs[:4]:
        crc_before = _hash_combine(crc_before, c)
    return _ArchiveTemplate(
        head=head, size=size, between=between, central=central, data_crc_at=offsets[4] + 16,
        id_crc_at=offsets[6] + 16, crc_before=crc_before, version_crc=crcs[5],
        name_hash=_names_hash(("data.pkl", ".format_version", ".storage_alignment", "byteorder", "data/0", "version")),
    )


# ---------------------------------------------------------------------------
# .metadata
# ---------------------------------------------------------------------------
_MD = "torch.distributed.checkpoint.metadata"
_METADATA = Global(_MD, "Metadata")
_TENSOR_STORAGE_METADATA = Global(_MD, "TensorStorageMetadata")
_BYTES_STORAGE_METADATA = Global(_MD, "BytesStorageMetadata")
_CHUNK_STORAGE_METADATA = Global(_MD, "ChunkStorageMetadata")
_TENSOR_PROPERTIES = Global(_MD, "TensorProperties")
_METADATA_INDEX = Global(_MD, "MetadataIndex")
_STORAGE_META = Global(_MD, "StorageMeta")
_STORAGE_INFO = Global("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_TORCH_SIZE = Global("torch", "Size")
# singletons in torch (torch.strided, the enum member), so pickled once and then referenced
_LAYOUT_STRIDED = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
_CONTIGUOUS_FORMAT = Reduce(Global(_MD, "_MEM_FORMAT_ENCODING"), (0,))


def _size(dims: Iterable[int]) -> Reduce:
    # a fresh tuple of Python ints per torch.Size, as torch pickles them
    return Reduce(_TORCH_SIZE, (tuple(int(d) for d in dims),))


def _planner_keys(keys: Iterable[Any]) -> tuple[str | int, ...]:
    """planner_data's key path: str keys and int sequence indices (numpy ints made Python ints)."""
    return tuple(int(k) if isinstance(k, (int, np.integer)) and not isinstance(k, bool) else str(k) for k in keys)


@dataclass(frozen=True)
class _Entry:
    """Where one archive was stored."""

    relative_path: str
    offset: int
    length: int


def metadata_pickle(
    targets: list[tuple[TargetArray, tuple[Chunk, ...]] | TargetValue],
    entries: dict[tuple[str, int | None], _Entry],
    *,
    checkpoint_id: str | None,
    save_id: str,
) -> bytes:
    """The `.metadata` pickle torch 2.13 writes for these targets and storage entries."""
    sdm: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    paths: dict[str, str] = {}  # one str object per file, so the pickle refers back to it
    # one torch.Size per distinct value, referred back to as well: a checkpoint of 13,500
    # chunks repeats a few chunk shapes and offsets (torch pickles a fresh one each time;
    # torch.Size is immutable, so the unpickled objects are the same either way)
    sizes: dict[tuple[int, ...], Reduce] = {}

    def size(dims: tuple[int, ...]) -> Reduce:
        found = sizes.get(dims)
        if found is not None:
            return found
        key = tuple(int(d) for d in dims)
        found = sizes.get(key)
        if found is None:
            found = sizes[key] = _size(key)
        return found

    def info(entry: _Entry) -> Obj:
        path = paths.setdefault(entry.relative_path, entry.relative_path)
        # _StorageInfo.__getstate__ leaves out transform_descriptors when None
        return Obj(_STORAGE_INFO, {"relative_path": path, "offset": entry.offset, "length": entry.length})

    # state_dict_metadata and planner_data follow the state dict's order, as torch's do
    for item in targets:
        if isinstance(item, TargetValue):
            sdm[item.name] = Obj(_BYTES_STORAGE_METADATA)  # empty __dict__: no BUILD
            planner[item.name] = _planner_keys(item.keys)
            storage[Obj(_METADATA_INDEX, {"fqn": item.name, "index": None})] = info(entries[(item.name, None)])
            continue
        target, chunks = item
        dt = dtypes.get(target.dtype)
        # TensorProperties.__getstate__ gives (dtype, layout, requires_grad, memory format, pin_memory)
        props = Obj(
            _TENSOR_PROPERTIES, (Global("torch", dt.torch or ""), _LAYOUT_STRIDED, False, _CONTIGUOUS_FORMAT, False)
        )
        chunk_md = [
            Obj(_CHUNK_STORAGE_METADATA, {"offsets": size(c.offsets), "sizes": size(c.sizes)}) for c in chunks
        ]
        sdm[target.name] = Obj(
            _TENSOR_STORAGE_METADATA, {"properties": props, "size": size(target.shape), "chunks": chunk_md}
        )
        planner[target.name] = _planner_keys(target.keys)
        for i, c in enumerate(chunks):
            # MetadataIndex.__init__ sets fqn, index, then offset: that is its __dict__ order
            index = Obj(_METADATA_INDEX, {"fqn": target.name, "index": i, "offset": size(c.offsets)})
            storage[index] = info(entries[(target.name, i)])
    storage_meta = Obj(
        _STORAGE_META, {"checkpoint_id": checkpoint_id, "save_id": save_id, "load_id": None, "modules": []}
    )
    md = Obj(_METADATA, {
        "state_dict_metadata": sdm,
        "planner_data": planner,
        "storage_data": storage,
        "storage_meta": storage_meta,
        "version": DCP_VERSION,
    })
    return dumps(md, 4)


# ---------------------------------------------------------------------------
# The writer
# ---------------------------------------------------------------------------
@dataclass
class _ListGroup:
    """Values that are the elements of one list of plain values, stored as one item.

    DCP's state-dict traversal stops at a list that holds no tensor and no
    dict (torch saves such a list as one bytes item named after the list), so
    a checkpoint holding `cfg.layers.0`, `cfg.layers.1` ... as separate items
    cannot be loaded by torch: its loader looks for `cfg.layers`. Sources
    that keep list elements apart (Orbax) are therefore merged back here.
    """

    target: TargetValue  # the merged item: keys and name of the list
    members: dict[str, tuple[Any, ...]]  # member name -> its keys below the list
    received: dict[str, Any] = field(default_factory=dict)

    def build(self) -> list[Any]:
        root: dict[Any, Any] = {}
        for name, rel in self.members.items():
            node = root
            for k in rel[:-1]:
                node = node.setdefault(k, {})
            node[rel[-1]] = self.received[name]

        def as_list(node: Any) -> Any:
            if not isinstance(node, dict):
                return node
            return [as_list(node[i]) for i in range(len(node))]

        return as_list(root)


def _list_groups(targets: list[TargetArray | TargetValue]) -> list[_ListGroup]:
    """The lists of plain values DCP would save as single items (see _ListGroup)."""
    root: dict[str, Any] = {"children": {}, "leaf": None}
    for target in targets:
        node = root
        for k in target.keys:
            node = node["children"].setdefault(k, {"children": {}, "leaf": None})
        node["leaf"] = target

    def is_list(node: dict[str, Any]) -> bool:
        keys = list(node["children"])
        # only a complete list can be rebuilt faithfully: indices 0..n-1
        return (
            node["leaf"] is None and bool(keys)
            and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys)))
        )

    def terminal(node: dict[str, Any]) -> bool:
        """A list whose elements are values or (recursively) such lists: no tensor, no dict.

        As torch's traverse_state_dict: a dict element, even an empty one,
        makes the list a node to traverse; a tuple element (one value here)
        does not, whatever it holds.
        """
        if not is_list(node):
            return False
        for child in node["children"].values():
            if child["children"]:
                if not terminal(child):
                    return False
            elif not isinstance(child["leaf"], TargetValue) or isinstance(child["leaf"].value, dict):
                return False
        return True

    def members(node: dict[str, Any], rel: tuple[Any, ...]) -> Iterable[tuple[TargetValue, tuple[Any, ...]]]:
        for k, child in node["children"].items():
            if child["children"]:
                yield from members(child, rel + (k,))
            else:
                yield child["leaf"], rel + (k,)

    names = {t.name for t in targets}
    groups: list[_ListGroup] = []

    def visit(node: dict[str, Any], keys: tuple[Any, ...]) -> None:
        for k, child in node["children"].items():
            path = keys + (k,)
            if terminal(child):
                name = ".".join(str(x) for x in path)
                if name not in names:  # never shadow a target of the plan
                    merged = TargetValue(path, name, None, "object")
                    groups.append(_ListGroup(merged, {t.name: rel for t, rel in members(child, ())}))
                    continue
            visit(child, path)

    visit(root, ())
    return groups


@dataclass
class _OpenFile:
    """A data file being filled; either way, callers may reuse their arrays once write_array returns.

    Local files are written in place (`local`): each archive at the offset
    reserved for it, by the thread that made it, and the file is closed
    (fsynced) by whoever finishes its last write after it was sealed. Other
    storage gets the file as one value: archives are copied into `data`.

    A local file after the first is created outside the writer's lock, by the thread that
    opened it, while others already reserve their offsets in it: on a TPU VM's gVisor kernel a
    create took about 10 ms, and up to 9 of 13 copy threads waited for the lock meanwhile.
    `opened` is set once `local` is there (or `open_error` says why it is not).
    """

    name: str
    local: LocalFileWriter | None = None
    opened: threading.Event | None = None
    open_error: BaseException | None = None
    data: bytearray = field(default_factory=bytearray)
    size: int = 0  # bytes reserved so far
    writing: int = 0  # archives being written into `local` right now
    sealed: bool = False  # no more archives go into this file
    done: bool = False  # flushed or closed
    # small archives placed back to back, not yet written (local files): one write for many
    pending: bytearray = field(default_factory=bytearray)
    pending_at: int = 0

    @property
    def is_local(self) -> bool:
        return self.local is not None or self.opened is not None


# a write made outside the writer's lock: the file, the offset, the buffers, whether padded (direct)
_Write = tuple[_OpenFile, int, list[Buffer], bool]


class DcpWriter(CheckpointWriter):
    """Writes a torch.distributed.checkpoint directory through a Storage (see writers.CheckpointWriter)."""

    def __init__(
        self,
        storage: Storage,
        *,
        file_mb: float = DEFAULT_FILE_MB,
        checkpoint_id: str | None = None,
        merge_value_lists: bool = True,
    ) -> None:
        """file_mb: data file size before rolling over; checkpoint_id: recorded in
        StorageMeta (default: plan.info["destination"], else the storage URL);
        merge_value_lists: store lists of plain values as one item, as torch does
        (see _ListGroup; without it torch cannot load such a checkpoint)."""
        if not file_mb > 0:
            raise DcpWriteError(f"file_mb must be positive, got {file_mb}")
        self._storage = storage
        if storage.local_root is None:
            file_mb = min(file_mb, REMOTE_FILE_MB)
        self._file_bytes = max(1, int(file_mb * 2**20))
        self._checkpoint_id = checkpoint_id
        self._merge_value_lists = merge_value_lists
        self._lock = threading.Lock()
        self._plan: WritePlan | None = None
        self._arrays: dict[str, tuple[TargetArray, tuple[Chunk, ...]]] = {}
        self._values: dict[str, TargetValue] = {}  # the bytes items of the output
        self._members: dict[str, _ListGroup] = {}  # value name -> the list it is merged into
        # chunks no process is asked for: the single empty chunk of a zero-size
        # tensor whose layout has none; the primary writes them itself
        self._implicit: list[str] = []
        self._entries: dict[tuple[str, int | None], _Entry] = {}
        self._current: _OpenFile | None = None
        self._files: list[_OpenFile] = []  # every data file opened, to close them on abort
        # whether local data files write large archives with O_DIRECT: learned from the first one,
        # the others are placed by it before they exist (see _OpenFile); None until then
        self._direct: bool | None = None
        self._next_file = 0
        self._state = "new"  # new -> writing -> finished -> committed | aborted
        self._save_id = ""
        self._closer = FileCloser("ckpt-dcp-close")  # closes (fsyncs) sealed local files
        # uploads sealed object-store files behind the copy threads, REMOTE_UPLOADS at once and no
        # more waiting (each holds its file's bytes): REMOTE_UPLOADS says why
        self._uploader = FileCloser("ckpt-dcp-upload", REMOTE_UPLOADS, bound=REMOTE_UPLOADS)

    # -- protocol ----------------------------------------------------------------
    def begin(self, plan: WritePlan) -> None:
        if self._state != "new":
            raise DcpWriteError("begin() called twice")
        if not 0 <= plan.process_index < plan.process_count:
            raise DcpWriteError(f"process index {plan.process_index} is outside 0..{plan.process_count - 1}")
        seen: set[str] = set()
        for target in plan.targets:
            if not isinstance(target.name, str) or not target.name:
                raise DcpWriteError("every target needs a non-empty name (its DCP fqn)", target.path)
            if target.name in seen:
                raise DcpWriteError(f"two targets share the fqn {target.name!r}", target.path)
            seen.add(target.name)
            if isinstance(target, TargetArray):
                self._arrays[target.name] = (target, self._chunks_of(target))
            else:
                self._values[target.name] = target
        for group in _list_groups(plan.targets) if self._merge_value_lists else []:
            for name in group.members:
                del self._values[name]
                self._members[name] = group
            self._values[group.target.name] = group.target
        self._plan = plan
        self._save_id = str(uuid.uuid4())
        self._state = "writing"

    def write_array(self, target: TargetArray, chunk_index: int, region: Region, data: np.ndarray) -> None:
        self._check_state("writing")
        planned = self._arrays.get(target.name)
        if planned is None:
            raise DcpWriteError("write_array for a target that is not in the plan", target.name)
        _, chunks = planned
        if not 0 <= chunk_index < len(chunks):
            raise DcpWriteError(f"chunk index {chunk_index} is outside 0..{len(chunks) - 1}", target.name)
        chunk = chunks[chunk_index]
        got = tuple((r.start, r.stop) for r in region)
        want = tuple((o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        if got != want:
            raise DcpWriteError(f"region {list(got)} is not chunk {chunk_index}'s {list(want)}", target.name)
        dt = dtypes.get(target.dtype)
        arr = self._as_stored(data, dt, chunk.sizes, target.name)
        parts, length = tensor_archive(dt, arr)
        self._append((target.name, chunk_index), parts, length)

    def write_value(self, target: TargetValue) -> None:
        self._check_state("writing")
        group = self._members.get(target.name)
        if group is not None:
            plain_value(target.value, target.name, [])  # fail now, not when the list completes
            value = target.value  # arrays stay arrays: value_archive makes them tensors
            with self._lock:
                if target.name in group.received:
                    raise DcpWriteError(f"value {target.name!r} was written twice")
                group.received[target.name] = value
                complete = len(group.received) == len(group.members)
            if complete:
                merged = group.target
                self._append((merged.name, None), *value_archive(group.build(), merged.name))
            return
        if self._values.get(target.name) is None:
            raise DcpWriteError("write_value for a target that is not in the plan", target.name)
        parts, length = value_archive(target.value, target.name)
        self._append((target.name, None), parts, length)

    def finish_process(self) -> None:
        self._check_state("writing")
        plan = self._require_plan()
        for group in {id(g): g for g in self._members.values()}.values():
            if 0 < len(group.received) < len(group.members):
                raise DcpWriteError(
                    f"only {len(group.received)} of the {len(group.members)} elements of list "
                    f"{group.target.name!r} were written (one process must write them all)"
                )
        if plan.process_index == 0:
            for name in self._implicit:
                target, chunks = self._arrays[name]
                dt = dtypes.get(target.dtype)
                arr = np.empty(chunks[0].sizes, dtype=dtypes.numpy_dtype(target.dtype))
                self._append((name, 0), *tensor_archive(dt, arr))
        ready: list[_OpenFile] = []
        writes: list[_Write] = []
        with self._lock:
            if self._current is not None:
                self._seal(self._current, ready, writes)
        self._write_out(writes, ready)
        with self._lock:
            unfinished = [f.name for f in self._files if not f.done]
        if unfinished:
            raise DcpWriteError(f"data file {unfinished[0]} still has writes in progress")
        for f in ready:
            self._flush(f)
        self._closer.wait()
        self._uploader.wait()
        if plan.process_count > 1 and plan.process_index != 0:
            self._storage.write(f"{SIDECAR_PREFIX}{plan.process_index}", self._sidecar())
        self._state = "finished"

    def commit(self) -> None:
        self._check_state("finished")
        plan = self._require_plan()
        if plan.process_index != 0:
            raise DcpWriteError("commit() runs on the primary process (index 0) only")
        entries = dict(self._entries)
        sidecars = [f"{SIDECAR_PREFIX}{rank}" for rank in range(1, plan.process_count)]
        for rank, key in enumerate(sidecars, start=1):
            for entry_key, entry in self._read_sidecar(key, rank).items():
                if entry_key in entries:
                    raise CorruptMetadataError(f"{_describe(entry_key)} was written by two processes", self._where(key))
                entries[entry_key] = entry
        targets: list[tuple[TargetArray, tuple[Chunk, ...]] | TargetValue] = []
        for t in plan.targets:
            if isinstance(t, TargetArray):
                targets.append(self._arrays[t.name])
            else:
                group = self._members.get(t.name)
                item = group.target if group is not None else self._values[t.name]
                # a merged list takes the place of its first element
                if group is None or next(iter(group.members)) == t.name:
                    targets.append(item)
        missing: list[tuple[str, int | None]] = []
        for written in targets:
            if isinstance(written, TargetValue):
                keys: list[tuple[str, int | None]] = [(written.name, None)]
            else:
                keys = [(written[0].name, i) for i in range(len(written[1]))]
            missing.extend(k for k in keys if k not in entries)
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise IncompleteCheckpointError(f"nothing was written for {_describe(missing[0])}{more}", self._storage.url)
        checkpoint_id = self._checkpoint_id or plan.info.get("destination") or self._storage.url
        data = metadata_pickle(targets, entries, checkpoint_id=str(checkpoint_id), save_id=self._save_id)
        # the sidecars go first so that .metadata, the commit marker, is the last write
        for key in sidecars:
            self._delete(key)
        self._storage.write(METADATA_FILE, data)
        self._state = "committed"

    def abort(self) -> None:
        with self._lock:
            self._current = None
            self._entries.clear()
            files, self._files = self._files, []
        for pending in (self._closer, self._uploader):
            try:
                pending.wait()
            except Exception:  # noqa: BLE001 - the output is being thrown away: its close errors with it
                pass
        for f in files:
            if f.opened is not None:
                f.opened.wait()  # a create in progress on another thread: its descriptor closed here too
            if f.local is not None:
                f.done = True
                f.local.discard()  # a no-op for files already closed
        self._state = "aborted"

    # -- internals ---------------------------------------------------------------
    def _require_plan(self) -> WritePlan:
        if self._plan is None:
            raise DcpWriteError("begin() was not called")
        return self._plan

    def _check_state(self, want: str) -> None:
        if self._state != want:
            raise DcpWriteError(
                f"writer is {self._state}, expected {want} (call order: begin, write, finish_process, commit)"
            )

    def _chunks_of(self, target: TargetArray) -> tuple[Chunk, ...]:
        dt = dtypes.get(target.dtype)
        if dt.torch is None:
            raise DcpWriteError(f"dtype {target.dtype} has no torch equivalent", target.path)
        shape = tuple(target.shape)
        if any(not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0 for n in shape):
            raise DcpWriteError(f"invalid shape {list(shape)}", target.path)
        layout = target.layout
        if isinstance(layout, ChunkList):
            chunks = tuple(layout.chunks)
        elif isinstance(layout, RegularGrid):
            if len(layout.chunk_shape) != len(shape):
                raise DcpWriteError(
                    f"chunk shape {list(layout.chunk_shape)} does not match rank {len(shape)}", target.path
                )
            chunks = tuple(grid_chunks(shape, tuple(layout.chunk_shape)))
        else:
            raise DcpWriteError(f"unknown chunk layout {type(layout).__name__}", target.path)
        for c in chunks:
            where = f"chunk {list(c.offsets)}+{list(c.sizes)}"
            if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
                raise DcpWriteError(f"{where} does not match rank {len(shape)}", target.path)
            if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, shape)):
                raise DcpWriteError(f"{where} lies outside shape {list(shape)}", target.path)
        if not chunks:
            if math.prod(shape) != 0:
                raise DcpWriteError(f"no chunks for a tensor of shape {list(shape)}", target.path)
            # torch saves an empty tensor as one empty chunk; nobody will be asked for it
            chunks = (Chunk((0,) * len(shape), shape),)
            self._implicit.append(target.name)
        return chunks

    @staticmethod
    def _as_stored(data: np.ndarray, dt: dtypes.DType, sizes: tuple[int, ...], where: str) -> np.ndarray:
        """The chunk's data as a C-contiguous little-endian array of the target dtype."""
        if isinstance(data, np.generic):
            data = np.asarray(data)  # indexing a 0-d array with () gives a numpy scalar
        if not isinstance(data, np.ndarray):
            raise DcpWriteError(f"chunk data must be a numpy array, got {type(data).__name__}", where)
        if tuple(data.shape) != tuple(sizes):
            raise DcpWriteError(f"chunk data has shape {list(data.shape)}, expected {list(sizes)}", where)
        order = data.dtype.byteorder
        if data.dtype.itemsize > 1 and (order == ">" or (order == "=" and sys.byteorder == "big")):
            # DCP stores little-endian bytes: the same values, byte-swapped
            data = data.byteswap().view(data.dtype.newbyteorder("<"))
        want = dt.numpy
        if data.dtype != want:
            raise DcpWriteError(f"chunk data is {data.dtype}, expected {dt.name}", where)
        # (np.ascontiguousarray alone would turn a 0-d array into shape (1,))
        return np.ascontiguousarray(data).reshape(data.shape)

    def _append(self, key: tuple[str, int | None], parts: list[Buffer], length: int) -> None:
        """Place one archive in the current data file; flush files that are full."""
        ready: list[_OpenFile] = []
        writes: list[_Write] = []  # made outside the lock: other threads place their archives meanwhile
        opening: list[_OpenFile] = []  # a file this thread opened, to create outside the lock
        try:
            with self._lock:
                self._place(key, parts, length, ready, writes, opening)
        except BaseException as exc:
            for f in opening:  # never to be created: whoever placed an archive in it meanwhile gets the error
                f.open_error = exc
                if f.opened is not None:
                    f.opened.set()
            raise
        for f in opening:
            self._create(f)
        self._write_out(writes, ready)
        for f in ready:
            self._flush(f)

    def _place(self, key: tuple[str, int | None], parts: list[Buffer], length: int, ready: list[_OpenFile],
               writes: list[_Write], opening: list[_OpenFile]) -> None:
        """_append's work under the lock: reserve the archive's place, queue its writes (lock held)."""
        if self._state != "writing":
            raise DcpWriteError(f"writer is {self._state}")
        if key in self._entries:
            raise DcpWriteError(f"{_describe(key)} was written twice")
        cur = self._current
        if cur is not None and cur.size and cur.size + length > self._file_bytes:
            self._seal(cur, ready, writes)
            cur = None
        if cur is None:
            name = self._new_file_name()
            if self._direct is None:
                # the first (or not a local file): created here, and local files are placed as it is
                cur = _OpenFile(name, self._storage.create_local_file(name))
                if cur.local is not None:
                    self._direct = cur.local.direct
            else:
                cur = _OpenFile(name, opened=threading.Event())
                opening.append(cur)
            self._current = cur
            self._files.append(cur)
        if cur.is_local:
            offset, cur.size = place_range(bool(self._direct), cur.size, length)
        else:
            offset, cur.size = cur.size, cur.size + length
        self._entries[key] = _Entry(cur.name, offset, length)
        if cur.is_local:
            small = length < COALESCE_BELOW
            if cur.pending and (not small or cur.pending_at + len(cur.pending) != offset):
                self._queue(writes, cur, *self._take_pending(cur))
            if small:
                # copied: the caller may reuse its arrays once we return
                if not cur.pending:
                    cur.pending_at = offset
                for part in parts:
                    cur.pending += part
                if len(cur.pending) >= COALESCE_BYTES:
                    self._queue(writes, cur, *self._take_pending(cur))
            else:
                self._queue(writes, cur, offset, parts, True)
        elif not offset and length >= self._file_bytes:
            # an archive with a file of its own: allocated once at its exact
            # size (growing a bytearray would copy it and over-allocate 1/8)
            cur.data = bytearray(length)
            pos = 0
            with memoryview(cur.data) as view:
                for part in parts:
                    # (a filled template's central directory is a bytearray)
                    n = len(part) if isinstance(part, (bytes, bytearray)) else part.nbytes
                    view[pos : pos + n] = part
                    pos += n
        else:
            for part in parts:
                cur.data += part
        if cur.size >= self._file_bytes:
            self._seal(cur, ready, writes)

    def _create(self, f: _OpenFile) -> None:
        """Create the local file `f` that this thread opened; threads writing into it wait for it."""
        assert f.opened is not None
        try:
            # as the first file: a file placed without O_DIRECT's alignment must not write with it
            f.local = self._storage.create_local_file(f.name, direct=self._direct)
            if f.local is None:
                raise DcpWriteError("the storage gave no local file after the first", f.name)
        except BaseException as exc:
            f.open_error = exc
            raise
        finally:
            f.opened.set()

    @staticmethod
    def _opened(f: _OpenFile) -> LocalFileWriter:
        """`f`'s local file, once the thread creating it is done; its error if that failed."""
        if f.opened is not None:
            f.opened.wait()
        if f.local is None:
            raise f.open_error or DcpWriteError("data file was not created", f.name)
        return f.local

    @staticmethod
    def _queue(writes: list[_Write], f: _OpenFile, at: int, data: list[Buffer], padded: bool) -> None:
        """One more write into `f`, made outside the lock (lock held)."""
        f.writing += 1
        writes.append((f, at, data, padded))

    def _write_out(self, writes: list[_Write], ready: list[_OpenFile]) -> None:
        """Make the writes queued under the lock; a sealed file whose last write this was is ready."""
        for f, at, data, padded in writes:
            try:
                self._opened(f).write_at(at, data, padded=padded)
            finally:
                with self._lock:
                    f.writing -= 1
                    if f.sealed and not f.writing and not f.done:
                        f.done = True
                        ready.append(f)

    @staticmethod
    def _take_pending(f: _OpenFile) -> tuple[int, list[Buffer], bool]:
        """The small archives waiting in `f`, as one write, never direct (lock held)."""
        data, f.pending = f.pending, bytearray()
        return f.pending_at, [data], False

    def _seal(self, f: _OpenFile, ready: list[_OpenFile], writes: list[_Write]) -> None:
        """No more archives go into `f`; it is ready to flush once its writes are done (lock held)."""
        if f.pending and f.is_local:
            self._queue(writes, f, *self._take_pending(f))  # the last small archives
        f.sealed = True
        if self._current is f:
            self._current = None
        if not f.writing and not f.done:
            f.done = True
            ready.append(f)

    def _new_file_name(self) -> str:
        plan = self._require_plan()
        name = f"__{plan.process_index}_{self._next_file}.distcp"
        self._next_file += 1
        return name

    def _flush(self, f: _OpenFile) -> None:
        if f.is_local:
            self._closer.submit(self._opened(f).close)  # fsynced behind the copy threads (FileCloser)
            return
        # the kvstore takes the bytearray as it is: no extra copy of the file here
        data, f.data = f.data, bytearray()
        name, storage = f.name, self._storage
        self._uploader.submit(lambda: storage.write(name, data))

    def _sidecar(self) -> bytes:
        plan = self._require_plan()
        with self._lock:
            rows = [[name, index, e.relative_path, e.offset, e.length] for (name, index), e in self._entries.items()]
        doc = {
            "format": "ckpt-dcp-entries",
            "version": 1,
            "process_index": plan.process_index,
            "process_count": plan.process_count,
            "entries": rows,
        }
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    def _read_sidecar(self, key: str, rank: int) -> dict[tuple[str, int | None], _Entry]:
        where = self._where(key)
        try:
            raw = self._storage.read(key)
        except NotFoundError:
            raise IncompleteCheckpointError(
                f"process {rank} did not finish writing (no {key})", self._storage.url
            ) from None
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise CorruptMetadataError(f"not JSON: {exc}", where) from None
        if not isinstance(doc, dict) or doc.get("format") != "ckpt-dcp-entries" or doc.get("process_index") != rank:
            raise CorruptMetadataError(f"not the entry list of process {rank}", where)
        rows = doc.get("entries")
        if not isinstance(rows, list):
            raise CorruptMetadataError("entries is not a list", where)
        out: dict[tuple[str, int | None], _Entry] = {}
        for row in rows:
            ok = (
                isinstance(row, list) and len(row) == 5 and isinstance(row[0], str)
                and (row[1] is None or type(row[1]) is int) and isinstance(row[2], str)
                and type(row[3]) is int and type(row[4]) is int and row[3] >= 0 and row[4] > 0
            )
            if not ok:
                raise CorruptMetadataError(f"invalid entry {str(row)[:80]}", where)
            name, index, path, offset, length = row
            entry_key = (name, index)
            known = (
                name in self._values if index is None
                else name in self._arrays and 0 <= index < len(self._arrays[name][1])
            )
            if not known:
                raise CorruptMetadataError(
                    f"{_describe(entry_key)} is not in this plan (processes ran different plans?)", where
                )
            out[entry_key] = _Entry(path, offset, length)
        return out

    def _delete(self, key: str) -> None:
        self._storage.delete(key)

    def _where(self, key: str) -> str:
        return f"{self._storage.url}/{key}"


def _describe(key: tuple[str, int | None]) -> str:
    name, index = key
    return f"value {name!r}" if index is None else f"chunk {index} of {name!r}"


# -- what the engine asks the format (core/write_plan.py) ---------------------------------------

# torch's traversal stops at a tuple: it is one bytes item, gathered from the
# element leaves an Orbax source gives (gathered_value)
TUPLES_AS_VALUES = True
# what a convert writes at DST's top level (the other processes' entry sidecars included, which
# commit() deletes), and the one file torch's load needs, written last: on an object store the commit
OUTPUT_ENTRIES = (METADATA_FILE, "*.distcp", SIDECAR_PREFIX + "*")
COMMIT_MARKERS = (METADATA_FILE,)
KEEPS_ANY_STR = True  # names and strings are pickled str (surrogatepass): torch's load gives back any, lone surrogates too

_SIMPLE = (int, float, bool, str, type(None))


def make_writer(storage: Storage, **_: Any) -> DcpWriter:
    return DcpWriter(storage)


def keeps_source_chunks(leaf: Any) -> bool:
    return True  # the source's chunks, as a list


def target_layout(leaf: Any, itemsize: int, cap: int | None, cap_bytes: int) -> ChunkList:
    """The source chunks, as a list (split further only when capped)."""
    if isinstance(leaf.layout, RegularGrid):
        chunks = grid_chunks(leaf.shape, leaf.layout.chunk_shape)
    else:
        chunks = list(leaf.layout.chunks)
    if cap:
        chunks = [p for c in chunks for p in split_to_cap(c, itemsize, int(cap))]
    return ChunkList(tuple(chunks))


def plan_value(ctx: PlanContext, keys: tuple[Key, ...], name: str, value: Any, source_path: str) -> None:
    """A non-tensor item: any simple Python value, one bytes item."""
    if not is_simple(value):
        ctx.refuse(source_path, f"{a_type(value)} value is not a simple Python value")
        return
    ctx.add_value(TargetValue(keys, name, plain(value), "object"))


def gathered_value(value: Any, where: str) -> Any:
    """A tuple of the source gathered from its element leaves, as one bytes item."""
    if not is_simple(value):
        raise UnsupportedLeafError("holds a value a DCP bytes item cannot store", where)
    return plain(value)


def is_simple(value: Any) -> bool:
    """A value a DCP bytes item can hold: plain Python values, numpy scalars, and
    numpy arrays of a torch dtype (the tensors of a tuple torch saved as one item)."""
    # each object once (values.nodes): a decoded pickle may share one list at many places
    return all(_simple_node(v) for v in values.nodes(value))


def _simple_node(value: Any) -> bool:
    if isinstance(value, _SIMPLE) or isinstance(value, np.generic):
        return True
    if isinstance(value, np.ndarray):
        return dtypes.torch_name_of(value) is not None
    if isinstance(value, dict):
        return all(isinstance(k, str) for k in value)
    return isinstance(value, (list, tuple))


def plain(value: Any) -> Any:
    """numpy scalars inside values become Python scalars (torch.load reads them without numpy);
    numpy arrays stay arrays (the DCP writer stores them as tensors). What the value shares
    stays shared (values.transform: each object once), as torch.save keeps it."""
    return values.transform(value, lambda v: v.item() if isinstance(v, np.generic) else v)
