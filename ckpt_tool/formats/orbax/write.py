"""Writes an Orbax checkpoint step the way orbax-checkpoint 0.12 does, without jax or orbax.

The output is what `StandardCheckpointer().save()` / `PyTreeCheckpointHandler`
leave on disk (OCDBT, zarr v2 by default or zarr v3), so orbax restores it
with or without target shardings:

    ocdbt.process_<i>/manifest.ocdbt + d/   each process's own OCDBT database
    manifest.ocdbt + d/                     the merged root database (commit)
    array_metadatas/process_<i>             write/chunk shapes of jax.Array leaves
    _METADATA                               the tree: key paths and value types
    _sharding                               NamedSharding of each jax.Array leaf
    _strings.json                           string leaves
    _CHECKPOINT_METADATA                    handler, timestamps
    commit_success.txt                      written last

Every process writes its chunks into its own database (orbax's "per-process
OCDBT"); the primary also writes every array's zarr metadata there, and at
commit merges all per-process B-trees into the root one, which keeps
referencing the per-process data files. ckpt encodes the chunks and writes
each process's database itself, on a local root and on gs:// / s3:// (direct.py;
there each data file is uploaded whole through Storage.write), and the root one:
with one process one node over the process's tree, with several a new B+tree
over every process's keys (the others' read back from storage), its values
where they lie in the process databases, as orbax's `merge_ocdbt_per_process_files`
(tensorstore's `experimental_copy_range_to`) leaves them. tensorstore writes
everything, that merge included, when CKPT_OCDBT_WRITER=tensorstore (zarr
arrays over its OCDBT driver) and on memory://.
"""
from __future__ import annotations

import base64
import functools
import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ...base import dtypes
from ...base.errors import CkptError, IncompleteCheckpointError, UnsupportedLeafError, a_type
from ...core.values import SharedValueError
from ...core.model import ChunkList, Key, Region, RegularGrid, Sharding, as_regular_grid, default_grid, flatten_value
from ...base.names import join_keys
from ...base.pagecache import DirectoryDropper
from ...storage import Storage, local_path, ts_error_text
from ...core.contract import CheckpointWriter
from ...core.write_plan import PlanContext, TargetArray, TargetValue, WritePlan
from ...machinery.arrays import stored_chunks
from . import direct, zarr_metadata
from . import reader as ob

if TYPE_CHECKING:
    import tensorstore as ts

# the class paths orbax records in _CHECKPOINT_METADATA["item_handlers"]
STANDARD_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
PYTREE_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"

ARRAY_METADATAS = "array_metadatas"
PROCESS_DB = "ocdbt.process_{}"

# orbax's tensorstore_utils._add_ocdbt_write_options: .zarray inline in the
# B-tree, chunks in data files; one large root node; a single-file manifest
_OCDBT_CONFIG = {
    "max_inline_value_bytes": 1024,
    "max_decoded_node_bytes": 100_000_000,
    "manifest_kind": "single",
}
_TARGET_DATA_FILE_SIZE = 2**31  # orbax's default (2 GiB)
_GCS_TARGET_DATA_FILE_SIZE = 400 * 2**20  # orbax's value for gs://
# orbax's get_ts_context(use_ocdbt=True)
_CONTEXT_SPEC = {
    "file_io_concurrency": {"limit": 128},
    "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
}
# (zarr compression exactly as orbax asks for it, tensorstore's default levels: zarr_metadata.orbax_metadata)

# orbax's KeyType
_KEY_SEQUENCE = 1
_KEY_DICT = 2
# orbax's empty-value type strings (metadata/empty_values.py)
_EMPTY_TYPES = {type(None): "None", dict: "Dict", list: "List", tuple: "Tuple"}

# Writes are issued asynchronously so that tensorstore batches many of them
# into one OCDBT commit (one write per commit makes a data file and a new root
# node per chunk: ten times slower and thousands of tiny files). This bounds
# the bytes copied into tensorstore but not yet committed.
DEFAULT_MAX_PENDING_BYTES = 64 * 2**20  # with the engine's in-flight chunks, keeps a convert under ~512 MiB


