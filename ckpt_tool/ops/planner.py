"""Planning a conversion: the target leaves of a source checkpoint under convert's options.

A ConversionPlanner walks the source's leaves once. Each is selected (--select/--exclude),
unstacked (--unstack), renamed (--rename) and claimed under its flat name in the target;
an array gets its output chunk layout (_target_layout), a value is handed to the target
format's plan_value, to which the planner is the PlanContext (core/write_plan.py). The tuples a
source records are gathered back into one value for a format that keeps a tuple whole.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable

import numpy as np

from ..core import casting, unstack
from ..base import dtypes
from .. import formats
from ..base.errors import CkptError, UnsupportedLeafError, UsageError
from ..core.filters import Selection
from ..core.contract import WriterModule
from ..core.model import (
    ArrayLeaf, Checkpoint, ChunkLayout, ChunkList, Key, Leaf, RegularGrid, ValueLeaf, memory_leaf, parse_rename_rules,
    stored_chunks,
)
from ..base.names import dotted_name, join_keys, key_text, unescape_key
from ..base.parallel import copy_workers
from ..scheduler import DEFAULT_MEMORY, band_bytes
from .stored_copy import output_chunk_limit, plans_stored_copy
from ..base.text import is_unicode_text
from ..core.values import SameObject
from ..core.write_plan import Target, TargetArray, TargetValue, WritePlan

# Orbax chunks made from DCP chunks (often a whole tensor per rank) are capped
# at this size unless --chunk-mb says otherwise: zarr chunks are encoded and
# held whole while written, so smaller ones bound memory and let the zstd work
# of one tensor run in parallel.
DEFAULT_CHUNK_MB = 8.0


@dataclass
class ConvertOptions:
    """What `ckpt convert` was asked: the target, the leaves kept and renamed, casts, chunking."""

    to: str  # a writable format's name (formats.writable())
    select: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    rename: list[str] = field(default_factory=list)
    unstack: list[str] = field(default_factory=list)  # core/unstack.py specs, applied before --rename
    like: str | None = None  # --like HF_DIR (ops/hf_export.py): the output must match that model's tensors
    force_like: bool = False  # write even when it does not
    # --optimizer-keys-like CKPT (core/optim_keys.py): key the source's optimizer state by ids or by FQNs,
    # as CKPT's is, paired through param_groups
    optimizer_keys_like: str | None = None
    dtype: str | None = None
    allow_overflow: bool = False  # write a --dtype cast whose values overflowed to inf/NaN (refused otherwise)
    chunk_mb: float | None = None
    skip_unsupported: bool = False
    zarr3: bool = False
    max_shard_size: int | None = None  # safetensors: bytes per file (None: the writer's 5GB default)
    workers: int = field(default_factory=copy_workers)
    overwrite: bool = False
    step: str | int | None = None
    memory: int = DEFAULT_MEMORY  # --memory: bytes of decoded data, assembly and write-behind in flight
    # the source's reader options ({"weights": "module"}: formats.read_options; not the --like reference's)
    read_options: dict[str, str] = field(default_factory=dict)



# each planned array's source leaf, by the target's keys as text (names.key_text): a key
# tuple, never a joined string, so two leaves never share an entry
Sources = dict[tuple[str, ...], ArrayLeaf]


def _renamed_keys(keys: tuple[Key, ...], rules: list[tuple[re.Pattern[str], str]]) -> tuple[Key, ...]:
    # the rules see the joined key path with its one reversible escape (a key `a/b` is `a%2Fb`),
    # and what they make is split back at its '/' and unescaped: a key never becomes two, nor two one
    path = join_keys(keys)
    new = path
    for rx, repl in rules:
        new = rx.sub(repl, new)
    if new == path:
        return keys
    parts = [unescape_key(p) for p in new.split("/") if p != ""]
    if not parts:
        raise CkptError(f"--rename turns {path!r} into an empty key")
    # a component that was a sequence index and is unchanged stays an int
    return tuple(
        keys[i] if i < len(keys) and isinstance(keys[i], int) and str(keys[i]) == p else p
        for i, p in enumerate(parts)
    )


def _target_layout(leaf: ArrayLeaf, write: WriterModule, itemsize: int, cap: int | None, memory: int = DEFAULT_MEMORY,
                   copied: Callable[[ChunkLayout], bool] | None = None) -> ChunkLayout:
    """The output chunks of `leaf` in the format whose write module is `write`. `copied(layout)`:
    whether the writer would take the source's stored chunks in that layout as they are stored
    (stored_copy.StoredCopies): the source's grid is then kept whatever its chunks' size."""
    if cap is None:
        # chunks that the memory budget could not hold whole are split (a big stored chunk is
        # decoded as a stream, each output chunk assembled from its bands)...
        limit = output_chunk_limit(memory)
        source_max = max((math.prod(c.sizes) for c in stored_chunks(tuple(leaf.shape), leaf.layout)), default=0) \
            if isinstance(leaf.layout, ChunkList) else math.prod(min(c, s) for c, s in zip(leaf.layout.chunk_shape, leaf.shape))
        if source_max * itemsize > limit and copied is not None and isinstance(leaf.layout, RegularGrid):
            # ...unless they are copied as they are stored, a window at a time
            kept = write.target_layout(leaf, itemsize, None, int(DEFAULT_CHUNK_MB * 2**20))
            if copied(kept):
                return kept
        if source_max * itemsize > limit:
            # where the source's own chunks would be kept (DCP lists, an Orbax grid), pieces of one
            # stream band each. The DCP writer reserves none of the budget, so the scheduler's bands
            # are exactly these pieces and each decoded band is handed to the writer as it is, where
            # pieces of two bands were assembled by a copy (on a TPU VM the copy of a 393 MiB
            # embedding took 1.8 s, longer than its decode). Elsewhere the default cap applies,
            # never raised by this one.
            cap = band_bytes(memory) if write.keeps_source_chunks(leaf) else min(limit, int(DEFAULT_CHUNK_MB * 2**20))
    cap_bytes = int(cap) if cap else int(DEFAULT_CHUNK_MB * 2**20)
    return write.target_layout(leaf, itemsize, cap, cap_bytes)



def plan_conversion(src: Checkpoint, opts: ConvertOptions, destination: str | None = None,
                    ) -> tuple[WritePlan, list[tuple[str, str]], Sources]:
    """Target leaves for `src` under the options; (plan, skipped, target keys (names.key_text) -> source leaf).
    `destination`: where the plan is written, for a writer that takes stored chunks there
    (WriterModule.stored_chunk_encoding); without it no chunk is planned to be copied."""
    return ConversionPlanner(src, opts, destination).plan()


def _target_format(src: Checkpoint, to: str) -> formats.FormatInfo:
    """The registered format `to`, if it is writable and writes from `src`'s format (else one line)."""
    if to not in formats.writable():
        raise UsageError(f"unknown target format {to!r} (use {formats.joined(formats.writable())})")
    target = formats.get(to)
    source = formats.for_checkpoint(src.format)
    if target.writes_from and (source is None or source.name not in target.writes_from):
        takes = formats.joined([formats.get(n).title for n in target.writes_from])
        raise CkptError(f"{target.title} checkpoints are written from {takes} checkpoints only; this is "
                        f"{'a ' + source.title if source is not None else src.format} checkpoint", src.path)
    return target


