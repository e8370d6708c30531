"""Hugging Face safetensors reader, without torch or the safetensors package.

A safetensors file is an 8-byte little-endian header length N, N bytes of
JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}` and then the raw little-endian tensor bytes,
back to back in offset order (begin/end are relative to the end of the
header). What is read here:

  * a single `.safetensors` file (`read_file`), or a directory holding
    `model.safetensors`, or a sharded set `model-0000K-of-0000N.safetensors`
    with `model.safetensors.index.json` (`weight_map`: tensor -> file,
    `metadata.total_size`) as transformers' save_pretrained writes it;
    other files (config.json, tokenizer files) are listed as notes;
  * torch DCP's HF layout (torch.distributed.checkpoint.hf_storage's
    HuggingFaceStorageWriter): with `save_distributed`, every rank writes
    `shard-0000R-model-0000K-of-0000N.safetensors` holding its pieces of
    each tensor, with each piece's offset in the full tensor in
    `__metadata__["DCP_SHARDING_INFO"]` (`{name: {"saved_offsets": [...]}}`);
    the full shape is the largest offset + shape along each dimension, as
    torch's HuggingFaceStorageReader computes it. Consolidated output is a
    plain sharded set (with the per-rank files left in `sharded/`).

Opening reads the first 8 bytes and the header of each file and nothing
else. The header is checked strictly before anything is trusted: the length
against the file size and a 100 MB cap (the safetensors library's), the JSON
(strict, no duplicate names, depth bounded by Python's recursion limit), each
dtype, shape and data_offsets (each tensor's bytes equal shape x itemsize,
the tensors tile the data section exactly, nothing past the end of the
file). `header_problems` lists every such problem for `ckpt validate`; the
reader refuses a file with any of them.

A region is read as byte ranges of the files through the storage layer
(local pread, S3/GCS ranged GETs): only the rows it touches.
"""
from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...core.contract import ArrayReader
from ...base import dtypes
from ...base.errors import CkptError, CorruptMetadataError, NotFoundError, UnreadableFileError, UsageError
from ...core.model import ArrayLeaf, Checkpoint, Chunk, ChunkList, Key, Leaf, MissingData, Region, Sharding, ValueLeaf
from ...storage import Storage
from ...machinery import hf_index
from ...base.strict_json import parse_json

NAME = "safetensors"
SUFFIX = ".safetensors"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# the safetensors library refuses longer headers (MAX_HEADER_SIZE in tensor.rs)
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"  # torch's _hf_utils.CUSTOM_METADATA_KEY
DCP_OFFSETS_KEY = "saved_offsets"
# ckpt's own __metadata__ entry: the source's tree keys where they are not the
# dotted split of the name ("flat": every tensor is one key, as in a DCP state dict)
KEYS_KEY = "ckpt.keys"
# ckpt's own __metadata__ entry: a JSON list of the 0-d tensors that were Python
# numbers (a `step` int) in the source; read back as ValueLeaf scalars of their type
SCALARS_KEY = "ckpt.python_scalars"
SHARD_FILE = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})\.safetensors$")
DCP_SHARD_FILE = re.compile(r"^shard-(?P<rank>\d{5})-model-(?P<k>\d{5})-of-(?P<n>\d{5})\.safetensors$")
# safetensors dtypes numpy cannot hold one element per byte (packed sub-byte floats)
_PACKED_DTYPES = {"F4", "F6_E2M3", "F6_E3M2"}
_U64_MAX = 2**64 - 1
# reading whole rows and cutting the region out of them is one request; past
# this much overhead a region is read row by row instead (bounded memory)
_SPAN_SLACK_BYTES = 1 << 20


def detect(storage: Storage) -> bool:
    """A directory with an index file or `.safetensors` files at its top."""
    _, files = storage.listdir()
    return any(f == INDEX_FILE or f.endswith(SUFFIX) for f in files)