def pending_window(memory: int) -> int:
    """The write-behind window under a --memory budget: 64 MiB from 512 MiB up, an eighth below."""
    return max(4 * 2**20, min(DEFAULT_MAX_PENDING_BYTES, memory // 8))


class UnsupportedValueError(UnsupportedLeafError):
    """A leaf Orbax cannot hold (e.g. a non-empty list or a bytes object)."""


@dataclass
class _Leaf:
    """One entry of the saved tree, as orbax will describe it."""

    keys: tuple[Key, ...]
    name: str
    value_type: str  # "jax.Array" | "np.ndarray" | "scalar" | "string" | "None" | "Dict" | ...
    shape: tuple[int, ...] = ()
    dtype: str | None = None  # canonical dtype for zarr-stored leaves
    chunk_shape: tuple[int, ...] = ()
    sharding: str | None = None  # the serialized _sharding entry (jax.Array leaves)

    @property
    def stored(self) -> bool:
        """Kept as a zarr array in OCDBT (arrays and scalars)."""
        return self.dtype is not None

    @property
    def skip_deserialize(self) -> bool:
        return self.value_type in _EMPTY_TYPES.values()


def unsupported_reason(target: TargetArray | TargetValue, *, zarr3: bool = False) -> str | None:
    """Why the Orbax writer cannot hold `target`, or None when it can.

    Lets the engine drop such leaves up front under --skip-unsupported.
    """
    try:
        if isinstance(target, TargetArray):
            _array_leaf(target, zarr3)
        else:
            _value_leaf(target, zarr3)
    except UnsupportedValueError as exc:
        return exc.message
    return None


def _check_dtype(name: str, zarr3: bool, where: str) -> dtypes.DType:
    try:
        dt = dtypes.get(name)
    except CkptError:
        raise UnsupportedValueError(f"dtype {name!r} has no zarr encoding", where) from None
    if zarr3 and dt.zarr3 is None:
        raise UnsupportedValueError(f"dtype {name} has no zarr v3 data_type (write zarr v2 instead)", where)
    return dt


def _array_leaf(target: TargetArray, zarr3: bool) -> _Leaf:
    where = target.path or target.name
    _check_dtype(target.dtype, zarr3, where)
    if not isinstance(target.layout, RegularGrid):
        raise CkptError("Orbax output needs a regular chunk grid (RegularGrid layout)", where)
    shape = tuple(int(s) for s in target.shape)
    chunks = tuple(int(c) for c in target.layout.chunk_shape)
    if len(chunks) != len(shape):
        raise CkptError(f"chunk shape {list(chunks)} does not match shape {list(shape)}", where)
    if any(c < 0 for c in chunks) or any(c == 0 and s > 0 for c, s in zip(chunks, shape)):
        raise CkptError(f"chunk shape {list(chunks)} has a zero size for a non-empty dimension", where)
    # zarr needs chunk sizes >= 1; a zero-length dimension has no chunks anyway
    chunks = tuple(max(1, c) for c in chunks)
    serialized = _serialize_sharding(target.sharding, len(shape), where)
    return _Leaf(
        keys=tuple(target.keys), name=target.name,
        # orbax restores a jax.Array only with a sharding: from the caller, or
        # else from _sharding; without one the leaf is a host numpy array
        value_type="jax.Array" if serialized is not None else "np.ndarray",
        shape=shape, dtype=target.dtype, chunk_shape=chunks, sharding=serialized,
    )


def _zarr_metadata(leaf: _Leaf, zarr3: bool) -> dict[str, Any]:
    """What orbax passes to tensorstore (tensorstore_utils._build_zarr{2,3}_metadata)."""
    return zarr_metadata.orbax_metadata(list(leaf.shape), list(leaf.chunk_shape), zarr3)


def _memory_spec(leaf: _Leaf, zarr3: bool) -> dict[str, Any]:
    """The array as the writer opens it, less its kvstore (direct.py makes it in memory)."""
    return {
        "driver": "zarr3" if zarr3 else "zarr",
        # every chunk is stored, even all-zero ones: a missing chunk then
        # always means lost data (orbax's STORE_ARRAY_DATA_EQUAL_TO_FILL_VALUE)
        "store_data_equal_to_fill_value": True,
        "dtype": leaf.dtype,
        "metadata": _zarr_metadata(leaf, zarr3),
    }


def stored_chunk_encoding(destination: str, target: TargetArray, zarr3: bool) -> stored_chunks.Encoding | None:
    """How a writer to `destination` would store `target`'s chunks (its layout's grid), where it
    writes the database itself and so takes source chunks as they are stored (write_stored);
    None elsewhere. From the metadata tensorstore makes, as the writer learns it in begin().

    Planning asks this (reshard): a source chunk of this encoding is then copied, however large,
    instead of being cut to fit --memory. Not on object stores: there a data file is uploaded
    from memory, so a chunk stays within what --memory plans."""
    if local_path(destination) is None or not direct.wanted_here():
        return None
    try:
        leaf = _array_leaf(target, zarr3)
        return direct.encoding_for(leaf.name, _memory_spec(leaf, zarr3), zarr3)
    except CkptError:
        return None


def _scalar_array(value: Any) -> np.ndarray | None:
    """The 0-d array orbax's ScalarHandler stores for a number (np.asarray(v)), else None."""
    if isinstance(value, (bool, int, float, complex, np.bool_, np.number)):
        try:
            arr = np.asarray(value)
        except OverflowError:
            return None
        return arr if arr.dtype.kind in "biufc" else None
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "biufc":
        return value
    return None


def _value_leaf(target: TargetValue, zarr3: bool) -> _Leaf:
    where = target.path or target.name
    value = target.value
    if isinstance(value, str):
        return _Leaf(tuple(target.keys), target.name, "string")
    arr = _scalar_array(value)
    if arr is not None:
        try:
            dt = dtypes.from_numpy(arr.dtype)
        except CkptError:
            raise UnsupportedValueError(f"a {arr.dtype} scalar has no zarr encoding", where) from None
        _check_dtype(dt.name, zarr3, where)
        return _Leaf(tuple(target.keys), target.name, "scalar", dtype=dt.name)
    empty = _EMPTY_TYPES.get(type(value))
    if empty is not None and not value:
        # orbax itself saves None and empty containers as metadata-only leaves
        return _Leaf(tuple(target.keys), target.name, empty)
    raise UnsupportedValueError(
        f"{a_type(value)} value has no Orbax leaf type (only arrays, numbers, strings, None and empty containers)",
        where,
    )


def _serialize_sharding(sharding: Sharding | None, rank: int, where: str) -> str | None:
    """The `_sharding` entry orbax writes (metadata/sharding.py), or None for a host array."""
    if sharding is None:
        return None
    if sharding.kind == "single_device" and sharding.device:
        return json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": sharding.device})
    if sharding.kind != "named":
        return None
    if not sharding.mesh_shape or not sharding.axis_names or len(sharding.mesh_shape) != len(sharding.axis_names):
        raise CkptError("named sharding needs a mesh shape and one axis name per mesh dimension", where)
    spec = list(sharding.partition_spec or ())
    if len(spec) > rank:
        raise CkptError(f"partition spec has {len(spec)} entries for a rank-{rank} array", where)
    data: dict[str, Any] = {
        "sharding_type": "NamedSharding",
        "shape": [int(s) for s in sharding.mesh_shape],
        "axis_names": [str(a) for a in sharding.axis_names],
        # jax's default; orbax records str(jax.sharding.AxisType.Auto)
        "axis_types": ["AxisType.Auto"] * len(sharding.axis_names),
        "partition_spec": [list(p) if isinstance(p, (tuple, list)) else p for p in spec],
    }
    if sharding.device_ids is not None:
        if len(sharding.device_ids) != math.prod(sharding.mesh_shape):
            raise CkptError(
                f"mesh {list(sharding.mesh_shape)} needs {math.prod(sharding.mesh_shape)} device ids, "
                f"got {len(sharding.device_ids)}", where
            )
        return json.dumps(data)[:-1] + ', "device_mesh": {"mesh": ' + \
            _device_mesh_text(tuple(sharding.device_ids), tuple(sharding.mesh_shape)) + "}}"
    return json.dumps(data)


@functools.lru_cache(maxsize=2)
def _device_mesh_text(ids: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """The text json.dumps gives the nested lists of {"id": i} over the mesh, spelled without a dict
    per device, once per mesh (every array of a reshard shares it): a mesh of a million devices took
    250 MB and a second per array as objects."""
    grid = np.asarray(ids, dtype=np.int64).reshape(shape)
    return _grid_text(grid)


def _grid_text(grid: np.ndarray) -> str:
    if grid.ndim > 1:
        return "[" + ", ".join(_grid_text(row) for row in grid) + "]"
    return '[{"id": ' + ", ".join(map(str, grid.tolist())).replace(", ", '}, {"id": ') + "}]"


def _check_tree(leaves: list[_Leaf]) -> None:
    """The key paths must form a tree orbax can rebuild from _METADATA.

    orbax rebuilds lists by appending index after index, so a list must hold
    exactly the indices 0..n-1; a node is either a dict or a list; and no
    leaf may also be a container of other leaves.
    """
    names: dict[str, tuple[Key, ...]] = {}
    children: dict[tuple[Key, ...], set[Key]] = {}
    leaf_paths = set()
    for leaf in leaves:
        where = join_keys(leaf.keys) or leaf.name
        if not leaf.keys:
            raise CkptError("a leaf without keys cannot be named in Orbax", leaf.name or "<root>")
        for k in leaf.keys:
            if isinstance(k, bool) or not isinstance(k, (int, str)):
                raise CkptError(f"key {k!r} is neither a dict key (str) nor a list index (int)", where)
            if isinstance(k, int) and k < 0:
                raise CkptError(f"negative list index {k}", where)
        if leaf.name in ("", ".", "..") or "/" in leaf.name:
            # the name is a directory inside OCDBT and a JSON pointer into _strings.json
            raise CkptError(f"Orbax parameter name {leaf.name!r} is not a single path component (orbax writes "
                            f"the name as a path; --rename can give the key another name)", where)
        if leaf.name in names:
            raise CkptError(f"two leaves have the Orbax name {leaf.name!r}", where)
        names[leaf.name] = leaf.keys
        leaf_paths.add(leaf.keys)
        for i in range(len(leaf.keys)):
            children.setdefault(leaf.keys[:i], set()).add(leaf.keys[i])
    for prefix, keys in children.items():
        where = join_keys(prefix) or "<root>"
        if prefix in leaf_paths:
            raise CkptError("is both a leaf and a container of other leaves", where)
        ints = [k for k in keys if isinstance(k, int)]
        if ints and len(ints) != len(keys):
            raise CkptError("mixes list indices and dict keys in one container", where)
        if ints and sorted(ints) != list(range(len(ints))):
            missing = sorted(set(range(max(ints) + 1)) - set(ints))
            raise CkptError(
                f"list has indices {sorted(ints)[:8]} but not {missing[:8]}: orbax restores only lists indexed 0..n-1",
                where,
            )


def _tree_order(keys: tuple[Key, ...]) -> tuple[tuple[int, Any], ...]:
    """jax's flatten order: dict keys sorted, list indices numerically."""
    return tuple((0, k) if isinstance(k, int) else (1, k) for k in keys)


class OrbaxWriter(CheckpointWriter):
    """A CheckpointWriter producing an Orbax step (OCDBT, zarr v2 or v3) in `storage`.

    Thread-safe for write_array / write_value; begin, finish_process, commit
    and abort are called from one thread.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        zarr3: bool = False,
        handler: str | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        target_data_file_size: int | None = None,
    ) -> None:
        """`handler`: "standard" or "pytree" for _CHECKPOINT_METADATA (default:
        StandardCheckpointHandler unless the tree holds strings, which only
        PyTreeCheckpointHandler saves)."""
        if handler not in (None, "standard", "pytree"):
            raise CkptError(f"unknown Orbax handler {handler!r} (use 'standard' or 'pytree')")
        self._storage = storage
        self._zarr3 = zarr3
        self._handler = handler
        self._max_pending = max(0, int(max_pending_bytes))
        # what uploads of data files may hold at once on an object store (written directly): one
        # window (a data file is then at most half of it: ocdbt_writer.py), 4 uploads of 16 MiB in
        # flight from --memory 512MiB up. Two windows (tensorstore's reserve) added 80-130 MiB of
        # peak RSS to a 1 GiB convert to gs:// and gained no time measurable here
        self._upload_bytes = self._max_pending
        # tensorstore's context, made where tensorstore writes (_ts_context): a local write that
        # ckpt makes itself imports no tensorstore (issue 46: ~80 ms on a TPU host)
        self._context: ts.Context | None = None
        self._context_lock = threading.Lock()
        base = storage.kvstore_spec()
        if target_data_file_size is None:
            target_data_file_size = _GCS_TARGET_DATA_FILE_SIZE if base.get("driver") == "gcs" else _TARGET_DATA_FILE_SIZE
        self._target_data_file_size = int(target_data_file_size)
        # the process's database is written by ckpt itself (direct.py), not tensorstore, on local
        # roots and on gs:// / s3:// (there each data file is uploaded through Storage.write)
        self._writes_directly = direct.wanted(storage)
        self._direct: direct.ProcessDatabase | None = None

        self._plan: WritePlan | None = None
        self._leaves: list[_Leaf] = []
        self._by_name: dict[str, _Leaf] = {}
        self._init_ns = 0
        self._lock = threading.Lock()
        self._stores: dict[str, ts.Future] = {}  # name -> future of the opened TensorStore
        self._pending: deque[tuple[ts.Future, int, str]] = deque()
        self._pending_bytes = 0
        self._cache_dropper: DirectoryDropper | None = None
        self._state = "new"  # new -> writing -> finished -> committed | aborted

    # -- specs -----------------------------------------------------------------

    @property
    def _primary(self) -> bool:
        return self._plan is not None and self._plan.process_index == 0

    def _ocdbt_spec(self, subdir: str, *, write: bool) -> dict[str, Any]:
        """The OCDBT kvstore spec orbax builds (tensorstore_utils._build_ocdbt_kvstore_tspec)."""
        base = self._storage.kvstore_spec(subdir + "/" if subdir else "")
        spec: dict[str, Any] = {"driver": "ocdbt", "base": base}
        if base.get("driver") == "file":
            # data files have unique names: no need for atomic rename; the
            # manifest keeps atomic writes so a crash never leaves half of one
            spec["base"] = {**base, "file_io_locking": {"mode": "non_atomic"}}
            spec["manifest"] = base
            if write and subdir:
                # A process's own database is fsynced once, whole, when the
                # process finishes (finish_process), not at every commit: the
                # output is not a checkpoint before its commit anyway, and
                # waiting for the disk after each commit left the CPUs idle
                # (2 GiB DCP -> Orbax: 2.8-3.2 s -> 2.5-2.8 s).
                spec["base"]["file_io_sync"] = False
                spec["manifest"] = {**base, "file_io_sync": False}
        if write:
            spec["target_data_file_size"] = self._target_data_file_size
            spec["config"] = dict(_OCDBT_CONFIG)
            # no initial empty manifest: nobody else writes this database
            spec["assume_config"] = True
        spec["cache_pool"] = "cache_pool#ocdbt"
        return spec

    def _zarr_metadata(self, leaf: _Leaf) -> dict[str, Any]:
        return _zarr_metadata(leaf, self._zarr3)

    def _memory_specs(self) -> dict[str, dict[str, Any]]:
        return {leaf.name: _memory_spec(leaf, self._zarr3) for leaf in self._leaves if leaf.stored}

    def _array_spec(self, leaf: _Leaf) -> dict[str, Any]:
        assert self._plan is not None
        kvstore = self._ocdbt_spec(PROCESS_DB.format(self._plan.process_index), write=True)
        kvstore["path"] = leaf.name + "/"
        return {**_memory_spec(leaf, self._zarr3), "kvstore": kvstore,
                "recheck_cached_data": False, "recheck_cached_metadata": False}

    def _ts_context(self) -> ts.Context:
        """The context tensorstore's opens share: a child of the storage's (memory:// stores stay
        shared), made at the first."""
        with self._context_lock:
            if self._context is None:
                import tensorstore as ts

                self._context = ts.Context(_CONTEXT_SPEC, parent=self._storage.context)
            return self._context

    def _store(self, leaf: _Leaf) -> ts.TensorStore:
        """The array's TensorStore, opened once per writer whatever the thread."""
        import tensorstore as ts

        context = self._ts_context()
        with self._lock:
            fut = self._stores.get(leaf.name)
            if fut is None:
                # only the primary writes .zarray / zarr.json (in begin); the
                # others assume it, as orbax does, and do no I/O to open
                fut = ts.open(self._array_spec(leaf), open=True, assume_metadata=True, context=context)
                self._stores[leaf.name] = fut
        # under the storage deadline: a remote store that stops answering must not hang the writer
        return self._storage.wait(fut, "cannot open the output array", leaf.name)

    # -- the protocol ------------------------------------------------------------

    @property
    def pending_bytes_limit(self) -> int:
        """Memory the writer holds besides the reader's (the engine's reserve): the
        window of decoded bytes copied into tensorstore, and their encoded copy
        while tensorstore commits them. Written directly to a local root, a chunk is
        on disk when write_array returns: nothing is held. Written directly to an
        object store, the uploads of sealed data files hold as much as this at most
        (their bytes and tensorstore's copy: staged_upload.py)."""
        if not self._writes_directly:
            return 2 * self._max_pending
        return 0 if self._storage.capabilities.local_files else self._upload_bytes

    def begin(self, plan: WritePlan) -> None:
        if self._state != "new":
            raise CkptError(f"begin() called on a writer that is already {self._state}")
        if not 0 <= plan.process_index < max(1, plan.process_count):
            raise CkptError(f"process index {plan.process_index} is outside 0..{plan.process_count - 1}")
        leaves = []
        for target in plan.targets:
            if isinstance(target, TargetArray):
                leaves.append(_array_leaf(target, self._zarr3))
            else:
                leaves.append(_value_leaf(target, self._zarr3))
        if not leaves:
            raise CkptError("nothing to write: the plan has no leaves", self._storage.url)
        _check_tree(leaves)
        leaves.sort(key=lambda leaf: _tree_order(leaf.keys))
        db = PROCESS_DB.format(plan.process_index)
        if self._storage.exists(f"{db}/{ob.ROOT_MANIFEST}"):
            raise CkptError(f"the output already holds {db}/{ob.ROOT_MANIFEST}; write into an empty directory", self._storage.url)
        self._plan = plan
        self._leaves = leaves
        self._by_name = {leaf.name: leaf for leaf in leaves}
        self._init_ns = time.time_ns()
        if self._writes_directly:
            self._direct = direct.ProcessDatabase(
                self._storage.child(db), zarr3=self._zarr3, ocdbt_config=_OCDBT_CONFIG,
                target_data_file_size=self._target_data_file_size, upload_bytes=self._upload_bytes)
        else:
            # OCDBT's data files ("d/"), which tensorstore writes, are written
            # back and leave the page cache as commits land (see base/pagecache.py)
            self._cache_dropper = self._storage.page_cache_dropper(f"{db}/d")
        self._state = "writing"
        if not self._primary:
            if self._direct is not None:  # the arrays' encodings, to compare with the source's (nothing is put)
                self._direct.add_metadata(self._memory_specs(), self._storage.url, put=False)
            return
        # like orbax: the step metadata first, without a commit timestamp, so
        # an interrupted write reads as an uncommitted save
        self._write_checkpoint_metadata(commit_ns=None)
        if self._direct is not None:
            self._direct.add_metadata(self._memory_specs(), self._storage.url)
            return
        # every zarr array's metadata, opened concurrently so that tensorstore
        # batches them into few OCDBT commits
        import tensorstore as ts

        context = self._ts_context()
        futures = {
            leaf.name: ts.open(self._array_spec(leaf), create=True, open=True, context=context)
            for leaf in leaves if leaf.stored
        }
        for name, fut in futures.items():
            self._storage.wait(fut, "cannot create the output array", name)
            self._stores[name] = fut

    def write_array(self, target: TargetArray, chunk_index: int, region: Region, data: np.ndarray) -> None:
        leaf = self._leaf_for(target.name, ("jax.Array", "np.ndarray"))
        region = tuple(region)
        stored = stored_chunks.recall(data)  # (before np.asarray, which drops what it knows)
        where = f"{target.path or leaf.name} chunk {chunk_index}"
        if len(region) != len(leaf.shape):
            raise CkptError(f"region of rank {len(region)} for a rank-{len(leaf.shape)} array", where)
        sizes = []
        for r, s in zip(region, leaf.shape):
            if r.step not in (None, 1) or not 0 <= r.start <= r.stop <= s:
                raise CkptError(f"region {_fmt_region(region)} is outside the array shape {list(leaf.shape)}", where)
            sizes.append(r.stop - r.start)
        data = np.asarray(data)
        if tuple(data.shape) != tuple(sizes):
            raise CkptError(f"data of shape {list(data.shape)} for region {_fmt_region(region)}", where)
        want = dtypes.numpy_dtype(leaf.dtype)
        if data.dtype != want:
            raise CkptError(f"data of dtype {data.dtype} for an array of dtype {leaf.dtype}", where)
        if data.size == 0:
            return
        if self._direct is not None:
            self._direct.write_region(leaf.name, leaf.chunk_shape, region, data, {}, stored=stored)
            return
        store = self._store(leaf)
        self._submit(store[region] if region else store, data, where)

    def stored_encoding(self, target: TargetArray) -> stored_chunks.Encoding | None:
        """How `target`'s chunks are stored, where ckpt writes the database itself (direct.py);
        None where tensorstore writes it (CKPT_OCDBT_WRITER=tensorstore, memory://)."""
        leaf = self._by_name.get(target.name)
        if self._direct is None or leaf is None or not leaf.stored:
            return None
        return self._direct.encoding(leaf.name)

    def write_stored(self, target: TargetArray, chunk_index: int, region: Region,
                     copy: Callable[[Callable[[bytes], None]], int]) -> None:
        leaf = self._leaf_for(target.name, ("jax.Array", "np.ndarray"))
        where = f"{target.path or leaf.name} chunk {chunk_index}"
        if self._direct is None or len(region) != len(leaf.chunk_shape):
            raise CkptError("a stored chunk given to a writer that does not take them", where)
        index = []
        for r, c, n in zip(region, leaf.chunk_shape, leaf.shape):
            if r.step not in (None, 1) or r.start % c or r.stop != min(r.start + c, n):
                raise CkptError(f"region {_fmt_region(tuple(region))} is not one whole chunk", where)
            index.append(r.start // c)
        self._direct.put_stored(leaf.name, tuple(index), copy)

    def write_value(self, target: TargetValue) -> None:
        leaf = self._by_name.get(target.name)
        if leaf is None:
            raise CkptError("value is not in the plan given to begin()", target.path or target.name)
        if leaf.value_type != "scalar":
            # strings and empty values live in _strings.json / _METADATA, which
            # the primary writes at commit from the plan
            return
        arr = _scalar_array(target.value)
        if arr is None or dtypes.from_numpy(arr.dtype).name != leaf.dtype:
            raise CkptError("value differs in type from the one in the plan", target.path or target.name)
        if self._direct is not None:
            self._direct.write_scalar(leaf.name, arr, target.path or target.name)
            return
        self._submit(self._store(leaf), arr, target.path or target.name)

    def finish_process(self) -> None:
        self._require("writing", "finish_process()")
        assert self._plan is not None
        self._drain(0)
        if self._cache_dropper is not None:
            self._cache_dropper.finish()
        if self._direct is not None:
            self._direct.finish()
        # written directly, every file was fsynced as it was closed (data files as they were sealed,
        # the tree's node file, the manifest): their directories remain. A second fsync of each of
        # the ~40 data files of a 2.3 GiB reshard ran one after another at the end of every run.
        self._storage.fsync_tree(PROCESS_DB.format(self._plan.process_index), files=self._direct is None)
        arrays = [leaf for leaf in self._leaves if leaf.value_type == "jax.Array"]
        if arrays:
            # every process lists every jax.Array (orbax checks they agree)
            doc = {ARRAY_METADATAS: [
                {"array_metadata": {
                    "param_name": leaf.name, "write_shape": list(leaf.chunk_shape),
                    "chunk_shape": list(leaf.chunk_shape), "ext_metadata": None,
                }}
                for leaf in arrays
            ]}
            self._storage.write(f"{ARRAY_METADATAS}/process_{self._plan.process_index}", json.dumps(doc).encode())
        with self._lock:
            self._stores.clear()
        self._state = "finished"

    def commit(self) -> None:
        self._require("finished", "commit()")
        if not self._primary:
            raise CkptError("commit() runs on the primary process (process_index 0) only")
        self._merge()
        self._write_tree_metadata()
        self._write_checkpoint_metadata(commit_ns=time.time_ns())
        url = str((self._plan.info if self._plan else {}).get("destination") or self._storage.url)
        # orbax's marker, written last: on object stores it is the commit itself
        self._storage.write(ob.COMMIT_MARKER, f"Checkpoint commit was successful to {url}".encode())
        self._state = "committed"

    def abort(self) -> None:
        if self._direct is not None:
            self._direct.discard()
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            self._stores.clear()
        # Let every pending commit finish rather than cancel it: a cancelled
        # future does not stop an OCDBT commit already under way, which would
        # then land in the output directory after the caller removed it. What
        # is pending is bounded (max_pending_bytes), so this wait is short.
        if pending:
            # (here, not at the top: these futures are tensorstore's, which has imported asyncio by
            # then; a reshard without them spared its 29 modules, 20 ms here and more on a TPU VM)
            import asyncio
        for fut, nbytes, where in pending:
            try:
                # bounded by the storage deadline: an abort after a dead endpoint must not hang
                self._storage.wait(fut, "cannot finish a pending write", where, nbytes=nbytes)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - cancelled or failed: either way it is over
                pass
        self._state = "aborted"

    # -- writing -------------------------------------------------------------------

    def _leaf_for(self, name: str, kinds: tuple[str, ...]) -> _Leaf:
        if self._state != "writing":
            raise CkptError(f"write after the writer is {self._state}", name)
        leaf = self._by_name.get(name)
        if leaf is None or leaf.value_type not in kinds:
            raise CkptError("array is not in the plan given to begin()", name)
        return leaf

    def _submit(self, store: ts.TensorStore, data: np.ndarray, where: str) -> None:
        """Start a write; return once tensorstore has taken the data, keeping its commit pending."""
        try:
            # the array is ours now (see CheckpointWriter): tensorstore may
            # encode straight from it rather than first copying it
            futures = store.write(data, can_reference_source_data_indefinitely=True)
            self._storage.wait(futures.copy, "cannot write", where, nbytes=int(data.nbytes))
        except CkptError:
            raise
        except Exception as exc:
            raise CkptError(f"cannot write: {ts_error_text(exc)}", where) from exc
        with self._lock:
            if self._state != "writing":
                futures.cancel()
                raise CkptError(f"write after the writer is {self._state}", where)
            self._pending.append((futures.commit, int(data.nbytes), where))
            self._pending_bytes += int(data.nbytes)
        self._drain(self._max_pending)

    def _drain(self, limit: int) -> None:
        """Wait for the oldest pending commits until at most `limit` bytes are pending."""
        while True:
            with self._lock:
                if not self._pending or self._pending_bytes <= limit:
                    return
                fut, nbytes, where = self._pending.popleft()
            try:
                self._storage.wait(fut, "cannot write", where, nbytes=nbytes)
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes
            if self._cache_dropper is not None:
                self._cache_dropper.written(nbytes)

    def _require(self, state: str, what: str) -> None:
        if self._state != state:
            raise CkptError(f"{what} called on a writer that is {self._state}")

    # -- commit ----------------------------------------------------------------------

    def _merge(self) -> None:
        """Merge the per-process databases into the root one and check every chunk arrived."""
        assert self._plan is not None
        if self._direct is not None and max(1, self._plan.process_count) == 1:
            # one process: the root database is a manifest over the process's own B+tree (no copy
            # of it, as tensorstore's merge makes), its keys checked from what was put
            self._check_all_chunks(self._direct.keys())
            self._direct.write_root(self._storage, PROCESS_DB.format(0) + "/")
            self._storage.fsync_tree("d", files=False)  # (its node file was fsynced as it closed; its name too now)
            return
        if self._direct is not None:
            # several processes, each database written by ckpt: the root is a new B+tree over every
            # process's keys, its values where they lie in the process databases (as tensorstore's
            # merge leaves them), its node file and manifest written by ckpt (Storage.write: checked
            # on gs://), after every chunk is found among its keys
            own = PROCESS_DB.format(self._plan.process_index) + "/"
            others = [PROCESS_DB.format(i) + "/" for i in range(self._plan.process_count)
                      if i != self._plan.process_index
                      and self._storage.exists(f"{PROCESS_DB.format(i)}/{ob.ROOT_MANIFEST}")]
            entries = self._direct.merged_entries(self._storage, own, others)
            self._check_all_chunks([key.decode("utf-8", "surrogateescape") for key, _ in entries])
            self._direct.write_merged_root(self._storage, entries)
            self._storage.fsync_tree("d", files=False)
            return
        import tensorstore as ts

        context = self._ts_context()
        children = []
        for i in range(max(1, self._plan.process_count)):
            db = PROCESS_DB.format(i)
            # a process that owned no chunk wrote no database; lost data is
            # caught by the chunk check below
            if self._storage.exists(f"{db}/{ob.ROOT_MANIFEST}"):
                children.append(ts.KvStore.open(self._ocdbt_spec(db, write=False), context=context))
        try:
            what, where = "cannot merge the per-process OCDBT databases", self._storage.url
            wait = self._storage.wait
            parent = wait(ts.KvStore.open(self._ocdbt_spec("", write=True), context=context), what, where)
            txn = ts.Transaction(atomic=True)
            target = parent.with_transaction(txn)
            copies = [wait(child, what, where).experimental_copy_range_to(target) for child in children]
            for fut in copies:
                wait(fut, what, where)
            keys = [k.decode("utf-8", "surrogateescape") for k in wait(target.list(), what, where)]
        except CkptError:
            raise
        except Exception as exc:
            raise CkptError(f"cannot merge the per-process OCDBT databases: {ts_error_text(exc)}", self._storage.url) from exc
        self._check_all_chunks(keys)
        self._storage.wait(txn.commit_async(), "cannot write the root OCDBT manifest", self._storage.url)

    def _check_all_chunks(self, keys: list[str]) -> None:
        """Every array has its zarr metadata and every chunk, or the commit is refused."""
        meta_key = "zarr.json" if self._zarr3 else ".zarray"
        stored: dict[str, set[str]] = {}
        for key in keys:
            name, _, rest = key.partition("/")
            stored.setdefault(name, set()).add(rest)
        for leaf in self._leaves:
            if not leaf.stored:
                continue
            have = stored.get(leaf.name, set())
            if meta_key not in have:
                raise IncompleteCheckpointError(f"{meta_key} missing after the merge", leaf.name)
            expected = math.prod(-(-s // c) for s, c in zip(leaf.shape, leaf.chunk_shape)) if leaf.shape else 1
            if len(have) - 1 >= expected:
                continue
            for idx, key in ob.chunk_keys(leaf.name, leaf.shape, leaf.chunk_shape, self._zarr3, {}):
                if key.partition("/")[2] not in have:
                    region = ", ".join(
                        f"{i * c}:{min((i + 1) * c, s)}" for i, c, s in zip(idx, leaf.chunk_shape, leaf.shape)
                    )
                    raise IncompleteCheckpointError(
                        f"{expected - (len(have) - 1)} of {expected} chunks were written by no process "
                        f"(first: chunk {list(idx)}, region [{region}])",
                        leaf.name,
                    )

    def _write_tree_metadata(self) -> None:
        """_METADATA, _sharding and _strings.json, as orbax's handlers write them."""
        assert self._plan is not None
        tree: dict[str, Any] = {}
        for leaf in self._leaves:
            value_meta = _value_meta(leaf)
            # orbax keys the entry by str() of the tuple of stringified keys
            tree[str(tuple(str(k) for k in leaf.keys))] = {
                "key_metadata": [
                    {"key": str(k), "key_type": _KEY_SEQUENCE if isinstance(k, int) else _KEY_DICT}
                    for k in leaf.keys
                ],
                "value_metadata": value_meta,
            }
        meta = {
            "tree_metadata": tree,
            "use_ocdbt": True,
            "use_zarr3": self._zarr3,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
        }
        tuples = _tuple_nodes(self._leaves, self._plan.tuples)
        if tuples:
            # tree_metadata records every sequence as a list (key_type 1); only
            # orbax's rich-types tree keeps tuples apart (see value_metadata_tree)
            meta[ob.VALUE_METADATA_TREE] = value_metadata_tree(self._leaves, tuples)
        self._storage.write(ob.TREE_METADATA, json.dumps(meta).encode())

        shardings = {
            base64.urlsafe_b64encode(leaf.name.encode()).decode(): leaf.sharding
            for leaf in self._leaves if leaf.sharding is not None
        }
        if shardings:
            # tensorstore's json driver wrote orbax's file: compact, keys sorted
            self._storage.write(ob.SHARDING, json.dumps(shardings, sort_keys=True, separators=(",", ":")).encode())

        strings = {t.name: t.value for t in self._plan.values() if self._by_name[t.name].value_type == "string"}
        if strings:
            self._storage.write(
                ob.STRINGS, json.dumps(strings, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
            )

    def _write_checkpoint_metadata(self, *, commit_ns: int | None) -> None:
        has_strings = any(leaf.value_type == "string" for leaf in self._leaves)
        if self._handler == "pytree" or (self._handler is None and has_strings):
            handler = PYTREE_HANDLER
        else:
            handler = STANDARD_HANDLER
        meta = {
            "item_handlers": handler,
            "metrics": {},
            "performance_metrics": {},
            "init_timestamp_nsecs": self._init_ns,
            "commit_timestamp_nsecs": commit_ns,
            "custom_metadata": {},
        }
        self._storage.write(ob.CHECKPOINT_METADATA, json.dumps(meta).encode())


def _value_meta(leaf: _Leaf) -> dict[str, Any]:
    """A leaf's ValueMetadataEntry.to_json(), as in tree_metadata."""
    meta: dict[str, Any] = {"value_type": leaf.value_type, "skip_deserialize": leaf.skip_deserialize}
    if leaf.value_type == "jax.Array":
        meta["write_shape"] = list(leaf.chunk_shape)
    return meta


def _tuple_nodes(leaves: list[_Leaf], tuples: set[tuple[Key, ...]]) -> set[tuple[Key, ...]]:
    """The planned tuple paths that are sequence nodes of this tree (indices below them)."""
    found = set()
    for leaf in leaves:
        for i in range(len(leaf.keys)):
            if leaf.keys[:i] in tuples and isinstance(leaf.keys[i], int):
                found.add(leaf.keys[:i])
    return found


def value_metadata_tree(leaves: list[_Leaf], tuples: set[tuple[Key, ...]]) -> str:
    """`_METADATA["value_metadata_tree"]`: the JSON string orbax writes with
    `PyTreeMetadataOptions(support_rich_types=True)` (metadata/tree_rich_types.py).

    It is the saved tree itself with a {"category": "custom", "clazz":
    "ValueMetadataEntry", "data": ...} object at each leaf, lists as JSON
    arrays and each tuple as {"category": "custom", "clazz": "tuple",
    "entries": [...]}, dict keys in jax's (sorted) order. orbax restores
    tuples from it when asked to (rich types); its default restore reads
    tree_metadata, where sequences are lists, and gives lists, as it does for
    tuples it saved itself. reader.recorded_tuples() reads it back.
    """
    root: dict[Key, Any] = {}
    for leaf in leaves:
        node = root
        for k in leaf.keys[:-1]:
            node = node.setdefault(k, {})
        node[leaf.keys[-1]] = leaf

    def build(node: Any, path: tuple[Key, ...]) -> Any:
        if isinstance(node, _Leaf):
            return {"category": "custom", "clazz": "ValueMetadataEntry", "data": _value_meta(node)}
        ordered = sorted(node, key=lambda k: (0, k) if isinstance(k, int) else (1, k))
        if ordered and isinstance(ordered[0], int):
            items = [build(node[k], path + (k,)) for k in ordered]
            return {"category": "custom", "clazz": "tuple", "entries": items} if path in tuples else items
        return {str(k): build(node[k], path + (k,)) for k in ordered}

    return json.dumps(build(root, ()))


def _fmt_region(region: Region) -> str:
    return "[" + ", ".join(f"{r.start}:{r.stop}" for r in region) + "]"


# -- what the engine asks the format (core/write_plan.py) ---------------------------------------

TUPLES_AS_VALUES = False  # a tuple is a pytree node: its elements are leaves, the tuple is recorded
# what a convert writes at DST's top level (the layout above), and the files written last that
# make it a checkpoint orbax restores: on an object store, which has no rename, they are the commit
OUTPUT_ENTRIES = (ob.TREE_METADATA, ob.SHARDING, ob.STRINGS, ob.CHECKPOINT_METADATA, ob.COMMIT_MARKER,
                  "manifest.ocdbt", "d", "ocdbt.process_*", ARRAY_METADATAS)
COMMIT_MARKERS = (ob.CHECKPOINT_METADATA, ob.COMMIT_MARKER)


def make_writer(storage: Storage, *, memory: int, zarr3: bool = False, **_: Any) -> OrbaxWriter:
    return OrbaxWriter(storage, zarr3=zarr3, max_pending_bytes=pending_window(memory))


def keeps_source_chunks(leaf: Any) -> bool:
    """An Orbax source's grid is kept (a chunk too big for the budget is split to it)."""
    return isinstance(leaf.layout, RegularGrid)


def target_layout(leaf: Any, itemsize: int, cap: int | None, cap_bytes: int) -> RegularGrid:
    """The source's grid where it has one (a DCP chunk list that tiles evenly has one too),
    else whole rows up to the cap; a grid over the cap is shrunk in its leading dims."""
    grid = as_regular_grid(leaf.layout, leaf.shape)
    if grid is None:
        grid = default_grid(leaf.shape, itemsize, cap_bytes)
    elif (cap or isinstance(leaf.layout, ChunkList)) and math.prod(grid) * itemsize > cap_bytes:
        # keep the source grid's alignment: shrink its leading dims to the cap
        grid = default_grid(grid, itemsize, cap_bytes)
    return RegularGrid(tuple(grid))


def plan_value(ctx: PlanContext, keys: tuple[Key, ...], name: str, value: Any, source_path: str) -> None:
    """Lists, tuples and dicts are subtrees in a pytree: their elements become leaves as orbax
    would have saved them (tuples recorded as tuples); None and empty containers are orbax's
    empty values; a tensor inside a bytes item (a tuple of tensors) is an array leaf."""
    try:
        flat = flatten_value(keys, value, ctx.tuples)
    except SharedValueError as exc:  # a value holding itself, or shared past any tree's size
        ctx.refuse(source_path, exc.message)
        return
    for sub_keys, sub_value in flat:
        sub_name = ".".join(str(k) for k in sub_keys)
        if sub_keys != keys:
            ctx.claim(sub_keys, source_path)
        where = "/".join(str(k) for k in sub_keys)
        if isinstance(sub_value, str):
            ctx.add_value(TargetValue(sub_keys, sub_name, sub_value, "string"))
        elif isinstance(sub_value, (bool, int, float, np.generic)) and not isinstance(sub_value, (np.str_, np.bytes_)):
            ctx.add_value(TargetValue(sub_keys, sub_name, sub_value, "scalar"))
        elif sub_value is None or (type(sub_value) in (list, tuple, dict) and not sub_value):
            ctx.add_value(TargetValue(sub_keys, sub_name, sub_value, "object"))
        elif isinstance(sub_value, np.ndarray) and dtypes.torch_name_of(sub_value) is not None:
            ctx.add_array(sub_keys, sub_name, sub_value)
        else:
            ctx.refuse(where, f"{a_type(sub_value)} value has no Orbax leaf type "
                              "(arrays, numbers, strings, None and containers of them)")
