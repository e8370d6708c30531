"""The backend interface: what one kind of storage root does, and the logic every kind shares.

A Storage (core.py) is what readers and writers hold; behind it sits one Backend per kind of root:
a local directory (local_backend.py), an object or memory store through a tensorstore kvstore
(kvstore_backend.py), and an OCDBT database read as a directory (ocdbt_view.py). Storage checks
keys (no `..`, no absolute key), remembers the listing and logs reads; a backend gets keys already
checked, relative to its root and (except where said) not empty, and answers for its kind only.

What every kind shares lives here, once: waiting for tensorstore under the remote deadline and
wording its failures (remote.py's rules, applied by `wait`), listing, writing and deleting through
the kvstore every root is opened as, and reading several keys concurrently by point reads.
"""
from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..base.errors import CkptError, NotFoundError
from .remote import _RETRIES, REMOTE_IN_FLIGHT, _endpoint_of, _error_for, _wait_for, opening

if TYPE_CHECKING:
    import tensorstore as ts

    from ..base.pagecache import DirectoryDropper
    from .local import LocalFileWriter

# One context for every open: memory:// stores are shared within a process
# and tensorstore's cache pools and thread pools are reused. Writers derive
# theirs from it, so the retry bounds apply to every request ckpt makes.
# Requests to one store at once: 4x the chunk reads a run keeps in flight there (remote.in_flight),
# so that the size probes, listings and tensorstore's own array writes (many small chunks of a
# many-device layout) are not queued behind them. (tensorstore's default too, set here so that it
# is a number of ckpt's.)
_REQUESTS_AT_ONCE = {"limit": 4 * REMOTE_IN_FLIGHT}
_CONTEXT_SPEC = {"s3_request_retries": _RETRIES, "gcs_request_retries": _RETRIES, "http_request_retries": _RETRIES,
                 "gcs_request_concurrency": _REQUESTS_AT_ONCE, "s3_request_concurrency": _REQUESTS_AT_ONCE}
# Array reads get their own context with a small decoded-chunk cache: a
# reshard cuts several output chunks from one source chunk, and without a
# cache each of them decodes that chunk again. Writers keep _CONTEXT, so
# nothing they write is cached. Local files are read with pread, not through
# memory maps: a mapped source file that shrinks while it is read (another
# process rewriting the checkpoint) kills the process with SIGBUS, where a
# read just comes back short and fails as one line. (Mapping saved ~0.4 s of
# a 2 GiB reshard; CKPT_MMAP_READS=1 brings it back for sources known not to
# change.)
_READ_CONTEXT_SPEC = {"cache_pool": {"total_bytes_limit": 64 * 2**20}}

# Both made on first use, and tensorstore imported then (~0.1 s with numpy, more on a TPU host): a
# local root is listed and read without it (local_backend.py), so `ckpt inspect` of a local DCP
# never loads it (issue 46). _CONTEXT and _READ_CONTEXT stay importable names (__getattr__ below).
_contexts: dict[str, Any] = {}
_contexts_lock = threading.Lock()


def shared_context() -> ts.Context:
    """The one context every kvstore and array ckpt opens derives from (see above)."""
    ctx = _contexts.get("shared")
    if ctx is None:
        import tensorstore as ts

        with _contexts_lock:
            ctx = _contexts.get("shared")
            if ctx is None:
                ctx = _contexts["shared"] = ts.Context(_CONTEXT_SPEC)
    return ctx


def read_context() -> ts.Context:
    """For opening arrays to read: shares shared_context()'s resources plus a chunk cache."""
    ctx = _contexts.get("read")
    if ctx is None:
        import tensorstore as ts

        parent = shared_context()
        with _contexts_lock:
            ctx = _contexts.get("read")
            if ctx is None:
                mmap = os.environ.get("CKPT_MMAP_READS", "") not in ("", "0")
                spec = _READ_CONTEXT_SPEC | ({"file_io_mode": {"mode": "memmap"}} if mmap else {})
                ctx = _contexts["read"] = ts.Context(spec, parent=parent)
    return ctx


def __getattr__(name: str) -> Any:
    # the contexts under their old names, made (and tensorstore imported) when first asked for
    if name == "_CONTEXT":
        return shared_context()
    if name == "_READ_CONTEXT":
        return read_context()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Capabilities:
    """What a kind of storage can do beyond reading (the backend suite skips a test by these)."""

    writable: bool  # write, delete, delete_all and Storage.create
    local_files: bool  # create_local_file, fsync_tree, page_cache_dropper, modification times
    symlinks: bool  # a file system whose links and special files containment must refuse
    deadlines: bool  # a remote endpoint: every wait has a deadline, and one that passes fails the rest fast
    bulk_reads: bool  # many keys read by one walk (OCDBT views), not a point read each


