"""Orbax checkpoints, read from metadata alone and without jax.

Handles a single save (StandardCheckpointer / PyTreeCheckpointer), a step
holding several named items, and a CheckpointManager root of steps; OCDBT
(merged or still per-process) and plain per-array directories; zarr v2 and
zarr v3. Opening reads `_CHECKPOINT_METADATA`, `_METADATA`, `_sharding` and
each array's `.zarray` / `zarr.json` (concurrently) and never an array chunk;
array data is read on request through tensorstore.
"""
from __future__ import annotations

import itertools
import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import tensorstore as ts

from ..contract import ArrayReader
from ... import dtypes
from . import schema
from ...errors import (
    CkptError, CorruptMetadataError, IncompleteCheckpointError, NotFoundError, StorageUnavailableError, UsageError,
)
from ...model import ArrayLeaf, Checkpoint, Key, Leaf, Region, RegularGrid, Sharding, StepInfo, ValueLeaf
from ...storage import Reads, Storage, ts_error_text

NAME = "orbax"

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
TREE_METADATA = "_METADATA"
SHARDING = "_sharding"
COMMIT_MARKER = "commit_success.txt"
STRINGS = "_strings.json"
ROOT_MANIFEST = "manifest.ocdbt"
_PROCESS_DB = re.compile(r"^ocdbt\.process_(\d+)$")
# orbax 0.12 names an unfinished save `<name>.orbax-checkpoint-tmp`; older
# versions appended `-<n>` or `-<timestamp>`.
_TMP_NAME = re.compile(r"\.orbax-checkpoint-tmp(-\d+)?$")
# step directories of a CheckpointManager: "12", or "<prefix>_12"
_STEP_NAME = re.compile(r"^(?:.*_)?(\d+)$")
# orbax's KeyType: 1 = sequence index, 2 = dict key
_KEY_SEQUENCE = 1
# value types whose values live in a zarr array: the arrays, and scalars
ZARR_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})

_MARKERS = (CHECKPOINT_METADATA, TREE_METADATA, ROOT_MANIFEST)


def is_tmp_name(name: str) -> bool:
    return bool(_TMP_NAME.search(name))


def _step_number(name: str) -> int | None:
    base = _TMP_NAME.sub("", name)
    m = _STEP_NAME.match(base)
    return int(m.group(1)) if m else None


def _looks_like_step(storage: Storage, dirs: list[str], files: list[str]) -> bool:
    if any(f in files for f in _MARKERS) or any(_PROCESS_DB.match(d) for d in dirs):
        return True
    # a step made only of named items: <item>/_METADATA. Sub-directories named
    # like steps (`1/`, `2/`: saves side by side) make a root of steps, not items.
    items = [d for d in dirs[:32] if _step_number(d) is None and storage.exists(f"{d}/{TREE_METADATA}")]
    return bool(items) and not _separate_checkpoints(storage, dirs, items)


def _separate_checkpoints(storage: Storage, dirs: list[str], items: list[str]) -> bool:
    """Whether sub-directories that look like a step's items are checkpoints of their own, side by side.

    orbax writes `_CHECKPOINT_METADATA` at the step level, never inside an
    item (from 0.5.11 every save has one at its top): a sub-directory holding
    its own is a separate save, and a directory of those is a folder of
    checkpoints, not a step (whose own `_CHECKPOINT_METADATA` would have made
    it one before this is asked). A step never holds a DCP or safetensors
    checkpoint either. Saves of orbax <= 0.5.10 side by side, with nothing of
    another format beside them, cannot be told from that version's items.
    """
    if any(storage.exists(f"{d}/{CHECKPOINT_METADATA}") for d in items):
        return True
    from .. import dcp, safetensors

    for d in dirs[:32]:
        if d in items or _step_number(d) is not None:
            continue
        sub = storage.child(d)
        if dcp.detect(sub) or safetensors.detect(sub):
            return True
    return False


def detect(storage: Storage) -> bool:
    dirs, files = storage.listdir()
    if _looks_like_step(storage, dirs, files):
        return True
    # a CheckpointManager root: step-named sub-directories holding steps
    for d in dirs:
        if _step_number(d) is not None:
            sub_dirs, sub_files = storage.listdir(d)
            if _looks_like_step(storage.child(d), sub_dirs, sub_files):
                return True
    return False


def read(storage: Storage, *, step: str | int | None = None) -> Checkpoint:
    dirs, files = storage.listdir()
    if _looks_like_step(storage, dirs, files):
        if step not in (None, "latest"):
            raise UsageError(f"--step {step} given, but this is a single step, not a CheckpointManager root", storage.url)
        return _read_step(storage, storage.url.rsplit("/", 1)[-1], dirs, files)
    return _read_manager_root(storage, dirs, step)


# -- commit status, as each orbax version defines it ---------------------------
#
# What a finished save leaves behind, by the orbax-checkpoint version that
# wrote it (read from orbax's atomicity.py / step.py of each release):
#
#   version        _CHECKPOINT_METADATA        commit_success.txt
#   <= 0.5.10      none                        gs:// only
#   0.5.11-0.12.2  commit_timestamp_nsecs      gs:// only
#   0.12.3 and on  commit_timestamp_nsecs      everywhere (local: inside the
#                                              tmp dir, before the rename)
#
# Off gs:// every version writes into `<name>.orbax-checkpoint-tmp*` and
# renames it: a final name is the commit, and orbax of no version asks for
# commit_success.txt there. So the marker's absence is never a sign of an
# interrupted save off gs:// (0.12.3+ writes it before the rename), and
# nothing on disk tells 0.12.3+ from 0.12.2, which never wrote it locally.
# Nor is the commit timestamp's: no version reads it to decide anything
# (step.py's is_path_finalized looks at the name, and on gs:// at the marker;
# a step without the timestamp is listed and restored, its commit time taken
# from the directory's mtime), and 0.5.11 stamped it only after the rename,
# so a finished save can lack it.
# On gs:// the step is written under its final name; orbax of every version
# restores from gs:// only with the marker there. A step with the commit
# timestamp (written once every array is stored, just before the marker) but
# no marker is a finished save copied to gs:// from a disk: committed, with
# the warning that orbax needs the marker; with neither, the save never
# finished.


