"""A local directory as a storage root: values read by pread/preadv, every read contained.

Reads go through the file system (local.py), not through tensorstore's file kvstore: a byte range
goes straight into the caller's buffer. Listing too (list_keys: the file kvstore's own rule), so that
a root opened for reading opens no kvstore and imports no tensorstore until something asks for one
(issue 46: ~0.1 s of a `ckpt inspect`). Whole-value writes too (write: as the file kvstore writes
them, fsynced, so that a local Orbax write imports no tensorstore); deletes go through the file
kvstore. Every key read is checked against the root's links and
special files (containment.py); roots opened for reading also scan a directory once before
tensorstore opens anything under it (guard).
"""
from __future__ import annotations

import errno
import os
import stat
from typing import Any

from ..base import directio
from ..base.errors import CkptError, NotFoundError, PathEscapeError
from ..base.pagecache import DirectoryDropper
from . import local as localfs
from .backend import Backend, Capabilities, missing
from .containment import _Containment, check_local_path
from .local import LocalFileWriter, _os_error

# the file kvstore's lock files, which it leaves out of its listings (tensorstore's kLockSuffix)
_LOCK_SUFFIX = ".__lock"

_CAPABILITIES = Capabilities(writable=True, local_files=True, symlinks=True, deadlines=False, bulk_reads=False)


