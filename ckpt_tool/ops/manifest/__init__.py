"""Integrity manifests: the sha256 of every file of a checkpoint, written once and checked later.

Format-neutral: a manifest names files, not leaves (with --tensors also each array leaf's
logical bytes), so one implementation serves every format and Megatron's own `integrity.json`
(see schema.py for the document). Where it lives:

- a checkpoint directory: `integrity.json` inside it, Megatron's name and place, so it travels
  with the checkpoint (cp -r, gsutil cp, aws s3 sync) and Megatron's
  `load(..., verify_integrity=True)` verifies one ckpt wrote; no format's reader or ckpt's
  checks look at a file of that name (tests/ops/manifest/test_manifest.py loads orbax and DCP saves with it);
- a checkpoint that is one file (model.safetensors): `model.safetensors.integrity.json` beside it;
- anywhere else with `--manifest FILE` (names stay relative to the checkpoint).

write() hashes (hashing.py) and writes atomically (a temporary file renamed over the final name;
on S3/GCS one PUT), never over a manifest another writer made unless asked (`overwrite`), and
never touches another file of the checkpoint. A manifest already there is the reference: the
digests just computed are compared with it (no second read), and a file it names that changed or
is gone makes write() refuse (ManifestMismatchError, one line per file) unless `rebaseline`
says the current state is the new reference; a file added since is no difference. check_shallow() (no data read: names, sizes) and
check_digests() (every file hashed; per-tensor digests named when a file differs) report
findings for `ckpt validate` and `ckpt manifest verify`; the core never prints (progress goes to
a callback).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...base.errors import CkptError, DestinationExistsError, NotFoundError, PathEscapeError, UsageError
from ...base.findings import Progress, no_progress
from ...storage import Storage
from ...base.text import is_ascii_number
from ...machinery.integrity import files
from ...machinery.integrity.files import TMP_PREFIX, Location, at, check_shallow, checkpoint_files, read
from ...machinery.integrity.schema import ALGORITHM, FILE, SINGLE, SINGLE_SUFFIX, TREE, Manifest, TensorDigest, render

if TYPE_CHECKING:
    from ...machinery.integrity.hashing import Hashed

__all__ = [
    "ALGORITHM", "FILE", "Location", "Manifest", "ManifestMismatchError", "TensorDigest", "WriteResult", "at",
    "check_digests", "check_shallow", "locate", "read", "write",
]


def locate(path: str, manifest: str | None = None, *, create: bool = False) -> Location:
    """The manifest of the checkpoint at `path`: its default place, or `manifest` (a file path or URL).
    `create`: the manifest's directory may be created (write)."""
    from ... import formats

    single = formats.split_file(path)
    if single is not None:
        directory, one = single[1]
        storage = Storage.open(directory)
    else:
        storage, one = Storage.open(path), None
    if manifest is None:
        name = f"{one}{SINGLE_SUFFIX}" if one else FILE
        return Location(storage, one, storage, name, name)
    home_url, name = _split(manifest)
    if not name:
        raise UsageError(f"--manifest {manifest}: not a file name")
    home = Storage.create(home_url) if create else Storage.open(home_url)
    inside = None
    # the same directory named two ways (relative and absolute paths): compare where they are
    base = os.path.realpath(storage.local_root) if storage.local_root else storage.url.rstrip("/")
    where = os.path.realpath(home.local_root) if storage.local_root and home.local_root else home.url.rstrip("/")
    if where == base:
        inside = name
    elif where.startswith(base + "/"):
        inside = f"{where[len(base) + 1:]}/{name}"
    return Location(storage, one, home, name, inside, explicit=True)


def _split(url: str) -> tuple[str, str]:
    """(directory, file name) of a local path or a URL."""
    if "://" not in url:
        path = os.path.abspath(os.path.expanduser(url))
        return os.path.dirname(path), os.path.basename(path)
    head, _, name = url.rstrip("/").rpartition("/")
    return head, name


# -- writing ------------------------------------------------------------------------------------


