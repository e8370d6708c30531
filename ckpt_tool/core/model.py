"""The format-neutral checkpoint model.

Readers fill it; commands and the Python API see only it. A Checkpoint is a
list of leaves, each addressed by `keys` (its path in the saved tree: dict
keys as str, sequence indices as int). An ArrayLeaf knows its shape, dtype,
stored chunk layout and recorded sharding before any data is read, and reads
any region on request through the reader's callback. A ValueLeaf holds a
scalar, string or other non-tensor item, decoded only when asked.
"""
from __future__ import annotations

import functools
import itertools
import math
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, Union, cast

from ..base import dtypes
from . import values
from ..base.errors import CkptError, UsageError
from .filters import Glob, glob_to_regex  # noqa: F401 - glob_to_regex: re-exported for callers of model
from ..base.names import join_keys, key_text

if TYPE_CHECKING:
    import numpy as np

    from ..storage import Storage
# (numpy is imported by what reads arrays: the model of a checkpoint read from its metadata needs
# none, and `ckpt inspect` of a DCP loads none, issue 46)


def _integer_types() -> tuple[type, ...]:
    """int, and numpy's integers where numpy is loaded (where it is not, no numpy integer exists)."""
    np_ = sys.modules.get("numpy")
    return (int, np_.integer) if np_ is not None else (int,)

Key = Union[str, int]
Region = tuple[slice, ...]


