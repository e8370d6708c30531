"""Containment: no key, link or special file takes a read out of a local root.

Keys are checked before they reach any store: no `..`, no absolute key
(`_check_relative`). Local roots are contained: every key read is checked
(no symlink out of the root, regular files only, `check_local_path`; the
open itself is non-blocking, so a FIFO swapped in never blocks: local.py),
and before tensorstore opens a directory itself (an OCDBT database, a
plain zarr array) the directory is scanned once per run for links out,
symlink loops and FIFOs, devices or sockets (`_Containment`, behind
Storage.guard).

One exception, for the layout huggingface_hub gives every model it caches: a snapshot's files
are links into its repository's blobs/ folder, which a snapshot may read (`in_hub_blobs`).

These are the rules that make a hostile checkpoint harmless; they are kept
together, apart from the reading itself, so they can be read (and
audited) in one place.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import threading

from ..base.errors import NotFoundError, PathEscapeError
from .local import _os_error


def _check_relative(key: str, where: str) -> str:
    """Refuse keys that are absolute or climb out of the root."""
    if "\x00" in key:
        raise PathEscapeError(f"path {key!r} contains a NUL byte", where)
    if ".." not in key and "\\" not in key and "//" not in key and not key.startswith(("/", "./")) and ":" not in key[:3] and "/./" not in key:
        return key.rstrip("/") if key.endswith("/") else key  # the common, clean case, checked cheaply
    if key.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:[\\/]", key):
        raise PathEscapeError(f"absolute path {key!r} escapes the checkpoint", where)
    parts = re.split(r"[\\/]", key)
    if any(p == ".." for p in parts):
        raise PathEscapeError(f"path {key!r} escapes the checkpoint", where)
    return "/".join(p for p in parts if p not in ("", "."))


# huggingface_hub's cache: every file of <cache>/models--org--name/snapshots/<revision>/ (what
# from_pretrained opens) is a link to ../../blobs/<hash>, one regular file each; a snapshot, or a
# folder in it, may read those (and only those) from outside itself
_HUB_SNAPSHOT = re.compile(r"^(?P<repo>.+/(?:models|datasets|spaces)--[^/]+)/snapshots/[^/]+(?:/.*)?$")


def in_hub_blobs(real: str, real_root: str) -> bool:
    """Whether `real` is a blob of the Hugging Face hub cache repository whose snapshot holds
    `real_root` (both resolved paths)."""
    m = _HUB_SNAPSHOT.match(real_root)
    if m is None:
        return False
    blobs = os.path.join(m.group("repo"), "blobs") + os.sep
    return real.startswith(blobs) and os.sep not in real[len(blobs):]


def check_local_path(local_root: str, rel: str, url: str, where: str, *, want_dir: bool,
                     real_root: str | None = None) -> None:
    """Refuse symlinks leading out of the root and anything but files/dirs (`where`: the key's URL).
    `real_root`: the root's realpath, where the caller keeps it (each realpath is an lstat per
    path component: on a TPU VM's gVisor kernel, about 0.2 ms each)."""
    root = real_root or os.path.realpath(local_root)
    path = os.path.join(local_root, rel)
    real = os.path.realpath(path)
    if real != root and not real.startswith(root + os.sep) and (want_dir or not in_hub_blobs(real, root)):
        raise PathEscapeError(f"{rel!r} resolves to {real}, outside the checkpoint", url)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return  # reported as missing by the read itself
    except OSError as exc:
        raise _os_error(exc, "cannot stat", where) from None
    if want_dir:
        if not stat.S_ISDIR(st.st_mode):
            raise NotFoundError("not a directory", where)
    elif not stat.S_ISREG(st.st_mode):
        raise PathEscapeError("not a regular file (refusing to open a FIFO, device or socket)", where)


class _Containment:
    """What one scan of a local checkpoint found: links out, loops, non-regular files.

    Built per opened root and shared by its children; each sub-directory is
    scanned once, when tensorstore is first about to open something under it.
    A symlink is followed only to resolve it, never walked: a link to a
    directory inside the root is checked through the target's own scan.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self._lock = threading.Lock()
        self._scanned: set[str] = set()  # sub-directories (relative, "" = root) already walked
        self.problems: dict[str, tuple[str, bool]] = {}  # rel -> (message, is a loop)
        self._linked_dirs: dict[str, str] = {}  # rel of a link to a directory inside -> rel of its target

    def _inside(self, real: str) -> bool:
        return real == self.real_root or real.startswith(self.real_root.rstrip(os.sep) + os.sep)

    def _covered(self, rel: str) -> bool:
        return any(s == "" or rel == s or rel.startswith(s + "/") for s in self._scanned)

    def _scan(self, rel: str) -> None:
        stack = [rel]
        while stack:
            d = stack.pop()
            path = os.path.join(self.root, d) if d else self.root
            try:
                entries = list(os.scandir(path))
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    self.problems[d] = ("symlink loop (Too many levels of symbolic links)", True)
                elif exc.errno != errno.ENOTDIR:
                    self.problems[d] = (f"cannot list: {exc.strerror or exc}", False)
                continue
            for entry in entries:
                sub = f"{d}/{entry.name}" if d else entry.name
                try:
                    if entry.is_symlink():
                        self._check_link(sub, entry.path)
                    elif entry.is_dir(follow_symlinks=False):
                        stack.append(sub)
                    elif not entry.is_file(follow_symlinks=False):
                        self.problems[sub] = ("not a regular file (refusing to open a FIFO, device or socket)", False)
                except OSError as exc:
                    self.problems[sub] = (f"cannot stat: {exc.strerror or exc}", False)
        self._scanned.add(rel)

    def _check_link(self, rel: str, path: str) -> None:
        real = os.path.realpath(path)
        if not self._inside(real) and not (in_hub_blobs(real, self.real_root) and os.path.isfile(real)):
            self.problems[rel] = (f"symlink to {real}, outside the checkpoint", False)
            return
        try:
            st = os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self.problems[rel] = ("symlink loop (Too many levels of symbolic links)", True)
            # a dangling link inside the root: the read reports it missing
            return
        if stat.S_ISDIR(st.st_mode):
            target = os.path.relpath(real, self.real_root).replace(os.sep, "/")
            self._linked_dirs[rel] = "" if target == "." else target
        elif not stat.S_ISREG(st.st_mode):
            self.problems[rel] = ("symlink to a FIFO, device or socket (refusing to open it)", False)

    def check(self, rel: str) -> list[tuple[str, str, bool]]:
        """Every problem at, under or above `rel` (relative to the root; "" = all): (path, message, loop)."""
        with self._lock:
            found: list[tuple[str, str, bool]] = []
            todo, seen = [rel], set()
            while todo:
                r = todo.pop()
                if r in seen:
                    continue
                seen.add(r)
                if not self._covered(r):
                    self._scan(r)
                for p, (msg, loop) in self.problems.items():
                    if not r or p == r or p.startswith(r + "/") or r.startswith(p + "/"):
                        found.append((p, msg, loop))
                # links to directories inside the root: their targets are read too
                for p, t in self._linked_dirs.items():
                    if not r or p == r or p.startswith(r + "/"):
                        todo.append(t)
                    elif r.startswith(p + "/"):  # `rel` is reached through the link
                        todo.append((t + "/" if t else "") + r[len(p) + 1 :])
            return sorted(set(found))
