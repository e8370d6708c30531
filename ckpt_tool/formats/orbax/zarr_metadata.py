"""The zarr metadata (`.zarray` / `zarr.json`) tensorstore writes for the Orbax output's arrays,
byte for byte, for hundreds of arrays at the cost of a few tensorstore opens.

The Orbax writer puts on disk exactly the metadata tensorstore's zarr driver writes for orbax's
spec (direct.py). Asking tensorstore once per array (an in-memory open) cost 0.5 s for the 632
leaves of a full Adam state on a TPU host, twice over (the plan asks each array's encoding, the
writer its metadata): a quarter of a reshard's whole time there. Yet the arrays of a checkpoint
differ mostly in shape and chunk shape: tensorstore is asked for one array of each kind (the
spec with the shapes left out, and the rank), the shapes are then put into its answer, and the
answer is checked twice before it is trusted: the first array's metadata must be what its
parsed JSON dumps back to, and a second array's derived metadata must be what tensorstore
itself writes for it. A kind that fails either check is asked of tensorstore array by array,
as before.
"""
from __future__ import annotations

import copy
import json
import threading
from typing import Any

import tensorstore as ts

from ...errors import CkptError
from ...storage import ts_error_text

# where the shapes sit in orbax's spec["metadata"] and in what tensorstore writes (the same paths)
_SHAPE_PATHS = {
    False: (("shape",), ("chunks",)),
    True: (("shape",), ("chunk_grid", "configuration", "chunk_shape"), ("codecs", 0, "configuration", "chunk_shape")),
}


def metadata_key(zarr3: bool) -> str:
    return "zarr.json" if zarr3 else ".zarray"


def from_tensorstore(specs: dict[str, dict[str, Any]], zarr3: bool) -> dict[str, bytes]:
    """name -> the metadata tensorstore writes for each spec (a zarr spec without kvstore), every
    array created at once in memory."""
    context = ts.Context()
    futures = {}
    try:
        for name, spec in specs.items():
            futures[name] = ts.open({**spec, "kvstore": {"driver": "memory", "path": name + "/"}},
                                    create=True, context=context)
        for fut in futures.values():
            fut.result()
        kv = ts.KvStore.open({"driver": "memory"}, context=context).result()
        key = metadata_key(zarr3)
        reads = {name: kv.read(f"{name}/{key}".encode()) for name in specs}
        got = {name: fut.result() for name, fut in reads.items()}
    except Exception as exc:  # noqa: BLE001 - tensorstore refused orbax's own metadata
        raise CkptError(f"cannot create the output array's metadata: {ts_error_text(exc)}",
                        next(iter(specs), "")) from exc
    out = {}
    for name, res in got.items():
        if res.state != "value":
            raise CkptError("tensorstore wrote no metadata for the array", name)
        out[name] = bytes(res.value)
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    _get(doc, path[:-1])[path[-1]] = value


def _dump(doc: Any) -> bytes:
    # tensorstore's (nlohmann's) compact form; the keys keep the order they were parsed in
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _kind(spec: dict[str, Any], zarr3: bool) -> str | None:
    """The spec with its shapes left out (their rank kept): arrays of one kind get metadata that
    differs only in the shapes. None when the spec lacks a shape path (asked of tensorstore)."""
    try:
        bare = copy.deepcopy(spec)
        for path in _SHAPE_PATHS[zarr3]:
            _set(bare["metadata"], path, len(_get(spec["metadata"], path)))
        return json.dumps(bare, sort_keys=True)
    except (KeyError, IndexError, TypeError):
        return None


class _Kinds:
    """kind -> tensorstore's metadata of one array of that kind, parsed (None: not derivable)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.templates: dict[str, dict[str, Any] | None] = {}


_KINDS = _Kinds()


def _derive(template: dict[str, Any], spec: dict[str, Any], zarr3: bool) -> bytes | None:
    doc = copy.deepcopy(template)
    try:
        for path in _SHAPE_PATHS[zarr3]:
            _get(doc, path)  # tensorstore wrote it there: else the kind is not derivable
            _set(doc, path, list(_get(spec["metadata"], path)))
    except (KeyError, IndexError, TypeError):
        return None
    return _dump(doc)


def _learn(kind: str, members: list[tuple[str, dict[str, Any]]], zarr3: bool) -> dict[str, bytes]:
    """Ask tensorstore for one member (two where there are two), keep the kind's template when
    the checks hold; the members asked, name -> metadata."""
    asked = members[:2]
    got = from_tensorstore(dict(asked), zarr3)
    first_name, _ = asked[0]
    template: dict[str, Any] | None = json.loads(got[first_name])
    if _dump(template) != got[first_name]:
        template = None
    if template is not None and len(asked) == 2:
        second_name, second_spec = asked[1]
        if _derive(template, second_spec, zarr3) != got[second_name]:
            template = None
    if template is not None and len(asked) == 1:
        return got  # one member: nothing checked the derivation yet, so none is kept
    with _KINDS.lock:
        _KINDS.templates[kind] = template
    return got


def metadata(specs: dict[str, dict[str, Any]], zarr3: bool) -> dict[str, bytes]:
    """name -> the `.zarray` / `zarr.json` tensorstore writes for each array spec (zarr or zarr3
    driver, dtype and metadata as the Orbax writer opens it, without kvstore), byte for byte."""
    by_kind: dict[str | None, list[tuple[str, dict[str, Any]]]] = {}
    for name, spec in specs.items():
        by_kind.setdefault(_kind(spec, zarr3), []).append((name, spec))
    out: dict[str, bytes] = {}
    unknown: dict[str, dict[str, Any]] = dict(by_kind.pop(None, []))
    for kind, members in by_kind.items():
        assert kind is not None
        with _KINDS.lock:
            learnt = kind in _KINDS.templates
            template = _KINDS.templates.get(kind)
        if not learnt:
            out.update(_learn(kind, members, zarr3))
            with _KINDS.lock:
                learnt = kind in _KINDS.templates
                template = _KINDS.templates.get(kind)
            members = [(n, s) for n, s in members if n not in out]
        for name, spec in members:
            derived = _derive(template, spec, zarr3) if template is not None else None
            if derived is None:
                unknown[name] = spec
            else:
                out[name] = derived
    if unknown:
        out.update(from_tensorstore(unknown, zarr3))
    return out
