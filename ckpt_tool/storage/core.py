"""Storage: one interface over a checkpoint root, whatever the root is.

Every reader and writer goes through a Storage; it decides, key by key,
which of the package's parts applies (containment and local files for a
local root, deadlines and error wording for a remote one) and holds what
a root remembers (its listing, its reads, its containment scan). See the
package docstring.
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import os
import stat
import threading
import time
from collections import Counter
from typing import Any, Iterable, Iterator

import tensorstore as ts

from .. import directio
from ..errors import CkptError, NotFoundError, PathEscapeError, StorageUnavailableError, TruncatedFileError
from ..pagecache import DirectoryDropper
from . import local as localfs
from . import ocdbt_bulk
from .containment import _check_relative, _Containment, check_local_path
from .local import LocalFileWriter, _os_error
from .remote import (
    ocdbt_truncated_cause, _RETRIES, _SIZE_IN_ERROR, _TRANSPORT, _endpoint_of, _error_for, _kvstore_spec, _text, _wait_for, opening,
)

# One context for every open: memory:// stores are shared within a process
# and tensorstore's cache pools and thread pools are reused. Writers derive
# theirs from it, so the retry bounds apply to every request ckpt makes.
_CONTEXT = ts.Context(
    {"s3_request_retries": _RETRIES, "gcs_request_retries": _RETRIES, "http_request_retries": _RETRIES}
)
# Array reads get their own context with a small decoded-chunk cache: a
# reshard cuts several output chunks from one source chunk, and without a
# cache each of them decodes that chunk again. Writers keep _CONTEXT, so
# nothing they write is cached. Local files are read with pread, not through
# memory maps: a mapped source file that shrinks while it is read (another
# process rewriting the checkpoint) kills the process with SIGBUS, where a
# read just comes back short and fails as one line. (Mapping saved ~0.4 s of
# a 2 GiB reshard; CKPT_MMAP_READS=1 brings it back for sources known not to
# change.)
_READ_CONTEXT = ts.Context(
    {"cache_pool": {"total_bytes_limit": 64 * 2**20}}
    | ({"file_io_mode": {"mode": "memmap"}} if os.environ.get("CKPT_MMAP_READS", "") not in ("", "0") else {}),
    parent=_CONTEXT,
)


# what an OCDBT view's url adds to its database directory's
_OCDBT_SUFFIX = " (ocdbt)"


class ReadLog:
    """Counts reads per key, so tests can prove which values were touched."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reads: Counter[str] = Counter()

    def record(self, key: str) -> None:
        with self._lock:
            self.reads[key] += 1

    def record_many(self, keys: Iterable[str]) -> None:
        with self._lock:
            self.reads.update(keys)


class PendingReads:
    """Reads started by `Storage.start_reads`; `result()` waits for them all."""

    def __init__(self, storage: Storage, futures: dict[str, Any]) -> None:
        self._storage = storage
        self._futures = futures

    def result(self) -> dict[str, bytes | None]:
        """Each key's bytes, or None where the key is missing."""
        out: dict[str, bytes | None] = {}
        for key, fut in self._futures.items():
            res = self._storage.wait(fut, "cannot read", self._storage._where(key))
            out[key] = bytes(res.value) if res.state == "value" else None
        return out


class OcdbtBulkReads:
    """Many keys of an OCDBT view, read at `.result()` by one walk of its B+tree (see ocdbt_bulk):
    the answer PendingReads gives, without a point read per key."""

    def __init__(self, storage: Storage, keys: list[str]) -> None:
        self._storage = storage
        self._keys = keys

    def result(self) -> dict[str, bytes | None]:
        located = self._storage.locate_values(self._keys)
        # values stored out of line: read from their data files where the walk found them
        refs = {k: v for k, v in located.items() if isinstance(v, ocdbt_bulk.IndirectValue)}
        read = read_indirect(self._storage, refs) if refs else {}
        return {k: read[k] if k in read else located.get(k) for k in self._keys}  # type: ignore[misc]  # (inline: bytes)