@dataclass(frozen=True)
class CommitStatus:
    """Whether a step finished its save, by the rules of the orbax that wrote it."""

    committed: bool
    detail: str | None = None  # why it is not committed
    file: str | None = None  # the file `detail` is about, relative to the step
    # committed, but without commit_success.txt on gs://, where orbax needs it
    needs_marker: bool = False

    @property
    def reason(self) -> str | None:
        return None if self.committed else f"uncommitted save ({self.detail})"


MISSING_MARKER_NOTE = (
    f"committed (commit_timestamp_nsecs), but no {COMMIT_MARKER}: orbax restores from gs:// only with it "
    "(a save copied from another filesystem lacks it)"
)


def object_store_needs_marker(url: str) -> bool:
    """orbax's is_gcs_path: the only storage where it writes and requires commit_success.txt."""
    return url.startswith("gs://")


def commit_status(storage: Storage, name: str, files: list[str], meta: Any) -> CommitStatus:
    """The commit status of a step directory called `name` (the table above).

    `meta` is what read_step_metadata() returned for the step.
    """
    if is_tmp_name(name):
        return CommitStatus(False, "temporary directory name")
    gcs = object_store_needs_marker(storage.url)
    has_marker = COMMIT_MARKER in files
    if CHECKPOINT_METADATA in files:
        if isinstance(meta, CkptError):
            return CommitStatus(False, f"{CHECKPOINT_METADATA} is unreadable: {meta.message}", CHECKPOINT_METADATA)
        if not isinstance(meta, dict):
            return CommitStatus(False, f"{CHECKPOINT_METADATA} is not a JSON object", CHECKPOINT_METADATA)
        stamp = meta.get("commit_timestamp_nsecs")
        if stamp is not None and (not isinstance(stamp, int) or isinstance(stamp, bool)):
            return CommitStatus(
                False, f"commit_timestamp_nsecs in {CHECKPOINT_METADATA} is not an integer: {stamp!r}", CHECKPOINT_METADATA
            )
        if stamp is None:
            # orbax decides by the final name alone (and on gs:// by the marker)
            if gcs and not has_marker:
                return CommitStatus(
                    False, f"{CHECKPOINT_METADATA} has no commit_timestamp_nsecs and there is no {COMMIT_MARKER} on gs://",
                    CHECKPOINT_METADATA,
                )
            return CommitStatus(True)
        return CommitStatus(True, needs_marker=gcs and not has_marker)
    if gcs and not has_marker:
        # orbax <= 0.5 on gs://: no step metadata, and the marker is the only commit record
        return CommitStatus(False, f"no {COMMIT_MARKER} and no {CHECKPOINT_METADATA} on gs://", COMMIT_MARKER)
    return CommitStatus(True)


def listed_commit_status(root: Storage, name: str, files: list[str]) -> CommitStatus:
    """commit_status of the step `name` of the root `root` from the step's listing:
    `_CHECKPOINT_METADATA` is read only where the listing cannot decide (gs:// without
    commit_success.txt), so `ckpt ls` reads no metadata otherwise; a damaged metadata file is
    validate's to find."""
    if CHECKPOINT_METADATA not in files or COMMIT_MARKER in files or not object_store_needs_marker(root.url):
        return commit_status(root, name, [f for f in files if f != CHECKPOINT_METADATA], None)
    step = root.child(name)
    return commit_status(step, name, files, read_step_metadata(step, files))


def read_step_metadata(storage: Storage, files: list[str]) -> Any:
    """`_CHECKPOINT_METADATA` parsed; None when absent, a CorruptMetadataError instance when unreadable."""
    if CHECKPOINT_METADATA not in files:
        return None
    try:
        doc = _read_json(storage, CHECKPOINT_METADATA)
        # the fields orbax validates (types, timestamp range): a bad one is unreadable metadata
        schema.parse_step_metadata(doc, f"{storage.url}/{CHECKPOINT_METADATA}")
        return doc
    except StorageUnavailableError:
        raise  # the store did not answer: nothing is known of the step (never "uncommitted")
    except CkptError as exc:
        return exc


# -- CheckpointManager roots --------------------------------------------------


def _step_status(storage: Storage, name: str) -> StepInfo:
    number = _step_number(name)
    if is_tmp_name(name):
        return StepInfo(name, number, False, commit_status(storage, name, [], None).reason)
    sub = storage.child(name)
    _dirs, files = sub.listdir()
    status = commit_status(sub, name, files, read_step_metadata(sub, files))
    return StepInfo(name, number, status.committed, status.reason)


def _read_manager_root(storage: Storage, dirs: list[str], step: str | int | None) -> Checkpoint:
    steps = [_step_status(storage, d) for d in dirs if _step_number(d) is not None]
    steps.sort(key=lambda s: (s.step if s.step is not None else -1, s.name))
    if not steps:
        raise NotFoundError("no Orbax steps in this directory", storage.url)
    if step in (None, "latest"):
        committed = [s for s in steps if s.committed]
        if not committed:
            raise IncompleteCheckpointError(
                "no committed step: " + ", ".join(f"{s.name} ({s.reason})" for s in steps), storage.url
            )
        chosen = committed[-1]
    else:
        try:
            want = int(step)
        except (TypeError, ValueError):
            raise UsageError(f"--step must be an integer or 'latest', got {step!r}") from None
        matches = [s for s in steps if s.step == want]
        if not matches:
            raise NotFoundError(
                f"no step {want}; steps here: " + ", ".join(str(s.step) for s in steps), storage.url
            )
        # prefer the committed directory over a leftover tmp one of the same number
        matches.sort(key=lambda s: not s.committed)
        chosen = matches[0]
    sub = storage.child(chosen.name)
    sub_dirs, sub_files = sub.listdir()
    ckpt = _read_step(sub, chosen.name, sub_dirs, sub_files)
    ckpt.path = storage.url
    ckpt.steps = steps
    ckpt.step = chosen.step
    ckpt.layout["step_dir"] = chosen.name
    return ckpt


