"""One torch.save file as ckpt's leaves: the archive opened (zip directory, `data.pkl`
unpickled through the allow-list: nothing in the file runs), its object walked into a tree, and
each tensor an ArrayLeaf reading the byte span of its view (storage offset and strides applied).

Shared machinery: the torch.save format reads its files here, and so do DeepSpeed (its
model-states and optimizer-states files) and Megatron (common.pt, legacy rank files); nothing
here names a format. How an object becomes leaves:

  * a dict is a subtree (str and int keys; a dotted str key is split at its
    dots, so that `pytorch_model.bin`'s "model.layers.0.mlp.up_proj.weight"
    has the same key path as the same tensor in `model.safetensors`; a file
    whose keys would collide once split keeps them whole);
  * a list or tuple holding a tensor is a subtree by index; one holding none
    is one value (as DCP keeps it: one non-tensor item);
  * a tensor is an ArrayLeaf whose reader reads the byte span of its view:
    views of one storage, tied weights (two keys on one tensor) and
    transposed tensors all read right, and a region reads only the bytes it needs;
  * anything else (numbers, strings, None, empty containers) is a ValueLeaf.

A tensor's claim on its storage is checked against the zip's central directory before anything
is read; its data offset (behind the member's local header) is found on its first read. The
pre-1.6 format (a bare pickle stream) is refused by name (LegacyFormatError): its tensors are
not addressable by byte range.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ...base import dtypes
from ...base.checksum import crc32
from ...base.errors import CkptError, CorruptMetadataError
from ...core.contract import ArrayReader
from ...core.model import ArrayLeaf, Key, Leaf, Region, RegularGrid, ValueLeaf, constant_loader, memory_leaf
from ...base.names import key_text
from ...storage import Storage
from ...core.values import SameObject
from . import object_tree
from . import payload as tp
from .safe_pickle import TensorRef

ZIP_MAGIC = b"PK\x03\x04"

# torch.save's pre-1.6 format: a pickle (protocol 2) of this magic number first
LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


class LegacyFormatError(CorruptMetadataError):
    """A torch.save file in the pre-1.6 pickle format (not a zip)."""

    def __init__(self, where: str) -> None:
        super().__init__(
            "a torch.save file in the legacy format (a pickle stream, written by torch < 1.6 or with "
            "_use_new_zipfile_serialization=False): ckpt reads the zip format only; re-save it with a "
            "current torch (torch.save(torch.load(f, weights_only=True), new_f))",
            where,
        )


def head_bytes(storage: Storage, name: str, n: int = 16) -> bytes:
    try:
        size = storage.size(name)
        return storage.read_range(name, 0, min(n, size)) if size else b""
    except CkptError:
        return b""


def is_torch_file(head: bytes) -> bool:
    """Whether a file's first bytes are a torch.save archive's (zip) or the legacy format's."""
    return head.startswith(ZIP_MAGIC) or head.startswith(LEGACY_MAGIC)


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
    notes: list[str] = []
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
        notes.append(f"{dotted(path)}: a view of {stored:,} stored bytes ({how}), "
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
    # compared as text (names.key_text): a list's `l/0` and a split `l.0` are one key path
    seen = {key_text(p) for p in out}
    if len(seen) != len(out):
        return None
    for path in out:
        text = key_text(path)
        for n in range(1, len(path)):
            if text[:n] in seen:
                return None
    return out


def value_type(value: Any) -> str:
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return "scalar"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (bytes, bytearray)):
        return "bytes"
    return "object"


SCALAR_DTYPES = {bool: "bool", int: "int64", float: "float64"}


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
            tree.shared.setdefault(value.storage.key, []).append(dotted(path))
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
        from . import safe_pickle

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


def dotted(path: tuple[Key, ...]) -> str:
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
        name = dotted(prefix + path)
        if isinstance(value, TensorRef):
            leaf = array_leaf(archive, value, keys, name, tree.shared.get(value.storage.key, []))
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
            first = dotted(prefix + value.first)
            leaves.append(ValueLeaf(
                keys=keys, name=name, value_type="reference", loader=constant_loader(SameObject(first)),
                extra={"file": archive.name, "same_as": first},
            ))
        else:
            leaves.append(ValueLeaf(
                keys=keys, name=name, value_type=value_type(value), dtype=SCALAR_DTYPES.get(type(value)),
                loader=decoder.loader(value), extra={"file": archive.name},
            ))
    return leaves


def value_loader(archive: Archive, value: Any) -> Callable[[], Any]:
    """A loader of one value of `archive` (decoded alone)."""
    return _ValueDecoder(archive, [value]).loader(value)


def array_leaf(archive: Archive, ref: TensorRef, keys: tuple[Key, ...], name: str, on_storage: list[str]) -> ArrayLeaf:
    itemsize = dtypes.get(ref.dtype).itemsize
    extra: dict[str, Any] = {"file": archive.name, "storage": ref.storage.key}
    if ref.storage_offset:
        extra["storage_offset"] = ref.storage_offset
    if not contiguous(ref.size, ref.stride):
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


def contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n > 1 and s != expected:
            return False
        expected *= n
    return True