@dataclass
class WriteResult:
    """What `ckpt manifest write` wrote: where, how many files and bytes, and what it replaced."""

    url: str  # the manifest written
    files: int
    bytes: int
    tensors: int | None  # leaves digested (None: no --tensors)
    seconds: float
    replaced: str | None = None  # what was there before ("ckpt's manifest", "another writer's manifest")
    # with rebaseline: how the files differed from the manifest replaced (one line per file)
    rebaselined: tuple[str, ...] = ()
    added: int = 0  # files the manifest replaced did not name (added since it was written)


class ManifestMismatchError(CkptError):
    """The checkpoint no longer matches the manifest `ckpt manifest write` would replace: the
    damage (or a change) would become the reference. `details`: one line per file that differs."""

    code = "manifest-mismatch"

    def __init__(self, differences: list[str], label: str, where: str) -> None:
        self.details = tuple(differences)
        n = len(differences)
        super().__init__(
            f"{n} file{'s' * (n != 1)} differ{'s' * (n == 1)} from the sha256 {label} records "
            f"({'listed above' if n > 1 else differences[0]}): damage, or a change since it was written; "
            "refusing to make that the reference, nothing was written (--rebaseline records the files as they "
            "are now)",
            where,
        )


def write(
    path: str,
    *,
    manifest: str | None = None,
    tensors: bool = False,
    overwrite: bool = False,
    rebaseline: bool = False,
    workers: int = 4,
    memory: int = 512 << 20,
    progress: Progress = no_progress,
) -> WriteResult:
    """Hash every file of the checkpoint at `path` and write its manifest (see the module docstring).
    A manifest there already is compared with the files first: ManifestMismatchError where one it
    names changed or is gone, unless `rebaseline`. Pickles (--tensors opens the checkpoint) are
    unpickled within `memory`."""
    from ...machinery.torch_save.pickle_budget import memory_budget

    with memory_budget(memory):
        return _write(path, manifest=manifest, tensors=tensors, overwrite=overwrite, rebaseline=rebaseline,
                      workers=workers, memory=memory, progress=progress)


def _write(path: str, *, manifest: str | None, tensors: bool, overwrite: bool, rebaseline: bool, workers: int,
           memory: int, progress: Progress) -> WriteResult:
    from ... import formats
    from ...base.version import __version__

    started = time.monotonic()
    loc = locate(path, manifest, create=True)
    if loc.single is None:
        formats.detect_one(loc.storage)  # a checkpoint ckpt reads, not any directory (one line otherwise)
    replaced, existing = _replaceable(loc, overwrite)
    names = checkpoint_files(loc)
    from ...machinery.integrity.hashing import hash_files  # (validate looks for a manifest without it)

    hashed = hash_files(loc.storage, names, workers=workers, memory=memory, progress=progress)
    for h in hashed:
        if h.error is not None:
            raise CkptError(f"cannot be read to hash it: {h.error.message}", f"{loc.storage.url}/{h.name}")
    differences: list[str] = []
    added = 0
    if existing is not None:
        # before --tensors' digests (the expensive part): the reference is checked first
        differences = _differences(existing, hashed, loc.label)
        if differences and not rebaseline:
            raise ManifestMismatchError(differences, loc.label, loc.url)
        added = sum(1 for h in hashed if h.name not in existing.files) if existing.scope == TREE else 0
    digests: dict[str, TensorDigest] | None = None
    if tensors:
        digests = _digest_tensors(path, workers=workers, memory=memory, progress=progress)
    data = render({h.name: h.digest for h in hashed if h.digest}, {h.name: h.size for h in hashed},
                  SINGLE if loc.single else TREE, digests, f"ckpt {__version__}")
    _write_atomic(loc.home, loc.name, data)
    return WriteResult(loc.url, len(hashed), sum(h.size for h in hashed), None if digests is None else len(digests),
                       time.monotonic() - started, replaced, tuple(differences), added)


