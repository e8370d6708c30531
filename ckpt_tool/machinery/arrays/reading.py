"""Zarr arrays as TensorStore writes them for Orbax (and as Megatron's zarr backend and orbax <= 0.4
saves hold them): each array's `.zarray` / `zarr.json`, read concurrently and checked
(schema.py), and region readers over tensorstore, in plain per-array directories or an OCDBT
database (merged, or still one per process). Shared machinery: the Orbax, msgpack (orbax <= 0.4,
T5X) and Megatron packages read their arrays here; nothing here names a format.
"""
from __future__ import annotations

import bisect
import itertools
import math
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ...base import dtypes
from ...base.bufferpool import POOL
from ...core.contract import ArrayReader
from ...base.errors import CkptError, CorruptMetadataError, NotFoundError
from ...core.model import Key, Leaf, Region, Sharding, ValueLeaf, constant_loader
from ...storage import Reads, Storage, ts_error_text
from ...storage.ocdbt_node import IndirectValue
from . import schema

if TYPE_CHECKING:
    import numpy as np
    import tensorstore as ts

    from . import stored_chunks
# (tensorstore is imported where an array is opened: the metadata of an Orbax checkpoint on a local
# path is read without it, issue 46)

# the files beside the arrays that this machinery reads (Orbax's names)
TREE_METADATA = "_METADATA"
SHARDING = "_sharding"
STRINGS = "_strings.json"
ROOT_MANIFEST = "manifest.ocdbt"

# the chunks of an array in an OCDBT database whose codecs core/codecs.py decodes are read by pread and
# decoded here up to this decoded size (LocatedZarrRegionReader); a larger chunk goes to tensorstore
LOCATED_CHUNK_BYTES = 256 << 20
_NOT_ASKED = object()  # (LocatedZarrRegionReader._encoding before its first chunk)
# chunk keys located per walk of the B+tree (whole arrays: a batch may hold more)
LOCATED_BATCH_KEYS = 8192
# batches kept at once (copy threads may be reading arrays of neighbouring batches)
LOCATED_BATCHES_KEPT = 4
# CKPT_LOCATED_READS=0: every chunk through tensorstore (bench/tpu_host.py's profile compares both)
LOCATED_READS = os.environ.get("CKPT_LOCATED_READS", "1") != "0"
# CKPT_STORED_CHUNKS=0: every chunk written is encoded again, even where its stored bytes would do
# (stored_chunks.py; the bench's A/B)
STORED_CHUNKS = os.environ.get("CKPT_STORED_CHUNKS", "1") != "0"


