"""torch.save archives, read without torch: one file, a directory of them, a Hugging Face sharded set.

torch.save (zip format, torch >= 1.6) writes a zip of `<stem>/data.pkl` (the
pickled object; each tensor is `_rebuild_tensor_v2(storage, offset, size,
stride, ...)` over a persistent-id storage) and `<stem>/data/<key>` (each
storage's raw bytes, STORED, 64-byte aligned). ckpt_tool/torchsave/ parses the
zip the way torch's reader does and unpickles `data.pkl` through the
allow-list, so nothing in the file runs; this module turns the object into
leaves:

  * a dict is a subtree (str and int keys; a dotted str key is split at its
    dots, so that `pytorch_model.bin`'s "model.layers.0.mlp.up_proj.weight"
    has the same key path as the same tensor in `model.safetensors`; a file
    whose keys would collide once split keeps them whole);
  * a list or tuple holding a tensor is a subtree by index; one holding none
    is one value (as DCP keeps it: one non-tensor item);
  * a tensor is an ArrayLeaf whose reader reads the byte span of its view
    (storage offset and strides applied): views of one storage, tied weights
    (two keys on one tensor) and transposed tensors all read right, and a
    region reads only the bytes it needs;
  * anything else (numbers, strings, None, empty containers) is a ValueLeaf.

What a directory holds is decided by its files: `*.bin.index.json` (transformers'
`pytorch_model.bin.index.json`: `weight_map` tensor -> shard file) names the set;
without one, `name-0000K-of-0000N.bin` shards are one set, and other torch.save
files are one subtree each (keyed by the file's stem), a lone file the whole
tree. Opening reads each file's zip directory (its last bytes) and `data.pkl`
(its first): two small reads per file. A tensor's claim on its storage is
checked against the zip's central directory before anything is read; its data
offset (behind the member's local header) is found on its first read.

The pre-1.6 format (a bare pickle stream, also what `_use_new_zipfile_serialization
=False` writes) is refused by name: its tensors are not addressable by byte range.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ..contract import ArrayReader
from ... import dtypes
from ...checksum import crc32
from ...errors import CkptError, CorruptMetadataError, NotFoundError, UsageError
from ...model import ArrayLeaf, Checkpoint, Key, Leaf, MissingData, Region, RegularGrid, ValueLeaf, memory_leaf
from ...storage import Storage
from ...torchsave import object_tree
from ...torchsave import payload as tp
from ...torchsave.safe_pickle import TensorRef
from ...values import SameObject

NAME = "torch"
SUFFIXES = (".bin", ".pt", ".pth")
INDEX_SUFFIX = ".bin.index.json"  # transformers' WEIGHTS_INDEX_NAME, pytorch_model.bin.index.json
ZIP_MAGIC = b"PK\x03\x04"
# torch.save's pre-1.6 format: a pickle (protocol 2) of this magic number first
LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
SHARD_FILE = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})\.bin$")
HF_WEIGHTS = "pytorch_model.bin"  # transformers' WEIGHTS_NAME
MAX_INDEX_BYTES = 100_000_000
# at most this many candidate files have their first bytes read by detect()
_SNIFF_LIMIT = 16


class LegacyFormatError(CorruptMetadataError):
    """A torch.save file in the pre-1.6 pickle format (not a zip)."""

    def __init__(self, where: str) -> None:
        super().__init__(
            "a torch.save file in the legacy format (a pickle stream, written by torch < 1.6 or with "
            "_use_new_zipfile_serialization=False): ckpt reads the zip format only; re-save it with a "
            "current torch (torch.save(torch.load(f, weights_only=True), new_f))",
            where,
        )


# ---------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------
def _head(storage: Storage, name: str, n: int = 16) -> bytes:
    try:
        size = storage.size(name)
        return storage.read_range(name, 0, min(n, size)) if size else b""
    except CkptError:
        return b""


def is_torch_file(head: bytes) -> bool:
    """Whether a file's first bytes are a torch.save archive's (zip) or the legacy format's."""
    return head.startswith(ZIP_MAGIC) or head.startswith(LEGACY_MAGIC)


