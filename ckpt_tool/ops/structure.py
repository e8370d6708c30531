"""A `ckpt inspect --json` document read back as a structure-only checkpoint.

CI can keep the few kilobytes of `ckpt inspect CKPT --json` instead of a
reference checkpoint and later ask `ckpt diff CKPT expected.json` whether a
new save still has those keys, kinds, shapes and dtypes. This module turns
such a file into a Checkpoint whose leaves carry only what the document
records (no reader, no loader: there is no array data in it).

The document is input like any other: its size is bounded before it is
parsed, Python's JSON parser bounds its nesting (a RecursionError is a
refusal, not a crash), and every field this module uses is type-checked, so
a damaged, hand-edited or unrelated JSON file is one line naming the file
and the field. Fields outside the schema 1 contract are ignored, and only
`keys` and `kind` (plus `shape` and `dtype` for arrays) are required, so an
expected file may also be written by hand or generated from model code.
"""
from __future__ import annotations

import json
import math
import os
import reprlib
import stat
from dataclasses import dataclass
from typing import Any, Sequence

from ..base import dtypes
from ..base.errors import CkptError, CorruptMetadataError, NotFoundError
from .inspect import JSON_SCHEMA_VERSION
from ..core.model import ArrayLeaf, Checkpoint, Key, Leaf, RegularGrid, Sharding, ValueLeaf, keys_path

# An inspect document is metadata only: about 0.5 KiB per leaf, more with a
# large mesh's device ids. 256 MiB is far above any real model's and keeps
# the parsed document to a few GB at worst.
MAX_DOCUMENT_BYTES = 256 * 2**20

# a dimension no storage holds; keeps element counts in sane integer ranges
MAX_DIM = 2**62

# leaf fields whose absence means "not recorded": `diff --layout` compares
# them only where both sides record them
LAYOUT_FIELDS = ("chunk_shape", "chunks", "sharding")


@dataclass(frozen=True)
class RecordedChunks:
    """A leaf's chunk layout as the document records it: the common chunk
    shape (or None) and the chunk count, without the chunks themselves."""

    chunk_shape: tuple[int, ...] | None
    chunks: int

    def count(self, shape: Sequence[int]) -> int:
        return self.chunks


@dataclass(repr=False)
class RecordedStructure(Checkpoint):
    """The structure an inspect document recorded; `path` is the document's file.

    `source` is the checkpoint the document was made from (its "path" field),
    `step` the step it showed. Its leaves cannot be read; each array leaf's
    `extra["recorded_fields"]` says which of LAYOUT_FIELDS the document has."""

    source: str | None = None


def is_inspect_json_file(path: str) -> bool:
    """Whether `path` names a local regular file holding a JSON document
    (rather than a checkpoint): a `.json` name, or text starting with `{`.

    A directory or a URL is a checkpoint. Binary single-file formats cannot
    pass for JSON: safetensors starts with an 8-byte length (NUL bytes),
    msgpack files with a map marker (0x80-0x8f, 0xde, 0xdf)."""
    if "://" in path:
        return False
    named_json = path.lower().endswith(".json")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return named_json  # then "no such file", not "no such directory"
    except (OSError, ValueError):
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    if named_json:
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    return text[:1] == b"{" and b"\x00" not in head