def split_file_url(url: str) -> tuple[str, str] | None:
    """(directory, file name) when `url` names one `.safetensors` file, else None."""
    path = url.rstrip("/")
    if not path.endswith(SUFFIX):
        return None
    scheme, sep, _ = path.partition("://")
    is_local = not sep or scheme.lower() == "file"
    if is_local:
        local = path[len("file://"):] if sep else path
        if not os.path.isfile(os.path.expanduser(local)):
            return None  # a directory named *.safetensors, or missing: opened as a directory
    parent, _, name = path.rpartition("/")
    if not parent:
        parent = "."
    elif parent.endswith(":/") or parent.endswith("://"):
        return None
    return parent, name


# ---------------------------------------------------------------------------
# Headers
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str | None  # canonical dtype name; None when the header's dtype is unknown
    shape: tuple[int, ...]
    begin: int  # data_offsets, relative to the end of the header
    end: int


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a header: a validate finding code and a message."""

    code: str
    message: str
    tensor: str | None = None
    severity: str = "error"  # or "warning": loaders still read the checkpoint as it is
    # a problem of the file as a whole (findings.FILE_CAUSES): the tensors it takes with it
    tensors: tuple[str, ...] = ()


@dataclass
class Header:
    file: str
    file_size: int
    data_start: int  # 8 + header length: where data_offsets count from
    metadata: dict[str, str] | None
    tensors: dict[str, TensorEntry]  # in the header's order
    problems: list[Problem] = field(default_factory=list)


class HeaderError(CorruptMetadataError):
    """A header that cannot be read at all (length, JSON, structure)."""

    def __init__(self, code: str, message: str, where: str | None = None) -> None:
        self.code = code
        super().__init__(message, where)


def _is_u64(v: Any) -> bool:
    return type(v) is int and 0 <= v <= _U64_MAX


def read_header(storage: Storage, name: str) -> Header:
    """Read and check one file's header (8-byte length + JSON); a HeaderError if unusable.

    Sizes are checked against the file before anything is allocated: a length
    claiming 2^60 bytes is refused from the first 8 bytes.
    """
    where = f"{storage.url}/{name}"
    file_size = storage.size(name)
    if file_size == 0:
        raise HeaderError("empty-file", "0 bytes: no header, no data", where)
    if file_size < 8:
        raise HeaderError("truncated-file", f"{file_size} bytes: too short for the 8-byte header length", where)
    (n,) = struct.unpack("<Q", storage.read_range(name, 0, 8))
    if n > MAX_HEADER_BYTES:
        raise HeaderError("bad-metadata", f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit", where)
    if 8 + n > file_size:
        raise HeaderError(
            "truncated-file", f"header length {n} runs past the end of the file ({file_size} bytes)", where
        )
    raw = storage.read_range(name, 8, 8 + n)
    if not raw.lstrip(b" \t\r\n").startswith(b"{"):
        raise HeaderError("bad-metadata", "header does not start with '{' (not a safetensors file?)", where)
    try:
        doc = parse_json(raw, "header")
    except ValueError as exc:
        raise HeaderError("bad-metadata", str(exc), where) from None
    if not isinstance(doc, dict):
        raise HeaderError("bad-metadata", "header is not a JSON object", where)
    header = Header(name, file_size, 8 + n, None, {})
    problems = header.problems
    meta = doc.pop(METADATA_KEY, None)
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            problems.append(Problem("bad-metadata", "__metadata__ must map strings to strings"))
        else:
            header.metadata = meta
    for tname, info in doc.items():
        entry = _tensor_entry(tname, info, problems)
        if entry is not None:
            header.tensors[tname] = entry
    _check_offsets(header)
    return header


def _tensor_entry(name: str, info: Any, problems: list[Problem]) -> TensorEntry | None:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        keys = sorted(info) if isinstance(info, dict) else type(info).__name__
        problems.append(Problem("bad-metadata", f"entry must have exactly dtype, shape, data_offsets (got {keys})", name))
        return None
    shape, offsets, dt_name = info["shape"], info["data_offsets"], info["dtype"]
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        problems.append(Problem("bad-metadata", f"shape {str(shape)[:60]} is not a list of non-negative integers", name))
        return None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(o) for o in offsets)):
        problems.append(Problem("bad-metadata", f"data_offsets {str(offsets)[:60]} is not [begin, end]", name))
        return None
    begin, end = offsets
    dtype: str | None = None
    if isinstance(dt_name, str) and dt_name in _PACKED_DTYPES:
        problems.append(Problem("bad-metadata", f"dtype {dt_name} (packed sub-byte floats) is not supported", name))
    else:
        try:
            dtype = dtypes.from_safetensors(dt_name).name
        except CkptError as exc:
            problems.append(Problem("bad-metadata", exc.message, name))
    if end < begin:
        problems.append(Problem("bad-metadata", f"data_offsets [{begin}, {end}] end before they begin", name))
    elif dtype is not None:
        want = math.prod(shape) * dtypes.get(dtype).itemsize
        if end - begin != want:
            problems.append(Problem(
                "bad-metadata",
                f"data_offsets [{begin}, {end}] hold {end - begin} bytes; shape {shape} x {dtype} needs {want}",
                name,
            ))
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_offsets(header: Header) -> None:
    """The tensors must tile the data section exactly, as the safetensors library requires."""
    data_len = header.file_size - header.data_start
    cursor = 0
    prev: TensorEntry | None = None
    for t in sorted(header.tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.end < t.begin:
            continue  # reported already
        if t.begin < cursor and prev is not None:
            header.problems.append(Problem(
                "bad-metadata",
                f"data_offsets [{t.begin}, {t.end}] overlap {prev.name!r} [{prev.begin}, {prev.end}]", t.name,
            ))
        elif t.begin > cursor:
            header.problems.append(Problem(
                "bad-metadata", f"data_offsets begin at {t.begin}, leaving bytes [{cursor}, {t.begin}) unused", t.name,
            ))
        if t.end > cursor:
            cursor, prev = t.end, t
    if cursor > data_len:
        # the safetensors library refuses the whole file ("incomplete metadata, file not fully
        # covered"): every tensor in it is lost with the tail, not only the last one
        header.problems.append(Problem(
            "truncated-file",
            f"truncated: the header places data up to byte {header.data_start + cursor} but the file has "
            f"{header.file_size} bytes; safetensors loads none of its tensors",
            None, tensors=tuple(sorted(header.tensors)),
        ))
    elif cursor < data_len:
        header.problems.append(Problem(
            "bad-metadata",
            f"{data_len - cursor} bytes after the last tensor (at {header.data_start + cursor}) that no header entry covers",
        ))


def dcp_offsets(header: Header) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's offset in the full tensor, from torch's DCP_SHARDING_INFO; None when absent."""
    raw = (header.metadata or {}).get(DCP_SHARDING_KEY)
    if raw is None:
        return None
    try:
        info = parse_json(raw.encode("utf-8"), DCP_SHARDING_KEY)
    except ValueError as exc:
        raise CorruptMetadataError(str(exc), header.file) from None
    if not isinstance(info, dict):
        raise CorruptMetadataError(f"{DCP_SHARDING_KEY} is not a JSON object", header.file)
    out: dict[str, tuple[int, ...]] = {}
    for name, t in header.tensors.items():
        entry = info.get(name)
        offs = entry.get(DCP_OFFSETS_KEY) if isinstance(entry, dict) else None
        if not (isinstance(offs, list) and len(offs) == len(t.shape) and all(_is_u64(o) for o in offs)):
            raise CorruptMetadataError(
                f"{DCP_SHARDING_KEY} has no valid saved_offsets for {name!r} (rank {len(t.shape)})", header.file
            )
        out[name] = tuple(offs)
    return out