def named_by_transformers(name: str) -> bool:
    """`pytorch_model.bin` or a `-0000K-of-0000N.bin` shard: a torch.save file by its name alone
    (so that a damaged one is reported as such, not as an unknown file)."""
    return name == HF_WEIGHTS or bool(SHARD_FILE.match(name))


def _is_torch_file(storage: Storage, name: str) -> bool:
    return named_by_transformers(name) or is_torch_file(_head(storage, name))


def detect(storage: Storage) -> bool:
    """A directory with a `*.bin.index.json`, or top-level `.bin`/`.pt`/`.pth` files that are torch.save archives."""
    _, files = storage.listdir()
    if any(f.endswith(INDEX_SUFFIX) for f in files):
        return True
    candidates = [f for f in files if f.endswith(SUFFIXES)][:_SNIFF_LIMIT]
    return any(_is_torch_file(storage, f) for f in candidates)


def split_local_file(url: str) -> tuple[str, str] | None:
    """(directory, file name) when `url` names one torch.save file: a local file by its first
    bytes (whatever its name: `.pt`, `.bin`, `.ckpt`, ...), a remote one by its suffix."""
    from .. import registered

    path = url[len("file://"):] if url.startswith("file://") else url
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if any(info.name != NAME and info.claimed(name) for info in registered()):
        return None  # another format's file (a DCP `.distcp` starts with a torch.save archive too)
    if "://" in url and not url.startswith("file://"):
        parent, _, name = url.rstrip("/").rpartition("/")
        if not name.endswith(SUFFIXES) or parent.endswith(":/"):
            return None
        return parent, name
    local = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(local):
        return None
    try:
        with open(local, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return None
    name = os.path.basename(local)
    if head.startswith(LEGACY_MAGIC) or (head.startswith(ZIP_MAGIC) and _holds_data_pkl(local, name)):
        return os.path.dirname(local), name
    return None


def _holds_data_pkl(path: str, name: str) -> bool:
    """A zip file torch.save wrote (a `data.pkl` member), not a numpy .npz or any other zip; a zip
    too damaged to list is torch's when its name says so (its damage is then reported as such)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as zf:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in zf.namelist())
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
        # (NotImplementedError: a "version needed to extract" zipfile does not know; miniz ignores it)
        return name.endswith(SUFFIXES)


# ---------------------------------------------------------------------------
# One archive
# ---------------------------------------------------------------------------
class Archive:
    """One torch.save file in a storage: its zip directory, its object, CRCs verified so far.

    Views share storages: tied weights, slices of one storage, and views whose
    logical size is far above their stored bytes (an `expand`: stride 0). A
    storage several tensors read, or one a view repeats, is fetched once and
    kept (CRC-checked) while it fits `CACHE_BYTES`, so that each of its readers,
    and each band of a view read in bands, takes its values from that one read.
    """

    # stored bytes kept for tensors that share or repeat them: least recently used first out;
    # a storage larger than this is read by each region's byte span instead
    CACHE_BYTES = 64 << 20

    def __init__(self, storage: Storage, name: str, allow: tp.Allow = None) -> None:
        self.storage = storage
        self.name = name
        self.where = f"{storage.url}/{name}"
        size = storage.size(name)
        if size == 0:
            raise CorruptMetadataError("0 bytes: not a torch.save archive", self.where)
        head = storage.read_range(name, 0, min(16, size))
        if head.startswith(LEGACY_MAGIC):
            raise LegacyFormatError(self.where)
        if not head.startswith(ZIP_MAGIC):
            raise CorruptMetadataError("not a torch.save archive (no zip header)", self.where)
        self.size = size
        self.zip = tp.open_payload_range(self.fetch, size, self.where, allow)
        self._lock = threading.Lock()
        self._located: dict[str, tp.TensorPayload] = {}  # storage key -> its member as uint8
        self.crc_checked: set[str] = set()  # storage keys whose CRC-32 a whole read has checked
        self._readers: dict[str, int] = {}  # storage key -> tensor readers on it
        self._cached: OrderedDict[str, memoryview] = OrderedDict()  # storage key -> its bytes (CRC-checked)
        self._cached_bytes = 0
        self._loading: dict[str, threading.Lock] = {}  # storage key -> held while it is fetched for the cache
        self._distinct: dict[tuple[Any, ...], ArrayLeaf] = {}  # a repeating view's geometry -> its values' leaf

    @property
    def obj(self) -> Any:
        return self.zip.obj

    def fetch(self, start: int, end: int) -> bytes:
        return self.storage.read_range(self.name, start, end)

    def fetch_into(self, start: int, buffer: Any) -> None:
        self.storage.read_range_into(self.name, start, buffer)

    def member(self, key: str) -> tp.TensorPayload:
        """Storage member `key`'s position (its local header read once)."""
        with self._lock:
            found = self._located.get(key)
        if found is None:
            found = self.zip.member_payload(key)
            with self._lock:
                self._located[key] = found
        return found

    def payload(self, ref: TensorRef) -> tp.TensorPayload:
        """Where a tensor's bytes are: its storage member's data offset, and the view."""
        problem = self.zip.claim_problem(ref)
        if problem is not None:
            raise CorruptMetadataError(problem, self.where)
        member = self.member(ref.storage.key)
        return tp.TensorPayload(
            dtype=ref.dtype, shape=ref.size, stride=ref.stride, storage_offset=ref.storage_offset,
            data_offset=member.data_offset, data_length=member.data_length, data_crc=member.data_crc,
            big_endian=self.zip.big_endian, conj=ref.conj, neg=ref.neg,
        )

    def verify_member(self, key: str) -> None:
        """Check storage member `key` against its CRC-32, streaming it (once per archive)."""
        with self._lock:
            if key in self.crc_checked:
                return
        tp.verify_crc(self.member(key), self.fetch, self.where)
        with self._lock:
            self.crc_checked.add(key)

    def add_reader(self, key: str) -> None:
        """A tensor reader on storage `key` (a storage several read is worth keeping once fetched)."""
        with self._lock:
            self._readers[key] = self._readers.get(key, 0) + 1

    def shared(self, key: str) -> bool:
        with self._lock:
            return self._readers.get(key, 0) > 1

    def cached_member(self, key: str) -> memoryview | None:
        """Storage member `key`'s bytes, fetched once and CRC-checked, kept while they fit
        CACHE_BYTES (least recently used first out); None for a member larger than that."""
        member = self.member(key)
        if member.data_length > self.CACHE_BYTES:
            return None
        with self._lock:
            found = self._cached.get(key)
            if found is not None:
                self._cached.move_to_end(key)
                return found
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:  # one fetch per member, however many readers ask at once
            with self._lock:
                found = self._cached.get(key)
                if found is not None:
                    return found
            start, end = member.data_offset, member.data_offset + member.data_length
            data = self.fetch(start, end)
            if len(data) != end - start:
                raise CorruptMetadataError(f"short read: wanted {end - start} bytes, got {len(data)}", self.where)
            if member.data_crc and crc32(data) != member.data_crc:
                raise CorruptMetadataError("tensor data fails its CRC-32 check", self.where)
            found = memoryview(data)
            with self._lock:
                self.crc_checked.add(key)
                self._cached[key] = found
                self._cached_bytes += len(found)
                while self._cached_bytes > self.CACHE_BYTES and len(self._cached) > 1:
                    _, dropped = self._cached.popitem(last=False)
                    self._cached_bytes -= len(dropped)
        return found

    def distinct_leaf(self, ref: TensorRef, values: tp.DistinctValues, name: str) -> ArrayLeaf:
        """The leaf of the values a repeating view draws from (one per storage and geometry: views
        repeating the same values share it, so that they are read and checked once)."""
        geometry = (ref.storage.key, ref.dtype, ref.storage_offset, values.shape, values.stride, ref.conj, ref.neg)
        with self._lock:
            found = self._distinct.get(geometry)
        if found is not None:
            return found
        stored = TensorRef(ref.storage, ref.dtype, ref.storage_offset, values.shape, values.stride,
                           ref.requires_grad, ref.conj, ref.neg)
        reader = TensorReader(self, stored, name)
        leaf = ArrayLeaf(
            keys=(), name=name, shape=values.shape, dtype=ref.dtype, layout=RegularGrid(values.shape),
            reader=reader, verifier=reader.verify if ref.storage.nbytes else None,
            extra={"file": self.name, "storage": ref.storage.key}, unreadable=self.zip.claim_problem(stored),
        )
        with self._lock:
            return self._distinct.setdefault(geometry, leaf)


class TensorReader(ArrayReader):
    """Reads a region of one tensor of an archive by byte ranges (the scheduler streams big ones).

    A view's values come from its storage: the bytes from the region's first
    element to its last, strided into place (payload.read_region). A tensor on
    a storage other tensors read too, or a view that repeats its stored
    elements, reads them from the archive's one fetch of the storage
    (Archive.cached_member) when it is small enough to keep.
    """

    reads_byte_ranges = True

    def __init__(self, archive: Archive, ref: TensorRef, name: str) -> None:
        self._archive = archive
        self._ref = ref
        self._name = name
        self._payload: tp.TensorPayload | None = None
        self._distinct = tp.distinct_values(ref.size, ref.stride)
        archive.add_reader(ref.storage.key)

    def _located(self) -> tp.TensorPayload:
        if self._payload is None:
            self._payload = self._archive.payload(self._ref)
        return self._payload

    def __call__(self, region: Region) -> np.ndarray:
        payload = self._located()
        archive = self._archive
        key = self._ref.storage.key
        if payload.data_length and (self._distinct is not None or archive.shared(key)):
            kept = archive.cached_member(key)
            if kept is not None:
                base = payload.data_offset

                def from_kept(start: int, end: int) -> memoryview:
                    return kept[start - base : end - base]

                # (the CRC-32 was checked when the member was kept)
                return tp.read_region(dataclasses.replace(payload, data_crc=0), region, from_kept, archive.where)
        out = tp.read_region(payload, region, archive.fetch, archive.where, archive.fetch_into)
        span = payload.span(region)
        if payload.data_crc and span == (payload.data_offset, payload.data_offset + payload.data_length):
            with archive._lock:  # read_region checked the whole member's CRC-32
                archive.crc_checked.add(key)
        return out

    def stored_values(self) -> tuple[ArrayLeaf, int | None] | None:
        """For a view that repeats stored elements (stride 0, overlapping strides): the leaf of the
        values it draws from, and how many times it repeats each (None: unevenly); None for any
        other tensor. validate --deep reads and checks those values, never the logical view."""
        if self._distinct is None:
            return None
        leaf = self._archive.distinct_leaf(self._ref, self._distinct, self._name)
        return leaf, self._distinct.repeats

    def verify(self, index: int) -> None:
        """validate --deep: the storage member's CRC-32 (a tensor read in bands never passes it whole)."""
        self._archive.verify_member(self._ref.storage.key)


def repeating_view_notes(paths: list[tuple[Key, ...]], values: list[Any], shown: int = 4) -> list[str]:
    """inspect's notes on views whose logical size is far above their stored bytes (an expand: stride 0;
    overlapping strides): "w: a view of 4 stored bytes (stride 0), 1,099,511,627,776 bytes logically"."""
    notes = []
    for path, value in zip(paths, values):
        if not isinstance(value, TensorRef):
            continue
        values_of = tp.distinct_values(value.size, value.stride)
        if values_of is None:
            continue
        if len(notes) == shown:
            notes.append("... (more views that repeat their stored elements)")
            break
        itemsize = dtypes.get(value.dtype).itemsize
        stored = tp.span_elements(value.size, value.stride) * itemsize
        how = "stride 0" if values_of.repeats is not None else "overlapping strides"
        notes.append(f"{_dotted(path)}: a view of {stored:,} stored bytes ({how}), "
                     f"{math.prod(value.size) * itemsize:,} bytes logically")
    return notes


# ---------------------------------------------------------------------------
# Objects to leaves
# ---------------------------------------------------------------------------
def walk(obj: Any, keys: tuple[Key, ...] = ()) -> Iterator[tuple[tuple[Key, ...], Any]]:
    """(key path, value) for each leaf of a torch.save object (see the module docstring); a
    container met again is an object_tree.Reference to the path that shows it."""
    return object_tree.walk(obj, keys)


def split_keys(paths: list[tuple[Key, ...]]) -> list[tuple[Key, ...]] | None:
    """The key paths with dotted str keys split at their dots; None when that makes two
    leaves collide or one leaf the parent of another (the keys are then kept whole)."""
    out = [tuple(p for k in path for p in (k.split(".") if isinstance(k, str) else (k,))) for path in paths]
    if out == paths:
        return out
    seen = set(out)
    if len(seen) != len(out):
        return None
    for path in out:
        for n in range(1, len(path)):
            if path[:n] in seen:
                return None
    return out


def _value_type(value: Any) -> str:
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return "scalar"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (bytes, bytearray)):
        return "bytes"
    return "object"


