"""torch.distributed.checkpoint (DCP) reader, without torch.

A DCP directory holds `.metadata` (a pickled `Metadata`: every state-dict
entry's shape, dtype and chunk list, plus where each chunk or non-tensor item
is stored) and `__<rank>_<n>.distcp` data files. Each stored entry is a byte
range of a data file holding one complete torch.save archive: a tensor chunk,
or a pickled Python value for non-tensor items.

Opening reads `.metadata` only, through the allow-list unpickler. Array data
is read on request, and only from the chunks overlapping the requested
region: a couple of small ranged reads locate a chunk's raw bytes inside its
archive (cached afterwards), then one ranged read fetches just the span the
region needs.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import math
import operator
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, overload

from ...base import dtypes
from ...core.contract import ArrayReader
from ...base.errors import (
    CkptError, CorruptMetadataError, IncompleteCheckpointError, NotFoundError, UnreadableFileError, UsageError, short_repr,
)
from ...core.model import ArrayLeaf, Checkpoint, Chunk, ChunkList, Key, Leaf, MissingData, Region, Sharding, ValueLeaf
from ...storage import Storage
from ..torch_save import safe_pickle
from ..torch_save.safe_pickle import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    Size,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    TorchDType,
)

if TYPE_CHECKING:
    import numpy as np
    from ..torch_save.payload import Allow, Fetch, TensorPayload


def _payload_module():  # noqa: ANN202
    # torch.save archives need zipfile & co.: loaded when data is read, not
    # when `ckpt inspect` only looks at .metadata
    from ..torch_save import payload as torch_payload

    return torch_payload

METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_MAX_PARALLEL_CHUNK_READS = 16


def detect(storage: Storage) -> bool:
    """A DCP directory: `.metadata`, or (an uncommitted save) top-level `.distcp` files."""
    if storage.exists(METADATA_FILE):
        return True
    _, files = storage.listdir()
    return any(f.endswith(DATA_SUFFIX) for f in files)


def read(storage: Storage, *, fmt: str, step: str | int | None = None, allow: Allow = None,
         note_others: bool = False) -> Checkpoint:
    """Open a DCP checkpoint: reads `.metadata` and nothing else. `fmt`: the registry name the
    Checkpoint carries (the format reading it: DCP, or a framework saving through DCP).

    `allow`: stand-ins for the classes a framework writing through DCP pickles into
    `.metadata` and its items (Megatron-Core's plans), beside the allow-list. `note_others`:
    the files beside `.metadata` and the data files are nobody's (a plain DCP directory, not a
    framework's that keeps its own files there): a note names them, as safetensors and
    torch.save listings name theirs, and the layout lists them (`ignored`)."""
    return _read(storage, fmt=fmt, step=step, allow=allow, want_metadata=False, note_others=note_others)[0]


def read_with_metadata(storage: Storage, *, fmt: str, step: str | int | None = None,
                       allow: Allow = None) -> tuple[Checkpoint, Any]:
    """read(), and the unpickled `.metadata` object (for a framework's own fields on it)."""
    return _read(storage, fmt=fmt, step=step, allow=allow, want_metadata=True)


def _read(storage: Storage, *, fmt: str, step: str | int | None, allow: Allow,
          want_metadata: bool, note_others: bool = False) -> tuple[Checkpoint, Any]:
    if step is not None:
        # (a run root's step is opened through the root: the reader sees --step only on one checkpoint)
        raise UsageError(f"--step {step} given, but this is one torch.distributed.checkpoint (DCP) checkpoint, "
                         "not a run root of steps", storage.url)
    metadata_where = f"{storage.url}/{METADATA_FILE}"
    if not storage.exists(METADATA_FILE):
        _, top_files = storage.listdir()
        if any(f.endswith(DATA_SUFFIX) for f in top_files):
            message = (
                "no .metadata: an incomplete or uncommitted DCP save "
                "(on multi-host, every host must write to one shared directory)"
            )
            rank_local = sorted(f for f in top_files if _RANK_METADATA.match(f))
            if rank_local:
                message += f"; found rank-local {rank_local[0]} (saved without rank coordination: open with torch)"
            raise IncompleteCheckpointError(message, storage.url)
        raise NotFoundError("no .metadata: not a torch.distributed.checkpoint directory", storage.url)

    size = storage.size(METADATA_FILE)
    if size > safe_pickle.MAX_METADATA_BYTES:
        raise CorruptMetadataError(
            f".metadata is {size} bytes, over the {safe_pickle.MAX_METADATA_BYTES}-byte limit", metadata_where
        )
    data = storage.read(METADATA_FILE)
    digest = hashlib.sha256(data).digest()
    parsed = well_formed = parsed_before(digest, allow)
    metadata = None
    if parsed is None and not want_metadata:
        # torch's own pickles, read in one pass without the unpickler (metadata_scan: None for
        # anything else, which the unpickler's path below reads as before)
        parsed = well_formed = _scanned(data, (digest, allow))
    if parsed is None or want_metadata:
        metadata = safe_pickle.load_metadata(data, metadata_where, allow)
    del data
    if parsed is None:
        well_formed = parse_well_formed(metadata, (digest, allow))
        # (one the fast parse does not vouch for is walked again by the careful one, which names
        # the problem exactly)
        parsed = well_formed if well_formed is not None else _parse_careful(metadata, metadata_where)

    leaves: list[Leaf] = []
    keys_of = parsed.keys
    array_leaf = _LeafMaker(storage)
    duplicates = 0
    for fqn, item in parsed.items.items():
        keys = keys_of[fqn] if keys_of is not None else parsed.keys_for(fqn)
        if isinstance(item, _TensorItem):
            leaves.append(array_leaf(fqn, keys, item))
            duplicates += item.duplicates
        else:
            leaves.append(_value_leaf(storage, fqn, keys, item, allow))

    needed = parsed.needed
    if needed is None:
        needed = {}
        for info in parsed.storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    files = sorted(needed)
    # torch names data files __<rank>_<n>.distcp; other writers may not
    matches = [_RANK_FILE.match(f) for f in files]
    ranks = len({m.group(1) for m in matches if m}) if all(matches) else None
    notes: list[str] = []
    listed = set(storage.list()) if files else set()
    # every data file there and long enough (a stat each, no read): else the checkpoint is incomplete
    missing: list[MissingData] = []
    # (on an object store each size is a round trip or more: all of them in flight together)
    storage.prefetch_shortfalls({f: needed[f] for f in files if f in listed})
    for f in files:
        unreadable = False
        if f not in listed:
            reason = "does not exist (named in .metadata)"
        else:
            try:
                short = storage.shortfall(f, needed[f])
            except (CkptError, OSError):
                continue  # unreadable or gone since the listing: a read says why
            if short is None:
                # there and long enough; an open (no read) says whether it can be read at all
                try:
                    storage.check_readable(f)
                    continue
                except UnreadableFileError as exc:
                    reason, unreadable = exc.message, True
                except (CkptError, OSError):
                    continue  # gone since the listing, or not a regular file: a read says why
            else:
                reason = f"{short:,} of the {needed[f]:,} bytes .metadata places in it"
        missing.append(MissingData(f, reason, sorted({fqn for (fqn, _), info in parsed.storage.items()
                                                      if info.relative_path == f}), unreadable))
    if parsed.transforms is not None:
        transforms = sorted({t for tr in parsed.transforms for t in tr})
    else:
        transforms = sorted({t for info in parsed.storage.values() for t in info.transforms})
    # (the transforms module, for a checkpoint stored with some: the rest need not import it)
    unknown = _transforms_module().describe_unknown(transforms) if transforms else []
    if unknown:
        notes.append(f"entries are stored with transforms {', '.join(unknown)} (not readable by ckpt)")
    elif transforms:
        notes.append(f"entries are stored with transforms {', '.join(transforms)} (torch's ZStandard extension)")
    if duplicates:
        notes.append(
            f"{duplicates} tensor chunk{'s are' if duplicates != 1 else ' is'} listed more than once (replicated "
            "duplicates kept by the save planner); one copy of each is read"
        )
    layout: dict[str, Any] = {
        "files": len(files),
        "ranks": ranks,
        "version": parsed.version,
    }
    if note_others:
        _, top = storage.listdir()
        ignored = sorted(f for f in top if f != METADATA_FILE and f not in needed and not f.endswith(DATA_SUFFIX))
        layout["ignored"] = ignored
        if ignored:
            notes.append(f"other files (ignored): {', '.join(ignored[:8])}" + (" ..." if len(ignored) > 8 else ""))
    return Checkpoint(
        path=storage.url,
        format=fmt,
        layout=layout,
        leaves=leaves,
        committed=True,
        saved_at=None,  # DCP records no save time
        notes=notes,
        missing=missing,
        # the checks of this run take the parse instead of reading .metadata again (checks.check_path's
        # `parsed`): a well-formed one only, which their lenient walk would find nothing wrong in
        parsed={opened_key(storage): (allow, well_formed)} if well_formed is not None else {},
    ), metadata


def opened_key(storage: Storage) -> str:
    """The key of Checkpoint.parsed under which read() leaves its parse of `.metadata` (with the
    `allow` it was unpickled with) for the checks."""
    return f"{storage.url}/{METADATA_FILE}"


# ---------------------------------------------------------------------------
# Metadata: validated into plain records
# ---------------------------------------------------------------------------
class _Entry(NamedTuple):
    """Where one stored item (a tensor chunk or a bytes item) lives.

    A named tuple, not a dataclass: one per stored item (10^4-10^5), built by
    tuple's own constructor at C speed (a frozen dataclass's __init__ costs a
    microsecond), immutable, compared and hashed by value."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.relative_path, "offset": self.offset, "length": self.length}
        if self.transforms:
            out["transforms"] = list(self.transforms)
        return out


@dataclass(slots=True)
class _TensorItem:
    shape: tuple[int, ...]
    dtype: str
    chunks: list[Chunk]  # distinct chunks: a replicated duplicate is listed once
    entries: list[_Entry]
    requires_grad: bool = False
    duplicates: int = 0  # chunks .metadata lists again with the same offsets and sizes
    layout: str = "torch.strided"
    # chunk -> times listed, for the chunks listed more than once (the fast parse only: validate's use)
    copies: dict[Chunk, int] | None = None


@dataclass
class _BytesItem:
    entry: _Entry


@dataclass
class _ParsedMetadata:
    items: dict[str, _TensorItem | _BytesItem]
    storage: dict[tuple[str, tuple[int, ...] | None], _Entry]
    planner_data: Any
    version: str | None
    # found on the way by the fast parse (None: work them out from `storage`)
    needed: dict[str, int] | None = None  # data file -> the bytes .metadata places in it
    transforms: set[tuple[str, ...]] | None = None  # the entries' distinct transform lists
    keys: dict[str, tuple[Key, ...]] | None = None  # fqn -> keys_for(fqn)

    def keys_for(self, fqn: str) -> tuple[Key, ...]:
        """The original state-dict path: planner_data's tuple (ints stay ints), else the fqn as one key.

        As torch loads it (`_EmptyStateDictLoadPlanner`): a key planner_data
        does not map (none is, when a save did not flatten) stays one flat key.
        """
        if isinstance(self.planner_data, dict):
            keys = self.planner_data.get(fqn)
            if (
                isinstance(keys, (tuple, list))
                and keys
                and all(type(k) in (str, int) for k in keys)
            ):
                return tuple(keys)
        return (fqn,)


def metadata_problem(md: Any) -> str | None:
    """What about `.metadata`'s top-level object torch's reader would fail on (None if nothing).

    FileSystemReader.read_metadata sets `storage_meta.load_id` (so it must be
    a StorageMeta or None), set_up_storage_reader needs storage_data, and the
    load planners iterate state_dict_metadata and look keys up in planner_data.
    """
    if not isinstance(md, Metadata):
        return f"expected a DCP Metadata object, found {type(md).__name__}"
    if not isinstance(md.state_dict_metadata, dict):
        return f"state_dict_metadata is {type(md.state_dict_metadata).__name__}, not a dict"
    if not isinstance(md.storage_data, dict):
        return "storage_data is missing (saved with a custom storage writer?); the data cannot be located"
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        return f"storage_meta is {type(md.storage_meta).__name__}, not a StorageMeta (torch's reader sets its load_id)"
    if md.version is not None and not isinstance(md.version, str):
        return f"version is {short_repr(md.version)}, not a string"
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        return f"planner_data is {type(md.planner_data).__name__}, not a dict (torch looks state-dict keys up in it)"
    return None


def planner_path_problem(planner_data: Any, fqn: str) -> str | None:
    """A planner_data entry torch's set_element cannot follow (it rebuilds the nested state dict from it)."""
    if not isinstance(planner_data, dict) or not planner_data:
        return None
    if fqn not in planner_data:
        # torch's load planner rebuilds the state dict from planner_data and
        # flattens it again: a key it does not map comes out under another name
        return "state-dict key has no planner_data entry (torch's load planner cannot map it back)"
    path = planner_data[fqn]
    if not isinstance(path, (tuple, list)) or not path or not all(type(k) in (str, int) for k in path):
        return f"planner_data path {short_repr(path)} is not a non-empty tuple of str and int keys"
    if any(type(k) is int and not 0 <= k < _MAX_LIST_INDEX for k in path):
        return f"planner_data path {short_repr(path)} has a list index outside [0, {_MAX_LIST_INDEX})"
    if ".".join(map(str, path)) != fqn:
        return f"planner_data path {short_repr(path)} does not flatten back to the key (torch's load planner needs it to)"
    return None


def planner_tree_problem(planner_data: Any, fqns: Any) -> tuple[str, str] | None:
    """(fqn, why) for two planner_data paths torch's set_element cannot both rebuild, else None.

    torch's load rebuilds the nested state dict path by path: a path that is also the container of
    another (`("m", "w")` beside `("m", "w", "x")`) fails there, or the later one replaces the earlier
    without a word; a container given a list index beside a dict key fails, or keeps two keys that are
    one key path (`0` and `"0"`). dcp.save never writes either (a state dict is a tree, its dict keys
    str, its list indices int): each is a damaged or foreign .metadata."""
    if not isinstance(planner_data, dict) or not planner_data:
        return None
    paths: dict[tuple[Any, ...], str] = {}
    for fqn in fqns:
        path = planner_data.get(fqn)
        # (the exact types of its keys compared in C: a generator per path was half of this walk)
        if type(path) is not tuple or not path or not _KEY_TYPES.issuperset(map(type, path)):
            continue  # (not a path of keys: planner_path_problem's to report, and it may not even hash)
        if len(path) > 1:
            paths[path] = fqn
        else:
            paths.setdefault(path, fqn)
    # every container path, from each path's parent up: distinct parents are few (a model's layers)
    inner: set[tuple[Any, ...]] = set()
    for parent in {p[:-1] for p in paths if len(p) > 1}:
        while parent and parent not in inner:
            inner.add(parent)
            parent = parent[:-1]
    clash = inner.intersection(paths)
    if clash:
        holder = min(clash, key=lambda p: paths[p])
        child = min((p for p in paths if p[:len(holder)] == holder and p != holder), key=lambda p: paths[p])
        return paths[child], (f"planner_data makes {paths[holder]!r} both a value and the container of this key "
                              "(torch's load fails, or keeps only one of them)")
    # (an int as a path's first key as well enters the walk below, which finds nothing then: one C pass)
    if int in set(map(type, itertools.chain.from_iterable(paths))):
        kinds: dict[tuple[Any, ...], tuple[type, str]] = {}
        indices: dict[tuple[Any, ...], set[int]] = {}
        for p, fqn in paths.items():
            for n in range(1, len(p)):
                seen = kinds.setdefault(p[:n], (type(p[n]), fqn))
                if seen[0] is not type(p[n]):
                    return fqn, (f"planner_data puts a list index and a dict key in one container (beside "
                                 f"{seen[1]!r}): torch's load fails, or keeps two keys that are one key path")
                if type(p[n]) is int:
                    indices.setdefault(p[:n], set()).add(p[n])
        for prefix, held in indices.items():
            if len(held) != max(held) + 1:
                # dcp.save writes every element of a list it walks into; torch's load fills a gap
                # with None, then finds no entry for it ("Missing key in checkpoint state_dict")
                gap = min(set(range(max(held) + 1)) - held)
                fqn = kinds[prefix][1]
                return fqn, (f"planner_data's list {'.'.join(map(str, prefix))!r} has no element {gap} "
                             "(torch's load fails: it finds no entry for it)")
    return None


# torch's set_element grows a list to a planner_data index with None: a
# larger index is a memory bomb for torch, never a real state dict
_MAX_LIST_INDEX = 1 << 20
_MEMORY_FORMATS = frozenset({"contiguous_format", "channels_last", "preserve_format"})


def index_problem(index: Any) -> str | None:
    """A storage_data key torch's unpickler could not rebuild as a MetadataIndex dict key."""
    if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
        return f"storage_data key {short_repr(index)} is not a MetadataIndex"
    # torch hashes MetadataIndex by (fqn, offset): a list offset is unhashable
    if index.offset is not None and not isinstance(index.offset, tuple):
        return f"storage_data offset of {index.fqn} is {type(index.offset).__name__}, not a torch.Size"
    if index.index is not None and type(index.index) is not int:
        return f"storage_data index hint of {index.fqn} is {short_repr(index.index)}, not an int"
    return None


def properties_problem(props: Any) -> str | None:
    """TensorProperties torch could not rebuild: its __setstate__ takes a 5-tuple with a memory-format enum."""
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, TorchDType):
        return "tensor properties carry no torch dtype"
    # (a damaged pickle can put anything there, an unhashable list too)
    if not isinstance(props.memory_format, str) or props.memory_format not in _MEMORY_FORMATS:
        return f"tensor properties have memory format {short_repr(props.memory_format)} (torch's reader refuses it)"
    return None


def _parse_metadata(md: Any, where: str, key: tuple[bytes, Allow] | None = None) -> _ParsedMetadata:
    # a well-formed .metadata (every real one) takes the fast walk; anything
    # it does not vouch for is walked again by the careful one, which names
    # the problem exactly as before
    parsed = parse_well_formed(md, key)
    if parsed is not None:
        return parsed
    return _parse_careful(md, where)


def parse_well_formed(md: Any, key: tuple[bytes, Allow] | None = None) -> _ParsedMetadata | None:
    """The parsed metadata when `.metadata` is well formed (nothing the careful walk would object to), else None.

    `key` (the file's SHA-256 and the `allow` it was unpickled with): the
    result is kept under it for parsed_before(), so that a command that opens
    a checkpoint and validates it (convert's preflight, validate --deep)
    unpickles and parses its `.metadata` once."""
    global _LAST_PARSED
    try:
        parsed = _parse_fast(md)
    except Exception:  # noqa: BLE001 - whatever a damaged pickle makes the fast walk trip on: the careful walk says
        return None
    if parsed is not None and key is not None:
        _LAST_PARSED = (key[0], key[1], parsed)
    return parsed


# the last well-formed .metadata parsed, by its SHA-256 (and `allow`): one only. What it
# holds beyond the leaves of an open checkpoint is small (its storage and item dicts, not
# the unpickled objects: those take ~1.8 KiB per tensor)
_LAST_PARSED: tuple[bytes, Any, _ParsedMetadata] | None = None


def _scanned(data: bytes, key: tuple[bytes, Allow]) -> _ParsedMetadata | None:
    """parse_well_formed() of what metadata_scan reads from `data` (None where it reads nothing
    or the fast parse does not vouch for it: the unpickler's path then says what it says)."""
    from . import metadata_scan  # (its patterns are compiled when a .metadata is first read)

    md = metadata_scan.scan(data, key[1])
    if md is None:
        return None
    return parse_well_formed(md, key)


def parsed_before(digest: bytes, allow: Allow = None) -> _ParsedMetadata | None:
    """The parse of a .metadata with these bytes (their SHA-256), if it was the last one parsed."""
    last = _LAST_PARSED
    if last is not None and last[0] == digest and last[1] is allow:
        return last[2]
    return None


# the planner_data key types torch writes (exact types: a subclass is walked carefully)
_KEY_TYPES = frozenset({str, int})


def _parse_fast(md: Any) -> _ParsedMetadata | None:
    """_parse_careful's result for a .metadata it accepts, or None wherever that walk might object.

    The same checks, made per stored item with exact type tests and identity
    fast paths (a tensor of one chunk at offset 0 that is its whole shape,
    the common case of 10^4-10^5 small tensors), and the per-element checks
    of every shape, offset and size (all ints, none negative) made once over
    all of them at C speed. Never raises for a problem it finds: it returns
    None, and the careful walk names the problem.
    """
    if type(md) is not Metadata or metadata_problem(md) is not None:
        return None
    sdm, storage_data, planner_data = md.state_dict_metadata, md.storage_data, md.planner_data
    new_entry = tuple.__new__
    ints: list[tuple[Any, ...]] = []  # every shape, offset and size: checked at the end, at once
    storage: dict[tuple[str, tuple[int, ...] | None], _Entry] = {}
    needed: dict[str, int] = {}
    transforms: set[tuple[str, ...]] = set()
    scanned_index, scanned_info, scanned_tensor, scanned_shards = _scanned_types()
    for index, info in storage_data.items():
        if type(index) is scanned_index:
            # a MetadataIndex and its _StorageInfo as metadata_scan matched them (the fields' types
            # made by the pattern: a str fqn and path, an int hint or None, the offset's ints not
            # negative (checked there), no transforms)
            if type(info) is not scanned_info:
                return None
            fqn, offset, _ = index
            path, start, length = info
            if start < 0 or length < 0:
                return None
            storage[(fqn, offset)] = new_entry(_Entry, (path, start, length, ()))
            end = start + length
            if end > needed.get(path, -1):
                needed[path] = end
            continue
        if type(index) is not MetadataIndex or type(info) is not StorageInfo:
            return None
        fqn, offset, hint = index.fqn, index.offset, index.index
        if type(fqn) is not str or (hint is not None and type(hint) is not int):
            return None
        if offset is not None:
            if type(offset) is not Size:
                return None
            offset = tuple(offset)
            ints.append(offset)
        path, start, length, tr = info.relative_path, info.offset, info.length, info.transform_descriptors
        if type(path) is not str or not path or type(start) is not int or type(length) is not int:
            return None
        if start < 0 or length < 0:
            return None
        if tr:
            if type(tr) not in (list, tuple) or not all(type(t) is str for t in tr):
                return None
            tr = tuple(tr)
            transforms.add(tr)
        else:
            tr = ()
        storage[(fqn, offset)] = new_entry(_Entry, (path, start, length, tr))
        end = start + length
        if end > needed.get(path, -1):
            needed[path] = end

    pd_dict = isinstance(planner_data, dict)
    check_paths = pd_dict and bool(planner_data)
    pd_get = planner_data.get if pd_dict else None
    joined: list[tuple[Any, ...]] = []  # planner paths found all-str by str.join: their exact types checked at once
    keys: dict[str, tuple[Key, ...]] = {}
    items: dict[str, _TensorItem | _BytesItem] = {}
    dtype_names = _TORCH_DTYPES
    chunk_of: dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk] = {}  # equal chunks shared (Chunk is frozen)
    checked: dict[int, tuple[Any, ...]] = {}  # id of a scanned tensor value -> what its checks gave
    for fqn, item in sdm.items():
        if type(fqn) is not str:
            return None
        path = pd_get(fqn) if pd_get is not None else None
        if check_paths:
            if type(path) is tuple and path:
                try:
                    ok = ".".join(path) == fqn
                except TypeError:  # an int index in the path: the full check
                    ok = planner_path_problem(planner_data, fqn) is None
                else:
                    joined.append(path)
                if not ok:
                    return None
            elif planner_path_problem(planner_data, fqn) is not None:
                return None
        # keys_for(fqn)
        if type(path) is tuple and path and (check_paths or all(type(k) in _KEY_TYPES for k in path)):
            keys[fqn] = path
        elif isinstance(path, (tuple, list)) and path and all(type(k) in _KEY_TYPES for k in path):
            keys[fqn] = tuple(path)
        else:
            keys[fqn] = (fqn,)
        kind = type(item)
        if kind is scanned_tensor:
            # a TensorStorageMetadata of one chunk as metadata_scan matched it (its shape, offsets and
            # sizes tuples of ints none negative, checked there; its dtype a torch dtype's name, its
            # layout and memory format str). The scan makes one such value for tensors alike: its
            # checks are made once, and each tensor of it looks up its own storage entry
            alike = checked.get(id(item))  # (md keeps the value alive: its id stays its own)
            if alike is None:
                dtype_name, shape, offsets, sizes, grad, layout, memory_format = item
                dtype = dtype_names.get(dtype_name)
                if dtype is None or memory_format not in _MEMORY_FORMATS:
                    return None
                whole = _whole_chunk(fqn, shape, offsets, sizes, storage, chunk_of)
                if whole is None:
                    return None
                checked[id(item)] = (shape, dtype, offsets, whole[0], grad, layout)
                items[fqn] = _TensorItem(shape, dtype, [whole[0]], [whole[1]], grad, 0, layout, None)
                continue
            shape, dtype, offsets, chunk, grad, layout = alike
            entry = storage.get((fqn, offsets))
            if entry is None:
                return None
            items[fqn] = _TensorItem(shape, dtype, [chunk], [entry], grad, 0, layout, None)
            continue
        if kind is scanned_shards:
            # a TensorStorageMetadata of several chunks as metadata_scan matched it (as above; its
            # chunks' (offsets, sizes) in the list's order)
            dtype_name, shape, geometries, grad, layout, memory_format = item
            dtype = dtype_names.get(dtype_name)
            if dtype is None or memory_format not in _MEMORY_FORMATS:
                return None
            sharded = _fast_chunks(fqn, shape, geometries, storage, chunk_of)
            if sharded is None:
                return None
            items[fqn] = _TensorItem(shape, dtype, sharded[0], sharded[1], grad, sharded[2], layout, sharded[3])
            continue
        if kind is BytesStorageMetadata:
            entry = storage.get((fqn, None))
            if entry is None:
                return None
            items[fqn] = _BytesItem(entry)
            continue
        if kind is not TensorStorageMetadata:
            return None
        props = item.properties
        if type(props) is not TensorProperties:
            return None
        torch_dtype = props.dtype
        if (type(torch_dtype) is not TorchDType or type(props.memory_format) is not str
                or props.memory_format not in _MEMORY_FORMATS):
            return None
        dtype = dtype_names.get(torch_dtype.name)
        if dtype is None:
            return None
        size = item.size
        if type(size) is not Size:
            return None
        shape = tuple(size)
        ints.append(shape)
        chunk_mds = item.chunks
        if type(chunk_mds) is not list or not chunk_mds:
            return None
        if len(chunk_mds) == 1:
            # _fast_chunk_geometry, inlined for the one-chunk tensor (10^4-10^5 of them: a call each was 3%)
            chunk_md = chunk_mds[0]
            if type(chunk_md) is not ChunkStorageMetadata:
                return None
            offsets, sizes = chunk_md.offsets, chunk_md.sizes
            if type(offsets) is not Size or type(sizes) is not Size:
                return None
            offsets, sizes = tuple(offsets), tuple(sizes)
            ints.append(offsets)
            ints.append(sizes)
            # (its bounds are checked once its ints are checked non-negative, below)
            whole = _whole_chunk(fqn, shape, offsets, sizes, storage, chunk_of)
            if whole is None:
                return None
            chunks, entries, duplicates, copies = [whole[0]], [whole[1]], 0, None
        else:
            geometries = []
            for chunk_md in chunk_mds:
                geometry = _fast_chunk_geometry(chunk_md, ints)
                if geometry is None:
                    return None
                geometries.append(geometry)
            sharded = _fast_chunks(fqn, shape, geometries, storage, chunk_of)
            if sharded is None:
                return None
            chunks, entries, duplicates, copies = sharded
        layout = props.layout
        items[fqn] = _TensorItem(shape, dtype, chunks, entries, bool(props.requires_grad), duplicates,
                                 layout if isinstance(layout, str) else "torch.strided",
                                 copies)
    # every shape, offset and size all ints (no bool, no float), none negative; the planner paths str
    flat = itertools.chain.from_iterable(ints)
    if not {int}.issuperset(map(type, flat)):
        return None
    if ints and min(itertools.chain.from_iterable(ints), default=0) < 0:
        return None
    if joined and not {str}.issuperset(map(type, itertools.chain.from_iterable(joined))):
        return None
    if len(storage) != len(storage_data):
        return None  # one (fqn, offsets) listed twice: the last wins, and `needed` counted both
    if check_paths and planner_tree_problem(planner_data, sdm) is not None:
        return None
    return _ParsedMetadata(items, storage, planner_data, md.version, needed, transforms, keys)