def read_index(storage: Storage) -> tuple[dict[str, str], int | None]:
    """weight_map and metadata.total_size of model.safetensors.index.json (hf_index: the one reader
    of Hugging Face's index, torch.save's too); a total_size that is no byte count is corrupt here."""
    weight_map, total = hf_index.read_index(storage, INDEX_FILE, suffix=SUFFIX)
    if total is not None and not _is_u64(total):
        raise CorruptMetadataError(f"metadata.total_size {str(total)[:40]!r} is not a byte count",
                                   f"{storage.url}/{INDEX_FILE}")
    return weight_map, total


# ---------------------------------------------------------------------------
# The set of files
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """One stored piece of a tensor: the whole tensor, or a DCP rank's shard of it."""

    file: str
    start: int  # absolute byte offset in the file
    offsets: tuple[int, ...]  # where it sits in the full tensor
    shape: tuple[int, ...]


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece]


@dataclass
class Layout:
    """What a safetensors directory holds, before any tensor is read."""

    files: list[str]  # the safetensors files read
    headers: dict[str, Header]
    index: dict[str, str] | None  # weight_map
    total_size: int | None
    dcp: bool  # torch DCP HF per-rank shards (DCP_SHARDING_INFO)
    tensors: dict[str, TensorInfo]
    ignored: list[str]  # other files beside them
    stray: list[str]  # .safetensors files the index does not name
    problems: list[Problem] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # file -> why it cannot be opened (a directory's)