_SCALAR_DTYPES = {bool: "bool", int: "int64", float: "float64"}


@dataclass
class FileTree:
    """The leaves of one archive, before they are placed in the checkpoint's tree."""

    archive: Archive
    paths: list[tuple[Key, ...]]  # the pickle's key paths
    values: list[Any]
    shared: dict[str, list[str]] = field(default_factory=dict)  # storage key -> dotted names on it


def file_tree(archive: Archive) -> FileTree:
    pairs = list(walk(archive.obj))
    tree = FileTree(archive, [p for p, _ in pairs], [v for _, v in pairs])
    for path, value in pairs:
        if isinstance(value, TensorRef):
            tree.shared.setdefault(value.storage.key, []).append(_dotted(path))
    return tree


class _ValueDecoder:
    """Decodes the value leaves of one tree with one memo: an object several values share is
    converted once (a value of N references to one big list costs the list once, not N times).
    Values from which a tensor can be reached are decoded alone, so that the memo never keeps
    tensor data alive. It holds the tree's values, so the ids in the memo stay theirs."""

    def __init__(self, archive: Archive, values: list[Any]) -> None:
        self._archive = archive
        self._values = values
        self._holders: set[int] | None = None
        self._memo: dict[int, Any] = {}
        self._lock = threading.Lock()

    def loader(self, value: Any) -> Callable[[], Any]:
        return lambda: self._decode(value)

    def _decode(self, value: Any) -> Any:
        from ...torchsave import safe_pickle

        archive = self._archive

        def read_tensor(ref: TensorRef) -> Any:
            # a tensor nested in a value (inside a set, say) is read when the value is loaded
            return TensorReader(archive, ref, "")(tuple(slice(0, n) for n in ref.size))

        with self._lock:
            if self._holders is None:
                self._holders = object_tree.tensor_holders(self._values, everywhere=True)
            alone = isinstance(value, object_tree.TENSORS) or id(value) in self._holders
            if not alone:
                try:
                    return safe_pickle.finalize(value, archive.where, read_tensor, self._memo)
                except BaseException:
                    self._memo.clear()  # (what a failed decode left half-built is not kept)
                    raise
        return safe_pickle.finalize(value, archive.where, read_tensor)


