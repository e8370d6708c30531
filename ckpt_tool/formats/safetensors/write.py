"""Hugging Face safetensors writer: what transformers' save_pretrained writes, streamed.

Output, as transformers 4.x/5.x names and indexes it:

  * `model.safetensors` when every tensor fits in one `max_shard_size`
    file; otherwise `model-0000K-of-0000N.safetensors` plus
    `model.safetensors.index.json` (`{"metadata": {"total_parameters",
    "total_size"}, "weight_map": {name: file}}`, sorted keys, indent 2);
  * tensors are assigned to files in plan order with huggingface_hub's
    `split_state_dict_into_shards_factory` rule (a new file when the next
    tensor would pass the limit; a tensor bigger than the limit gets a file
    of its own), so the same state dict splits the same way;
  * each header is `{"__metadata__": {"format": "pt"}, name: {"dtype",
    "shape", "data_offsets"}}`, padded with spaces to a multiple of 8 bytes
    as the safetensors library pads it.

Numbers (a `step` int, a learning-rate float, a numpy scalar) are 0-d
tensors, which every safetensors reader loads (a Python int as int64, a
float as float64, a bool as bool, a numpy scalar in its own dtype). The
names of those that were Python numbers are listed in `__metadata__`
(`ckpt.python_scalars`), so ckpt's reader gives them back as Python numbers,
as they were saved; strings, bytes and other values are refused.

Every header is computed in begin() from the plan (shapes are known before
any data), and written first; then each region the engine hands over goes
straight to its final offset (a region of whole rows is one contiguous byte
range), from several threads at once, with no reassembly: memory stays at
the engine's few chunks in flight. A local file is written in place with
pwritev and, once its last byte is there, fsynced and dropped from the page
cache (storage.LocalFileWriter). Where the file system suits O_DIRECT
(base/directio.py), the whole 4 KiB blocks inside a range bypass the page cache
and only its two ends, which share a block with the neighbouring ranges, are
written buffered: O_DIRECT's zero padding must never reach a byte of the next
range. Other storage (S3, GCS) receives each file as one value: it is
assembled in a temporary local file and read back whole for its upload
(see REMOTE_MIN_SHARD for the sizes and the memory this holds).

In a multi-process run file K is written by process K mod P (`owns`), and
the primary writes the index after every process has finished (commit).
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...base import directio, dtypes
from ...base import sizes
from ...base.errors import CkptError, IncompleteCheckpointError, a_type
from ...core.model import Key, Region, default_grid, stored_chunks
from ...storage import LocalFileWriter, Storage
from ...core.contract import CheckpointWriter
from ...core.write_plan import PlanContext, TargetArray, TargetValue, WritePlan, byte_runs
from ...core.model import RegularGrid
from .reader import INDEX_FILE, KEYS_KEY, SCALARS_KEY, SINGLE_FILE

# transformers 4.x's save_pretrained default (5.x raised it to 50GB); parsed as huggingface_hub does
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
# On an object store a shard is uploaded whole, from memory (tensorstore uploads a value in one
# request; GCS compose and S3 multipart are not reachable through it), and the upload holds copies
# of it: a 326 MiB shard written to gs:// peaked at 1.3 GiB. There the shards are cut at an
# eighth of --memory (at least REMOTE_MIN_SHARD), whatever --max-shard-size asks: a set of more
# shards loads the same (transformers, safetensors), memory no longer follows the checkpoint, and
# the half of --memory that uploads may hold keeps four in flight.
REMOTE_MIN_SHARD = 64 * 2**20
# ...and a shard is filled by whichever copy thread holds its next chunk, several shards at once (8
# threads on an object store): a 1 GiB checkpoint to gs:// at --memory 128MiB held 1.2 GiB of shard
# buffers. So each shard is assembled in a temporary local file (TMPDIR, unlinked at once) and read
# back when complete, as many at a time as half of --memory holds (the engine reserves that from the
# readers'), one at least.


class SafetensorsWriteError(CkptError):
    """The plan or the data given to the safetensors writer cannot be written."""


def parse_size(text: str | int) -> int:
    """--max-shard-size: '5GB' (10^9, as huggingface_hub reads it), '500MiB' (2^20), or plain bytes."""
    return sizes.parse_size(text, "--max-shard-size", examples="5GB, 500MB, 2GiB")


@dataclass
class _Tensor:
    target: TargetArray
    dt: dtypes.DType
    file: int  # index into _files
    begin: int  # absolute byte offset of the tensor in its file
    nbytes: int
    chunks: list[tuple[int, ...]] = field(default_factory=list)  # chunk offsets (for checking)


@dataclass
class _File:
    name: str
    header: bytes  # 8-byte length + JSON header
    size: int  # the whole file
    tensors: list[str]
    remaining: int = 0  # data bytes not written yet
    local: LocalFileWriter | None = None
    staged: Any = None  # an object store's: a temporary local file, read back and sent once complete
    done: bool = False


def split_into_files(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """huggingface_hub's split_state_dict_into_shards_factory, on (name, nbytes) in order."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_shard_size:
            shards.append([name])  # its own file, placed before the one being filled
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    return shards


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def scalar_tensor(value: Any) -> np.ndarray | None:
    """The 0-d tensor a number is stored as, or None when `value` is not a number safetensors holds.

    A Python int is int64 (uint64 past its range), a float float64, a bool
    bool, as np.asarray makes them; a numpy scalar keeps its dtype. Strings,
    bytes, complex numbers and ints past 64 bits have no tensor here."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if not isinstance(value, (bool, int, float, np.generic)):
        return None
    try:
        arr = np.asarray(value)
        dt = dtypes.from_numpy(arr.dtype)
    except (OverflowError, CkptError):
        return None
    return arr if dt.safetensors is not None and arr.dtype.kind != "c" else None


def is_python_scalar(value: Any) -> bool:
    """A Python number (not a numpy scalar, which reads back as a 0-d array of its dtype)."""
    return type(value) in (bool, int, float)


def keys_metadata(targets: list[TargetArray]) -> str | None:
    """ckpt's record of tree keys the reader could not get back from the names, if any."""
    differ = {t.name: list(t.keys) for t in targets if tuple(str(k) for k in t.keys) != tuple(t.name.split("."))
              or any(isinstance(k, int) for k in t.keys)}
    if not differ:
        return None
    if all(len(t.keys) == 1 and isinstance(t.keys[0], str) for t in targets):
        return "flat"
    return json.dumps(differ, separators=(",", ":"))


