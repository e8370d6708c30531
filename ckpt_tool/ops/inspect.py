"""What is in a checkpoint: the result `ckpt inspect` renders.

`inspect_checkpoint` opens the checkpoint (metadata only), applies the
filter, optionally decodes value leaves, and returns an InspectResult whose
`to_json()` is the documented --json contract.
"""
from __future__ import annotations

import collections
import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, cast

from ..core import values
from ..base.errors import CkptError
from ..core.model import ArrayLeaf, Checkpoint, Leaf, ValueLeaf

JSON_SCHEMA_VERSION = 1

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_LAYOUT = operator.attrgetter("layout")
_ARRAYS_ONLY = frozenset({ArrayLeaf})
_ARRAYS_AND_VALUES = frozenset({ArrayLeaf, ValueLeaf})


@dataclass
class DtypeTotals:
    leaves: int = 0
    parameters: int = 0
    bytes: int = 0


@dataclass
class InspectResult:
    checkpoint: Checkpoint
    leaves: list[Leaf]  # after --filter
    values: dict[str, Any] | None  # leaf path -> decoded value, with --values
    value_errors: dict[str, str]

    @functools.cached_property
    def by_dtype(self) -> dict[str, DtypeTotals]:
        totals: dict[str, DtypeTotals] = {}
        plain = self._plain_arrays
        if plain is not None:
            # every array leaf an ArrayLeaf itself: counted by (dtype, shape) in C, each pair's size
            # and bytes asked of one leaf of it (30,000 DCP leaves of a few shapes were 90,000
            # property calls here, issue 46); dtypes in the order the leaves first name them
            pairs = list(zip(map(_DTYPE, plain), map(_SHAPE, plain)))
            one_of = dict(zip(pairs, plain))
            for pair, count in collections.Counter(pairs).items():
                one = one_of[pair]
                t = totals.get(pair[0])
                if t is None:
                    t = totals[pair[0]] = DtypeTotals()
                t.leaves += count
                t.parameters += one.size * count
                t.bytes += one.nbytes * count
            return dict(sorted(totals.items(), key=lambda kv: -kv[1].bytes))
        for leaf in self.leaves:
            if isinstance(leaf, ArrayLeaf):
                t = totals.get(leaf.dtype)
                if t is None:
                    t = totals[leaf.dtype] = DtypeTotals()
                t.leaves += 1
                t.parameters += leaf.size
                t.bytes += leaf.nbytes
        return dict(sorted(totals.items(), key=lambda kv: -kv[1].bytes))

    @functools.cached_property
    def _plain_arrays(self) -> list[ArrayLeaf] | None:
        """The array leaves when each is an ArrayLeaf itself (whose size, bytes and chunk count
        follow from its shape, dtype and layout alone), else None (a subclass may say otherwise)."""
        kinds = set(map(type, self.leaves))
        if kinds <= _ARRAYS_ONLY:
            return cast("list[ArrayLeaf]", self.leaves)
        if kinds <= _ARRAYS_AND_VALUES:
            return [leaf for leaf in self.leaves if isinstance(leaf, ArrayLeaf)]
        return None

    def _chunk_total(self) -> int:
        plain = self._plain_arrays
        if plain is None:
            return sum(leaf.chunk_count for leaf in self.leaves if isinstance(leaf, ArrayLeaf))
        # by (layout, shape), as by_dtype counts (leaves saved alike share their layout object)
        pairs = list(zip(map(id, map(_LAYOUT, plain)), map(_SHAPE, plain)))
        one_of = dict(zip(pairs, plain))
        return sum(one_of[pair].chunk_count * count for pair, count in collections.Counter(pairs).items())

    @functools.cached_property
    def summary(self) -> dict[str, Any]:
        by_dtype = self.by_dtype
        arrays = sum(t.leaves for t in by_dtype.values())
        return {
            "leaves": len(self.leaves),
            "arrays": arrays,
            "values": len(self.leaves) - arrays,
            "parameters": sum(t.parameters for t in by_dtype.values()),
            "bytes": sum(t.bytes for t in by_dtype.values()),
            "chunks": self._chunk_total(),
            "by_dtype": {
                d: {"leaves": t.leaves, "parameters": t.parameters, "bytes": t.bytes}
                for d, t in self.by_dtype.items()
            },
        }

    def to_json(self, leaves: bool = True) -> dict[str, Any]:
        """The --json document (`leaves`: False leaves out the leaves' list, to_json_text's part)."""
        ck = self.checkpoint
        # arrays saved alike have equal Sharding values (one object, or one per leaf): render
        # each distinct value once (the output then shares that dict between leaves); 2,250
        # leaves of one mesh and spec were 2,250 to_json calls, a tenth of inspect's output time
        shardings: dict[Any, dict[str, Any]] = {}
        # and the same object met again is found by its id, without hashing the dataclass (a Python
        # __hash__ per leaf): DCP's 30,000 leaves share one Sharding object (issue 46)
        by_id: dict[int, dict[str, Any]] = {}
        return {
            "schema": JSON_SCHEMA_VERSION,
            "path": ck.path,
            "format": ck.format,
            "layout": ck.layout,
            "committed": ck.committed,
            # committed, uncommitted, or incomplete: committed but data files missing (listed in "missing")
            "status": ck.status,
            "missing": [m.to_json() for m in ck.missing],
            "saved_at": ck.saved_at,
            "step": ck.step,
            "steps": [s.to_json() for s in ck.steps],
            "notes": list(ck.notes),
            "leaves": [self._leaf_json(leaf, shardings, by_id) for leaf in self.leaves] if leaves else None,
            "summary": self.summary,
        }

    def to_json_text(self, before: dict[str, Any], after: dict[str, Any]) -> str:
        """json.dumps({**before, **self.to_json(), **after}, default=str) in its compact form (a
        pipe's, what scripts read), written without building the leaves' dicts: each array leaf's
        text is put together from its fields in _leaf_json's order (tests/ops/inspect checks the
        two agree byte for byte), a shape's and a sharding's text made once. 30,000 leaves took
        0.12 s through the dicts and json.dumps, 0.03 s here (issue 46)."""
        import json

        doc = {**before, **self.to_json(leaves=False), **after}
        doc["leaves"] = _LEAVES_MARK
        text = json.dumps(doc, default=str, ensure_ascii=True)
        head, mark, tail = text.partition(_LEAVES_TEXT)
        if not mark or _LEAVES_TEXT in tail:  # (a value spelled like the mark: through the dicts)
            return json.dumps({**before, **self.to_json(), **after}, default=str, ensure_ascii=True)
        return head + '"leaves": [' + ", ".join(self._leaf_texts()) + "]" + tail

    def _leaf_texts(self) -> list[str]:
        import json
        from json.encoder import encode_basestring_ascii  # (json.dumps' own, in C; TypeError for a non-str)

        string: Callable[[Any], str] = encode_basestring_ascii

        out = []
        lists: dict[tuple[int, ...], str | None] = {}  # a tuple of ints -> its JSON list (None: not all ints)
        # a sharding's text, by the object's id (the leaves keep their Sharding objects alive while
        # this runs), then by its value, as _leaf_json shares them: equal values, one json.dumps
        # (an Orbax reader's 3,000 leaves have 3,000 Sharding objects of a few values)
        sharding_texts: dict[int, str] = {id(None): "null"}
        by_value: dict[Any, str] = {}
        # an ArrayLeaf's text after its name follows from its shape, dtype, layout and sharding (its
        # bytes and chunk count from those): made once for leaves saved alike (DCP's 30,000 leaves:
        # a few texts), the layout by its object's id; None where the leaf's fields take json.dumps
        tails: dict[tuple[Any, str, int, str], str | None] = {}
        shared: dict[Any, dict[str, Any]] = {}
        by_id: dict[int, dict[str, Any]] = {}
        for leaf in self.leaves:
            if type(leaf) is ArrayLeaf:
                sharding = leaf.sharding
                try:
                    sharding_text = sharding_texts.get(id(sharding))
                    if sharding_text is None:
                        sharding_text = sharding_texts[id(sharding)] = _sharding_text(sharding, by_value)
                    tail_key = (leaf.shape, leaf.dtype, id(leaf.layout), sharding_text)
                    tail = tails[tail_key] if tail_key in tails else tails.setdefault(
                        tail_key, _array_tail(leaf, lists, sharding_text))
                    if tail is not None:
                        # _leaf_json's keys, in its order
                        out.append(f'{{"keys": [{", ".join(map(string, leaf.keys))}], "name": {string(leaf.name)}, '
                                   + tail)
                        continue
                except TypeError:  # a key or name not a str, a shape that does not hash: through the dicts
                    pass
            out.append(json.dumps(self._leaf_json(leaf, shared, by_id), default=str, ensure_ascii=True))
        return out

    def _leaf_json(self, leaf: Leaf, shardings: dict[Any, dict[str, Any]],
                   by_id: dict[int, dict[str, Any]]) -> dict[str, Any]:
        if isinstance(leaf, ArrayLeaf):
            sharding = None
            if leaf.sharding is not None:
                # (the leaves keep their Sharding objects alive while this runs: an id stays theirs)
                sharding = by_id.get(id(leaf.sharding))
                if sharding is None:
                    key: Any = leaf.sharding  # a frozen dataclass: equal values, one key
                    try:
                        sharding = shardings.get(key)
                    except TypeError:  # a field holding a list: by object
                        key = id(leaf.sharding)
                        sharding = shardings.get(key)
                    if sharding is None:
                        sharding = shardings[key] = leaf.sharding.to_json()
                    by_id[id(leaf.sharding)] = sharding
            chunk_shape = leaf.chunk_shape
            # one dict display in the contract's key order (building it in two steps cost a tenth more)
            return {
                "keys": list(leaf.keys), "name": leaf.name, "kind": leaf.kind,
                "shape": list(leaf.shape), "dtype": leaf.dtype, "nbytes": leaf.nbytes,
                "chunk_shape": list(chunk_shape) if chunk_shape is not None else None,
                "chunks": leaf.chunk_count,
                "sharding": sharding,
            }
        out: dict[str, Any] = {"keys": list(leaf.keys), "name": leaf.name, "kind": leaf.kind}
        out.update(
            shape=[], dtype=leaf.dtype, nbytes=leaf.nbytes, chunk_shape=None, chunks=0,
            sharding=None, value_type=leaf.value_type,
        )
        if self.values is not None and leaf.path in self.values:
            try:
                out["value"] = _jsonable(self.values[leaf.path])
            except CkptError as exc:  # a value that holds itself has no JSON form
                out["value_error"] = exc.message
        if leaf.path in self.value_errors:
            out["value_error"] = self.value_errors[leaf.path]
        return out


