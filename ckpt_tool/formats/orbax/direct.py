"""Orbax's OCDBT databases written by ckpt itself, chunks encoded by ckpt.

The Orbax writer (write.py) writes each process's database through this
module, on a local directory and on gs:// and s3:// alike: chunks go from the
copy thread to a data file (storage/ocdbt_writer.py says why, with the times
measured); on an object store each data file is staged on local disk and
uploaded whole through Storage.write once sealed, so every object of the
output passes through ckpt (and is checked on GCS: storage/gcs_verify.py), the
root database the primary merges from several processes' ones included
(merged_entries, write_merged_root).
CKPT_OCDBT_WRITER=tensorstore hands the chunks to tensorstore's zarr and OCDBT
drivers instead, as orbax writes them. What lands in the store is what
tensorstore's zarr driver writes for orbax:

- zarr v2: each chunk in C order, its full chunk shape (an edge chunk padded
  with zeros, as tensorstore pads it), one zstd frame at orbax's level 1;
- zarr v3 (orbax's one-chunk shards): the chunk's bytes as one zstd frame at
  level 3, then the shard index (offset, length as uint64le) and its CRC-32C;
- the zarr metadata (`.zarray` / `zarr.json`) is what tensorstore writes for
  each array, byte for byte (zarr_metadata.py writes it for orbax's specs, and
  asks tensorstore once per kind of array for any other);
- a 0-d value is one chunk like any other (its element's bytes, encoded as
  above: tensorstore's chunk byte for byte), put under the key tensorstore
  names it ("0" in zarr v2, "c" in zarr3). Where its metadata came from
  tensorstore (a spec zarr_metadata.generate does not know, or
  CKPT_ZARR_METADATA=tensorstore) tensorstore writes it, in memory, and the
  keys are copied, as before.

tests/formats/orbax/test_orbax_direct.py reads every output back through tensorstore and
orbax, and compares it with the tensorstore-written one.
"""
from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import zstandard

from ...machinery.arrays import stored_chunks
from ...machinery.arrays.reading import block_chunk_keys, chunk_key
from ...base.bufferpool import POOL
from ...base.checksum import crc32c
from ...base.errors import CkptError
from ...core.model import Region
from ...storage import Storage, ts_error_text
from ...storage.ocdbt_encode import Config, DataFile, NodeRef, ValueRef
from ...storage.ocdbt_writer import OcdbtDatabaseWriter, write_database, write_database_over
from . import zarr_metadata

if TYPE_CHECKING:
    import tensorstore as ts

# orbax's zstd levels (zarr_metadata.orbax_metadata's compressors)
ZARR2_LEVEL = 1
ZARR3_LEVEL = 3
# Chunks from this size up are compressed as a stream, a MiB of output at a time, into the data
# file's staging buffer: compress() returns a new buffer of the whole encoded chunk, and on a TPU
# VM's sandboxed kernel (gVisor) every first touch of fresh memory is a fault the sandbox serves
# (1 GiB filled in 3.2 s fresh, 1.6 s reused). Smaller chunks are compressed in one call.
STREAM_MIN_BYTES = 1 << 20
STREAM_PIECE_BYTES = 1 << 20


# the object stores whose databases ckpt writes itself (memory:// stays with tensorstore's driver)
OBJECT_STORE_DRIVERS = ("gcs", "s3")


def wanted(storage: Storage) -> bool:
    """Whether the Orbax writer writes its databases itself here: local roots, gs:// and s3://,
    unless CKPT_OCDBT_WRITER=tensorstore (the switch back to tensorstore's driver)."""
    if not wanted_here():
        return False
    return storage.capabilities.local_files or storage.kvstore_spec().get("driver") in OBJECT_STORE_DRIVERS


def wanted_here() -> bool:
    """Whether the writer writes the databases itself (CKPT_OCDBT_WRITER)."""
    return os.environ.get("CKPT_OCDBT_WRITER", "ckpt") != "tensorstore"


