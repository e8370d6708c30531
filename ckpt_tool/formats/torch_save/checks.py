"""Shallow checks of torch.save files (one, a directory, a Hugging Face sharded set); --deep's CRC-32s.

Shallow: the index (its JSON, the files it names, shards it does not name),
the set's completeness (every `-0000K-of-0000N` shard present), and in every
file the zip structure and records as torch's reader checks them, the pickle
through the allow-list (a global outside it is `unsafe-pickle`: refused,
nothing run), and each tensor's claim on its storage member (present, the
storage's size, the view inside it) from the zip's central directory. A
tensor name in two files of a set, or in a file the index does not place it
in, is an error: which copy a loader takes depends on the loader.

Deep (check_deep, after every tensor was read and checked for NaN/Inf): the
CRC-32 of every storage member a whole read did not already check, each
streamed once, and every non-tensor value decoded.
"""
from __future__ import annotations

from typing import Any

from ...base.errors import CkptError, PathEscapeError
from ...base.findings import FILE_CAUSES, Findings
from ...storage import Storage
# one file's checks and --deep's loop: the shared torch.save machinery's
from ...machinery.torch_save.checks import check_file, verify_and_decode
from . import reader as ts

def check_path(storage: Storage, findings: Findings, *, step: str | int | None = None, only: str | None = None) -> None:
    """`only`: check just that file of `storage` (not listed: its directory may hold anything); no steps."""
    if only is not None:
        if not storage.exists(only):
            findings.error("missing-file", "no such file", file=only)
            return
        layout = ts.Layout([only], None, None, False, [], [], [])
    else:
        try:
            layout = ts.scan(storage)
        except PathEscapeError:
            raise
        except CkptError as exc:
            findings.error("bad-metadata", exc.message, file=_file_of(storage, exc.where))
            return
        if layout.index_file:
            findings.count("index")
    for name in layout.missing:
        why = f"named in {layout.index_file} but does not exist" if layout.index_file else \
            "a shard of this set is missing (the other shards are here)"
        findings.error("missing-file", why, file=name)
        _name_held(findings, name, layout.weight_map)
    for name in layout.stray:
        findings.warning("stray-file", f"a shard that {layout.index_file} does not name (loaders ignore it)", file=name)
    names: dict[str, str] = {}  # dotted name -> file (sets only)
    stored: dict[str, set[str]] = {}
    for name in layout.files:
        tree = check_file(storage, name, findings, restore_locations=True)
        if tree is None:
            _name_held(findings, name, layout.weight_map)
            continue
        leaves = ts.leaves_of(tree)
        stored[name] = {leaf.name for leaf in leaves}
        if layout.sharded:
            for leaf in leaves:
                if leaf.name in names:
                    findings.error("chunk-overlap", f"stored in both {names[leaf.name]} and {name}", leaf=leaf.name,
                                   file=name)
                names.setdefault(leaf.name, name)
    if layout.weight_map is not None:
        for tname, fname in layout.weight_map.items():
            if fname in stored and tname not in stored[fname]:
                findings.error("leaf-missing", f"{layout.index_file} places it in {fname}, which does not hold it",
                               leaf=tname, file=layout.index_file)
        for fname, held in stored.items():
            for tname in sorted(held):
                want = layout.weight_map.get(tname)
                if want is None:
                    findings.warning("leaf-missing", f"stored in {fname} but not in {layout.index_file} "
                                     "(loaders that follow the index will not see it)", leaf=tname, file=fname)
                elif want != fname:
                    findings.error("chunk-overlap", f"{layout.index_file} places it in {want}, but {fname} holds it",
                                   leaf=tname, file=fname)


def _name_held(findings: Findings, name: str, weight_map: dict[str, str] | None) -> None:
    """The tensors the index places in `name` join its finding about the file as a whole (missing,
    cut short, unreadable: torch.load opens none of them), when it has one."""
    held = sorted(t for t, f in (weight_map or {}).items() if f == name)
    cause = next((f for f in reversed(findings.errors) if f.file == name and f.code in FILE_CAUSES), None)
    if cause is None:
        return
    for tensor in held:
        findings.file_problem(cause.code, cause.message, file=name, leaf=tensor)


def _file_of(storage: Storage, where: str | None) -> str | None:
    if where and where.startswith(storage.url.rstrip("/") + "/"):
        return where[len(storage.url.rstrip("/")) + 1:]
    return None


def check_deep(storage: Storage, ckpt: Any, findings: Findings, skip_leaves: set[str]) -> None:
    """--deep's part besides the tensor reads: every storage member's CRC-32 (those a whole
    read did not already check, each streamed once), and every non-tensor value decoded
    (torch_save.checks.verify_and_decode, DeepSpeed's and DCP's loop too)."""
    archives: dict[int, ts.Archive] = {}
    for leaf in ckpt.leaves:
        reader = getattr(leaf, "reader", None)
        archive = getattr(reader, "_archive", None)
        if isinstance(archive, ts.Archive):
            archives[id(archive)] = archive
    verify_and_decode(findings, ckpt.leaves, skip_leaves, archives=[(a, a.name) for a in archives.values()],
                      value_file=lambda leaf, exc: leaf.extra.get("file"))