def scan(storage: Storage, only: str | None = None) -> Layout:
    """Read the index (if any) and every header; raise on unusable headers, list the rest as problems.

    `only`: just that file (no listing: its directory may hold anything, e.g. a home directory)."""
    top = [] if only is not None else storage.listdir()[1]
    top_set = set(top) if only is None else {only}
    index: dict[str, str] | None = None
    total: int | None = None
    stray: list[str] = []
    if only is not None:
        files = [only]
        ignored: list[str] = []
    else:
        if INDEX_FILE in top_set:
            index, total = read_index(storage)
            files = sorted(set(index.values()))
            stray = sorted(f for f in top if f.endswith(SUFFIX) and f not in set(files))
        else:
            files = sorted(f for f in top if f.endswith(SUFFIX))
        ignored = sorted(f for f in top if f != INDEX_FILE and not f.endswith(SUFFIX))
    problems: list[Problem] = []
    headers: dict[str, Header] = {}
    unreadable: dict[str, str] = {}
    for name in files:
        if name not in top_set:
            problems.append(Problem("missing-file", f"{name} is named in {INDEX_FILE} but does not exist"))
            continue
        try:
            headers[name] = read_header(storage, name)
        except UnreadableFileError as exc:
            if only is not None:
                raise  # the one file asked for: its error is the answer
            # a file of the set that is there but cannot be read (its permissions): the checkpoint is
            # incomplete, as for a missing shard, and the other files' tensors are listed
            unreadable[name] = exc.message
    layout = Layout(files, headers, index, total, False, {}, ignored, stray, problems, unreadable)
    _collect_tensors(layout)
    return layout