def encoding_for(name: str, spec: dict[str, Any], zarr3: bool) -> stored_chunks.Encoding | None:
    """How chunks of the array `spec` (a tensorstore spec without kvstore) are stored: from the
    metadata tensorstore writes for it (zarr_metadata.py), as ProcessDatabase learns it."""
    return stored_chunks.encoding_of(json.loads(zarr_metadata.metadata({name: spec}, zarr3)[name]), zarr3)


def config(ocdbt_config: dict[str, Any]) -> Config:
    """A new database's config from the one orbax asks tensorstore for."""
    return Config.new(max_inline_value_bytes=int(ocdbt_config["max_inline_value_bytes"]),
                      max_decoded_node_bytes=int(ocdbt_config["max_decoded_node_bytes"]))


def compress_rows(compressor: zstandard.ZstdCompressor, rows: np.ndarray) -> list[Any]:
    """Each row of `rows` (a C-contiguous 2-D uint8 array) as its own zstd frame: the bytes
    `compressor.compress(row)` makes, as bytes-like objects.

    All rows in one call where python-zstandard's C backend has multi_compress_to_buffer. On the
    TPU VM (13 copy threads), a 256-device layout compressing its blocks row by row spent 35 of
    its 45 busy thread-seconds on that one line, where compressing the same 2.3 GiB in large
    pieces takes 8 CPU-seconds there: each of 40,000 calls gave up the GIL and waited to take it
    back from a dozen other threads. One call per block takes it back once."""
    n, width = rows.shape
    multi = getattr(compressor, "multi_compress_to_buffer", None)
    if multi is None or n < 2 or width == 0:
        return [compressor.compress(row.data) for row in rows]
    segments = np.empty((n, 2), dtype="<u8")  # (offset, length) of each row, as BufferWithSegments takes them
    segments[:, 0] = np.arange(n, dtype=np.uint64) * np.uint64(width)
    segments[:, 1] = width
    try:
        frames = multi(zstandard.BufferWithSegments(rows.reshape(-1).data, segments.tobytes()), threads=0)
    except NotImplementedError:  # (a backend without it: the cffi one)
        return [compressor.compress(row.data) for row in rows]
    return [frames[i] for i in range(n)]


class _Compressors(threading.local):
    def __init__(self) -> None:
        self.by_level = {level: zstandard.ZstdCompressor(level=level) for level in (ZARR2_LEVEL, ZARR3_LEVEL)}