def _dotted(path: tuple[Key, ...]) -> str:
    return ".".join(str(k) for k in path)


def leaves_of(tree: FileTree, prefix: tuple[Key, ...] = ()) -> list[Leaf]:
    archive = tree.archive
    split = split_keys(tree.paths)
    keyed = split if split is not None else tree.paths
    decoder = _ValueDecoder(archive, tree.values)
    leaves: list[Leaf] = []
    # each view of a storage (a tied weight saved under two names) -> the first name it has
    first_name: dict[tuple[Any, ...], str] = {}
    for path, keys, value in zip(tree.paths, keyed, tree.values):
        keys = prefix + keys
        name = _dotted(prefix + path)
        if isinstance(value, TensorRef):
            leaf = _array_leaf(archive, value, keys, name, tree.shared.get(value.storage.key, []))
            view = (value.storage.key, value.dtype, value.storage_offset, value.size, value.stride, value.conj, value.neg)
            if leaf.extra.get("shares_storage_with"):
                # the same tensor as an earlier leaf: diff accepts a side that stores it once
                same = first_name.setdefault(view, name)
                if same != name:
                    leaf.extra["same_tensor_as"] = same
            leaves.append(leaf)
        elif isinstance(value, np.ndarray):
            leaves.append(memory_leaf(keys, name, value))
        elif isinstance(value, object_tree.Reference):
            first = _dotted(prefix + value.first)
            leaves.append(ValueLeaf(
                keys=keys, name=name, value_type="reference", loader=_constant(SameObject(first)),
                extra={"file": archive.name, "same_as": first},
            ))
        else:
            leaves.append(ValueLeaf(
                keys=keys, name=name, value_type=_value_type(value), dtype=_SCALAR_DTYPES.get(type(value)),
                loader=decoder.loader(value), extra={"file": archive.name},
            ))
    return leaves


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