def _collect_tensors(layout: Layout) -> None:
    problems = layout.problems
    offsets_by_file = {name: dcp_offsets(h) for name, h in layout.headers.items()}
    layout.dcp = bool(offsets_by_file) and all(o is not None for o in offsets_by_file.values())
    found: dict[str, list[tuple[str, TensorEntry]]] = {}
    for name, header in layout.headers.items():
        for t in header.tensors.values():
            found.setdefault(t.name, []).append((name, t))
    if layout.index is not None:
        for tname, fname in layout.index.items():
            if fname in layout.headers and all(f != fname for f, _ in found.get(tname, [])):
                problems.append(Problem("leaf-missing", f"{INDEX_FILE} places {tname!r} in {fname}, whose header does not hold it", tname))
    for tname, where in found.items():
        if layout.index is not None:
            want = layout.index.get(tname)
            if want is None:
                problems.append(Problem(
                    "leaf-missing", f"stored in {where[0][0]} but not in {INDEX_FILE} (loaders will not see it)", tname,
                    "warning",
                ))
                continue
            listed = [(f, t) for f, t in where if f == want]
            others = [f for f, _ in where if f != want]
            if others:
                problems.append(Problem("chunk-overlap", f"stored in {want} and also in {', '.join(others)}", tname))
            where = listed
        if not where:
            continue
        if not layout.dcp and len(where) > 1:
            problems.append(Problem("chunk-overlap", f"stored in both {where[0][0]} and {where[1][0]}", tname))
            where = where[:1]
        info = _tensor_info(layout, tname, where, offsets_by_file, problems)
        if info is not None:
            layout.tensors[tname] = info
    # (with a file missing or unreadable the sum is short because of that file, whose own finding
    # says so: the index is not to blame)
    if layout.index is not None and layout.total_size is not None and all(f in layout.headers for f in layout.files):
        stored = sum(math.prod(t.shape) * dtypes.get(t.dtype).itemsize for t in layout.tensors.values())
        if stored != layout.total_size:
            problems.append(Problem(
                "bad-metadata", f"{INDEX_FILE} says total_size {layout.total_size} but the tensors hold {stored} bytes",
                None, "warning",
            ))


def _tensor_info(
    layout: Layout, name: str, where: list[tuple[str, TensorEntry]],
    offsets_by_file: dict[str, dict[str, tuple[int, ...]] | None], problems: list[Problem],
) -> TensorInfo | None:
    dts: set[str] = set()
    for _, t in where:
        if t.dtype is None:
            return None  # unknown dtype: reported by the header check
        dts.add(t.dtype)
    ranks = {len(t.shape) for _, t in where}
    if len(dts) > 1 or len(ranks) > 1:
        problems.append(Problem("bad-metadata", f"pieces disagree on dtype or rank: {sorted(map(str, dts))}", name))
        return None
    pieces: list[Piece] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for fname, t in where:
        offs = offsets_by_file[fname]
        off = offs[name] if offs is not None else (0,) * len(t.shape)
        if (off, t.shape) in seen:
            continue  # a replicated piece stored by several ranks: identical, read once
        seen.add((off, t.shape))
        pieces.append(Piece(fname, layout.headers[fname].data_start + t.begin, off, t.shape))
    ndim = ranks.pop()
    shape = tuple(max(p.offsets[d] + p.shape[d] for p in pieces) for d in range(ndim))
    info = TensorInfo(name, dts.pop(), shape, pieces)
    if len(pieces) > 1:
        _check_pieces(info, problems)
    return info


def _check_pieces(info: TensorInfo, problems: list[Problem]) -> None:
    """DCP pieces: no two cover the same elements, together they cover the tensor."""
    ps = info.pieces
    for i in range(len(ps)):
        for j in range(i + 1, len(ps)):
            a, b = ps[i], ps[j]
            if all(max(ao, bo) < min(ao + asz, bo + bsz)
                   for ao, asz, bo, bsz in zip(a.offsets, a.shape, b.offsets, b.shape)):
                problems.append(Problem(
                    "chunk-overlap",
                    f"pieces at {list(a.offsets)} ({a.file}) and {list(b.offsets)} ({b.file}) cover the same elements",
                    info.name,
                ))
                return
    covered = sum(math.prod(p.shape) for p in ps)
    if covered != math.prod(info.shape):
        problems.append(Problem(
            "coverage-gap",
            f"the pieces cover {covered} of {math.prod(info.shape)} elements of shape {list(info.shape)}",
            info.name,
        ))


# ---------------------------------------------------------------------------
# Opening
# ---------------------------------------------------------------------------
def read(storage: Storage, *, step: str | int | None = None) -> Checkpoint:
    """Open a safetensors directory: the index and every header, no tensor data."""
    if step is not None:
        # (a run root's step is opened through the root: the reader sees --step only on one checkpoint)
        raise UsageError(f"--step {step} given, but this is one safetensors checkpoint, not a run root of steps",
                         storage.url)
    return _checkpoint(storage, scan(storage))