@dataclass
class ArraySource:
    """Where arrays live: an OCDBT database (subdir '' = root) or plain directories (None).

    The chunks of arrays in an OCDBT database are located without tensorstore's
    point reads, whose cost grows with the B+tree node holding the key (orbax's
    100k-leaf save: one node of 200,000 entries, 0.2-0.5 ms per read, so
    `validate --deep` was quadratic in the leaf count). The readers register in
    leaf order; the first read of a chunk locates the chunks of its whole batch
    of arrays by one walk of the tree (storage/ocdbt_bulk.py), and the reader
    reads and decodes the chunk's bytes itself (LocatedZarrRegionReader).
    """

    storage: Storage
    ocdbt_dir: str | None
    _view: Storage | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # the arrays whose chunks are located by a walk, in leaf order. Their chunks, numbered one after
    # the other (each array's in grid order), are located LOCATED_BATCH_KEYS at a time: one walk's
    # keys are bounded however many chunks one array's metadata claims (`ckpt inspect` reads no
    # data and pays nothing per array for this)
    located_readers: list["LocatedZarrRegionReader"] = field(default_factory=list)
    _located_offsets: list[int] = field(default_factory=lambda: [0])  # each reader's first chunk number
    _located_batches: dict[int, dict[str, Any]] = field(default_factory=dict)

    def register_located(self, reader: "LocatedZarrRegionReader") -> int:
        self.located_readers.append(reader)
        return len(self.located_readers) - 1

    def located_chunk(self, index: int, ordinal: int, key: str) -> bytes | memoryview | None:
        """The stored bytes of chunk `key` (number `ordinal` in its grid) of located reader `index`, or
        None when the database does not hold it (the caller then reads through tensorstore, which
        says how it is missing)."""
        value = self.locate_chunk(index, ordinal, key)
        return None if value is None else self.read_chunk(key, value)

    def read_chunk(self, key: str, value: bytes | IndirectValue) -> bytes | memoryview:
        """A located chunk's stored bytes (into a pooled buffer when read from its data file)."""
        return value if isinstance(value, bytes) else self.view.read_located(key, value, pooled=True)

    def locate_chunk(self, index: int, ordinal: int, key: str) -> bytes | IndirectValue | None:
        """Where chunk `key` is (its bytes if stored in line), as for located_chunk."""
        with self._lock:
            offsets = self._located_offsets
            while len(offsets) <= len(self.located_readers):  # (readers registered since the last read)
                offsets.append(offsets[-1] + self.located_readers[len(offsets) - 1].chunk_count)
            batch = (offsets[index] + ordinal) // LOCATED_BATCH_KEYS
            located = self._located_batches.get(batch)
            if located is None:
                located = self.view.locate_values(self._batch_keys(batch))
                while len(self._located_batches) >= LOCATED_BATCHES_KEPT:
                    del self._located_batches[next(iter(self._located_batches))]
                self._located_batches[batch] = located
        value = located.get(key)
        if value is None:
            return None
        self.view.log.record(key)
        return value

    def _batch_keys(self, batch: int) -> list[str]:
        """The chunk keys numbered [batch, batch + 1) * LOCATED_BATCH_KEYS (lock held)."""
        offsets = self._located_offsets
        start, stop = batch * LOCATED_BATCH_KEYS, (batch + 1) * LOCATED_BATCH_KEYS
        keys: list[str] = []
        i = bisect.bisect_right(offsets, start) - 1
        while i < len(self.located_readers) and offsets[i] < stop:
            keys.extend(self.located_readers[i].chunk_keys(max(start, offsets[i]) - offsets[i],
                                                           min(stop, offsets[i + 1]) - offsets[i]))
            i += 1
        return keys

    @property
    def view(self) -> Storage:
        if self._view is None:
            self._view = self.storage.ocdbt(self.ocdbt_dir) if self.ocdbt_dir is not None else self.storage
        return self._view

    def array_kvstore(self, name: str) -> dict[str, Any]:
        if self.ocdbt_dir is None:
            return self.storage.kvstore_spec(name + "/")
        base = self.storage.kvstore_spec(self.ocdbt_dir + "/" if self.ocdbt_dir else "")
        return {"driver": "ocdbt", "base": base, "path": name + "/"}


def read_zarr_metadata(
    sources: list[ArraySource], names: list[str], meta_key: str, first_reads: Reads
) -> dict[str, tuple[dict[str, Any], ArraySource]]:
    """Each array's zarr metadata, read concurrently, with the source holding it.

    `first_reads` are the reads of every name from the first source, already
    started; names it lacks are looked for in the next sources in turn.
    """
    found: dict[str, tuple[dict[str, Any], ArraySource]] = {}
    remaining = list(names)
    for i, source in enumerate(sources):
        if not remaining:
            break
        pending = first_reads if i == 0 else source.view.start_reads(f"{n}/{meta_key}" for n in remaining)
        raw = pending.result()
        still = []
        parsed: dict[bytes, Any] = {}  # arrays of one shape and dtype share their metadata text
        for n in remaining:
            data = raw[f"{n}/{meta_key}"]
            if data is None:
                still.append(n)
                continue
            if data not in parsed:
                parsed[data] = schema.load_json(data, f"{source.view.url}/{n}/{meta_key}")
            found[n] = (parsed[data], source)
        remaining = still
    return found


def parse_zarr_metadata(
    zmeta: Any, zarr3: bool, where: str
) -> tuple[tuple[int, ...], str, tuple[int, ...], dict[str, Any]]:
    """shape, dtype, stored chunk shape and codec facts from .zarray / zarr.json (schema-checked)."""
    z = schema.parse_zarr_metadata(zmeta, zarr3, where)
    return z.shape, z.dtype, z.chunk_shape, z.info


