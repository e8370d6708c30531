"""Storage: one interface over a checkpoint root, whatever the root is.

Every reader and writer goes through a Storage. It holds one backend, the
kind of root it is (backend.py: local_backend.py, kvstore_backend.py,
ocdbt_view.py), and does for every kind alike what does not depend on it:
keys are checked before any backend sees them (no `..`, no absolute key;
the backend's own containment check next), the root's listing is
remembered, every value read is logged, byte ranges are checked, and
failures of tensorstore calls made elsewhere are worded as one line. See
the package docstring.
"""
from __future__ import annotations

import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable

from ..base.errors import CkptError
from ..base.pagecache import DirectoryDropper
from . import ocdbt_bulk
from .backend import Backend, Capabilities, PendingReads, Reads, read_context, shared_context
from .containment import _check_relative
from .kvstore_backend import KvstoreBackend
from .local import LocalFileWriter
from .local_backend import LocalBackend
from .ocdbt_view import OcdbtBackend, OcdbtBulkReads
from .remote import _kvstore_spec

if TYPE_CHECKING:
    import tensorstore as ts  # (imported when a kvstore or context is first made: backend.py)

__all__ = ["PendingReads", "OcdbtBulkReads", "ReadLog", "Storage", "_CONTEXT", "_READ_CONTEXT"]


def __getattr__(name: str) -> Any:
    # backend.py's contexts under their old names, made when first asked for
    if name in ("_CONTEXT", "_READ_CONTEXT"):
        return shared_context() if name == "_CONTEXT" else read_context()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# (Storage.list shadows the builtin inside the class)
_Keys = list[str]
# size look-ups in flight together on an object store (each is a few one-byte reads)
_SIZE_PROBES_IN_FLIGHT = 32


