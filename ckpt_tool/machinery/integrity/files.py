"""A checkpoint's integrity manifest as files: where it is (Location), reading it, and checking a
directory against it (names and sizes without reading data; every file's sha256).

Shared machinery below the formats: the manifest package (`ckpt manifest`, validate) builds on
it, and Megatron's package checks the `integrity.json` of the saves inside a checkpoint with it.
Nothing here opens a checkpoint or names a format.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from ...base.errors import CkptError, CorruptMetadataError, NotFoundError, PathEscapeError
from ...base.findings import Progress, no_progress
from ...base.names import TMP_MARKER
from ...storage import Storage
from .schema import FILE, MAX_BYTES, SINGLE, Manifest, parse

TMP_PREFIX = ".integrity-tmp-"  # the manifest writer's own temporary while writing (never a file of the checkpoint)


@dataclass(frozen=True)
class Location:
    """Where a checkpoint's manifest is, and what it covers."""

    storage: Storage  # the checkpoint's directory: the manifest's names are relative to it
    single: str | None  # the checkpoint's one file, when it is one file
    home: Storage  # the directory the manifest file is in
    name: str  # the manifest's file name in `home`
    inside: str | None  # its key in `storage` when it sits inside the checkpoint (never one of its files)
    explicit: bool = False  # given with --manifest

    @property
    def url(self) -> str:
        return f"{self.home.url.rstrip('/')}/{self.name}"

    @property
    def label(self) -> str:
        """How findings name it: relative to the checkpoint when inside it."""
        return self.inside or self.url

    def present(self) -> bool:
        return self.home.exists(self.name)


def at(storage: Storage, name: str = FILE) -> Location:
    """The manifest `name` inside a checkpoint directory already open (validate's, Megatron's saves)."""
    return Location(storage, None, storage, name, name)


def read(loc: Location) -> Manifest:
    """The manifest, checked (CorruptMetadataError naming it; NotFoundError when absent)."""
    try:
        size = loc.home.size(loc.name)
    except NotFoundError:
        raise NotFoundError("no integrity manifest here", loc.url) from None
    if size > MAX_BYTES:
        raise CorruptMetadataError(f"{size:,} bytes: not an integrity manifest", loc.label)
    return parse(loc.home.read(loc.name), loc.label)


def checkpoint_files(loc: Location) -> list[str]:
    """The files a tree manifest covers: every file under the checkpoint directory but the
    manifest itself and ckpt's own temporaries (a convert's `.ckpt-tmp` output, a manifest being
    written)."""
    if loc.single is not None:
        return [loc.single]
    return [k for k in loc.storage.list() if k != loc.inside and not _temporary(k, TMP_MARKER)]


def _temporary(key: str, marker: str) -> bool:
    return any(marker in part or part.startswith(TMP_PREFIX) for part in key.split("/"))


def check_shallow(loc: Location, findings: Any, *, covers: Callable[[str], bool] | None = None,
                  workers: int = 4) -> Manifest | None:
    """No data read: the manifest readable (`bad-metadata`), every file it names present
    (`missing-file`) with its recorded size (`size-mismatch`, when sizes are recorded), and the
    checkpoint's files it does not name (`unlisted-file`, a warning). `covers(name)`: which
    top-level files another writer's manifest (Megatron's: its save's files) is meant to name."""
    try:
        manifest = read(loc)
    except PathEscapeError:
        raise
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=loc.label)
        return None
    findings.count("manifest_files", len(manifest.files))
    listing = set(loc.storage.list()) if loc.single is None else set()
    present = []
    for name in manifest.files:
        if name in listing:
            present.append(name)
            continue
        try:
            there = loc.storage.exists(name)
        except PathEscapeError as exc:
            findings.error("path-escape", f"{loc.label} names it: {exc.message}", file=name)
            continue
        if there:
            present.append(name)
        else:
            findings.error("missing-file", f"named by {loc.label}, which records its sha256", file=name)
    if manifest.sizes:
        recorded = [n for n in present if n in manifest.sizes]
        for name, size in zip(recorded, _sizes(loc.storage, recorded, workers)):
            if size is not None and size != manifest.sizes[name]:
                findings.error("size-mismatch", f"{size:,} bytes where {loc.label} records {manifest.sizes[name]:,}: "
                               "not the file the manifest was written from", file=name)
    for name in _unlisted(loc, manifest, listing, covers):
        findings.warning("unlisted-file", f"not named by {loc.label}: added after the manifest was written, so "
                         "not protected by it", file=name)
    return manifest


def _sizes(storage: Storage, names: list[str], workers: int) -> list[int | None]:
    def one(name: str) -> int | None:
        try:
            return storage.size(name)
        except PathEscapeError:
            raise
        except (CkptError, OSError):
            return None  # gone since the listing: the digest check says so
    if storage.local_root is not None or len(names) < 2:
        return [one(n) for n in names]
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckpt-stat") as pool:
        return list(pool.map(one, names))


def _unlisted(loc: Location, manifest: Manifest, listing: set[str], covers: Callable[[str], bool] | None) -> list[str]:
    if loc.single is not None or manifest.scope == SINGLE:
        return []  # a one-file checkpoint: the directory's other files are not its own
    if manifest.ours:  # every file under the directory when it was written
        return [k for k in checkpoint_files(loc) if k not in manifest.files]
    # another writer's (Megatron's): the files directly in the directory
    top = sorted(loc.storage.listdir()[1])
    return [k for k in top if k not in manifest.files and k != loc.inside and (covers is None or covers(k))]


def check_digests(
    loc: Location,
    findings: Any,
    *,
    workers: int = 4,
    memory: int = 512 << 20,
    progress: Progress = no_progress,
) -> tuple[Manifest, list[str]] | None:
    """Every named file hashed against the manifest (`digest-mismatch` naming the file): the
    manifest and the files that differ (None: it is unreadable). An unreadable manifest or a
    missing file was reported by check_shallow."""
    try:
        manifest = read(loc)
    except CkptError:
        return None
    listing = set(loc.storage.list()) if loc.single is None else set()  # one LIST, not a request per file
    names = []
    for name in sorted(manifest.files):
        try:
            if name in listing or loc.storage.exists(name):
                names.append(name)
        except PathEscapeError:
            continue  # reported by the shallow check
    from .hashing import hash_files  # (a manifest's digests checked: --deep, `ckpt manifest verify`)

    hashed = hash_files(loc.storage, names, workers=workers, memory=memory, progress=progress)
    verified = 0
    differs = []
    for h in hashed:
        if h.error is not None:
            findings.error("digest-mismatch", f"cannot be read whole to verify its sha256: {h.error.message}",
                           file=h.name)
            differs.append(h.name)
        elif h.digest != manifest.files[h.name]:
            # (a file hashed without error always has its digest: the `or` only satisfies the type)
            findings.error("digest-mismatch", f"sha256 {(h.digest or '')[:16]}... differs from {loc.label}'s "
                           f"{manifest.files[h.name][:16]}...: not the bytes the manifest was written from",
                           file=h.name)
            differs.append(h.name)
        else:
            verified += 1
    findings.count("sha256_verified", verified)
    return manifest, differs