def build_header(entries: list[tuple[str, str, tuple[int, ...], int, int]], metadata: dict[str, str]) -> bytes:
    """8-byte length + JSON header padded with spaces to a multiple of 8 (as safetensors pads it)."""
    doc: dict[str, Any] = {"__metadata__": metadata}
    for name, st_dtype, shape, begin, end in entries:
        doc[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [begin, end]}
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


class SafetensorsWriter(CheckpointWriter):
    """Writes a Hugging Face safetensors checkpoint through a Storage (see writers.CheckpointWriter)."""

    def __init__(self, storage: Storage, *, max_shard_size: int | None = None, memory: int | None = None) -> None:
        """memory: the run's --memory, which bounds a shard on an object store (REMOTE_MIN_SHARD)."""
        self._storage = storage
        self._max = int(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
        if self._max <= 0:
            raise SafetensorsWriteError(f"max_shard_size must be positive, got {max_shard_size}")
        if storage.local_root is None and memory is not None:
            self._max = min(self._max, max(REMOTE_MIN_SHARD, memory // 8))
        # object stores: what shards being uploaded may hold (one always goes, whatever its size)
        self._buffer_limit = 0 if storage.local_root is not None else (max(1, memory // 2) if memory else REMOTE_MIN_SHARD)
        self._buffered = 0  # bytes of shards read back and being uploaded
        self._room = threading.Condition()
        self._lock = threading.Lock()
        self._plan: WritePlan | None = None
        self._tensors: dict[str, _Tensor] = {}
        self._files: list[_File] = []
        self._mine: list[int] = []  # files this process writes
        self._owner_by_chunk: list[int] = []  # stream() order -> process
        self._scalars: dict[str, np.ndarray] = {}  # numbers stored as 0-d tensors: name -> their bytes
        self._state = "new"

    # -- protocol ----------------------------------------------------------------
    def begin(self, plan: WritePlan) -> None:
        if self._state != "new":
            raise SafetensorsWriteError("begin() called twice")
        # numbers become 0-d tensors, in plan order among the arrays; anything else is refused
        tensors: list[TargetArray] = []
        python_scalars: list[str] = []
        for t in plan.targets:
            if isinstance(t, TargetArray):
                tensors.append(t)
                continue
            arr = scalar_tensor(t.value) if t.value_type == "scalar" else None
            if arr is None:
                raise SafetensorsWriteError(
                    "safetensors holds tensors and numbers only (use --skip-unsupported to leave other values out)",
                    t.path,
                )
            self._scalars[t.name] = arr
            if is_python_scalar(t.value):
                python_scalars.append(t.name)
            tensors.append(TargetArray(tuple(t.keys), t.name, (), dtypes.from_numpy(arr.dtype).name, RegularGrid(())))
        arrays = plan.arrays()
        seen: set[str] = set()
        sizes: list[tuple[str, int]] = []
        for t in tensors:
            if not isinstance(t.name, str) or not t.name or t.name == "__metadata__":
                raise SafetensorsWriteError(f"invalid tensor name {t.name!r}", t.path)
            if t.name in seen:
                raise SafetensorsWriteError(f"two tensors share the name {t.name!r}", t.path)
            seen.add(t.name)
            dt = dtypes.get(t.dtype)
            if dt.safetensors is None:
                raise SafetensorsWriteError(f"dtype {t.dtype} has no safetensors equivalent", t.path)
            if any(not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0 for n in t.shape):
                raise SafetensorsWriteError(f"invalid shape {list(t.shape)}", t.path)
            nbytes = math.prod(t.shape) * dt.itemsize
            self._tensors[t.name] = _Tensor(t, dt, -1, 0, nbytes)
            sizes.append((t.name, nbytes))
        groups = split_into_files(sizes, self._max)
        names = file_names(len(groups))
        meta = {"format": "pt"}
        recorded = keys_metadata(tensors)
        if recorded is not None:
            meta[KEYS_KEY] = recorded
        if python_scalars:
            meta[SCALARS_KEY] = json.dumps(sorted(python_scalars), separators=(",", ":"), ensure_ascii=False)
        for i, (fname, group) in enumerate(zip(names, groups)):
            entries = []
            cursor = 0
            for name in group:
                tensor = self._tensors[name]
                entries.append((name, tensor.dt.safetensors, tuple(tensor.target.shape), cursor, cursor + tensor.nbytes))
                cursor += tensor.nbytes
            header = build_header(entries, meta)  # type: ignore[arg-type]
            for name, _, _, begin, _ in entries:
                self._tensors[name].file = i
                self._tensors[name].begin = len(header) + begin
            self._files.append(_File(fname, header, len(header) + cursor, list(group), remaining=cursor))
        rank, count = plan.process_index, plan.process_count
        if not 0 <= rank < count:
            raise SafetensorsWriteError(f"process index {rank} is outside 0..{count - 1}")
        for t in arrays:
            owner = self._tensors[t.name].file % count
            for c in stored_chunks(tuple(t.shape), t.layout):
                self._tensors[t.name].chunks.append(c.offsets)
                self._owner_by_chunk.append(owner)
        self._plan = plan
        self._mine = [i for i in range(len(self._files)) if i % count == rank]
        self._state = "writing"
        for i in self._mine:
            if self._storage.local_root is not None:
                self._open(self._files[i])
            # (elsewhere a file's buffer is made at its first write: made here, every shard of the
            # checkpoint would be held at once)

    def owns(self, n: int, rank: int, count: int) -> bool:
        """Whether process `rank` writes the n-th chunk of the plan: the owner of its file."""
        return self._owner_by_chunk[n] == rank

    def write_array(self, target: TargetArray, chunk_index: int, region: Region, data: np.ndarray) -> None:
        self._check_state("writing")
        t = self._tensors.get(target.name)
        if t is None:
            raise SafetensorsWriteError("write_array for a target that is not in the plan", target.name)
        f = self._files[t.file]
        if t.file not in self._mine:
            raise SafetensorsWriteError(f"{f.name} is written by another process", target.name)
        self._opened(f)
        if not 0 <= chunk_index < len(t.chunks) or t.chunks[chunk_index] != tuple(r.start for r in region):
            raise SafetensorsWriteError(f"region {[(r.start, r.stop) for r in region]} is not chunk {chunk_index}", target.name)
        arr = _as_stored(data, t.dt, tuple(r.stop - r.start for r in region), target.name)
        flat = arr.reshape(-1).view(np.uint8)
        runs = list(byte_runs(tuple(target.shape), region, t.dt.itemsize))
        pos = 0
        for offset, length in runs:
            self._put(f, t.begin + offset, flat[pos : pos + length])
            pos += length
        with self._lock:
            f.remaining -= pos
            complete = f.remaining == 0 and not f.done
            if f.remaining < 0:
                raise SafetensorsWriteError(f"more bytes written than {f.name} holds (a chunk written twice?)", target.name)
            if complete:
                f.done = True
        if complete:
            self._close(f)

    def write_value(self, target: TargetValue) -> None:
        # a number's bytes went into its file when the file was opened (by the process owning it)
        self._check_state("writing")
        if target.name not in self._scalars:
            raise SafetensorsWriteError("write_value for a value that is not in the plan", target.path)

    def finish_process(self) -> None:
        self._check_state("writing")
        for i in self._mine:
            f = self._files[i]
            self._opened(f)  # (a file of numbers and empty tensors only: written now)
            if f.remaining:
                raise IncompleteCheckpointError(
                    f"{f.remaining} bytes of {f.name} were never written ({f.tensors[0]!r}, ...)", self._storage.url
                )
            if not f.done:  # a file of empty tensors only
                f.done = True
                self._close(f)
        self._state = "finished"

    def commit(self) -> None:
        self._check_state("finished")
        plan = self._plan
        assert plan is not None
        if plan.process_index != 0:
            raise SafetensorsWriteError("commit() runs on the primary process (index 0) only")
        if len(self._files) > 1:
            # every process has finished its files (the engine's barrier): the index goes last
            weight_map = {name: f.name for f in self._files for name in f.tensors}
            index = {
                "metadata": {
                    "total_parameters": sum(math.prod(t.target.shape) for t in self._tensors.values()),
                    "total_size": sum(t.nbytes for t in self._tensors.values()),
                },
                "weight_map": weight_map,
            }
            self._storage.write(INDEX_FILE, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        self._state = "committed"

    @property
    def pending_bytes_limit(self) -> int:
        """Shards assembled in memory for an object store (see REMOTE_MIN_SHARD): the engine keeps
        them out of the readers' budget."""
        return self._buffer_limit

    def abort(self) -> None:
        with self._lock:
            files = list(self._files)
        for f in files:
            if f.local is not None:
                f.local.discard()
            if f.staged is not None:
                f.staged.close()
                f.staged = None
        self._state = "aborted"

    # -- internals ---------------------------------------------------------------
    def _check_state(self, want: str) -> None:
        if self._state != want:
            raise SafetensorsWriteError(
                f"writer is {self._state}, expected {want} (call order: begin, write, finish_process, commit)"
            )

    def _open(self, f: _File) -> None:
        if self._storage.local_root is not None:
            path = os.path.join(self._storage.local_root, f.name)  # our own file names: no containment risk
            os.makedirs(self._storage.local_root, exist_ok=True)
            f.local = LocalFileWriter(path, f"{self._storage.url}/{f.name}", direct=directio.supported(self._storage.local_root))
            f.local.write_at(0, [f.header])
        else:  # an object store's shard is assembled on local disk, and read back to be uploaded
            try:
                f.staged = tempfile.TemporaryFile(prefix="ckpt-shard-")
                _pwrite_all(f.staged.fileno(), memoryview(f.header), 0)
            except OSError as exc:
                raise self._staging_error(f, "cannot stage", exc) from None
        for name in f.tensors:
            arr = self._scalars.get(name)
            if arr is not None:
                t = self._tensors[name]
                self._put(f, t.begin, _as_stored(arr, t.dt, (), name).reshape(-1).view(np.uint8))
                f.remaining -= t.nbytes

    def _opened(self, f: _File) -> None:
        """Open `f` where begin() left it to its first write (an object store's staged shard)."""
        if f.local is not None or f.staged is not None or f.done:
            return
        with self._lock:
            if f.staged is None and not f.done:
                self._open(f)

    def _put(self, f: _File, offset: int, view: np.ndarray) -> None:
        if f.local is not None:
            f.local.write_span(offset, view)
            return
        assert f.staged is not None
        try:
            _pwrite_all(f.staged.fileno(), view.data, offset)
        except OSError as exc:
            raise self._staging_error(f, "cannot stage", exc) from None

    def _close(self, f: _File) -> None:
        if f.local is not None:
            f.local.close()
            return
        assert f.staged is not None
        staged, f.staged = f.staged, None
        self._take_room(f.size)  # read back once the uploads under way leave room for it
        try:
            data = bytearray(f.size)
            view = memoryview(data)
            pos = 0
            while pos < f.size:
                got = os.preadv(staged.fileno(), [view[pos:]], pos)
                if got <= 0:
                    raise OSError(0, f"the staged file ends at {pos} of {f.size} bytes")
                pos += got
            del view
            self._storage.write(f.name, data)
        except OSError as exc:
            raise self._staging_error(f, "cannot read back", exc) from None
        finally:
            staged.close()
            self._give_room(f.size)

    def _staging_error(self, f: _File, what: str, exc: OSError) -> SafetensorsWriteError:
        return SafetensorsWriteError(f"{what} {f.name} staged in {tempfile.gettempdir()} (TMPDIR): "
                                     f"{exc.strerror or exc}", self._storage.url)

    def _take_room(self, nbytes: int) -> None:
        """Count `nbytes` of shard read back for its upload, once the uploads under way leave room
        for it under the limit (one is always let through). Only uploads hold the room, and each
        ends by itself: nothing here waits on another thread's copying."""
        with self._room:
            while self._buffered and self._buffered + nbytes > self._buffer_limit:
                self._room.wait()
            self._buffered += nbytes

    def _give_room(self, nbytes: int) -> None:
        with self._room:
            self._buffered -= nbytes
            self._room.notify_all()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of `data` at `offset` (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _as_stored(data: np.ndarray, dt: dtypes.DType, sizes: tuple[int, ...], where: str) -> np.ndarray:
    """The region's data as a C-contiguous little-endian array of the target dtype."""
    if isinstance(data, np.generic):
        data = np.asarray(data)
    if not isinstance(data, np.ndarray):
        raise SafetensorsWriteError(f"chunk data must be a numpy array, got {type(data).__name__}", where)
    if tuple(data.shape) != sizes:
        raise SafetensorsWriteError(f"chunk data has shape {list(data.shape)}, expected {list(sizes)}", where)
    order = data.dtype.byteorder
    if data.dtype.itemsize > 1 and (order == ">" or (order == "=" and sys.byteorder == "big")):
        data = data.byteswap().view(data.dtype.newbyteorder("<"))
    if data.dtype != dt.numpy:
        raise SafetensorsWriteError(f"chunk data is {data.dtype}, expected {dt.name}", where)
    return np.ascontiguousarray(data).reshape(data.shape)


# -- what the engine asks the format (core/write_plan.py) ---------------------------------------

TUPLES_AS_VALUES = False  # a tuple's arrays are tensors of their own
# the index a sharded set's loaders open first, written last (one file is whole once stored); what
# a convert writes at DST's top level is the format's claims and parts (its files, the model's beside)
COMMIT_MARKERS = (INDEX_FILE,)


def make_writer(storage: Storage, *, max_shard_size: int | None = None, memory: int | None = None,
                **_: Any) -> SafetensorsWriter:
    return SafetensorsWriter(storage, max_shard_size=max_shard_size, memory=memory)


def keeps_source_chunks(leaf: Any) -> bool:
    return False  # blocks of whole rows, whatever the source's chunks


def target_layout(leaf: Any, itemsize: int, cap: int | None, cap_bytes: int) -> RegularGrid:
    """Blocks of whole rows: each is one contiguous byte range of the output file."""
    return RegularGrid(default_grid(tuple(leaf.shape), itemsize, cap_bytes))


def plan_value(ctx: PlanContext, keys: tuple[Key, ...], name: str, value: Any, source_path: str) -> None:
    """A number (a step counter) is a 0-d tensor here; the writer records which were Python
    numbers, so ckpt reads them back as such. Nothing else has a place in a safetensors file."""
    if scalar_tensor(value) is not None:
        ctx.add_value(TargetValue(keys, name, value, "scalar"))
        return
    ctx.refuse(source_path, f"safetensors holds tensors and numbers only, not {a_type(value)} value")