# -- one step ------------------------------------------------------------------


def _read_step(storage: Storage, name: str, dirs: list[str], files: list[str]) -> Checkpoint:
    step_meta = read_step_metadata(storage, files)
    status = commit_status(storage, name, files, step_meta)
    committed, reason = status.committed, status.reason
    saved_at = None
    if isinstance(step_meta, dict):
        ns = step_meta.get("commit_timestamp_nsecs") or step_meta.get("init_timestamp_nsecs")
        if isinstance(ns, (int, float)):
            saved_at = ns / 1e9

    leaves: list[Leaf] = []
    notes: list[str] = []
    layout: dict[str, Any] = {}
    try:
        if TREE_METADATA in files or ROOT_MANIFEST in files or any(_PROCESS_DB.match(d) for d in dirs):
            item = _read_item(storage, prefix=())
            leaves, layout = item.leaves, item.layout
            notes += item.notes
        else:
            found = step_items(storage, dirs, step_meta)
            items = [i.name for i in found if i.kind != "unknown"]
            unread = [i for i in found if i.kind == "unknown"]
            notes += [unread_item_note(i) for i in unread]
            if not found:
                raise CorruptMetadataError(f"no {TREE_METADATA} and no items", storage.url)
            # CheckpointManager's single unnamed item lives in `default/`; orbax
            # presents its tree without that level, and so do we.
            unnamed = items == ["default"]
            layout = {"items": items}
            if unread:
                # convert refuses to leave them out unless told to (--skip-unsupported)
                layout["unread_items"] = {i.name: unread_why(i) for i in unread}
            for entry in found:
                item_name = entry.name
                if entry.kind == "unknown":
                    continue
                sub = storage.child(item_name)
                if entry.kind == "json":
                    leaves += _read_json_item(sub, () if unnamed else (item_name,), entry)
                    continue
                item = _read_item(sub, prefix=() if unnamed else (item_name,))
                leaves += item.leaves
                notes += [f"{item_name}: {n}" for n in item.notes]
                for k, v in item.layout.items():
                    layout.setdefault(k, v)
    except StorageUnavailableError:
        raise  # an unanswered read is no torn save: never a partial tree reported as one
    except CkptError:
        unstamped = isinstance(step_meta, dict) and step_meta.get("commit_timestamp_nsecs") is None
        if committed and not unstamped:
            raise
        if committed:
            # under its final name without a commit timestamp, orbax would list the step; but with
            # its tree unreadable it is a save cut off before its commit (ckpt's own writer on an
            # object store, where there is no temporary name), not a damaged complete one
            committed = False
            reason = f"{CHECKPOINT_METADATA} has no commit_timestamp_nsecs and the tree cannot be read: an interrupted save"
        # an interrupted save: say so and show what is there instead of failing on it
        notes.append("could not read the tree of this incomplete save")
    if not committed:
        notes.insert(0, reason or "uncommitted save")
        notes.append("present: " + ", ".join(sorted(dirs) + sorted(files)))
    elif status.needs_marker:
        notes.insert(0, MISSING_MARKER_NOTE)
    if isinstance(step_meta, dict) and step_meta.get("item_handlers"):
        layout["item_handlers"] = step_meta["item_handlers"]
    return Checkpoint(
        path=storage.url, format=NAME, layout=layout, leaves=leaves,
        committed=committed, saved_at=saved_at, notes=notes,
    )


# -- the items of a step ------------------------------------------------------------
#
# A step of several items records each item's handler in _CHECKPOINT_METADATA
# (`item_handlers`: item name -> the handler class's module path). ckpt reads
# the pytree items (`<item>/_METADATA`) and the items of orbax's JSON handlers:
#   v0 JsonCheckpointHandler (ocp.args.JsonSave)     <item>/metadata
#   v1 JsonHandler (save_checkpointables, the JSON   <item>/data.json; its load
#      handler registered for a checkpointable)      also takes `metadata`
#   v1 MetricsHandler (the `metrics` checkpointable) <item>/metrics
# (the file names of json_handler.py's _get_supported_filenames). A JSON
# value is shown as orbax's load returns it, flattened into leaves the way
# every nested value is (dict keys, list indices; an empty container or a
# scalar is one leaf), so `config/optimizer/b1` is the same leaf whether the
# dict came from a JSON item, a pytree or a DCP bytes item. An item of any
# other handler (proto, StatefulCheckpointable, a user's own) is named in a
# note: ckpt does not read it, and never leaves it out without a word.

_JSON_FILES = ("data.json", "metadata")
_JSON_HANDLER_FILES = {
    "JsonCheckpointHandler": ("metadata",),
    "JsonHandler": _JSON_FILES,
    "MetricsHandler": ("metrics",) + _JSON_FILES,
}
PYTREE_HANDLERS = frozenset({
    "PyTreeCheckpointHandler", "StandardCheckpointHandler", "PyTreeHandler", "ArrayCheckpointHandler",
})


@dataclass(frozen=True)
class StepItem:
    """One item directory of a step: how ckpt reads it."""

    name: str
    kind: str  # "pytree" | "json" | "unknown"
    handler: str | None = None  # the handler _CHECKPOINT_METADATA records for it
    file: str | None = None  # json: the file holding the value (None: none of the handler's files)
    files: tuple[str, ...] = ()  # json: the names the handler loads from, in its order

    @property
    def handler_name(self) -> str | None:
        return self.handler.rsplit(".", 1)[-1] if self.handler else None


