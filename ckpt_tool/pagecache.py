"""Keep a conversion's output from piling up in the page cache.

convert and reshard write their whole output once and never read it back.
Left alone, the kernel keeps every written page cached until memory runs
short: a 2 TB conversion evicts everything else the host had cached, and
every page of output costs a fresh page allocation (on a VM, a fault into
the hypervisor per page: writing 2 GiB into fresh page cache took 4.4 s
here, against 0.5 s into pages freed a moment before). So the writers start
writeback right behind themselves and drop what has reached the disk: the
output keeps a window of a few tens of MiB in the cache, and the next writes
reuse the pages just freed. Peak memory and the bytes on disk are unchanged.

Nothing here decides correctness: the writers still fsync every file before
a checkpoint is committed, and fsync reports any write error. So failures of
these hints (a file system without sync_file_range or fadvise, a file
removed under us) are ignored. Local files only: object stores have no page
cache of ours.
"""
from __future__ import annotations

import functools
import os
import stat
import threading
from collections import deque
from typing import Callable

# the output a writer leaves cached before the oldest part is dropped
DEFAULT_WINDOW_BYTES = 64 * 2**20

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* from <fcntl.h>


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), which Python's os module does not offer.

    Looked up on first use, not at import: inspect and validate import this
    module through storage.py and never write.
    """
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # the process's libc
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_fadvise = getattr(os, "posix_fadvise", None)
ENABLED = _fadvise is not None


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Queue the range for writing to disk without waiting for it."""
    sync_file_range = _sync_file_range()
    if sync_file_range is not None:
        sync_file_range(fd, offset, length, _WRITE)


def _write_and_drop(fd: int, offset: int, length: int) -> None:
    """Wait until the range is on disk, then let the kernel free its pages.

    `length` 0 means to the end of the file. Clean pages only are dropped, so
    a range still being written elsewhere simply stays cached.
    """
    if _fadvise is None:
        return
    sync_file_range = _sync_file_range()
    try:
        if sync_file_range is not None:
            sync_file_range(fd, offset, length, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
        else:
            os.fdatasync(fd)
        _fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


class WriteBehind:
    """Writeback and dropping for one file that we write ourselves, from several threads.

    Call `written(offset, length)` after each write; writeback of that range
    starts at once, and once more than `window` bytes are waiting, the oldest
    ranges are waited for and dropped. `finish()` after the final fsync
    drops the rest.
    """

    def __init__(self, fd: int, window: int | None = None) -> None:
        self._fd = fd
        self._window = DEFAULT_WINDOW_BYTES if window is None else window
        self._lock = threading.Lock()
        self._ranges: deque[tuple[int, int]] = deque()
        self._waiting = 0

    def written(self, offset: int, length: int) -> None:
        if not ENABLED or length <= 0:
            return
        try:
            _start_writeback(self._fd, offset, length)
        except OSError:
            pass
        with self._lock:
            self._ranges.append((offset, length))
            self._waiting += length
            oldest = []
            while self._waiting > self._window and self._ranges:
                start, size = self._ranges.popleft()
                self._waiting -= size
                oldest.append((start, size))
        # outside the lock: the wait is for the disk, other threads go on writing
        for start, size in oldest:
            _write_and_drop(self._fd, start, size)

    def finish(self) -> None:
        """Drop whatever is still cached (call after fsync: nothing is left to wait for)."""
        with self._lock:
            self._ranges.clear()
            self._waiting = 0
        if ENABLED:
            _write_and_drop(self._fd, 0, 0)


class DirectoryDropper:
    """Dropping for the files another library writes into a directory (tensorstore's OCDBT data files).

    The caller reports the bytes it knows to be written (`written(n)`, e.g.
    after each OCDBT commit); every `window` bytes the directory's files are
    written back and dropped. A file seen with the same size and mtime in two
    sweeps in a row is taken for finished: it is dropped once more and then
    left alone, so each sweep costs a directory listing plus the files still
    growing. `finish()` drops every file.
    """

    def __init__(self, directory: str, window: int | None = None) -> None:
        self._dir = directory
        self._window = DEFAULT_WINDOW_BYTES if window is None else window
        self._lock = threading.Lock()
        self._sweeping = threading.Lock()
        self._unswept = 0
        self._seen: dict[str, tuple[int, int]] = {}
        self._finished: set[str] = set()

    def written(self, nbytes: int) -> None:
        if not ENABLED:
            return
        with self._lock:
            self._unswept += nbytes
            if self._unswept < self._window:
                return
            self._unswept = 0
        # one sweep at a time; a thread that finds one under way goes on writing
        if self._sweeping.acquire(blocking=False):
            try:
                self._sweep()
            finally:
                self._sweeping.release()

    def finish(self) -> None:
        """Drop every file once more, after the last write is committed (a
        file taken for finished too early is caught here)."""
        if ENABLED:
            with self._sweeping:
                self._sweep(every_file=True)

    def _sweep(self, every_file: bool = False) -> None:
        try:
            entries = list(os.scandir(self._dir))
        except OSError:
            return
        for entry in entries:
            if entry.name in self._finished and not every_file:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            state = (st.st_size, st.st_mtime_ns)
            if self._seen.get(entry.name) == state:
                self._finished.add(entry.name)
                self._seen.pop(entry.name, None)
            else:
                self._seen[entry.name] = state
            try:
                fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                continue
            try:
                _write_and_drop(fd, 0, 0)
            finally:
                os.close(fd)