def _scanned_types() -> tuple[Any, Any, Any, Any]:
    """metadata_scan's _ScannedIndex, _ScannedInfo, _ScannedTensor and _ScannedShards, where it is
    loaded (else types no value has: a .metadata the unpickler read holds none of them)."""
    import sys

    scan = sys.modules.get(__package__ + ".metadata_scan")
    if scan is None:
        return _NoScan, _NoScan, _NoScan, _NoScan
    return scan._ScannedIndex, scan._ScannedInfo, scan._ScannedTensor, scan._ScannedShards


class _NoScan:
    """No value is of this type."""


def _whole_chunk(fqn: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
                 storage: dict[Any, _Entry], chunk_of: dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk],
                 ) -> tuple[Chunk, _Entry] | None:
    """A tensor of one chunk for the fast parse, scanned or unpickled: the chunk (one object for
    tensors alike) and its storage entry; None unless the chunk is the whole tensor and stored."""
    if sizes != shape or len(offsets) != len(shape) or any(offsets):
        return None
    entry = storage.get((fqn, offsets))
    if entry is None:
        return None
    chunk = chunk_of.get((offsets, sizes))
    if chunk is None:
        chunk = chunk_of[(offsets, sizes)] = Chunk(offsets, sizes)
    return chunk, entry