def load_structure(path: str) -> RecordedStructure:
    """Read and check the inspect JSON document at local file `path`."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_DOCUMENT_BYTES:
                raise CorruptMetadataError(_too_large(size), path)
            # read one byte more than allowed: a file growing meanwhile is caught too
            data = f.read(MAX_DOCUMENT_BYTES + 1)
    except FileNotFoundError:
        raise NotFoundError("no such file", path) from None
    except IsADirectoryError:
        raise CkptError("is a directory, not an inspect JSON document", path) from None
    except OSError as exc:
        raise CkptError(f"cannot read: {exc.strerror or exc}", path) from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise CorruptMetadataError(_too_large(len(data)), path)
    try:
        text = data.decode("utf-8-sig")  # JSON is UTF-8 (RFC 8259); a BOM is tolerated
    except UnicodeDecodeError as exc:
        raise CorruptMetadataError(
            f"not an inspect JSON document: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})", path
        ) from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise CorruptMetadataError(
            "not an inspect JSON document: nested too deeply (an inspect document is a few levels deep)", path
        ) from None
    except json.JSONDecodeError as exc:
        raise CorruptMetadataError(
            f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", path
        ) from None
    except ValueError as exc:  # an integer with more digits than Python converts (4300)
        reason = "an integer with thousands of digits" if "digits" in str(exc) else str(exc)
        raise CorruptMetadataError(f"not valid JSON: {reason}", path) from None
    return structure_from_document(doc, path)


def _too_large(size: int) -> str:
    return (
        f"{size:,} bytes, over the {MAX_DOCUMENT_BYTES // 2**20} MiB an inspect JSON document may have "
        "(it holds metadata only)"
    )


def structure_from_document(doc: Any, where: str) -> RecordedStructure:
    """The structure a parsed inspect document records; CorruptMetadataError
    (naming `where` and the field) on anything that breaks the contract."""
    if not isinstance(doc, dict):
        raise _bad(where, None, f"not an inspect JSON document: the top level is {_type(doc)}, not an object")
    if "schema" not in doc:
        raise _bad(where, None, "not an inspect JSON document (`ckpt inspect --json`): no 'schema' field" + _what_it_is(doc))
    schema = doc["schema"]
    if not _is_int(schema):
        raise _bad(where, "schema", f"expected an integer, got {_type(schema)}")
    if schema != JSON_SCHEMA_VERSION:
        newer = " (written by a newer ckpt)" if schema > JSON_SCHEMA_VERSION else ""
        raise _bad(where, None, f"schema {schema}{newer}; this ckpt reads inspect JSON schema {JSON_SCHEMA_VERSION}")
    if "leaves" not in doc:
        raise _bad(where, None, "no 'leaves' field")
    raw_leaves = doc["leaves"]
    if not isinstance(raw_leaves, list):
        raise _bad(where, "leaves", f"expected a list, got {_type(raw_leaves)}")
    source = _optional(doc, "path", str, where)
    fmt = _optional(doc, "format", str, where)
    step = doc.get("step")
    if step is not None and not _is_int(step):
        raise _bad(where, "step", f"expected an integer or null, got {_type(step)}")
    layout = doc.get("layout")
    if layout is not None and not isinstance(layout, dict):
        raise _bad(where, "layout", f"expected an object or null, got {_type(layout)}")
    committed = doc.get("committed", True)
    if not isinstance(committed, bool):
        raise _bad(where, "committed", f"expected true or false, got {_type(committed)}")

    leaves: list[Leaf] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(raw_leaves):
        leaf = _leaf(raw, f"leaves[{i}]", where)
        if leaf.path in seen:
            raise _bad(where, f"leaves[{i}]", f"leaf {leaf.path!r} is listed twice (also leaves[{seen[leaf.path]}])")
        seen[leaf.path] = i
        leaves.append(leaf)
    return RecordedStructure(
        path=where, format=fmt or "unknown", layout=dict(layout or {}), leaves=leaves,
        committed=committed, step=step, source=source,
    )


def _leaf(raw: Any, at: str, where: str) -> Leaf:
    if not isinstance(raw, dict):
        raise _bad(where, at, f"expected an object, got {_type(raw)}")
    if "keys" not in raw:
        raise _bad(where, at, "no 'keys' field")
    keys = raw["keys"]
    if not isinstance(keys, list) or not all(isinstance(k, str) or _is_int(k) for k in keys):
        raise _bad(where, f"{at}.keys", "expected a list of strings and integers")
    path_keys: tuple[Key, ...] = tuple(keys)
    # from here on, name the leaf as well as the index: people edit these files by path
    at = f"{at} ({keys_path(path_keys) or '(root)'})"
    name = raw.get("name", keys_path(path_keys))
    if not isinstance(name, str):
        raise _bad(where, f"{at}.name", f"expected a string, got {_type(name)}")
    if "kind" not in raw:
        raise _bad(where, at, "no 'kind' field")
    kind = raw["kind"]
    if kind == "value":
        value_type = _optional(raw, "value_type", str, where, at) or "unknown"
        dtype = _optional(raw, "dtype", str, where, at)
        return ValueLeaf(path_keys, name, value_type, dtype)
    if kind != "array":
        raise _bad(where, f"{at}.kind", f"expected 'array' or 'value', got {_short(kind)}")
    for required in ("shape", "dtype"):
        if required not in raw:
            raise _bad(where, at, f"an array leaf without '{required}'")
    shape = _dims(raw["shape"], f"{at}.shape", where)
    dtype = raw["dtype"]
    if not isinstance(dtype, str):
        raise _bad(where, f"{at}.dtype", f"expected a string, got {_type(dtype)}")
    if dtype not in dtypes.BY_NAME:
        raise _bad(where, f"{at}.dtype", f"unknown dtype {_short(dtype)} (known: {', '.join(dtypes.BY_NAME)})")
    chunk_shape: tuple[int, ...] | None = None
    if raw.get("chunk_shape") is not None:
        chunk_shape = _dims(raw["chunk_shape"], f"{at}.chunk_shape", where)
        if len(chunk_shape) != len(shape):
            raise _bad(where, f"{at}.chunk_shape", f"rank {len(chunk_shape)}, the shape has rank {len(shape)}")
    if "chunks" in raw:
        chunks = raw["chunks"]
        if not _is_int(chunks) or chunks < 0:
            raise _bad(where, f"{at}.chunks", f"expected a non-negative integer, got {_short(chunks)}")
    else:  # not recorded: what the chunk shape implies, for the summary only
        chunks = RegularGrid(chunk_shape).count(shape) if chunk_shape is not None else 1
    sharding = _sharding(raw.get("sharding"), f"{at}.sharding", where)
    recorded = frozenset(f for f in LAYOUT_FIELDS if f in raw)
    return ArrayLeaf(
        path_keys, name, shape, dtype, RecordedChunks(chunk_shape, chunks), sharding,  # type: ignore[arg-type]
        extra={"recorded_fields": recorded},
    )


def _dims(value: Any, at: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(d) and 0 <= d <= MAX_DIM for d in value):
        raise _bad(where, at, f"expected a list of non-negative integers, got {_short(value)}")
    if math.prod(value) > MAX_DIM:
        raise _bad(where, at, f"{_short(value)} has more elements than any storage holds")
    return tuple(value)


def _sharding(raw: Any, at: str, where: str) -> Sharding | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _bad(where, at, f"expected an object or null, got {_type(raw)}")
    kind = raw.get("kind")
    if not isinstance(kind, str):
        raise _bad(where, f"{at}.kind", f"expected a string, got {_type(kind)}")

    def ints(name: str) -> tuple[int, ...] | None:
        v = raw.get(name)
        if v is None:
            return None
        if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
            raise _bad(where, f"{at}.{name}", f"expected a list of non-negative integers, got {_short(v)}")
        return tuple(v)

    axis_names = raw.get("axis_names")
    if axis_names is not None:
        if not isinstance(axis_names, list) or not all(isinstance(a, str) for a in axis_names):
            raise _bad(where, f"{at}.axis_names", f"expected a list of strings, got {_short(axis_names)}")
        axis_names = tuple(axis_names)
    spec = raw.get("partition_spec")
    if spec is not None:
        if not isinstance(spec, list):
            raise _bad(where, f"{at}.partition_spec", f"expected a list, got {_type(spec)}")
        entries: list[Any] = []
        for j, p in enumerate(spec):
            if p is None or isinstance(p, str):
                entries.append(p)
            elif isinstance(p, list) and all(isinstance(a, str) for a in p):
                entries.append(tuple(p))
            else:
                raise _bad(where, f"{at}.partition_spec[{j}]", f"expected null, an axis name or a list of them, got {_short(p)}")
        spec = tuple(entries)
    device = raw.get("device")
    if device is not None and not isinstance(device, str):
        raise _bad(where, f"{at}.device", f"expected a string, got {_type(device)}")
    chunks = raw.get("chunks")
    if chunks is not None and not (_is_int(chunks) and chunks >= 0):
        raise _bad(where, f"{at}.chunks", f"expected a non-negative integer, got {_short(chunks)}")
    return Sharding(
        kind=kind, mesh_shape=ints("mesh_shape"), axis_names=axis_names, partition_spec=spec,
        device_ids=ints("device_ids"), device=device, chunks=chunks,
    )


def _optional(obj: dict[str, Any], name: str, typ: type, where: str, at: str | None = None) -> Any:
    value = obj.get(name)
    if value is not None and not isinstance(value, typ):
        field_name = f"{at}.{name}" if at else name
        raise _bad(where, field_name, f"expected a {typ.__name__} or null, got {_type(value)}")
    return value


def _what_it_is(doc: dict[str, Any]) -> str:
    """A hint when the file is another ckpt command's JSON output."""
    if "differences" in doc and "same" in doc:
        return "; this is `ckpt diff --json` output"
    if "findings" in doc and "ok" in doc:
        return "; this is `ckpt validate --json` output"
    return ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


# a bounded rendering of whatever a damaged document holds (however large or deep)
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 2, 30, 30


def _short(value: Any) -> str:
    return _REPR.repr(value)


def _bad(where: str, at: str | None, message: str) -> CorruptMetadataError:
    return CorruptMetadataError(f"{at}: {message}" if at else message, where)
