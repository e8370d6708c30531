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
cache of ours. Off on gVisor, where the hints do nothing but sync (_gvisor).
"""
from __future__ import annotations

import functools
import os
import queue
import stat
import threading
from collections import deque
from typing import Callable

# the output a writer leaves cached before the oldest part is dropped
DEFAULT_WINDOW_BYTES = 64 * 2**20
# writeback starts once per this many bytes written (the span of the writes since the last start)
START_BYTES = 4 * 2**20

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* from <fcntl.h>


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), which Python's os module does not offer.

    Looked up on first use, not at import: inspect and validate import this
    module through storage/ and never write.
    """
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # the process's libc
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _gvisor() -> bool:
    """Whether this is gVisor's kernel (TPU VMs run their jobs in it), by the version it reports.

    There, posix_fadvise does nothing and sync_file_range with WAIT_AFTER syncs the whole file
    (gvisor.dev/issue/1897): the hints drop nothing and turn every 64 MiB written into a
    full fsync. On a TPU VM, 2.3 GiB converted to DCP took 7.8 s with them and 7.3 s without.
    """
    try:
        with open("/proc/version") as fh:
            return fh.read().startswith("Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016")
    except OSError:
        return False


_fadvise = getattr(os, "posix_fadvise", None)


@functools.cache
def enabled() -> bool:
    """Whether the hints are given: where fadvise exists and the kernel is not gVisor.

    CKPT_PAGECACHE=0 / =1 turns them off / on whatever the kernel (bench/tpu_host.py's profile
    compares both). Decided on the first write, not at import: inspect and validate import this
    module through storage/ and never write."""
    setting = os.environ.get("CKPT_PAGECACHE", "")
    return _fadvise is not None and setting != "0" and (setting == "1" or not _gvisor())


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Queue the range for writing to disk without waiting for it."""
    sync_file_range = _sync_file_range()
    if sync_file_range is not None:
        sync_file_range(fd, offset, length, _WRITE)


def _drop(fd: int, offset: int = 0, length: int = 0) -> None:
    """Let the kernel free the range's clean pages (dirty ones stay)."""
    if _fadvise is not None:
        try:
            _fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _write_and_drop(fd: int, offset: int, length: int) -> None:
    """Wait until the range is on disk, then let the kernel free its pages.

    `length` 0 means to the end of the file. Clean pages only are dropped, so
    a range still being written elsewhere simply stays cached.
    """
    if not enabled():
        return
    sync_file_range = _sync_file_range()
    try:
        if sync_file_range is not None:
            sync_file_range(fd, offset, length, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
        else:
            os.fdatasync(fd)
    except OSError:
        return
    _drop(fd, offset, length)


class _Background:
    """The one thread per process that waits for the disk and drops pages.

    Writer threads only queue that work: waiting for writeback in a writer
    thread kept it from reading the next chunk (a reshard's copy threads
    spent a fifth of their time there, and the CPUs idled meanwhile). Owners
    count their queued jobs so they can wait for them before closing a file.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] | None = None
        if hasattr(os, "register_at_fork"):
            # a forked child has no copy of the thread: it starts its own
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._jobs = None

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                # a daemon: a job left queued at exit is a hint nobody needs
                threading.Thread(target=self._run, args=(self._jobs,), name="ckpt-pagecache", daemon=True).start()
            jobs = self._jobs
        jobs.put(job)

    @staticmethod
    def _run(jobs: "queue.SimpleQueue[Callable[[], None]]") -> None:
        while True:
            job = jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - hints only (see the module docstring)
                pass


_BACKGROUND = _Background()


class _Jobs:
    """An owner's queued background jobs, so that it can wait for them all."""

    def __init__(self) -> None:
        self._done = threading.Condition()
        self._queued = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._done:
            self._queued += 1

        def run() -> None:
            try:
                job()
            finally:
                with self._done:
                    self._queued -= 1
                    self._done.notify_all()

        _BACKGROUND.submit(run)

    def wait(self) -> None:
        with self._done:
            self._done.wait_for(lambda: self._queued == 0)


class WriteBehind:
    """Writeback and dropping for one file that we write ourselves, from several threads.

    Call `written(offset, length)` after each write; writeback of that range
    starts at once, and once more than `window` bytes are waiting, the oldest
    ranges are waited for and dropped in the background. `finish()` after
    the final fsync drops the rest; `close()` (for a file being thrown away)
    only waits for the background work. Call one of them before closing the
    file descriptor.
    """

    def __init__(self, fd: int, window: int | None = None) -> None:
        self._fd = fd
        self._window = DEFAULT_WINDOW_BYTES if window is None else window
        self._lock = threading.Lock()
        self._ranges: deque[tuple[int, int]] = deque()
        self._waiting = 0
        self._jobs = _Jobs()
        # writes not yet handed to writeback: their span and size
        self._unstarted = 0
        self._span: tuple[int, int] | None = None

    def written(self, offset: int, length: int) -> None:
        if not enabled() or length <= 0:
            return
        begin: tuple[int, int] | None = None
        with self._lock:
            # one sync_file_range per START_BYTES written, over the span of the
            # writes since the last one: a call per small write (13,500 archives
            # of 1 to 16 KiB) cost more than the writes themselves
            lo, hi = self._span or (offset, offset + length)
            self._span = (min(lo, offset), max(hi, offset + length))
            self._unstarted += length
            if self._unstarted >= START_BYTES:
                begin, self._span, self._unstarted = self._span, None, 0
            self._ranges.append((offset, length))
            self._waiting += length
            while self._waiting > self._window and self._ranges:
                start, size = self._ranges.popleft()
                self._waiting -= size
                self._jobs.submit(functools.partial(_write_and_drop, self._fd, start, size))
        if begin is not None:
            _start_writeback(self._fd, begin[0], begin[1] - begin[0])

    def finish(self) -> None:
        """Drop whatever is still cached (call after fsync: nothing is left to wait for)."""
        self.close()
        if enabled():
            _write_and_drop(self._fd, 0, 0)

    def wait(self) -> None:
        """Wait for the background work queued so far."""
        self._jobs.wait()

    def close(self) -> None:
        """Wait for the background work on this file (and queue no more)."""
        with self._lock:
            self._ranges.clear()
            self._waiting = 0
        self._jobs.wait()


class DirectoryDropper:
    """Dropping for the files another library writes into a directory (tensorstore's OCDBT data files).

    The caller reports the bytes it knows to be written (`written(n)`, e.g.
    after each OCDBT commit); every `window` bytes a background sweep starts
    writeback of the directory's files and drops what is on disk. A file
    seen with the same size and mtime in two sweeps in a row is taken for
    finished: it is waited for, dropped and then left alone, so each sweep
    costs a directory listing plus the files still growing. `finish()` waits
    for the sweeps and drops every file.
    """

    def __init__(self, directory: str, window: int | None = None) -> None:
        self._dir = directory
        self._window = DEFAULT_WINDOW_BYTES if window is None else window
        self._lock = threading.Lock()
        self._unswept = 0
        self._sweep_queued = False
        self._seen: dict[str, tuple[int, int]] = {}
        self._finished: set[str] = set()
        self._jobs = _Jobs()

    def written(self, nbytes: int) -> None:
        if not enabled():
            return
        with self._lock:
            self._unswept += nbytes
            if self._unswept < self._window or self._sweep_queued:
                return  # not yet, or a sweep is queued that will see these bytes too
            self._unswept = 0
            self._sweep_queued = True
        self._jobs.submit(self._sweep)

    def wait(self) -> None:
        """Wait for the sweeps queued so far."""
        self._jobs.wait()

    def finish(self) -> None:
        """Drop every file once more, after the last write is committed (a
        file taken for finished too early is caught here)."""
        if enabled():
            self._jobs.wait()
            self._sweep(every_file=True)

    def _sweep(self, every_file: bool = False) -> None:
        with self._lock:
            self._sweep_queued = False
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
            settled = every_file or self._seen.get(entry.name) == state
            if settled:
                self._finished.add(entry.name)
                self._seen.pop(entry.name, None)
            else:
                self._seen[entry.name] = state
            try:
                fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                continue
            try:
                if settled:
                    _write_and_drop(fd, 0, 0)
                else:  # still growing, maybe: start its writeback, wait for it next time
                    _start_writeback(fd, 0, 0)
                    _drop(fd)
            finally:
                os.close(fd)
