"""`integrity.json`: the sha256 manifest megatron-core >= 0.18 writes beside a save.

`dist_checkpointing.save(..., verify_integrity=True)` (Megatron-LM `--verify-integrity`) hashes,
after metadata.json is written, every FILE directly in the save directory except the manifest
itself, and writes (megatron/core/dist_checkpointing/validation.py, save_integrity_manifest;
Megatron-LM commit 970c2540, core_v0.18.0):

    {"algorithm": "sha256", "files": {"<name>": "<hex digest>", ...}}     (json.dump, indent=2)

with names relative to the save directory, sorted, digests from hashlib's hexdigest (64
lowercase hex characters) of the file read in 1 MiB blocks. `load(..., verify_integrity=True)`
(_verify_integrity_manifest_impl) takes `algorithm` (default "sha256", anything else refused),
re-hashes every named file and fails on a missing file or a different digest. Sizes are not
recorded, so without reading the files only their presence can be checked.

validate: shallow, the manifest as Megatron reads it (`bad-metadata`), every file it names present
(`missing-file`), a save's files it does not name (`stray-file`, a warning: written after the
manifest, so not protected by it); --deep, each named file's sha256, streamed (`bad-chunk` when it
differs: the file's bytes are not the ones saved).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from ...errors import CkptError, CorruptMetadataError, PathEscapeError
from ...storage import Storage

FILE = "integrity.json"
ALGORITHM = "sha256"
MAX_BYTES = 64 << 20  # a manifest of a million files is ~100 MB; no save has that many top-level files
HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")
BLOCK_BYTES = 8 << 20  # read per range request while hashing
# files Megatron-Bridge / NeMo put beside a save after it: not in the manifest by design
_WRITTEN_LATER = ("run_config.yaml", "train_state.pt")


@dataclass(frozen=True)
class Manifest:
    algorithm: str
    files: dict[str, str]  # name (relative to the save) -> hex digest


def read_manifest(storage: Storage) -> Manifest:
    """integrity.json, checked as Megatron's verifier reads it (CorruptMetadataError otherwise)."""
    from ..orbax import schema

    where = f"{storage.url}/{FILE}"
    size = storage.size(FILE)
    if size > MAX_BYTES:
        raise CorruptMetadataError(f"{size:,} bytes: not an integrity manifest", where)
    doc = schema.load_json(storage.read(FILE), where)
    if not isinstance(doc, dict):
        raise CorruptMetadataError("not a JSON object", where)
    algorithm = doc.get("algorithm", ALGORITHM)  # Megatron's default when absent
    if algorithm != ALGORITHM:
        raise CorruptMetadataError(f"algorithm {str(algorithm)[:40]!r}: Megatron's verifier accepts only "
                                   f"{ALGORITHM!r}", where)
    files = doc.get("files")
    if not isinstance(files, dict):
        raise CorruptMetadataError("no 'files' mapping of file names to digests", where)
    for name, digest in files.items():
        if not isinstance(digest, str) or not HEX_DIGEST.match(digest):
            raise CorruptMetadataError(f"{name!r}: {str(digest)[:70]!r} is not a sha256 hex digest as hashlib "
                                       "writes it (64 lowercase hex digits)", where)
        if not name or name.startswith("/") or name in (".", FILE):
            raise CorruptMetadataError(f"{name!r} is not a file of the save", where)
    return Manifest(algorithm, dict(files))


def sha256_of(storage: Storage, name: str) -> str:
    """The file's sha256, read in BLOCK_BYTES ranges (never whole in memory)."""
    size = storage.size(name)
    h = hashlib.sha256()
    for start in range(0, size, BLOCK_BYTES):
        h.update(storage.read_range(name, start, min(size, start + BLOCK_BYTES)))
    return h.hexdigest()


def note(storage: Storage) -> str:
    """inspect's line about the manifest (never an error: inspect reads no data)."""
    try:
        manifest = read_manifest(storage)
    except PathEscapeError:
        raise
    except CkptError as exc:
        return f"{FILE} unreadable ({exc.message}): validate reports it"
    return f"{FILE}: sha256 of {len(manifest.files)} files (megatron-core >= 0.18; validate --deep verifies them)"


def check(storage: Storage, findings: Any) -> Manifest | None:
    """Shallow: the manifest readable, every file it names present, top-level files it does not name."""
    try:
        manifest = read_manifest(storage)
    except PathEscapeError:
        raise
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=FILE)
        return None
    findings.count("integrity_files", len(manifest.files))
    for name in manifest.files:
        try:
            present = storage.exists(name)
        except PathEscapeError as exc:
            findings.error("path-escape", f"{FILE} names it: {exc.message}", file=name)
            continue
        if not present:
            findings.error("missing-file", f"named by {FILE}: Megatron's load(verify_integrity=True) fails on it",
                           file=name)
    _, files = storage.listdir()
    for name in sorted(files):
        if name not in manifest.files and name not in _WRITTEN_LATER and _saved_by_megatron(name):
            findings.warning("stray-file", f"not named by {FILE}: written after the save's manifest, so not "
                             "protected by it", file=name)
    return manifest


def _saved_by_megatron(name: str) -> bool:
    """A file dist_checkpointing.save writes (so one its manifest names when it was written with it)."""
    return name in ("metadata.json", "common.pt", ".metadata") or name.endswith((".distcp", ".pt"))


def check_deep(storage: Storage, findings: Any) -> None:
    """--deep: every named file's sha256 against the manifest (an unreadable manifest was reported shallow)."""
    try:
        manifest = read_manifest(storage)
    except CkptError:
        return
    checked = 0
    for name, digest in sorted(manifest.files.items()):
        try:
            if not storage.exists(name):
                continue  # reported by the shallow check
            actual = sha256_of(storage, name)
        except PathEscapeError:
            continue  # reported by the shallow check
        except CkptError as exc:
            findings.error("bad-chunk", f"cannot be read to verify its sha256: {exc.message}", file=name)
            continue
        checked += 1
        if actual != digest:
            findings.error("bad-chunk", f"sha256 {actual[:16]}... differs from {FILE}'s {digest[:16]}...: not the "
                           "bytes that were saved (Megatron's load(verify_integrity=True) refuses it)", file=name)
    findings.count("sha256_verified", checked)