_OPEN_LOCKS = tuple(threading.Lock() for _ in range(64))


class ZarrRegionReader(ArrayReader):
    """Reads regions of one zarr array through tensorstore, opening it on first use."""

    # one per array, 10^4-10^5 of them: no per-instance __dict__
    __slots__ = ("_source", "_name", "_zarr3", "_zmeta", "_store", "_opening", "_lock")

    starts_reads = True  # tensorstore reads run together: start_read, start_read_into, start_open

    def __init__(self, source: ArraySource, name: str, zarr3: bool, zmeta: dict[str, Any]) -> None:
        self._source = source
        self._name = name
        self._zarr3 = zarr3
        self._zmeta = zmeta
        self._store: ts.TensorStore | None = None
        self._opening: Any = None  # the open future, once started
        # a lock per array was 84 bytes each (8 MiB at 100k leaves): opens share a few, by name
        self._lock = _OPEN_LOCKS[hash(name) % len(_OPEN_LOCKS)]

    def start_open(self) -> None:
        """Start opening the array without waiting (opens of many small arrays then overlap)."""
        if self._store is None and self._opening is None:
            with self._lock:
                if self._store is None and self._opening is None:
                    self._opening = self._open_future()

    def _open_future(self) -> Any:
        spec = {
            "driver": "zarr3" if self._zarr3 else "zarr",
            "kvstore": self._source.array_kvstore(self._name),
            # a lost chunk must fail the read, not come back as zeros
            "fill_missing_data_reads": False,
            "recheck_cached_data": False,
            # the metadata read and schema-checked with every other array's (one batch at open):
            # tensorstore need not read it again per array (10,000 small arrays: one point read each)
            "metadata": self._zmeta,
        }
        try:
            import tensorstore as ts

            return ts.open(spec, open=True, read=True, assume_metadata=True, context=self._source.storage.read_context)
        except Exception as exc:
            raise CkptError(f"cannot open array: {ts_error_text(exc)}", self._name) from exc

    def _open(self) -> ts.TensorStore:
        if self._store is not None:  # opened already: no lock on every chunk read
            return self._store
        with self._lock:
            if self._store is None:
                fut = self._opening if self._opening is not None else self._open_future()
                # the storage layer's deadline: a remote store that stops answering fails, never hangs
                self._store = self._source.storage.wait(fut, "cannot open array", self._name)
            return self._store

    def read(self, region: Region) -> np.ndarray:
        return self.start_read(region)()

    __call__ = read

    def start_read(self, region: Region) -> Callable[[], np.ndarray]:
        """Start reading a region; the returned call waits for it. Many small reads
        started at once let tensorstore run them together (3,000 small leaves:
        0.5 s, against 1.3 s read one by one from four threads)."""
        store = self._open()
        try:
            view = store[tuple(region)] if region else store
            fut = view.read()
        except Exception as exc:
            raise CkptError(f"cannot read data: {ts_error_text(exc)}", self._name) from exc
        nbytes = view.size * view.dtype.numpy_dtype.itemsize
        import numpy as np

        return lambda: np.asarray(self._source.storage.wait(fut, "cannot read data", self._name, nbytes=nbytes))

    def start_read_into(self, region: Region, out: np.ndarray) -> Callable[[], None]:
        """Start reading a region straight into `out` (of the region's shape); the returned call waits."""
        store = self._open()
        try:
            import tensorstore as ts

            target = ts.array(out, copy=False)
            fut = target.write(store[tuple(region)].translate_to[(0,) * len(region)])
        except Exception as exc:
            raise CkptError(f"cannot read data: {ts_error_text(exc)}", self._name) from exc
        return lambda: self._source.storage.wait(fut, "cannot read data", self._name, nbytes=out.nbytes)

    def scalar(self) -> Any:
        value = self.read(())
        return value.item() if value.shape == () else value

    def stored_chunk(self, index: tuple[int, ...]) -> tuple[Storage, str, dict[str, Any], bool]:
        """Where the stored chunk at grid position `index` lives: (storage, key, zarr metadata, zarr3),
        for decoding its bytes as a stream (ckpt_tool/core/codecs.py) when it is too large to decode whole.

        In an OCDBT database the storage is the value where the B+tree holds it out of line
        (_LocatedValue): its windows are read by pread into reused buffers, where tensorstore's
        file kvstore makes a new buffer and a copy of it per window (fresh memory: base/bufferpool.py).
        Anything else (a value held in line, a chunk the walk does not find, which the view then
        says how it is missing) is read through the database's view."""
        view = self._source.view
        key = chunk_key(self._name, index, self._zarr3, self._zmeta)
        source: Any = view
        if self._source.ocdbt_dir is not None:
            found = view.locate_values([key]).get(key)
            if isinstance(found, IndirectValue):
                source = _LocatedValue(view, key, found)
        return source, key, self._zmeta, self._zarr3

    def stored_encoding(self) -> stored_chunks.Encoding | None:
        """How the chunks are stored (stored_chunks.encoding_of), where a writer may copy them as
        they are; None when CKPT_STORED_CHUNKS=0."""
        from . import stored_chunks  # (with numpy, which reading metadata does without)

        return stored_chunks.encoding_of(self._zmeta, self._zarr3) if STORED_CHUNKS else None

    def copy_stored(self, index: tuple[int, ...], write: Callable[[bytes], None], window: int) -> int:
        """The stored chunk at grid `index`, as stored, to `write` in windows, each decoded as it
        passes as the check (codecs.copy_stored_chunk)."""
        from ...core import codecs

        storage, key, zmeta, zarr3 = self.stored_chunk(index)
        _, _, chunk_shape, _ = parse_zarr_metadata(zmeta, zarr3, key)
        nbytes = math.prod(chunk_shape) * codecs.stored_itemsize(zmeta, zarr3)
        return codecs.copy_stored_chunk(storage, key, zmeta, zarr3, nbytes, write, window)


