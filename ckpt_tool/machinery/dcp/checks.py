"""Shallow checks of a torch.distributed.checkpoint (DCP) directory.

Reads `.metadata` (through the allow-list unpickler: nothing in it can run),
the directory listing and one size per data file; no chunk is read (that is
--deep, in deep.py, which goes through the DCP reader and its CRC checks).

`.metadata` is walked leniently here, not with the reader's `_parse_metadata`:
the reader stops at the first inconsistency, while validate must describe
every one (each chunk out of bounds, each chunk without a storage entry, ...)
and go on. Every problem becomes a Finding; nothing here raises on damage it
can describe.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
import posixpath
import re
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ...base import dtypes
from ...base.errors import (
    CkptError, NotFoundError, PathEscapeError, StorageUnavailableError, UnsafePickleError, short_repr,
)
from ...base.findings import Findings
from ..torch_save import safe_pickle
from . import reader as dcp
from . import transforms as dcp_transforms
from ...core.model import Chunk, keys_path
from ...storage import Storage

# how many regions / files one message names before "... and N more"
_MAX_NAMED = 5
# a file-level finding names more: which items a lost file takes with it is the point
_MAX_NAMED_ITEMS = 20
# per tensor, overlap and bounds findings beyond this are summarised in one line
_MAX_CHUNK_FINDINGS = 10
# orphan-entry warnings beyond this are summarised in one line
_MAX_ORPHAN_FINDINGS = 20
# coverage is computed exactly on the grid of distinct chunk boundaries; a
# tensor whose grid has more cells than this gets an element count instead
_MAX_COVERAGE_CELLS = 1 << 22
# uncovered regions merged into boxes per tensor (the count covers the rest)
_MAX_GAP_BOXES = 20
# chunk-pair comparisons spent naming overlaps in one tensor
_PAIR_BUDGET = 2_000_000

_TMP_METADATA = re.compile(r"^(__\d+)?\.metadata\.tmp$")
_RANK_METADATA = re.compile(r"^__\d+\.metadata$")

# a box: one [start, stop) interval per dimension
Box = tuple[tuple[int, int], ...]
# storage_data identity: (fqn, chunk offsets) for a tensor chunk, (fqn, None) for a bytes item
EntryKey = tuple[str, tuple[int, ...] | None]


@dataclass
class _Tensor:
    fqn: str
    leaf: str
    shape: tuple[int, ...]
    chunks: list[Chunk]  # distinct chunks (a replicated duplicate once)
    duplicates: int = 0  # chunks listed again with the same offsets and sizes
    copies: dict[Chunk, int] = field(default_factory=dict)  # chunk -> times listed, when more than once
    itemsize: int = 0  # 0: a dtype ckpt cannot read (reported already)
    claims: list[str] = field(default_factory=list)  # chunks whose claimed size their entries cannot hold
    oversized: bool = False  # a chunk claims more bytes than its (non-empty) entry holds


@dataclass(frozen=True)
class _Placed:
    """One storage entry with the item it stores, for file-level findings."""

    key: EntryKey
    entry: dcp._Entry
    leaf: str
    sizes: tuple[int, ...] | None = None  # the chunk's sizes, when the entry belongs to a chunk
    orphan: bool = False

    @property
    def label(self) -> str:
        """How a message names the item: "model.w[3:6, 0:4]", "step", or an orphan entry."""
        fqn, offsets = self.key
        if offsets is None:
            return f"{fqn} (orphan entry)" if self.orphan else fqn
        if self.sizes is None:
            return f"{fqn} (orphan entry at offsets {list(offsets)})"
        return _chunk_label(fqn, Chunk(offsets, self.sizes))


def check_path(storage: Storage, findings: Findings, *, step: str | int | None = None, only: str | None = None,
               allow: Any = None, leaf_path: Callable[[str], str] | None = None,
               parsed: dict[str, Any] | None = None) -> None:
    """Validate one DCP checkpoint directory; every problem becomes a finding (a directory has no steps,
    and no single file is a DCP checkpoint: `step` and `only` are unused). `allow`: a framework's
    stand-ins for the classes it pickles into `.metadata` (reader.read's); `leaf_path`: how its
    reader names the leaf of an fqn, where that is not planner_data's path. `parsed`: the
    Checkpoint.parsed of the checkpoint opened in this run (ChecksModule.check_opened): the reader's
    parse of `.metadata`, taken instead of reading it again."""
    _, files = storage.listdir()
    data_files = sorted(f for f in files if f.endswith(dcp.DATA_SUFFIX))
    tmp_metadata = sorted(f for f in files if _TMP_METADATA.match(f))

    if dcp.METADATA_FILE not in files:
        _report_missing_metadata(files, data_files, tmp_metadata, findings)
        return
    for name in tmp_metadata:
        # torch writes .metadata.tmp and renames it; a leftover beside a committed
        # .metadata is from an earlier, interrupted save into this directory
        findings.warning(
            "stray-file",
            "leftover temporary metadata from an interrupted save (torch renames it to .metadata when the save "
            "commits); this .metadata is not affected, the file can be deleted",
            file=name,
        )

    md, well_formed = _load_metadata(storage, findings, allow, parsed)
    if md is _UNREADABLE:
        return
    walked = _walk(md, well_formed, findings, leaf_path, report_metadata=True)
    if walked is None:
        return  # nothing below can be located
    leaf_of, entries, malformed, tensors, bytes_fqns = walked

    # every chunk and bytes item needs a storage entry; every entry needs an owner
    placed: list[_Placed] = []
    used: set[EntryKey] = set()
    for tensor in tensors:
        for chunk in tensor.chunks:
            key: EntryKey = (tensor.fqn, chunk.offsets)
            entry = entries.get(key)
            if entry is None:
                if key in malformed:
                    continue  # its entry is there but unreadable: already reported as bad-metadata
                findings.error(
                    "missing-storage-entry",
                    f"chunk {_chunk_label(tensor.fqn, chunk)} (offsets {list(chunk.offsets)}, sizes {list(chunk.sizes)}) has no storage_data "
                    "entry saying where its bytes are: restore will fail",
                    leaf=tensor.leaf, file=dcp.METADATA_FILE,
                )
            elif key not in used:
                used.add(key)
                placed.append(_Placed(key, entry, tensor.leaf, chunk.sizes))
                problem = dcp.chunk_claim_problem(chunk.sizes, tensor.itemsize, entry) if tensor.itemsize else None
                if problem:
                    tensor.claims.append(f"{_chunk_label(tensor.fqn, chunk)}: {problem}")
                    if entry.length:
                        tensor.oversized = True
    for fqn in bytes_fqns:
        key = (fqn, None)
        entry = entries.get(key)
        if entry is None and key not in malformed:
            findings.error(
                "missing-storage-entry",
                f"non-tensor item {fqn} has no storage_data entry saying where its bytes are: restore will fail",
                leaf=leaf_of(fqn), file=dcp.METADATA_FILE,
            )
        elif entry is not None:
            used.add(key)
            placed.append(_Placed(key, entry, leaf_of(fqn)))
            if entry.length == 0:
                findings.error(
                    "empty-chunk",
                    f"non-tensor item {fqn}: its storage entry in {entry.relative_path} has length 0 (torch.load "
                    "of 0 bytes fails)",
                    leaf=leaf_of(fqn), file=dcp.METADATA_FILE,
                )
    orphans = [(key, entry) for key, entry in entries.items() if key not in used]
    for key, entry in orphans[:_MAX_ORPHAN_FINDINGS]:
        fqn, offsets = key
        what = f"{fqn} chunk at offsets {list(offsets)}" if offsets is not None else f"{fqn} (non-tensor item)"
        findings.warning(
            "orphan-storage-entry",
            f"storage_data entry for {what} in {entry.relative_path} belongs to no chunk or item in "
            "state_dict_metadata; torch ignores it",
            leaf=leaf_of(fqn), file=dcp.METADATA_FILE,
        )
    if len(orphans) > _MAX_ORPHAN_FINDINGS:
        findings.warning(
            "orphan-storage-entry",
            f"... and {len(orphans) - _MAX_ORPHAN_FINDINGS} more storage_data entries that belong to no item",
            file=dcp.METADATA_FILE,
        )
    # orphans are checked like the rest: a reference to a file outside the
    # checkpoint or past a file's end is damage even if nothing reads it
    for key, entry in orphans:
        placed.append(_Placed(key, entry, leaf_of(key[0]), orphan=True))

    referenced, sound = _check_files(storage, placed, findings)
    _check_entry_bounds(storage, sound, findings)
    duplicates = sum(t.duplicates for t in tensors)
    for name in data_files:
        if name not in referenced:
            size = _size_or_none(storage, name)
            if size == 0:
                # a thread_count > 1 save leaves an empty file for each thread
                # that got no item: nothing was lost in it
                continue
            if duplicates and size and _starts_like_an_item(storage, name):
                # a planner that keeps replicated duplicates writes every copy,
                # but .metadata points at one: a rank whose items were all
                # copies has an unreferenced file. --deep checks what it holds.
                continue
            findings.warning(
                "stray-file",
                "data file not referenced by .metadata (left by an earlier save into this directory, or by a rank "
                "whose write results never reached the coordinator); torch ignores it",
                file=name,
            )

    for tensor in tensors:
        if _check_claims(tensor, entries, findings):
            _check_geometry(tensor, findings)
    _check_transforms(placed, findings)

    findings.count("tensors", len(tensors))
    findings.count("chunks", sum(len(t.chunks) for t in tensors))
    findings.count("bytes_items", len(bytes_fqns))
    findings.count("files", len(referenced))
    if duplicates:
        findings.count("duplicate_chunks", duplicates)


def _check_claims(tensor: _Tensor, entries: dict[EntryKey, dcp._Entry], findings: Findings) -> bool:
    """Sizes claimed against bytes stored: each chunk within its entry, the tensor within its chunks' entries.

    One finding per kind per tensor (the first chunk named, the rest
    counted). False when the tensor claims more than is stored: its geometry
    is then not worth checking (and a 2**62 x 2**62 shape would overflow the
    coverage arithmetic).
    """
    def report(code: str, claims: list[str]) -> None:
        more = f" (and {len(claims) - 1} more chunk{'s' if len(claims) > 2 else ''} like it)" if len(claims) > 1 else ""
        findings.error(code, claims[0] + more, leaf=tensor.leaf, file=dcp.METADATA_FILE)

    empty = [c for c in tensor.claims if "has length 0" in c]
    oversized = [c for c in tensor.claims if "has length 0" not in c]
    if empty:
        report("empty-chunk", empty)
    if oversized:
        report("bad-metadata", oversized)
    if tensor.claims:
        return not tensor.oversized  # (the tensor-level claim would repeat what the chunk's says)
    if not tensor.itemsize:
        return True
    capacity = sum(dcp.entry_capacity(e) for e in (entries.get((tensor.fqn, c.offsets)) for c in tensor.chunks) if e)
    claimed = math.prod(tensor.shape) * tensor.itemsize
    if claimed > capacity:
        findings.error(
            "bad-metadata",
            f"shape {list(tensor.shape)} claims {claimed} bytes but the storage entries of its {len(tensor.chunks)} "
            f"chunk{'s' if len(tensor.chunks) != 1 else ''} hold {capacity} at most: the metadata does not describe "
            "the stored data",
            leaf=tensor.leaf, file=dcp.METADATA_FILE,
        )
        return False
    return not tensor.oversized


def _starts_like_an_item(storage: Storage, name: str) -> bool:
    """Whether a data file begins as DCP items do: a torch.save zip or a zstd frame (4 bytes read)."""
    try:
        return storage.read_range(name, 0, 4) in (b"PK\x03\x04", b"\x28\xb5\x2f\xfd")
    except (CkptError, OSError):
        return False


def _size_or_none(storage: Storage, name: str) -> int | None:
    try:
        return storage.size(name)
    except (CkptError, OSError):
        return None


def _check_transforms(placed: list[_Placed], findings: Findings) -> None:
    """Entries stored with a transform ckpt cannot undo: an error naming it (torch needs it registered too)."""
    unknown: dict[str, list[_Placed]] = defaultdict(list)
    for p in placed:
        for desc in dcp_transforms.describe_unknown(p.entry.transforms):
            unknown[desc].append(p)
    for desc, items in sorted(unknown.items()):
        findings.error(
            "bad-metadata",
            f"{len(items)} item{'s are' if len(items) != 1 else ' is'} stored with transform {desc!r}, which ckpt "
            f"cannot decode (it reads torch's ZStandard extension, {', '.join(dcp_transforms.KNOWN)}); torch loads "
            f"it only with that extension registered: {_named([p.label for p in items], _MAX_NAMED_ITEMS)}",
            leaf=_one_leaf(items), file=dcp.METADATA_FILE,
        )


# ---------------------------------------------------------------------------
# .metadata
# ---------------------------------------------------------------------------
def _report_missing_metadata(
    files: list[str], data_files: list[str], tmp_metadata: list[str], findings: Findings
) -> None:
    if tmp_metadata:
        findings.error(
            "uncommitted-save",
            f"{tmp_metadata[0]} was written but never renamed to .metadata: the save died while committing",
            file=tmp_metadata[0],
        )
    message = (
        "no .metadata: an incomplete or uncommitted DCP save (the coordinator writes .metadata last; "
        "on multi-host every host must write to one shared directory)"
    )
    if data_files:
        message += f"; data files present: {_named(data_files)}"
    rank_local = sorted(f for f in files if _RANK_METADATA.match(f))
    if rank_local:
        message += f"; found rank-local {_named(rank_local)} (saved without rank coordination: open with torch)"
    findings.error("missing-metadata", message, file=dcp.METADATA_FILE)


# what _load_metadata returns for a .metadata it could not unpickle (None is a value a pickle can hold)
_UNREADABLE: Any = object()


def _load_metadata(storage: Storage, findings: Findings, allow: Any = None,
                   opened: dict[str, Any] | None = None) -> tuple[Any, dcp._ParsedMetadata | None]:
    """`.metadata` through the allow-list unpickler, or _UNREADABLE after reporting why not; and
    the reader's parse of it when it is well formed (then the unpickled object is not kept: None).

    `opened` (Checkpoint.parsed of the checkpoint its reader opened in this run: convert's
    preflight): the reader's parse, when well formed, and .metadata is not read again. A .metadata
    this process parsed already otherwise (validate before --deep's open) is read, but not
    unpickled or parsed again."""
    name = dcp.METADATA_FILE
    record = opened.get(dcp.opened_key(storage)) if opened is not None else None
    if opened is not None and record is not None and record[0] is allow:
        del opened[dcp.opened_key(storage)]  # (taken: not needed after this)
        return None, record[1]
    try:
        size = storage.size(name)
        if size > safe_pickle.MAX_METADATA_BYTES:
            findings.error(
                "bad-metadata", f"{size} bytes, over the {safe_pickle.MAX_METADATA_BYTES}-byte limit", file=name
            )
            return _UNREADABLE, None
        data = storage.read(name)
        digest = hashlib.sha256(data).digest()
        parsed = dcp.parsed_before(digest, allow)
        if parsed is not None:
            return None, parsed
        md = safe_pickle.load_metadata(data, f"{storage.url}/{name}", allow)
        del data
        parsed = dcp.parse_well_formed(md, (digest, allow))
        return (None if parsed is not None else md), parsed
    except UnsafePickleError as exc:
        findings.error(
            "unsafe-pickle",
            f"refers to {exc.module}.{exc.name}, which is not in the allow-list: refused, nothing was executed "
            "(a hostile or non-DCP file; do not load it with torch)",
            file=name,
        )
    except PathEscapeError as exc:
        findings.error("path-escape", exc.message, file=name)
    except (CkptError, OSError) as exc:
        findings.error("bad-metadata", f"unreadable: {getattr(exc, 'message', exc)}", file=name)
    return _UNREADABLE, None


def _walk(md: Any, parsed: dcp._ParsedMetadata | None, findings: Findings,
          leaf_path: Callable[[str], str] | None, *, report_metadata: bool) -> tuple[
              Callable[[str], str], dict[EntryKey, dcp._Entry], set[EntryKey], list[_Tensor], list[str]] | None:
    """.metadata's storage entries and items, every problem in them a finding: (the leaf naming,
    the entries, the keys of malformed ones, the tensors, the bytes items' fqns), or None when
    nothing can be located. `report_metadata`: the top-level object's problems and the
    planner_data paths are findings too (the shallow checks; the deep duplicate check has them)."""
    if parsed is not None:
        # well formed (the reader's parse accepted it, in this command or just now): the walk
        # below would find nothing wrong in it; what it would build is built from the parse
        keys_of = parsed.keys or {}

        def leaf_of(fqn: str) -> str:
            if leaf_path is not None:
                return leaf_path(fqn)
            keys = keys_of.get(fqn)
            return keys_path(keys if keys is not None else parsed.keys_for(fqn))

        tensors, bytes_fqns = _parsed_items(parsed, leaf_of, findings)
        return leaf_of, parsed.storage, set(), tensors, bytes_fqns
    if md is _UNREADABLE:
        return None
    if report_metadata:
        # the object torch's reader gets (a pickled None is a value, not a failure)
        problem = dcp.metadata_problem(md)
        if problem:
            findings.error("bad-metadata", problem, file=dcp.METADATA_FILE)
    if not (isinstance(md, safe_pickle.Metadata) and isinstance(md.state_dict_metadata, dict)
            and isinstance(md.storage_data, dict)):
        return None

    # the reader's leaf paths (planner_data's original keys), so that findings
    # name the same leaf as `ckpt inspect` and --deep do
    naming = dcp._ParsedMetadata(items={}, storage={}, planner_data=md.planner_data, version=None)

    def named_leaf(fqn: str) -> str:
        return leaf_path(fqn) if leaf_path is not None else keys_path(naming.keys_for(fqn))

    entries, malformed = _storage_entries(md.storage_data, named_leaf, findings)
    tensors, bytes_fqns = _items(md.state_dict_metadata, named_leaf, findings,
                                 md.planner_data if report_metadata else None)
    return named_leaf, entries, malformed, tensors, bytes_fqns


def _parsed_items(
    parsed: dcp._ParsedMetadata, leaf_of: Callable[[str], str], findings: Findings
) -> tuple[list[_Tensor], list[str]]:
    """_items() of a well-formed .metadata, from the reader's parse of it (the same tensors, in the
    same order; the one finding _items makes on such a file: a layout ckpt does not read)."""
    tensors: list[_Tensor] = []
    bytes_fqns: list[str] = []
    itemsizes: dict[str, int] = {}
    for fqn, item in parsed.items.items():
        if type(item) is not dcp._TensorItem:
            bytes_fqns.append(fqn)
            continue
        leaf = leaf_of(fqn)
        itemsize = itemsizes.get(item.dtype)
        if itemsize is None:
            itemsize = itemsizes[item.dtype] = dtypes.get(item.dtype).itemsize
        if item.layout != "torch.strided":
            findings.error(
                "bad-metadata",
                f"{fqn}: a {item.layout.removeprefix('torch.')} tensor: ckpt reads only strided (dense) tensors "
                "and cannot check or convert it (load it with torch)",
                leaf=leaf, file=dcp.METADATA_FILE,
            )
        tensors.append(_Tensor(fqn, leaf, item.shape, list(item.chunks), item.duplicates, dict(item.copies or {}),
                               itemsize))
    return tensors, bytes_fqns


def _storage_entries(
    storage_data: dict, leaf_of: Callable[[str], str], findings: Findings
) -> tuple[dict[EntryKey, dcp._Entry], set[EntryKey]]:
    """storage_data as {(fqn, offsets | None): entry}, and the keys of entries too malformed to use.

    Malformed entries are reported here, once, and skipped.
    """
    out: dict[EntryKey, dcp._Entry] = {}
    malformed: set[EntryKey] = set()
    where = dcp.METADATA_FILE
    for index, info in storage_data.items():
        problem = dcp.index_problem(index)
        if problem:
            fqn = getattr(index, "fqn", None)
            findings.error("bad-metadata", problem, leaf=leaf_of(fqn) if isinstance(fqn, str) else None, file=where)
            continue
        fqn = index.fqn
        try:
            offsets = None if index.offset is None else dcp._int_tuple(index.offset, "storage_data offset", where)
        except CkptError as exc:
            findings.error("bad-metadata", f"storage_data entry of {fqn}: {exc.message}", leaf=leaf_of(fqn), file=where)
            continue
        try:
            entry = dcp._entry(info, where)
        except CkptError as exc:
            findings.error("bad-metadata", f"storage_data entry of {fqn}: {exc.message}", leaf=leaf_of(fqn), file=where)
            malformed.add((fqn, offsets))
            continue
        # MetadataIndex.index is only a lookup hint; (fqn, offsets) is the
        # identity, and like torch's dict the last entry for it wins
        out[(fqn, offsets)] = entry
        malformed.discard((fqn, offsets))
    return out, malformed


def _items(
    sdm: dict, leaf_of: Callable[[str], str], findings: Findings, naming_data: Any = None
) -> tuple[list[_Tensor], list[str]]:
    """The tensors (with their well-formed chunks) and the bytes items' fqns."""
    tensors: list[_Tensor] = []
    bytes_fqns: list[str] = []
    where = dcp.METADATA_FILE
    for fqn, item in sdm.items():
        if not isinstance(fqn, str):
            findings.error("bad-metadata", f"state_dict_metadata key {short_repr(fqn)} is not a string", file=where)
            continue
        leaf = leaf_of(fqn)
        problem = dcp.planner_path_problem(naming_data, fqn)
        if problem:
            findings.error("bad-metadata", f"{fqn}: {problem}", leaf=leaf, file=where)
        if isinstance(item, safe_pickle.BytesStorageMetadata):
            bytes_fqns.append(fqn)
            continue
        if not isinstance(item, safe_pickle.TensorStorageMetadata):
            findings.error("bad-metadata", f"{fqn}: unknown storage metadata {type(item).__name__}", leaf=leaf, file=where)
            continue
        props = item.properties
        problem = dcp.properties_problem(props)
        if problem:
            findings.error("bad-metadata", f"{fqn}: {problem}", leaf=leaf, file=where)
            continue
        itemsize = 0
        try:
            itemsize = dtypes.get(dtypes.from_torch(props.dtype.name).name).itemsize
        except CkptError as exc:  # e.g. a quantized tensor's qint8: reading it would fail, so would --deep
            findings.error(
                "bad-metadata", f"{fqn}: {exc.message}: ckpt cannot read, check or convert this tensor (load it with torch)",
                leaf=leaf, file=where,
            )
        if isinstance(props.layout, str) and props.layout != "torch.strided":
            findings.error(
                "bad-metadata",
                f"{fqn}: a {props.layout.removeprefix('torch.')} tensor: ckpt reads only strided (dense) tensors "
                "and cannot check or convert it (load it with torch)",
                leaf=leaf, file=where,
            )
        try:
            shape = dcp._int_tuple(item.size, "tensor size", where)
        except CkptError as exc:
            findings.error("bad-metadata", f"{fqn}: {exc.message}", leaf=leaf, file=where)
            continue
        if any(n < 0 for n in shape):
            findings.error("bad-metadata", f"{fqn}: negative dimension in size {list(shape)}", leaf=leaf, file=where)
            continue
        if not isinstance(item.chunks, (list, tuple)):
            findings.error("bad-metadata", f"{fqn}: chunk list is not a list", leaf=leaf, file=where)
            continue
        chunks: list[Chunk] = []
        seen: set[Chunk] = set()
        duplicates = 0
        copies: dict[Chunk, int] = {}
        for chunk_md in item.chunks:
            try:
                if not isinstance(chunk_md, safe_pickle.ChunkStorageMetadata):
                    raise CkptError(f"chunk {short_repr(chunk_md)} is not a ChunkStorageMetadata")
                offsets = dcp._int_tuple(chunk_md.offsets, "chunk offsets", where)
                sizes = dcp._int_tuple(chunk_md.sizes, "chunk sizes", where)
            except CkptError as exc:
                findings.error("bad-metadata", f"{fqn}: {exc.message}", leaf=leaf, file=where)
                continue
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                findings.error(
                    "bad-metadata",
                    f"{fqn}: chunk at offsets {list(offsets)} with sizes {list(sizes)} does not match the "
                    f"tensor's rank {len(shape)}",
                    leaf=leaf, file=where,
                )
                continue
            chunk = Chunk(offsets, sizes)
            if chunk in seen:
                # the same offsets and sizes again: a replicated duplicate kept by
                # the save planner (torch loads it); storage_data has one copy
                duplicates += 1
                copies[chunk] = copies.get(chunk, 1) + 1
                continue
            seen.add(chunk)
            chunks.append(chunk)
        tensors.append(_Tensor(fqn, leaf, shape, chunks, duplicates, copies, itemsize))
    tree = dcp.planner_tree_problem(naming_data, [fqn for fqn in sdm if isinstance(fqn, str)])
    if tree is not None:
        findings.error("bad-metadata", f"{tree[0]}: {tree[1]}", leaf=leaf_of(tree[0]), file=where)
    return tensors, bytes_fqns


# ---------------------------------------------------------------------------
# Data files
# ---------------------------------------------------------------------------
def _check_files(storage: Storage, placed: list[_Placed], findings: Findings) -> tuple[set[str], list[_Placed]]:
    """Each referenced data file: inside the checkpoint, present, non-empty, long enough.

    One size() per file; returns the referenced names (for the stray-file
    check) and the entries nothing here found wrong with (in a readable
    file, within it, not overlapping another, non-empty, torch reads them):
    those whose bytes _check_entry_bounds may look at.
    """
    sound: list[_Placed] = []
    by_file: dict[str, list[_Placed]] = defaultdict(list)
    for p in placed:
        by_file[p.entry.relative_path].append(p)
    # (on an object store each size is a round trip or more: all of them in flight together)
    needs = {name: max(p.entry.offset + p.entry.length for p in items) for name, items in by_file.items()}
    storage.prefetch_shortfalls({name: max(1, need) for name, need in needs.items() if "\x00" not in name})
    for name in sorted(by_file):
        items = by_file[name]
        if "\x00" in name:  # the OS would refuse it (ValueError), not report it missing
            findings.error(
                "bad-metadata",
                f"storage entry file name {name!r} contains a NUL byte; .metadata places {_items_text(items)}",
                leaf=_one_leaf(items), file=dcp.METADATA_FILE,
            )
            continue
        if posixpath.normpath(name) == dcp.METADATA_FILE:
            # the coordinator's own pickle is never a data file (torch writes it last, over nothing)
            findings.error(
                "bad-metadata", f"a storage entry points into {dcp.METADATA_FILE} itself; .metadata places {_items_text(items)}",
                leaf=_one_leaf(items), file=dcp.METADATA_FILE,
            )
            continue
        try:
            # (what the entries need, when the file holds at least that: every comparison below is
            # against the entries' ends)
            need = max(1, needs[name])  # (an empty file is always told)
            short = storage.shortfall(name, need)
            size = need if short is None else short
        except PathEscapeError as exc:
            findings.error(
                "path-escape",
                f"refused to read it ({exc.message}); .metadata places {_items_text(items)}",
                leaf=_one_leaf(items), file=name,
            )
            continue
        except (NotFoundError, FileNotFoundError):
            findings.error(
                "missing-file",
                f"data file is missing; .metadata places {_items_text(items)} (the rank that wrote it did not "
                "finish, or the file was not copied)",
                leaf=_one_leaf(items), file=name,
            )
            continue
        except (CkptError, OSError) as exc:
            findings.error(
                "unreadable-file",
                f"data file cannot be read ({getattr(exc, 'message', exc)}); .metadata places {_items_text(items)}",
                leaf=_one_leaf(items), file=name,
            )
            continue
        unreadable = _unreadable(storage, name) if size and storage.local_root is not None else None
        if unreadable is not None:
            # one finding for the file, with the OS's reason: not one per entry blaming .metadata's offsets
            findings.error(
                "unreadable-file",
                f"data file cannot be read ({unreadable}); .metadata places {_items_text(items)}",
                leaf=_one_leaf(items), file=name,
            )
            continue
        if size == 0:
            findings.error(
                "empty-file",
                f"data file is empty (0 bytes) but .metadata places {_items_text(items)} (the host that wrote it "
                "failed or its copy did not complete); restore will fail",
                leaf=_one_leaf(items), file=name,
            )
            continue
        clashing = _check_overlaps(name, items, findings)
        past = [p for p in items if p.entry.offset + p.entry.length > size]
        sound += [p for p in items if p.entry.length > 0 and not p.orphan and p.entry.offset + p.entry.length <= size
                  and (p.entry.offset, p.entry.length) not in clashing]
        if past:
            need = max(p.entry.offset + p.entry.length for p in past)
            findings.error(
                "truncated-file",
                f"data file has {size} bytes but .metadata needs {need}; "
                f"{len(past)} item{'s' if len(past) != 1 else ''} past its end: "
                f"{_named([p.label for p in past], _MAX_NAMED_ITEMS)}",
                leaf=_one_leaf(past), file=name,
            )
    return set(by_file), sound


def _unreadable(storage: Storage, name: str) -> str | None:
    """Why a local data file that stat() sees cannot be read (permissions, an I/O error), or None.

    One byte read: a file the OS refuses to open fails every entry in it
    the same way, which is one problem with the file, not with .metadata.
    """
    try:
        storage.read_range(name, 0, 1)
    except PathEscapeError:
        raise
    except CkptError as exc:
        return exc.message.removeprefix("cannot read: ")
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _check_overlaps(name: str, items: list[_Placed], findings: Findings) -> set[tuple[int, int]]:
    """Entries of one data file sharing bytes: torch writes each item once, back to back, so an
    entry reaching into its neighbour has a wrong offset or length (torch.load then reads a
    stream that does not start or end where an archive does). One identical range listed
    twice is not an overlap."""
    ranges = sorted({(p.entry.offset, p.entry.offset + p.entry.length): p for p in items if p.entry.length}.items())
    clashes: list[tuple[_Placed, _Placed]] = []
    end, last = -1, None
    for (start, stop), p in ranges:
        if last is not None and start < end:
            clashes.append((last, p))
        if stop > end:
            end, last = stop, p
    if clashes:
        a, b = clashes[0]
        more = f" (and {len(clashes) - 1} more overlapping entries)" if len(clashes) > 1 else ""
        findings.error(
            "bad-metadata",
            f"storage entries overlap: {a.label} at [{a.entry.offset}:{a.entry.offset + a.entry.length}] and "
            f"{b.label} at [{b.entry.offset}:{b.entry.offset + b.entry.length}]{more}; one of them has a wrong "
            "offset or length (torch would read a damaged item)",
            leaf=b.leaf, file=name,
        )
    clashing = {(p.entry.offset, p.entry.length) for pair in clashes for p in pair}
    # one range listed for items of different sizes (tensor archives of a few
    # dozen bytes all have the same length, so an offset moved onto another
    # item's start overlaps nothing): one archive cannot be both
    by_range: dict[tuple[int, int], list[_Placed]] = defaultdict(list)
    for p in items:
        if p.entry.length and not p.orphan:
            by_range[(p.entry.offset, p.entry.length)].append(p)
    shared = [(r, ps) for r, ps in sorted(by_range.items()) if len({p.sizes for p in ps}) > 1]
    if shared:
        (start, length), ps = shared[0]
        a = ps[0]
        b = next(p for p in ps if p.sizes != a.sizes)
        more = f" (and {len(shared) - 1} more ranges like it)" if len(shared) > 1 else ""
        findings.error(
            "bad-metadata",
            f"storage entries of {a.label} and {b.label} both point at bytes [{start}:{start + length}]{more}: "
            "items of different sizes cannot be one archive; one of them has a wrong offset (torch would read "
            "the wrong item)",
            leaf=b.leaf, file=name,
        )
        clashing |= {r for r, _ in shared}
    # (offset, length) of every entry in a clash: reported here, not probed again
    return clashing


def _items_text(items: list[_Placed]) -> str:
    return f"{len(items)} item{'s' if len(items) != 1 else ''} in it: {_named([p.label for p in items], _MAX_NAMED_ITEMS)}"


def _one_leaf(items: list[_Placed]) -> str | None:
    """The leaf a file-level finding is about, when every item belongs to the same one."""
    leaves = {p.leaf for p in items}
    return next(iter(leaves)) if len(leaves) == 1 else None


# ---------------------------------------------------------------------------
# Entry bounds: each storage entry holds exactly one whole item
# ---------------------------------------------------------------------------
# torch.save's legacy (pre-zip) format begins with this pickle of its magic
# number; torch.load still reads it, and its end has no record to check
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."
# the end records torch.save writes (miniz opened with zip64): zip64 end
# record (56 bytes), its locator (20), the end of central directory (22)
_TAIL_BYTES = 56 + 20 + 22
_MAX_ZIP_COMMENT = 0xFFFF
# read-ahead of a zstd frame walk: small blocks' headers come in one read
_ZSTD_READ_AHEAD = 4096
# reads one entry's check may make before it gives up quietly (a zstd walk
# reads one block header per 128 KiB block of a large frame that does not
# compress: 4096, ~0.1 s here, walk a 512 MiB one; remote reads are round
# trips, so far fewer there)
_ENTRY_READS_LOCAL = 4096
_ENTRY_READS_REMOTE = 8
# reads in flight at once on remote storage (each a round trip)
_REMOTE_PROBES = 32
# first ranges of one file closer than this are read as one: a file of 3,000
# small archives costs a few reads, not 3,000
_MERGE_GAP = 64 << 10
_MERGE_MAX = 4 << 20


# an entry's check ran out of reads (counted in the summary, not a finding)
_NOT_WALKED = "(not walked)"


class _OutOfReads(Exception):
    """An entry's check ran out of its read budget: it is left unjudged."""


class _EntryBytes:
    """Bytes [0, length) of one storage entry, read in small cached ranges within a budget."""

    def __init__(self, storage: Storage, entry: dcp._Entry, reads: int, seed: tuple[int, bytes]) -> None:
        self._storage, self._entry, self._reads = storage, entry, reads
        self.length, self.transforms = entry.length, entry.transforms
        self._segments: list[tuple[int, bytes]] = [seed]  # (position in the entry, bytes read there)

    def get(self, pos: int, n: int, ahead: int = 0) -> bytes:
        """Bytes [pos, pos + n) of the entry, clipped to it; reading `ahead` more when it must read."""
        end = min(self.length, pos + n)
        if pos < 0 or pos >= end:
            return b""
        for lo, data in self._segments:
            if lo <= pos and end <= lo + len(data):
                return data[pos - lo : end - lo]
        if self._reads <= 0:
            raise _OutOfReads
        self._reads -= 1
        stop = min(self.length, max(end, pos + ahead))
        base = self._entry.offset
        data = self._storage.read_range(self._entry.relative_path, base + pos, base + stop)
        # the first range and the latest two: a zstd walk only moves forward
        self._segments = self._segments[:1] + self._segments[1:][-1:] + [(pos, data)]
        return data[: end - pos]


class _ZstdView:
    """_zstd_frame_end's window over one entry (positions relative to its offset)."""

    def __init__(self, entry: _EntryBytes) -> None:
        self._entry = entry

    def get(self, pos: int, n: int) -> bytes:
        return self._entry.get(pos, n, _ZSTD_READ_AHEAD)


def _zip_problem(b: _EntryBytes) -> str | None:
    """Why entry `b` is not exactly one torch.save zip archive, or None.

    torch.save ends an archive with its end-of-central-directory record (and
    the zip64 records before it), whose central-directory offset counts from
    the archive's first byte: from one read of the entry's last 98 bytes,
    the record sitting at the entry's end says the end is right, and the
    directory ending where those records begin says the start is. torch
    (miniz) fails on an entry cut inside its archive ("failed finding
    central directory") or starting inside it ("invalid load key").
    """
    n = b.length
    tail_at = max(0, n - _TAIL_BYTES)
    tail = b.get(tail_at, n - tail_at)
    if n >= _EOCD.size and tail[-_EOCD.size:-_EOCD.size + 4] == b"PK\x05\x06" and tail[-2:] == b"\x00\x00":
        eocd = n - _EOCD.size  # where torch writes it: the last 22 bytes, no comment
    else:
        head = b.get(0, len(_LEGACY_MAGIC))
        if head == _LEGACY_MAGIC:
            return None  # legacy torch.save format: torch.load reads it; nothing here to check
        if head[:4] != _LOCAL_HEADER:
            return "does not start with a zip archive (no local header at its offset)"
        # an archive with a comment: its record is further back (as miniz looks, up to 64 KiB)
        lo = max(0, n - (_MAX_ZIP_COMMENT + _EOCD.size))
        block = b.get(lo, n - lo)
        at = block.rfind(b"PK\x05\x06", 0, len(block) - _EOCD.size + 4)
        if at < 0:
            return ("does not end where its archive does: no end-of-central-directory record at its end "
                    "(the entry ends inside the archive, or the archive is damaged there)")
        eocd = lo + at
        comment = _EOCD.unpack(block[at : at + _EOCD.size])[7]
        if eocd + _EOCD.size + comment != n:
            return (f"does not end where its archive does: the archive's end record says it ends at byte "
                    f"{eocd + _EOCD.size + comment} of the entry's {n}")
    cd_size, cd_offset = _EOCD.unpack(b.get(eocd, _EOCD.size))[5:7]
    locator = b.get(eocd - _ZIP64_LOCATOR.size, _ZIP64_LOCATOR.size) if eocd >= _ZIP64_LOCATOR.size else b""
    if locator[:4] == b"PK\x06\x07":
        record_at = _ZIP64_LOCATOR.unpack(locator)[2]  # counted from the archive's start, as everything here
        locator_at = eocd - _ZIP64_LOCATOR.size
        record = b.get(record_at, _ZIP64_EOCD.size) if record_at + _ZIP64_EOCD.size <= locator_at else b""
        if record[:4] != b"PK\x06\x06" or record_at + 12 + _ZIP64_EOCD.unpack(record)[1] != locator_at:
            return ("does not start where its archive does: the archive's zip64 end record is not where its "
                    "locator, counted from the entry's offset, puts it")
        cd_size, cd_offset = _ZIP64_EOCD.unpack(record)[8:10]
        cd_end, records_at = cd_offset + cd_size, record_at
    else:
        cd_end, records_at = cd_offset + cd_size, eocd
    if cd_end != records_at:
        return (f"does not start where its archive does: the central directory, counted from the entry's "
                f"offset, ends {cd_end - records_at:+d} bytes away from the end records (the archive starts "
                f"{records_at - cd_end:+d} bytes from the entry's offset)")
    return None


def _zstd_problem(b: _EntryBytes) -> str | None:
    """Why entry `b` (transform stream.zstd/1) is not exactly one zstd frame, or None.

    torch's ZStandard extension decompresses one frame; the frame's end is
    found by walking its block headers from the start (RFC 8878).
    """
    if b.get(0, 4, _ZSTD_READ_AHEAD) != _ZSTD_MAGIC:
        return "does not start with a zstd frame (its transform is stream.zstd/1)"
    end = _zstd_frame_end(_ZstdView(b), 0, b.length)  # type: ignore[arg-type]
    if end is None:
        return "does not end where its zstd frame does (the entry ends inside the frame, or the frame is damaged)"
    if end != b.length:
        return f"does not end where its zstd frame does: the frame ends at byte {end} of the entry's {b.length}"
    return None


def _first_range(entry: dcp._Entry) -> tuple[int, int]:
    """The bytes of its file an entry's check reads first: a zip's end records, a zstd frame's start."""
    if entry.transforms:
        return entry.offset, entry.offset + min(entry.length, _ZSTD_READ_AHEAD)
    return entry.offset + max(0, entry.length - _TAIL_BYTES), entry.offset + entry.length


def _read_groups(entries: list[dcp._Entry]) -> list[tuple[str, int, int, list[dcp._Entry]]]:
    """The entries' first ranges, merged per file where they lie close: (file, start, end, entries)."""
    groups: list[list[Any]] = []
    for entry in sorted(entries, key=lambda e: (e.relative_path, _first_range(e))):
        lo, hi = _first_range(entry)
        last = groups[-1] if groups else None
        if (last is not None and last[0] == entry.relative_path and lo - last[2] <= _MERGE_GAP
                and max(hi, last[2]) - last[1] <= _MERGE_MAX):
            last[2] = max(last[2], hi)
            last[3].append(entry)
        else:
            groups.append([entry.relative_path, lo, hi, [entry]])
    return [(name, lo, hi, members) for name, lo, hi, members in groups]


def _check_group(
    storage: Storage, group: tuple[str, int, int, list[dcp._Entry]], reads: int
) -> list[tuple[dcp._Entry, str | None]]:
    """One read for a group of entries, then each entry judged (further reads only where it needs them)."""
    name, lo, hi, members = group
    try:
        data = storage.read_range(name, lo, hi)
    except (PathEscapeError, StorageUnavailableError):
        raise  # one finding for the run, not one per entry
    except (CkptError, OSError) as exc:
        problem = f"cannot be read ({getattr(exc, 'message', None) or exc})"
        return [(entry, problem) for entry in members]
    out: list[tuple[dcp._Entry, str | None]] = []
    for entry in members:
        a, b = _first_range(entry)
        if not entry.transforms and _zip_tail_sound(data, a - lo, entry.length):
            out.append((entry, None))
            continue
        out.append((entry, _entry_problem(_EntryBytes(storage, entry, reads, (a - entry.offset, data[a - lo : b - lo])))))
    return out


def _zip_tail_sound(data: bytes, at: int, n: int) -> bool:
    """True when _zip_problem would find nothing wrong with an entry of n bytes whose last
    _TAIL_BYTES are data[at:at + _TAIL_BYTES], decided from those bytes alone (False: undecided).

    The archive torch.save writes, whose zip64 end record, locator and end record are its
    last 98 bytes: read in place (no copies, no reader object), for the 10^4-10^5 small
    entries of a checkpoint of many tensors. Anything else is left to _zip_problem."""
    if n < _TAIL_BYTES or len(data) < at + _TAIL_BYTES:
        return False
    eocd = at + _TAIL_BYTES - _EOCD.size
    sig, _, _, _, _, cd_size, cd_offset, comment = _EOCD.unpack_from(data, eocd)
    if sig != b"PK\x05\x06" or comment != 0:
        return False
    locator = eocd - _ZIP64_LOCATOR.size
    if data[locator : locator + 4] != b"PK\x06\x07":
        return cd_offset + cd_size == n - _EOCD.size
    record_at = _ZIP64_LOCATOR.unpack_from(data, locator)[2]
    if record_at != n - _TAIL_BYTES:
        return False
    record = _ZIP64_EOCD.unpack_from(data, at)
    return (record[0] == b"PK\x06\x06" and record_at + 12 + record[1] == n - _TAIL_BYTES + _ZIP64_EOCD.size
            and record[8] + record[9] == record_at)


def _entry_problem(b: _EntryBytes) -> str | None:
    try:
        return _zstd_problem(b) if b.transforms else _zip_problem(b)
    except _OutOfReads:
        return _NOT_WALKED  # a frame too long to walk within the budget: --deep reads it
    except (PathEscapeError, StorageUnavailableError):
        raise
    except CkptError as exc:
        return f"cannot be read ({exc.message})"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"


def _check_entry_bounds(storage: Storage, sound: list[_Placed], findings: Findings) -> None:
    """Each entry holds one whole item: starts and ends exactly where its archive (or zstd frame) does.

    An offset or length changed by a few bytes, so that the entry stays
    inside its file and clear of its neighbours, passes every check above;
    torch.load of it fails. One small read per entry (neighbouring entries'
    reads merged into one; a walk of block headers for a zstd entry); on
    remote storage many reads at once. Entries with a transform other than
    torch's ZStandard are not judged (reported already as undecodable), nor
    is anything torch never reads.
    """
    distinct: dict[dcp._Entry, list[_Placed]] = {}
    for p in sound:
        if p.entry.transforms and p.entry.transforms != (dcp_transforms.KNOWN[0],):
            continue
        distinct.setdefault(p.entry, []).append(p)
    if not distinct:
        return
    groups = _read_groups(list(distinct))
    results: list[tuple[dcp._Entry, str | None]] = []
    if storage.local_root is not None:
        for group in groups:
            results += _check_group(storage, group, _ENTRY_READS_LOCAL)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(_REMOTE_PROBES, len(groups)), thread_name_prefix="ckpt-bounds") as pool:
            for part in pool.map(lambda g: _check_group(storage, g, _ENTRY_READS_REMOTE), groups):
                results += part
    bad: dict[str, list[tuple[_Placed, str]]] = defaultdict(list)
    not_walked = sum(1 for _, problem in results if problem is _NOT_WALKED)
    if not_walked:
        findings.count("zstd_frames_too_long_to_walk", not_walked)
    for entry, problem in results:
        if problem and problem is not _NOT_WALKED:
            bad[entry.relative_path] += [(p, problem) for p in distinct[entry]]
    for name, items in sorted(bad.items()):
        shown = "; ".join(
            f"{p.label} at [{p.entry.offset}:{p.entry.offset + p.entry.length}] {problem}"
            for p, problem in items[:_MAX_NAMED]
        )
        more = f"; and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else ""
        plural = len(items) != 1
        findings.error(
            "bad-metadata",
            f"{len(items)} storage entr{'ies' if plural else 'y'} in .metadata do{'' if plural else 'es'} not "
            f"hold one whole item: {shown}{more}; the offset or length in .metadata is wrong (or the file is "
            "damaged there): torch.load of it fails",
            leaf=_one_leaf([p for p, _ in items]), file=name,
        )


