"""Local files: read by pread/preadv, written by pwritev, made durable by fsync.

A local root is read through the file system directly, not through
tensorstore's file kvstore: a byte range goes straight into the caller's
buffer (one copy, by the kernel), where the kvstore hands over bytes of
its own, a copy or two more per chunk. DCP and safetensors data files are
written the same way (`LocalFileWriter`), with O_DIRECT for large ranges
where the file system suits it (base/directio.py) and writeback behind the
writer (base/pagecache.py).

Every open for reading is non-blocking and checks the file is regular
(a FIFO swapped in after containment's check never blocks); OS errors
become one line naming the file. Which keys may be opened at all is
containment.py's business; which root is local is Storage's.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import os
import stat
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

from ..base import directio
from ..base.parallel import copy_workers
from ..base.errors import CkptError, NoSpaceError, NotFoundError, PathEscapeError, TruncatedFileError, UnreadableFileError
from ..base.pagecache import WriteBehind


@contextlib.contextmanager
def open_for_read(path: str, where: str) -> Iterator[int]:
    """A descriptor of the regular file at `path` (named `where` in errors); OS errors become one line."""
    fd = _open_regular(path, where)
    try:
        yield fd
    except OSError as exc:  # (an I/O error while reading it)
        raise _os_error(exc, "cannot read", where) from exc
    finally:
        os.close(fd)


class ReadDescriptors:
    """Descriptors of the files a root's bulk reads use, kept open from one read to the next.

    A chunk read used to open its data file, fstat it, pread and close it. On a TPU VM's gVisor
    kernel, whose file operations go to a separate file server, the opens and closes of a 2.3 GiB
    reshard took 2.7 of its 12 busy thread-seconds, as much as the preads: an OCDBT data file
    holds hundreds of chunks, and a streamed chunk is read window by window. Here a file is opened
    (and checked, by `check`) once and its descriptor shared by the threads reading it. At most
    `keep` descriptors no read is using stay open (the least recently used go first); the rest
    are closed when the last root sharing this object is dropped. A descriptor pins the file that
    was checked: a path swapped for a link afterwards is never read through it.
    """

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        # path -> [fd, reads using it]; idle ones in least recently used order
        self._open: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        # path -> set once the thread checking and opening it is done: the others wait for its
        # descriptor instead of each checking (a realpath: an lstat per path component) and opening
        # the file too, as 13 copy threads did with the first data file of a reshard on a TPU VM
        self._opening: dict[str, threading.Event] = {}
        weakref.finalize(self, _close_all, self._open)

    @contextlib.contextmanager
    def use(self, path: str, where: str, check: Callable[[], None]) -> Iterator[int]:
        """A descriptor of the regular file at `path`; `check()` runs before it is first opened."""
        entry = self._entry(path, where, check)
        try:
            yield entry[0]
        except OSError as exc:  # (an I/O error while reading it)
            raise _os_error(exc, "cannot read", where) from exc
        finally:
            with self._lock:
                entry[1] -= 1
                idle = [p for p, e in self._open.items() if not e[1]]
                closing = [self._open.pop(p)[0] for p in idle[: max(0, len(idle) - self._keep)]]
            for fd in closing:
                os.close(fd)

    def _entry(self, path: str, where: str, check: Callable[[], None]) -> list[int]:
        """The [fd, users] entry of `path`, counted as used once more; opened by one thread at a time."""
        while True:
            with self._lock:
                entry = self._open.get(path)
                if entry is not None:
                    entry[1] += 1
                    self._open.move_to_end(path)
                    return entry
                opening = self._opening.get(path)
                mine = opening is None
                if opening is None:
                    opening = self._opening[path] = threading.Event()
            if not mine:
                opening.wait()
                continue  # opened, or the opener failed: then this thread tries (and says why) itself
            try:
                check()
                fd = _open_regular(path, where)
                with self._lock:
                    entry = self._open[path] = [fd, 1]
                return entry
            finally:
                with self._lock:
                    del self._opening[path]
                opening.set()


def _close_all(open_fds: dict[str, list[int]]) -> None:
    for fd, _ in open_fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    open_fds.clear()


def _open_regular(path: str, where: str) -> int:
    """A read descriptor of the regular file at `path`: non-blocking, since a FIFO put in place
    after the containment check must not block the open, and refused unless a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise NotFoundError("missing", where) from None
    except OSError as exc:
        raise _os_error(exc, "cannot read", where) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise _os_error(exc, "cannot read", where) from None
    if not stat.S_ISREG(mode):  # swapped in after the check
        os.close(fd)
        raise PathEscapeError("not a regular file (refusing to read a FIFO, device or socket)", where)
    return fd


def read_all(fd: int) -> bytes:
    """The whole file behind `fd`, read to its end."""
    parts: list[bytes] = []
    want = max(os.fstat(fd).st_size, 1 << 16)
    while True:
        part = os.read(fd, want)
        if not part:
            return b"".join(parts)
        parts.append(part)


