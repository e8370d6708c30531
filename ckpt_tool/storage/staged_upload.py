"""A file bound for an object store, filled at known offsets on local disk and uploaded whole.

The OCDBT writer (ocdbt_writer.py) appends chunks to data files with the interface of a local
file (`write_at`, `close`, `discard`). On gs:// and s3:// there is no such file: each data file is
one object, uploaded in one request (tensorstore's drivers upload a value in one request; GCS
compose and S3 multipart are not reachable through them). Its bytes are staged in a temporary
file (TMPDIR, unlinked at once, as safetensors/write.py stages a remote shard) while a copy thread
fills it, then read back and handed to `Storage.write`, which uploads them and, on GCS, checks
what was stored (gcs_verify.py). Staged in memory instead, every copy thread would hold a data
file of up to SEAL_BYTES (16 MiB) at all times, whether or not anything is being uploaded.

Memory: an upload holds the file's bytes read back plus the copy tensorstore makes of them
(`UploadRoom` counts both), until the object is stored. Uploads wait for room under the writer's
limit (one is always let through), so what uploads hold is bounded by that limit, which the
writer reports to the engine as its reserve (pending_bytes_limit).
"""
from __future__ import annotations

import os
import threading
from typing import Any, Iterable

from ..base.errors import CkptError
from .core import Storage

# what an upload holds per byte of its object: ckpt's buffer read back, and tensorstore's copy of
# it (the Python binding copies a value into a Cord of its own before the request)
UPLOAD_COPIES = 2


class UploadRoom:
    """Bytes held by uploads in flight, at most `limit` (one upload is always let through)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, int(limit))
        self._held = 0
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> None:
        with self._cond:
            while self._held and self._held + nbytes > self.limit:
                self._cond.wait()
            self._held += nbytes

    def give(self, nbytes: int) -> None:
        with self._cond:
            self._held -= nbytes
            self._cond.notify_all()


class StagedUpload:
    """One object at `key` of `storage`, staged in a temporary file: written at offsets by one
    thread, uploaded by `close()` (on another thread), or dropped by `discard()`."""

    __slots__ = ("_storage", "_key", "_room", "_file", "_end")

    def __init__(self, storage: Storage, key: str, room: UploadRoom) -> None:
        self._storage = storage
        self._key = key
        self._room = room
        self._end = 0
        import tempfile  # (object stores only: a local data file is written in place, ocdbt_writer.py)

        try:
            self._file: Any = tempfile.TemporaryFile(prefix="ckpt-ocdbt-")
        except OSError as exc:
            raise self._error("cannot stage", exc) from None

    @property
    def where(self) -> str:
        return f"{self._storage.url}/{self._key}"

    def write_at(self, offset: int, parts: Iterable[Any], *, padded: bool = True) -> None:
        """The buffers back to back from `offset` (`padded` is the local file's knob: unused here)."""
        del padded
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if v.nbytes]
        if self._file is None:
            raise CkptError("write to a data file already uploaded or discarded", self.where)
        try:
            while views:
                n = os.pwritev(self._file.fileno(), views, offset)
                offset += n
                while views and n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                if n:
                    views[0] = views[0][n:]
        except OSError as exc:
            raise self._error("cannot stage", exc) from None
        self._end = max(self._end, offset)

    def close(self) -> None:
        """Read the staged bytes back and upload them as the object (Storage.write: on gs://,
        checked against what GCS stored), once the uploads in flight leave room."""
        staged, self._file = self._file, None
        if staged is None:
            return
        size = self._end
        held = UPLOAD_COPIES * size
        self._room.take(held)
        try:
            data = bytearray(size)
            view = memoryview(data)
            pos = 0
            while pos < size:
                got = os.preadv(staged.fileno(), [view[pos:]], pos)
                if got <= 0:
                    raise OSError(0, f"the staged file ends at {pos} of {size} bytes")
                pos += got
            del view
            staged.close()
            staged = None
            self._storage.write(self._key, data)
        except OSError as exc:
            raise self._error("cannot read back", exc) from None
        finally:
            if staged is not None:
                staged.close()
            self._room.give(held)

    def discard(self) -> None:
        """Drop the staged bytes; nothing is uploaded."""
        staged, self._file = self._file, None
        if staged is not None:
            staged.close()

    def _error(self, what: str, exc: OSError) -> CkptError:
        import tempfile

        return CkptError(f"{what} {self._key} staged in {tempfile.gettempdir()} (TMPDIR): "
                         f"{exc.strerror or exc}", self._storage.url)