# ---------------------------------------------------------------------------
# Chunk geometry: bounds, overlap, coverage
# ---------------------------------------------------------------------------
def _check_geometry(tensor: _Tensor, findings: Findings) -> None:
    """A tensor's chunks: inside its shape, pairwise disjoint, together covering every element."""
    shape, leaf = tensor.shape, tensor.leaf
    if len(tensor.chunks) == 1:
        only = tensor.chunks[0]
        if only.sizes == shape and not any(only.offsets):
            # one chunk that is the whole tensor (offsets and shape are ints here, the shape
            # not negative): inside it, nothing to overlap, nothing left uncovered
            return

    def error(code: str, message: str) -> None:
        findings.error(code, message, leaf=leaf, file=dcp.METADATA_FILE)

    boxes: list[tuple[Chunk, Box]] = []  # the in-bounds part of every chunk that covers something
    out_of_bounds = 0
    for chunk in tensor.chunks:
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, shape)):
            out_of_bounds += 1
            if out_of_bounds <= _MAX_CHUNK_FINDINGS:
                error(
                    "chunk-out-of-bounds",
                    f"chunk at offsets {list(chunk.offsets)} with sizes {list(chunk.sizes)} "
                    f"(region {_box_text(_chunk_box(chunk))}) extends past the tensor's shape {list(shape)}",
                )
        # only the in-bounds part can hold tensor elements
        box = tuple((max(0, o), min(n, o + s)) for o, s, n in zip(chunk.offsets, chunk.sizes, shape))
        if all(lo < hi for lo, hi in box):  # zero-size chunks are legal (empty shards) and cover nothing
            boxes.append((chunk, box))
    if out_of_bounds > _MAX_CHUNK_FINDINGS:
        error("chunk-out-of-bounds", f"... and {out_of_bounds - _MAX_CHUNK_FINDINGS} more chunks past the shape {list(shape)}")

    numel = math.prod(shape)
    if numel == 0 or _tiles_exactly(shape, [box for _, box in boxes]):
        return  # the normal case, in O(chunks): no overlap, no gap
    if not boxes:
        error("coverage-gap", f"no chunk stores any of the {numel} elements of this tensor: restored values are undefined")
        return

    grid = _cell_grid(shape, [box for _, box in boxes])
    if grid is None:
        # an irregular layout with very many distinct chunk boundaries: a
        # budgeted pairwise search for overlaps, element counts for gaps
        pairs = list(itertools.islice(_overlapping_pairs(boxes, _PAIR_BUDGET), _MAX_CHUNK_FINDINGS + 1))
        _report_overlaps(pairs, error)
        covered = sum(math.prod(hi - lo for lo, hi in box) for _, box in boxes)
        if not pairs and covered < numel:
            error(
                "coverage-gap",
                f"{numel - covered} of {numel} elements are covered by no chunk (too many chunks to list the "
                "regions); restored values there are undefined",
            )
        return

    bounds, counts = grid
    if (counts > 1).any():
        # name the pairs: only chunks touching a cell counted twice can take part
        suspects = [cb for cb in boxes if (counts[_cells(bounds, cb[1])] > 1).any()]
        pairs = list(itertools.islice(_overlapping_pairs(suspects, _PAIR_BUDGET), _MAX_CHUNK_FINDINGS + 1))
        if pairs:
            _report_overlaps(pairs, error)
        else:  # the budget ran out before a pair was named
            error("chunk-overlap", "some elements are covered by more than one chunk (too many chunks to name the pairs)")
    free = counts == 0
    if not free.any():
        return
    missing = int(_cell_volumes(bounds)[free].sum())
    regions, more = _free_regions(bounds, free)
    text = ", ".join(_box_text(r) for r in regions[:_MAX_NAMED])
    more = more or len(regions) > _MAX_NAMED
    if more:
        text += " and more"
    plural = len(regions) > 1 or more
    error(
        "coverage-gap",
        f"region{'s' if plural else ''} {text} {'are' if plural else 'is'} covered by no chunk "
        f"({missing} of {numel} elements); restored values there are undefined",
    )