def step_items(storage: Storage, dirs: list[str], step_meta: Any) -> list[StepItem]:
    """The item directories of a step, classified.

    A directory `item_handlers` names is an item, whatever its handler. Others
    (no handler records: orbax < 0.9, or a single-item save whose
    `item_handlers` is one string) are items when they hold what the pytree or
    JSON handlers write: anything else there is not an item (the array
    directories of a plain save that lost its _METADATA, say).
    """
    handlers = step_meta.get("item_handlers") if isinstance(step_meta, dict) else None
    handlers = handlers if isinstance(handlers, dict) else {}
    out: list[StepItem] = []
    for d in sorted(dirs):
        recorded = d in handlers
        handler = handlers.get(d) if isinstance(handlers.get(d), str) else None
        short = handler.rsplit(".", 1)[-1] if handler else None
        if storage.exists(f"{d}/{TREE_METADATA}"):
            out.append(StepItem(d, "pytree", handler))
            continue
        sub_dirs, sub_files = storage.listdir(d)
        names = _JSON_HANDLER_FILES.get(short or "")
        if names is None and short is None and not sub_dirs:
            # no handler recorded: a JSON file where the JSON handlers put it
            names = _JSON_FILES
        if names is not None:
            file = next((n for n in names if n in sub_files), None)
            if file is not None or short in _JSON_HANDLER_FILES:
                out.append(StepItem(d, "json", handler, file, names))
                continue
        if recorded:
            out.append(StepItem(d, "unknown", handler))
    return out


def unread_why(item: StepItem) -> str:
    """Why ckpt does not read an item."""
    if item.handler_name in PYTREE_HANDLERS:
        return f"a pytree item ({item.handler_name}) without {TREE_METADATA}"
    if item.handler:
        return f"written by {item.handler_name}, a handler ckpt does not read"
    return "no handler recorded for it and no file ckpt knows"


def unread_item_note(item: StepItem) -> str:
    """The note naming an item ckpt does not read."""
    return f"item {item.name!r} not read: {unread_why(item)}; its contents are not shown"


def _read_json_item(storage: Storage, prefix: tuple[Key, ...], item: StepItem | None = None) -> list[Leaf]:
    """The leaves of a JSON item (`item` None: orbax <= 0.4's JsonCheckpointHandler file `metadata`)."""
    if item is None:
        item = StepItem(storage.url.rstrip("/").rsplit("/", 1)[-1], "json", None, "metadata", ("metadata",))
    if item.file is None:
        raise NotFoundError(
            f"JSON item {item.name!r} has none of the files its handler loads ({', '.join(item.files)})", storage.url
        )
    data = _read_json(storage, item.file)
    leaves: list[Leaf] = []

    def walk(value: Any, keys: tuple[Key, ...]) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, keys + (str(k),))
        elif isinstance(value, list) and value:
            for i, v in enumerate(value):
                walk(v, keys + (i,))
        else:
            leaves.append(ValueLeaf(
                keys=keys, name=".".join(str(k) for k in keys), value_type="json",
                loader=lambda v=value: v, extra={"json_type": type(value).__name__},
            ))

    # a JSON item holding one scalar is one leaf named after the item, even as the unnamed `default`
    walk(data, prefix or ((item.name,) if not isinstance(data, (dict, list)) or not data else ()))
    return leaves


@dataclass
class _Item:
    leaves: list[Leaf]
    layout: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def _tree_entries(meta: Any, where: str) -> list[tuple[tuple[Key, ...], schema.ValueMeta]]:
    """(keys, value metadata) of every leaf in `_METADATA`, checked against orbax's schema."""
    return parse_tree(meta, where).entries


def parse_tree(meta: Any, where: str) -> schema.TreeMetadata:
    return schema.parse_tree_metadata(meta, where)


def _param_name(keys: tuple[Key, ...]) -> str:
    return ".".join(str(k) for k in keys)