def read_indirect(view: "Storage", refs: dict[str, ocdbt_bulk.IndirectValue]) -> dict[str, bytes]:
    """Out-of-line values of an OCDBT view, read concurrently by byte range from the data files
    (relative to the database root) the B+tree walk found them in."""
    base = view._ocdbt_base
    assert base is not None
    base_url = view.url[: -len(_OCDBT_SUFFIX)] if view.url.endswith(_OCDBT_SUFFIX) else view.url
    futures = {key: base.read(ref.path, byte_range=slice(ref.offset, ref.offset + ref.length))
               for key, ref in refs.items()}
    out: dict[str, bytes] = {}
    for key, fut in futures.items():
        ref = refs[key]
        where = f"{base_url}/{ref.path}"  # the data file, as validate names it
        res = view.wait(fut, "cannot read", where, nbytes=ref.length)
        data = bytes(res.value) if res.state == "value" else b""
        if len(data) != ref.length:
            # (a read that ends short ends at the end of the file)
            raise TruncatedFileError(f"value of {key} ({ref.length} bytes at offset {ref.offset}) is cut short: "
                                     f"the data file holds {len(data)} of them", where,
                                     size=ref.offset + len(data), cause=ocdbt_truncated_cause(ref.offset + len(data)))
        out[key] = data
    return out