def _report_overlaps(pairs: list[tuple[Chunk, Chunk, Box]], error: Callable[[str, str], None]) -> None:
    for a, b, common in pairs[:_MAX_CHUNK_FINDINGS]:
        error(
            "chunk-overlap",
            f"chunks at offsets {list(a.offsets)} sizes {list(a.sizes)} and at offsets {list(b.offsets)} "
            f"sizes {list(b.sizes)} both cover {_box_text(common)}",
        )
    if len(pairs) > _MAX_CHUNK_FINDINGS:
        error("chunk-overlap", "... and more overlapping chunk pairs")


def _tiles_exactly(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """True when the boxes are exactly the cells of a grid partitioning the tensor.

    That is how torch shards (DTensor placements, FSDP, even uneven ones): per
    dimension, the chunks' intervals partition [0, n), and every combination
    occurs once. Distinct boxes drawn from a partition's product, as many as the
    product has, are that product: no overlap and no gap.
    """
    partitions = [sorted({box[d] for box in boxes}) for d in range(len(shape))]
    for intervals, n in zip(partitions, shape):
        end = 0
        for lo, hi in intervals:
            if lo != end:
                return False
            end = hi
        if end != n:
            return False
    return len(boxes) == math.prod(len(p) for p in partitions) and len(set(boxes)) == len(boxes)


def _cell_grid(shape: tuple[int, ...], boxes: list[Box]) -> tuple[list[list[int]], np.ndarray] | None:
    """Coordinate compression: the chunk boundaries cut each dimension into
    intervals, and every cell of that grid is covered by a whole number of
    chunks. Returns (boundaries per dimension, how many chunks cover each cell),
    or None when the grid has more than _MAX_COVERAGE_CELLS cells.
    """
    bounds = [sorted({0, n} | {v for box in boxes for v in box[d]}) for d, n in enumerate(shape)]
    if math.prod(len(b) - 1 for b in bounds) > _MAX_COVERAGE_CELLS:
        return None
    counts = np.zeros(tuple(len(b) - 1 for b in bounds), dtype=np.int32)
    for box in boxes:
        counts[_cells(bounds, box)] += 1
    return bounds, counts


def _cells(bounds: list[list[int]], box: Box) -> tuple[slice, ...]:
    """The grid cells a box covers."""
    return tuple(slice(bisect.bisect_left(b, lo), bisect.bisect_left(b, hi)) for b, (lo, hi) in zip(bounds, box))


def _cell_volumes(bounds: list[list[int]]) -> np.ndarray:
    """Elements per grid cell."""
    widths = [np.diff(np.asarray(b, dtype=np.int64)) for b in bounds]
    return functools.reduce(np.multiply.outer, widths, np.array(1, dtype=np.int64))


def _free_regions(bounds: list[list[int]], free: np.ndarray) -> tuple[list[Box], bool]:
    """The free cells merged into disjoint boxes (tensor coordinates), and whether more were left unlisted.

    From the first free cell in C order, grow along the last dimension, then
    the one before, ... while the slab stays free; mark the box and repeat.
    """
    free = free.copy()
    grid = free.shape
    regions: list[Box] = []
    while free.any():
        if len(regions) == _MAX_GAP_BOXES:
            return regions, True
        start = [int(i) for i in np.argwhere(free)[0]]
        stop = [i + 1 for i in start]
        for d in reversed(range(len(grid))):
            while stop[d] < grid[d]:
                slab = tuple(slice(stop[d], stop[d] + 1) if k == d else slice(start[k], stop[k]) for k in range(len(grid)))
                if not free[slab].all():
                    break
                stop[d] += 1
        free[tuple(slice(a, b) for a, b in zip(start, stop))] = False
        regions.append(tuple((bounds[d][start[d]], bounds[d][stop[d]]) for d in range(len(grid))))
    return regions, False


def _uncovered(shape: tuple[int, ...], boxes: list[Box]) -> tuple[int, list[Box], bool] | None:
    """Exactly which elements no box covers: (count, disjoint boxes, more boxes not listed); None past the cap."""
    grid = _cell_grid(shape, boxes)
    if grid is None:
        return None
    bounds, counts = grid
    free = counts == 0
    regions, more = _free_regions(bounds, free)
    return int(_cell_volumes(bounds)[free].sum()), regions, more


def _overlapping_pairs(boxes: list[tuple[Chunk, Box]], budget: int | None = None) -> Iterator[tuple[Chunk, Chunk, Box]]:
    """Pairs of chunks sharing elements, with the shared box.

    A sweep along the dimension with the most distinct chunk starts: only
    chunks whose intervals meet in that dimension are compared. Stops quietly
    after `budget` comparisons.
    """
    if len(boxes) < 2:
        return
    ndim = len(boxes[0][1])
    if ndim == 0:  # every non-empty chunk of a 0-d tensor covers its one element
        for other in boxes[1:]:
            yield boxes[0][0], other[0], ()
        return
    dim = max(range(ndim), key=lambda d: len({box[d][0] for _, box in boxes}))
    order = sorted(boxes, key=lambda cb: cb[1][dim])
    compared = 0
    for i, (chunk_a, box_a) in enumerate(order):
        end = box_a[dim][1]
        for chunk_b, box_b in order[i + 1:]:
            if box_b[dim][0] >= end:
                break
            compared += 1
            if budget is not None and compared > budget:
                return
            common = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(box_a, box_b))
            if all(lo < hi for lo, hi in common):
                yield chunk_a, chunk_b, common