def _check_dtype(dtype: str | None) -> None:
    """--dtype names a floating type (else a usage error)."""
    if dtype is None:
        return
    if dtype not in dtypes.BY_NAME:
        floats = ", ".join(name for name, dt in dtypes.BY_NAME.items() if dt.is_float)
        raise UsageError(f"--dtype: unknown dtype {dtype!r} (floating types: {floats})")
    if not dtypes.get(dtype).is_float:
        raise UsageError(f"--dtype must be a floating type, got {dtype}")


class ConversionPlanner:
    """The plan of one conversion of `src` under `opts` (plan_conversion), made by plan().

    It is also the PlanContext (core/write_plan.py) the target format's plan_value gets: a value
    becomes one target value, a subtree of values and arrays, or is refused.
    """

    def __init__(self, src: Checkpoint, opts: ConvertOptions, destination: str | None = None) -> None:
        self.src, self.opts, self.destination = src, opts, destination
        self.target = _target_format(src, opts.to)
        self.write: WriterModule = self.target.writer_module()
        _check_dtype(opts.dtype)
        self.rules = parse_rename_rules(opts.rename)
        # --select/--exclude by '/'-joined keys or dotted name; a pattern matching no leaf is refused here
        # items the reader does not read (an Orbax item of a handler ckpt does not
        # know): a copy without them is partial, so they are refused like any leaf
        # unless --skip-unsupported or --exclude leaves them out
        self.unread = [ValueLeaf((item,), item, "unread", extra={"why": why})
                       for item, why in (src.layout.get("unread_items") or {}).items()]
        self.selection = Selection(opts.select, opts.exclude, [*src.leaves, *self.unread], src.path)
        self.cap = int(opts.chunk_mb * 2**20) if opts.chunk_mb else None
        self.targets: list[Target | None] = []
        self.skipped: list[tuple[str, str]] = []
        self.sources: Sources = {}
        self._seen: dict[str, str] = {}  # a claimed target name -> the source path that claimed it
        self.tuples: set[tuple[Key, ...]] = set()  # (PlanContext.tuples: the output's tuples)
        # a format that keeps a tuple as one value (DCP's bytes item: torch's traversal
        # stops at it) gets the tuples a source recorded (Orbax) gathered back from their
        # element leaves into one value: tuple path -> (slot in targets, members)
        self._source_tuples = _source_tuples(src)
        if not self.write.TUPLES_AS_VALUES:
            # Orbax to Orbax: the tuples stay recorded as tuples (safetensors: their arrays are tensors)
            self.tuples.update(_renamed_keys(t, self.rules) for t in self._source_tuples)
            self._source_tuples = set()
        self._gathered: dict[tuple[Key, ...], tuple[int, list[Any]]] = {}
        # a writer that stores names and strings as Python str (DCP's pickle) keeps any; the others
        # write them as UTF-8 (a JSON header or metadata, zarr paths, file names), which a lone surrogate is not
        self._keeps_any_str = self.write.KEEPS_ANY_STR

    def plan(self) -> tuple[WritePlan, list[tuple[str, str]], Sources]:
        """(the plan, the leaves skipped with why, target keys (names.key_text) -> source leaf)."""
        src = self.src
        kept, unstackable = unstack.apply(unstack.parse_specs(self.opts.unstack),
                                          [leaf for leaf in src.leaves if self.selection.keeps(leaf)], src.path)
        for path in unstackable:
            self.refuse(path, "--unstack matches it, but it is a value, not an array")
        for leaf in kept:
            if leaf.path not in unstackable:
                self._plan_leaf(leaf)
        for unread in self.unread:
            if self.selection.keeps(unread):
                self.refuse(unread.path, f"an item ckpt does not read ({unread.extra['why']})")
        self._gather_tuples()
        final = [t for t in self.targets if t is not None]
        if not final:
            raise CkptError("nothing to convert: every leaf was filtered out", src.path)
        # (the source's layout: a writer that copies some of the source's own files finds them by it)
        plan = WritePlan(final, info={"source": src.path, "source_format": src.format, "source_layout": dict(src.layout)},
                         tuples=self.tuples)
        return plan, self.skipped, self.sources

    def _plan_leaf(self, leaf: Leaf) -> None:
        """One selected source leaf: gathered into its tuple, or renamed, claimed and planned."""
        outer = next((leaf.keys[:i] for i in range(1, len(leaf.keys)) if leaf.keys[:i] in self._source_tuples), None)
        if outer is not None:
            if outer not in self._gathered:
                self._gathered[outer] = (len(self.targets), [])
                self.targets.append(None)  # the tuple's place, filled once all its elements are seen
            self._gathered[outer][1].append(leaf)
            return
        keys = _renamed_keys(tuple(leaf.keys), self.rules)
        joined = dotted_name(keys)
        if not self._keeps_any_str and not is_unicode_text(joined):  # (where --skip-unsupported may leave it out)
            self.refuse(leaf.path, _not_text(joined, self.target.title))
            return
        name = self.claim(keys, leaf.path)
        if isinstance(leaf, ArrayLeaf):
            self._add_leaf(leaf, keys, name)
        else:
            self._plan_value(leaf, keys, name)

    def _plan_value(self, leaf: ValueLeaf, keys: tuple[Key, ...], name: str) -> None:
        """A value leaf, loaded and handed to the target format's plan_value."""
        try:
            value = leaf.load()
        except CkptError as exc:
            if self.opts.skip_unsupported:
                self.skipped.append((leaf.path, f"cannot decode: {exc.message}"))
                return
            raise
        if isinstance(value, np.ndarray) and value.shape == ():
            value = value[()]
        if isinstance(value, SameObject):  # (a reader's later path to an object it shows once)
            first = value.name or "the top-level object"
            self.refuse(leaf.path, f"the same object as {first} (torch.load gives one object at both paths; "
                                   f"the output holds it at {first} only)")
            return
        self.write.plan_value(self, keys, name, value, leaf.path)

    def _gather_tuples(self) -> None:
        """Each gathered tuple's value, in the place its first element held."""
        for outer, (slot, members) in self._gathered.items():
            keys = _renamed_keys(outer, self.rules)
            name = self.claim(keys, join_keys(outer))
            value = _gather_tuple(outer, members, self._source_tuples, self.write)
            self.targets[slot] = TargetValue(keys, name, value, "object")

    def _add_leaf(self, leaf: ArrayLeaf, keys: tuple[Key, ...], name: str) -> None:
        """An array leaf as a target array: its dtype (--dtype) and its output chunk layout."""
        if leaf.unreadable:
            # before any output chunk is planned from the claimed shape
            raise CkptError(f"cannot be read: {leaf.unreadable}", leaf.path)
        dtype = leaf.dtype
        source_dtype = None
        # (core/casting.py: step counters, integer leaves and the other kind of floating type stay)
        if self.opts.dtype and casting.kept_reason(tuple(leaf.keys), leaf.size, leaf.dtype, self.opts.dtype) is None:
            dtype, source_dtype = self.opts.dtype, leaf.dtype
        itemsize = dtypes.get(dtype).itemsize
        sharding = leaf.sharding if (leaf.sharding and leaf.sharding.kind == "named") else None
        array = TargetArray(keys, name, tuple(leaf.shape), dtype, leaf.layout, sharding, source_dtype)
        array.layout = _target_layout(leaf, self.write, itemsize, self.cap, self.opts.memory,
                                      partial(self._takes_stored, array, leaf))
        self.targets.append(array)
        self.sources[key_text(keys)] = leaf  # (claim refused a second leaf of these keys)

    def _takes_stored(self, array: TargetArray, leaf: ArrayLeaf, layout: ChunkLayout) -> bool:
        """Whether the writer would take `leaf`'s stored chunks as they are for `array` in `layout`."""
        return self.destination is not None and plans_stored_copy(
            self.write, self.destination, replace(array, layout=layout), leaf, self.opts.zarr3)

    # -- the PlanContext of the format's plan_value (core/write_plan.py) --

    def claim(self, keys: tuple[Key, ...], source_path: str) -> str:
        # the target's flat name (a tensor name, a DCP fqn, an Orbax parameter): the keys joined
        # by '.', so the source's own names come back (the tensor `a/b` stays `a/b`); two leaves
        # whose keys differ but join alike (`a.b` and `a`/`b`) cannot both be held by one
        # name, and are refused here by both their key paths, before anything is written
        name = dotted_name(keys)
        if not self._keeps_any_str and not is_unicode_text(name):  # keys inside a value, a gathered tuple's
            raise UnsupportedLeafError(_not_text(name, self.target.title), source_path)
        if name in self._seen:
            raise CkptError(f"two leaves map to {name!r}: {self._seen[name]!r} and {source_path!r}; "
                            f"{self.target.title} checkpoints cannot hold both (leave one out with --exclude, "
                            f"or --rename one)")
        self._seen[name] = source_path
        return name

    def add_value(self, value: TargetValue) -> None:
        if isinstance(value.value, str) and not self._keeps_any_str and not is_unicode_text(value.value):
            self.refuse(value.path, f"its string {value.value[:40]!r} holds a lone surrogate (not Unicode text), "
                                    f"which {self.target.title} checkpoints cannot store")
            return
        self.targets.append(value)

    def add_array(self, keys: tuple[Key, ...], name: str, arr: np.ndarray) -> None:
        self._add_leaf(memory_leaf(keys, name, arr), keys, name)

    def refuse(self, where: str, reason: str) -> None:
        if self.opts.skip_unsupported:
            self.skipped.append((where, reason))
            return
        raise UnsupportedLeafError(reason + "; use --skip-unsupported to leave it out", where)