def _value_loader(archive: Archive, value: Any) -> Callable[[], Any]:
    """A loader of one value of `archive` (decoded alone)."""
    return _ValueDecoder(archive, [value]).loader(value)


def _array_leaf(archive: Archive, ref: TensorRef, keys: tuple[Key, ...], name: str, on_storage: list[str]) -> ArrayLeaf:
    itemsize = dtypes.get(ref.dtype).itemsize
    extra: dict[str, Any] = {"file": archive.name, "storage": ref.storage.key}
    if ref.storage_offset:
        extra["storage_offset"] = ref.storage_offset
    if not _contiguous(ref.size, ref.stride):
        extra["stride"] = list(ref.stride)
    others = [n for n in on_storage if n != name]
    if others:
        extra["shares_storage_with"] = others[:8]
    if ref.conj or ref.neg:
        extra["view_bits"] = [b for b in ("conj", "neg") if getattr(ref, b)]
    reader = TensorReader(archive, ref, name)
    return ArrayLeaf(
        keys=keys, name=name, shape=tuple(ref.size), dtype=ref.dtype, layout=RegularGrid(tuple(ref.size)),
        reader=reader, verifier=reader.verify if ref.storage.nbytes else None, extra=extra,
        unreadable=archive.zip.claim_problem(ref),
    )


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n > 1 and s != expected:
            return False
        expected *= n
    return True


