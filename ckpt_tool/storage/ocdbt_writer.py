"""A new OCDBT database written by ckpt into a local directory: data files, B+tree, manifest.

Why not tensorstore's OCDBT driver, which orbax itself writes through: every
commit of that driver writes a new B+tree version and a new root, and its
writes of already-encoded chunks cost far more than the bytes. On the issue's
TPU host (13 cores) tensorstore's OCDBT writes were most of a reshard (orbax's
own save of the 2.3 GiB checkpoint: 5.0-6.7 s, where `cp -r && sync` of it
took 1.9-2.5 s); here, 2.1 GB of encoded chunks written into an OCDBT kvstore
took 4.4 s in one transaction against 0.6 s to copy them.

An output database is written once and read only after it is complete, so it
needs none of the driver's machinery: values larger than the database's
`max_inline_value_bytes` are appended to data files (`d/<random hex>`, one
per writing thread at a time, so threads never share a file) with pwritev;
smaller ones stay in memory and go inline into the leaf nodes, as the driver
does. `finish()` fsyncs the data files, then writes the whole B+tree into one
more data file and the single-file manifest last (ocdbt_encode.py). What
tensorstore, orbax and ckpt read is the same either way.

On an object store (gs://, s3://) each data file is one object: staged in a temporary file
while its thread fills it, and uploaded through `Storage.write` (on gs://, checked against the
CRC-32C GCS stored) once sealed, on the closer threads, as many at a time as `upload_bytes`
allows (staged_upload.py), at most SEALED_QUEUED of them waiting. The B+tree's node file and
the manifest are uploaded last, after every data file.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from ..base.errors import CkptError
from .core import Storage
from .local import FileCloser
from .staged_upload import UPLOAD_COPIES, StagedUpload, UploadRoom
from .ocdbt_encode import (BTREE_NODE_MAGIC, Config, DataFile, NodeRef, ValueRef, build_tree, encode, interior_body,
                           manifest)

MANIFEST = "manifest.ocdbt"
DATA_DIR = "d/"
# Values are staged per thread and written this much at a time: a layout for 256 devices cuts
# 2.3 GiB into 40,000 chunks, and a write (and its page-cache bookkeeping) per chunk cost more than
# the bytes. Pieces this large or larger go to the file as they are.
STAGE_BYTES = 1 << 20
# A thread's data file is sealed once it holds this much: fsynced on a closer thread while the
# copy goes on, so that the syncs overlap the work instead of all waiting for the end (on the
# TPU VM the final fsyncs of 2.3 GiB took 0.7 s of a 4.6 s reshard). Each copy thread fills a
# file of its own, so nothing is sealed before every thread has written this much: at 64 MiB and
# 13 threads, 832 MiB of the 2.3 GiB, and the fsyncs ran 1.5 s past the last chunk there. At
# 16 MiB that reshard took 2.96 s against 3.38 s (medians of 3, interleaved, bench/tpu_host.py
# MODE=ab); 8 closer threads instead of 4 gained nothing more then. (Now there is one per copy
# worker, FileCloser: once a profile showed 4 of them busy to the end of a convert.)
SEAL_BYTES = 16 << 20
# On an object store: sealed data files staged and waiting for (or in) their upload, at most.
SEALED_QUEUED = 8


def new_data_file(base_path: str = "") -> DataFile:
    """A data file name as tensorstore's driver makes them: d/ and 128 random bits in hex."""
    return DataFile(base_path, DATA_DIR + os.urandom(16).hex())


class _FileSink(Protocol):
    """Where a data file's bytes go: a local file (LocalFileWriter), or an object's staging
    (StagedUpload), which close() uploads."""

    def write_at(self, offset: int, parts: Iterable[Any], *, padded: bool = True) -> None: ...
    def close(self) -> None: ...
    def discard(self) -> None: ...


