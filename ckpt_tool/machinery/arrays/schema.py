"""One typed schema for every JSON metadata file of an Orbax checkpoint.

Each parser takes the bytes (or the decoded document) of one file and returns
plain typed values, or raises SchemaError naming the file and the field
(`_sharding: entry 'params.w': partition_spec: ...`). What is checked is what
the readers themselves parse and reject, read from their source:

- orbax-checkpoint 0.12: `_METADATA` (metadata/tree.py, value_metadata_entry.py:
  key_metadata / value_metadata required, key_type in the KeyType enum,
  skip_deserialize required, write_shape a list), `_sharding`
  (metadata/sharding.py: values are JSON *strings*; sharding_type in
  ShardingTypes; NamedSharding needs shape, axis_names, partition_spec;
  device_mesh.mesh of {"id": int}), `array_metadatas/process_N`
  (array_metadata_store.py: param_name, write_shape, chunk_shape required),
  `_CHECKPOINT_METADATA` and `metadata/_ROOT_METADATA`
  (step/root_metadata_serialization.py, metadata_serialization_utils.py:
  timestamps int, metrics / custom_metadata dicts with str keys).
- tensorstore's zarr drivers for `.zarray` and `zarr.json`: the members it
  requires are checked here (so the message names them), and the document is
  then given to tensorstore's own JSON parser (tensorstore.Spec with the
  metadata as a constraint: microseconds, no I/O), which rejects exactly the
  dtypes, compressor ids and options, orders, fill values and codecs that
  opening the array would reject.

JSON is parsed with a size bound and a nesting bound, so a hostile file can
neither exhaust memory nor reach a RecursionError in a later walk. Sizes
claimed by metadata are bounded too (element counts that overflow int64, byte
sizes past any plausible checkpoint): such shapes are refused before anything
is allocated for them.
"""
from __future__ import annotations

import base64
import binascii
import functools
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ...base import dtypes
from ...base.errors import CkptError, CorruptMetadataError, short_repr
from ...base.names import join_keys

# a metadata file larger than this is not read into memory
MAX_JSON_BYTES = 256 * 2**20
# deeper nesting than this is refused (real files nest at most ~8 levels:
# a device mesh of rank 4 inside _sharding; JSON items are the user's own)
MAX_JSON_DEPTH = 100
# arrays claiming more bytes than this are refused: no checkpoint holds 2^50
# bytes (1 PiB) in one array, and the claim must not drive any allocation
MAX_ARRAY_BYTES = 2**50
# an array whose chunk grid has more chunks than this is refused: orbax writes
# one chunk per device shard (or a few per shard), and every consumer of the
# grid (validate, convert, reshard) walks it chunk by chunk
MAX_CHUNKS_PER_ARRAY = 2**24
# orbax's KeyType enum (metadata/tree.py)
KEY_SEQUENCE, KEY_DICT = 1, 2
KEY_TYPES = (KEY_SEQUENCE, KEY_DICT)
# value typestrs of orbax's type handlers and empty values (type_handlers.py, empty_values.py)
ZARR_VALUE_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})
EMPTY_VALUE_TYPES = frozenset({"None", "Dict", "List", "Tuple", "NamedTuple"})
VALUE_TYPES = ZARR_VALUE_TYPES | EMPTY_VALUE_TYPES | {"string", "placeholder"}
# orbax's ShardingTypes; PositionalSharding is refused by orbax 0.12 ("deprecated")
SHARDING_TYPES = ("NamedSharding", "SingleDeviceSharding")
# str(jax.sharding.AxisType member), as orbax writes axis_types
AXIS_TYPES = frozenset({"AxisType.Auto", "AxisType.Explicit", "AxisType.Manual"})
# InternalCheckpointMetadata fields (step_metadata_serialization.py)
STEP_FIELDS = frozenset({
    "item_handlers", "metrics", "performance_metrics", "init_timestamp_nsecs",
    "commit_timestamp_nsecs", "custom_metadata",
})
# StepStatistics fields a float performance metric may name (logging/step_statistics.py)
_INT64_MAX = 2**63 - 1


class SchemaError(CorruptMetadataError):
    """A metadata file that breaks its schema: `<file>: <field>: <what>`."""

    def __init__(self, message: str, file: str, field_: "str | _EntryWhere | None" = None) -> None:
        self.field = str(field_) if field_ is not None else None
        super().__init__(f"{field_}: {message}" if field_ else message, file)


class _EntryWhere:
    """`tree_metadata[<key>]`, formatted only when an error names it (a string per entry was
    ~1 us of every leaf's parse)."""

    __slots__ = ("key", "suffix")

    def __init__(self, key: Any, suffix: str = "") -> None:
        self.key = key
        self.suffix = suffix  # a field under the entry (".write_shape"), also formatted only when named

    def __str__(self) -> str:
        return f"tree_metadata[{short_repr(self.key, 80)}]{self.suffix}"

    def field(self, name: str) -> "_EntryWhere":
        return _EntryWhere(self.key, self.suffix + name)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


# -- bounded JSON --------------------------------------------------------------

# json_depth's tables: the bytes it drops (all but brackets and quotes), each bracket's step
_NOT_BRACKET_OR_QUOTE = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
_BACKSLASH_PAIR = re.compile(rb"\\\\")
_ESCAPED_QUOTE = re.compile(rb'\\"')