# ---------------------------------------------------------------------------
# A directory: which files, and how their trees combine
# ---------------------------------------------------------------------------
@dataclass
class Layout:
    files: list[str]  # the torch.save files read, in order
    index_file: str | None
    weight_map: dict[str, str] | None
    sharded: bool  # the files' trees are merged (an index, or -0000K-of-0000N shards)
    missing: list[str]  # files the index names that are not there
    ignored: list[str]  # other files beside them
    stray: list[str]  # torch files the index does not name


def read_index(storage: Storage, name: str) -> dict[str, str]:
    """weight_map of a transformers `pytorch_model.bin.index.json`."""
    from ..safetensors.reader import parse_json  # (the same strict JSON reading as safetensors' index)

    where = f"{storage.url}/{name}"
    size = storage.size(name)
    if size > MAX_INDEX_BYTES:
        raise CorruptMetadataError(f"{size} bytes, over the {MAX_INDEX_BYTES}-byte limit", where)
    try:
        doc = parse_json(storage.read(name), "index")
    except ValueError as exc:
        raise CorruptMetadataError(str(exc), where) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise CorruptMetadataError("no weight_map object", where)
    weight_map = doc["weight_map"]
    for k, v in weight_map.items():
        if not isinstance(v, str) or "/" in v or "\\" in v or v in ("", ".", ".."):
            raise CorruptMetadataError(f"weight_map[{k!r}] = {str(v)[:60]!r} is not a file beside it", where)
    return weight_map