class ProcessDatabase:
    """One process's database of an Orbax output: chunks encoded and put as they come."""

    def __init__(self, storage: Storage, *, zarr3: bool, ocdbt_config: dict[str, Any],
                 target_data_file_size: int, upload_bytes: int) -> None:
        """upload_bytes: on an object store, the memory uploads of data files may hold at once."""
        self.zarr3 = zarr3
        self.db = OcdbtDatabaseWriter(storage, config(ocdbt_config), target_data_file_size=target_data_file_size,
                                      upload_bytes=upload_bytes)
        self._ocdbt_config = ocdbt_config
        self.root: NodeRef | None = None  # the B+tree's root, once finished
        self._compressors = _Compressors()
        self._memory: ts.Context | None = None  # the in-memory arrays the metadata comes from
        self._meta: dict[str, dict[str, Any]] = {}  # leaf name -> its spec (memory kvstore)
        self._encodings: dict[str, stored_chunks.Encoding | None] = {}  # leaf name -> how its chunks are stored
        self._scalars: dict[str, stored_chunks.Encoding] = {}  # 0-d arrays whose chunk is encoded here

    # -- what tensorstore makes: metadata and 0-d values -------------------------------------------

    def add_metadata(self, specs: dict[str, dict[str, Any]], where: str, *, put: bool = True) -> None:
        """Put the metadata tensorstore writes for every array (name -> tensorstore spec without
        kvstore) (put=False: only learn each array's encoding). A 0-d array whose metadata
        zarr_metadata.generate writes gets its chunk from write_scalar, encoded here; any other
        is created in memory, where write_scalar has tensorstore write its one chunk."""
        scalars = {name: spec for name, spec in specs.items() if not spec["metadata"].get("shape")}
        if zarr_metadata.generated_here():
            for name, spec in scalars.items():
                made = zarr_metadata.generate(spec, self.zarr3)
                encoding = stored_chunks.encoding_of(json.loads(made), self.zarr3) if made is not None else None
                if encoding is not None:
                    self._scalars[name] = encoding
            scalars = {name: spec for name, spec in scalars.items() if name not in self._scalars}
        if scalars:
            self._tensorstore_scalars(scalars, where, put)
        arrays = {name: spec for name, spec in specs.items() if name not in scalars}
        key = zarr_metadata.metadata_key(self.zarr3)
        for name, data in (zarr_metadata.metadata(arrays, self.zarr3) if arrays else {}).items():
            self._encodings[name] = stored_chunks.encoding_of(json.loads(data), self.zarr3)
            if put:
                self.db.put(f"{name}/{key}".encode("utf-8", "surrogateescape"), data)

    def _tensorstore_scalars(self, scalars: dict[str, dict[str, Any]], where: str, put: bool) -> None:
        import tensorstore as ts  # (only for a 0-d array whose metadata zarr_metadata does not write)

        self._memory = ts.Context()
        futures = {}
        for name, spec in scalars.items():
            mem = {**spec, "kvstore": {"driver": "memory", "path": name + "/"}}
            self._meta[name] = mem
            futures[name] = ts.open(mem, create=True, context=self._memory)
        try:
            for fut in futures.values():
                fut.result()
        except Exception as exc:  # noqa: BLE001 - tensorstore refused orbax's own metadata
            raise CkptError(f"cannot create the output array's metadata: {ts_error_text(exc)}", where) from exc
        self._copy_memory_keys(where, put=put)

    def write_scalar(self, name: str, value: np.ndarray, where: str) -> None:
        """A 0-d value: its one chunk encoded here where its metadata was (add_metadata), else
        written by tensorstore in memory and copied."""
        if name in self._scalars:
            if value.shape != ():
                raise CkptError("value is not 0-d", where)
            if value.dtype.byteorder == ">":  # (zarr's bytes are little-endian, as numpy's here)
                value = value.astype(value.dtype.newbyteorder("<"))
            self._put_chunk(chunk_key(name, (), self.zarr3, {}), value, ())
            return
        if self._memory is None or name not in self._meta:
            raise CkptError("value is not in the plan given to begin()", where)
        import tensorstore as ts

        try:
            store = ts.open(self._meta[name], open=True, context=self._memory).result()
            store.write(value).result()
        except Exception as exc:  # noqa: BLE001
            raise CkptError(f"cannot write: {ts_error_text(exc)}", where) from exc
        self._copy_memory_keys(where, prefix=name + "/", skip_metadata=True)

    def _copy_memory_keys(self, where: str, prefix: str = "", skip_metadata: bool = False, put: bool = True) -> None:
        import tensorstore as ts

        kv = ts.KvStore.open({"driver": "memory", "path": prefix}, context=self._memory).result()
        keys = [k for k in kv.list().result() if not (skip_metadata and k in (b".zarray", b"zarr.json"))]
        reads = [kv.read(key) for key in keys]  # (all at once: one at a time took 0.3 s for 158 arrays)
        for key, fut in zip(keys, reads):
            got = fut.result()
            if got.state != "value":
                raise CkptError(f"tensorstore lost the in-memory key {key!r}", where)
            name, _, rest = (prefix.encode() + bytes(key)).decode("utf-8", "surrogateescape").rpartition("/")
            if rest in (".zarray", "zarr.json"):
                self._encodings[name] = stored_chunks.encoding_of(json.loads(bytes(got.value)), self.zarr3)
            if put:
                self.db.put(prefix.encode() + bytes(key), bytes(got.value))
            if skip_metadata:
                kv.delete_range(ts.KvStore.KeyRange(key, key + b"\x00")).result()

    # -- chunks, encoded here ---------------------------------------------------------------------

    def encoding(self, name: str) -> stored_chunks.Encoding | None:
        """How the array's chunks are stored (from the metadata tensorstore made), None if not known."""
        return self._encodings.get(name)

    def put_stored(self, name: str, index: tuple[int, ...], copy: Callable[[Callable[[bytes], None]], int]) -> None:
        """The chunk at grid `index` as the stored bytes of a source chunk of the same encoding,
        which `copy(write)` hands over piece by piece (into the data file, no buffer of its size)."""
        self.db.put_stream(chunk_key(name, index, self.zarr3, {}).encode(), copy)

    def write_region(self, name: str, chunk_shape: tuple[int, ...], region: Region, data: np.ndarray,
                     zmeta: dict[str, Any], *, stored: stored_chunks.StoredChunk | None = None) -> bool:
        """Every whole chunk of `region` (one chunk, or a block of whole chunks of the grid).

        `stored`: where `data`'s bytes are stored already (stored_chunks.recall): one chunk of
        the same encoding and grid position is stored as those bytes, not encoded again. Returns
        whether it was."""
        first = [r.start // c for r, c in zip(region, chunk_shape)]
        counts = [-(-(r.stop - r.start) // c) for r, c in zip(region, chunk_shape)]
        if (stored is not None and stored.index == tuple(first) and all(n == 1 for n in counts)
                and stored.encoding == self._encodings.get(name)):
            self.db.put(chunk_key(name, tuple(first), self.zarr3, zmeta).encode(), stored.read())
            return True
        if math.prod(counts) > 1 and tuple(data.shape) == tuple(n * c for n, c in zip(counts, chunk_shape)):
            self._put_block(name, chunk_shape, first, counts, data, zmeta)
            return False
        for offsets in np.ndindex(*counts):
            index = tuple(f + o for f, o in zip(first, offsets))
            lo = [i * c - r.start for i, c, r in zip(index, chunk_shape, region)]
            part = data[tuple(slice(a, min(a + c, n)) for a, c, n in zip(lo, chunk_shape, data.shape))]
            self._put_chunk(chunk_key(name, index, self.zarr3, zmeta), part, chunk_shape)
        return False

    def _put_block(self, name: str, chunk_shape: tuple[int, ...], first: list[int], counts: list[int],
                   data: np.ndarray, zmeta: dict[str, Any]) -> None:
        """A block of whole chunks (none at an edge), with the per-chunk work batched: a layout for
        256 devices hands over 40,000 small chunks in blocks, and a chunk's Python work holds the
        GIL the copy threads share. One copy lays the chunks out one after another, then each is
        compressed (zstandard releases the GIL) and all are put at once."""
        rank = len(chunk_shape)
        split = data.reshape(tuple(x for n, c in zip(counts, chunk_shape) for x in (n, c)))
        chunks = POOL.empty(tuple(counts) + tuple(chunk_shape), data.dtype)
        _bits(chunks)[...] = _bits(split).transpose(tuple(range(0, 2 * rank, 2)) + tuple(range(1, 2 * rank, 2)))
        flat = chunks.reshape(math.prod(counts), -1).view(np.uint8)
        encoded = compress_rows(self._compressors.by_level[ZARR3_LEVEL if self.zarr3 else ZARR2_LEVEL], flat)
        del flat, chunks  # (the pooled buffer is free again)
        keys = [key.encode() for key in block_chunk_keys(name, tuple(first), tuple(counts), self.zarr3, zmeta)]
        if self.zarr3:
            self.db.put_many(zip(keys, ([e, _shard_index(len(e))] for e in encoded)))
        else:
            self.db.put_many(zip(keys, ([e] for e in encoded)))

    def _put_chunk(self, key: str, part: np.ndarray, chunk_shape: tuple[int, ...]) -> None:
        buf = None
        if tuple(part.shape) == tuple(chunk_shape) and part.flags.c_contiguous:
            raw = part.reshape(-1).view(np.uint8)
        else:  # an edge chunk (padded with zeros, as tensorstore pads it) or a piece of a block
            buf = POOL.empty(tuple(chunk_shape), part.dtype)
            if tuple(part.shape) != tuple(chunk_shape):
                buf.fill(0)
            _bits(buf[tuple(slice(0, n) for n in part.shape)])[...] = _bits(part)
            raw = buf.reshape(-1).view(np.uint8)
        compressor = self._compressors.by_level[ZARR3_LEVEL if self.zarr3 else ZARR2_LEVEL]
        if raw.nbytes >= STREAM_MIN_BYTES:
            def fill(write: Callable[[Any], None]) -> None:
                # the frame declares its size, as compress() makes it (and tensorstore's writer)
                chunker = compressor.chunker(size=raw.nbytes, chunk_size=STREAM_PIECE_BYTES)
                length = 0
                for piece in chunker.compress(raw.data):
                    write(piece)
                    length += len(piece)
                for piece in chunker.finish():  # (called once compress's pieces are all taken)
                    write(piece)
                    length += len(piece)
                if self.zarr3:  # the shard index after the chunk: where it lies in the shard
                    write(_shard_index(length))

            self.db.put_stream(key.encode(), fill)
            return
        encoded = compressor.compress(raw.data)
        del raw, buf  # (the pooled buffer is free again once nothing refers to it)
        if self.zarr3:
            self.db.put_parts(key.encode(), [encoded, _shard_index(len(encoded))])
        else:
            self.db.put(key.encode(), encoded)

    # -- the end ------------------------------------------------------------------------------------

    def finish(self) -> None:
        if not self.db.entries:
            # a process that owned no chunk (more processes than chunks) writes no database, as none
            # is made through tensorstore's driver: the merge skips it, the chunk check counts all
            self.db.discard()
            return
        self.root = self.db.finish()

    def discard(self) -> None:
        self.db.discard()

    def keys(self) -> list[str]:
        """Every key put."""
        return [key.decode("utf-8", "surrogateescape") for key, _ in self.db.entries]

    def write_root(self, storage: Storage, base_path: str) -> None:
        """The root database (orbax's merge of the per-process ones) when this is the only process:
        a B+tree over this database's, reached under `base_path` (its directory)."""
        if self.root is None:
            raise CkptError("the process's database is not finished", storage.url)
        node = replace(self.root, file=DataFile(base_path + self.root.file.base_path, self.root.file.relative_path))
        write_database_over(storage, config(self._ocdbt_config), node)


    def merged_entries(self, storage: Storage, own: str, others: list[str]
                       ) -> list[tuple[bytes, bytes | ValueRef]]:
        """Every entry of the root database orbax's merge makes of several processes' databases:
        this one's (under `own`, its directory from the step's root, with a trailing "/"), from
        memory, and each of `others`' read back from storage (ocdbt_entries.py), every value stored
        out of line named where it lies in the process's database (`ocdbt.process_<i>/d/...`)."""
        files: dict[DataFile, DataFile] = {}

        def moved(file: DataFile) -> DataFile:
            # the process database's own base path, seen from the step's root (as tensorstore's merge names it)
            got = files.get(file)
            if got is None:
                got = files[file] = DataFile(own + file.base_path, file.relative_path)
            return got

        entries: list[tuple[bytes, bytes | ValueRef]] = [
            (key, ValueRef(moved(value.file), value.offset, value.length) if isinstance(value, ValueRef) else value)
            for key, value in self.db.entries
        ]
        from ...storage.ocdbt_entries import database_entries  # (a merge of several processes' only)

        for database in others:
            entries.extend(database_entries(storage, database))
        return entries

    def write_merged_root(self, storage: Storage, entries: list[tuple[bytes, bytes | ValueRef]]) -> None:
        """The root database over `entries` (merged_entries): its B+tree's node file and manifest
        written by ckpt, through Storage.write on an object store, as each process's own are."""
        write_database(storage, config(self._ocdbt_config), entries)


def _bits(a: np.ndarray) -> np.ndarray:
    """`a` as unsigned integers of its item size, where there is one: numpy copies those without
    the per-item calls a custom dtype's copy takes (ml_dtypes' bfloat16, float8)."""
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def _shard_index(length: int) -> bytes:
    """A one-chunk shard's index: the chunk at offset 0 of `length` bytes, and its CRC-32C."""
    index = struct.pack("<QQ", 0, length)
    return index + struct.pack("<I", crc32c(index))