# what to_json_text puts in the leaves' place, and how json.dumps spells it there
_LEAVES_MARK = "\x00leaves\x00"
_LEAVES_TEXT = '"leaves": "\\u0000leaves\\u0000"'


def _int_list(values: tuple[Any, ...]) -> str | None:
    """A tuple of ints as json.dumps writes its list; None where an element is not exactly an int."""
    if not all(type(v) is int for v in values):
        return None
    return "[" + ", ".join(map(int.__repr__, values)) + "]"


def _sharding_text(sharding: Any, by_value: dict[Any, str]) -> str:
    """A leaf's sharding as json.dumps writes _leaf_json's dict of it; equal values looked up once."""
    import json

    try:
        known = by_value.get(sharding)
    except TypeError:  # a field holding a list: made for this object alone
        return json.dumps(sharding.to_json(), default=str)
    if known is None:
        known = by_value[sharding] = json.dumps(sharding.to_json(), default=str)
    return known


def _array_tail(leaf: ArrayLeaf, lists: dict[tuple[int, ...], str | None], sharding_text: str) -> str | None:
    """An ArrayLeaf's JSON text from "kind" on, as json.dumps writes _leaf_json's dict; None
    where a field is not of the type this writes (a shape not of ints, ...)."""
    from json.encoder import encode_basestring_ascii

    shape, chunk_shape = leaf.shape, leaf.chunk_shape
    if type(shape) is not tuple or type(leaf.dtype) is not str or not (chunk_shape is None
                                                                     or type(chunk_shape) is tuple):
        return None
    shape_text = lists[shape] if shape in lists else lists.setdefault(shape, _int_list(shape))
    chunk_text: str | None = "null"
    if chunk_shape is not None:
        chunk_text = (lists[chunk_shape] if chunk_shape in lists
                      else lists.setdefault(chunk_shape, _int_list(chunk_shape)))
    nbytes, chunks = leaf.nbytes, leaf.chunk_count
    if shape_text is None or chunk_text is None or type(nbytes) is not int or type(chunks) is not int:
        return None
    return (f'"kind": "array", "shape": {shape_text}, "dtype": {encode_basestring_ascii(leaf.dtype)}, '
            f'"nbytes": {int.__repr__(nbytes)}, "chunk_shape": {chunk_text}, '
            f'"chunks": {int.__repr__(chunks)}, "sharding": {sharding_text}}}')