class Storage:
    """A checkpoint root on any tensorstore kvstore."""

    def __init__(
        self,
        kvstore: ts.KvStore,
        url: str,
        *,
        spec: dict[str, Any],
        local_root: str | None = None,
        log: ReadLog | None = None,
        check_local: bool = True,
        containment: _Containment | None = None,
        contain_base: str = "",
    ) -> None:
        self._kv = kvstore
        # the JSON spec we opened with: KvStore.spec() drops context resources
        # such as aws_credentials, so derived stores are built from this one
        self._spec = spec
        self.url = url.rstrip("/") if url not in ("/",) else url
        self.local_root = local_root
        self.log = log or ReadLog()
        # OCDBT views resolve keys inside the database, not on the filesystem
        self._check_local = check_local and local_root is not None
        # every key under the root, once listed (see list())
        self._listing: list[str] | None = None
        # when this store was opened (time.monotonic()): failures since then belong to this run
        self.opened_at = time.monotonic()
        # an OCDBT view: the kvstore holding its database's manifest, and this view's key prefix in it,
        # for reads of many keys at once (ocdbt_bulk)
        self._ocdbt_base: ts.KvStore | None = None
        self._ocdbt_prefix = ""
        # remote stores: the endpoint named when it stops answering, and deadlines apply
        self._endpoint = _endpoint_of(spec)
        # local roots opened for reading: the scan behind guard(), and where this root sits in it
        self._containment = containment
        self._contain_base = contain_base

    # -- opening ---------------------------------------------------------
    @classmethod
    def open(cls, url: str, log: ReadLog | None = None) -> "Storage":
        spec, local_root = _kvstore_spec(url)
        if local_root is not None:
            try:
                st = os.stat(local_root)
            except FileNotFoundError:
                raise NotFoundError("no such directory", url) from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise PathEscapeError("symlink loop (Too many levels of symbolic links)", url) from None
                raise CkptError(f"cannot open: {exc.strerror or exc}", url) from None
            if not stat.S_ISDIR(st.st_mode):
                raise NotFoundError("is a file, not a checkpoint directory", url)
        kv = cls._open_kvstore(spec, url)
        return cls(kv, url, spec=spec, local_root=local_root, log=log,
                   containment=_Containment(local_root) if local_root is not None else None)

    @staticmethod
    def _open_kvstore(spec: dict[str, Any], url: str, what: str = "cannot open storage") -> ts.KvStore:
        endpoint = opening(spec, url, what)
        try:
            fut = ts.KvStore.open(spec, context=_CONTEXT)
        except Exception as exc:  # tensorstore raises ValueError for bad specs
            raise _error_for(exc, endpoint, what, url) from exc
        return _wait_for(fut, endpoint, 0, what, url)

    def child(self, relpath: str) -> "Storage":
        """The storage rooted at a sub-directory (containment checked)."""
        rel = _check_relative(relpath, self.url)
        if not rel:
            return self
        if self._check_local:
            self._check_local_path(rel, want_dir=True)
        kv = self._kv / (rel + "/")
        local = os.path.join(self.local_root, rel) if self.local_root else None
        child = Storage(
            kv, f"{self.url}/{rel}", spec=self._spec_for(rel + "/"),
            local_root=local, log=self.log, check_local=self._check_local,
            containment=self._containment, contain_base=self._contained(rel),
        )
        if self._ocdbt_base is not None:
            child._ocdbt_base, child._ocdbt_prefix = self._ocdbt_base, self._ocdbt_prefix + rel + "/"
        if self._listing is not None:
            # the sub-directory's part of the listing: no new LIST
            cut = len(rel) + 1
            child._listing = [k[cut:] for k in self._listing if k.startswith(rel + "/")]
        return child

    def ocdbt(self, subdir: str = "") -> "Storage":
        """A view of the OCDBT database whose manifest lives at `subdir`."""
        base = self.child(subdir) if subdir else self
        base.guard()  # the manifest, the data files and (at the root) every process's database
        spec = {"driver": "ocdbt", "base": base._spec}
        kv = self._open_kvstore(spec, base.url, "cannot open OCDBT database")
        view = Storage(kv, base.url + _OCDBT_SUFFIX, spec=spec, local_root=None, log=self.log, check_local=False)
        view._ocdbt_base = base._kv
        return view

    def kvstore_spec(self, subpath: str = "") -> dict[str, Any]:
        """The kvstore spec (JSON) for `subpath`, for opening arrays with tensorstore.

        tensorstore then opens files under `subpath` without asking this
        layer, so the directory is checked first (see guard).
        """
        self.guard(subpath)
        return self._spec_for(subpath)

    def _spec_for(self, subpath: str) -> dict[str, Any]:
        rel = _check_relative(subpath, self.url) if subpath else ""
        if subpath.endswith("/") and rel:
            rel += "/"
        spec = dict(self._spec)
        spec["path"] = spec.get("path", "") + rel
        return spec

    def guard(self, subpath: str = "") -> None:
        """Refuse to let tensorstore open anything under `subpath` (local roots opened for reading)
        when it holds a symlink out of the checkpoint, a symlink loop, or a FIFO, device or socket.

        The directory is scanned once per run; later calls cost a lookup.
        """
        if self._containment is None or not self._check_local:
            return
        rel = _check_relative(subpath, self.url) if subpath else ""
        problems = self._containment.check(self._contained(rel))
        if problems:
            path, message, _loop = problems[0]
            raise PathEscapeError(message, self._root_where(path))

    def containment_problems(self) -> list[tuple[str, str]]:
        """Every symlink out, symlink loop and non-regular file under this local root: (path, message).

        Paths are relative to this root; validate reports each as `path-escape`.
        """
        if self._containment is None or not self._check_local:
            return []
        base = self._contain_base
        out = []
        for path, message, _loop in self._containment.check(base):
            if base and path.startswith(base + "/"):
                path = path[len(base) + 1 :]
            elif base and path != base:
                continue  # above this root (a link it is reached through): reported by its own path
            out.append((path, message))
        return out

    def _contained(self, rel: str) -> str:
        """`rel` (relative to this root) as a path relative to the scanned root."""
        if not self._contain_base:
            return rel
        return f"{self._contain_base}/{rel}" if rel else self._contain_base

    def _root_where(self, contained: str) -> str:
        """A path of the scan, as a one-line error names it."""
        assert self._containment is not None
        root = self._containment.root
        return os.path.join(root, contained) if contained else root

    @property
    def context(self) -> ts.Context:
        return _CONTEXT

    @property
    def read_context(self) -> ts.Context:
        """For opening arrays to read: shares _CONTEXT's resources plus a chunk cache."""
        return _READ_CONTEXT

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

    def _list_uncached(self, rel: str) -> builtins.list[str]:
        try:
            if rel:
                rng = ts.KvStore.KeyRange(inclusive_min=rel, exclusive_max=rel[:-1] + chr(ord("/") + 1))
                fut = self._kv.list(rng)
            else:
                fut = self._kv.list()
        except Exception as exc:
            raise self._error(exc, "cannot list keys", self.url) from exc
        keys = self.wait(fut, "cannot list keys", self.url)
        return sorted(k.decode("utf-8", "surrogateescape") for k in keys)

    def listdir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[str]]:
        """Immediate sub-directories and files under `prefix`."""
        rel = _check_relative(prefix, self.url) if prefix else ""
        start = len(rel) + 1 if rel else 0
        dirs: set[str] = set()
        files: builtins.list[str] = []
        for key in self.list(rel):
            rest = key[start:]
            if "/" in rest:
                dirs.add(rest.split("/", 1)[0])
            else:
                files.append(rest)
        return sorted(dirs), files

    def exists(self, key: str) -> bool:
        rel = _check_relative(key, self.url)
        if self._check_local:
            path = os.path.join(self.local_root, rel)  # type: ignore[arg-type]
            return os.path.lexists(path)
        try:
            res = self._wait(self._kv.read(rel, byte_range=slice(0, 0)), 0, "cannot read", self._where(rel))
        except StorageUnavailableError:
            raise
        except Exception as exc:
            if isinstance(exc, CkptError) or not _TRANSPORT.search(_text(exc)):
                return True  # it exists but is shorter than the probe: still exists
            raise self._error(exc, "cannot read", self._where(rel)) from exc
        return res.state == "value"

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

        The bulk path for tensor data: a local file is read straight into the
        caller's buffer with preadv (one copy, by the kernel). Through the
        file kvstore the same 2 GiB of DCP chunks took 3.3 s instead of 0.3 s
        here: tensorstore reads into fresh buffers of its own and hands them
        over as bytes, a copy or two more per chunk.
        """
        view = memoryview(buffer).cast("B")
        size = view.nbytes
        if start < 0:
            raise CkptError(f"invalid byte range [{start}, {start + size})", self._where(key))
        if size == 0:
            return
        if not self._check_local:
            view[:] = self.read_range(key, start, start + size)
            return
        with self._local_read(key) as (rel, fd):
            localfs.pread_into(fd, view, start, self._where(rel))

    @contextlib.contextmanager
    def _local_read(self, key: str) -> Iterator[tuple[str, int]]:
        """The checked key and a descriptor of its local file, logged as read; OS errors become one line."""
        rel = self._checked(key)
        self.log.record(rel)
        path = os.path.join(self.local_root, rel)  # type: ignore[arg-type]
        with localfs.open_for_read(path, self._where(rel)) as fd:
            yield rel, fd

    def read_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """Read several keys concurrently (None for a missing key)."""
        return self.start_reads(keys).result()

    def start_reads(self, keys: Iterable[str]) -> "PendingReads | OcdbtBulkReads":
        """Start reading several keys; the caller may do other work before `.result()`."""
        keys = list(keys)
        if self._ocdbt_base is not None and len(keys) >= ocdbt_bulk.BULK_MIN_KEYS:
            self.log.record_many([self._checked(key) for key in keys])
            return OcdbtBulkReads(self, keys)
        futures = {}
        for key in keys:
            rel = self._checked(key)
            self.log.record(rel)
            futures[key] = self._kv.read(rel)
        return PendingReads(self, futures)

    def locate_values(self, keys: builtins.list[str]) -> dict[str, "bytes | ocdbt_bulk.IndirectValue"]:
        """For an OCDBT view: each present key's value if stored in line, else where it lies
        (read it with read_located), by one walk of the B+tree; absent keys are left out.

        Nothing is logged as read: a caller that uses a value records it (log.record)."""
        if self._ocdbt_base is None:
            raise ValueError("locate_values needs an OCDBT view")
        prefix = self._ocdbt_prefix

        def wait(future: Any) -> Any:
            return self.wait(future, "cannot read OCDBT B+tree", self.url)

        try:
            inline, indirect = ocdbt_bulk.read_keys(self._ocdbt_base, [prefix + self._checked(k) for k in keys], wait)
        except ocdbt_bulk.OcdbtTreeError as exc:
            raise CkptError(f"cannot read OCDBT B+tree: {exc}", self.url) from None
        cut = len(prefix)
        out: dict[str, bytes | ocdbt_bulk.IndirectValue] = {k[cut:]: v for k, v in inline.items()}
        out.update((k[cut:], v) for k, v in indirect.items())
        return out

    def read_located(self, key: str, ref: "ocdbt_bulk.IndirectValue") -> bytes:
        """An out-of-line value of this OCDBT view where locate_values found it."""
        return read_indirect(self, {key: ref})[key]

    def size(self, key: str) -> int:
        """The size in bytes of the value at `key`, without reading it where possible."""
        rel = self._checked(key)
        if self._check_local:
            try:
                return os.stat(os.path.join(self.local_root, rel)).st_size  # type: ignore[arg-type]
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise _os_error(exc, "cannot stat", self._where(rel)) from None
        # kvstores have no stat: an out-of-range probe makes the driver state
        # the size; drivers that do not say so fall back to a full read.
        try:
            res = self._wait(self._kv.read(rel, byte_range=slice(1 << 62, (1 << 62) + 1)), 0, "cannot read", self._where(rel))
        except ValueError as exc:
            m = _SIZE_IN_ERROR.search(str(exc))
            if m:
                return int(m.group(1))
            if _TRANSPORT.search(_text(exc)):
                raise self._error(exc, "cannot read", self._where(rel)) from exc
            return len(self.read(key))
        if res.state != "value":
            raise NotFoundError("missing", self._where(key))
        return len(self.read(key))

    def stat(self, key: str) -> tuple[int, float | None]:
        """(size in bytes, modification time) of the value at `key`.

        The time is known on local roots only: tensorstore's S3/GCS drivers
        do not return an object's time (a read's stamp is the time of the
        read), so there it is None and the size costs a request (see size).
        Locally the entry itself is looked at (lstat: a symlink is not
        followed, so nothing outside the root is touched) without the
        containment walk a read needs (a realpath per key: `ckpt ls` on a
        root of 2,200 files spent 1.1 s there).
        """
        if not self._check_local:
            return self.size(key), None
        rel = _check_relative(key, self.url)
        try:
            st = os.lstat(os.path.join(self.local_root, rel))  # type: ignore[arg-type]
        except OSError as exc:
            raise _os_error(exc, "cannot stat", self._where(rel)) from None
        return st.st_size, st.st_mtime

    # -- writing ---------------------------------------------------------
    @classmethod
    def create(cls, url: str, log: ReadLog | None = None) -> "Storage":
        """Open a destination, creating a local directory if needed."""
        spec, local_root = _kvstore_spec(url)
        if local_root is not None:
            try:
                os.makedirs(local_root, exist_ok=True)
            except OSError as exc:
                raise _os_error(exc, "cannot create", url) from None
        kv = cls._open_kvstore(spec, url)
        return cls(kv, url, spec=spec, local_root=local_root, log=log)

    def delete(self, key: str) -> None:
        """Remove one value (missing is fine)."""
        rel = _check_relative(key, self.url)
        self._listing = None
        self.wait(self._kv.write(rel, None), "cannot delete", self._where(rel))  # tensorstore deletes on None

    def write(self, key: str, data: bytes | bytearray) -> None:
        """Write a whole value (the file driver fsyncs it before returning)."""
        rel = _check_relative(key, self.url)
        if not rel:
            raise CkptError("empty key", self.url)
        self._listing = None
        fut = self._kv.write(rel, data)
        # tensorstore reads `data` in place until the write is over, which on a
        # deadline may be after we return: the callback holds it until then
        fut.add_done_callback(lambda _f, _keep=data: None)
        self.wait(fut, "cannot write", self._where(rel), nbytes=len(data))

    def create_local_file(self, key: str) -> "LocalFileWriter | None":
        """A new file at `key` for writing at known offsets, on local roots only (else None).

        The bulk path for DCP data files: archives go from the caller's arrays
        to the file with pwritev, where a kvstore write first copies the whole
        file into a buffer of its own.
        """
        if not self._check_local:
            return None
        rel = _check_relative(key, self.url)
        if not rel:
            raise CkptError("empty key", self.url)
        self._listing = None
        path = os.path.join(self.local_root, rel)  # type: ignore[arg-type]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._check_local_path(rel, want_dir=False)
        return LocalFileWriter(path, self._where(rel), direct=directio.supported(os.path.dirname(path)))

    def page_cache_dropper(self, subdir: str) -> "DirectoryDropper | None":
        """Drops from the page cache what another library writes under `subdir`
        (tensorstore's OCDBT data files), on local roots only (else None)."""
        if self.local_root is None:
            return None
        rel = _check_relative(subdir, self.url)
        return DirectoryDropper(os.path.join(self.local_root, rel))

    def fsync_tree(self, subdir: str) -> None:
        """fsync every file and directory under `subdir`, then `subdir` itself
        (local roots; object stores hold a value once its write returns)."""
        if self.local_root is None:
            return
        localfs.fsync_tree(os.path.join(self.local_root, _check_relative(subdir, self.url)), self._where(subdir))

    def delete_all(self) -> None:
        """Remove every key under this root (used to drop an unfinished output)."""
        self._listing = None
        self.wait(self._kv.delete_range(ts.KvStore.KeyRange()), "cannot delete", self.url)

    # -- deadlines and errors --------------------------------------------------
    @property
    def endpoint(self) -> str | None:
        """The remote endpoint (s3://, gs://), or None for local and memory stores."""
        return self._endpoint

    def wait(self, future: Any, what: str, where: str, *, nbytes: int = 0) -> Any:
        """`future.result()` under this store's deadline (remote stores), failures as one line.

        For tensorstore calls made outside this module (array opens and reads):
        a failure is a CkptError `<where>: <what>: ...`; a remote endpoint that
        does not answer is a StorageUnavailableError naming it. `nbytes`: what
        the operation moves, which extends the deadline.
        """
        try:
            return _wait_for(future, self._endpoint, nbytes, what, where)
        except CkptError:
            raise
        except Exception as exc:
            raise self._error(exc, what, where) from exc

    def _wait(self, future: Any, nbytes: int, what: str, where: str) -> Any:
        """As wait(), but tensorstore's own exceptions pass through (callers that read their status)."""
        return _wait_for(future, self._endpoint, nbytes, what, where)

    def _error(self, exc: BaseException, what: str, where: str) -> CkptError:
        err = _error_for(exc, self._endpoint, what, where)
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

    # -- internals -------------------------------------------------------
    def _where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _checked(self, key: str) -> str:
        rel = _check_relative(key, self.url)
        if not rel:
            raise CkptError("empty key", self.url)
        if self._check_local:
            self._check_local_path(rel, want_dir=False)
        return rel

    def _check_local_path(self, rel: str, *, want_dir: bool) -> None:
        """Refuse symlinks leading out of the root and anything but files/dirs (containment.py)."""
        check_local_path(self.local_root, rel, self.url, self._where(rel), want_dir=want_dir)  # type: ignore[arg-type]

    def _read(self, key: str, byte_range: slice | None) -> bytes:
        if self._check_local:  # by pread, through the checked, non-blocking open (see read_range_into for why)
            with self._local_read(key) as (rel, fd):
                if byte_range is None:
                    return localfs.read_all(fd)
                return localfs.pread(fd, byte_range.start, byte_range.stop, self._where(rel))
        rel = self._checked(key)
        self.log.record(rel)
        try:
            if byte_range is None:
                fut = self._kv.read(rel)
            else:
                fut = self._kv.read(rel, byte_range=byte_range)
            res = self._wait(fut, 0 if byte_range is None else byte_range.stop - byte_range.start, "cannot read", self._where(rel))
        except ValueError as exc:
            msg = str(exc)
            if "OUT_OF_RANGE" in msg:
                m = _SIZE_IN_ERROR.search(msg)
                have = f"it has {m.group(1)} bytes" if m else "it is shorter"
                raise CkptError(
                    f"truncated: needed bytes [{byte_range.start}, {byte_range.stop}) but {have}",  # type: ignore[union-attr]
                    self._where(rel),
                ) from exc
            raise self._error(exc, "cannot read", self._where(rel)) from exc
        if res.state != "value":
            raise NotFoundError("missing", self._where(rel))
        return bytes(res.value)