class _computed_once:
    """functools.cached_property without the lock Python < 3.12 takes on each
    first access (a third of summarising 3,000 leaves). Two threads racing
    on a first access both compute the same value, which is harmless here."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self._fn = fn
        self._name = fn.__name__
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self._name] = self._fn(obj)
        return value


@dataclass(frozen=True, slots=True)
class RegularGrid:
    """Chunks of one shape tiling the array (zarr); edge chunks may be cut."""

    chunk_shape: tuple[int, ...]

    def count(self, shape: Sequence[int]) -> int:
        return math.prod(-(-s // c) if c else 0 for s, c in zip(shape, self.chunk_shape)) if shape else 1

    def to_json(self) -> dict[str, Any]:
        return {"kind": "grid", "chunk_shape": list(self.chunk_shape)}


@dataclass(frozen=True, slots=True)  # (one per stored chunk, 10^5 of them: no per-instance __dict__)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def region(self) -> Region:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


@dataclass(frozen=True)
class ChunkList:
    """Explicit chunks with offsets and sizes (torch DCP shards)."""

    chunks: tuple[Chunk, ...]

    def count(self, shape: Sequence[int]) -> int:
        return len(self.chunks)

    @_computed_once
    def chunk_shape(self) -> tuple[int, ...] | None:
        """The common chunk shape when every chunk has the same sizes."""
        sizes = {c.sizes for c in self.chunks}
        return next(iter(sizes)) if len(sizes) == 1 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "list",
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in self.chunks],
        }


ChunkLayout = Union[RegularGrid, ChunkList]


def split_to_cap(chunk: Chunk, itemsize: int, cap_bytes: int) -> list[Chunk]:
    """Split a chunk along its leading dimensions until each piece is at most cap_bytes."""
    nbytes = math.prod(chunk.sizes) * itemsize
    if nbytes <= cap_bytes or not chunk.sizes:
        return [chunk]
    for dim, size in enumerate(chunk.sizes):
        if size > 1:
            row_bytes = nbytes // size
            step = max(1, cap_bytes // max(1, row_bytes))
            if step >= size:
                continue
            pieces = []
            for start in range(0, size, step):
                offsets = list(chunk.offsets)
                sizes = list(chunk.sizes)
                offsets[dim] += start
                sizes[dim] = min(step, size - start)
                pieces.extend(split_to_cap(Chunk(tuple(offsets), tuple(sizes)), itemsize, cap_bytes))
            return pieces
    return [chunk]


def grid_chunks(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> list[Chunk]:
    """A regular grid as a chunk list, in C order (the engine's chunk indices)."""
    shape, chunk_shape = tuple(shape), tuple(chunk_shape)
    count = math.prod(-(-s // c) if c else 0 for s, c in zip(shape, chunk_shape))
    # planning, the scheduler and the writers each ask for a leaf's chunks, and thousands
    # of leaves share a few shapes: small grids are made once (Chunk is frozen: sharing is safe)
    return list(_small_grid(shape, chunk_shape) if count <= 1024 else _grid(shape, chunk_shape))


@functools.lru_cache(maxsize=4096)
def _small_grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[Chunk, ...]:
    return _grid(shape, chunk_shape)


def _grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[Chunk, ...]:
    if not shape:
        return (Chunk((), ()),)
    ranges = [range(0, s, c) if c else range(0) for s, c in zip(shape, chunk_shape)]
    return tuple(
        Chunk(tuple(off), tuple(min(c, s - o) for o, c, s in zip(off, chunk_shape, shape)))
        for off in itertools.product(*ranges)
    )


def stored_chunks(shape: tuple[int, ...], layout: ChunkLayout) -> list[Chunk]:
    """The chunks a layout stores, as explicit offsets and sizes."""
    if isinstance(layout, ChunkList):
        return list(layout.chunks)
    return grid_chunks(shape, layout.chunk_shape)


def as_regular_grid(layout: ChunkLayout, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The grid a chunk list already forms (DCP shards of an evenly split tensor), if any."""
    if isinstance(layout, RegularGrid):
        return layout.chunk_shape
    chunks = [c for c in layout.chunks if all(s > 0 for s in c.sizes)]
    if not chunks or not shape:
        return None
    grid = tuple(max(c.sizes[d] for c in chunks) for d in range(len(shape)))
    for c in chunks:
        for d, (o, s) in enumerate(zip(c.offsets, c.sizes)):
            if o % grid[d] or s != min(grid[d], shape[d] - o):
                return None
    return grid


def default_grid(shape: tuple[int, ...], itemsize: int, cap_bytes: int) -> tuple[int, ...]:
    """A chunk shape for an array with no usable layout: whole rows up to the cap."""
    if not shape:
        return ()
    chunk = list(shape)
    for d in range(len(shape)):
        rest = math.prod(chunk[d + 1 :]) * itemsize
        if math.prod(chunk) * itemsize <= cap_bytes:
            break
        chunk[d] = max(1, min(shape[d], cap_bytes // max(1, rest)))
    return tuple(max(1, c) for c in chunk)


@dataclass(frozen=True)
class Sharding:
    """How the array was laid out over devices when it was saved.

    kind: "named" (a jax NamedSharding: mesh shape, axis names, partition
    spec, device ids), "single_device", or "chunks" (DCP: the saved chunk
    list is all the layout there is).
    """

    kind: str
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    partition_spec: tuple[Any, ...] | None = None
    device_ids: tuple[int, ...] | None = None
    device: str | None = None
    chunks: int | None = None

    def describe(self) -> str:
        if self.kind == "named":
            mesh = ",".join(f"{a}={s}" for a, s in zip(self.axis_names or (), self.mesh_shape or ()))
            spec = ", ".join(_spec_entry(p) for p in (self.partition_spec or ()))
            return f"mesh({mesh}) P({spec})"
        if self.kind == "single_device":
            return f"device {self.device}" if self.device else "single device"
        if self.kind == "chunks":
            return f"{self.chunks} chunk{'s' if self.chunks != 1 else ''}"
        return self.kind

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for name in ("mesh_shape", "axis_names", "partition_spec", "device_ids"):
            value = getattr(self, name)
            if value is not None:
                out[name] = [list(v) if isinstance(v, tuple) else v for v in value]
        if self.device is not None:
            out["device"] = self.device
        if self.chunks is not None:
            out["chunks"] = self.chunks
        return out


def _spec_entry(p: Any) -> str:
    if p is None:
        return "None"
    if isinstance(p, (list, tuple)):
        return "(" + ", ".join(str(x) for x in p) + ")"
    return str(p)


def keys_path(keys: Sequence[Key]) -> str:
    """The key path as one string, as --filter, --rename and every listing spell it: the keys
    joined by '/', each with base/names.py's one reversible escape (a key `a/b` is `a%2Fb`)."""
    return join_keys(tuple(keys))


def normalize_region(index: Any, shape: Sequence[int]) -> Region:
    """Turn an index expression (ints, slices, Ellipsis) into a region of slices."""
    if index is None or index is Ellipsis:
        return tuple(slice(0, s) for s in shape)
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        pos = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:pos] + (slice(None),) * fill + index[pos + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"too many indices: {len(index)} for an array of rank {len(shape)}")
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    region = []
    integers = _integer_types()
    for i, s in zip(index, shape):
        if isinstance(i, integers):
            n = int(cast(int, i))  # (an int, or a numpy integer)
            j = n + s if n < 0 else n
            if not 0 <= j < s:
                raise IndexError(f"index {i} out of bounds for size {s}")
            region.append(slice(j, j + 1))
        elif isinstance(i, slice):
            start, stop, step = i.indices(s)
            if step != 1:
                raise IndexError("strided regions are not supported; slice the result instead")
            region.append(slice(start, max(start, stop)))
        else:
            raise IndexError(f"unsupported index {i!r}")
    return tuple(region)


# what ArrayLeaf.reader holds: a format's ArrayReader (core/contract.py, with the hooks the
# scheduler uses) or a plain function of the region (contract.array_reader gives it the defaults)
RegionReader = Callable[[Region], "np.ndarray"]


# 10^4-10^5 leaves in a checkpoint: slotted (no per-instance __dict__: ~0.8 KiB a leaf less)
@dataclass(slots=True)
class ArrayLeaf:
    keys: tuple[Key, ...]
    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: ChunkLayout
    sharding: Sharding | None = None
    reader: RegionReader | None = field(default=None, repr=False, compare=False)
    # checks stored chunk i's integrity without decoding it (a checksum over
    # its bytes), where the format has one that a region read cannot check
    verifier: Callable[[int], None] | None = field(default=None, repr=False, compare=False)
    # format-specific facts worth showing (e.g. Orbax value_type, zarr codecs)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # why the stored bytes cannot hold what the metadata claims (a 16-byte
    # entry claiming 8 TB), found when the metadata was read: inspect still
    # shows the leaf; every command that would size work by the claim
    # (convert, reshard) refuses it first
    unreadable: str | None = field(default=None, compare=False)
    # size, nbytes and chunk_count are asked for several times per leaf by
    # every summary; a leaf's shape, dtype and layout never change once read:
    # each is computed on first use and kept here
    _size: int | None = field(default=None, init=False, repr=False, compare=False)
    _nbytes: int | None = field(default=None, init=False, repr=False, compare=False)
    _chunk_count: int | None = field(default=None, init=False, repr=False, compare=False)

    kind = "array"

    @property
    def path(self) -> str:
        return keys_path(self.keys)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        value = self._size
        if value is None:
            value = self._size = math.prod(self.shape)
        return value

    @property
    def nbytes(self) -> int:
        value = self._nbytes
        if value is None:
            value = self._nbytes = self.size * dtypes.get(self.dtype).itemsize
        return value

    @property
    def chunk_shape(self) -> tuple[int, ...] | None:
        if isinstance(self.layout, RegularGrid):
            return self.layout.chunk_shape
        return self.layout.chunk_shape

    @property
    def chunk_count(self) -> int:
        value = self._chunk_count
        if value is None:
            value = self._chunk_count = self.layout.count(self.shape)
        return value

    def read(self, region: Any = None) -> np.ndarray:
        """Read a region (tuple of slices, or None for all) into numpy."""
        if self.reader is None:
            raise CkptError("this leaf has no data reader", self.name)
        reg = normalize_region(region, self.shape)
        out = self.reader(reg)
        want = tuple(r.stop - r.start for r in reg)
        if tuple(out.shape) != want:
            raise CkptError(f"reader returned shape {tuple(out.shape)}, expected {want}", self.name)
        return out

    def __getitem__(self, index: Any) -> np.ndarray:
        reg = normalize_region(index, self.shape)
        out = self.read(reg)
        # integer indices drop their dimension, as numpy does
        idx = index if isinstance(index, tuple) else (index,)
        integers = _integer_types()
        drop = tuple(i for i, x in enumerate(idx) if isinstance(x, integers))
        return out.reshape([n for i, n in enumerate(out.shape) if i not in drop]) if drop else out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.read()
        return arr.astype(dtype) if dtype is not None else arr

    def __repr__(self) -> str:
        return f"ArrayLeaf({self.path!r}, {self.dtype}{list(self.shape)})"


@dataclass(slots=True)
class ValueLeaf:
    """A scalar, string or other non-tensor item; `load()` decodes it."""

    keys: tuple[Key, ...]
    name: str
    value_type: str  # "scalar", "string", "bytes" (DCP non-tensor item), ...
    dtype: str | None = None
    loader: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    kind = "value"
    shape: tuple[int, ...] = ()

    @property
    def path(self) -> str:
        return keys_path(self.keys)

    @property
    def nbytes(self) -> int:
        return dtypes.get(self.dtype).itemsize if self.dtype and self.dtype in dtypes.BY_NAME else 0

    def load(self) -> Any:
        if self.loader is None:
            raise CkptError("this value has no loader", self.name)
        return self.loader()

    def __repr__(self) -> str:
        return f"ValueLeaf({self.path!r}, {self.value_type})"


def constant_loader(value: Any) -> Callable[[], Any]:
    """A ValueLeaf loader of a value already decoded (a closure over it: each call site's own value)."""
    return lambda: value


Leaf = Union[ArrayLeaf, ValueLeaf]


@dataclass
class StepInfo:
    """One step of a CheckpointManager root (or an incomplete save beside them)."""

    name: str
    step: int | None
    committed: bool
    reason: str | None = None  # why it is not committed

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "committed": self.committed, "reason": self.reason}


@dataclass
class MissingData:
    """A data file the metadata names that is not there whole, and the leaves stored in it."""

    file: str  # relative to the checkpoint
    reason: str  # "does not exist", "N of M bytes", "cannot read: Permission denied"
    leaves: list[str] = field(default_factory=list)  # names of the leaves (or pieces) it holds
    unreadable: bool = False  # there, and long enough, but it cannot be opened for reading

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "reason": self.reason, "leaves": list(self.leaves), "unreadable": self.unreadable}


@dataclass
class Checkpoint:
    """A checkpoint as ckpt sees it, whatever the format."""

    path: str
    format: str  # the reader's format name (formats.REGISTRY) or one of its families
    layout: dict[str, Any]
    leaves: list[Leaf]
    committed: bool = True
    saved_at: float | None = None  # unix seconds
    steps: list[StepInfo] = field(default_factory=list)  # CheckpointManager roots
    step: int | None = None
    notes: list[str] = field(default_factory=list)  # facts worth a line (e.g. "unmerged OCDBT")
    # stored data the metadata names that is absent or cut short (a shard of a
    # partial download, a rank's data file): the checkpoint is incomplete,
    # whatever its commit record says; readers fill this from a stat per file
    missing: list[MissingData] = field(default_factory=list)
    # how it was opened, so that validate's checks of it in the same run (convert's, reshard's and
    # diff's preflight: validate.validate_opened) do not read its metadata again: the Storage its
    # reader read through (formats.open_checkpoint sets it; its listing is taken), and what the
    # reader parsed of its metadata files, keyed as the format chooses (the file's URL), for that
    # format's own checks (ChecksModule.check_opened, which take out what they use) and hooks only:
    # nothing above formats/ looks inside. A reader records only what parsed cleanly, as its checks
    # would parse it; open_checkpoint keeps the records only where the caller validates next
    # (keep_parsed), so that an inspect or a library open holds no more than the leaves.
    storage: Storage | None = field(default=None, repr=False, compare=False)
    parsed: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def status(self) -> str:
        """One of "committed", "uncommitted" (no commit record) and "incomplete" (committed, data missing)."""
        if not self.committed:
            return "uncommitted"
        return "incomplete" if self.missing else "committed"

    def __iter__(self) -> Iterator[Leaf]:
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)

    def __getitem__(self, path: str | Sequence[Key]) -> Leaf:
        """The leaf of a key tuple, of a joined key path (names.join_keys), or of its format's own name."""
        if not isinstance(path, str):
            want = key_text(tuple(path))
            for leaf in self.leaves:
                if key_text(leaf.keys) == want:
                    return leaf
            raise KeyError(keys_path(path))
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        for leaf in self.leaves:  # (after every path: a name never shadows another leaf's path)
            if leaf.name == path:
                return leaf
        raise KeyError(path)

    def arrays(self) -> list[ArrayLeaf]:
        return [leaf for leaf in self.leaves if isinstance(leaf, ArrayLeaf)]

    def tree(self) -> dict[Key, Any]:
        """Nested dicts of leaves, by keys."""
        root: dict[Key, Any] = {}
        for leaf in self.leaves:
            node = root
            for k in leaf.keys[:-1]:
                node = node.setdefault(k, {})
            node[leaf.keys[-1] if leaf.keys else ""] = leaf
        return root

    def filtered(self, pattern: str | None) -> list[Leaf]:
        """The leaves a --filter glob matches by '/'-joined keys or dotted name
        (ckpt_tool/core/filters.py); all of them without a pattern, [] when none match."""
        if not pattern:
            return list(self.leaves)
        glob = Glob(pattern)
        return [leaf for leaf in self.leaves if glob.matches_leaf(leaf)]

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, format={self.format!r}, leaves={len(self.leaves)})"