def _fast_chunks(fqn: str, shape: tuple[int, ...], geometries: Any, storage: dict[Any, _Entry],
                 chunk_of: dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk]) -> tuple[Any, Any, int, Any] | None:
    """A tensor of several chunks for the fast parse: (its chunks, their storage entries, how many
    chunks repeat one before, how many times each such chunk is listed (None without any)), from its
    chunks' (offsets, sizes) in the list's order; None where a chunk is outside the shape or has no
    storage entry."""
    rank = len(shape)
    chunks: list[Chunk] = []
    entries: list[_Entry] = []
    duplicates = 0
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    copies: dict[Chunk, int] | None = None
    for offsets, sizes in geometries:
        if len(offsets) != rank or len(sizes) != rank:
            return None
        if shape and any(map(operator.gt, map(operator.add, offsets, sizes), shape)):
            return None
        entry = storage.get((fqn, offsets))
        if entry is None:
            return None
        chunk = chunk_of.get((offsets, sizes))
        if chunk is None:
            chunk = chunk_of[(offsets, sizes)] = Chunk(offsets, sizes)
        if (offsets, sizes) in seen:
            duplicates += 1
            copies = {} if copies is None else copies
            copies[chunk] = copies.get(chunk, 1) + 1
            continue
        seen.add((offsets, sizes))
        chunks.append(chunk)
        entries.append(entry)
    return chunks, entries, duplicates, copies