class _OpenDataFile:
    """A data file one thread appends to, through a staging buffer of its own."""

    __slots__ = ("file", "local", "cursor", "stage", "staged", "stage_start")

    def __init__(self, file: DataFile, local: _FileSink) -> None:
        self.file = file
        self.local = local
        self.cursor = 0  # the end of what was appended (staged or written)
        self.stage = bytearray(STAGE_BYTES)
        self.staged = 0
        self.stage_start = 0

    def write(self, piece: memoryview) -> None:
        n = piece.nbytes
        if self.staged and self.staged + n > STAGE_BYTES:
            self.flush()
        if n >= STAGE_BYTES:
            self.local.write_at(self.cursor, [piece], padded=False)
        else:
            if not self.staged:
                self.stage_start = self.cursor
            self.stage[self.staged : self.staged + n] = piece
            self.staged += n
        self.cursor += n

    def flush(self) -> None:
        if self.staged:
            self.local.write_at(self.stage_start, [memoryview(self.stage)[: self.staged]], padded=False)
            self.staged = 0

    def close(self) -> None:
        """Flush the staged bytes, fsync, close."""
        self.flush()
        self.local.close()


class OcdbtDatabaseWriter:
    """Writes one new OCDBT database at the root of `storage` (a local directory, or an object
    store's prefix).

    `put` is thread-safe; `finish` and `discard` are called once, from one thread, after the puts.
    `upload_bytes`: on an object store, the most memory the uploads of sealed data files hold at
    once (UploadRoom: one is always let through), and so what a data file holds at most (half of
    it: its bytes and tensorstore's copy); unused on a local directory.
    """

    def __init__(self, storage: Storage, config: Config, *, target_data_file_size: int = 2**31,
                 upload_bytes: int = 8 * SEAL_BYTES) -> None:
        if not storage.capabilities.writable:
            raise CkptError(f"{storage.backend_kind} storage is read-only", storage.url)
        self._storage = storage
        self._room = UploadRoom(upload_bytes)
        self.config = config
        self._target = max(1, min(int(target_data_file_size), SEAL_BYTES))
        if not storage.capabilities.local_files:
            # an upload holds its file twice (staged_upload.py): files small enough that one fits in
            # `upload_bytes`, so that a small --memory is kept (one is let through whatever its size)
            self._target = max(1 << 20, min(self._target, int(upload_bytes) // UPLOAD_COPIES))
        self._lock = threading.Lock()
        # seals handing their file to the closer, outside the lock: discard() waits for them (below)
        self._submitting = 0
        self._submitted = threading.Condition(self._lock)
        self._entries: list[tuple[bytes, bytes | ValueRef]] = []
        self._files: list[_OpenDataFile] = []  # the data files open, for finish / discard
        self._closer = FileCloser("ckpt-ocdbt-close")  # seals full files, and closes the rest at the end
        # on an object store, sealed files not yet uploaded, at most: a copy thread that seals one
        # more waits, so that what is staged on local disk stays bounded when the network is slower
        # than the copy (else the whole output could sit in TMPDIR)
        self._queued = None if storage.capabilities.local_files else threading.BoundedSemaphore(SEALED_QUEUED)
        self._local = threading.local()
        self._state = "writing"

    @property
    def entries(self) -> list[tuple[bytes, bytes | ValueRef]]:
        """What was put so far, in put order (values stored out of line as where they lie)."""
        with self._lock:
            return list(self._entries)

    def put(self, key: bytes, value: Any) -> None:
        """Store `value` (a bytes-like object) under `key`: in line when small, else appended to this
        thread's data file."""
        view = memoryview(value).cast("B")
        if view.nbytes <= self.config.max_inline_value_bytes:
            entry: tuple[bytes, bytes | ValueRef] = (key, view.tobytes())
        else:
            entry = (key, self._append([view], view.nbytes))
        with self._lock:
            if self._state != "writing":
                raise CkptError(f"write after the OCDBT database is {self._state}", self._storage.url)
            self._entries.append(entry)

    def put_many(self, items: Iterable[tuple[bytes, list[Any]]]) -> None:
        """Store each value, the concatenation of its parts, under its key (a block of chunks): in
        line when small, else appended to this thread's data file; one lock for all, and as little
        Python per value as it takes (a 256-device layout puts 40,000)."""
        limit = self.config.max_inline_value_bytes
        entries: list[tuple[bytes, bytes | ValueRef]] = []
        for key, parts in items:
            views = [memoryview(p).cast("B") for p in parts]
            n = views[0].nbytes if len(views) == 1 else sum(v.nbytes for v in views)
            entries.append((key, b"".join(views) if n <= limit else self._append(views, n)))
        with self._lock:
            if self._state != "writing":
                raise CkptError(f"write after the OCDBT database is {self._state}", self._storage.url)
            self._entries.extend(entries)

    def put_parts(self, key: bytes, parts: Iterable[Any]) -> None:
        """Store the concatenation of `parts` under `key` without joining them first (a zarr v3 shard:
        the encoded chunk, then its index)."""
        self.put_many([(key, list(parts))])

    def put_stream(self, key: bytes, fill: Callable[[Callable[[Any], None]], object]) -> int:
        """Store out of line the value `fill(write)` produces piece by piece (a chunk compressed as
        a stream: no buffer of its whole size); returns its length."""
        f = self._data_file(0)
        start = f.cursor

        def write(piece: Any) -> None:
            f.write(memoryview(piece).cast("B"))

        fill(write)
        ref = ValueRef(f.file, start, f.cursor - start)
        with self._lock:
            if self._state != "writing":
                raise CkptError(f"write after the OCDBT database is {self._state}", self._storage.url)
            self._entries.append((key, ref))
        return ref.length

    def _append(self, views: list[memoryview], length: int) -> ValueRef:
        """The `length` bytes of `views`, back to back at the end of this thread's data file."""
        f = self._data_file(length)
        start = f.cursor
        for v in views:
            f.write(v)
        return ValueRef(f.file, start, f.cursor - start)

    def _data_file(self, length: int) -> _OpenDataFile:
        """This thread's data file, a new one once the value would take it past the target size."""
        if self._state != "writing":  # (this thread's file may be closed already)
            raise CkptError(f"write after the OCDBT database is {self._state}", self._storage.url)
        f: _OpenDataFile | None = getattr(self._local, "file", None)
        if f is None or (f.cursor and f.cursor + length > self._target):
            if f is not None:
                self._seal(f)
            f = self._open_data_file()
            self._local.file = f
        return f

    def _seal(self, f: _OpenDataFile) -> None:
        """Flush, fsync and close a full data file on a closer thread (on an object store: upload it,
        once fewer than SEALED_QUEUED wait for their upload)."""
        queued = self._queued
        close = f.close
        if queued is not None:
            queued.acquire()

            def close() -> None:
                try:
                    f.close()
                finally:
                    queued.release()

        with self._lock:
            if self._state != "writing":  # (discarded meanwhile: discard() closes what it finds)
                if queued is not None:
                    queued.release()
                return
            self._files.remove(f)
            self._submitting += 1
        # Handed over outside the lock: the closer's first submits start its threads, and a thread's
        # start waits for the GIL among 13 busy copy threads. Under the lock every put waited for
        # that too: 4.1 of the 30 busy thread-seconds of a 1.5 GiB reshard on a TPU VM.
        try:
            self._closer.submit(close)
        finally:
            with self._lock:
                self._submitting -= 1
                self._submitted.notify_all()

    def _open_data_file(self) -> _OpenDataFile:
        file = new_data_file()
        local = _sink(self._storage, file.path, self._room)
        opened = _OpenDataFile(file, local)
        with self._lock:
            if self._state != "writing":
                local.discard()
                raise CkptError(f"write after the OCDBT database is {self._state}", self._storage.url)
            self._files.append(opened)
        return opened

    def close_data_files(self) -> None:
        """fsync and close every data file (several at a time); no more puts of out-of-line values."""
        with self._lock:
            files, self._files = self._files, []
            self._submitted.wait_for(lambda: not self._submitting)  # (a seal still handing over its file)
        for f in files:
            self._closer.submit(f.close)
        self._closer.wait()

    def finish(self, *, commit_time_ns: int | None = None) -> NodeRef:
        """Close the data files, then write the B+tree over every entry put and, last, the
        manifest, which makes the database exist. Returns the B+tree's root."""
        with self._lock:
            if self._state != "writing":
                raise CkptError(f"finish() on an OCDBT database that is {self._state}", self._storage.url)
            self._state = "finishing"
        try:
            self.close_data_files()
            entries = sorted(self.entries, key=lambda e: e[0])
            node_file = new_data_file()
            content, root = build_tree(entries, self.config, node_file)
            _write_tree(self._storage, self.config, node_file, content, root, commit_time_ns)
        except ValueError as exc:  # repeated keys: a writer bug, said as one line
            raise CkptError(f"cannot write the OCDBT database: {exc}", self._storage.url) from None
        self._state = "finished"
        return root

    def discard(self) -> None:
        """Close the data files without syncing (the output is being thrown away)."""
        with self._lock:
            files, self._files = self._files, []
            self._state = "discarded"
            # a seal handing its file over meanwhile: the wait below must see that close too, so that
            # nothing is written (uploaded) after the caller removed the output
            self._submitted.wait_for(lambda: not self._submitting)
        try:
            self._closer.wait()
        except Exception:  # noqa: BLE001 - the output is being thrown away: a failed seal changes nothing
            pass
        for f in files:
            f.local.discard()


def write_database_over(storage: Storage, config: Config, subtree: NodeRef, *,
                        commit_time_ns: int | None = None) -> None:
    """A database at the root of `storage` whose B+tree is another's, `subtree` (its node file
    named from here): orbax's merged root database over one process's, without copying its tree.

    Its root is one interior node over `subtree` (in its own d/, as orbax's root database has
    one). The format's transitive paths make this exact: a node reached through data file
    base_path + relative_path resolves its own table under base_path (format document, "Data file
    table format"), so the process's tree, read from the root, finds the process's data files."""
    node_file = new_data_file()
    node = encode(BTREE_NODE_MAGIC, interior_body(subtree.height + 1, [subtree]), config)
    root = NodeRef(node_file, 0, len(node), subtree.height + 1, subtree.first_key, subtree.num_keys,
                   len(node) + subtree.num_tree_bytes, subtree.num_indirect_value_bytes)
    _write_tree(storage, config, node_file, node, root, commit_time_ns)


def write_database(storage: Storage, config: Config, entries: list[tuple[bytes, bytes | ValueRef]], *,
                   commit_time_ns: int | None = None) -> NodeRef:
    """A new database at the root of `storage` over `entries` (keys unique, any order), whose values
    stored out of line stay where they lie (in other databases' data files: orbax's merged root
    over the per-process ones, ocdbt_entries.py): only its B+tree's node file and its manifest are
    written, the same way finish() writes a database's (on an object store, each through
    Storage.write, so checked on gs://). Returns the B+tree's root."""
    entries = sorted(entries, key=lambda e: e[0])
    for i in range(1, len(entries)):
        if entries[i - 1][0] == entries[i][0]:
            key = entries[i][0].decode("utf-8", "surrogateescape")
            raise CkptError(f"cannot write the OCDBT database: key {key!r} is in two of the databases merged",
                            storage.url)
    node_file = new_data_file()
    try:
        content, root = build_tree(entries, config, node_file)
    except ValueError as exc:  # no entry at all
        raise CkptError(f"cannot write the OCDBT database: {exc}", storage.url) from None
    _write_tree(storage, config, node_file, content, root, commit_time_ns)
    return root


def _sink(storage: Storage, key: str, room: UploadRoom) -> _FileSink:
    """A new data file at `key`: a local file, or on an object store an object staged for upload."""
    local = storage.create_local_file(key)
    return local if local is not None else StagedUpload(storage, key, room)


def _write_tree(storage: Storage, config: Config, node_file: DataFile, content: bytes, root: NodeRef,
                commit_time_ns: int | None) -> None:
    """The encoded nodes into their data file (fsynced, or uploaded), then the manifest naming
    `root`, last."""
    if not storage.capabilities.local_files:
        # one upload of bytes held already: Storage.write (checked on gs://), then the manifest
        storage.write(node_file.path, content)
        storage.write(MANIFEST, manifest(config, root, commit_time_ns or time.time_ns()))
        return
    local = storage.create_local_file(node_file.path)
    if local is None:
        raise CkptError("not a local directory", storage.url)
    try:
        local.write_at(0, [content], padded=False)
    except BaseException:
        local.discard()
        raise
    local.close()
    storage.write(MANIFEST, manifest(config, root, commit_time_ns or time.time_ns()))