def _replaceable(loc: Location, overwrite: bool) -> tuple[str | None, Manifest | None]:
    """What the manifest's place holds now, when it may be replaced, and the manifest there (None:
    none, or one that cannot be read); DestinationExistsError when it may not be replaced."""
    if not loc.present():
        return None, None
    try:
        existing = read(loc)
    except PathEscapeError:
        raise
    except CkptError as exc:
        if overwrite:
            return "an unreadable manifest", None
        raise DestinationExistsError(f"holds a file that is not a manifest ckpt wrote ({exc.message}); "
                                     "--overwrite replaces it", loc.url) from None
    if existing.ours:
        return "ckpt's manifest", existing
    if not overwrite:
        raise DestinationExistsError(
            f"holds a manifest of {len(existing.files)} files that ckpt did not write (Megatron's save wrote it, or "
            "another tool); `ckpt manifest verify` checks it as it is; --overwrite replaces it", loc.url)
    return "another writer's manifest", existing


def _differences(existing: Manifest, hashed: list[Hashed], label: str) -> list[str]:
    """How the files just hashed differ from the manifest there, one line per file it names that
    changed or is gone (its own checks' words: what `verify` would report). Another writer's
    manifest (Megatron's) is compared on the files it names, as its verifier does."""
    now = {h.name: h for h in hashed}
    out = []
    for name in sorted(existing.files):
        want = existing.files[name]
        h = now.get(name)
        if h is None:
            out.append(f"missing: {name}: named by {label}, which records its sha256")
        elif h.digest != want:
            size = ""
            recorded = existing.sizes.get(name) if existing.sizes else None
            if recorded is not None and recorded != h.size:
                size = f" ({h.size:,} bytes where it records {recorded:,})"
            out.append(f"changed: {name}: sha256 {(h.digest or '')[:16]}... differs from {label}'s "
                       f"{want[:16]}...{size}")
    return out


def _digest_tensors(path: str, *, workers: int, memory: int, progress: Progress) -> dict[str, TensorDigest]:
    from ...formats import open_checkpoint
    from .tensors import tensor_digests

    ckpt = open_checkpoint(path)
    if ckpt.steps:
        raise UsageError(f"--tensors: {path} is a run root of {len(ckpt.steps)} steps; write a manifest per step "
                         "(ckpt manifest write ROOT/STEP --tensors)")
    digests, failed = tensor_digests(ckpt, workers=workers, memory=memory, progress=progress)
    if failed:
        leaf, why = next(iter(sorted(failed.items())))
        raise CkptError(f"cannot be read to digest it: {why}" + (f" (and {len(failed) - 1} more leaves)"
                                                                 if len(failed) > 1 else ""), leaf)
    return digests


def _write_atomic(home: Storage, name: str, data: bytes) -> None:
    """The manifest's bytes under `name`, all or nothing: locally a temporary file fsynced and
    renamed over the name (a rename replaces a symlink there, never writes through it); on an
    object store one PUT, which is all or nothing already."""
    if home.local_root is None:
        home.write(name, data)
        return
    final = os.path.join(home.local_root, name)
    _remove_dead_temporaries(home.local_root)
    import secrets  # (writing a manifest only: validate and a convert's preflight look for one)

    tmp = os.path.join(home.local_root, f"{TMP_PREFIX}{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        dfd = os.open(home.local_root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        with _quiet():
            os.unlink(tmp)
        raise CkptError(f"cannot write the manifest: {exc.strerror or exc}", final) from None


def _host() -> str:
    import socket

    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:40] or "host"