def kept_reason(target: TargetArray, sources: Sources, dtype: str) -> str:
    """Why --dtype left a planned array as it is (decided on its source leaf, as planned)."""
    leaf = sources[key_text(target.keys)]
    return casting.kept_reason(tuple(leaf.keys), leaf.size, leaf.dtype, dtype) or casting.SAME_DTYPE


def _not_text(name: str, target: str) -> str:
    """Why a name holding a lone surrogate is refused (where it names the leaf)."""
    return f"its name {name!r} holds a lone surrogate (not Unicode text), which {target} checkpoints cannot store"


def _source_tuples(src: Checkpoint) -> set[tuple[Key, ...]]:
    """The tuples a source records (orbax's rich-types metadata: its format says), else none."""
    info = formats.for_checkpoint(src.format)
    return info.reader_module().recorded_tuples(src) if info is not None else set()


def _gather_tuple(outer: tuple[Key, ...], members: list[Any], tuples: set[tuple[Key, ...]], write: WriterModule) -> Any:
    """The value of the tuple at `outer` from its element leaves (arrays read whole, as torch holds them)."""
    where = join_keys(outer)
    root: dict[Key, Any] = {}
    for leaf in members:
        rel = tuple(leaf.keys[len(outer):])
        node = root
        for k in rel[:-1]:
            node = node.setdefault(k, {})
        node[rel[-1]] = _Loaded(leaf.read() if isinstance(leaf, ArrayLeaf) else leaf.load())

    def build(node: Any, path: tuple[Key, ...]) -> Any:
        if isinstance(node, _Loaded):
            return node.value  # an array stays an array: a tensor in the bytes item
        keys = list(node)
        if keys and all(isinstance(k, int) for k in keys):
            if sorted(keys) != list(range(len(keys))):
                raise CkptError(
                    f"only elements {sorted(keys)[:8]} of this sequence are selected; select all of it or none",
                    join_keys(path),
                )
            items = [build(node[i], path + (i,)) for i in range(len(keys))]
            return tuple(items) if path in tuples else items
        return {str(k): build(v, path + (k,)) for k, v in node.items()}

    return write.gathered_value(build(root, outer), where)


@dataclass
class _Loaded:
    """A loaded leaf value inside a tuple being gathered (never confused with a subtree dict)."""

    value: Any