def pread(fd: int, start: int, end: int, where: str) -> bytes:
    """Bytes [start, end) of the file behind `fd`; an error if it is shorter."""
    data = os.pread(fd, end - start, start)
    if len(data) < end - start:  # a regular file reads short only at its end
        raise _truncated(fd, start, end, where)
    return data


def pread_into(fd: int, view: memoryview, start: int, where: str) -> None:
    """Fill the byte `view` from offset `start` of the file behind `fd` (preadv); an error if it is shorter."""
    size = view.nbytes
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:]], start + got)
        if n == 0:  # a regular file reads short only at its end
            raise _truncated(fd, start, start + size, where)
        got += n


def _truncated(fd: int, start: int, end: int, where: str) -> CkptError:
    size = os.fstat(fd).st_size
    return TruncatedFileError(f"truncated: needed bytes [{start}, {end}) but it has {size} bytes", where, size=size)


def fsync_tree(top: str, where: str, *, files: bool = True) -> None:
    """fsync every file (files=False: none) and directory under `top`, then `top` itself
    (`where`: it, as errors name it)."""
    try:
        for dirpath, _, names in os.walk(top, topdown=False):
            for name in names if files else ():
                _fsync_path(os.path.join(dirpath, name), os.O_RDONLY)
            _fsync_path(dirpath, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise _os_error(exc, "cannot write", where) from exc


def fsync_dir(path: str) -> None:
    """fsync the directory `path` (an entry made or renamed in it made durable)."""
    _fsync_path(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync_path(path: str, flags: int) -> None:
    fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# errors that say a file cannot be read at all, whatever is read from it: validate names the
# file once (unreadable-file), not every item stored in it
_UNREADABLE = frozenset({errno.EACCES, errno.EPERM, errno.EIO, errno.ENXIO})
# a full file system, or the user's quota on it
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def _os_error(exc: OSError, what: str, where: str) -> CkptError:
    """An OS error on a local path as one line (a symlink loop is a containment failure;
    permission denied and I/O errors are the file's, a full disk the file system's)."""
    if exc.errno == errno.ELOOP:
        return PathEscapeError("symlink loop (Too many levels of symbolic links)", where)
    return errno_error(exc.errno, exc.strerror or str(exc), what, where)


def errno_error(code: int | None, strerror: str, what: str, where: str) -> CkptError:
    """An OS error number met doing `what` on the file `where` as its one line, of the class that
    says whose it is: the file's (unreadable), the file system's (no space), or the input's.
    (Also for the errors tensorstore reports with their os_error_code.)"""
    if code in NO_SPACE:
        return NoSpaceError(f"{what}: {strerror}", where)
    if code in _UNREADABLE and what.startswith(("cannot read", "cannot stat")):
        return UnreadableFileError(f"{what}: {strerror}", where)
    return CkptError(f"{what}: {strerror}", where)


class FileCloser:
    """Closes (fsyncs) finished files on a few threads behind the writers that filled them.

    A copy thread that waited for the disk at each file's end held its next chunk back: on a TPU
    VM's gVisor kernel, where data reaches the disk only at fsync, 4 of the 30 busy thread-seconds
    of a 2.3 GiB convert. `wait()` waits for every close submitted so far and raises the first
    error; the threads start with the first close and end at each wait.

    One thread per copy worker (at least 4): there, an fsync is where the file's bytes are
    written, so it costs about what filling the file did. Four closers behind 13 copy threads
    were the slowest step of that convert: busy from its second second to its end, 1.1 s after
    the last chunk was written.
    """

    def __init__(self, name: str, threads: int | None = None, *, bound: int | None = None) -> None:
        """`bound`: at most this many submitted and not finished; submit() waits for a place (what
        each holds, an upload's bytes say, then stays within `bound` of them), and raises the first
        failure of those finished, so that a run whose upload failed stops making more."""
        self._name = name
        self._threads = threads or max(4, copy_workers())
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closing: list[Future[None]] = []
        self._places = threading.BoundedSemaphore(bound) if bound else None

    def submit(self, close: Callable[[], None]) -> None:
        places = self._places
        run: Callable[[], None] = close
        if places is not None:
            places.acquire()
            with self._lock:
                failed = next((f for f in self._closing if f.done() and f.exception() is not None), None)
            if failed is not None:
                places.release()
                failed.result()  # (raises its error)

            def run() -> None:
                try:
                    close()
                finally:
                    places.release()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
            self._closing.append(self._pool.submit(run))

    def wait(self) -> None:
        with self._lock:
            closing, self._closing = self._closing, []
            pool, self._pool = self._pool, None
        try:
            for fut in closing:
                fut.result()
        finally:
            if pool is not None:
                pool.shutdown(wait=True)


def place_range(direct: bool, cursor: int, length: int) -> tuple[int, int]:
    """Where a range of `length` bytes reserved at `cursor` of a file starts, and the next free
    cursor: aligned (start and length) if the file writes large ranges with O_DIRECT."""
    if direct and length >= directio.MIN_DIRECT_BYTES:
        start = directio.align_up(cursor)
        return start, start + directio.align_up(length)
    return cursor, cursor + length


class LocalFileWriter:
    """A new local file that several threads fill at offsets they reserved.

    `close()` fsyncs it, as tensorstore's file kvstore does for every value
    it writes; `discard()` just closes it (the output is being thrown away).
    Large ranges go to the disk with O_DIRECT where the file system suits it
    (see base/directio.py); `place()` then aligns them, so callers reserve their
    offsets through it. What is written buffered goes to disk behind the
    writer and leaves the page cache (see base/pagecache.py).
    """

    def __init__(self, path: str, where: str, *, direct: bool = False) -> None:
        self.where = where
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise _os_error(exc, "cannot create", where) from exc
        self._behind = WriteBehind(self._fd)
        self._direct_fd = -1
        if direct:
            try:  # a second descriptor, so small writes stay buffered
                self._direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))  # type: ignore[attr-defined]
            except OSError:
                pass  # the file system refuses O_DIRECT after all: all buffered
        self._direct = self._direct_fd >= 0  # cleared if the device refuses our alignment
        self._lock = threading.Lock()
        self._end = 0  # the end of the data written so far (direct writes' padding excluded)

    @property
    def direct(self) -> bool:
        """Whether large ranges go to the disk with O_DIRECT (so `place` aligns them)."""
        return self._direct

    def place(self, cursor: int, length: int) -> tuple[int, int]:
        """Where a range of `length` bytes reserved at `cursor` starts, and the next free cursor."""
        return place_range(self._direct, cursor, length)

    def write_at(self, offset: int, parts: Iterable[Any], *, padded: bool = True) -> None:
        """Write the buffers back to back from `offset` (reserved through `place`).

        padded=False: the range was not reserved through `place` as one piece
        (several small ranges written as one), so it must not be written
        direct, whose zeros up to the next 4 KiB would cover its neighbour.
        """
        views = [memoryview(p).cast("B") for p in parts]
        length = sum(v.nbytes for v in views)
        with self._lock:
            self._end = max(self._end, offset + length)
        if padded and self._direct and length >= directio.MIN_DIRECT_BYTES and not offset % directio.ALIGNMENT:
            try:
                directio.write_direct(self._direct_fd, offset, views)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise _os_error(exc, "cannot write", self.where) from exc
                # the device wants a coarser alignment than ALIGNMENT: write
                # this range buffered, and place the next ones unaligned (the
                # descriptor stays open until close: another thread may be using it)
                self._direct = False
        self._write_buffered(offset, views)

    def write_span(self, offset: int, data: Any) -> None:
        """Write `data` at `offset` of a file its format lays out itself (not reserved through
        `place`: a safetensors tensor, a universal checkpoint's storage): the whole blocks inside
        go direct; the ends, which share a block with the neighbouring range, are written
        buffered, as is a range too short to hold any direct block."""
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        start = directio.align_up(offset)
        stop = (offset + n) // directio.ALIGNMENT * directio.ALIGNMENT
        if stop - start >= directio.MIN_DIRECT_BYTES:
            head, body = start - offset, stop - offset
            if head:
                self.write_at(offset, [mv[:head]])
            self.write_at(start, [mv[head:body]])
            if body < n:
                self.write_at(stop, [mv[body:]])
        else:
            self.write_at(offset, [mv], padded=False)

    def _write_buffered(self, offset: int, views: list[memoryview]) -> None:
        start = offset
        try:
            while views:
                written = os.pwritev(self._fd, views, offset)
                if written == 0 and any(v.nbytes for v in views):
                    raise CkptError("cannot write: the file system took no bytes", self.where)
                offset += written
                # a short write (a signal, a full disk on the next call): go on from there
                while views and written >= views[0].nbytes:
                    written -= views[0].nbytes
                    views.pop(0)
                if views and written:
                    views[0] = views[0][written:]
        except OSError as exc:
            raise _os_error(exc, "cannot write", self.where) from exc
        self._behind.written(start, offset - start)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            if os.fstat(fd).st_size > self._end:
                os.ftruncate(fd, self._end)  # the zeros padding the last direct write
            os.fsync(fd)
            self._behind.finish()
        except OSError as exc:
            raise _os_error(exc, "cannot write", self.where) from exc
        finally:
            self._behind.close()  # after a failed fsync too: no background work may outlive the descriptor
            self._close_direct()
            os.close(fd)

    def discard(self) -> None:
        """Close without syncing (the output is being thrown away); a no-op once closed."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            self._behind.close()  # no background work may outlive the descriptor
            self._close_direct()
            try:
                os.close(fd)
            except OSError:
                pass

    def _close_direct(self) -> None:
        fd, self._direct_fd = self._direct_fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