class Reads(Protocol):
    """Reads started together; `result()` waits for them all."""

    def result(self) -> dict[str, bytes | None]:
        """Each key's bytes, or None where the key is missing."""
        ...


def open_kvstore(spec: dict[str, Any], url: str, what: str = "cannot open storage") -> ts.KvStore:
    """The kvstore for `spec` (named `url` in errors), opened under the remote checks and deadline."""
    endpoint = opening(spec, url, what)
    import tensorstore as ts

    try:
        fut = ts.KvStore.open(spec, context=shared_context())
    except Exception as exc:  # tensorstore raises ValueError for bad specs
        raise _error_for(exc, endpoint, what, url) from exc
    return _wait_for(fut, endpoint, 0, what, url)


class Backend(ABC):
    """One kind of storage root, as a flat key space (see the module docstring for who checks what)."""

    # what a kvstore opened on first use (Backend.kvstore) says when it cannot be opened
    _OPEN_WHAT = "cannot open storage"

    def __init__(self, kvstore: ts.KvStore | None, url: str, spec: dict[str, Any]) -> None:
        # None: opened from `spec` when first used (a local root that is only listed and read by
        # the file system never opens one, nor imports tensorstore)
        self._kvstore = kvstore
        self.url = url
        # the JSON spec it was opened with: KvStore.spec() drops context resources
        # such as aws_credentials, so derived stores are built from this one
        self.spec = spec
        self._endpoint = _endpoint_of(spec)

    @property
    def kvstore(self) -> ts.KvStore:
        """The tensorstore kvstore of this root (opened on first use where it was not given)."""
        if self._kvstore is None:
            self._kvstore = open_kvstore(self.spec, self._open_url(), self._OPEN_WHAT)
        return self._kvstore

    def _open_url(self) -> str:
        """The root as an error opening its kvstore names it."""
        return self.url

    # -- what the kind is ----------------------------------------------------------------
    @property
    @abstractmethod
    def kind(self) -> str:
        """A short name of the kind ("local", "s3", "gcs", "memory", "ocdbt"), for messages and tests."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this root can do beyond reading."""

    @property
    def endpoint(self) -> str | None:
        """The remote endpoint (s3://, gs://, or the one an OCDBT view's database lies on); None when local."""
        return self._endpoint

    @property
    def local_root(self) -> str | None:
        """The local directory this root is, or None (object stores, memory, OCDBT views)."""
        return None

    @abstractmethod
    def child(self, rel: str) -> Backend:
        """The backend rooted at the sub-directory `rel` (checked relative, not empty)."""

    def spec_for(self, rel: str) -> dict[str, Any]:
        """The kvstore spec (JSON) for `rel` (checked relative; a trailing '/' kept), for tensorstore's own opens."""
        spec = dict(self.spec)
        spec["path"] = spec.get("path", "") + rel
        return spec

    # -- containment (kinds with a file system override these) ---------------------------
    def check_key(self, rel: str, *, want_dir: bool) -> None:
        """Refuse a key whose read would leave the root (a link out, a FIFO); keys themselves are checked."""

    def guard(self, rel: str) -> None:
        """Refuse to let tensorstore open anything under `rel` that would leave the root."""

    def containment_problems(self) -> list[tuple[str, str]]:
        """Every (path, message) under this root that containment refuses."""
        return []

    # -- reading -------------------------------------------------------------------------
    def list_keys(self, prefix: str) -> list[str]:
        """Every key under `prefix` ("" or ending in '/'), relative to the root, sorted; one LIST each call."""
        import tensorstore as ts

        try:
            if prefix:
                rng = ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=prefix[:-1] + chr(ord("/") + 1))
                fut = self.kvstore.list(rng)
            else:
                fut = self.kvstore.list()
        except Exception as exc:
            raise self.error(exc, "cannot list keys", self.url) from exc
        keys = self.wait(fut, "cannot list keys", self.url)
        # (kept to the prefix here too: some servers answer a LIST with more than the range asked for)
        return sorted(k for k in (k.decode("utf-8", "surrogateescape") for k in keys) if k.startswith(prefix))

    @abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether a value is stored at `rel` (without reading it)."""

    @abstractmethod
    def read(self, rel: str, byte_range: slice | None) -> bytes:
        """The whole value at `rel`, or bytes [start, stop) of it (a non-empty range);
        NotFoundError when missing, an error naming its size when it is shorter than the range."""

    @abstractmethod
    def read_into(self, rel: str, start: int, view: memoryview) -> None:
        """Fill the byte `view` (not empty) from offset `start` of the value at `rel`; as read() when short.
        `rel`'s form is checked; its containment (check_key) is this method's to check."""

    def start_reads(self, rels: dict[str, str]) -> Reads:
        """Start reading several values (caller's key -> checked key); the result is by caller's key."""
        return PendingReads(self, {key: (rel, self.kvstore.read(rel)) for key, rel in rels.items()})

    @abstractmethod
    def size(self, rel: str) -> int | None:
        """The size in bytes of the value at `rel`, without reading it; NotFoundError when missing,
        None where the store cannot tell without reading the whole value."""

    def check_readable(self, rel: str) -> None:
        """Raise UnreadableFileError when the value at `rel` cannot be opened for reading, reading
        nothing. Default: nothing to do (an object store's listing and size are what it knows without
        a read; each more request per file would cost a round trip)."""

    def shortfall(self, rel: str, need: int) -> int | None:
        """None when the value at `rel` holds at least `need` bytes, else its size (see Storage.shortfall)."""
        size = self.size(rel)
        if size is None:
            size = len(self.read(rel, None))
        return None if size >= need else size

    @abstractmethod
    def stat(self, rel: str) -> tuple[int, float | None]:
        """(size in bytes, modification time or None where the kind does not keep one) of the value at `rel`.

        Storage.stat checks the key's form only: a kind with links looks at the entry itself."""

    # -- writing -------------------------------------------------------------------------
    def write(self, rel: str, data: bytes | bytearray) -> None:
        """Store a whole value at `rel`, replacing any there (the file driver fsyncs it before returning)."""
        fut = self.kvstore.write(rel, data)  # type: ignore[arg-type]  # any buffer; the stubs say bytes

        # tensorstore reads `data` in place until the write is over, which on a
        # deadline may be after we return: the callback holds it until then
        def hold(_future: Any, _keep: bytes | bytearray = data) -> None:
            pass

        fut.add_done_callback(hold)
        self.wait(fut, "cannot write", self.where(rel), nbytes=len(data))

    def delete(self, rel: str) -> None:
        """Remove the value at `rel` (missing is fine)."""
        self.wait(self.kvstore.write(rel, None), "cannot delete", self.where(rel))  # tensorstore deletes on None

    def delete_all(self) -> None:
        """Remove every value under this root."""
        import tensorstore as ts

        self.wait(self.kvstore.delete_range(ts.KvStore.KeyRange()), "cannot delete", self.url)

    def create_local_file(self, rel: str, *, direct: bool | None = None) -> LocalFileWriter | None:
        """A new local file at `rel` for writing at known offsets; None where the kind has no local files.
        direct=False: never O_DIRECT (see LocalFileWriter); None: where its directory suits it."""
        return None

    def page_cache_dropper(self, rel: str) -> DirectoryDropper | None:
        """Drops from the page cache what another library writes under `rel`; None where nothing is cached."""
        return None

    def fsync_tree(self, rel: str, *, files: bool = True) -> None:
        """Make everything under `rel` durable (object stores hold a value once its write returns);
        files=False: its directories only (the files were fsynced as they were written)."""

    # -- deadlines and errors (every kind alike) -----------------------------------------
    def wait(self, future: Any, what: str, where: str, *, nbytes: int = 0) -> Any:
        """`future.result()` under the deadline (remote roots), failures as one line (see Storage.wait)."""
        try:
            return _wait_for(future, self._endpoint, nbytes, what, where)
        except CkptError:
            raise
        except Exception as exc:
            raise self.error(exc, what, where) from exc

    def wait_raw(self, future: Any, what: str, where: str, *, nbytes: int = 0) -> Any:
        """As wait(), but tensorstore's own exceptions pass through (callers that read their status)."""
        return _wait_for(future, self._endpoint, nbytes, what, where)

    def error(self, exc: BaseException, what: str, where: str) -> CkptError:
        """A tensorstore failure doing `what` on `where` as ckpt's one line."""
        return _error_for(exc, self._endpoint, what, where)

    def where(self, rel: str) -> str:
        """The key as a one-line error names it."""
        return f"{self.url}/{rel}"


class PendingReads:
    """Point reads started together (Backend.start_reads); `result()` waits for them all."""

    def __init__(self, backend: Backend, futures: dict[str, tuple[str, Any]]) -> None:
        self._backend = backend
        self._futures = futures

    def result(self) -> dict[str, bytes | None]:
        """Each key's bytes, or None where the key is missing."""
        out: dict[str, bytes | None] = {}
        for key, (rel, fut) in self._futures.items():
            res = self._backend.wait(fut, "cannot read", self._backend.where(rel))
            out[key] = bytes(res.value) if res.state == "value" else None
        return out


def missing(where: str) -> NotFoundError:
    """A key with no value, as every kind words it."""
    return NotFoundError("missing", where)
