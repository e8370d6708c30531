"""sha256 of many files: streamed, files in parallel, within a memory budget, through Storage.

sha256 is sequential within a file, so the parallelism is across files: `workers` threads each
hash one file at a time (the largest first, so one big file does not start last), reading it
block by block into one buffer of their own and feeding hashlib, which releases the GIL for
buffers over 2 KiB (the threads hash on separate cores). Memory is `workers` buffers, whatever
the file sizes. Local files are read with pread straight into the buffer (Storage.read_range_into);
remote ones (S3, GCS) by byte range, in larger blocks since each is a request.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from ...base.errors import CkptError, NotFoundError, PathEscapeError
from ...base.findings import Progress, no_progress
from ...storage import Storage

# 1 MiB blocks stay in the CPU's cache between the read and the hash (the hash reads what the
# copy from the page cache just wrote); measured no faster at 8 MiB locally. A remote read is a
# request: fewer, larger ones.
LOCAL_BLOCK = 1 << 20
REMOTE_BLOCK = 8 << 20
MIN_BLOCK = 64 << 10


@dataclass(frozen=True)
class Hashed:
    name: str
    size: int
    digest: str | None  # None when the file could not be read whole (error says why)
    error: CkptError | None = None


def block_bytes(storage: Storage, memory: int, workers: int) -> int:
    """Each worker's buffer: the default block, smaller when `memory` asks for it."""
    block = LOCAL_BLOCK if storage.local_root is not None else REMOTE_BLOCK
    return max(MIN_BLOCK, min(block, memory // max(1, workers)))


def sha256_file(storage: Storage, name: str, size: int, buffer: bytearray,
                advance: Callable[[int], None] = lambda n: None) -> str:
    """The sha256 of `name`'s first `size` bytes, read block by block into `buffer`; an error if shorter."""
    # (imported where a file is hashed: validate of a checkpoint without a manifest, and a convert's
    # or reshard's preflight, import this module and hash nothing)
    import hashlib

    h = hashlib.sha256()
    view = memoryview(buffer)
    for start in range(0, size, len(buffer)):
        part = view[: min(len(buffer), size - start)]
        storage.read_range_into(name, start, part)
        h.update(part)
        advance(len(part))
    if size == 0:
        storage.read_range(name, 0, 0)  # still opened: an unreadable empty file is not a verified one
    return h.hexdigest()


def hash_files(
    storage: Storage,
    names: Sequence[str],
    *,
    workers: int,
    memory: int,
    progress: Progress = no_progress,
    sizes: dict[str, int] | None = None,
) -> list[Hashed]:
    """Every named file's size and sha256, in the order given. A file that cannot be read is
    returned with its error (the caller decides: a write stops, a verify reports it); a path that
    leaves the checkpoint raises PathEscapeError."""
    if not names:
        return []
    sizes = dict(sizes or {})
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckpt-sha256") as pool:
        # sizes first (a stat locally, a request each remotely: in parallel too)
        unknown = [n for n in names if n not in sizes]
        for name, size in zip(unknown, pool.map(lambda n: _size(storage, n), unknown)):
            sizes[name] = size
        total = sum(s for s in sizes.values() if s >= 0)
        block = block_bytes(storage, memory, workers)
        local = threading.local()
        lock = threading.Lock()
        done = [0]
        progress("hash", 0, total)

        def advance(n: int) -> None:
            with lock:
                done[0] += n
                progress("hash", done[0], total)

        def one(name: str) -> Hashed:
            size = sizes[name]
            if size < 0:
                return Hashed(name, -1, None, CkptError("missing", name))
            buffer = getattr(local, "buffer", None)
            if buffer is None:
                buffer = local.buffer = bytearray(block)
            try:
                return Hashed(name, size, sha256_file(storage, name, size, buffer, advance))
            except PathEscapeError:
                raise
            except CkptError as exc:
                return Hashed(name, size, None, exc)

        largest_first = sorted(names, key=lambda n: -sizes[n])
        results = {h.name: h for h in pool.map(one, largest_first)}
    return [results[n] for n in names]


def _size(storage: Storage, name: str) -> int:
    """The file's size; -1 when it is missing."""
    try:
        return storage.size(name)
    except NotFoundError:
        return -1
    except PathEscapeError:
        raise
    except CkptError as exc:
        if exc.code == "not-found":
            return -1
        raise