def json_depth(data: bytes) -> int:
    """The deepest nesting of [ and { in a JSON text, brackets inside strings skipped.

    A quote opens or closes a string unless an odd run of backslashes precedes it; a bracket
    counts only with an even number of real quotes before it. In C passes over the bytes
    (~4 ms for the 700 KB _METADATA of 3,000 leaves), without numpy: its import was a sixth of
    an inspect of a 3,000-leaf Orbax checkpoint (issue 46). Backslash pairs go first (a run
    keeps its parity), then each quote a backslash still escapes; of the brackets and quotes
    left, every other stretch between quotes is outside the strings.
    """
    if b"\\" in data:
        data = _ESCAPED_QUOTE.sub(b"", _BACKSLASH_PAIR.sub(b"", data))
    data = data.translate(None, _NOT_BRACKET_OR_QUOTE)
    if b'"' in data:
        data = b"".join(data.split(b'"')[::2])
    return max(0, max(itertools.accumulate(map(_STEP.__getitem__, data)), default=0))


def load_json(data: bytes | str, file: str, *, max_depth: int = MAX_JSON_DEPTH, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """json.loads with a size bound and a nesting bound; every failure a SchemaError."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise SchemaError(f"{len(raw):,} bytes of JSON, more than the {max_bytes:,} a metadata file may have", file)
    if raw.startswith(b"\xef\xbb\xbf"):
        # orbax reads its files as text and json.loads refuses a BOM there
        raise SchemaError("starts with a UTF-8 byte order mark, which orbax's JSON reader refuses", file)
    depth = json_depth(raw)
    if depth > max_depth:
        raise SchemaError(f"JSON nested {depth} levels deep (at most {max_depth} allowed)", file)
    try:
        return json.loads(raw)
    except RecursionError:
        raise SchemaError("JSON nested too deeply", file) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(f"invalid JSON: {exc}", file) from None


# -- small typed checks --------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_int(v: Any) -> int | None:
    """An integer as JSON may spell it (tensorstore also takes 16.0); None otherwise."""
    if _is_int(v):
        return v
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
        return int(v)
    return None


def int_list(v: Any, file: str, field_: "str | _EntryWhere", *, positive: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise SchemaError(f"must be a list of integers, got {short_repr(v)}", file, field_)
    out = []
    for i, x in enumerate(v):
        n = _as_int(x)
        if n is None or n < (1 if positive else 0) or n > _INT64_MAX:
            kind = "positive" if positive else "non-negative"
            raise SchemaError(f"entry {i} must be a {kind} integer, got {short_repr(x)}", file, field_)
        out.append(n)
    return tuple(out)


def _dict(v: Any, file: str, field_: str | None, what: str = "a JSON object") -> dict[str, Any]:
    if not isinstance(v, dict):
        raise SchemaError(f"must be {what}, got {short_repr(v)}", file, field_)
    return v


def _opt_bool(doc: dict[str, Any], key: str, file: str, default: bool | None) -> bool | None:
    v = doc.get(key, default)
    if v is not None and not isinstance(v, bool):
        raise SchemaError(f"must be true or false, got {short_repr(v)}", file, key)
    return v


def _str_keys(v: dict[str, Any], file: str, field_: str) -> None:
    for k in v:
        if not isinstance(k, str):  # JSON keys always are; kept for documents built in code
            raise SchemaError(f"key {short_repr(k)} is not a string", file, field_)


def check_chunk_count(shape: tuple[int, ...], chunks: tuple[int, ...], file: str) -> None:
    """Refuse chunk grids no writer makes, before anything walks them."""
    n = math.prod(-(-s // c) for s, c in zip(shape, chunks)) if chunks else 1
    if n > MAX_CHUNKS_PER_ARRAY:
        raise SchemaError(
            f"{list(shape)} in chunks of {list(chunks)} makes {n:,} chunks, more than the "
            f"{MAX_CHUNKS_PER_ARRAY:,} an array may have", file, "shape",
        )


def check_array_size(shape: tuple[int, ...], itemsize: int, file: str, field_: str = "shape") -> None:
    """Refuse shapes whose element count or byte size no checkpoint can hold."""
    n = math.prod(shape)
    if n > _INT64_MAX:
        raise SchemaError(f"{list(shape)} has {n:.3e} elements, more than a 64-bit count can hold", file, field_)
    if n * max(itemsize, 1) > MAX_ARRAY_BYTES:
        raise SchemaError(
            f"{list(shape)} claims {n * max(itemsize, 1):.3e} bytes, more than any stored array "
            f"(limit {MAX_ARRAY_BYTES:.3e})", file, field_,
        )


# -- _CHECKPOINT_METADATA and metadata/_ROOT_METADATA -----------------------------


def _timestamp(doc: dict[str, Any], key: str, file: str) -> int | None:
    v = doc.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise SchemaError(f"must be an integer (nanoseconds since 1970), got {short_repr(v)}", file, key)
    if not 0 <= v <= _INT64_MAX:
        raise SchemaError(f"{v} is out of range (0 to 2^63-1 nanoseconds)", file, key)
    return v


@dataclass(frozen=True)
class StepMetadata:
    """A step's _CHECKPOINT_METADATA: its timestamps and item handlers (`raw`: the document)."""

    init_timestamp_nsecs: int | None
    commit_timestamp_nsecs: int | None
    item_handlers: dict[str, Any] | str | None
    raw: dict[str, Any]


def parse_step_metadata(doc: Any, file: str) -> StepMetadata:
    """`_CHECKPOINT_METADATA`, as orbax's InternalCheckpointMetadata.deserialize validates it."""
    doc = _dict(doc, file, None)
    handlers = doc.get("item_handlers")
    if handlers is not None:
        if not isinstance(handlers, (dict, str)):
            raise SchemaError(f"must be a string or an object, got {short_repr(handlers)}", file, "item_handlers")
        if isinstance(handlers, dict):
            for k, v in handlers.items():
                if v is not None and not isinstance(v, str):
                    raise SchemaError(f"handler of {k!r} must be a string, got {short_repr(v)}", file, "item_handlers")
    for key in ("metrics", "performance_metrics", "custom_metadata"):
        v = doc.get(key)
        if v is not None:
            _str_keys(_dict(v, file, key), file, key)
    perf = doc.get("performance_metrics") or {}
    for k, v in perf.items():
        # orbax keeps the float ones and builds StepStatistics(**them): an unknown name fails it
        if isinstance(v, float) and k not in _STEP_STATISTICS:
            raise SchemaError(f"{k!r} is not a StepStatistics field", file, "performance_metrics")
    unknown = sorted(set(doc) - STEP_FIELDS)
    if unknown and doc.get("custom_metadata"):
        # orbax moves unknown keys into custom_metadata, and refuses when it is already set
        raise SchemaError(f"unknown key {unknown[0]!r} while custom_metadata is set (orbax refuses this)", file, unknown[0])
    init = _timestamp(doc, "init_timestamp_nsecs", file)
    commit = _timestamp(doc, "commit_timestamp_nsecs", file)
    return StepMetadata(init, commit, handlers, doc)


_STEP_STATISTICS = frozenset({
    "step", "event_type", "reached_preemption", "preemption_received_at", "synchronous",
    "wait_for_prev_start_time", "wait_for_prev_duration_secs", "checkpointer_blocking_start_time",
    "checkpointer_blocking_duration_secs", "get_old_steps_start_time", "get_old_steps_duration_secs",
    "checkpoint_manager_blocking_start_time", "checkpoint_manager_blocking_duration_secs",
    "checkpoint_manager_start_time", "checkpoint_manager_duration_secs",
    "checkpointer_start_time", "checkpointer_duration_secs",
    "directory_creation_start_time", "directory_creation_duration_secs",
})


def parse_root_metadata(doc: Any, file: str) -> dict[str, Any]:
    """CheckpointManager `metadata/_ROOT_METADATA` (root_metadata_serialization.py)."""
    doc = _dict(doc, file, None)
    for key in ("internal_metadata", "custom_metadata"):
        v = doc.get(key)
        if v is not None:
            _str_keys(_dict(v, file, key), file, key)
    unknown = sorted(set(doc) - {"internal_metadata", "custom_metadata"})
    if unknown and doc.get("custom_metadata"):
        raise SchemaError(f"unknown key {unknown[0]!r} while custom_metadata is set (orbax refuses this)", file, unknown[0])
    return doc


# -- _METADATA ------------------------------------------------------------------


@dataclass(frozen=True)
class ValueMeta:
    """One leaf's entry in _METADATA's tree: its value type and how it is restored."""

    value_type: str
    skip_deserialize: bool = False
    write_shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TreeMetadata:
    """An item's _METADATA: its leaves' entries by key path, and the storage options it records."""

    entries: list[tuple[tuple[Any, ...], ValueMeta]]
    use_ocdbt: bool | None
    use_zarr3: bool
    # None when the key is absent (orbax < 0.10: lost chunks restore as fill values)
    store_array_data_equal_to_fill_value: bool | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


def _value_meta(v: Any, file: str, where: "str | _EntryWhere", *, legacy: bool) -> ValueMeta:
    if not isinstance(v, dict):
        v = _dict(v, file, f"{where}.value_metadata")
    vt = v.get("value_type")
    if not isinstance(vt, str):
        raise SchemaError(f"value_type must be a string, got {short_repr(vt)}", file, where)
    if vt not in VALUE_TYPES:
        raise SchemaError(f"unknown value_type {vt!r} (orbax has no handler for it)", file, where)
    if "skip_deserialize" not in v and not legacy:
        raise SchemaError("value_metadata lacks skip_deserialize (orbax requires it)", file, where)
    skip = v.get("skip_deserialize", False)
    if not isinstance(skip, bool):
        raise SchemaError(f"skip_deserialize must be true or false, got {short_repr(skip)}", file, where)
    if not legacy and skip != (vt in EMPTY_VALUE_TYPES):
        # orbax skips exactly the empty containers and looks a handler up for the rest
        raise SchemaError(
            f"skip_deserialize is {str(skip).lower()} for value_type {vt!r} (orbax skips only empty containers)", file, where
        )
    # orbax: tuple(json_dict["write_shape"]) whenever the key is there, so null fails it
    # (the field's name formatted only if an error names it: an f-string here was 10 us of every jax.Array leaf)
    field_ = where.field(".write_shape") if isinstance(where, _EntryWhere) else f"{where}.write_shape"
    write_shape = int_list(v["write_shape"], file, field_) if "write_shape" in v else None
    return ValueMeta(vt, skip, write_shape)


def parse_tree_metadata(doc: Any, file: str) -> TreeMetadata:
    """`_METADATA` as orbax 0.12's InternalTreeMetadata.from_json reads it (and older files)."""
    doc = _dict(doc, file, None)
    tree = doc.get("tree_metadata")
    if not isinstance(tree, dict):
        raise SchemaError(f"must be a JSON object, got {short_repr(tree)}", file, "tree_metadata")
    use_ocdbt = _opt_bool(doc, "use_ocdbt", file, None)
    use_zarr3 = bool(_opt_bool(doc, "use_zarr3", file, False))
    store_flag = _opt_bool(doc, "store_array_data_equal_to_fill_value", file, None)
    entries: list[tuple[tuple[Any, ...], ValueMeta]] = []
    # the key type at each level of the tree: prefix -> (a key there, the entry it came from)
    levels: dict[tuple[Any, ...], tuple[Any, str]] = {}
    for flat_key, entry in tree.items():
        where = _EntryWhere(flat_key)
        if isinstance(entry, dict) and "key_metadata" in entry:
            kms = entry["key_metadata"]
            if not isinstance(kms, list) or not kms:
                raise SchemaError(f"key_metadata must be a non-empty list, got {short_repr(kms)}", file, where)
            keys: list[Any] = []
            for i, km in enumerate(kms):
                if not isinstance(km, dict) or "key" not in km or "key_type" not in km:
                    raise SchemaError(f"key_metadata[{i}] must be {{key, key_type}}, got {short_repr(km)}", file, where)
                key, kt = km["key"], km["key_type"]
                if not _is_int(kt) or kt not in KEY_TYPES:
                    raise SchemaError(
                        f"key_metadata[{i}].key_type {short_repr(kt)} is not a KeyType (1 = sequence, 2 = dict)", file, where
                    )
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise SchemaError(f"key_metadata[{i}].key must be a string, got {short_repr(key)}", file, where)
                if kt == KEY_SEQUENCE:
                    try:
                        keys.append(int(key))
                    except ValueError:
                        raise SchemaError(f"key_metadata[{i}].key {key!r} is a sequence index but not an integer", file, where) from None
                else:
                    keys.append(str(key))
            if "value_metadata" not in entry:
                raise SchemaError("lacks value_metadata (orbax requires it)", file, where)
            vmeta = _value_meta(entry["value_metadata"], file, where, legacy=False)
            _check_key_types(tuple(keys), levels, file, where)
        else:
            # very old _METADATA: the key is a repr'd tuple and the entry is the value metadata
            import ast  # only for these old files

            try:
                parsed = ast.literal_eval(flat_key) if isinstance(flat_key, str) and len(flat_key) < 10_000 else None
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                parsed = None
            if not isinstance(parsed, tuple) or not all(isinstance(k, (str, int)) for k in parsed):
                raise SchemaError("unparseable tree key (no key_metadata, and not a tuple of keys)", file, where)
            keys = list(parsed)
            vmeta = _value_meta(entry, file, where, legacy=True)
        entries.append((tuple(keys), vmeta))
    # the top-level fields only: the tree's entries (a few containers per leaf, ~1.5 KiB each as
    # Python objects) are freed as soon as the caller drops the parsed document
    return TreeMetadata(entries, use_ocdbt, use_zarr3, store_flag, {k: v for k, v in doc.items() if k != "tree_metadata"})


def _check_key_types(keys: tuple[Any, ...], levels: dict[tuple[Any, ...], tuple[Any, Any]], file: str,
                     where: "str | _EntryWhere") -> None:
    """One level of the tree holds sequence indices or dict keys, never both.

    orbax's restore (metadata/tree.py as_nested_tree) sorts the entries by
    their key paths, a sequence index an int and a dict key a str: two paths
    that agree up to a level and then hold an int and a str there make the
    sort raise TypeError, and nothing restores. Entries of the legacy layout
    (no key_metadata) are not sorted that way and are not checked.
    """
    for i, key in enumerate(keys):
        seen, seen_where = levels.setdefault(keys[:i], (key, where))
        if seen.__class__ is not key.__class__:
            kind = lambda k: "a sequence index" if isinstance(k, int) else "a dict key"  # noqa: E731
            under = join_keys(keys[:i]) or "the root"
            raise SchemaError(
                f"key_metadata[{i}] makes {key!r} {kind(key)} under {under}, where {seen_where} has {seen!r} as "
                f"{kind(seen)}: orbax's restore fails sorting a level that mixes them",
                file, where,
            )


# -- _sharding ------------------------------------------------------------------


@dataclass(frozen=True)
class ShardingInfo:
    """One array's entry in _sharding: a named sharding's mesh and partition spec, or its one device."""

    kind: str  # "named" | "single_device"
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    partition_spec: tuple[Any, ...] | None = None
    device_ids: tuple[int, ...] | None = None
    device: str | None = None


def _mesh_ids(mesh: Any, file: str, where: str) -> tuple[int, ...]:
    """The device ids of a nested mesh list (walked without recursion); it must be rectangular.

    Whether their count fits the mesh shape is the validator's business
    (a bad-sharding finding), not a parse error.
    """
    out: list[int] = []
    dims: dict[int, int] = {}  # depth -> list length seen there
    leaf_depth: int | None = None
    stack: list[tuple[Any, int]] = [(mesh, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            if dims.setdefault(depth, len(node)) != len(node) or (leaf_depth is not None and depth >= leaf_depth):
                raise SchemaError("device_mesh.mesh is not a rectangular nested list", file, where)
            stack.extend((n, depth + 1) for n in reversed(node))
            continue
        if not isinstance(node, dict) or "id" not in node or not _is_int(node["id"]) or not 0 <= node["id"] < 2**31:
            raise SchemaError(f"device_mesh entry must be {{\"id\": <device id>}}, got {short_repr(node)}", file, where)
        if leaf_depth is None:
            leaf_depth = depth
        elif depth != leaf_depth or depth in dims:
            raise SchemaError("device_mesh.mesh is not a rectangular nested list", file, where)
        out.append(node["id"])
    return tuple(out)


def parse_sharding_entry(text: Any, file: str, where: str) -> ShardingInfo | None:
    """One `_sharding` value (a JSON string), as orbax's from_serialized_string reads it; None for ""."""
    if not isinstance(text, str):
        raise SchemaError(f"must be a JSON string holding the sharding, got {short_repr(text)}", file, where)
    if not text:
        return None  # orbax: no sharding recorded
    info = _dict(load_json(text, file), file, where)
    kind = info.get("sharding_type")
    if kind not in SHARDING_TYPES:
        hint = " (deprecated; orbax 0.12 refuses it)" if kind == "PositionalSharding" else ""
        raise SchemaError(f"sharding_type {short_repr(kind)} is not one of {list(SHARDING_TYPES)}{hint}", file, where)
    if kind == "SingleDeviceSharding":
        dev = info.get("device_str")
        if not isinstance(dev, str):
            raise SchemaError(f"device_str must be a string, got {short_repr(dev)}", file, where)
        return ShardingInfo("single_device", device=dev)
    for key in ("shape", "axis_names", "partition_spec"):
        if key not in info:
            raise SchemaError(f"NamedSharding lacks {key}", file, where)
    shape = int_list(info["shape"], file, f"{where}.shape", positive=True)
    names = info["axis_names"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise SchemaError(f"axis_names must be a list of strings, got {short_repr(names)}", file, where)
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise SchemaError(f"axis_names {names} do not name the {len(shape)} mesh axes once each", file, where)
    if math.prod(shape) > 2**20:
        raise SchemaError(f"mesh shape {list(shape)} has more than 2^20 devices", file, where)
    types_ = info.get("axis_types")
    if types_:
        if not isinstance(types_, list) or len(types_) != len(shape) or not all(isinstance(t, str) and t in AXIS_TYPES for t in types_):
            raise SchemaError(f"axis_types must list one of {sorted(AXIS_TYPES)} per axis, got {short_repr(types_)}", file, where)
    spec_raw = info["partition_spec"]
    if not isinstance(spec_raw, list):
        raise SchemaError(f"partition_spec must be a list, got {short_repr(spec_raw)}", file, where)
    spec: list[Any] = []
    used: set[str] = set()
    for i, p in enumerate(spec_raw):
        axes = p if isinstance(p, list) else [p] if p is not None else []
        for a in axes:
            if not isinstance(a, str) or a not in names:
                raise SchemaError(f"partition_spec[{i}] names {short_repr(a)}, not a mesh axis of {names}", file, where)
            if a in used:
                raise SchemaError(f"partition_spec uses mesh axis {a!r} twice", file, where)
            used.add(a)
        spec.append(tuple(p) if isinstance(p, list) else p)
    ids = None
    mesh = info.get("device_mesh")
    if mesh:  # orbax: `if device_mesh_dic := ...get(...)`: an empty one means none
        mesh = _dict(mesh, file, f"{where}.device_mesh")
        if "mesh" not in mesh:
            raise SchemaError("device_mesh lacks mesh", file, where)
        ids = _mesh_ids(mesh["mesh"], file, where)
    return ShardingInfo("named", shape, tuple(names), tuple(spec), ids)


def parse_sharding_file(
    doc: Any, file: str, errors: list[tuple[str, SchemaError]] | None = None
) -> dict[str, ShardingInfo]:
    """`_sharding`: {urlsafe_b64(param name): JSON string}; entries sharing a text are parsed once.

    With `errors`, a bad entry is recorded there as (param name, error) and
    left out, so that a validator reports each one and checks the rest.
    """
    doc = _dict(doc, file, None)
    out: dict[str, ShardingInfo] = {}
    parsed: dict[str, ShardingInfo | None] = {}
    for encoded, value in doc.items():
        try:
            name = base64.urlsafe_b64decode(encoded.encode("ascii")).decode("utf-8")
        except (ValueError, UnicodeError, binascii.Error):
            name = None
        # orbax looks an array's entry up by the exact encoding of its name
        if name is None or base64.urlsafe_b64encode(name.encode()).decode("ascii") != encoded:
            raise SchemaError("key is not the urlsafe base64 of a parameter name", file, f"entry {short_repr(encoded)}")
        where = f"entry {name!r}"
        if isinstance(value, str) and value in parsed:
            info = parsed[value]
        else:
            try:
                info = parse_sharding_entry(value, file, where)
            except SchemaError as exc:
                if errors is None:
                    raise
                errors.append((name, exc))
                continue
            if isinstance(value, str):
                parsed[value] = info
        if info is not None:
            out[name] = info
    return out


# -- array_metadatas/process_N -----------------------------------------------------


def parse_array_metadatas(doc: Any, file: str) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """{param_name: (write_shape, chunk_shape)}: orbax's array_metadata_store _from_dict."""
    doc = _dict(doc, file, None)
    items = doc.get("array_metadatas")
    if not isinstance(items, list):
        raise SchemaError(f"must be a list, got {short_repr(items)}", file, "array_metadatas")
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for i, item in enumerate(items):
        where = f"array_metadatas[{i}]"
        item = _dict(item, file, where)
        am = _dict(item.get("array_metadata"), file, f"{where}.array_metadata")
        for key in ("param_name", "write_shape", "chunk_shape"):
            if key not in am:
                raise SchemaError(f"lacks {key} (orbax requires it)", file, where)
        name = am["param_name"]
        if not isinstance(name, str):
            raise SchemaError(f"param_name must be a string, got {short_repr(name)}", file, where)
        write = int_list(am["write_shape"], file, f"{where}.write_shape")
        chunk = int_list(am["chunk_shape"], file, f"{where}.chunk_shape")
        if len(write) != len(chunk):
            raise SchemaError(f"write_shape {list(write)} and chunk_shape {list(chunk)} differ in rank", file, where)
        ext = am.get("ext_metadata")
        if ext is not None and not isinstance(ext, dict):
            raise SchemaError(f"ext_metadata must be an object or null, got {short_repr(ext)}", file, where)
        out[name] = (write, chunk)
    return out


# -- .zarray / zarr.json --------------------------------------------------------------


@dataclass(frozen=True)
class ZarrMeta:
    """One array's zarr metadata as ckpt uses it: shape, dtype, chunks, codecs and chunk key encoding."""

    shape: tuple[int, ...]
    dtype: str  # ckpt's dtype name
    chunk_shape: tuple[int, ...]
    info: dict[str, Any]  # codec facts shown by inspect
    separator: str  # zarr v2 dimension_separator / v3 chunk key separator
    default_keys: bool  # zarr v3 "default" chunk key encoding (c/ prefix)


_ZARR2_REQUIRED = ("zarr_format", "shape", "chunks", "dtype", "compressor", "fill_value", "order", "filters")
_ZARR2_MEMBERS = frozenset(_ZARR2_REQUIRED) | {"dimension_separator"}
_ZARR3_REQUIRED = ("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs", "fill_value")
_ZARR3_MEMBERS = frozenset(_ZARR3_REQUIRED) | {"attributes", "dimension_names", "storage_transformers"}


# the .zarray a tensorstore or orbax writer makes, which tensorstore always opens (tests/machinery/arrays/test_zarr_plain.py
# holds every form of it accepted by tensorstore): checked without it (see _plain_zarr2)
_PLAIN_ZARR2_DTYPES = frozenset({"<c16", "<c8", "<f2", "<f4", "<f8", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8",
                                 "bfloat16", "float8_e4m3fn", "float8_e5m2", "|b1", "|i1", "|u1"})
_PLAIN_MAX_RANK = 32  # (tensorstore's kMaxRank)
_PLAIN_MAX_CHUNK_BYTES = 1 << 30
_PLAIN_MAX_SHARDED_RANK = 31  # (tensorstore's sharding_indexed: its index has a dimension more)


def _plain_zarr2(known: dict[str, Any]) -> bool:
    """Whether a .zarray (its members parse_zarray checked already) is of the plain form tensorstore
    opens whatever else it holds: a dtype of the list, no fill value, no filters, no compressor or
    zstd at a level 0-22, at most 32 dimensions, a chunk under 1 GiB. Such metadata needs no
    tensorstore to be checked (issue 46: an Orbax inspect then imports no tensorstore); any other is
    given to tensorstore's own parser, which says what is wrong with it."""
    comp = known.get("compressor")
    if comp is not None:
        if comp.keys() != {"id", "level"} or comp["id"] != "zstd":
            return False
        level = comp["level"]
        if type(level) is not int or not 0 <= level <= 22:
            return False
    if known.get("fill_value") is not None or known.get("filters") is not None:
        return False
    dtype = known.get("dtype")
    if dtype not in _PLAIN_ZARR2_DTYPES or known.get("order") not in ("C", "F"):
        return False
    shape, chunks = known.get("shape"), known.get("chunks")
    if type(shape) is not list or type(chunks) is not list or len(shape) != len(chunks) or len(shape) > _PLAIN_MAX_RANK:
        return False
    if not all(type(n) is int and 0 <= n < 1 << 53 for n in shape):
        return False
    if not all(type(n) is int and 0 < n < 1 << 31 for n in chunks):
        return False
    return math.prod(chunks) * dtypes.from_zarr2(dtype).itemsize <= _PLAIN_MAX_CHUNK_BYTES


# zarr3: data_type -> (item size, the fill_value tensorstore writes for an array created without one)
_PLAIN_ZARR3_DTYPES: dict[str, tuple[int, Any]] = {
    "bool": (1, False),
    **{f"{k}int{b}": (b // 8, 0) for k in ("", "u") for b in (8, 16, 32, 64)},
    **{f"float{b}": (b // 8, 0.0) for b in (16, 32, 64)},
    "bfloat16": (2, 0.0), "float8_e4m3fn": (1, 0.0), "float8_e5m2": (1, 0.0),
    "complex64": (8, [0.0, 0.0]), "complex128": (16, [0.0, 0.0]),
}


def _plain_zarr3(known: dict[str, Any]) -> bool:
    """Whether a zarr.json (its members parse_zarr_json checked already) is of the form tensorstore
    writes for orbax's arrays (one chunk a shard: bytes and zstd inside, the index's bytes and
    crc32c at its end), which it opens whatever else it holds: a data type of the list and its
    zero fill value, the default chunk keys, no attributes, zstd at a level 0-22 without its
    checksum, at most 31 dimensions, a chunk under 1 GiB. Compared as canonical JSON text, where
    false, 0 and 0.0 differ as they do to tensorstore. As _plain_zarr2: no tensorstore to check it
    (issue 46: a local reshard of a zarr3 Orbax source then imports none); any other form is given
    to tensorstore's parser."""
    dtype, shape, grid = known.get("data_type"), known.get("shape"), known.get("chunk_grid")
    if dtype not in _PLAIN_ZARR3_DTYPES or type(shape) is not list or not isinstance(grid, dict):
        return False
    chunks = (grid.get("configuration") or {}).get("chunk_shape") if isinstance(grid.get("configuration"), dict) else None
    if type(chunks) is not list or len(shape) != len(chunks) or len(shape) > _PLAIN_MAX_SHARDED_RANK:
        return False
    if not all(type(n) is int and 0 <= n < 1 << 53 for n in shape) or not all(type(n) is int and 0 < n < 1 << 31 for n in chunks):
        return False
    try:
        (shard,) = known["codecs"]
        level = shard["configuration"]["codecs"][1]["configuration"]["level"]
    except (KeyError, IndexError, TypeError, ValueError):
        return False
    if type(level) is not int or not 0 <= level <= 22:
        return False
    size, fill = _PLAIN_ZARR3_DTYPES[dtype]
    inner_bytes: dict[str, Any] = {"name": "bytes"} if size == 1 else {"name": "bytes", "configuration": {"endian": "little"}}
    plain = {
        "zarr_format": 3, "node_type": "array", "shape": shape, "data_type": dtype, "fill_value": fill,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": chunks,
            "codecs": [inner_bytes, {"name": "zstd", "configuration": {"level": level, "checksum": False}}],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        }}],
    }
    try:
        same = json.dumps(known, sort_keys=True) == json.dumps(plain, sort_keys=True)
    except (TypeError, ValueError):
        return False
    return same and math.prod(chunks) * size <= _PLAIN_MAX_CHUNK_BYTES


def _tensorstore_check(zmeta: dict[str, Any], driver: str, members: frozenset[str], file: str) -> None:
    """Give the metadata to tensorstore's own JSON parser: what it rejects, opening would reject."""
    known = {k: v for k, v in zmeta.items() if k in members}  # a reader ignores members it does not know
    if driver == "zarr" and type(known.get("zarr_format")) is int and known["zarr_format"] == 2 and _plain_zarr2(known):
        return
    if driver == "zarr3" and _plain_zarr3(known):
        return
    import tensorstore as ts

    try:
        ts.Spec({"driver": driver, "kvstore": {"driver": "memory"}, "metadata": known})
    except Exception as exc:  # tensorstore raises ValueError with its status text
        text = str(exc).replace('Error parsing object member "metadata": ', "")
        raise SchemaError(f"tensorstore rejects it: {text}", file) from None
    problem = _stored_metadata_problem(driver, json.dumps(known, sort_keys=True))
    if problem:
        raise SchemaError(f"tensorstore rejects it: {problem}", file)


@functools.lru_cache(maxsize=4096)
def _stored_metadata_problem(driver: str, text: str) -> str | None:
    """Why tensorstore would not open an array whose stored metadata file holds `text`, or None.

    The readers open each array with the metadata already read (assume_metadata: no second read of
    every `.zarray` / `zarr.json`), where tensorstore takes it as constraints and fills what is left
    out (a zarr v3 `bytes` codec without its `endian`); a stored file is stricter, and it is the
    stored file orbax opens. So the text is opened as a stored file, from memory: once per distinct
    metadata (arrays of one shape and dtype share theirs).
    """
    import tensorstore as ts

    context = ts.Context()
    store = ts.KvStore.open({"driver": "memory"}, context=context).result()
    store.write(".zarray" if driver == "zarr" else "zarr.json", text.encode()).result()
    try:
        ts.open({"driver": driver, "kvstore": {"driver": "memory"}}, open=True, context=context).result()
    except Exception as exc:  # tensorstore's status text
        return str(exc).replace('Error opening "zarr3" driver: ', "").replace('Error opening "zarr" driver: ', "")
    return None


def _zarr_members(zmeta: Any, file: str, required: Any, version: int) -> dict:
    """A zarr metadata object with the members tensorstore requires and its zarr_format."""
    zmeta = _dict(zmeta, file, None)
    for key in required:
        if key not in zmeta:
            raise SchemaError("missing (tensorstore requires it)", file, key)
    if _as_int(zmeta["zarr_format"]) != version:
        raise SchemaError(f"must be {version}, got {short_repr(zmeta['zarr_format'])}", file, "zarr_format")
    return zmeta


def parse_zarray(zmeta: Any, file: str) -> ZarrMeta:
    """`.zarray` (zarr v2), as tensorstore's zarr driver reads it."""
    zmeta = _zarr_members(zmeta, file, _ZARR2_REQUIRED, 2)
    shape = int_list(zmeta["shape"], file, "shape")
    chunks = int_list(zmeta["chunks"], file, "chunks", positive=True)
    if len(chunks) != len(shape):
        raise SchemaError(f"{list(chunks)} has rank {len(chunks)}, shape {list(shape)} has rank {len(shape)}", file, "chunks")
    sep = zmeta.get("dimension_separator", ".")
    if sep not in (".", "/"):
        raise SchemaError(f"must be '.' or '/', got {short_repr(sep)}", file, "dimension_separator")
    if zmeta["order"] not in ("C", "F"):
        raise SchemaError(f"must be 'C' or 'F', got {short_repr(zmeta['order'])}", file, "order")
    comp = zmeta["compressor"]
    if comp is not None and not (isinstance(comp, dict) and isinstance(comp.get("id"), str)):
        raise SchemaError(f"must be null or an object with an id, got {short_repr(comp)}", file, "compressor")
    filters = zmeta["filters"]
    if filters not in (None, []):
        raise SchemaError(f"filters are not supported by tensorstore, got {short_repr(filters)}", file, "filters")
    if not isinstance(zmeta["dtype"], str):
        # structured dtypes: tensorstore reads them, ckpt does not model them
        raise SchemaError(f"must be a dtype string, got {short_repr(zmeta['dtype'])}", file, "dtype")
    try:
        dtype = dtypes.from_zarr2(zmeta["dtype"])
    except CkptError as exc:
        raise SchemaError(exc.message, file, "dtype") from None
    _tensorstore_check(zmeta, "zarr", _ZARR2_MEMBERS, file)
    check_array_size(shape, dtype.itemsize, file)
    check_array_size(chunks, dtype.itemsize, file, "chunks")
    check_chunk_count(shape, chunks, file)
    info = {"compressor": comp.get("id") if isinstance(comp, dict) else None}
    return ZarrMeta(shape, dtype.name, chunks, info, sep, False)


def parse_zarr_json(zmeta: Any, file: str) -> ZarrMeta:
    """`zarr.json` (zarr v3), as tensorstore's zarr3 driver reads it."""
    zmeta = _zarr_members(zmeta, file, _ZARR3_REQUIRED, 3)
    if zmeta["node_type"] != "array":
        raise SchemaError(f"must be 'array', got {short_repr(zmeta['node_type'])}", file, "node_type")
    shape = int_list(zmeta["shape"], file, "shape")
    grid = _dict(zmeta["chunk_grid"], file, "chunk_grid")
    if grid.get("name") != "regular":
        raise SchemaError(f"name must be 'regular', got {short_repr(grid.get('name'))}", file, "chunk_grid")
    chunks = int_list(_dict(grid.get("configuration"), file, "chunk_grid.configuration").get("chunk_shape"),
                      file, "chunk_grid.configuration.chunk_shape", positive=True)
    if len(chunks) != len(shape):
        raise SchemaError(f"{list(chunks)} has rank {len(chunks)}, shape {list(shape)} has rank {len(shape)}", file, "chunk_grid")
    if not isinstance(zmeta["data_type"], str):
        raise SchemaError(f"must be a data type name, got {short_repr(zmeta['data_type'])}", file, "data_type")
    try:
        dtype = dtypes.from_zarr3(zmeta["data_type"])
    except CkptError as exc:
        raise SchemaError(exc.message, file, "data_type") from None
    enc = _dict(zmeta["chunk_key_encoding"], file, "chunk_key_encoding")
    enc_name = enc.get("name")
    if enc_name not in ("default", "v2"):
        raise SchemaError(f"name must be 'default' or 'v2', got {short_repr(enc_name)}", file, "chunk_key_encoding")
    cfg = enc.get("configuration") or {}
    cfg = _dict(cfg, file, "chunk_key_encoding.configuration")
    sep = cfg.get("separator", "/" if enc_name == "default" else ".")
    if sep not in (".", "/"):
        raise SchemaError(f"separator must be '.' or '/', got {short_repr(sep)}", file, "chunk_key_encoding")
    codecs = zmeta["codecs"]
    if not isinstance(codecs, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in codecs):
        raise SchemaError(f"must be a list of {{name, configuration}}, got {short_repr(codecs)}", file, "codecs")
    _tensorstore_check(zmeta, "zarr3", _ZARR3_MEMBERS, file)
    check_array_size(shape, dtype.itemsize, file)
    info: dict[str, Any] = {"codecs": [c["name"] for c in codecs]}
    for codec in codecs:
        if codec["name"] == "sharding_indexed":
            ccfg = codec.get("configuration") or {}
            inner = ccfg.get("chunk_shape")
            info["inner_chunk_shape"] = list(int_list(inner, file, "codecs.sharding_indexed.chunk_shape", positive=True))
            info["codecs"] = ["sharding_indexed"] + [c.get("name") for c in ccfg.get("codecs", []) if isinstance(c, dict)]
    check_array_size(chunks, dtype.itemsize, file, "chunk_grid")
    check_chunk_count(shape, chunks, file)
    return ZarrMeta(shape, dtype.name, chunks, info, sep, enc_name == "default")


def parse_zarr_metadata(zmeta: Any, zarr3: bool, file: str) -> ZarrMeta:
    return parse_zarr_json(zmeta, file) if zarr3 else parse_zarray(zmeta, file)


# -- _strings.json --------------------------------------------------------------------


def parse_strings(doc: Any, file: str) -> dict[str, str]:
    """`_strings.json`: {param name: string} (orbax's StringHandler)."""
    doc = _dict(doc, file, None)
    for k, v in doc.items():
        if not isinstance(v, str):
            raise SchemaError(f"must be a string, got {short_repr(v)}", file, f"entry {k!r}")
    return doc


# -- shapes across files ----------------------------------------------------------------


def shape_disagreement(shape: tuple[int, ...], write_shape: tuple[int, ...] | list[int] | None) -> str | None:
    """Why a per-device write shape cannot belong to an array of `shape` (None when it can)."""
    if write_shape is None:
        return None
    ws = tuple(write_shape)
    if len(ws) != len(shape):
        return f"write shape {list(ws)} has rank {len(ws)}, the array has rank {len(shape)}"
    for dim, (s, w) in enumerate(zip(shape, ws)):
        if w > s or (s > 0 and w == 0):
            return f"dimension {dim}: the array has size {s} but each write covers {w}"
    return None