# ---------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------
def _chunk_label(fqn: str, chunk: Chunk) -> str:
    """A chunk as messages name it: "model.w[3:6, 0:4]" (a 0-d tensor's only chunk is just "fqn")."""
    return f"{fqn}{_box_text(_chunk_box(chunk))}" if chunk.offsets else fqn


def _chunk_box(chunk: Chunk) -> Box:
    return tuple((o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))


def _box_text(box: Box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def _named(names: list[str], limit: int = _MAX_NAMED) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---------------------------------------------------------------------------
# Replicated duplicates (--deep)
# ---------------------------------------------------------------------------
_LOCAL_HEADER = b"PK\x03\x04"
_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory record
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_WINDOW = 1 << 20
_COMPARE_BLOCK = 8 << 20


class _Window:
    """Buffered small reads of one data file (zip records, zstd block headers)."""

    def __init__(self, storage: Storage, name: str, size: int) -> None:
        self._storage, self._name, self.size = storage, name, size
        self._start, self._data = 0, b""

    def get(self, pos: int, n: int) -> bytes:
        if not (self._start <= pos and pos + n <= self._start + len(self._data)):
            self._start = pos
            self._data = self._storage.read_range(self._name, pos, min(self.size, pos + max(n, _WINDOW)))
        return self._data[pos - self._start : pos - self._start + n]


def check_deep(storage: Storage, ckpt: Any, findings: Findings, skip_leaves: set[str], allow: Any = None,
               leaf_path: Callable[[str], str] | None = None) -> None:
    """--deep's DCP part besides the chunk reads: every non-tensor item, and the replicated duplicates.

    A bytes item is a torch.save archive of a pickled value: it is opened
    (its zip structure and records checked as torch's reader checks them)
    and unpickled through the allow-list, so a damaged item is found here
    and not by the first `dcp.load`. Its size is bounded by the entry length
    (and the payload-pickle limit), never by anything it claims.
    """
    # (torch_save.checks.verify_and_decode: the torch.save and DeepSpeed checks' loop too; DCP has no
    # archive of storages to verify, its chunks are the tensor reads. Imported here: the shallow
    # checks need none of torch.save's archive reading)
    from ..torch_save.checks import verify_and_decode

    verify_and_decode(findings, ckpt.leaves, skip_leaves, what="non-tensor item", counted="bytes_items_read",
                      refuses_pickles=True, value_file=lambda leaf, exc: _relative_file(storage, exc.where))
    check_duplicates_deep(storage, findings, allow, leaf_path)


def _relative_file(storage: Storage, where: str | None) -> str | None:
    root = storage.url.rstrip("/") + "/"
    return where[len(root):] if where and where.startswith(root) else where


def check_duplicates_deep(storage: Storage, findings: Findings, allow: Any = None,
                          leaf_path: Callable[[str], str] | None = None) -> None:
    """Compare the copies of replicated duplicates that .metadata does not point at with the one it does.

    A planner that keeps duplicates has every rank write its replica, but
    storage_data, keyed by (fqn, offsets), points at one of them: the others
    sit in the ranks' data files at byte ranges no entry references. They
    are found there (each a whole torch.save archive, its end known from its
    end-of-central-directory record, or a zstd frame), decoded, matched to a
    duplicated chunk by dtype and shape, and compared block by block with
    the copy torch reads. Copies that differ are `duplicate-mismatch` errors:
    the replicas disagreed when saved, and torch silently restores one.
    """
    quiet = Findings()  # the shallow checks already reported what is malformed
    md, parsed = _load_metadata(storage, quiet, allow)
    walked = _walk(md, parsed, quiet, leaf_path, report_metadata=False)
    if walked is None:
        return
    _, entries, _, tensors, _ = walked
    duplicated = [(t, c, n) for t in tensors for c, n in t.copies.items()]
    if not duplicated:
        return
    try:
        leaves = {leaf.name: leaf for leaf in dcp.read(storage, fmt="").arrays()}  # (only its arrays are asked)
    except CkptError:
        return  # --deep's own open reports why
    # (dtype, chunk sizes) -> [tensor, chunk, copies not yet seen, leaf]
    candidates: dict[tuple[str, tuple[int, ...]], list[list[Any]]] = defaultdict(list)
    for tensor, chunk, n in duplicated:
        leaf = leaves.get(tensor.fqn)
        if leaf is not None:
            candidates[(leaf.dtype, chunk.sizes)].append([tensor, chunk, n - 1, leaf])
    largest = max(math.prod(c[1].sizes) * 16 for group in candidates.values() for c in group) if candidates else 0

    referenced: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for entry in entries.values():
        referenced[entry.relative_path].append((entry.offset, entry.offset + entry.length))
    _, files = storage.listdir()
    compared = 0
    for name in sorted(f for f in files if f.endswith(dcp.DATA_SUFFIX)):
        size = _size_or_none(storage, name)
        if not size:
            continue
        gaps, pos = [], 0
        for start, end in sorted(referenced.get(name, [])):
            if start > pos:
                gaps.append((pos, start))
            pos = max(pos, end)
        if pos < size:
            gaps.append((pos, size))
        window = _Window(storage, name, size)
        unexplained = False
        for gap_start, gap_end in gaps:
            for kind, start, end in _stored_items(window, gap_start, gap_end):
                if kind is None or not _compare_copy(storage, name, kind, start, end, candidates, largest, entries,
                                                     findings):
                    unexplained = True
                    break
                compared += 1
        if unexplained and name not in referenced and _starts_like_an_item(storage, name):
            # (the shallow check left such files of a duplicates save to this one)
            findings.warning(
                "stray-file",
                "data file not referenced by .metadata and not holding copies of its replicated duplicates (left by "
                "an earlier save into this directory, or by a rank whose write results never reached the "
                "coordinator); torch ignores it",
                file=name,
            )
    findings.count("duplicate_copies_compared", compared)


def _stored_items(window: _Window, start: int, end: int) -> Iterator[tuple[str | None, int, int]]:
    """The torch.save archives ('zip') and zstd frames ('zstd') back to back in [start, end); (None, ...) at the first other byte."""
    pos = start
    while pos < end:
        magic = window.get(pos, 4)
        item_end = None
        kind: str | None = None
        if magic == _LOCAL_HEADER:
            kind, item_end = "zip", _zip_end(window, pos, end)
        elif magic == _ZSTD_MAGIC:
            kind, item_end = "zstd", _zstd_frame_end(window, pos, end)
        if item_end is None:
            yield None, pos, end
            return
        yield kind, pos, item_end
        pos = item_end


def _zip_end(window: _Window, start: int, limit: int) -> int | None:
    """Where the zip archive starting at `start` ends: its EOCD record agreeing with the start.

    torch writes local headers without sizes (data descriptors follow the
    data), so the archive is delimited from its end: the first EOCD whose
    central directory, counted back, begins the archive at `start`.
    """
    pos = start
    while pos < limit:
        block = window.get(pos, min(_WINDOW, limit - pos))
        if not block:
            return None
        at = block.find(b"PK\x05\x06")
        while at >= 0:
            eocd = pos + at
            if eocd + _EOCD.size <= limit:
                _, _, _, _, _, cd_size, cd_offset, comment = _EOCD.unpack(window.get(eocd, _EOCD.size))
                # torch writes zip64 end records even for small archives: the
                # central directory then ends where the zip64 record begins
                ok = start + cd_offset + cd_size == eocd or _zip64_agrees(window, start, eocd)
                if ok and eocd + _EOCD.size + comment <= limit:
                    return eocd + _EOCD.size + comment
            at = block.find(b"PK\x05\x06", at + 1)
        if pos + len(block) >= limit:
            return None
        pos += max(1, len(block) - 3)  # overlap: a signature across two blocks
    return None


def _zip64_agrees(window: _Window, start: int, eocd: int) -> bool:
    loc_at = eocd - _ZIP64_LOCATOR.size
    if loc_at < start:
        return False
    sig, _, z64_offset, _ = _ZIP64_LOCATOR.unpack(window.get(loc_at, _ZIP64_LOCATOR.size))
    rec_at = start + z64_offset
    if sig != b"PK\x06\x07" or rec_at + _ZIP64_EOCD.size > loc_at:
        return False
    fields = _ZIP64_EOCD.unpack(window.get(rec_at, _ZIP64_EOCD.size))
    rec_sig, rec_size, cd_size, cd_offset = fields[0], fields[1], fields[8], fields[9]
    return rec_sig == b"PK\x06\x06" and rec_at + 12 + rec_size == loc_at and start + cd_offset + cd_size == rec_at


def _zstd_frame_end(window: _Window, start: int, limit: int) -> int | None:
    """Where the zstd frame starting at `start` ends (RFC 8878: header, then blocks to the last one)."""
    header = window.get(start, 5)
    if len(header) < 5:
        return None
    fhd = header[4]
    if fhd & 0x08:  # reserved bit
        return None
    single_segment = (fhd >> 5) & 1
    pos = start + 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[fhd & 3] + ((1 if single_segment else 0), 2, 4, 8)[fhd >> 6]
    while True:
        raw = window.get(pos, 3)
        if len(raw) < 3:
            return None
        block = int.from_bytes(raw, "little")
        kind, size = (block >> 1) & 3, block >> 3
        if kind == 3:
            return None
        pos += 3 + (1 if kind == 1 else size)
        if pos > limit:
            return None
        if block & 1:
            break
    if fhd & 0x04:  # content checksum
        pos += 4
    return pos if pos <= limit else None


def _compare_copy(
    storage: Storage, name: str, kind: str, start: int, end: int,
    candidates: dict[tuple[str, tuple[int, ...]], list[list[Any]]], largest: int,
    entries: dict[EntryKey, dcp._Entry], findings: Findings,
) -> bool:
    """Compare one unreferenced stored item with the duplicated chunk it copies; False if it copies none."""
    from . import transforms as dcp_transforms
    from ..torch_save import payload as torch_payload

    where = f"{storage.url}/{name}[{start}:{end}]"

    def fetch_raw(a: int, b: int) -> bytes:
        return storage.read_range(name, start + a, start + b)

    try:
        fetch: Callable[[int, int], bytes] = fetch_raw
        length = end - start
        if kind == "zstd":
            decoded = dcp_transforms.DecodedEntry(
                fetch_raw, end - start, [dcp_transforms.KNOWN[0]], where,
                max_decoded=2 * largest + dcp._ARCHIVE_SLACK, key=(storage.url, name, start, "copy"),
            )
            length, fetch = decoded.scan(), decoded.fetch
        payload = torch_payload.open_payload_range(fetch, length, where).tensor()
    except CkptError:
        return False
    group = candidates.get((payload.dtype, payload.shape))
    if not group:
        return False
    # a copy belongs to a chunk still missing copies first; identical bytes settle it
    differs: str | None = None
    for cand in sorted(group, key=lambda c: c[2] <= 0):
        tensor, chunk, _, leaf = cand
        try:
            kept, kept_fetch, kept_where = leaf.reader._locate(leaf.layout.chunks.index(chunk))
        except CkptError:
            continue  # the copy torch reads is damaged: --deep's chunk reads report it
        differs = _first_difference(payload, fetch, where, kept, kept_fetch, kept_where)
        if differs is None:
            cand[2] -= 1
            return True
    tensor, chunk = group[0][0], group[0][1]
    kept_entry = entries.get((tensor.fqn, chunk.offsets))
    kept_text = f"{kept_entry.relative_path}[{kept_entry.offset}:{kept_entry.offset + kept_entry.length}]" if kept_entry else "its entry"
    if len(group) == 1:
        what = f"a copy of {_chunk_label(tensor.fqn, chunk)}"
    else:
        what = "a copy of one of " + _named([_chunk_label(c[0].fqn, c[1]) for c in group])
    findings.error(
        "duplicate-mismatch",
        f"{what} (a replicated duplicate, bytes {start}:{end} of this file) {differs or 'differs from it'} compared "
        f"with the copy .metadata points at ({kept_text}), the only one torch restores: the replicas disagreed "
        "when they were saved, or this copy was damaged since",
        leaf=tensor.leaf if len(group) == 1 else None, file=name,
    )
    return True


def _first_difference(a: Any, fetch_a: Callable, where_a: str, b: Any, fetch_b: Callable, where_b: str) -> str | None:
    """How copy `a` differs from copy `b` (values compared bytewise, block by block); None if identical.

    A failure to read `b` (the copy torch reads) propagates; `a` failing to
    decode is a difference.
    """
    from ..torch_save import payload as torch_payload
    from ...core.model import split_to_cap

    whole = Chunk(tuple(0 for _ in a.shape), tuple(a.shape))
    for piece in split_to_cap(whole, a.itemsize, _COMPARE_BLOCK):
        try:
            x = torch_payload.read_region(a, piece.region, fetch_a, where_a)
        except CkptError as exc:
            return f"does not decode ({exc.message})"
        y = torch_payload.read_region(b, piece.region, fetch_b, where_b)
        if x.tobytes() != y.tobytes():
            return f"holds other values in {_box_text(_chunk_box(piece))}"
    return None