def read_file(storage: Storage, name: str) -> Checkpoint:
    """Open one `.safetensors` file `name` inside `storage`."""
    if not storage.exists(name):
        raise NotFoundError("no such file", f"{storage.url}/{name}")
    ck = _checkpoint(storage, scan(storage, only=name))
    ck.path = f"{storage.url}/{name}"
    return ck


def _checkpoint(storage: Storage, layout: Layout) -> Checkpoint:
    # damage that would make a read wrong is refused; what only hides a file
    # or a tensor is a note, and the leaves that are there can be read
    bad = [p for h in layout.headers.values() for p in h.problems if p.severity == "error"] + [
        p for p in layout.problems if p.severity == "error" and p.code not in ("leaf-missing", "missing-file")
    ]
    if bad:
        first = bad[0]
        where = next((f"{storage.url}/{h.file}" for h in layout.headers.values() if first in h.problems), storage.url)
        what = f"{first.tensor}: {first.message}" if first.tensor else first.message
        more = f" (and {len(bad) - 1} more problems; `ckpt validate` lists them)" if len(bad) > 1 else ""
        raise CorruptMetadataError(what + more, where)
    keys_of = _keys_function(layout)
    scalars = _python_scalars(layout)
    leaves: list[Leaf] = []
    for info in layout.tensors.values():
        if info.name in scalars and info.shape == () and info.dtype in _PYTHON_TYPES:
            leaves.append(_scalar_leaf(storage, info, keys_of(info.name)))
            continue
        leaves.append(_array_leaf(storage, info, keys_of(info.name), layout.dcp))
    notes = _notes(layout)
    # (a missing shard file is not a note: it makes the checkpoint incomplete, with its tensors named)
    notes[:0] = [p.message if p.tensor is None else f"{p.tensor}: {p.message}" for p in layout.problems
                 if p.code == "leaf-missing" and p.severity == "error"]
    missing = [
        MissingData(name, layout.unreadable.get(name, f"does not exist (named in {INDEX_FILE})"),
                    [t for t, f in (layout.index or {}).items() if f == name], name in layout.unreadable)
        for name in layout.files if name not in layout.headers
    ]
    if layout.index is not None and "sharded" in storage.listdir()[0]:
        notes.append("sharded/: torch DCP per-rank files of a consolidated save (not read; the files here are the consolidated ones)")
    ranks = None
    if layout.dcp:
        ranks = len({m.group("rank") for m in map(DCP_SHARD_FILE.match, layout.files) if m}) or None
    return Checkpoint(
        path=storage.url,
        format=NAME,
        layout={
            "files": len(layout.files),
            "index": INDEX_FILE if layout.index is not None else None,
            "dcp": ("save_distributed" if ranks else "rank0") if layout.dcp else None,
            "ranks": ranks,
            "metadata": {name: h.metadata for name, h in layout.headers.items() if h.metadata},
            "ignored": layout.ignored,
        },
        leaves=leaves,
        committed=True,
        saved_at=None,
        notes=notes,
        missing=missing,
    )


def _keys_function(layout: Layout) -> Callable[[str], tuple[Key, ...]]:
    """Tree keys: the dotted name split, unless ckpt recorded the source's own keys."""
    recorded: dict[str, Any] = {}
    flat = False
    for h in layout.headers.values():
        raw = (h.metadata or {}).get(KEYS_KEY)
        if raw == "flat":
            flat = True
        elif raw:
            try:
                doc = parse_json(raw.encode("utf-8"), KEYS_KEY)
            except ValueError:
                continue  # ckpt's own hint only; the names are still right
            if isinstance(doc, dict):
                recorded.update(doc)

    def keys_of(name: str) -> tuple[Key, ...]:
        keys = recorded.get(name)
        if isinstance(keys, list) and keys and all(type(k) in (str, int) for k in keys):
            return tuple(keys)
        return (name,) if flat else tuple(name.split("."))

    return keys_of


