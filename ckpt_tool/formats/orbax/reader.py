"""Orbax checkpoints, read from metadata alone and without jax.

Handles a single save (StandardCheckpointer / PyTreeCheckpointer), a step
holding several named items, and a CheckpointManager root of steps; OCDBT
(merged or still per-process) and plain per-array directories; zarr v2 and
zarr v3. Opening reads `_CHECKPOINT_METADATA`, `_METADATA`, `_sharding` and
each array's `.zarray` / `zarr.json` (concurrently) and never an array chunk;
array data is read on request through tensorstore.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ...machinery.arrays import schema
# the zarr machinery's names are the Orbax package's too (checks.py, write.py: ob.read_json, ...)
from ...machinery.arrays.reading import (  # noqa: F401
    ROOT_MANIFEST, SHARDING, STRINGS, TREE_METADATA, ArraySource, json_leaves, StringsFile, UnmergedRegionReader, ZarrRegionReader,
    chunk_key, chunk_keys, parse_sharding, parse_zarr_metadata, read_json, read_shardings, read_zarr_metadata,
    region_reader, sharding_model,
)
from ...base.errors import (
    CkptError, CorruptMetadataError, IncompleteCheckpointError, NotFoundError, StorageUnavailableError, UsageError,
)
from ...core.model import ArrayLeaf, Checkpoint, Key, Leaf, RegularGrid, Sharding, StepInfo, ValueLeaf
from ...storage import Storage

NAME = "orbax"

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_MARKER = "commit_success.txt"
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
# _METADATA's rich-types tree (tuples kept apart from lists), a JSON string (write.py writes it)
VALUE_METADATA_TREE = "value_metadata_tree"


def is_tmp_name(name: str) -> bool:
    return bool(_TMP_NAME.search(name))


def step_number(name: str) -> int | None:
    base = _TMP_NAME.sub("", name)
    m = _STEP_NAME.match(base)
    return int(m.group(1)) if m else None


def _looks_like_step(storage: Storage, dirs: list[str], files: list[str]) -> bool:
    if any(f in files for f in _MARKERS) or any(_PROCESS_DB.match(d) for d in dirs):
        return True
    # a step made only of named items: <item>/_METADATA. Sub-directories named
    # like steps (`1/`, `2/`: saves side by side) make a root of steps, not items.
    items = [d for d in dirs[:32] if step_number(d) is None and storage.exists(f"{d}/{TREE_METADATA}")]
    return bool(items) and not _separate_checkpoints(storage, dirs, items)


def _separate_checkpoints(storage: Storage, dirs: list[str], items: list[str]) -> bool:
    """Whether sub-directories that look like a step's items are checkpoints of their own, side by side.

    orbax writes `_CHECKPOINT_METADATA` at the step level, never inside an
    item (from 0.5.11 every save has one at its top): a sub-directory holding
    its own is a separate save, and a directory of those is a folder of
    checkpoints, not a step (whose own `_CHECKPOINT_METADATA` would have made
    it one before this is asked). A step never holds a DCP or safetensors
    checkpoint either (_other_checkpoint_file: the names their detection looks
    for). Saves of orbax <= 0.5.10 side by side, with nothing of another
    format beside them, cannot be told from that version's items.
    """
    if any(storage.exists(f"{d}/{CHECKPOINT_METADATA}") for d in items):
        return True
    for d in dirs[:32]:
        if d in items or step_number(d) is not None:
            continue
        sub = storage.child(d)
        if sub.exists(_DCP_METADATA) or any(_other_checkpoint_file(f) for f in sub.listdir()[1]):
            return True
    return False


# the files that make a directory a DCP checkpoint (its `.metadata`, or `.distcp` data of an
# uncommitted save) or a safetensors one (its files, a Hugging Face index), by name
_DCP_METADATA = ".metadata"
_OTHER_CHECKPOINT_FILES = (".distcp", ".safetensors")
_SAFETENSORS_INDEX = "model.safetensors.index.json"


def _other_checkpoint_file(name: str) -> bool:
    return name == _SAFETENSORS_INDEX or name.endswith(_OTHER_CHECKPOINT_FILES)


def detect(storage: Storage) -> bool:
    dirs, files = storage.listdir()
    if _looks_like_step(storage, dirs, files):
        return True
    # a CheckpointManager root: step-named sub-directories holding steps
    for d in dirs:
        if step_number(d) is not None:
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
        doc = read_json(storage, CHECKPOINT_METADATA)
        # the fields orbax validates (types, timestamp range): a bad one is unreadable metadata
        schema.parse_step_metadata(doc, f"{storage.url}/{CHECKPOINT_METADATA}")
        return doc
    except StorageUnavailableError:
        raise  # the store did not answer: nothing is known of the step (never "uncommitted")
    except CkptError as exc:
        return exc


# -- CheckpointManager roots --------------------------------------------------


def _step_status(storage: Storage, name: str) -> StepInfo:
    number = step_number(name)
    if is_tmp_name(name):
        return StepInfo(name, number, False, commit_status(storage, name, [], None).reason)
    sub = storage.child(name)
    _dirs, files = sub.listdir()
    status = commit_status(sub, name, files, read_step_metadata(sub, files))
    return StepInfo(name, number, status.committed, status.reason)


def _read_manager_root(storage: Storage, dirs: list[str], step: str | int | None) -> Checkpoint:
    steps = [_step_status(storage, d) for d in dirs if step_number(d) is not None]
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
    # what the checks of this run take instead of parsing again (Checkpoint.parsed, ItemParse)
    parsed: dict[str, Any] = {parsed_key(storage, CHECKPOINT_METADATA): step_meta}
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
            parsed.update(item.parsed)
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
                parsed.update(item.parsed)
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
        committed=committed, saved_at=saved_at, notes=notes, parsed=parsed,
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
    return json_leaves(storage, item.file, prefix, item.name)


@dataclass
class _Item:
    leaves: list[Leaf]
    layout: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    parsed: dict[str, Any] = field(default_factory=dict)  # (Checkpoint.parsed's records of the item)


@dataclass(frozen=True)
class ItemParse:
    """What the reader parsed of one pytree item's metadata: Checkpoint.parsed[parsed_key(item,
    TREE_METADATA)], for checks.check_opened in the same run, which reads none of it again (and
    takes it out: its memory goes once the checks are done). Recorded only as the checks would
    parse it (the reader raises on the rest). recorded_tuples finds the item's value_metadata_tree
    text (None where it has none) under parsed_key(item, VALUE_METADATA_TREE)."""

    tree: schema.TreeMetadata  # `_METADATA`
    shardings: dict[str, Sharding] | None  # `_sharding` parsed; None where the item has none
    # each array's zarr metadata and its parse (parse_zarr_metadata), by its name; None where the
    # arrays are read from several per-process databases (the checks look in them in their own order)
    zarr: dict[str, tuple[dict[str, Any], tuple[tuple[int, ...], str, tuple[int, ...], dict[str, Any]]]] | None


def parsed_key(storage: Storage, file: str) -> str:
    """The key of Checkpoint.parsed that holds what the reader parsed of `file` in `storage`."""
    return f"{storage.url}/{file}"


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
    tree = parse_tree(read_json(storage, TREE_METADATA), f"{storage.url}/{TREE_METADATA}")
    entries = tree.entries
    rich_tree = tree.raw.get(VALUE_METADATA_TREE) if isinstance(tree.raw, dict) else None
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
    sources: list[ArraySource]
    if use_ocdbt:
        if ROOT_MANIFEST in files:
            sources = [ArraySource(storage, "")]
            layout["ocdbt"] = "merged"
        elif process_dbs:
            sources = [ArraySource(storage, d) for _, d in process_dbs]
            layout["ocdbt"] = "unmerged"
            notes.append(
                f"unmerged OCDBT: no root {ROOT_MANIFEST}, reading {len(process_dbs)} per-process database(s)"
            )
        else:
            raise NotFoundError(f"OCDBT checkpoint without {ROOT_MANIFEST} or ocdbt.process_N/", storage.url)
    else:
        sources = [ArraySource(storage, None)]

    meta_key = "zarr.json" if use_zarr3 else ".zarray"
    names = [_param_name(k) for k, _ in entries]
    array_names = [n for n, (_, v) in zip(names, entries) if v.value_type in ZARR_TYPES]
    # tensorstore reads the arrays' metadata on its own threads while this
    # thread parses _sharding
    first_reads = sources[0].view.start_reads(f"{n}/{meta_key}" for n in array_names)
    shardings = read_shardings(storage, files)
    zmetas = read_zarr_metadata(sources, array_names, meta_key, first_reads)
    strings = None
    parsed_zmeta: dict[int, tuple[tuple[int, ...], str, tuple[int, ...], dict[str, Any]]] = {}
    # (each array's zarr metadata and its parse, for the checks: one pair per distinct text)
    zarr: dict[str, tuple[dict[str, Any], Any]] | None = {} if len(sources) == 1 else None
    pairs: dict[int, tuple[dict[str, Any], Any]] = {}
    grids: dict[int, RegularGrid] = {}  # by id(zmeta), as parsed_zmeta

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
                parsed_zmeta[id(zmeta)] = parse_zarr_metadata(zmeta, use_zarr3, f"{name}/{meta_key}")
            shape, dtype, chunk_shape, info = parsed_zmeta[id(zmeta)]
            if zarr is not None:
                pair = pairs.get(id(zmeta))
                if pair is None:
                    pair = pairs[id(zmeta)] = (zmeta, parsed_zmeta[id(zmeta)])
                zarr[name] = pair
            why = schema.shape_disagreement(shape, vmeta.write_shape)
            if not why and value_type == "jax.Array" and any(c > max(n, 1) for c, n in zip(chunk_shape, shape)):
                why = f"its chunks {list(chunk_shape)} are larger than the array (a jax.Array's chunk is part of one shard)"
            if why:
                # orbax would restore another shape than the one stored, or fail
                raise CorruptMetadataError(f"{meta_key} shape {list(shape)} disagrees with {TREE_METADATA}: {why}", f"{storage.url}/{name}")
            extra.update(info)
            reader: UnmergedRegionReader | ZarrRegionReader
            if len(sources) > 1:
                # unmerged OCDBT: each process holds its own chunks of the array
                reader = UnmergedRegionReader(sources, name, use_zarr3, zmeta, shape, chunk_shape)
            else:
                reader = region_reader(source, name, use_zarr3, zmeta, shape, chunk_shape)
            if value_type == "scalar":
                leaves.append(ValueLeaf(
                    keys=full_keys, name=name, value_type="scalar", dtype=dtype,
                    loader=reader.scalar, extra=extra,
                ))
                continue
            if vmeta.write_shape is not None:
                extra["write_shape"] = list(vmeta.write_shape)
            # (arrays of one zarr metadata share their grid, as they share its parse: inspect's
            # output is made once for leaves alike, found by their layout object)
            grid = grids.get(id(zmeta))
            if grid is None:
                grid = grids[id(zmeta)] = RegularGrid(chunk_shape)
            leaves.append(ArrayLeaf(
                keys=full_keys, name=name, shape=shape, dtype=dtype,
                layout=grid, sharding=shardings.get(name),
                reader=reader, extra=extra,
            ))
        elif value_type == "string":
            if strings is None:
                strings = StringsFile(storage)
            leaves.append(ValueLeaf(
                keys=full_keys, name=name, value_type="string", dtype="string",
                loader=functools.partial(strings.get, name), extra=extra,
            ))
        else:
            # empty containers and None ("Dict", "List", "None") and anything newer
            leaves.append(ValueLeaf(
                keys=full_keys, name=name, value_type=value_type,
                loader=functools.partial(_empty_value, value_type), extra=extra,
            ))
    record = ItemParse(tree, shardings if SHARDING in files else None, zarr)
    return _Item(leaves, layout, notes, {
        parsed_key(storage, TREE_METADATA): record,
        parsed_key(storage, VALUE_METADATA_TREE): rich_tree if isinstance(rich_tree, str) else None,
    })


def _empty_value(value_type: str) -> Any:
    return {"Dict": {}, "List": [], "Tuple": (), "None": None}.get(value_type)


def recorded_tuples(ckpt: Any) -> set[tuple[Key, ...]]:
    """The key paths of the tuples an Orbax checkpoint records (value_metadata_tree), else empty.

    The counterpart of write.value_metadata_tree(), for converting Orbax back to
    DCP, where a tuple is one bytes item but a list is traversed. Paths carry
    the item prefix the reader gives its leaves.
    """
    storage = Storage.create(ckpt.path)
    step_dir = ckpt.layout.get("step_dir")
    if step_dir:
        storage = storage.child(step_dir)
    items = ckpt.layout.get("items")
    places = [(storage, ())] if not items else [
        (storage.child(item), () if items == ["default"] else (item,)) for item in items
    ]
    found: set[tuple[Key, ...]] = set()
    for place, prefix in places:
        if parsed_key(place, VALUE_METADATA_TREE) in ckpt.parsed:  # read when it was opened: not again
            text = ckpt.parsed[parsed_key(place, VALUE_METADATA_TREE)]
        elif not place.exists(TREE_METADATA):
            continue
        else:
            meta = read_json(place, TREE_METADATA)
            text = meta.get(VALUE_METADATA_TREE) if isinstance(meta, dict) else None
        if not isinstance(text, str):
            continue
        where = f"{place.url}/{TREE_METADATA}"
        try:
            _walk_rich_tree(json.loads(text), prefix, found)
        except ValueError as exc:
            raise CorruptMetadataError(f"{VALUE_METADATA_TREE} is not JSON: {exc}", where) from None
        except RecursionError:
            raise CorruptMetadataError(f"{VALUE_METADATA_TREE} is nested too deeply", where) from None
    return found


def _walk_rich_tree(node: Any, path: tuple[Key, ...], found: set[tuple[Key, ...]]) -> None:
    if isinstance(node, list):
        for i, child in enumerate(node):
            _walk_rich_tree(child, path + (i,), found)
    elif isinstance(node, dict):
        if node.get("category") == "custom":
            if node.get("clazz") == "tuple" and isinstance(node.get("entries"), list):
                if node["entries"]:
                    found.add(path)
                for i, child in enumerate(node["entries"]):
                    _walk_rich_tree(child, path + (i,), found)
            return  # a ValueMetadataEntry leaf
        if node.get("category") == "namedtuple":
            return  # its fields are dict keys in tree_metadata; no tuple of DCP's kind
        for k, child in node.items():
            _walk_rich_tree(child, path + (str(k),), found)
