"""The manifest document: Megatron-Core's `integrity.json` schema, plus a section of ckpt's own.

megatron-core >= 0.18 (`dist_checkpointing.save(..., verify_integrity=True)`,
validation.py save_integrity_manifest) writes, after a save, every file directly in the save
directory but the manifest, sorted, digests from hashlib (json.dump, indent=2):

    {"algorithm": "sha256", "files": {"<name>": "<64 lowercase hex>", ...}}

and its verifier (_verify_integrity_manifest_impl) reads `algorithm` (default "sha256",
anything else refused) and `files`, nothing else. ckpt writes the same two keys, so Megatron's
`load(..., verify_integrity=True)` verifies a manifest ckpt wrote, plus one key Megatron's
reader ignores:

    "ckpt": {"version": 1, "scope": "tree" | "file", "sizes": {"<name>": bytes, ...},
             "tensors": {"<leaf path>": {"sha256": ..., "dtype": ..., "shape": [...]}, ...}}

`scope` "tree": the manifest names every file under the checkpoint directory (sub-directories
too), so a file it does not name was added after it; "file": a checkpoint that is one file.
`sizes` lets a shallow check (no data read) find a file of the wrong length; `tensors` (with
`ckpt manifest write --tensors`) the sha256 of each array leaf's logical bytes (C order,
little-endian, as a safetensors file stores them), which names the tensor a changed byte is in.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ...base.errors import CorruptMetadataError

FILE = "integrity.json"  # Megatron's name, in the checkpoint directory
SINGLE_SUFFIX = ".integrity.json"  # beside a checkpoint that is one file: model.safetensors.integrity.json
ALGORITHM = "sha256"
SECTION = "ckpt"
VERSION = 1
TREE, SINGLE = "tree", "file"
MAX_BYTES = 256 << 20  # a manifest of a million files with tensors is ~200 MB
HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class TensorDigest:
    """One array leaf's sha256 of its logical bytes (--tensors), with its dtype and shape."""

    sha256: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    """An integrity manifest read: each file's digest (and size, where recorded), whose it is."""

    algorithm: str
    files: dict[str, str]  # name (relative to the checkpoint directory) -> hex digest
    ours: bool = False  # written by ckpt (it has the "ckpt" section)
    scope: str = ""  # TREE | SINGLE for ckpt's; "" for another writer's (Megatron: top-level files)
    sizes: dict[str, int] | None = None  # None: not recorded (Megatron's)
    tensors: dict[str, TensorDigest] | None = None  # None: not recorded (no --tensors)


def parse(raw: bytes, where: str) -> Manifest:
    """The manifest in `raw`, checked as Megatron's verifier reads it and ckpt's section as ckpt
    writes it; CorruptMetadataError (one line naming `where`) otherwise."""
    if len(raw) > MAX_BYTES:
        raise CorruptMetadataError(f"{len(raw):,} bytes: not an integrity manifest", where)
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise CorruptMetadataError("JSON nested too deeply", where) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptMetadataError(f"invalid JSON: {exc}", where) from None
    if not isinstance(doc, dict):
        raise CorruptMetadataError("not a JSON object", where)
    algorithm = doc.get("algorithm", ALGORITHM)  # Megatron's default when absent
    if algorithm != ALGORITHM:
        raise CorruptMetadataError(f"algorithm {str(algorithm)[:40]!r}: Megatron's verifier (and ckpt) accept only "
                                   f"{ALGORITHM!r}", where)
    files = doc.get("files")
    if not isinstance(files, dict):
        raise CorruptMetadataError("no 'files' mapping of file names to digests", where)
    for name, digest in files.items():
        _check_digest(digest, repr(name), where)
        if not name or name.startswith("/") or name in (".", FILE):
            raise CorruptMetadataError(f"{name!r} is not a file of the checkpoint", where)
    section = doc.get(SECTION)
    if section is None:
        return Manifest(algorithm, dict(files))
    return _parse_section(algorithm, dict(files), section, where)


def _parse_section(algorithm: str, files: dict[str, str], section: Any, where: str) -> Manifest:
    if not isinstance(section, dict):
        raise CorruptMetadataError(f"{SECTION!r} is not a JSON object", where)
    version = section.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptMetadataError(f"{SECTION}.version {str(version)[:20]!r} is not a version number", where)
    if version > VERSION:
        raise CorruptMetadataError(f"{SECTION}.version {version}: written by a newer ckpt (this one reads "
                                   f"version {VERSION})", where)
    scope = section.get("scope", TREE)
    if scope not in (TREE, SINGLE):
        raise CorruptMetadataError(f"{SECTION}.scope {str(scope)[:20]!r}: not {TREE!r} or {SINGLE!r}", where)
    sizes = section.get("sizes")
    if sizes is not None:
        if not isinstance(sizes, dict):
            raise CorruptMetadataError(f"{SECTION}.sizes is not a mapping of file names to sizes", where)
        for name, size in sizes.items():
            if name not in files:
                raise CorruptMetadataError(f"{SECTION}.sizes names {name!r}, which 'files' does not", where)
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise CorruptMetadataError(f"{SECTION}.sizes[{name!r}]: {str(size)[:30]!r} is not a size in bytes",
                                           where)
        sizes = dict(sizes)
    tensors = section.get("tensors")
    parsed: dict[str, TensorDigest] | None = None
    if tensors is not None:
        if not isinstance(tensors, dict):
            raise CorruptMetadataError(f"{SECTION}.tensors is not a mapping of leaf paths to digests", where)
        parsed = {}
        for path, entry in tensors.items():
            what = f"{SECTION}.tensors[{path!r}]"
            if not isinstance(entry, dict):
                raise CorruptMetadataError(f"{what} is not a JSON object", where)
            _check_digest(entry.get("sha256"), what, where)
            dtype, shape = entry.get("dtype"), entry.get("shape")
            if not isinstance(dtype, str) or not isinstance(shape, list) or \
                    not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                raise CorruptMetadataError(f"{what} needs a dtype name and a shape (a list of sizes)", where)
            parsed[path] = TensorDigest(entry["sha256"], dtype, tuple(shape))
    return Manifest(algorithm, files, True, scope, sizes, parsed)


def _check_digest(digest: Any, what: str, where: str) -> None:
    if not isinstance(digest, str) or not HEX_DIGEST.match(digest):
        raise CorruptMetadataError(f"{what}: {str(digest)[:70]!r} is not a sha256 hex digest as hashlib writes it "
                                   "(64 lowercase hex digits)", where)


def render(files: dict[str, str], sizes: dict[str, int], scope: str, tensors: dict[str, TensorDigest] | None,
           writer: str) -> bytes:
    """The manifest's bytes: Megatron's two keys first, as json.dump(indent=2) writes them, then ckpt's."""
    section: dict[str, Any] = {"version": VERSION, "writer": writer, "scope": scope,
                               "sizes": {name: sizes[name] for name in sorted(sizes)}}
    if tensors is not None:
        section["tensors"] = {path: {"sha256": t.sha256, "dtype": t.dtype, "shape": list(t.shape)}
                              for path, t in sorted(tensors.items())}
    doc = {"algorithm": ALGORITHM, "files": {name: files[name] for name in sorted(files)}, SECTION: section}
    return (json.dumps(doc, indent=2) + "\n").encode()