def parse_rename_rules(rules: Sequence[str]) -> list[tuple[re.Pattern[str], str]]:
    """--rename 'REGEX=REPL' rules, applied in order to joined key paths (keys_path)."""
    out = []
    for rule in rules:
        if "=" not in rule:
            raise UsageError(f"--rename needs REGEX=REPL, got {rule!r}")
        pattern, repl = rule.split("=", 1)
        try:
            out.append((re.compile(pattern), repl))
        except re.error as exc:
            raise UsageError(f"--rename: bad regex {pattern!r}: {exc}") from None
    return out


def flatten_value(
    keys: tuple[Key, ...], value: Any, tuples: set[tuple[Key, ...]] | None = None
) -> Iterator[tuple[tuple[Key, ...], Any]]:
    """Non-empty lists/tuples/dicts (str keys) become subtrees; anything else is one leaf.

    The paths of the non-empty tuples go into `tuples` (pytree nodes orbax
    records as tuples, where DCP keeps one bytes item). A decoded pickle may
    share a list at many places or hold itself: values.SharedValueError (a
    CkptError) when it has no tree form within values.MAX_UNFOLDED objects.
    """
    values.check_tree(value, join_keys(keys) or None)
    return _flatten(keys, value, tuples)


def _flatten(
    keys: tuple[Key, ...], value: Any, tuples: set[tuple[Key, ...]] | None
) -> Iterator[tuple[tuple[Key, ...], Any]]:
    if isinstance(value, (list, tuple)) and value:
        if isinstance(value, tuple) and tuples is not None:
            tuples.add(keys)
        for i, v in enumerate(value):
            yield from _flatten(keys + (i,), v, tuples)
    elif isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        for k, v in value.items():
            yield from _flatten(keys + (k,), v, tuples)
    else:
        yield keys, value


def memory_leaf(keys: tuple[Key, ...], name: str, arr: np.ndarray) -> ArrayLeaf:
    """An array held by a non-tensor item (a tensor inside a DCP bytes item), as a leaf of its own."""
    import numpy as np

    arr = np.require(arr, requirements="C")  # (ascontiguousarray would make a 0-d array 1-d)
    return ArrayLeaf(
        keys=keys, name=name, shape=tuple(arr.shape), dtype=dtypes.from_numpy(arr.dtype).name,
        layout=RegularGrid(tuple(arr.shape)),
        reader=lambda region: np.asarray(arr[tuple(region)]),
        # a host tensor, on no mesh: reshard keeps such leaves host arrays
        extra={"value_type": "np.ndarray"},
    )
