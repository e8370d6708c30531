"""validate's shallow checks of one torch.save file: its zip, records and pickle (through the
allow-list: a global outside it is `unsafe-pickle`, refused, nothing run), and each tensor's claim
on its storage member (present, the storage's size, the view inside it) from the zip's central
directory. Shared machinery: the torch.save, DeepSpeed and Megatron checks use it.

verify_and_decode is --deep's loop beside the tensor reads, for the torch.save, DeepSpeed and DCP
checks: each storage member's CRC-32, each recorded value decoded.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from ...base.errors import CkptError, PathEscapeError, UnreadableFileError, UnsafePickleError, short_repr
from ...base.findings import FindingSink
from ...core.model import Leaf, ValueLeaf
from ...storage import Storage
from .reading import Archive, FileTree, file_tree, leaves_of
from .safe_pickle import TensorRef, UnsupportedTensorError, restore_location

# damaged-zip messages that mean the file ends too soon (its end records, or a member, cut off)
CUT_SHORT = ("no end-of-central-directory record", "outside the archive", "runs past the archive",
              "too short for an end-of-central-directory", "central directory outside")


def check_file(storage: Storage, name: str, findings: FindingSink, allow: Any = None, *,
               restore_locations: bool = False) -> FileTree | None:
    """One archive: its zip, records and pickle, and every tensor's claim on its storage.

    `allow`: a framework's stand-ins for the classes it pickles (Megatron's common.pt).
    `restore_locations`: also judge each storage's saved location as torch.load without
    map_location does (a plain torch.save file; Megatron and DeepSpeed load theirs with
    map_location='cpu', where the location does not matter)."""
    try:
        archive = Archive(storage, name, allow)
    except PathEscapeError:
        raise
    except UnsafePickleError as exc:
        findings.error("unsafe-pickle", f"refers to {exc.module}.{exc.name}: refused, nothing was executed", file=name)
        return None
    except UnsupportedTensorError as exc:
        findings.error("bad-metadata", exc.message, file=name)
        return None
    except UnreadableFileError as exc:
        findings.error("unreadable-file", exc.message, file=name)
        return None
    except CkptError as exc:
        size = file_size(storage, name)
        code = "empty-file" if size == 0 else (
            "truncated-file" if any(part in exc.message for part in CUT_SHORT) else "bad-metadata")
        findings.error(code, exc.message, file=name)
        return None
    findings.count("files")
    tree = file_tree(archive)
    tensors = 0
    locations: dict[str, list[str]] = {}  # a location torch.load does not simply restore -> its tensors
    # a leaf is named by its path (keys joined by '/'), as --deep's list of leaves to skip has it:
    # a claim found wrong here is never read (a size of 2**63 would be split into blocks forever)
    for leaf, value in zip(leaves_of(tree), tree.values):
        if not isinstance(value, TensorRef):
            continue
        tensors += 1
        problem = archive.zip.claim_problem(value)
        if problem is not None:
            code = "missing-chunk" if "missing from the archive" in problem else "bad-metadata"
            findings.error(code, problem, leaf=leaf.path, file=name)
        if restore_locations and value.storage.location != "cpu":
            locations.setdefault(value.storage.location, []).append(leaf.path)
    findings.count("tensors", tensors)
    for location, leaves in locations.items():
        _check_location(location, leaves, name, findings)
    return tree


def _check_location(location: str, leaves: list[str], name: str, findings: FindingSink) -> None:
    """One finding per saved location torch.load (without map_location) does not simply restore,
    on the first tensor saved there: an error where it restores it nowhere, a warning where it
    needs a device or gives no values."""
    verdict = restore_location(location)
    if verdict is None:
        return
    kind, why = verdict
    more = len(leaves) - 1
    where = f"saved on {short_repr(location)}" + (f" (and {more} more tensor{'s' if more > 1 else ''})" if more else "")
    if kind == "invalid":
        findings.error("bad-metadata", f"{where}, {why}: torch.load cannot restore it (only "
                       "torch.load(..., map_location='cpu') loads this file)", leaf=leaves[0], file=name)
    elif kind == "meta":
        findings.warning("device-location", f"{where}: torch.load gives {why} unless map_location='cpu'",
                         leaf=leaves[0], file=name)
    else:
        findings.warning("device-location", f"{where}: torch.load needs map_location='cpu' on a machine without "
                         f"{why}", leaf=leaves[0], file=name)


def file_size(storage: Storage, name: str) -> int | None:
    try:
        return storage.size(name)
    except CkptError:
        return None


def verify_and_decode(findings: FindingSink, leaves: Iterable[Leaf], skip_leaves: set[str], *,
                      value_file: Callable[[ValueLeaf, CkptError], str | None],
                      archives: Sequence[tuple[Archive, str]] | None = None, what: str = "value",
                      counted: str = "values_read", refuses_pickles: bool = False) -> None:
    """--deep's part besides the tensor reads: every storage member's CRC-32 in `archives` (each
    with the file name its findings give; those a whole read already checked are not read again,
    each streamed once; counted as storages_checked; None: no archives to verify, nothing counted),
    then every value leaf not in `skip_leaves` decoded (counted as `counted`).

    A value that does not decode is a bad-chunk finding ("<what> does not decode: ..."), its file
    `value_file(leaf, error)`; with `refuses_pickles`, one whose pickle names a global outside the
    allow-list is an unsafe-pickle finding (DCP's bytes items, unpickled only now)."""
    if archives is not None:
        members = 0
        for archive, file in archives:
            for key, (size, crc) in sorted(archive.zip.storage_members().items()):
                if not size or not crc:
                    continue  # torch was told not to record CRCs (then they are 0)
                members += 1
                try:
                    archive.verify_member(key)
                except PathEscapeError:
                    raise
                except CkptError as exc:
                    findings.error("bad-chunk", f"storage {key}: {exc.message}", file=file)
        findings.count("storages_checked", members)
    values = 0
    for leaf in leaves:
        if not isinstance(leaf, ValueLeaf) or leaf.path in skip_leaves:
            continue
        values += 1
        try:
            leaf.load()
        except UnsafePickleError as exc:
            if not refuses_pickles:
                findings.error("bad-chunk", f"{what} does not decode: {exc.message}", leaf=leaf.path,
                               file=value_file(leaf, exc))
                continue
            findings.error("unsafe-pickle", f"{what} refers to {exc.module}.{exc.name}: refused, nothing was executed",
                           leaf=leaf.path, file=value_file(leaf, exc))
        except CkptError as exc:
            findings.error("bad-chunk", f"{what} does not decode: {exc.message}", leaf=leaf.path,
                           file=value_file(leaf, exc))
    findings.count(counted, values)