class _LocatedValue:
    """One out-of-line value of an OCDBT view, where its walk found it, offered to codecs as the
    Storage calls it makes (size, read_range, _where): each range read from the data file into a
    pooled buffer (Storage.read_located), its length checked against the file."""

    __slots__ = ("_view", "_key", "_ref")

    def __init__(self, view: Storage, key: str, ref: IndirectValue) -> None:
        self._view = view
        self._key = key
        self._ref = ref

    def size(self, key: str) -> int:
        return self._ref.length

    def read_range(self, key: str, start: int, end: int) -> bytes | memoryview:
        ref = self._ref
        if start < 0 or end > ref.length or start > end:
            raise CkptError(f"invalid byte range [{start}, {end}) of a {ref.length}-byte value", self._where(key))
        if start == end:
            return b""
        self._view.log.record(self._key)  # (one read per window, as the view logs a range read)
        return self._view.read_located(self._key, IndirectValue(ref.path, ref.offset + start, end - start), pooled=True)

    def _where(self, key: str) -> str:
        return self._view._where(key)


class LocatedZarrRegionReader(ZarrRegionReader):
    """A zarr array of an OCDBT database whose whole chunks are read by pread and decoded here.

    Through tensorstore's zarr driver, reading 2.3 GiB of orbax chunks (zstd) took 4.6 s and 8.9
    CPU-seconds on two cores here, where a pread of the data files takes 0.25 s and zstandard
    decodes them in 2.0 CPU-seconds; on a TPU VM's sandboxed kernel (gVisor) the driver's file
    reads cost more still. So a walk of the B+tree locates the chunks of a batch of arrays at a
    time (ArraySource.located_chunk), one pread reads a chunk's bytes and core/codecs.py decodes them
    in the calling thread (zstandard releases the GIL: the copy threads decode in parallel).

    A region of several chunks (a small leaf read whole) is assembled from them; a region with a
    chunk the walk does not find is read through tensorstore as before (which then says how the
    chunk is missing). starts_reads is False: the scheduler reads a chunk that feeds several
    regions once, whole, and cuts the pieces from it, so each chunk is still decoded once.
    """

    __slots__ = ("_located", "_shape", "_chunk_shape", "_encoding")

    starts_reads = False

    def __init__(self, source: ArraySource, name: str, zarr3: bool, zmeta: dict[str, Any],
                 shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> None:
        super().__init__(source, name, zarr3, zmeta)
        self._shape = shape
        self._chunk_shape = chunk_shape
        self._located = source.register_located(self)
        self._encoding: Any = _NOT_ASKED  # how the chunks are stored: asked by the first chunk read

    @property
    def _grid(self) -> list[int]:
        """Chunks along each dimension."""
        return [-(-n // c) for n, c in zip(self._shape, self._chunk_shape)]

    @property
    def chunk_count(self) -> int:
        return math.prod(self._grid)

    def chunk_keys(self, start: int, stop: int) -> list[str]:
        """The keys of chunks number start..stop-1, in grid (C) order."""
        grid = self._grid
        keys = []
        for ordinal in range(start, stop):
            index = []
            for n in reversed(grid):
                ordinal, i = divmod(ordinal, n)
                index.append(i)
            keys.append(chunk_key(self._name, tuple(reversed(index)), self._zarr3, self._zmeta))
        return keys

    def start_read(self, region: Region) -> Callable[[], np.ndarray]:
        if not region and self._shape:
            region = tuple(slice(0, n) for n in self._shape)
        if len(region) != len(self._shape) or any(r.step not in (None, 1) for r in region) or 0 in self._shape:
            return super().start_read(region)
        return lambda: self._read_region(region)

    def start_read_into(self, region: Region, out: np.ndarray) -> Callable[[], None]:
        out[...] = self.start_read(region)()
        return lambda: None

    def _whole_chunk(self, region: Region) -> tuple[int, ...] | None:
        """The grid index of the chunk `region` is exactly (clipped to the array), or None."""
        index = []
        for r, n, c in zip(region, self._shape, self._chunk_shape):
            start = r.start or 0
            stop = n if r.stop is None else r.stop
            if start % c or stop != min(start + c, n):
                return None
            index.append(start // c)
        return tuple(index)

    def _read_region(self, region: Region) -> np.ndarray:
        """The region assembled from the chunks it overlaps, each read and decoded once; through
        tensorstore if the walk does not find one of them."""
        index = self._whole_chunk(region)
        if index is not None:  # the common case: one stored chunk, returned as decoded
            chunk = self._chunk(index)
            if chunk is None:
                return ZarrRegionReader.start_read(self, region)()
            return chunk
        bounds = [(r.start or 0, n if r.stop is None else r.stop) for r, n in zip(region, self._shape)]
        out: np.ndarray | None = None
        grid = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(bounds, self._chunk_shape)]
        for index in itertools.product(*grid):
            chunk = self._chunk(index)
            if chunk is None:
                return ZarrRegionReader.start_read(self, region)()
            if out is None:
                out = POOL.empty(tuple(hi - lo for lo, hi in bounds), chunk.dtype)
            # the part of this chunk inside the region, in the chunk and in the output
            src, dst = [], []
            for i, c, (lo, hi) in zip(index, self._chunk_shape, bounds):
                a, b = max(lo, i * c), min(hi, (i + 1) * c)
                src.append(slice(a - i * c, b - i * c))
                dst.append(slice(a - lo, b - lo))
            out[tuple(dst)] = chunk[tuple(src)]
        if out is None:  # (an empty region)
            return ZarrRegionReader.start_read(self, region)()
        return out

    def _chunk(self, index: tuple[int, ...]) -> np.ndarray | None:
        """The stored chunk at grid `index`, decoded and clipped to the array; None if the walk
        does not find it."""
        from ...core import codecs

        key = chunk_key(self._name, index, self._zarr3, self._zmeta)
        ordinal = 0
        for i, n in zip(index, self._grid):
            ordinal = ordinal * n + i
        source = self._source
        where = source.locate_chunk(self._located, ordinal, key)
        if where is None:
            return None
        data = source.read_chunk(key, where)
        chunk = codecs.decode_chunk(data, self._zmeta, self._zarr3, self._chunk_shape, f"{source.view.url}/{key}")
        if any((i + 1) * c > n for i, c, n in zip(index, self._chunk_shape, self._shape)):  # an edge chunk
            chunk = chunk[tuple(slice(0, min(c, n - i * c)) for i, c, n in zip(index, self._chunk_shape, self._shape))]
        encoding = self._encoding
        if encoding is _NOT_ASKED:  # (here, not when made: inspect makes every array's reader and reads none)
            encoding = self._encoding = self.stored_encoding()
        if encoding is None:
            return chunk
        # a writer of the same encoding may store these bytes as they are. From a local file (or in
        # line) they are read again when written (from the page cache), not kept. From an object
        # store they are kept while the decoded chunk lives: reading them again would download the
        # chunk twice (and double the process's share of the source's bytes:
        # tests/ops/reshard/test_multihost_gcs.py), and encoding them again cost a reshard gs:// ->
        # local of 1 GiB 7 of its 20 busy thread-seconds (zstd), 2.7x the same reshard of a local
        # copy. Kept, the chunk is held twice while it is written, which is what the scheduler
        # charges a whole chunk's decode for (scheduler.decoded_cost)
        from . import stored_chunks

        if isinstance(where, bytes) or source.storage.capabilities.local_files:
            del data
            return stored_chunks.remember(chunk, encoding, index, lambda: source.read_chunk(key, where))
        # (downloaded into memory of its own, or into a pooled buffer, which stays out of the pool
        # while this refers to it: bufferpool.py)
        kept = data
        return stored_chunks.remember(chunk, encoding, index, lambda: kept)


def region_reader(source: ArraySource, name: str, zarr3: bool, zmeta: dict[str, Any],
                  shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> ZarrRegionReader:
    """The reader of one array: a LocatedZarrRegionReader where its chunks can be read without
    tensorstore (an OCDBT database, codecs core/codecs.py decodes, chunks up to LOCATED_CHUNK_BYTES)."""
    from ...core import codecs

    if LOCATED_READS and source.ocdbt_dir is not None and len(chunk_shape) == len(shape) and 0 not in chunk_shape:
        problem = codecs.zarr3_stream_problem(zmeta) if zarr3 else codecs.zarr2_stream_problem(zmeta)
        try:
            nbytes = math.prod(chunk_shape) * codecs.stored_itemsize(zmeta, zarr3)
        except Exception:  # noqa: BLE001 - a dtype the decoders do not know: tensorstore reads it
            problem = "its dtype"
        if problem is None and nbytes <= LOCATED_CHUNK_BYTES:
            return LocatedZarrRegionReader(source, name, zarr3, zmeta, shape, chunk_shape)
    return ZarrRegionReader(source, name, zarr3, zmeta)


def _key_form(name: str, zarr3: bool, zmeta: dict[str, Any]) -> tuple[str, str, str]:
    """How an array's chunk keys are spelled: a chunk's key is head + separator.join(its grid
    index); the third is the key of a 0-d array's one chunk."""
    if zarr3:
        enc = zmeta.get("chunk_key_encoding") or {}
        default = enc.get("name", "default") == "default"
        sep = (enc.get("configuration") or {}).get("separator", "/" if default else ".")
        if default:
            return f"{name}/c{sep}", sep, f"{name}/c"
        return f"{name}/", sep, f"{name}/0"
    return f"{name}/", zmeta.get("dimension_separator") or ".", f"{name}/0"


def chunk_key(name: str, index: tuple[int, ...], zarr3: bool, zmeta: dict[str, Any]) -> str:
    """The key of one chunk of an array's regular grid (as chunk_keys names them)."""
    head, sep, scalar = _key_form(name, zarr3, zmeta)
    return head + sep.join(map(str, index)) if index else scalar


def block_chunk_keys(name: str, first: tuple[int, ...], counts: tuple[int, ...], zarr3: bool,
                     zmeta: dict[str, Any]) -> list[str]:
    """The keys of a block of whole chunks (`counts` of them along each dimension, from grid index
    `first`), in C order: a block of a 256-device layout names thousands, each index's digits
    spelled once."""
    head, sep, scalar = _key_form(name, zarr3, zmeta)
    if not first:
        return [scalar]
    digits = [[str(f + o) for o in range(n)] for f, n in zip(first, counts)]
    return [head + sep.join(parts) for parts in itertools.product(*digits)]


def chunk_keys(name: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...], zarr3: bool, zmeta: dict[str, Any]):
    """Every chunk key of an array's regular chunk grid, with its grid index."""
    grid = [range(-(-s // c)) if c else range(0) for s, c in zip(shape, chunk_shape)]
    head, sep, scalar = _key_form(name, zarr3, zmeta)
    for idx in itertools.product(*grid):
        yield idx, (head + sep.join(map(str, idx)) if idx else scalar)


class UnmergedRegionReader(ArrayReader):
    """Reads an array whose chunks are spread over per-process OCDBT databases.

    Each database is opened with the primary's zarr metadata assumed (only
    process 0 writes it); each chunk is read from the database that lists it.
    """

    def __init__(self, sources: list[ArraySource], name: str, zarr3: bool, zmeta: dict[str, Any],
                 shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> None:
        self._sources = sources
        self._name = name
        self._zarr3 = zarr3
        self._zmeta = zmeta
        self._shape = shape
        self._chunk_shape = chunk_shape
        self._owner: dict[str, int] | None = None
        self._stores: dict[int, ts.TensorStore] = {}
        self._lock = threading.Lock()

    def _owner_of(self) -> dict[str, int]:
        with self._lock:
            if self._owner is None:
                owner: dict[str, int] = {}
                for i, src in enumerate(self._sources):
                    for key in src.view.list(self._name):
                        owner.setdefault(key, i)
                self._owner = owner
            return self._owner

    def _store(self, i: int) -> ts.TensorStore:
        with self._lock:
            if i not in self._stores:
                spec = {
                    "driver": "zarr3" if self._zarr3 else "zarr",
                    "kvstore": self._sources[i].array_kvstore(self._name),
                    "metadata": self._zmeta,
                    "fill_missing_data_reads": False,
                }
                storage = self._sources[i].storage
                try:
                    # only the primary wrote .zarray: assume it for the other databases
                    import tensorstore as ts

                    fut = ts.open(spec, open=True, read=True, assume_metadata=True, context=storage.read_context)
                except Exception as exc:
                    raise CkptError(f"cannot open array: {ts_error_text(exc)}", self._name) from exc
                self._stores[i] = storage.wait(fut, "cannot open array", self._name)
            return self._stores[i]

    def read(self, region: Region) -> np.ndarray:
        region = region or tuple(slice(0, s) for s in self._shape)
        want = tuple(r.stop - r.start for r in region)
        import numpy as np

        out = np.empty(want, dtype=dtypes.numpy_dtype(zarr_dtype(self._zmeta, self._zarr3)))
        owner = self._owner_of()
        for idx, key in chunk_keys(self._name, self._shape, self._chunk_shape, self._zarr3, self._zmeta):
            lo = [i * c for i, c in zip(idx, self._chunk_shape)]
            hi = [min((i + 1) * c, s) for i, c, s in zip(idx, self._chunk_shape, self._shape)]
            inter = [(max(l, r.start), min(h, r.stop)) for l, h, r in zip(lo, hi, region)]
            if any(a >= b for a, b in inter):
                continue
            if key not in owner:
                raise CkptError(f"chunk {list(idx)} is in no per-process database", f"{self._name}/{key}")
            src = tuple(slice(a, b) for a, b in inter)
            dst = tuple(slice(a - r.start, b - r.start) for (a, b), r in zip(inter, region))
            try:
                fut = self._store(owner[key])[src].read()
            except CkptError:
                raise
            except Exception as exc:
                raise CkptError(f"cannot read data: {ts_error_text(exc)}", self._name) from exc
            out[dst] = self._sources[owner[key]].storage.wait(fut, "cannot read data", self._name, nbytes=out[dst].nbytes)
        return out

    __call__ = read

    def scalar(self) -> Any:
        value = self.read(())
        return value.item() if value.shape == () else value


def zarr_dtype(zmeta: dict[str, Any], zarr3: bool) -> str:
    return (dtypes.from_zarr3(zmeta["data_type"]) if zarr3 else dtypes.from_zarr2(zmeta["dtype"])).name


# -- sharding and strings ------------------------------------------------------


def read_shardings(storage: Storage, files: list[str]) -> dict[str, Sharding]:
    if SHARDING not in files:
        return {}
    where = f"{storage.url}/{SHARDING}"
    infos = schema.parse_sharding_file(read_json(storage, SHARDING), where)
    return {name: sharding_model(info) for name, info in infos.items()}


def sharding_model(info: schema.ShardingInfo) -> Sharding:
    if info.kind == "single_device":
        return Sharding("single_device", device=info.device)
    return Sharding(
        "named", mesh_shape=info.mesh_shape, axis_names=info.axis_names,
        partition_spec=info.partition_spec, device_ids=info.device_ids,
    )


def parse_sharding(info: dict[str, Any], where: str) -> Sharding:
    """A Sharding from one `_sharding` entry as orbax writes it."""
    kind = str(info.get("sharding_type", "unknown"))
    if kind == "NamedSharding":
        try:
            mesh_shape = tuple(int(x) for x in info["shape"])
            axis_names = tuple(str(x) for x in info["axis_names"])
            spec = tuple(
                tuple(p) if isinstance(p, list) else p for p in info.get("partition_spec", [])
            )
            device_ids: tuple[int, ...] | None = None
            mesh = (info.get("device_mesh") or {}).get("mesh")
            if mesh is not None:
                flat: list[int] = []

                def walk(node: Any) -> None:
                    if isinstance(node, list):
                        for n in node:
                            walk(n)
                    elif isinstance(node, dict):
                        flat.append(int(node["id"]))

                walk(mesh)
                device_ids = tuple(flat)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptMetadataError(f"bad NamedSharding entry: {exc}", where) from None
        return Sharding("named", mesh_shape=mesh_shape, axis_names=axis_names, partition_spec=spec, device_ids=device_ids)
    if kind == "SingleDeviceSharding":
        return Sharding("single_device", device=info.get("device_str"))
    return Sharding(kind)


class StringsFile:
    """`_strings.json` (or, in OCDBT saves, the same key inside the database), read once."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._values: dict[str, Any] | None = None

    def get(self, name: str) -> Any:
        if self._values is None:
            self._values = (
                schema.parse_strings(read_json(self._storage, STRINGS), f"{self._storage.url}/{STRINGS}")
                if self._storage.exists(STRINGS) else {}
            )
        if name not in self._values:
            raise NotFoundError(f"string {name!r} missing from {STRINGS}", self._storage.url)
        return self._values[name]


def read_json(storage: Storage, key: str) -> Any:
    """A JSON metadata file, parsed with the schema layer's size and nesting bounds."""
    where = f"{storage.url}/{key}"
    if storage.local_root:  # a stat is free here: refuse a huge file before reading it
        try:
            size = storage.size(key)
        except NotFoundError:
            size = 0  # the read below says it is missing
        if size > schema.MAX_JSON_BYTES:
            raise CorruptMetadataError(f"{size:,} bytes, more than the {schema.MAX_JSON_BYTES:,} a metadata file may have", where)
    return schema.load_json(storage.read(key), where)


def json_leaves(storage: Storage, file: str, prefix: tuple[Key, ...], name: str) -> list[Leaf]:
    """The leaves of a JSON item's file (Orbax's JSON handlers; orbax <= 0.4's `metadata` file),
    named under `prefix`: the value as orbax's load returns it, flattened as every nested value is."""
    data = read_json(storage, file)
    leaves: list[Leaf] = []

    def walk(value: Any, keys: tuple[Key, ...]) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, keys + (str(k),))
        elif isinstance(value, list) and value:
            for i, v in enumerate(value):
                walk(v, keys + (i,))
        else:
            leaves.append(ValueLeaf(
                keys=keys, name=".".join(str(k) for k in keys), value_type="json",
                loader=constant_loader(value), extra={"json_type": type(value).__name__},
            ))

    # a JSON item holding one scalar is one leaf named after the item, even as the unnamed `default`
    walk(data, prefix or ((name,) if not isinstance(data, (dict, list)) or not data else ()))
    return leaves