# the dtypes ckpt's writer gives Python numbers, and the type each reads back as
_PYTHON_TYPES = {"bool": bool, "int64": int, "uint64": int, "float64": float}


def _python_scalars(layout: Layout) -> set[str]:
    """The names ckpt's writer recorded as Python numbers (SCALARS_KEY), in any file's header."""
    out: set[str] = set()
    for h in layout.headers.values():
        raw = (h.metadata or {}).get(SCALARS_KEY)
        if not raw:
            continue
        try:
            doc = parse_json(raw.encode("utf-8"), SCALARS_KEY)
        except ValueError:
            continue  # ckpt's own hint only: the tensors read as 0-d arrays
        if isinstance(doc, list):
            out.update(n for n in doc if isinstance(n, str))
    return out


def _scalar_leaf(storage: Storage, info: TensorInfo, keys: tuple[Key, ...]) -> ValueLeaf:
    """A 0-d tensor that was a Python number: loads as that number (int, float or bool)."""
    reader = _RegionReader(storage, info)
    kind = _PYTHON_TYPES[info.dtype]
    extra = {"file": info.pieces[0].file, "byte_offset": info.pieces[0].start} if len(info.pieces) == 1 else {}
    return ValueLeaf(keys=keys, name=info.name, value_type="scalar", dtype=info.dtype,
                     loader=lambda: kind(reader(()).item()), extra=extra)


def _notes(layout: Layout) -> list[str]:
    notes: list[str] = []
    metas = {name: h.metadata for name, h in layout.headers.items() if h.metadata}
    shown: dict[str, list[str]] = {}
    for name, meta in metas.items():
        text = ", ".join(
            f"{k}=<{len(v)} chars>" if k in (DCP_SHARDING_KEY, KEYS_KEY, SCALARS_KEY) else f"{k}={v}" for k, v in sorted(meta.items())
        )
        shown.setdefault(text, []).append(name)
    for text, names in shown.items():
        which = names[0] if len(names) == 1 else f"{len(names)} files"
        notes.append(f"__metadata__ ({which}): {text}")
    if layout.dcp and any(DCP_SHARD_FILE.match(f) for f in layout.files):
        pieces = sum(len(t.pieces) for t in layout.tensors.values())
        notes.append(
            f"torch DCP HF layout (HuggingFaceStorageWriter, save_distributed): {len(layout.files)} per-rank files, "
            f"{pieces} pieces; full shapes are the pieces' extent (the files record no global shape)"
        )
    elif layout.dcp:
        notes.append("written by torch DCP's HuggingFaceStorageWriter (DCP_SHARDING_INFO in __metadata__)")
    if layout.index is None and any(
        (m := SHARD_FILE.match(f)) and int(m.group("n")) > 1 for f in layout.files
    ) and not layout.dcp:
        notes.append(f"sharded files without {INDEX_FILE}: every file was read (transformers needs the index)")
    if layout.stray:
        notes.append(f"not in {INDEX_FILE} (not read): {', '.join(layout.stray[:5])}" + (" ..." if len(layout.stray) > 5 else ""))
    if layout.ignored:
        notes.append(f"other files (ignored): {', '.join(layout.ignored[:8])}" + (" ..." if len(layout.ignored) > 8 else ""))
    return notes