def _read_item(storage: Storage, prefix: tuple[Key, ...]) -> _Item:
    dirs, files = storage.listdir()
    if TREE_METADATA not in files:
        raise NotFoundError(f"no {TREE_METADATA}: not an Orbax item (or an incomplete save)", storage.url)
    tree = parse_tree(_read_json(storage, TREE_METADATA), f"{storage.url}/{TREE_METADATA}")
    entries = tree.entries
    use_zarr3 = tree.use_zarr3
    process_dbs = sorted((int(m.group(1)), d) for d in dirs if (m := _PROCESS_DB.match(d)))
    use_ocdbt = tree.use_ocdbt if tree.use_ocdbt is not None else (ROOT_MANIFEST in files or bool(process_dbs))
    meta = tree.raw
    notes: list[str] = []
    layout: dict[str, Any] = {
        "storage": "ocdbt" if use_ocdbt else "directories",
        "zarr": 3 if use_zarr3 else 2,
        "processes": max(1, len(process_dbs)),
    }
    if "store_array_data_equal_to_fill_value" in meta:
        layout["store_array_data_equal_to_fill_value"] = meta["store_array_data_equal_to_fill_value"]

    # where the arrays live
    sources: list[_ArraySource]
    if use_ocdbt:
        if ROOT_MANIFEST in files:
            sources = [_ArraySource(storage, "")]
            layout["ocdbt"] = "merged"
        elif process_dbs:
            sources = [_ArraySource(storage, d) for _, d in process_dbs]
            layout["ocdbt"] = "unmerged"
            notes.append(
                f"unmerged OCDBT: no root {ROOT_MANIFEST}, reading {len(process_dbs)} per-process database(s)"
            )
        else:
            raise NotFoundError(f"OCDBT checkpoint without {ROOT_MANIFEST} or ocdbt.process_N/", storage.url)
    else:
        sources = [_ArraySource(storage, None)]

    meta_key = "zarr.json" if use_zarr3 else ".zarray"
    names = [_param_name(k) for k, _ in entries]
    array_names = [n for n, (_, v) in zip(names, entries) if v.value_type in ZARR_TYPES]
    # tensorstore reads the arrays' metadata on its own threads while this
    # thread parses _sharding
    first_reads = sources[0].view.start_reads(f"{n}/{meta_key}" for n in array_names)
    shardings = _read_shardings(storage, files)
    zmetas = _read_zarr_metadata(sources, array_names, meta_key, first_reads)
    strings = None
    parsed_zmeta: dict[int, tuple[tuple[int, ...], str, tuple[int, ...], dict[str, Any]]] = {}

    leaves: list[Leaf] = []
    for name, (keys, vmeta) in zip(names, entries):
        value_type = vmeta.value_type
        full_keys = prefix + keys
        extra: dict[str, Any] = {"value_type": value_type}
        if vmeta.skip_deserialize:
            extra["skip_deserialize"] = True
        if value_type in ZARR_TYPES:
            found = zmetas.get(name)
            if found is None:
                raise NotFoundError(
                    f"array {name!r} is in {TREE_METADATA} but its {meta_key} is missing",
                    storage.url,
                )
            zmeta, source = found
            # arrays with the same metadata text share one parsed dict: parse it once
            if id(zmeta) not in parsed_zmeta:
                parsed_zmeta[id(zmeta)] = _parse_zarr_metadata(zmeta, use_zarr3, f"{name}/{meta_key}")
            shape, dtype, chunk_shape, info = parsed_zmeta[id(zmeta)]
            why = schema.shape_disagreement(shape, vmeta.write_shape)
            if not why and value_type == "jax.Array" and any(c > max(n, 1) for c, n in zip(chunk_shape, shape)):
                why = f"its chunks {list(chunk_shape)} are larger than the array (a jax.Array's chunk is part of one shard)"
            if why:
                # orbax would restore another shape than the one stored, or fail
                raise CorruptMetadataError(f"{meta_key} shape {list(shape)} disagrees with {TREE_METADATA}: {why}", f"{storage.url}/{name}")
            extra.update(info)
            if len(sources) > 1:
                # unmerged OCDBT: each process holds its own chunks of the array
                reader = _UnmergedRegionReader(sources, name, use_zarr3, zmeta, shape, chunk_shape)
            else:
                reader = _ZarrRegionReader(source, name, use_zarr3, zmeta, shape, chunk_shape)
            if value_type == "scalar":
                leaves.append(ValueLeaf(
                    keys=full_keys, name=name, value_type="scalar", dtype=dtype,
                    loader=reader.scalar, extra=extra,
                ))
                continue
            if vmeta.write_shape is not None:
                extra["write_shape"] = list(vmeta.write_shape)
            leaves.append(ArrayLeaf(
                keys=full_keys, name=name, shape=shape, dtype=dtype,
                layout=RegularGrid(chunk_shape), sharding=shardings.get(name),
                reader=reader, extra=extra,
            ))
        elif value_type == "string":
            if strings is None:
                strings = _StringsFile(storage)
            leaves.append(ValueLeaf(
                keys=full_keys, name=name, value_type="string", dtype="string",
                loader=lambda n=name, s=strings: s.get(n), extra=extra,
            ))
        else:
            # empty containers and None ("Dict", "List", "None") and anything newer
            leaves.append(ValueLeaf(
                keys=full_keys, name=name, value_type=value_type,
                loader=lambda t=value_type: _empty_value(t), extra=extra,
            ))
    return _Item(leaves, layout, notes)


def _empty_value(value_type: str) -> Any:
    return {"Dict": {}, "List": [], "Tuple": (), "None": None}.get(value_type)


# -- array metadata and data ---------------------------------------------------


# one-chunk arrays whose chunk decodes to at most this many bytes are read from an OCDBT walk (below)
SMALL_CHUNK_BYTES = 1 << 20
# chunks located per walk of the B+tree; the last two batches are kept
SMALL_CHUNK_BATCH = 8192


