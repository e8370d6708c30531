"""Checkpoints whose tree is a msgpack document: Flax legacy, orbax <= 0.4, T5X.

One reader for the three families, because they share everything but where
the big arrays live (each is `flax.serialization`'s msgpack, scanned by
msgpack_scan without loading array data):

- Flax legacy: `flax.training.checkpoints.save_checkpoint` with orbax off
  writes `<dir>/checkpoint_<N>` msgpack FILES; `flax.serialization.to_bytes`
  files are the same document. Every array is inline (ext 1); arrays over
  1 GiB are split into `__msgpack_chunked_array__` pieces.
- orbax-checkpoint <= 0.4 (and Flax 0.7's `save_checkpoint` with orbax on,
  which writes `checkpoint_<N>/`): no `_METADATA`; the tree is the file
  `checkpoint`, where each array saved through a TypeHandler is the string
  `PLACEHOLDER://<param name>` and its data is a zarr array in OCDBT (when
  `manifest.ocdbt` is there) or in `<param name>/`; aggregated values are
  inline.
- T5X: `checkpoint_<N>/checkpoint` holds `{'version': 3, 'optimizer':
  state}`; each partitioned array is the JSON of its tensorstore spec
  (`{'driver': 'zarr', 'kvstore': {'path': 'target.encoder...kernel/'},
  'metadata': ...}`), the path relative to the step directory.

A directory holding `checkpoint_<N>` files or directories (or `<N>/` steps)
is a root with steps, like a CheckpointManager root: `--step N`, default the
latest complete one. A local path naming one msgpack file reads that file.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...base import strict_json
from ...base import dtypes
from ...base.errors import CkptError, CorruptMetadataError, IncompleteCheckpointError, NotFoundError, UsageError
from ...core.model import ArrayLeaf, Checkpoint, Key, Leaf, Region, RegionReader, RegularGrid, StepInfo, ValueLeaf, constant_loader
from ...storage import Storage
from . import scan as ms
# the zarr array machinery the Orbax reader uses too: the same arrays, opened the same way
# (TREE_METADATA: orbax >= 0.5 writes it, and then the Orbax reader reads the step)
from ...machinery.arrays.reading import (
    ROOT_MANIFEST, SHARDING, TREE_METADATA, ArraySource, ZarrRegionReader, json_leaves, parse_sharding,
    parse_zarr_metadata,
)

# detection's names and rules (detection.py: what the registry imports without this module)
from .detection import FLAX_TMP, NAME, TREE_FILE, TREE_SUFFIXES, _untmp, is_tmp, split_local_file, step_of  # noqa: F401

PLACEHOLDER = "PLACEHOLDER://"
CHUNKED = "__msgpack_chunked_array__"
_MAX_SNIFFED = 64


def _head(storage: Storage, key: str) -> bytes:
    try:
        size = storage.size(key)
        return storage.read_range(key, 0, min(size, 8)) if size else b""
    except (CkptError, OSError):
        return b""


def is_tree_file(storage: Storage, key: str) -> bool:
    """A stored file that starts like a saved tree (a msgpack map with str keys)."""
    return ms.sniff(_head(storage, key))


def _is_item(storage: Storage, files: list[str]) -> bool:
    return TREE_FILE in files and TREE_METADATA not in files and is_tree_file(storage, TREE_FILE)


def _prefix(name: str) -> str:
    """A step entry's name without its number: `checkpoint_` for `checkpoint_12`."""
    return _untmp(name).rstrip("0123456789")


@dataclass
class _Entry:
    """One step (or unfinished save) of a root: a msgpack file or a step directory."""

    name: str
    step: int | None
    is_dir: bool
    committed: bool
    reason: str | None = None
    # a step directory's items: ("",) when it is an item itself, else its item
    # sub-directories (orbax 0.4 CheckpointManager: `default/`, or named items)
    items: tuple[str, ...] = ()
    json_items: tuple[str, ...] = ()