def _array_leaf(storage: Storage, info: TensorInfo, keys: tuple[Key, ...], dcp: bool) -> ArrayLeaf:
    chunks = tuple(Chunk(p.offsets, p.shape) for p in info.pieces)
    extra: dict[str, Any] = {}
    if len(info.pieces) == 1:
        p = info.pieces[0]
        extra = {"file": p.file, "byte_offset": p.start}
    else:
        extra = {"files": sorted({p.file for p in info.pieces})}
    return ArrayLeaf(
        keys=keys,
        name=info.name,
        shape=info.shape,
        dtype=info.dtype,
        layout=ChunkList(chunks),
        sharding=Sharding(kind="chunks", chunks=len(chunks)) if dcp else None,
        reader=_RegionReader(storage, info),
        extra=extra,
    )


# ---------------------------------------------------------------------------
# Reading regions
# ---------------------------------------------------------------------------
class _RegionReader(ArrayReader):
    """Reads a region of one tensor as byte ranges of the pieces it overlaps."""

    # any part of a tensor is read by byte ranges of its file: the scheduler streams a tensor
    # larger than the memory budget in bands instead of refusing it
    reads_byte_ranges = True

    def __init__(self, storage: Storage, info: TensorInfo) -> None:
        self._storage = storage
        self._info = info
        self._dtype = dtypes.numpy_dtype(info.dtype)
        self._itemsize = dtypes.get(info.dtype).itemsize

    def __call__(self, region: Region) -> np.ndarray:
        want = tuple(r.stop - r.start for r in region)
        out = np.empty(want, dtype=self._dtype)
        if not math.prod(want):
            return out
        covered = 0
        for p in self._info.pieces:
            lo = tuple(max(r.start, o) for r, o in zip(region, p.offsets))
            hi = tuple(min(r.stop, o + s) for r, o, s in zip(region, p.offsets, p.shape))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            in_piece_lo = tuple(l - o for l, o in zip(lo, p.offsets))
            in_piece_hi = tuple(h - o for h, o in zip(hi, p.offsets))
            # (the Ellipsis keeps a 0-d result a view, not a numpy scalar)
            target = out[tuple(slice(l - r.start, h - r.start) for l, h, r in zip(lo, hi, region)) + (Ellipsis,)]
            if target.flags.c_contiguous:
                self._fill(p.file, p.start, p.shape, in_piece_lo, in_piece_hi, target)
            else:
                block = np.empty(target.shape, dtype=self._dtype)
                self._fill(p.file, p.start, p.shape, in_piece_lo, in_piece_hi, block)
                target[...] = block
            covered += math.prod(h - l for l, h in zip(lo, hi))
        if covered != math.prod(want):
            raise CkptError(
                f"region {[(r.start, r.stop) for r in region]} is not fully stored (the pieces cover {covered} "
                f"of {math.prod(want)} elements)", self._info.name,
            )
        return out

    def _fill(
        self, file: str, base: int, pshape: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...], out: np.ndarray,
    ) -> None:
        """Fill the C-contiguous `out` with [lo, hi) of a C-ordered piece stored at `base`."""
        if not pshape:
            self._read_into(file, base, out)
            return
        ndim = len(pshape)
        row = math.prod(pshape[1:]) * self._itemsize  # bytes per index of dimension 0
        full_rest = all(lo[d] == 0 and hi[d] == pshape[d] for d in range(1, ndim))
        if full_rest:  # whole rows: one contiguous range
            self._read_into(file, base + lo[0] * row, out)
            return
        span = (hi[0] - lo[0]) * row
        if span <= 2 * out.nbytes + _SPAN_SLACK_BYTES:
            rows = np.empty((hi[0] - lo[0],) + pshape[1:], dtype=self._dtype)
            self._read_into(file, base + lo[0] * row, rows)
            out[...] = rows[(slice(None),) + tuple(slice(l, h) for l, h in zip(lo[1:], hi[1:]))]
            return
        for i in range(lo[0], hi[0]):  # a narrow slice of wide rows: row by row
            self._fill(file, base + i * row, pshape[1:], lo[1:], hi[1:], out[i - lo[0]])

    def _read_into(self, file: str, start: int, arr: np.ndarray) -> None:
        self._storage.read_range_into(file, start, arr.reshape(-1).view(np.uint8))