def scan(storage: Storage) -> Layout:
    _, files = storage.listdir()
    indexes = sorted(f for f in files if f.endswith(INDEX_SUFFIX))
    top = set(files)
    if indexes:
        if len(indexes) > 1:
            raise CorruptMetadataError(
                f"{len(indexes)} index files ({', '.join(indexes)}): open a directory holding one set", storage.url,
            )
        weight_map = read_index(storage, indexes[0])
        named = sorted(set(weight_map.values()))
        present = [f for f in named if f in top]
        stray = sorted(f for f in files if f.endswith(SUFFIXES) and f not in set(named)
                       and SHARD_FILE.match(f))
        ignored = sorted(f for f in files if f not in set(named) and f != indexes[0] and f not in set(stray))
        return Layout(present, indexes[0], weight_map, True, [f for f in named if f not in top], ignored, stray)
    torch_files = sorted(f for f in files if f.endswith(SUFFIXES) and _is_torch_file(storage, f))
    ignored = sorted(f for f in files if f not in set(torch_files))
    shards = [f for f in torch_files if SHARD_FILE.match(f)]
    sharded = bool(shards) and len(shards) == len(torch_files)
    missing: list[str] = []
    if sharded:
        m = SHARD_FILE.match(shards[0])
        assert m is not None
        stem, n = m.group("stem"), int(m.group("n"))
        missing = [f"{stem}-{k:05d}-of-{n:05d}.bin" for k in range(1, n + 1)
                   if f"{stem}-{k:05d}-of-{n:05d}.bin" not in top]
    return Layout(torch_files, None, None, sharded, missing, ignored, [])