class ReadLog:
    """Counts reads per key, so tests can prove which values were touched, and the bytes read
    through this Storage (whole values, byte ranges, located OCDBT values): what a process of a
    multi-process run read of its source. (B+tree nodes and what tensorstore reads by itself, as
    when it opens an array, are not counted.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reads: Counter[str] = Counter()
        self.bytes = 0

    def record(self, key: str) -> None:
        with self._lock:
            self.reads[key] += 1

    def record_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def record_many(self, keys: Iterable[str]) -> None:
        with self._lock:
            self.reads.update(keys)


class _CountedReads:
    """Reads whose bytes are added to the log when their result is taken."""

    def __init__(self, reads: Reads, log: ReadLog) -> None:
        self._reads, self._log = reads, log

    def result(self) -> dict[str, bytes | None]:
        out = self._reads.result()
        self._log.record_bytes(sum(len(v) for v in out.values() if v is not None))
        return out


class Storage:
    """A checkpoint root of any kind: local directory, object store, memory store or OCDBT view."""

    def __init__(self, backend: Backend, log: ReadLog | None = None) -> None:
        self.backend = backend
        self.url = backend.url.rstrip("/") if backend.url not in ("/",) else backend.url
        self.log = log or ReadLog()
        # every key under the root, once listed (see list())
        self._listing: list[str] | None = None
        # shortfalls learned together by prefetch_shortfalls (object stores), each handed out once
        # by shortfall(): -1 for none
        self._sizes: dict[str, int | BaseException] = {}
        # when this store was opened (time.monotonic()): failures since then belong to this run
        self.opened_at = time.monotonic()

    # -- opening ---------------------------------------------------------
    @classmethod
    def open(cls, url: str, log: ReadLog | None = None) -> Storage:
        """The existing root at a path or URL, for reading."""
        return cls(_backend_for(url, create=False), log)

    @classmethod
    def create(cls, url: str, log: ReadLog | None = None) -> Storage:
        """Open a destination, creating a local directory if needed."""
        return cls(_backend_for(url, create=True), log)

    def child(self, relpath: str) -> Storage:
        """The storage rooted at a sub-directory (containment checked)."""
        rel = _check_relative(relpath, self.url)
        if not rel:
            return self
        self._check_local_path(rel, want_dir=True)
        child = Storage(self.backend.child(rel), self.log)
        if self._listing is not None:
            # the sub-directory's part of the listing: no new LIST
            cut = len(rel) + 1
            child._listing = [k[cut:] for k in self._listing if k.startswith(rel + "/")]
        return child

    def counted_in(self, log: ReadLog | None = None) -> Storage:
        """This root again, its listing kept (no new LIST), its reads counted in `log` (a new one by
        default): validate's checks of a checkpoint opened already (validate_opened) read through
        it without adding to what the run counts as read of its source (the reader's ReadLog)."""
        again = Storage(self.backend, log)
        again._listing = self._listing
        return again

    def ocdbt(self, subdir: str = "") -> Storage:
        """A view of the OCDBT database whose manifest lives at `subdir`."""
        base = self.child(subdir) if subdir else self
        base.guard()  # the manifest, the data files and (at the root) every process's database
        return Storage(OcdbtBackend.open_database(base.backend), self.log)

    # -- what the root is ------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """What this kind of root can do beyond reading (see backend.Capabilities)."""
        return self.backend.capabilities

    @property
    def backend_kind(self) -> str:
        """The kind of root: "local", "s3", "gcs", "memory" or "ocdbt"."""
        return self.backend.kind

    @property
    def local_root(self) -> str | None:
        """The local directory this root is, or None (object stores, memory, OCDBT views)."""
        return self.backend.local_root

    @property
    def endpoint(self) -> str | None:
        """The remote endpoint (s3://, gs://), or None for local and memory stores."""
        return self.backend.endpoint

    @property
    def context(self) -> ts.Context:
        return shared_context()

    @property
    def read_context(self) -> ts.Context:
        """For opening arrays to read: shares _CONTEXT's resources plus a chunk cache."""
        return read_context()

    def kvstore_spec(self, subpath: str = "") -> dict[str, Any]:
        """The kvstore spec (JSON) for `subpath`, for opening arrays with tensorstore.

        tensorstore then opens files under `subpath` without asking this
        layer, so the directory is checked first (see guard).
        """
        self.guard(subpath)
        rel = _check_relative(subpath, self.url) if subpath else ""
        if subpath.endswith("/") and rel:
            rel += "/"
        return self.backend.spec_for(rel)

    # -- containment -----------------------------------------------------
    def guard(self, subpath: str = "") -> None:
        """Refuse to let tensorstore open anything under `subpath` (local roots opened for reading)
        when it holds a symlink out of the checkpoint, a symlink loop, or a FIFO, device or socket.

        The directory is scanned once per run; later calls cost a lookup.
        """
        self.backend.guard(_check_relative(subpath, self.url) if subpath else "")

    def containment_problems(self) -> list[tuple[str, str]]:
        """Every symlink out, symlink loop and non-regular file under this local root: (path, message).

        Paths are relative to this root; validate reports each as `path-escape`.
        """
        return self.backend.containment_problems()

    # -- reading ---------------------------------------------------------
    def list(self, prefix: str = "") -> list[str]:
        """Every key under `prefix` (recursive), relative to the root, sorted.

        The whole root is listed once per Storage and remembered: a reader
        asks for it several times (format detection, then the reader itself,
        sub-directories of a CheckpointManager root), and on S3 or GCS each
        would be another round of LIST requests. It is a snapshot; writing
        through this Storage forgets it.
        """
        rel = _check_relative(prefix, self.url) if prefix else ""
        if rel and not rel.endswith("/"):
            rel += "/"
        if self._listing is not None:
            return [k for k in self._listing if k.startswith(rel)] if rel else list(self._listing)
        keys = self._list_uncached(rel)
        if not rel:
            self._listing = keys
            return list(keys)
        return keys

    def _list_uncached(self, rel: str) -> _Keys:
        return self.backend.list_keys(rel)

    def listdir(self, prefix: str = "") -> tuple[_Keys, _Keys]:
        """Immediate sub-directories and files under `prefix`."""
        rel = _check_relative(prefix, self.url) if prefix else ""
        start = len(rel) + 1 if rel else 0
        dirs: set[str] = set()
        files: _Keys = []
        for key in self.list(rel):
            rest = key[start:]
            if "/" in rest:
                dirs.add(rest.split("/", 1)[0])
            else:
                files.append(rest)
        return sorted(dirs), files

    def exists(self, key: str) -> bool:
        """Whether a value is stored at `key` (a local entry, even a link, counts)."""
        return self.backend.exists(_check_relative(key, self.url))

    def read(self, key: str) -> bytes:
        """The whole value at `key`; NotFoundError when missing."""
        return self._read(key, None)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the value at `key`; an error if it is shorter."""
        if start < 0 or end < start:
            raise CkptError(f"invalid byte range [{start}, {end})", self._where(key))
        if end == start:
            return b""
        return self._read(key, slice(start, end))

    def read_range_into(self, key: str, start: int, buffer: Any) -> None:
        """Fill the writable `buffer` with the bytes of `key` from `start`; an error if it is shorter.

        The bulk path for tensor data: on a local root the file is read
        straight into the buffer (see LocalBackend.read_into).
        """
        view = memoryview(buffer).cast("B")
        size = view.nbytes
        if start < 0:
            raise CkptError(f"invalid byte range [{start}, {start + size})", self._where(key))
        if size == 0:
            return
        rel = self._value_key(key)
        self.log.record(rel)
        # (containment is the backend's here: a local root checks a file when it first opens it
        # and keeps it open for the next read, which a check per read would make slow again)
        self.backend.read_into(rel, start, view)
        self.log.record_bytes(size)

    def _read(self, key: str, byte_range: slice | None) -> bytes:
        data = self.backend.read(self._read_key(key), byte_range)
        self.log.record_bytes(len(data))
        return data

    def read_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """Read several keys concurrently (None for a missing key)."""
        return self.start_reads(keys).result()

    def start_reads(self, keys: Iterable[str]) -> Reads:
        """Start reading several keys; the caller may do other work before `.result()`."""
        rels = {key: self._checked(key) for key in keys}
        self.log.record_many(rels.values())
        return _CountedReads(self.backend.start_reads(rels), self.log)

    def locate_values(self, keys: _Keys) -> dict[str, bytes | ocdbt_bulk.IndirectValue]:
        """For an OCDBT view: each present key's value if stored in line, else where it lies
        (read it with read_located), by one walk of the B+tree; absent keys are left out.

        Nothing is logged as read: a caller that uses a value records it (log.record)."""
        return self._ocdbt_view().locate_values([self._checked(k) for k in keys])

    def read_located(self, key: str, ref: ocdbt_bulk.IndirectValue, *, pooled: bool = False) -> bytes | memoryview:
        """An out-of-line value of this OCDBT view where locate_values found it. pooled: a local
        value is read into a buffer of bufferpool.POOL (a memoryview), for a caller that lets go
        of it once decoded."""
        value = self._ocdbt_view().read_located({key: ref}, pooled=pooled)[key]
        self.log.record_bytes(len(value))
        return value

    def _ocdbt_view(self) -> OcdbtBackend:
        if not isinstance(self.backend, OcdbtBackend):
            raise ValueError("locate_values needs an OCDBT view")
        return self.backend

    def size(self, key: str) -> int:
        """The size in bytes of the value at `key`, without reading it where possible; NotFoundError when missing.
        (On GCS that is a search of several round trips: a check against what metadata claims asks
        shortfall() instead.)"""
        size = self.backend.size(self._checked(key))
        # a store that cannot tell without reading: the value is read (and logged as read)
        return len(self.read(key)) if size is None else size

    def check_readable(self, key: str) -> None:
        """UnreadableFileError when the file at `key` is there but cannot be opened for reading (a
        local file's permissions); nothing is read. On an object store: nothing, no request."""
        self.backend.check_readable(self._checked(key))

    def shortfall(self, key: str, need: int) -> int | None:
        """None when the value at `key` holds at least `need` bytes, else its size (NotFoundError when
        missing). What a check of "is this data file long enough for what the metadata places in it"
        asks: on an object store one one-byte read answers it, where a size costs a search (GCS)."""
        known = self._sizes.pop(key, None)
        if isinstance(known, BaseException):
            raise known
        if known is None:
            known = self.backend.shortfall(self._checked(key), need)
        return None if known == -1 or (known is not None and known >= need) else known

    def prefetch_shortfalls(self, needs: dict[str, int]) -> None:
        """Ask shortfall() of many values at once, where each costs a round trip (object stores): the
        next shortfall() of each key answers from here (once). A local root stats each file when
        asked: nothing to do here."""
        if self.local_root is not None or len(needs) < 2:
            return

        def one(item: tuple[str, int]) -> int | BaseException:
            try:
                short = self.backend.shortfall(self._checked(item[0]), item[1])
                return -1 if short is None else short
            except (CkptError, OSError) as exc:
                return exc

        with ThreadPoolExecutor(max_workers=min(_SIZE_PROBES_IN_FLIGHT, len(needs)),
                                thread_name_prefix="ckpt-size") as pool:
            self._sizes.update(zip(needs, pool.map(one, needs.items())))

    def stat(self, key: str) -> tuple[int, float | None]:
        """(size in bytes, modification time) of the value at `key`.

        The time is known on local roots only: tensorstore's S3/GCS drivers
        do not return an object's time, so there it is None and the size
        costs a request (see size). The key is checked for its form only: a
        local root looks at the entry itself, following no link.
        """
        return self.backend.stat(_check_relative(key, self.url))

    # -- writing ---------------------------------------------------------
    def _writable_key(self, key: str) -> str:
        rel = _check_relative(key, self.url)
        if not self.capabilities.writable:
            raise CkptError(f"{self.backend_kind} storage is read-only", self.url)
        self._listing = None
        self._sizes.clear()
        return rel

    def delete(self, key: str) -> None:
        """Remove one value (missing is fine)."""
        self.backend.delete(self._writable_key(key))

    def write(self, key: str, data: bytes | bytearray) -> None:
        """Write a whole value (the file driver fsyncs it before returning)."""
        rel = self._writable_key(key)
        if not rel:
            raise CkptError("empty key", self.url)
        self.backend.write(rel, data)

    def create_local_file(self, key: str, *, direct: bool | None = None) -> LocalFileWriter | None:
        """A new file at `key` for writing at known offsets, on local roots only (else None).

        The bulk path for DCP data files: archives go from the caller's arrays
        to the file with pwritev, where a kvstore write first copies the whole
        file into a buffer of its own. direct=False: never O_DIRECT, for a
        caller that placed its ranges without the alignment it needs.
        """
        if not self.capabilities.local_files:
            return None
        rel = self._writable_key(key)
        if not rel:
            raise CkptError("empty key", self.url)
        return self.backend.create_local_file(rel, direct=direct)

    def page_cache_dropper(self, subdir: str) -> DirectoryDropper | None:
        """Drops from the page cache what another library writes under `subdir`
        (tensorstore's OCDBT data files), on local roots only (else None)."""
        return self.backend.page_cache_dropper(_check_relative(subdir, self.url))

    def fsync_tree(self, subdir: str, *, files: bool = True) -> None:
        """fsync every file and directory under `subdir`, then `subdir` itself
        (local roots; object stores hold a value once its write returns). files=False: the
        directories only, for a writer that fsynced each file it wrote (their names are
        durable once their directory is)."""
        self.backend.fsync_tree(_check_relative(subdir, self.url), files=files)

    def delete_all(self) -> None:
        """Remove every key under this root (used to drop an unfinished output)."""
        if not self.capabilities.writable:
            raise CkptError(f"{self.backend_kind} storage is read-only", self.url)
        self._listing = None
        self.backend.delete_all()

    # -- deadlines and errors --------------------------------------------------
    def wait(self, future: Any, what: str, where: str, *, nbytes: int = 0) -> Any:
        """`future.result()` under this store's deadline (remote stores), failures as one line.

        For tensorstore calls made outside this package (array opens and reads):
        a failure is a CkptError `<where>: <what>: ...`; a remote endpoint that
        does not answer is a StorageUnavailableError naming it. `nbytes`: what
        the operation moves, which extends the deadline.
        """
        try:
            return self.backend.wait_raw(future, what, where, nbytes=nbytes)
        except CkptError:
            raise
        except Exception as exc:
            raise self._error(exc, what, where) from exc

    def _error(self, exc: BaseException, what: str, where: str) -> CkptError:
        err = self.backend.error(exc, what, where)
        located = getattr(err, "ocdbt_value", None)
        if located is not None:  # a value past the end of its data file: name the file, not the database
            data_file = self._ocdbt_data_file(*located)
            if data_file is not None:
                err.where = data_file
                err.args = (f"{data_file}: {err.message}",)
        return err

    def _ocdbt_data_file(self, database: str, key: str) -> str | None:
        """The local data file the value `key` of the OCDBT database at `database` lies in
        (one walk of its tree), or None where that cannot be told."""
        if self.local_root is None or not os.path.isabs(database):
            return None
        rel = os.path.relpath(database, self.local_root)
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            return None
        try:
            ref = self.ocdbt("" if rel == os.curdir else rel).locate_values([key]).get(key)
        except (CkptError, ValueError):
            return None
        if not isinstance(ref, ocdbt_bulk.IndirectValue):
            return None
        return os.path.join(database, ref.path)

    # -- keys ------------------------------------------------------------
    def _where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _value_key(self, key: str) -> str:
        """`key` relative and not empty."""
        rel = _check_relative(key, self.url)
        if not rel:
            raise CkptError("empty key", self.url)
        return rel

    def _checked(self, key: str) -> str:
        """`key` relative and not empty, and (the backend's containment) safe to read."""
        rel = self._value_key(key)
        self._check_local_path(rel, want_dir=False)
        return rel

    def _read_key(self, key: str) -> str:
        """The checked key of a value about to be read, logged as read."""
        rel = self._checked(key)
        self.log.record(rel)
        return rel

    def _check_local_path(self, rel: str, *, want_dir: bool) -> None:
        """Refuse symlinks leading out of the root and anything but files/dirs (the backend's containment)."""
        self.backend.check_key(rel, want_dir=want_dir)


def _backend_for(url: str, *, create: bool) -> Backend:
    """The backend of the kind a path or URL names: a local directory (made if `create`), else a kvstore."""
    spec, local_root = _kvstore_spec(url)
    if local_root is None:
        return KvstoreBackend.open(spec, url)
    if create:
        return LocalBackend.create(spec, url, local_root)
    return LocalBackend.open(spec, url, local_root)