def _fast_chunk_geometry(chunk_md: Any, ints: list[tuple[Any, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A chunk's (offsets, sizes) for the fast parse when it is exactly torch's ChunkStorageMetadata
    of two torch.Size stand-ins (their ints queued in `ints` for the one all-at-once check), else None."""
    if type(chunk_md) is not ChunkStorageMetadata:
        return None
    offsets, sizes = chunk_md.offsets, chunk_md.sizes
    if type(offsets) is not Size or type(sizes) is not Size:
        return None
    offsets, sizes = tuple(offsets), tuple(sizes)
    ints.append(offsets)
    ints.append(sizes)
    return offsets, sizes


def _torch_dtypes() -> dict[str, str]:
    """torch dtype attribute name -> ckpt's dtype name, for every one ckpt reads."""
    out = {}
    for name in dtypes.TORCH_DTYPE_NAMES:
        try:
            out[name] = dtypes.from_torch(name).name
        except CkptError:
            continue
    return out


_TORCH_DTYPES = _torch_dtypes()


def _parse_careful(md: Any, where: str) -> _ParsedMetadata:
    problem = metadata_problem(md)
    if problem:
        raise CorruptMetadataError(problem, where)
    sdm = md.state_dict_metadata
    version = md.version

    storage: dict[tuple[str, tuple[int, ...] | None], _Entry] = {}
    for index, info in md.storage_data.items():
        problem = index_problem(index)
        if problem:
            raise CorruptMetadataError(problem, where)
        offset = None if index.offset is None else _int_tuple(index.offset, f"storage_data offset of {index.fqn}", where)
        entry = _entry(info, f"{where} [{index.fqn}]")
        # MetadataIndex.index is only a lookup hint; (fqn, offset) is the
        # identity, and like torch's dict the last entry for it wins
        storage[(index.fqn, offset)] = entry

    items: dict[str, _TensorItem | _BytesItem] = {}
    for fqn, item in sdm.items():
        if not isinstance(fqn, str):
            raise CorruptMetadataError(f"state_dict_metadata key {short_repr(fqn)} is not a string", where)
        item_where = f"{where} [{fqn}]"
        problem = planner_path_problem(md.planner_data, fqn)
        if problem:
            raise CorruptMetadataError(problem, item_where)
        if isinstance(item, TensorStorageMetadata):
            items[fqn] = _tensor_item(fqn, item, storage, item_where)
        elif isinstance(item, BytesStorageMetadata):
            bytes_entry = storage.get((fqn, None))
            if bytes_entry is None:
                raise CorruptMetadataError("no storage_data entry for this non-tensor item", item_where)
            items[fqn] = _BytesItem(bytes_entry)
        else:
            raise CorruptMetadataError(f"unknown storage metadata {type(item).__name__}", item_where)
    tree = planner_tree_problem(md.planner_data, sdm)
    if tree is not None:
        raise CorruptMetadataError(tree[1], f"{where} [{tree[0]}]")
    return _ParsedMetadata(items, storage, md.planner_data, version)


def _tensor_item(fqn: str, item: TensorStorageMetadata, storage: dict, where: str) -> _TensorItem:
    props = item.properties
    problem = properties_problem(props)
    if problem:
        raise CorruptMetadataError(problem, where)
    try:
        dtype = dtypes.from_torch(props.dtype.name).name
    except CkptError as exc:
        raise CorruptMetadataError(exc.message, where) from None
    shape = _int_tuple(item.size, "tensor size", where)
    if shape and min(shape) < 0:
        raise CorruptMetadataError(f"negative dimension in size {list(shape)}", where)
    if not isinstance(item.chunks, (list, tuple)):
        raise CorruptMetadataError("chunk list is not a list", where)
    chunks: list[Chunk] = []
    entries: list[_Entry] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    duplicates = 0
    for chunk_md in item.chunks:
        if not isinstance(chunk_md, ChunkStorageMetadata):
            raise CorruptMetadataError(f"chunk {short_repr(chunk_md)} is not a ChunkStorageMetadata", where)
        offsets = _int_tuple(chunk_md.offsets, "chunk offsets", where)
        sizes = _int_tuple(chunk_md.sizes, "chunk sizes", where)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise CorruptMetadataError(
                f"chunk at offsets {list(offsets)} with sizes {list(sizes)} does not match rank {len(shape)}", where
            )
        # (map-based: this runs for every chunk of every tensor)
        ends = map(operator.add, offsets, sizes)
        if shape and (min(offsets) < 0 or min(sizes) < 0 or any(map(operator.gt, ends, shape))):
            raise CorruptMetadataError(
                f"chunk at offsets {list(offsets)} with sizes {list(sizes)} lies outside shape {list(shape)}", where
            )
        entry = storage.get((fqn, offsets))
        if entry is None:
            raise CorruptMetadataError(f"no storage_data entry for the chunk at offsets {list(offsets)}", where)
        if (offsets, sizes) in seen:
            # a planner that keeps replicated duplicates lists the chunk once per
            # rank; storage_data (keyed by fqn and offsets) holds one copy of it
            duplicates += 1
            continue
        seen.add((offsets, sizes))
        chunks.append(Chunk(offsets, sizes))
        entries.append(entry)
    layout = props.layout if isinstance(props.layout, str) else "torch.strided"
    return _TensorItem(shape, dtype, chunks, entries, bool(props.requires_grad), duplicates, layout)


def _entry(info: Any, where: str) -> _Entry:
    if not isinstance(info, StorageInfo):
        raise CorruptMetadataError(f"storage entry {short_repr(info)} is not a _StorageInfo", where)
    path, offset, length = info.relative_path, info.offset, info.length
    if not isinstance(path, str) or not path:
        raise CorruptMetadataError(f"storage entry has no file name ({short_repr(path)})", where)
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise CorruptMetadataError(f"storage entry {path} has invalid byte range {offset!r}+{length!r}", where)
    transforms = info.transform_descriptors or ()
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise CorruptMetadataError(f"invalid transform descriptors {short_repr(transforms)}", where)
    return _Entry(path, offset, length, tuple(transforms))


# zstd's densest encoding (an RLE block: a 3-byte header and one byte that
# stands for up to 128 KiB) decodes to at most ~32,768 times its size
MAX_TRANSFORM_RATIO = 1 << 15


def entry_capacity(entry: _Entry) -> int:
    """The most bytes an entry's stored bytes can stand for (its length; more when it is zstd-compressed)."""
    return entry.length * (MAX_TRANSFORM_RATIO if entry.transforms else 1)


def chunk_claim_problem(sizes: tuple[int, ...], itemsize: int, entry: _Entry) -> str | None:
    """Why a chunk's claimed size cannot be in its storage entry (a torch.save archive holds the raw bytes), or None.

    Checked before anything is sized by the claim: a 16-byte entry cannot
    hold an 8 TB chunk, and a read must fail in one line instead of trying.
    """
    if entry.length == 0:
        return f"its storage entry in {entry.relative_path} has length 0 (torch.load of 0 bytes fails)"
    claimed = math.prod(sizes) * itemsize
    if claimed > entry_capacity(entry):
        stored = f"{entry.length} stored bytes" + (" (compressed)" if entry.transforms else "")
        return f"chunk of sizes {list(sizes)} claims {claimed} bytes but its storage entry has {stored}"
    return None


def _int_tuple(value: Any, what: str, where: str) -> tuple[int, ...]:
    if type(value) is Size and (not value or set(map(type, value)) == {int}):
        return tuple(value)
    if not isinstance(value, (tuple, list)) or (value and set(map(type, value)) != {int}):
        raise CorruptMetadataError(f"{what} is not a tuple of ints: {short_repr(value)}", where)
    return tuple(value)


# ---------------------------------------------------------------------------
# Leaves
# ---------------------------------------------------------------------------
def _entry_where(storage: Storage, entry: _Entry, fqn: str) -> str:
    return f"{storage.url}/{entry.relative_path}[{entry.offset}:{entry.offset + entry.length}] ({fqn})"


class _LeafMaker:
    """_array_leaf for every tensor of one checkpoint: what thousands of tensors share (the
    dtype's size, the chunk list of a one-chunk tensor) is made once."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._dtypes: dict[str, int] = {}  # dtype name -> itemsize
        self._layouts: dict[int, tuple[Chunk, ChunkList]] = {}  # id(chunk) -> (chunk, its one-chunk list)
        self._sharding = _chunk_list_sharding(1)

    def __call__(self, fqn: str, keys: tuple[Key, ...], item: _TensorItem) -> ArrayLeaf:
        chunks, entries = item.chunks, item.entries
        if len(chunks) != 1 or item.requires_grad or item.duplicates:
            return _array_leaf(self._storage, fqn, keys, item)
        dtype = item.dtype
        known = self._dtypes.get(dtype)
        if known is None:
            known = self._dtypes[dtype] = dtypes.get(dtype).itemsize
        itemsize = known
        chunk, entry = chunks[0], entries[0]
        unreadable = None
        if not entry.length or entry.transforms or math.prod(chunk.sizes) * itemsize > entry.length:
            unreadable = chunk_claim_problem(chunk.sizes, itemsize, entry)
        shared = self._layouts.get(id(chunk))
        if shared is None:
            shared = self._layouts[id(chunk)] = (chunk, ChunkList((chunk,)))  # (the chunk kept: its id stays its own)
        reader = _TensorReader(self._storage, fqn, item)
        if entry.transforms:
            stored = [entry.to_json()]
        else:
            stored = [{"file": entry.relative_path, "offset": entry.offset, "length": entry.length}]
        return ArrayLeaf(keys, fqn, item.shape, dtype, shared[1], self._sharding, reader, reader.verify_chunk,
                         {"storage": stored}, unreadable)


def _array_leaf(storage: Storage, fqn: str, keys: tuple[Key, ...], item: _TensorItem) -> ArrayLeaf:
    extra: dict[str, Any] = {"storage": [e.to_json() for e in item.entries]}
    reader = _TensorReader(storage, fqn, item)
    if item.requires_grad:
        extra["requires_grad"] = True
    if item.duplicates:
        extra["duplicate_chunks"] = item.duplicates
    itemsize = dtypes.get(item.dtype).itemsize
    unreadable = next(
        (p for chunk, entry in zip(item.chunks, item.entries) if (p := chunk_claim_problem(chunk.sizes, itemsize, entry))),
        None,
    )
    return ArrayLeaf(
        keys=keys,
        name=fqn,
        shape=item.shape,
        dtype=item.dtype,
        layout=ChunkList(tuple(item.chunks)),
        sharding=_chunk_list_sharding(len(item.chunks)),
        reader=reader,
        verifier=reader.verify_chunk,
        extra=extra,
        unreadable=unreadable,
    )


@functools.lru_cache(maxsize=None)
def _chunk_list_sharding(count: int) -> Sharding:
    """One shared (immutable) Sharding per chunk count: thousands of tensors have the same."""
    return Sharding(kind="chunks", chunks=count)


def _value_leaf(storage: Storage, fqn: str, keys: tuple[Key, ...], item: _BytesItem, allow: Allow = None) -> ValueLeaf:
    entry = item.entry

    def load() -> Any:
        where = _entry_where(storage, entry, fqn)
        _refuse_transforms(entry, where)
        if entry.length == 0:
            raise CorruptMetadataError("empty storage entry", where)
        if entry.transforms:
            decoded = _transforms_module().DecodedEntry(
                _entry_fetch(storage, entry, where), entry.length, entry.transforms, where,
                max_decoded=safe_pickle.MAX_PAYLOAD_PICKLE_BYTES + _ARCHIVE_SLACK,
            )
            data = decoded.read_all()
        else:
            data = storage.read_range(entry.relative_path, entry.offset, entry.offset + entry.length)
        return _payload_module().load_value(data, where, allow)

    return ValueLeaf(keys=keys, name=fqn, value_type="bytes", loader=load, extra={"storage": [entry.to_json()]})


def _refuse_transforms(entry: _Entry, where: str) -> None:
    """Only transforms ckpt can undo (torch's ZStandard extension) get past here."""
    if entry.transforms:
        _transforms_module().check(entry.transforms, where)


def _entry_fetch(storage: Storage, entry: _Entry, where: str) -> Fetch:
    """fetch(start, end) over one storage entry's stored bytes."""

    def fetch(start: int, end: int) -> bytes:
        if end > entry.length:
            raise CorruptMetadataError(f"read past the entry's {entry.length} bytes", where)
        return storage.read_range(entry.relative_path, entry.offset + start, entry.offset + end)

    return fetch


def _transforms_module():  # noqa: ANN202
    from . import transforms as dcp_transforms  # (imports zstandard only when an entry is decoded)

    return dcp_transforms


# decoded bytes a torch.save archive may hold besides its tensor's storage
# (data.pkl, zip records, alignment): bounds what a zstd stream may decode to
_ARCHIVE_SLACK = 16 << 20


class _TensorReader(ArrayReader):
    """Reads a region of one DCP tensor from the chunks that overlap it."""

    # any part of a chunk is read by byte ranges of its archive: the scheduler streams big chunks
    reads_byte_ranges = True

    # one per tensor, 10^4-10^5 of them in a checkpoint of many small tensors: no per-instance
    # __dict__, the per-chunk records made on first use, and one lock shared by every tensor
    # (it guards a few dict operations: contention is negligible)
    __slots__ = ("_storage", "_fqn", "_item", "_np_dtype", "_located", "_decoded_lengths", "_crc_tiles",
                 "_crc_checked")
    _lock = threading.Lock()

    def __init__(self, storage: Storage, fqn: str, item: _TensorItem, np_dtype: np.dtype | None = None) -> None:
        self._storage = storage
        self._fqn = fqn
        self._item = item
        # the numpy dtype when first read (numpy is imported then: an inspect reads nothing, issue 46)
        self._np_dtype = np_dtype
        # a chunk's payload location (from its zip headers) never changes: keep it
        self._located: dict[int, TensorPayload] | None = None
        self._decoded_lengths: dict[int, int] | None = None  # transformed entries: decoded archive sizes
        # chunks read in parts (bands of a chunk larger than the budget): their
        # storage member's CRC-32 put together from the parts as they are read
        self._crc_tiles: dict[int, Any] | None = None  # chunk -> checksum.CrcTiling
        self._crc_checked: set[int] | None = None

    @property
    def _dtype(self) -> np.dtype:
        dt = self._np_dtype
        if dt is None:
            dt = self._np_dtype = dtypes.numpy_dtype(self._item.dtype)
        return dt

    def __call__(self, region: Region) -> np.ndarray:
        import numpy as np

        if self._item.layout != "torch.strided":
            raise CkptError(
                f"a {self._item.layout.removeprefix('torch.')} tensor, which ckpt cannot read (only strided, "
                "dense tensors); load it with torch",
                f"{self._storage.url}/{METADATA_FILE} [{self._fqn}]",
            )
        out_shape = tuple(r.stop - r.start for r in region)
        volume = math.prod(out_shape)
        if volume == 0:
            return np.empty(out_shape, dtype=self._dtype)
        tasks: list[tuple[int, Region, Region]] = []
        covered = 0
        for i, chunk in enumerate(self._item.chunks):
            overlap = _intersect(region, chunk)
            if overlap is None:
                continue
            local = tuple(slice(r.start - o, r.stop - o) for r, o in zip(overlap, chunk.offsets))
            target = tuple(slice(r.start - q.start, r.stop - q.start) for r, q in zip(overlap, region))
            tasks.append((i, local, target))
            covered += math.prod(r.stop - r.start for r in overlap)
        if covered < volume:
            self._check_coverage(region, tasks, covered, volume)

        for i, _, _ in tasks:
            problem = chunk_claim_problem(self._item.chunks[i].sizes, self._dtype.itemsize, self._item.entries[i])
            if problem:
                raise CorruptMetadataError(problem, _entry_where(self._storage, self._item.entries[i], self._fqn))
        # Locate every chunk first: its archive header is checked against
        # .metadata and against the bytes actually stored before anything
        # sized by .metadata alone (the output, a coverage mask) is allocated.
        sources = _map(lambda task: self._locate(task[0], fresh=True), tasks)
        if covered > volume:
            self._check_coverage(region, tasks, covered, volume)
        if len(tasks) == 1 and covered == volume:
            # one chunk covers the region: its decoded array is the answer (no second copy)
            (index, local, _), (payload, fetch, where, held) = tasks[0], sources[0]
            return _payload_module().read_region(
                payload, local, fetch, where, None if held else self._fetch_into(index, where),
                self._on_span(index, payload, where),
            )
        out = np.empty(out_shape, dtype=self._dtype)

        def copy(args: tuple[tuple[int, Region, Region], tuple[TensorPayload, Fetch, str, bool]]) -> None:
            (i, local, target), (payload, fetch, where, held) = args
            out[target] = _payload_module().read_region(
                payload, local, fetch, where, None if held else self._fetch_into(i, where), self._on_span(i, payload, where)
            )

        _map(copy, list(zip(tasks, sources)))
        return out

    def verify_chunk(self, i: int) -> None:
        """Check chunk i's CRC-32 (for chunks read in blocks): done already if
        its blocks tiled its storage member, else by streaming its bytes once more."""
        with self._lock:
            if self._crc_checked is not None and i in self._crc_checked:
                return
        payload, fetch, where = self._locate(i)
        _payload_module().verify_crc(payload, fetch, where)

    def _on_span(self, i: int, payload: TensorPayload, where: str) -> Callable[[int, int, int], None]:
        """What read_region tells of a part of chunk i it read: the part's CRC-32, tiled into the member's."""

        def on_span(start: int, end: int, crc: int) -> None:
            with self._lock:
                if self._crc_checked is not None and i in self._crc_checked:
                    return
                if self._crc_tiles is None:
                    self._crc_tiles = {}
                tiles = self._crc_tiles.get(i)
                if tiles is None:
                    from ...base.checksum import CrcTiling  # (zlib-ng: only once data is read)

                    tiles = self._crc_tiles[i] = CrcTiling(payload.data_offset, payload.data_offset + payload.data_length)
                whole = tiles.add(start, end, crc)
                if whole is None:
                    return
                del self._crc_tiles[i]
                if whole == payload.data_crc:
                    if self._crc_checked is None:
                        self._crc_checked = set()
                    self._crc_checked.add(i)
                    return
            raise CorruptMetadataError("tensor data fails its CRC-32 check", where)

        return on_span

    def _check_coverage(self, region: Region, tasks: list, covered: int, volume: int) -> None:
        """Every element of the region must come from some chunk (no uninitialised output)."""
        import numpy as np

        if covered == volume:
            return  # DCP chunks do not overlap, so an exact count means full coverage
        if covered > volume:  # overlapping chunks: count precisely
            mask = np.zeros(tuple(r.stop - r.start for r in region), dtype=bool)
            for _, _, target in tasks:
                mask[target] = True
            if mask.all():
                return
            covered = int(mask.sum())
        where = f"{self._storage.url}/{METADATA_FILE} [{self._fqn}]"
        raise CorruptMetadataError(
            f"the saved chunks cover only {covered} of the {volume} elements of region "
            f"{[(r.start, r.stop) for r in region]}",
            where,
        )

    def _fetch_into(self, i: int, where: str) -> Callable[[int, Any], None]:
        """Chunk i's bulk read: fill a buffer with its entry's bytes from a position."""
        entry = self._item.entries[i]
        if entry.transforms:
            # the stored bytes are not the archive's: decode straight into the buffer
            return self._decoded(i, entry, where, _entry_fetch(self._storage, entry, where)).fetch_into

        def fetch_into(start: int, buffer: Any) -> None:
            if start + memoryview(buffer).nbytes > entry.length:
                raise CorruptMetadataError(f"read past the entry's {entry.length} bytes", where)
            self._storage.read_range_into(entry.relative_path, entry.offset + start, buffer)

        return fetch_into

    def _decoded(self, i: int, entry: _Entry, where: str, fetch: Fetch) -> Any:
        """Chunk i's transformed entry as a DecodedEntry (its decoded length once known)."""
        with self._lock:
            known = self._decoded_lengths.get(i) if self._decoded_lengths is not None else None
        # the decoded archive holds the chunk's bytes plus small records
        expected = math.prod(self._item.chunks[i].sizes) * self._dtype.itemsize
        return _transforms_module().DecodedEntry(
            fetch, entry.length, entry.transforms, where,
            max_decoded=2 * expected + _ARCHIVE_SLACK,
            key=(self._storage.url, entry.relative_path, entry.offset), length=known,
        )

    @overload
    def _locate(self, i: int) -> tuple[TensorPayload, Fetch, str]: ...
    @overload
    def _locate(self, i: int, fresh: Literal[True]) -> tuple[TensorPayload, Fetch, str, bool]: ...

    def _locate(self, i: int, fresh: bool = False) -> tuple[Any, ...]:
        """Chunk i's validated payload location, a fetch over its entry, and its `where`
        (`fresh`: and whether that fetch holds the whole entry already: a small entry's
        archive, read whole to locate its payload the first time, so that its data needs
        no second read: 10,000 small tensors are then 10,000 reads, not 20,000)."""
        entry = self._item.entries[i]
        chunk = self._item.chunks[i]
        where = _entry_where(self._storage, entry, self._fqn)
        _refuse_transforms(entry, where)
        fetch = _entry_fetch(self._storage, entry, where)
        length = entry.length
        decoded = None
        if entry.transforms:
            decoded = self._decoded(i, entry, where, fetch)
            fetch = decoded.fetch

        with self._lock:
            payload = self._located.get(i) if self._located is not None else None
        if payload is not None:
            return (payload, fetch, where, False) if fresh else (payload, fetch, where)
        if decoded is not None:
            length = decoded.scan()
        archive = _payload_module().open_payload_range(fetch, length, where)
        payload = archive.tensor()
        if payload.dtype != self._item.dtype or payload.shape != chunk.sizes:
            raise CorruptMetadataError(
                f"payload holds {payload.dtype}{list(payload.shape)} but .metadata says "
                f"{self._item.dtype}{list(chunk.sizes)} for the chunk at offsets {list(chunk.offsets)}",
                where,
            )
        with self._lock:
            if self._located is None:
                self._located = {}
            self._located[i] = payload
            if decoded is not None:
                if self._decoded_lengths is None:
                    self._decoded_lengths = {}
                self._decoded_lengths[i] = length
        # this first time, read through the archive: it holds what locating
        # fetched (all of a small entry), so the data may need no new read
        if fresh:
            return payload, archive.read_bytes, where, length <= _payload_module().WHOLE_FETCH_BELOW
        return payload, archive.read_bytes, where


def _map(fn: Callable[[Any], Any], items: list) -> list:
    """fn over items, concurrently when there are several (chunk reads are I/O)."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(_MAX_PARALLEL_CHUNK_READS, len(items))) as pool:
        return list(pool.map(fn, items))  # list() re-raises the first failure


def _intersect(region: Region, chunk: Chunk) -> Region | None:
    out = []
    for r, o, s in zip(region, chunk.offsets, chunk.sizes):
        lo, hi = max(r.start, o), min(r.stop, o + s)
        if hi <= lo:
            return None
        out.append(slice(lo, hi))
    return tuple(out)