def _remove_dead_temporaries(directory: str) -> None:
    """Temporaries of manifest writes on this host whose process is gone (killed between the write
    and the rename): ckpt's own output, so removed; another host's are left alone."""
    prefix = f"{TMP_PREFIX}{_host()}-"
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return
    for n in names:
        pid = n[len(prefix):].split("-", 1)[0]
        if not is_ascii_number(pid) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running (or another user's process): not ours to judge
        except ProcessLookupError:
            pass
        except OSError:
            continue
        with _quiet():
            os.unlink(os.path.join(directory, n))


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


# -- checking -----------------------------------------------------------------------------------


def check_digests(
    loc: Location,
    findings: Any,
    *,
    workers: int = 4,
    memory: int = 512 << 20,
    progress: Progress = no_progress,
    checkpoint: str | None = None,
) -> None:
    """Every named file hashed against the manifest (`digest-mismatch` naming the file). When a
    file differs and the manifest records per-tensor digests, the leaves of `checkpoint` (its
    path) are digested too, and each that differs is named (`digest-mismatch` with the leaf).
    An unreadable manifest or a missing file was reported by check_shallow."""
    checked = files.check_digests(loc, findings, workers=workers, memory=memory, progress=progress)
    if checked is None:
        return
    manifest, differs = checked
    if differs and manifest.tensors and checkpoint is not None:
        _check_tensors(checkpoint, manifest, loc, findings, workers=workers, memory=memory, progress=progress)


def _check_tensors(path: str, manifest: Manifest, loc: Location, findings: Any, *, workers: int, memory: int,
                   progress: Progress) -> None:
    """Name the leaves whose values changed (the files' digests say only which files did)."""
    from ...formats import open_checkpoint
    from .tensors import tensor_digests

    try:
        ckpt = open_checkpoint(path)
    except CkptError as exc:
        findings.error("digest-mismatch", f"cannot be opened to check {loc.label}'s per-tensor digests: "
                       f"{exc.message}", file=loc.label)
        return
    assert manifest.tensors is not None
    digests, failed = tensor_digests(ckpt, workers=workers, memory=memory, progress=progress)
    same = 0
    for leaf, want in sorted(manifest.tensors.items()):
        got = digests.get(leaf)
        if leaf in failed:
            findings.error("digest-mismatch", f"cannot be read to check its digest: {failed[leaf]}", leaf=leaf)
        elif got is None:
            findings.error("digest-mismatch", f"recorded in {loc.label} but not an array of the checkpoint now",
                           leaf=leaf)
        elif (got.dtype, got.shape) != (want.dtype, want.shape):
            findings.error("digest-mismatch", f"now {got.dtype}{list(got.shape)}, {loc.label} records "
                           f"{want.dtype}{list(want.shape)}", leaf=leaf)
        elif got.sha256 != want.sha256:
            findings.error("digest-mismatch", f"its values' sha256 {got.sha256[:16]}... differs from {loc.label}'s "
                           f"{want.sha256[:16]}...: the changed bytes are in this tensor", leaf=leaf)
        else:
            same += 1
    findings.count("tensor_digests_verified", same)


def verify(
    path: str,
    *,
    manifest: str | None = None,
    workers: int = 4,
    memory: int = 512 << 20,
    progress: Progress = no_progress,
) -> tuple[Location, Any, str | None]:
    """`ckpt manifest verify`: the manifest's checks alone, shallow and every digest; (where it is,
    the Findings, the checkpoint's format). No manifest, or one that cannot be read, is an error
    (one line), not a finding: there is nothing to verify against. Pickles are unpickled within `memory`."""
    from ...machinery.torch_save.pickle_budget import memory_budget

    with memory_budget(memory):
        return _verify(path, manifest=manifest, workers=workers, memory=memory, progress=progress)


def _verify(path: str, *, manifest: str | None, workers: int, memory: int,
            progress: Progress) -> tuple[Location, Any, str | None]:
    from ... import formats
    from ...base.findings import Findings

    loc = locate(path, manifest)
    if not loc.present():
        raise NotFoundError("no integrity manifest (`ckpt manifest write` writes one; --manifest FILE names one "
                            "kept elsewhere)", loc.url)
    read(loc)
    checks, fmt = None, None
    try:
        # locate() set loc.single from this same split
        single = formats.split_file(path) if loc.single else None
        info = single[0] if single is not None else formats.get(formats.detect_one(loc.storage).NAME)
        checks, fmt = info.checks(), info.name
    except CkptError:
        pass  # a manifest names files: they can be checked whatever the directory holds
    findings = Findings()
    check_shallow(loc, findings, covers=checks.manifest_covers if checks is not None else None, workers=workers)
    check_digests(loc, findings, workers=workers, memory=memory, progress=progress,
                  checkpoint=path if fmt is not None else None)
    return loc, findings, fmt