def _layout_by_dir(storage: Storage) -> dict[str, dict[str, set[str]]]:
    """For each top-level directory, in one pass over the listing: where its `checkpoint`,
    `_METADATA` and JSON-item `metadata` files are ('' = the directory itself)."""
    out: dict[str, dict[str, set[str]]] = {}
    for key in storage.list():
        parts = key.split("/")
        if len(parts) not in (2, 3) or parts[-1] not in (TREE_FILE, TREE_METADATA, "metadata"):
            continue
        where = parts[1] if len(parts) == 3 else ""
        out.setdefault(parts[0], {}).setdefault(parts[-1], set()).add(where)
    return out


def _step_items(storage: Storage, name: str, found: dict[str, set[str]],
                lenient: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(msgpack items, JSON items) of a step directory, or None when it holds no msgpack tree.

    Once one item's `checkpoint` file starts like a saved tree, every item's
    is kept (a damaged one is then read, and reported, never dropped); with
    `lenient` (a step of a root already known to be ours) none need to."""
    metadata = found.get(TREE_METADATA, set())
    if "" in metadata:
        return None  # an orbax >= 0.5 item: the Orbax reader's
    trees = found.get(TREE_FILE, set()) - metadata
    if "" in trees:
        return (("",), ()) if lenient or is_tree_file(storage, f"{name}/{TREE_FILE}") else None
    items = tuple(sorted(i for i in trees if i))
    if not items or not (lenient or any(is_tree_file(storage, f"{name}/{i}/{TREE_FILE}") for i in items)):
        return None
    json_items = tuple(sorted(found.get("metadata", set()) - set(items) - metadata - {""}))
    return items, json_items


def _entries(storage: Storage, dirs: list[str], files: list[str]) -> tuple[list[_Entry], list[str]]:
    """The steps of a root, and the loose msgpack files that are not steps."""
    steps: list[_Entry] = []
    loose: list[str] = []
    layout = _layout_by_dir(storage) if dirs else {}
    sniffed = 0
    # step-named entries that do not start like a saved tree: steps all the same when the
    # root is ours (flax's latest_checkpoint goes by the name alone, then fails on the file)
    unsniffed: list[tuple[str, int, bool]] = []
    for d in dirs:
        number = step_of(d)
        if number is None or d not in layout:
            continue
        if is_tmp(d):
            # an unfinished save: shown, never read as a step
            if TREE_FILE in layout[d] and not layout[d].get(TREE_METADATA):
                steps.append(_Entry(d, number, True, False, "uncommitted save (temporary directory name)"))
            continue
        found = _step_items(storage, d, layout[d])
        if found is not None:
            steps.append(_Entry(d, number, True, True, items=found[0], json_items=found[1]))
        else:
            unsniffed.append((d, number, True))
    for f in files:
        if f.startswith((".", "_")) or sniffed >= _MAX_SNIFFED:
            continue
        number = step_of(f)
        stepish = number is not None or FLAX_TMP.match(f)
        if not stepish and "." in f and not f.endswith(TREE_SUFFIXES):  # (detection.sniffed_file's rule)
            continue
        sniffed += 1
        if not is_tree_file(storage, f):
            if number is not None and not FLAX_TMP.match(f):
                unsniffed.append((f, number, False))
            continue
        if FLAX_TMP.match(f):
            steps.append(_Entry(f, None, False, False, "uncommitted save (flax's temporary file)"))
        elif number is not None:
            steps.append(_Entry(f, number, False, True))
        else:
            loose.append(f)
    prefixes = {_prefix(e.name) for e in steps if e.committed}
    for name, number, is_dir in unsniffed:
        # a damaged step of this root (named like its steps): listed, so that reading or
        # validating it reports the damage instead of falling back to an older step
        if _prefix(name) not in prefixes:
            continue
        if not is_dir:
            steps.append(_Entry(name, number, False, True))
            continue
        found = _step_items(storage, name, layout[name], lenient=True)
        if found is not None:
            steps.append(_Entry(name, number, True, True, items=found[0], json_items=found[1]))
    steps.sort(key=lambda e: (e.step if e.step is not None else -1, e.name))
    return steps, loose


def detect(storage: Storage) -> bool:
    dirs, files = storage.listdir()
    if TREE_METADATA in files:
        return False
    if _is_item(storage, files):
        return True
    steps, loose = _entries(storage, dirs, files)
    return any(s.committed or s.step is not None for s in steps) or bool(loose)


def read(storage: Storage, *, step: str | int | None = None) -> Checkpoint:
    dirs, files = storage.listdir()
    if _is_item(storage, files):
        if step not in (None, "latest"):
            raise UsageError(f"--step {step} given, but this is a single checkpoint, not a directory of steps", storage.url)
        return _read_item(storage, storage.url.rsplit("/", 1)[-1])
    steps, loose = _entries(storage, dirs, files)
    if isinstance(step, str) and step in files and is_tree_file(storage, step):
        # a path naming one file (or --step with an entry's name)
        ckpt = read_file(storage, step)
        return _with_steps(ckpt, storage, steps, step_of(step), step)
    if not steps:
        if len(loose) == 1 and step in (None, "latest"):
            return read_file(storage, loose[0])
        if loose:
            raise CkptError(
                f"{len(loose)} Flax msgpack files here ({', '.join(loose[:5])}): give one file's path", storage.url
            )
        raise NotFoundError("no msgpack checkpoint here", storage.url)
    chosen = _choose(storage, steps, step)
    try:
        if chosen.is_dir:
            ckpt = _read_step_dir(storage, chosen)
        else:
            ckpt = read_file(storage, chosen.name)
    except CorruptMetadataError as exc:
        older = [s for s in steps if s.committed and s.step is not None and chosen.step is not None and s.step < chosen.step]
        if step in (None, "latest") and older:
            # the library would fail on this step too (it goes by the name); say which one reads
            raise type(exc)(f"{exc.message} (the latest step; --step {older[-1].step} reads the one before)",
                                       exc.where) from None
        raise
    return _with_steps(ckpt, storage, steps, chosen.step, chosen.name)


def _with_steps(ckpt: Checkpoint, storage: Storage, steps: list[_Entry], step: int | None, name: str) -> Checkpoint:
    ckpt.path = storage.url
    ckpt.steps = [StepInfo(e.name, e.step, e.committed, e.reason) for e in steps]
    ckpt.step = step
    ckpt.layout["step_dir" if any(e.is_dir for e in steps) else "step_file"] = name
    return ckpt


def _choose(storage: Storage, steps: list[_Entry], step: str | int | None) -> _Entry:
    if step in (None, "latest"):
        committed = [s for s in steps if s.committed]
        if not committed:
            raise IncompleteCheckpointError(
                "no complete step: " + ", ".join(f"{s.name} ({s.reason})" for s in steps), storage.url
            )
        return committed[-1]
    try:
        want = int(step)
    except (TypeError, ValueError):
        named = [s for s in steps if s.name == step]
        if named:
            return named[0]
        raise UsageError(f"--step must be a step number, 'latest' or an entry's name, got {step!r}") from None
    matches = sorted((s for s in steps if s.step == want), key=lambda s: not s.committed)
    if not matches:
        raise NotFoundError(
            f"no step {want}; steps here: " + ", ".join(str(s.step) for s in steps if s.step is not None), storage.url
        )
    return matches[0]


def _read_step_dir(storage: Storage, entry: _Entry) -> Checkpoint:
    """A step directory: one item, or several (named items; `default/` alone is unnamed, as orbax shows it)."""
    if entry.items == ("",):
        return _read_item(storage.child(entry.name), entry.name)
    unnamed = entry.items == ("default",) and not entry.json_items
    leaves: list[Leaf] = []
    notes: list[str] = []
    layout: dict[str, Any] = {} if unnamed else {"items": sorted(entry.items + entry.json_items)}
    fmt = "orbax"
    for item in entry.items:
        ckpt = _read_item(storage.child(f"{entry.name}/{item}"), item, prefix=() if unnamed else (item,))
        fmt = ckpt.format
        leaves += ckpt.leaves
        notes += [n if unnamed else f"{item}: {n}" for n in ckpt.notes]
        for k, v in ckpt.layout.items():
            layout.setdefault(k, v)
    for item in entry.json_items:
        # orbax <= 0.4's JsonCheckpointHandler item: its file `metadata`
        leaves += json_leaves(storage.child(f"{entry.name}/{item}"), "metadata", (item,), item)
    return Checkpoint(path=storage.url, format=fmt, layout=layout, leaves=leaves, notes=notes)


# -- one document ---------------------------------------------------------------


def read_file(storage: Storage, key: str) -> Checkpoint:
    """A Flax msgpack file (save_checkpoint with orbax off, or serialization.to_bytes).

    The `checkpoint` file of an orbax <= 0.4 item or a T5X step directory is
    read as that directory (its arrays live beside it): the same leaves either way."""
    if key == TREE_FILE and _is_item(storage, storage.listdir()[1]):
        ckpt = _read_item(storage, storage.url.rstrip("/").rsplit("/", 1)[-1])
        ckpt.path = f"{storage.url}/{key}"
        return ckpt
    tree = ms.scan_tree(storage, key)
    builder = _Builder(storage, key)
    builder.walk(tree, ())
    if builder.placeholders or builder.specs:
        raise CorruptMetadataError("a Flax msgpack file refers to arrays stored elsewhere", f"{storage.url}/{key}")
    layout = {"storage": "msgpack", "file": key, "writer": "flax.serialization"}
    return Checkpoint(path=f"{storage.url}/{key}", format="flax", layout=layout, leaves=builder.leaves)


def _read_item(storage: Storage, name: str, prefix: tuple[Key, ...] = ()) -> Checkpoint:
    """An orbax <= 0.4 item or a T5X step directory: the `checkpoint` file plus its arrays."""
    dirs, files = storage.listdir()
    tree, t5x_version = t5x_state(ms.scan_tree(storage, TREE_FILE))
    notes: list[str] = []
    builder = _Builder(storage, TREE_FILE)
    builder.walk(tree, prefix)
    committed = not is_tmp(name)
    layout: dict[str, Any]
    if t5x_version is not None or builder.specs:
        layout = {"storage": "directories", "zarr": 2, "t5x_version": t5x_version}
        builder.resolve_specs()
        fmt = "t5x"
    else:
        fmt = "orbax"
        layout = {"tree": "msgpack (orbax <= 0.4: no _METADATA)"}
        notes.append(f"tree from the msgpack file '{TREE_FILE}' (orbax <= 0.4 or Flax 0.7 with orbax: no {TREE_METADATA})")
    if builder.placeholders:
        use_ocdbt = ROOT_MANIFEST in files
        layout.update(storage="ocdbt" if use_ocdbt else "directories", zarr=2, processes=1)
        if use_ocdbt:
            layout["ocdbt"] = "merged"
        builder.resolve_placeholders(use_ocdbt, read_shardings(storage, files), _sharding_names(storage, files))
    if not committed:
        notes.insert(0, "uncommitted save (temporary directory name)")
    leaves = builder.leaves
    if t5x_version is not None:
        # t5x keeps the version beside the state: a leaf like any other value
        keys = prefix + ("version",)
        if any(tuple(leaf.keys[: len(keys)]) == keys for leaf in leaves):
            notes.append(f"T5X version {t5x_version} not shown: the state has its own 'version'")
        else:
            version: Leaf = ValueLeaf(keys=keys, name=".".join(str(k) for k in keys), value_type="scalar", dtype="int64",
                                      loader=constant_loader(t5x_version), extra={"stored": "t5x checkpoint version"})
            leaves = [version] + leaves
    return Checkpoint(path=storage.url, format=fmt, layout=layout, leaves=leaves, committed=committed, notes=notes)


def t5x_state(tree: ms.Node) -> tuple[ms.Node, int | None]:
    """T5X's {'version': 3, 'optimizer': state}: the state (what t5x restores) and the version."""
    if isinstance(tree, ms.MapNode):
        top = dict(tree.items)
        version = top.get("version")
        if "optimizer" in top and isinstance(version, ms.Scalar) and isinstance(version.value, int) \
                and not isinstance(version.value, bool):
            return top["optimizer"], version.value
    return tree, None


def _sharding_names(storage: Storage, files: list[str]) -> set[str] | None:
    """The param names orbax 0.4's `_sharding` lists (its jax.Arrays, '' for one device), or None
    without the file: a name not listed was saved by the numpy or scalar handlers."""
    if SHARDING not in files:
        return None
    try:
        raw = strict_json.loads(storage.read(SHARDING))
    except (ValueError, CkptError):
        return None  # read_shardings reports it
    return set(raw) if isinstance(raw, dict) else None


def read_shardings(storage: Storage, files: list[str]) -> dict[str, Any]:
    """orbax 0.4's `_sharding`: {param name: JSON text of the sharding, or '' for host arrays}."""
    if SHARDING not in files:
        return {}
    where = f"{storage.url}/{SHARDING}"
    try:
        raw = strict_json.loads(storage.read(SHARDING))
    except ValueError as exc:
        raise CorruptMetadataError(f"invalid JSON: {exc}", where) from None
    if not isinstance(raw, dict):
        raise CorruptMetadataError("not a JSON object", where)
    out = {}
    for name, text in raw.items():
        if not isinstance(text, str) or not text:
            continue
        try:
            info = strict_json.loads(text)
        except ValueError as exc:
            raise CorruptMetadataError(f"bad entry {name!r}: {exc}", where) from None
        if isinstance(info, dict):
            out[name] = parse_sharding(info, where)
    return out


def _is_ts_spec(node: ms.MapNode) -> bool:
    """t5x's own test for a tensorstore spec in the tree: a dict with driver, kvstore and metadata."""
    return {"driver", "kvstore", "metadata"} <= {k for k, _ in node.items}


def _plain(node: ms.Node, where: str) -> Any:
    """A small subtree (a tensorstore spec) as Python values."""
    if isinstance(node, ms.Scalar):
        return node.value
    if isinstance(node, ms.MapNode):
        return {str(k): _plain(v, where) for k, v in node.items}
    if isinstance(node, ms.ListNode):
        return [_plain(v, where) for v in node.items]
    raise CorruptMetadataError("a tensorstore spec holds an array", where)


# the dtypes np.asarray gives a Python int, float and bool
_PYTHON_NUMBER_DTYPES = frozenset({"int64", "float64", "bool"})


def _python_number(reader: RegionReader) -> Callable[[], Any]:
    """The loader of a 0-d array saved from a Python number: that number (numpy's .item())."""
    return lambda: reader(()).item()


class _Builder:
    """Turns the scanned tree into leaves; external arrays are resolved afterwards."""

    def __init__(self, storage: Storage, key: str) -> None:
        self.storage = storage
        self.key = key
        self.leaves: list[Leaf] = []
        self.placeholders: list[tuple[int, tuple[Key, ...], str]] = []
        self.specs: list[tuple[int, tuple[Key, ...], dict[str, Any]]] = []

    @property
    def where(self) -> str:
        return f"{self.storage.url}/{self.key}"

    def walk(self, node: ms.Node, keys: tuple[Key, ...]) -> None:
        # depth is bounded by the scanner (MAX_DEPTH), so recursion is safe here
        name = ".".join(str(k) for k in keys)
        if isinstance(node, ms.MapNode):
            if not node.items:
                self._value(keys, "Dict", None, lambda: {})
            elif _is_ts_spec(node):
                # a T5X array stored by tensorstore
                self.specs.append((len(self.leaves), keys, _plain(node, self.where)))
                self.leaves.append(None)  # type: ignore[arg-type]  # filled by resolve_specs
            elif any(k == CHUNKED for k, _ in node.items):
                self.leaves.append(self._chunked(node, keys, name))
            else:
                for k, v in node.items:
                    self.walk(v, keys + (k,))
        elif isinstance(node, ms.ListNode):
            if not node.items:
                kind = "Tuple" if node.tuple_ext else "List"
                self._value(keys, kind, None, (lambda: ()) if node.tuple_ext else (lambda: []))
            for i, v in enumerate(node.items):
                self.walk(v, keys + (i,))
        elif isinstance(node, ms.InlineArray):
            self.leaves.append(self._inline(node, keys, name))
        elif isinstance(node, ms.Scalar):
            v = node.value
            if isinstance(v, str) and v.startswith(PLACEHOLDER):
                self.placeholders.append((len(self.leaves), keys, v[len(PLACEHOLDER):]))
                self.leaves.append(None)  # type: ignore[arg-type]  # filled by resolve_placeholders
            elif isinstance(v, str):
                self._value(keys, "string", "string", lambda v=v: v)
            elif v is None:
                self._value(keys, "None", None, lambda: None)
            elif isinstance(v, bytes):
                self._value(keys, "bytes", None, lambda v=v: v)
            else:
                dtype = {bool: "bool", int: "int64", float: "float64", complex: "complex128"}[type(v)]
                self._value(keys, "scalar", dtype, lambda v=v: v)
        elif isinstance(node, ms.LazyBytes):
            self._value(keys, "string" if node.is_str else "bytes", "string" if node.is_str else None,
                        lambda n=node: self._lazy(n))
        else:
            assert isinstance(node, ms.UnknownExt)
            code = node.code

            def refuse(code: int = code, name: str = name) -> Any:
                raise CkptError(f"msgpack ext type {code} is not a flax/orbax type; not decoded", name)

            self._value(keys, f"msgpack-ext-{code}", None, refuse)

    def _value(self, keys: tuple[Key, ...], kind: str, dtype: str | None, loader: Any) -> None:
        self.leaves.append(ValueLeaf(keys=keys, name=".".join(str(k) for k in keys), value_type=kind,
                                     dtype=dtype, loader=loader))

    def _lazy(self, node: ms.LazyBytes) -> Any:
        data = self.storage.read_range(self.key, node.offset, node.offset + node.length)
        return data.decode("utf-8", "replace") if node.is_str else data

    def _dtype(self, name: str, leaf: str) -> str:
        try:
            return dtypes.get(name).name
        except CkptError:
            raise CorruptMetadataError(f"array of dtype {name!r}, which ckpt does not know", leaf) from None

    def _inline(self, node: ms.InlineArray, keys: tuple[Key, ...], name: str) -> Leaf:
        dtype = self._dtype(node.dtype, name)
        itemsize = dtypes.get(dtype).itemsize
        flat = _FlatArray(self.storage, self.key, node.shape, dtype, [(node.offset, node.length)])
        extra: dict[str, Any] = {"stored": "inline", "offset": node.offset}
        want = math.prod(node.shape) * itemsize
        if want != node.length:
            # flax's own restore fails here too (np.frombuffer(...).reshape)
            flat.error = (f"payload is {node.length:,} bytes but shape {list(node.shape)} x {itemsize}-byte "
                          f"{dtype} needs {want:,} (array at byte {node.at} of {self.key})")
            extra["payload_error"] = flat.error
        if node.scalar:
            # ext 3, a numpy scalar (np.int32(7)): a 0-d array keeps its dtype in
            # every target format, where a Python number would not
            extra["numpy_scalar"] = True
        return ArrayLeaf(keys=keys, name=name, shape=node.shape, dtype=dtype,
                         layout=RegularGrid(node.shape), reader=flat.read, extra=extra)

    def _chunked(self, node: ms.MapNode, keys: tuple[Key, ...], name: str) -> Leaf:
        """flax's `_chunk`: {'__msgpack_chunked_array__': True, 'shape': {'0': n, ...}, 'chunks': {'0': arr, ...}}."""
        items = dict(node.items)
        shape_node, chunks_node = items.get("shape"), items.get("chunks")
        bad = CorruptMetadataError("malformed chunked array (flax __msgpack_chunked_array__)", name)
        if not isinstance(shape_node, ms.MapNode) or not isinstance(chunks_node, ms.MapNode):
            raise bad
        dims = dict(shape_node.items)
        try:
            shape = tuple(int(dims[str(i)].value) for i in range(len(dims)))
        except (KeyError, AttributeError, TypeError, ValueError):
            raise bad from None
        pieces = dict(chunks_node.items)
        segments = []
        dtype = None
        for i in range(len(pieces)):
            piece = pieces.get(str(i))
            if not isinstance(piece, ms.InlineArray) or len(piece.shape) != 1:
                raise bad
            if dtype is None:
                dtype = self._dtype(piece.dtype, name)
            elif self._dtype(piece.dtype, name) != dtype:
                raise CorruptMetadataError("chunked array pieces of different dtypes", name)
            if piece.length != piece.shape[0] * dtypes.get(dtype).itemsize:
                raise CorruptMetadataError(f"chunk {i} payload does not match its length", name)
            segments.append((piece.offset, piece.length))
        if dtype is None or any(s < 0 for s in shape):
            raise bad
        flat = _FlatArray(self.storage, self.key, shape, dtype, segments)
        total = sum(n for _, n in segments)
        if total != math.prod(shape) * dtypes.get(dtype).itemsize:
            flat.error = f"chunks hold {total:,} bytes but shape {list(shape)} needs {math.prod(shape) * dtypes.get(dtype).itemsize:,}"
        extra = {"stored": "inline, chunked", "pieces": len(segments)}
        if flat.error:
            extra["payload_error"] = flat.error
        return ArrayLeaf(keys=keys, name=name, shape=shape, dtype=dtype, layout=RegularGrid(shape),
                         reader=flat.read, extra=extra)

    # -- external arrays -----------------------------------------------------------

    def resolve_placeholders(self, use_ocdbt: bool, shardings: dict[str, Any],
                             jax_arrays: set[str] | None = None) -> None:
        """The zarr arrays the placeholders name. `jax_arrays`: the names `_sharding` lists.

        orbax 0.4 stores a Python number as a 0-d zarr array (its ScalarHandler:
        np.asarray(7), int64; a float float64; a bool bool) and records no type;
        jax.Arrays are the names in `_sharding`. A 0-d int64 / float64 / bool array
        outside it is read as the Python number the writer saved (what orbax 0.4
        restores into the saved tree as target), so it stays a number in every
        output (a DCP bytes item holding 7, not tensor(7)); other 0-d arrays (an
        np.int32 optimizer count) stay arrays of their dtype."""
        source = ArraySource(self.storage, "" if use_ocdbt else None)
        names = [n for _, _, n in self.placeholders]
        raw = source.view.start_reads(f"{n}/.zarray" for n in names).result()
        for index, keys, pname in self.placeholders:
            data = raw.get(f"{pname}/.zarray")
            if data is None:
                where = "in the OCDBT database" if use_ocdbt else f"in {pname}/"
                raise NotFoundError(
                    f"array {pname!r} is a placeholder in '{TREE_FILE}' but its .zarray is not stored {where}",
                    self.storage.url,
                )
            leaf = self._zarr_leaf(source, keys, pname, data, shardings.get(pname), "orbax placeholder")
            if jax_arrays is not None and pname not in jax_arrays and leaf.shape == () \
                    and leaf.dtype in _PYTHON_NUMBER_DTYPES and leaf.reader is not None:
                self.leaves[index] = ValueLeaf(
                    keys=keys, name=leaf.name, value_type="scalar", dtype=leaf.dtype,
                    loader=_python_number(leaf.reader), extra={**leaf.extra, "python_scalar": True},
                )
            else:
                self.leaves[index] = leaf

    def resolve_specs(self) -> None:
        source = ArraySource(self.storage, None)
        paths = []
        for _, keys, spec in self.specs:
            paths.append(spec_path(spec, ".".join(str(k) for k in keys)))
        raw = self.storage.start_reads(f"{p}/.zarray" for p in paths).result()
        for (index, keys, spec), path in zip(self.specs, paths):
            data = raw.get(f"{path}/.zarray")
            if data is None:
                raise NotFoundError(
                    f"array {'/'.join(map(str, keys))!r}: its tensorstore directory {path}/ (or its .zarray) is missing",
                    self.storage.url,
                )
            leaf = self._zarr_leaf(source, keys, path, data, None, "t5x tensorstore")
            if str(spec.get("dtype", leaf.dtype)) != leaf.dtype:
                raise CorruptMetadataError(
                    f"spec dtype {spec.get('dtype')!r} disagrees with {path}/.zarray ({leaf.dtype})", self.storage.url
                )
            self.leaves[index] = leaf

    def _zarr_leaf(self, source: ArraySource, keys: tuple[Key, ...], path: str, data: bytes,
                   sharding: Any, stored: str) -> ArrayLeaf:
        where = f"{self.storage.url}/{path}/.zarray"
        try:
            zmeta = strict_json.loads(data)
        except ValueError as exc:
            raise CorruptMetadataError(f"invalid JSON: {exc}", where) from None
        shape, dtype, chunk_shape, info = parse_zarr_metadata(zmeta, False, where)
        reader = ZarrRegionReader(source, path, False, zmeta)
        extra = {"stored": stored, **info}
        return ArrayLeaf(keys=keys, name=".".join(str(k) for k in keys), shape=shape, dtype=dtype,
                         layout=RegularGrid(chunk_shape), sharding=sharding, reader=reader, extra=extra)


def spec_path(spec: dict[str, Any], where: str) -> str:
    """The array directory a T5X tensorstore spec names, relative to the step directory."""
    kv = spec.get("kvstore")
    path = kv.get("path") if isinstance(kv, dict) else None
    if path is None:
        path = spec.get("path")  # tensorstore < 0.1.14 put it at the top
    if not isinstance(path, str) or not path.strip("/"):
        raise CorruptMetadataError("tensorstore spec without a kvstore path", where)
    if spec.get("driver") != "zarr":
        raise CorruptMetadataError(f"tensorstore spec with driver {spec.get('driver')!r} (t5x writes zarr)", where)
    return path.strip("/")


class _FlatArray:
    """A C-order array whose bytes sit in one or more byte ranges of a stored file.

    A region is read as the contiguous runs it covers (one read when the
    region spans whole trailing dimensions), straight into the output, so
    memory is the region and nothing more, whatever the file's size.
    """

    def __init__(self, storage: Storage, key: str, shape: tuple[int, ...], dtype: str,
                 segments: list[tuple[int, int]]) -> None:
        self.storage = storage
        self.key = key
        self.shape = shape
        self.dtype = dtypes.numpy_dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.segments = segments  # (file offset, byte length), consecutive in the flat array
        self.error: str | None = None

    def read(self, region: Region) -> np.ndarray:
        if self.error:
            raise CkptError(self.error, f"{self.storage.url}/{self.key}")
        region = region or tuple(slice(0, s) for s in self.shape)
        want = tuple(r.stop - r.start for r in region)
        out = np.empty(want, dtype=self.dtype)
        if out.size == 0:
            return out
        buf = out.reshape(-1).view(np.uint8)
        if not self.shape:
            self._copy(0, self.itemsize, buf)
            return out
        # the first dimension j after which the region spans everything: runs are [j:] blocks
        j = len(self.shape) - 1
        while j > 0 and region[j].start == 0 and region[j].stop == self.shape[j]:
            j -= 1
        strides = [math.prod(self.shape[i + 1:]) for i in range(len(self.shape))]
        run = (region[j].stop - region[j].start) * strides[j]
        lead = [range(r.start, r.stop) for r in region[:j]]
        pos = 0
        for idx in itertools.product(*lead):
            start = sum(i * s for i, s in zip(idx, strides)) + region[j].start * strides[j]
            self._copy(start * self.itemsize, run * self.itemsize, buf[pos: pos + run * self.itemsize])
            pos += run * self.itemsize
        return out

    def _copy(self, flat_start: int, length: int, into: np.ndarray) -> None:
        base = 0
        done = 0
        for offset, size in self.segments:
            if length == done:
                return
            lo = max(flat_start + done, base)
            hi = min(flat_start + length, base + size)
            if lo < hi:
                self.storage.read_range_into(self.key, offset + lo - base, into[lo - flat_start: hi - flat_start])
                done = hi - flat_start
            base += size