def _stem(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def read(storage: Storage, *, step: str | int | None = None) -> Checkpoint:
    """A directory of torch.save files (see the module docstring); no tensor data is read."""
    if step not in (None, "latest"):
        raise UsageError(f"--step {step} given, but a directory of torch.save files has no steps", storage.url)
    layout = scan(storage)
    if not layout.files and not layout.missing:
        raise CorruptMetadataError("no torch.save files here", storage.url)
    archives = [Archive(storage, name) for name in layout.files]
    trees = [file_tree(a) for a in archives]
    notes: list[str] = []
    leaves: list[Leaf] = []
    if layout.sharded or len(trees) == 1:
        for tree in trees:
            leaves.extend(leaves_of(tree))
        leaves = _merged(leaves, storage, layout, notes)
    else:
        stems = [_stem(t.archive.name) for t in trees]
        for tree, stem in zip(trees, stems):
            key = stem if stems.count(stem) == 1 else tree.archive.name
            leaves.extend(leaves_of(tree, (key,)))
        notes.append(f"{len(trees)} torch.save files, each a subtree by its name: {', '.join(layout.files[:6])}"
                     + (" ..." if len(layout.files) > 6 else ""))
    missing = [MissingData(name, f"does not exist (named in {layout.index_file})" if layout.index_file
                           else "does not exist (the other shards of its set are here)",
                           [t for t, f in (layout.weight_map or {}).items() if f == name])
               for name in layout.missing]
    notes.extend(_notes(trees, layout))
    return Checkpoint(
        path=storage.url, format=NAME,
        layout={"files": len(layout.files), "index": layout.index_file, "sharded": layout.sharded,
                "ignored": layout.ignored},
        leaves=leaves, committed=True, saved_at=None, notes=notes, missing=missing,
    )


def _merged(leaves: list[Leaf], storage: Storage, layout: Layout, notes: list[str]) -> list[Leaf]:
    """A sharded set's leaves: one per name (a name in two files is an error), checked against the index."""
    by_name: dict[str, Leaf] = {}
    for leaf in leaves:
        if leaf.name in by_name:
            first, second = by_name[leaf.name].extra.get("file"), leaf.extra.get("file")
            raise CorruptMetadataError(f"{leaf.name!r} is stored in both {first} and {second}", storage.url)
        by_name[leaf.name] = leaf
    if layout.weight_map is None:
        return leaves
    out = []
    for leaf in leaves:
        want = layout.weight_map.get(leaf.name)
        if want is None:
            notes.append(f"{leaf.name}: stored in {leaf.extra.get('file')} but not in {layout.index_file}")
        elif want != leaf.extra.get("file"):
            raise CorruptMetadataError(
                f"{layout.index_file} places {leaf.name!r} in {want}, but it is stored in {leaf.extra.get('file')}",
                storage.url,
            )
        out.append(leaf)
    present = set(layout.files)
    for tname, fname in layout.weight_map.items():
        if fname in present and tname not in by_name:
            notes.append(f"{tname}: {layout.index_file} places it in {fname}, which does not hold it")
    return out


def _notes(trees: list[FileTree], layout: Layout) -> list[str]:
    notes: list[str] = []
    for tree in trees:
        notes.extend(repeating_view_notes(tree.paths, tree.values))
        for names in tree.shared.values():
            if len(set(names)) > 1:
                shown = sorted(set(names))
                notes.append(f"one storage, {len(shown)} tensors ({tree.archive.name}): " + ", ".join(shown[:4])
                             + (" ..." if len(shown) > 4 else ""))
        refs = [(_dotted(path), _dotted(value.first) or "the top-level object")
                 for path, value in zip(tree.paths, tree.values) if isinstance(value, object_tree.Reference)]
        if refs:
            notes.append(f"{len(refs)} path{'s' if len(refs) != 1 else ''} to an object shown at another ({tree.archive.name}; "
                         "torch.load gives one object at both): " + ", ".join(f"{a} is {b}" for a, b in refs[:4])
                         + (" ..." if len(refs) > 4 else ""))
    if layout.stray:
        notes.append(f"not in {layout.index_file} (not read): {', '.join(layout.stray[:5])}"
                     + (" ..." if len(layout.stray) > 5 else ""))
    if layout.ignored:
        notes.append(f"other files (ignored): {', '.join(layout.ignored[:8])}" + (" ..." if len(layout.ignored) > 8 else ""))
    return notes


def read_file(storage: Storage, name: str) -> Checkpoint:
    """One torch.save file `name` inside `storage`."""
    if not storage.exists(name):
        raise NotFoundError("no such file", f"{storage.url}/{name}")
    archive = Archive(storage, name)
    tree = file_tree(archive)
    layout = Layout([name], None, None, False, [], [], [])
    return Checkpoint(
        path=f"{storage.url}/{name}", format=NAME,
        layout={"files": 1, "file": name, "index": None, "sharded": False, "ignored": []},
        leaves=leaves_of(tree), committed=True, saved_at=None, notes=_notes([tree], layout),
    )


def layout_text(ck: Checkpoint) -> str:
    """inspect's "format" row: "torch.save (3 files, pytorch_model.bin.index.json)"."""
    lay = ck.layout
    if lay.get("file"):
        return f"torch.save ({lay['file']})"
    what = f"{lay.get('files', 0)} file{'s' if lay.get('files') != 1 else ''}"
    return f"torch.save ({what}" + (f", {lay['index']})" if lay.get("index") else ")")