@dataclass
class _ArraySource:
    """Where arrays live: an OCDBT database (subdir '' = root) or plain directories (None).

    Small one-chunk arrays in an OCDBT database are read without tensorstore's
    point reads, whose cost grows with the B+tree node holding the key (orbax's
    100k-leaf save: one node of 200,000 entries, 0.2-0.5 ms per read, so
    `validate --deep` was quadratic in the leaf count). Their chunk keys are
    registered in leaf order; the first read of one locates its whole batch
    by one walk of the tree (storage/ocdbt_bulk.py), and the chunk is decoded
    from those bytes by the streaming decoders (codecs.py).
    """

    storage: Storage
    ocdbt_dir: str | None
    _view: Storage | None = None
    # the arrays that may be read from a walk, in leaf order (whether each can is decided at its batch's
    # first read: `ckpt inspect` reads no data and pays nothing per array for this)
    small_readers: list["_ZarrRegionReader"] = field(default_factory=list)
    _batches: dict[int, dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register_small(self, reader: "_ZarrRegionReader") -> int:
        self.small_readers.append(reader)
        return len(self.small_readers) - 1

    def small_chunk(self, index: int, key: str) -> bytes | None:
        """The stored bytes of the chunk `key` of registered array `index`, or None when the database
        does not hold it (the caller then reads through tensorstore, which says how it is missing)."""
        batch = index // SMALL_CHUNK_BATCH
        with self._lock:
            located = self._batches.get(batch)
            if located is None:
                members = self.small_readers[batch * SMALL_CHUNK_BATCH:(batch + 1) * SMALL_CHUNK_BATCH]
                keys = [k for k in (r.small_key() for r in members) if k is not None]
                located = self.view.locate_values(keys)
                if len(self._batches) >= 2:
                    del self._batches[next(iter(self._batches))]
                self._batches[batch] = located
        value = located.get(key)
        if value is None:
            return None
        self.view.log.record(key)
        return value if isinstance(value, bytes) else self.view.read_located(key, value)

    @property
    def view(self) -> Storage:
        if self._view is None:
            self._view = self.storage.ocdbt(self.ocdbt_dir) if self.ocdbt_dir is not None else self.storage
        return self._view

    def array_kvstore(self, name: str) -> dict[str, Any]:
        if self.ocdbt_dir is None:
            return self.storage.kvstore_spec(name + "/")
        base = self.storage.kvstore_spec(self.ocdbt_dir + "/" if self.ocdbt_dir else "")
        return {"driver": "ocdbt", "base": base, "path": name + "/"}


def _read_zarr_metadata(
    sources: list[_ArraySource], names: list[str], meta_key: str, first_reads: Reads
) -> dict[str, tuple[dict[str, Any], _ArraySource]]:
    """Each array's zarr metadata, read concurrently, with the source holding it.

    `first_reads` are the reads of every name from the first source, already
    started; names it lacks are looked for in the next sources in turn.
    """
    found: dict[str, tuple[dict[str, Any], _ArraySource]] = {}
    remaining = list(names)
    for i, source in enumerate(sources):
        if not remaining:
            break
        pending = first_reads if i == 0 else source.view.start_reads(f"{n}/{meta_key}" for n in remaining)
        raw = pending.result()
        still = []
        parsed: dict[bytes, Any] = {}  # arrays of one shape and dtype share their metadata text
        for n in remaining:
            data = raw[f"{n}/{meta_key}"]
            if data is None:
                still.append(n)
                continue
            if data not in parsed:
                parsed[data] = schema.load_json(data, f"{source.view.url}/{n}/{meta_key}")
            found[n] = (parsed[data], source)
        remaining = still
    return found


def _parse_zarr_metadata(
    zmeta: Any, zarr3: bool, where: str
) -> tuple[tuple[int, ...], str, tuple[int, ...], dict[str, Any]]:
    """shape, dtype, stored chunk shape and codec facts from .zarray / zarr.json (schema-checked)."""
    z = schema.parse_zarr_metadata(zmeta, zarr3, where)
    return z.shape, z.dtype, z.chunk_shape, z.info


_OPEN_LOCKS = tuple(threading.Lock() for _ in range(64))


class _ZarrRegionReader(ArrayReader):
    """Reads regions of one zarr array through tensorstore, opening it on first use."""

    # one per array, 10^4-10^5 of them: no per-instance __dict__
    __slots__ = ("_source", "_name", "_zarr3", "_zmeta", "_store", "_opening", "_lock", "_small")

    starts_reads = True  # tensorstore reads run together: start_read, start_read_into, start_open

    def __init__(self, source: _ArraySource, name: str, zarr3: bool, zmeta: dict[str, Any],
                 shape: tuple[int, ...] | None = None, chunk_shape: tuple[int, ...] | None = None) -> None:
        self._source = source
        self._name = name
        self._zarr3 = zarr3
        self._zmeta = zmeta
        self._store: ts.TensorStore | None = None
        self._opening: Any = None  # the open future, once started
        # a lock per array was 84 bytes each (8 MiB at 100k leaves): opens share a few, by name
        self._lock = _OPEN_LOCKS[hash(name) % len(_OPEN_LOCKS)]
        # an array of an OCDBT database: (its index among the source's small readers, shape, chunk shape,
        # then its chunk key once known to be one small chunk the decoders handle, or "" when it is not)
        self._small: tuple[Any, ...] | None = None
        if source.ocdbt_dir is not None and shape is not None and chunk_shape is not None:
            self._small = (source.register_small(self), shape, chunk_shape)

    def small_key(self) -> str | None:
        """The chunk key, when this array is one small chunk read from a walk of its database."""
        small = self._small
        if small is None:
            return None
        if len(small) == 3:
            small = self._small = small + (self._small_chunk_key(small[1], small[2]),)
        return small[3] or None

    def _small_chunk_key(self, shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> str:
        from ... import codecs

        if len(chunk_shape) != len(shape) or any(c < n for c, n in zip(chunk_shape, shape)) or 0 in chunk_shape:
            return ""
        problem = codecs.zarr3_stream_problem(self._zmeta) if self._zarr3 else codecs.zarr2_stream_problem(self._zmeta)
        if problem is not None:
            return ""
        try:
            nbytes = math.prod(chunk_shape) * codecs.stored_itemsize(self._zmeta, self._zarr3)
        except Exception:  # noqa: BLE001 - a dtype the decoders do not know: tensorstore reads it
            return ""
        if nbytes > SMALL_CHUNK_BYTES:
            return ""
        return chunk_key(self._name, (0,) * len(shape), self._zarr3, self._zmeta)

    def _small_read(self, region: Region) -> np.ndarray | None:
        """The region from the chunk an OCDBT walk found, when the array is one small chunk; else None."""
        key = self.small_key()
        if key is None:
            return None
        index, shape, chunk_shape, _ = self._small  # type: ignore[misc]
        if region and any((r.start or 0) != 0 or (r.stop if r.stop is not None else n) != n or r.step not in (None, 1)
                          for r, n in zip(region, shape)):
            return None
        data = self._source.small_chunk(index, key)
        if data is None:
            return None
        from ... import codecs

        chunk = codecs.decode_chunk(data, self._zmeta, self._zarr3, chunk_shape, f"{self._source.view.url}/{key}")
        if chunk_shape != shape:  # an edge chunk larger than the array it holds
            chunk = chunk[tuple(slice(0, n) for n in shape)]
        return chunk

    def start_open(self) -> None:
        """Start opening the array without waiting (opens of many small arrays then overlap).
        Not for an array read from an OCDBT walk: it is opened only if its chunk is not found there."""
        if self.small_key() is None and self._store is None and self._opening is None:
            with self._lock:
                if self._store is None and self._opening is None:
                    self._opening = self._open_future()

    def _open_future(self) -> Any:
        spec = {
            "driver": "zarr3" if self._zarr3 else "zarr",
            "kvstore": self._source.array_kvstore(self._name),
            # a lost chunk must fail the read, not come back as zeros
            "fill_missing_data_reads": False,
            "recheck_cached_data": False,
            # the metadata read and schema-checked with every other array's (one batch at open):
            # tensorstore need not read it again per array (10,000 small arrays: one point read each)
            "metadata": self._zmeta,
        }
        try:
            return ts.open(spec, open=True, read=True, assume_metadata=True, context=self._source.storage.read_context)
        except Exception as exc:
            raise CkptError(f"cannot open array: {ts_error_text(exc)}", self._name) from exc

    def _open(self) -> ts.TensorStore:
        if self._store is not None:  # opened already: no lock on every chunk read
            return self._store
        with self._lock:
            if self._store is None:
                fut = self._opening if self._opening is not None else self._open_future()
                # the storage layer's deadline: a remote store that stops answering fails, never hangs
                self._store = self._source.storage.wait(fut, "cannot open array", self._name)
            return self._store

    def read(self, region: Region) -> np.ndarray:
        return self.start_read(region)()

    __call__ = read

    def start_read(self, region: Region) -> Callable[[], np.ndarray]:
        """Start reading a region; the returned call waits for it. Many small reads
        started at once let tensorstore run them together (3,000 small leaves:
        0.5 s, against 1.3 s read one by one from four threads)."""
        small = self._small_read(region)
        if small is not None:
            return lambda: small
        store = self._open()
        try:
            view = store[tuple(region)] if region else store
            fut = view.read()
        except Exception as exc:
            raise CkptError(f"cannot read data: {ts_error_text(exc)}", self._name) from exc
        nbytes = view.size * view.dtype.numpy_dtype.itemsize
        return lambda: np.asarray(self._source.storage.wait(fut, "cannot read data", self._name, nbytes=nbytes))

    def start_read_into(self, region: Region, out: np.ndarray) -> Callable[[], None]:
        """Start reading a region straight into `out` (of the region's shape); the returned call waits."""
        small = self._small_read(region)
        if small is not None:
            out[...] = small
            return lambda: None
        store = self._open()
        try:
            target = ts.array(out, copy=False)
            fut = target.write(store[tuple(region)].translate_to[(0,) * len(region)])
        except Exception as exc:
            raise CkptError(f"cannot read data: {ts_error_text(exc)}", self._name) from exc
        return lambda: self._source.storage.wait(fut, "cannot read data", self._name, nbytes=out.nbytes)

    def scalar(self) -> Any:
        value = self.read(())
        return value.item() if value.shape == () else value

    def stored_chunk(self, index: tuple[int, ...]) -> tuple[Storage, str, dict[str, Any], bool]:
        """Where the stored chunk at grid position `index` lives: (storage, key, zarr metadata, zarr3),
        for decoding its bytes as a stream (ckpt_tool/codecs.py) when it is too large to decode whole."""
        return self._source.view, chunk_key(self._name, index, self._zarr3, self._zmeta), self._zmeta, self._zarr3


def chunk_key(name: str, index: tuple[int, ...], zarr3: bool, zmeta: dict[str, Any]) -> str:
    """The key of one chunk of an array's regular grid (as chunk_keys names them)."""
    if zarr3:
        enc = zmeta.get("chunk_key_encoding") or {}
        default = enc.get("name", "default") == "default"
        sep = (enc.get("configuration") or {}).get("separator", "/" if default else ".")
        if default:
            return f"{name}/c" + "".join(sep + str(i) for i in index)
        return f"{name}/" + (sep.join(str(i) for i in index) if index else "0")
    sep = zmeta.get("dimension_separator") or "."
    return f"{name}/" + (sep.join(str(i) for i in index) if index else "0")


def chunk_keys(name: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...], zarr3: bool, zmeta: dict[str, Any]):
    """Every chunk key of an array's regular chunk grid, with its grid index."""
    grid = [range(-(-s // c)) if c else range(0) for s, c in zip(shape, chunk_shape)]
    if zarr3:
        enc = zmeta.get("chunk_key_encoding") or {}
        default = enc.get("name", "default") == "default"
        sep = (enc.get("configuration") or {}).get("separator", "/" if default else ".")
        for idx in itertools.product(*grid):
            if default:
                yield idx, f"{name}/c" + "".join(sep + str(i) for i in idx)
            else:
                yield idx, f"{name}/" + (sep.join(str(i) for i in idx) if idx else "0")
    else:
        sep = zmeta.get("dimension_separator") or "."
        for idx in itertools.product(*grid):
            yield idx, f"{name}/" + (sep.join(str(i) for i in idx) if idx else "0")


class _UnmergedRegionReader(ArrayReader):
    """Reads an array whose chunks are spread over per-process OCDBT databases.

    Each database is opened with the primary's zarr metadata assumed (only
    process 0 writes it); each chunk is read from the database that lists it.
    """

    def __init__(self, sources: list[_ArraySource], name: str, zarr3: bool, zmeta: dict[str, Any],
                 shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> None:
        self._sources = sources
        self._name = name
        self._zarr3 = zarr3
        self._zmeta = zmeta
        self._shape = shape
        self._chunk_shape = chunk_shape
        self._owner: dict[str, int] | None = None
        self._stores: dict[int, ts.TensorStore] = {}
        self._lock = threading.Lock()

    def _owner_of(self) -> dict[str, int]:
        with self._lock:
            if self._owner is None:
                owner: dict[str, int] = {}
                for i, src in enumerate(self._sources):
                    for key in src.view.list(self._name):
                        owner.setdefault(key, i)
                self._owner = owner
            return self._owner

    def _store(self, i: int) -> ts.TensorStore:
        with self._lock:
            if i not in self._stores:
                spec = {
                    "driver": "zarr3" if self._zarr3 else "zarr",
                    "kvstore": self._sources[i].array_kvstore(self._name),
                    "metadata": self._zmeta,
                    "fill_missing_data_reads": False,
                }
                storage = self._sources[i].storage
                try:
                    # only the primary wrote .zarray: assume it for the other databases
                    fut = ts.open(spec, open=True, read=True, assume_metadata=True, context=storage.read_context)
                except Exception as exc:
                    raise CkptError(f"cannot open array: {ts_error_text(exc)}", self._name) from exc
                self._stores[i] = storage.wait(fut, "cannot open array", self._name)
            return self._stores[i]

    def read(self, region: Region) -> np.ndarray:
        region = region or tuple(slice(0, s) for s in self._shape)
        want = tuple(r.stop - r.start for r in region)
        out = np.empty(want, dtype=dtypes.numpy_dtype(_dtype_of(self._zmeta, self._zarr3)))
        owner = self._owner_of()
        for idx, key in chunk_keys(self._name, self._shape, self._chunk_shape, self._zarr3, self._zmeta):
            lo = [i * c for i, c in zip(idx, self._chunk_shape)]
            hi = [min((i + 1) * c, s) for i, c, s in zip(idx, self._chunk_shape, self._shape)]
            inter = [(max(l, r.start), min(h, r.stop)) for l, h, r in zip(lo, hi, region)]
            if any(a >= b for a, b in inter):
                continue
            if key not in owner:
                raise CkptError(f"chunk {list(idx)} is in no per-process database", f"{self._name}/{key}")
            src = tuple(slice(a, b) for a, b in inter)
            dst = tuple(slice(a - r.start, b - r.start) for (a, b), r in zip(inter, region))
            try:
                fut = self._store(owner[key])[src].read()
            except CkptError:
                raise
            except Exception as exc:
                raise CkptError(f"cannot read data: {ts_error_text(exc)}", self._name) from exc
            out[dst] = self._sources[owner[key]].storage.wait(fut, "cannot read data", self._name, nbytes=out[dst].nbytes)
        return out

    __call__ = read

    def scalar(self) -> Any:
        value = self.read(())
        return value.item() if value.shape == () else value


def _dtype_of(zmeta: dict[str, Any], zarr3: bool) -> str:
    return (dtypes.from_zarr3(zmeta["data_type"]) if zarr3 else dtypes.from_zarr2(zmeta["dtype"])).name


# -- sharding and strings ------------------------------------------------------


def _read_shardings(storage: Storage, files: list[str]) -> dict[str, Sharding]:
    if SHARDING not in files:
        return {}
    where = f"{storage.url}/{SHARDING}"
    infos = schema.parse_sharding_file(_read_json(storage, SHARDING), where)
    return {name: _sharding_model(info) for name, info in infos.items()}


def _sharding_model(info: schema.ShardingInfo) -> Sharding:
    if info.kind == "single_device":
        return Sharding("single_device", device=info.device)
    return Sharding(
        "named", mesh_shape=info.mesh_shape, axis_names=info.axis_names,
        partition_spec=info.partition_spec, device_ids=info.device_ids,
    )


def parse_sharding(info: dict[str, Any], where: str) -> Sharding:
    """A Sharding from one `_sharding` entry as orbax writes it."""
    kind = str(info.get("sharding_type", "unknown"))
    if kind == "NamedSharding":
        try:
            mesh_shape = tuple(int(x) for x in info["shape"])
            axis_names = tuple(str(x) for x in info["axis_names"])
            spec = tuple(
                tuple(p) if isinstance(p, list) else p for p in info.get("partition_spec", [])
            )
            device_ids: tuple[int, ...] | None = None
            mesh = (info.get("device_mesh") or {}).get("mesh")
            if mesh is not None:
                flat: list[int] = []

                def walk(node: Any) -> None:
                    if isinstance(node, list):
                        for n in node:
                            walk(n)
                    elif isinstance(node, dict):
                        flat.append(int(node["id"]))

                walk(mesh)
                device_ids = tuple(flat)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptMetadataError(f"bad NamedSharding entry: {exc}", where) from None
        return Sharding("named", mesh_shape=mesh_shape, axis_names=axis_names, partition_spec=spec, device_ids=device_ids)
    if kind == "SingleDeviceSharding":
        return Sharding("single_device", device=info.get("device_str"))
    return Sharding(kind)


class _StringsFile:
    """`_strings.json` (or, in OCDBT saves, the same key inside the database), read once."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._values: dict[str, Any] | None = None

    def get(self, name: str) -> Any:
        if self._values is None:
            self._values = (
                schema.parse_strings(_read_json(self._storage, STRINGS), f"{self._storage.url}/{STRINGS}")
                if self._storage.exists(STRINGS) else {}
            )
        if name not in self._values:
            raise NotFoundError(f"string {name!r} missing from {STRINGS}", self._storage.url)
        return self._values[name]


def _read_json(storage: Storage, key: str) -> Any:
    """A JSON metadata file, parsed with the schema layer's size and nesting bounds."""
    where = f"{storage.url}/{key}"
    if storage.local_root:  # a stat is free here: refuse a huge file before reading it
        try:
            size = storage.size(key)
        except NotFoundError:
            size = 0  # the read below says it is missing
        if size > schema.MAX_JSON_BYTES:
            raise CorruptMetadataError(f"{size:,} bytes, more than the {schema.MAX_JSON_BYTES:,} a metadata file may have", where)
    return schema.load_json(storage.read(key), where)