def _jsonable(value: Any) -> Any:
    """A decoded value as JSON; a CkptError when it holds itself or its shared parts unfold
    too far (values.jsonable: a pickle's object graph is walked once, never as a tree)."""
    return values.jsonable(value, _json_atom)


def _json_atom(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    return repr(value)


def inspect_checkpoint(
    path: str,
    *,
    step: str | int | None = None,
    pattern: str | None = None,
    values: bool = False,
) -> InspectResult:
    """Open `path` from metadata and describe it; decode value leaves if `values`.

    `pattern` is a --filter glob (ckpt_tool/core/filters.py); NoMatchError when it matches no leaf."""
    from ..core.filters import filter_leaves
    from ..formats import open_checkpoint

    ckpt = open_checkpoint(path, step=step)
    # a pattern that matches nothing is an error (NoMatchError), not an empty listing
    leaves = filter_leaves(ckpt.leaves, pattern, where=ckpt.path)
    decoded: dict[str, Any] | None = None
    errors: dict[str, str] = {}
    if values:
        decoded = {}
        for leaf in leaves:
            if isinstance(leaf, ValueLeaf):
                try:
                    decoded[leaf.path] = leaf.load()
                except CkptError as exc:
                    errors[leaf.path] = str(exc)
    return InspectResult(ckpt, leaves, decoded, errors)