class LocalBackend(Backend):
    """A local directory (a path or file:// URL)."""

    def __init__(self, kvstore: Any, url: str, spec: dict[str, Any], root: str, *,
                 containment: _Containment | None = None, contain_base: str = "",
                 reads: localfs.ReadDescriptors | None = None) -> None:
        super().__init__(kvstore, url, spec)
        self.root = root
        # bulk reads' open files, shared with this root's children (keyed by absolute path)
        self._reads = reads if reads is not None else localfs.ReadDescriptors()
        # directories made (and checked) for create_local_file: whether their files go O_DIRECT
        self._made_dirs: dict[str, bool] = {}
        # roots opened for reading: the scan behind guard(), and where this root sits in it
        self._containment = containment
        self._contain_base = contain_base
        self._real_root: str | None = None

    @classmethod
    def open(cls, spec: dict[str, Any], url: str, root: str) -> LocalBackend:
        """The existing directory `root` (named `url`), for reading: its containment scan starts empty."""
        try:
            st = os.stat(root)
        except FileNotFoundError:
            raise NotFoundError("no such directory", url) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PathEscapeError("symlink loop (Too many levels of symbolic links)", url) from None
            raise CkptError(f"cannot open: {exc.strerror or exc}", url) from None
        if not stat.S_ISDIR(st.st_mode):
            raise NotFoundError("is a file, not a checkpoint directory", url)
        # (its kvstore is opened when first used: Backend.kvstore)
        return cls(None, url, spec, root, containment=_Containment(root))

    @classmethod
    def create(cls, spec: dict[str, Any], url: str, root: str) -> LocalBackend:
        """The directory `root` (named `url`) as a destination, made if needed."""
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise _os_error(exc, "cannot create", url) from None
        # (its kvstore is opened when first used, as a read root's: Backend.kvstore)
        return cls(None, url, spec, root)

    @property
    def kind(self) -> str:
        return "local"

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    @property
    def local_root(self) -> str | None:
        return self.root

    def child(self, rel: str) -> LocalBackend:
        # (Storage.child has checked `rel` is a directory inside the root)
        kvstore = self._kvstore / (rel + "/") if self._kvstore is not None else None  # else opened when used
        return LocalBackend(kvstore, f"{self.url}/{rel}", self.spec_for(rel + "/"),
                            os.path.join(self.root, rel), containment=self._containment,
                            contain_base=self._contained(rel), reads=self._reads)

    # -- containment -----------------------------------------------------------------------
    def check_key(self, rel: str, *, want_dir: bool) -> None:
        if self._real_root is None:  # (the root is resolved once: it was opened, not replaced, by then)
            self._real_root = os.path.realpath(self.root)
        check_local_path(self.root, rel, self.url, self.where(rel), want_dir=want_dir, real_root=self._real_root)

    def guard(self, rel: str) -> None:
        if self._containment is None:
            return  # a destination: what is there is ours
        problems = self._containment.check(self._contained(rel))
        if problems:
            path, message, _loop = problems[0]
            root = self._containment.root
            raise PathEscapeError(message, os.path.join(root, path) if path else root)

    def containment_problems(self) -> list[tuple[str, str]]:
        if self._containment is None:
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

    # -- reading ---------------------------------------------------------------------------
    def list_keys(self, prefix: str) -> list[str]:
        """Every file under `prefix`, as tensorstore's file kvstore lists them (tests/storage/test_local_listing.py
        holds the two equal): directories are walked, a link is a key and is not followed (a link to a
        directory too), a FIFO or socket is a key, its own `*.__lock` files are not; the directory
        `prefix` names is opened as the file system opens a path (links in it followed)."""
        top = os.path.join(self.root, prefix) if prefix else self.root
        keys: list[str] = []
        stack = [(top, prefix)]
        while stack:
            directory, rel = stack.pop()
            try:
                with os.scandir(directory) as it:
                    entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            except FileNotFoundError:
                if directory == top:
                    return []  # nothing under that prefix (the kvstore lists none)
                continue  # gone since its parent was listed
            except NotADirectoryError:
                if directory == top:  # a file (the kvstore: "Cannot list non-directory")
                    raise CkptError("cannot list keys: not a directory", self.where(rel.rstrip("/"))) from None
                continue  # replaced by a file since its parent was listed
            except OSError as exc:
                raise _os_error(exc, "cannot list keys", self.where(rel.rstrip("/")) if rel else self.url) from None
            for name, is_dir in entries:
                if is_dir:
                    stack.append((os.path.join(directory, name), f"{rel}{name}/"))
                elif not name.endswith(_LOCK_SUFFIX):
                    keys.append(rel + name)
        keys.sort()
        return keys

    def exists(self, rel: str) -> bool:
        return os.path.lexists(os.path.join(self.root, rel))

    def read(self, rel: str, byte_range: slice | None) -> bytes:
        # by pread, through the checked, non-blocking open (see read_into for why)
        with localfs.open_for_read(os.path.join(self.root, rel), self.where(rel)) as fd:
            if byte_range is None:
                return localfs.read_all(fd)
            return localfs.pread(fd, byte_range.start, byte_range.stop, self.where(rel))

    def read_into(self, rel: str, start: int, view: memoryview) -> None:
        """The bulk path for tensor data: the file is read straight into the caller's buffer with
        preadv (one copy, by the kernel). Through the file kvstore the same 2 GiB of DCP chunks took
        3.3 s instead of 0.3 s: tensorstore reads into fresh buffers of its own and hands them over
        as bytes, a copy or two more per chunk."""
        where = self.where(rel)
        # the containment check runs when the file is first opened (see ReadDescriptors)
        with self._reads.use(os.path.join(self.root, rel), where, lambda: self.check_key(rel, want_dir=False)) as fd:
            localfs.pread_into(fd, view, start, where)

    def check_readable(self, rel: str) -> None:
        # an open and a close, no read: what a stat cannot tell (a mode-000 file, a file of another
        # user's); the open is the non-blocking one of every read (a FIFO does not block it)
        with localfs.open_for_read(os.path.join(self.root, rel), self.where(rel)):
            pass

    def size(self, rel: str) -> int | None:
        try:
            return os.stat(os.path.join(self.root, rel)).st_size
        except FileNotFoundError:
            raise missing(self.where(rel)) from None
        except OSError as exc:
            raise _os_error(exc, "cannot stat", self.where(rel)) from None

    def stat(self, rel: str) -> tuple[int, float | None]:
        """The entry itself (lstat: a symlink is not followed, so nothing outside the root is
        touched), without the containment walk a read needs (a realpath per key: `ckpt ls` on a root
        of 2,200 files spent 1.1 s there)."""
        try:
            st = os.lstat(os.path.join(self.root, rel))
        except OSError as exc:
            raise _os_error(exc, "cannot stat", self.where(rel)) from None
        return st.st_size, st.st_mtime

    # -- writing ---------------------------------------------------------------------------
    def write(self, rel: str, data: bytes | bytearray) -> None:
        """The whole value at `rel`, as tensorstore's file kvstore writes it: into `<key>.__lock`
        beside it (a name listings leave out), fsynced, renamed over the key, its directory
        fsynced; a reader sees the old value or the new one, never a part. (Through the kvstore,
        the first write of a local run imported tensorstore: ~80 ms on a TPU host, issue 46.)"""
        path = os.path.join(self.root, rel)
        directory = os.path.dirname(path)
        temp = path + _LOCK_SUFFIX
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(temp, flags, 0o666)
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
            localfs.fsync_dir(directory)
        except OSError as exc:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise _os_error(exc, "cannot write", self.where(rel)) from None

    def create_local_file(self, rel: str, *, direct: bool | None = None) -> LocalFileWriter | None:
        """The bulk path for DCP data files: archives go from the caller's arrays to the file with
        pwritev, where a kvstore write first copies the whole file into a buffer of its own."""
        path = os.path.join(self.root, rel)
        directory = os.path.dirname(path)
        supported = self._made_dirs.get(directory)
        if supported is None:
            # once per directory: on a TPU VM's gVisor kernel a realpath per new file took 0.8 of a
            # reshard's busy thread-seconds, in the writing threads. The file itself is created
            # O_EXCL, which no entry put there (a link, a FIFO) gets through
            os.makedirs(directory, exist_ok=True)
            self.check_key(rel, want_dir=False)
            supported = self._made_dirs[directory] = directio.supported(directory)
        return LocalFileWriter(path, self.where(rel), direct=supported if direct is None else direct and supported)

    def page_cache_dropper(self, rel: str) -> DirectoryDropper | None:
        return DirectoryDropper(os.path.join(self.root, rel))

    def fsync_tree(self, rel: str, *, files: bool = True) -> None:
        localfs.fsync_tree(os.path.join(self.root, rel), self.where(rel), files=files)
