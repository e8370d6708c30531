"""`ckpt diff A B`: compare two checkpoints of either format, leaf by leaf.

Leaves are matched by their keys (as text: a list index 0 is the key "0"),
spelled as one string by names.join_keys (reversible: two different key
tuples never share a spelling, so no two leaves are paired as one or one
left out), after optional rename rules applied to A's paths; leaves whose
keys differ only in where their dotted name is split (torch.save's
`model/0/weight`, DCP's `model/0.weight`) are matched by that name. Structure differences (only in A, only in B, changed
kind, shape or dtype) come from metadata alone; with values=True each array
pair is compared region by region along A's stored chunks, so memory stays
bounded by a couple of chunks whatever the size of the checkpoints.

Either side may be a RecordedStructure (an `inspect --json` document read by
ckpt_tool.ops.structure): its leaves carry keys, kinds, shapes, dtypes and the
recorded layout but no data, so only the structure is compared. The chunk
layout and sharding are compared only when asked (layout=True): a resharded
or converted checkpoint with the same keys, shapes and dtypes matches.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..base import dtypes
from ..core import values
from ..base.findings import Progress, no_progress
from ..base.errors import CkptError, short_repr
from ..core.filters import Glob
from ..core.model import ArrayLeaf, Checkpoint, Leaf, Region, ValueLeaf, constant_loader, parse_rename_rules
from ..base.names import dotted_name, join_keys, split_path
from ..scheduler import DEFAULT_MEMORY, Scheduler, Want
from .structure import RecordedStructure
from .validate.deep import chunk_regions


@dataclass
class LeafDiff:
    path: str
    kind: str  # "only_a" | "only_b" | "kind" | "shape" | "dtype" | "chunks" | "sharding" | "values" | "value"
    message: str
    max_abs: float | None = None
    max_rel: float | None = None
    mismatched: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "kind": self.kind, "message": self.message}
        if self.max_abs is not None:
            out.update(max_abs=self.max_abs, max_rel=self.max_rel, mismatched=self.mismatched)
        return out


@dataclass
class DtypeCast:
    """Floating leaves whose dtype differs from A to B in the same way (cast_ok):
    accepted as a cast, and compared by value when values are compared."""

    a: str  # dtype in A
    b: str  # dtype in B
    paths: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "leaves": len(self.paths), "paths": list(self.paths)}


@dataclass
class DottedMatch:
    """One leaf whose key paths differ only in where its dotted name is split."""

    name: str  # the dotted name, the path it is reported under
    a: str  # A's (renamed) '/'-joined keys
    b: str  # B's

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "a": self.a, "b": self.b}


@dataclass
class OptimizerPairing:
    """An optimizer state keyed by ids on one side and by FQNs on the other (core/optim_keys.py): its
    state entries paired through param_groups, or `note` saying why they are not."""

    where: str  # the param_groups path
    a: str | None  # how each side keys it: "ids", "FQNs"
    b: str | None
    paired: int = 0  # state leaves of the ids side compared under the other side's FQN
    example: tuple[str, str] | None = None  # (A's path, B's) of one paired entry
    note: str | None = None  # why nothing was paired (the groups differ)

    def to_json(self) -> dict[str, Any]:
        return {"where": self.where, "a": self.a, "b": self.b, "paired": self.paired,
                "example": list(self.example) if self.example else None, "note": self.note}


@dataclass
class TiedLeaf:
    """A leaf of one side only that its reader records as the same tensor as another
    leaf of that side (same storage, offset, shape, strides): a tied weight the other
    side stores once (transformers' safetensors keep `lm_head.weight` out when it is
    the input embedding). Its data is compared through `same_as`."""

    path: str
    side: str  # "a" or "b": where it is
    same_as: str  # the compared path it shares its data with

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "side": self.side, "same_as": self.same_as}


@dataclass
class DiffReport:
    a: str
    b: str
    compared: int = 0
    values_compared: bool = False
    differences: list[LeafDiff] = field(default_factory=list)
    layout_compared: bool = False
    # what each side is: "checkpoint", or "inspect-json" (structure only)
    sources: dict[str, str] = field(default_factory=lambda: {"a": "checkpoint", "b": "checkpoint"})
    # the step each side was read at: what was asked (--step/--step-a/--step-b; None: the
    # default, a root's latest committed step) and the step the checkpoint records
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    cast_ok: bool = False
    # with cast_ok: floating dtype changes, one entry per (dtype in A, dtype in B)
    casts: list[DtypeCast] = field(default_factory=list)
    # leaves whose key paths split their dotted name at other dots (torch.save's
    # `model/0/weight`, DCP's `model/0.weight`), matched by that name and reported under it
    dotted: list[DottedMatch] = field(default_factory=list)
    # leaves on one side only that are the same tensor as a compared leaf of that side
    # (a tied weight the other side stores once): not differences, each said
    tied: list[TiedLeaf] = field(default_factory=list)
    # without cast_ok, when every difference is a floating dtype change (a `convert --dtype`
    # output against its source): those changes per pair of dtypes, for the hint --cast-ok
    # accepts them; empty when anything else differs too
    only_casts: list[DtypeCast] = field(default_factory=list)
    # optimizer states keyed by ids on one side and FQNs on the other, paired through param_groups
    optimizer: list[OptimizerPairing] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not self.differences

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "same": self.same, "compared": self.compared,
            "values": self.values_compared, "layout": self.layout_compared, "sources": dict(self.sources),
            "steps": {side: dict(v) for side, v in self.steps.items()},
            "cast_ok": self.cast_ok, "casts": [c.to_json() for c in self.casts],
            "dotted_matches": [m.to_json() for m in self.dotted], "tied": [t.to_json() for t in self.tied],
            "only_casts": [c.to_json() for c in self.only_casts],
            "optimizer_keys": [o.to_json() for o in self.optimizer],
            "differences": [d.to_json() for d in self.differences],
        }


def _renamed(path: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for rx, repl in rules:
        path = rx.sub(repl, path)
    return path


def _by_path(ck: Checkpoint, rules: list[tuple[re.Pattern[str], str]], side: str) -> dict[str, Leaf]:
    """A side's leaves by their (renamed) key path: two leaves that would share one
    (two keys a reader could not tell apart, or --rename making two paths one) are an
    error naming both, never one of them silently left out of the comparison."""
    out: dict[str, Leaf] = {}
    for leaf in ck.leaves:
        path = _renamed(leaf.path, rules) if rules else leaf.path
        first = out.get(path)
        if first is not None:
            how = "--rename maps both to" if rules else "both are spelled"
            raise CkptError(f"two leaves of {side} cannot be told apart: {first.path!r} and {leaf.path!r} "
                            f"({how} {path!r})", ck.path)
        out[path] = leaf
    return out


def _expand_values(side: dict[str, Leaf], other: dict[str, Leaf]) -> dict[str, Leaf]:
    """Value leaves whose path is an inner node on the other side, flattened as
    convert flattens them (only those are loaded: a few small items)."""
    from ..core.model import flatten_value as _flatten_value, memory_leaf as _memory_leaf  # convert's own flattening rule

    inner = {p.rsplit("/", i)[0] for p in other for i in range(1, p.count("/") + 1)}
    out: dict[str, Leaf] = {}
    for path, leaf in side.items():
        if not (isinstance(leaf, ValueLeaf) and path not in other and path in inner):
            out[path] = leaf
            continue
        subs = [("/".join([path, join_keys(sub_keys)]) if sub_keys else path, sub_keys, sub)
                for sub_keys, sub in _flatten_value((), leaf.load())]
        if any(sub_path != path and sub_path in side for sub_path, _, _ in subs):
            # a part of the value would take the path of a leaf this side has already (the
            # safetensors tensors `x` and `x.0`): compared whole, never in that leaf's place
            out[path] = leaf
            continue
        for sub_path, sub_keys, sub in subs:
            keys = tuple(leaf.keys) + sub_keys
            if isinstance(sub, np.ndarray):
                out[sub_path] = _memory_leaf(keys, ".".join(map(str, keys)), sub)
            else:
                out[sub_path] = ValueLeaf(keys, leaf.name, leaf.value_type, loader=constant_loader(sub))
    return out


def diff_checkpoints(
    a: Checkpoint,
    b: Checkpoint,
    *,
    values: bool = False,
    rtol: float = 0.0,
    atol: float = 0.0,
    rename: list[str] | None = None,
    workers: int = 4,
    progress: Progress = no_progress,
    layout: bool = False,
    pattern: str | None = None,
    memory: int = DEFAULT_MEMORY,
    cast_ok: bool = False,
    steps: tuple[str | int | None, str | int | None] = (None, None),
) -> DiffReport:
    """Compare A and B by keys (A's renamed first); `layout` adds chunk layout
    and recorded sharding; `pattern` (a --filter glob, ckpt_tool/core/filters.py,
    over the matched keys or their dotted names) limits the comparison to the
    leaves it matches on either side: NoMatchError when it matches none on
    both. `cast_ok`: a floating leaf whose dtype differs (a cast conversion)
    is no difference; its values are compared in float64 within atol/rtol.
    `steps`: the step asked for each side, recorded in the report. Pickles
    (values decoded for --values) are unpickled within `memory`.

    A side that shallow validate finds incomplete or damaged (a rank's lost
    `.distcp`, a shard missing from a partial download) is refused naming it,
    as convert refuses its source: its metadata alone would compare "same", or
    show what it lost as "only in" lines."""
    from .engine import check_source_complete
    from ..machinery.torch_save.pickle_budget import memory_budget  # (here: most checkpoints hold no pickle)

    for side, ck in (("A", a), ("B", b)):
        if not isinstance(ck, RecordedStructure):  # (an inspect JSON document has no files to lose)
            check_source_complete(ck, side=side)
    with memory_budget(memory):
        return _diff_checkpoints(a, b, values=values, rtol=rtol, atol=atol, rename=rename, workers=workers,
                                 progress=progress, layout=layout, pattern=pattern, memory=memory,
                                 cast_ok=cast_ok, steps=steps)


def _diff_checkpoints(
    a: Checkpoint,
    b: Checkpoint,
    *,
    values: bool,
    rtol: float,
    atol: float,
    rename: list[str] | None,
    workers: int,
    progress: Progress,
    layout: bool,
    pattern: str | None,
    memory: int,
    cast_ok: bool,
    steps: tuple[str | int | None, str | int | None],
) -> DiffReport:
    structure = [ck.path for ck in (a, b) if isinstance(ck, RecordedStructure)]
    if values and structure:
        raise CkptError(f"{structure[0]} is an inspect JSON document: it holds no array data to compare values with")
    rules = parse_rename_rules(rename or [])
    left = _by_path(a, rules, "A")
    right = _by_path(b, [], "B")
    # a DCP bytes item holding a list/tuple/dict is a subtree once converted to
    # Orbax: compare it the way convert flattens it; until neither side changes, as
    # one side's expansion may make the other's value an inner node (a torch.save
    # `param_groups` list against DCP's per-group values, whichever side is A)
    while True:
        before = (set(left), set(right))
        if not isinstance(a, RecordedStructure):
            left = _expand_values(left, right)
        if not isinstance(b, RecordedStructure):
            right = _expand_values(right, left)
        if (set(left), set(right)) == before:
            break
    left, right, optimizer = _pair_optimizer_states(left, right)
    left, right, dotted, spellings = _match_dotted(left, right)
    if pattern:
        glob = Glob(pattern)
        all_left, all_right = left, right

        def keep(path: str, leaf: Leaf) -> bool:
            # a leaf matched by its dotted name is kept when any spelling of either side matches
            return any(glob.matches(p, _flat_names(p, lf)) for p, lf in spellings.get(path, [(path, leaf)]))

        left = {p: leaf for p, leaf in left.items() if keep(p, leaf)}
        right = {p: leaf for p, leaf in right.items() if keep(p, leaf)}
        dotted = [m for m in dotted if m.name in left]
        if not left and not right:
            raise glob.no_match([*all_left.values(), *all_right.values()], what=f" of A ({a.path}) and B ({b.path})")
    report = DiffReport(a.path, b.path, values_compared=values, layout_compared=layout, sources={
        side: "inspect-json" if isinstance(ck, RecordedStructure) else "checkpoint" for side, ck in (("a", a), ("b", b))
    }, cast_ok=cast_ok, steps={
        side: {"requested": asked, "step": ck.step} for side, asked, ck in (("a", steps[0], a), ("b", steps[1], b))
    })
    report.dotted = dotted
    report.optimizer = optimizer
    casts: dict[tuple[str, str], DtypeCast] = {}
    uncast: dict[tuple[str, str], DtypeCast] = {}  # the same, without cast_ok (only_casts)
    common = set(left) & set(right)
    for side, mine, theirs, kind in (("a", left, right, "only_a"), ("b", right, left, "only_b")):
        by_name = {leaf.name: path for path, leaf in mine.items() if path in common}
        for path in sorted(set(mine) - set(theirs)):
            alias = mine[path].extra.get("same_tensor_as") if isinstance(mine[path], ArrayLeaf) else None
            if alias in by_name:
                report.tied.append(TiedLeaf(path, side, by_name[alias]))
            else:
                report.differences.append(LeafDiff(path, kind, f"only in {side.upper()}"))
    pairs: list[tuple[str, ArrayLeaf, ArrayLeaf]] = []
    for path in sorted(set(left) & set(right)):
        la, lb = left[path], right[path]
        report.compared += 1
        meta = _metadata_difference(path, la, lb)
        # (a dtype difference is between two arrays: the isinstance checks only say so to the types)
        if (meta and meta.kind == "dtype" and isinstance(la, ArrayLeaf) and isinstance(lb, ArrayLeaf)
                and _castable(la.dtype, lb.dtype)):
            # a cast conversion: the dtype change is reported once per pair of dtypes, not per leaf
            pair = (la.dtype, lb.dtype)
            (casts if cast_ok else uncast).setdefault(pair, DtypeCast(*pair)).paths.append(path)
            if cast_ok:
                meta = None
        if meta:
            report.differences.append(meta)
            continue
        if layout and isinstance(la, ArrayLeaf) and isinstance(lb, ArrayLeaf):
            report.differences.extend(_layout_differences(path, la, lb))
        if values and isinstance(la, ArrayLeaf) and isinstance(lb, ArrayLeaf):
            unreadable = [f"{side}: {leaf.unreadable}" for side, leaf in (("A", la), ("B", lb)) if leaf.unreadable]
            if unreadable:
                # never size a comparison by a claim the stored bytes cannot hold
                report.differences.append(LeafDiff(path, "values", "cannot be read: " + "; ".join(unreadable)))
            else:
                pairs.append((path, la, lb))
        elif values and isinstance(la, ValueLeaf) and isinstance(lb, ValueLeaf):
            va, vb = la.load(), lb.load()
            if not _values_equal(va, vb):
                report.differences.append(LeafDiff(path, "value", f"{short_repr(va)} != {short_repr(vb)}"))
    report.casts = list(casts.values())
    if pairs:
        report.differences.extend(_compare_values(pairs, rtol, atol, workers=workers, memory=memory, progress=progress))
    report.differences.sort(key=lambda d: d.path)  # stable: a leaf's chunks line stays before its sharding line
    if uncast and sum(len(c.paths) for c in uncast.values()) == len(report.differences):
        report.only_casts = list(uncast.values())  # (each such leaf is one dtype difference, and nothing else is)
    return report


def _pair_optimizer_states(
    left: dict[str, Leaf], right: dict[str, Leaf],
) -> tuple[dict[str, Leaf], dict[str, Leaf], list[OptimizerPairing]]:
    """Optimizer state keyed by integer ids on one side (`torch.save(opt.state_dict())`) and by
    FQNs on the other (DCP's get_state_dict), at the same place: the ids side's state entries are
    re-keyed by the FQN at the same position of the same param group, and its param_groups' params
    read as those FQNs, as torch itself maps them (core/optim_keys.py). Groups that differ in count or
    size pair nothing: one note naming both sides."""
    from ..core import optim_keys

    if not all(any(optim_keys.PARAM_GROUPS in p for p in side) for side in (left, right)):
        return left, right, []  # (most checkpoints: no key split for nothing)
    sides = {"a": left, "b": right}
    entries: dict[str, list[optim_keys.Entry]] = {side: [(split_path(p), leaf) for p, leaf in leaves.items()]
                                                  for side, leaves in sides.items()}
    # only a place both sides hold param_groups at is read (its values are loaded)
    common = optim_keys.prefixes(entries["a"]) & optim_keys.prefixes(entries["b"])
    if not common:
        return left, right, []
    found = {side: {st.prefix: st for st in optim_keys.find_states(e, common)} for side, e in entries.items()}
    out: list[OptimizerPairing] = []
    for prefix in sorted(found["a"].keys() & found["b"].keys()):
        sa, sb = found["a"][prefix], found["b"][prefix]
        if sa.scheme is None or sb.scheme is None or sa.scheme == sb.scheme:
            continue  # keyed alike: the keys match as they are
        note = OptimizerPairing(sa.where, sa.scheme, sb.scheme)
        out.append(note)
        why = optim_keys.mismatch(sa, sb)
        side = "a" if sa.scheme == optim_keys.IDS else "b"  # the side re-keyed: by ids
        result = optim_keys.pair(sa, sb) if side == "a" else optim_keys.pair(sb, sa)
        if why is not None or result is None:
            note.note = why
            continue
        other = "b" if side == "a" else "a"
        conflict = optim_keys.shape_conflict(result, entries[side], entries[other], (side.upper(), other.upper()))
        if conflict is not None:  # equal group sizes, listed in another order: no guess either
            note.note = conflict + "; not paired"
            continue
        rekeyed, moved = optim_keys.rekey(entries[side], result)
        # the re-keyed entries' new paths; every other entry keeps its own
        paths = [join_keys(new) if new is not old else path
                 for path, (old, _), (new, _) in zip(sides[side], entries[side], rekeyed)]
        if len(set(paths)) != len(paths):  # a re-keyed entry would take another leaf's path: none is
            note.note = "pairing them would give two leaves one path; not paired"
            continue
        if result.source.state:
            # one entry's state, as each side spells it: `optim/state/0` is `optim/state/0.weight`
            first = min(result.source.state)
            taken = result.source.state[first][1]
            ids_side = join_keys(entries[side][first][0][:len(prefix) + 1 + taken])
            fqn_side = join_keys(rekeyed[first][0][:len(prefix) + 2])
            note.example = (ids_side, fqn_side) if side == "a" else (fqn_side, ids_side)
        entries[side] = rekeyed
        sides[side] = {path: leaf for path, (_, leaf) in zip(paths, rekeyed)}
        note.paired = moved
    return sides["a"], sides["b"], out


def _match_dotted(
    left: dict[str, Leaf], right: dict[str, Leaf],
) -> tuple[dict[str, Leaf], dict[str, Leaf], list[DottedMatch], dict[str, list[tuple[str, Leaf]]]]:
    """Pair the leaves of one side only with those of the other whose dotted name is the
    same: readers split a torch FQN differently (torch.save and safetensors at every dot,
    `model/0/weight`; DCP only at its state dict's nesting, `model/0.weight`). A pair is
    keyed by its dotted name on both sides; a name two leaves of one side share stays
    unpaired (only in A / only in B), as does one that is another leaf's path already.
    Returns the re-keyed sides, the matches, and each pair's spellings (for --filter)."""
    def dotted(side: dict[str, Leaf], other: dict[str, Leaf]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for path in side:
            if path not in other:
                out.setdefault(dotted_name(split_path(path)), []).append(path)
        return out

    only_a, only_b = dotted(left, right), dotted(right, left)
    def unclaimed(name: str, path_a: str, path_b: str) -> bool:
        # the name is no other leaf's path (DCP's top-level `0.weight` is its own)
        return (name not in left or name == path_a) and (name not in right or name == path_b)

    matches = [DottedMatch(name, pa[0], only_b[name][0]) for name, pa in sorted(only_a.items())
               if len(pa) == 1 and len(only_b.get(name, ())) == 1 and unclaimed(name, pa[0], only_b[name][0])]
    if not matches:
        return left, right, [], {}
    left, right = dict(left), dict(right)
    spellings: dict[str, list[tuple[str, Leaf]]] = {}
    for m in matches:
        la, lb = left.pop(m.a), right.pop(m.b)
        left[m.name], right[m.name] = la, lb
        spellings[m.name] = [(m.a, la), (m.b, lb)]
    return left, right, matches, spellings


def _flat_names(path: str, leaf: Leaf) -> tuple[str, ...]:
    """The dotted spellings --filter also matches, for a leaf compared under `path`
    (A's renamed path: its own name no longer describes it)."""
    dotted = dotted_name(split_path(path))
    return (dotted,) if path != leaf.path or leaf.name in (None, "", dotted) else (dotted, leaf.name)


def _castable(dtype_a: str, dtype_b: str) -> bool:
    """Two floating dtypes a cast converts between (real to real, complex to complex)."""
    da, db = dtypes.get(dtype_a), dtypes.get(dtype_b)
    return da.is_float and db.is_float and da.name.startswith("complex") == db.name.startswith("complex")


def _metadata_difference(path: str, la: Leaf, lb: Leaf) -> LeafDiff | None:
    if la.kind != lb.kind:
        return LeafDiff(path, "kind", f"{la.kind} in A, {lb.kind} in B")
    if isinstance(la, ArrayLeaf) and isinstance(lb, ArrayLeaf):
        if la.shape != lb.shape:
            return LeafDiff(path, "shape", f"shape {list(la.shape)} in A, {list(lb.shape)} in B")
        if la.dtype != lb.dtype:
            return LeafDiff(path, "dtype", f"dtype {la.dtype} in A, {lb.dtype} in B")
    return None


def _layout_differences(path: str, la: ArrayLeaf, lb: ArrayLeaf) -> list[LeafDiff]:
    """Chunk layout and recorded sharding, where both sides record them (an
    expected JSON may leave a field out: then it is not compared)."""
    out = []
    chunks_a = (la.chunk_shape, la.chunk_count) if _records(la, "chunk_shape") else None
    chunks_b = (lb.chunk_shape, lb.chunk_count) if _records(lb, "chunk_shape") else None
    shape_differs = chunks_a is not None and chunks_b is not None and chunks_a[0] != chunks_b[0]
    count_differs = _records(la, "chunks") and _records(lb, "chunks") and la.chunk_count != lb.chunk_count
    if shape_differs or count_differs:
        out.append(LeafDiff(path, "chunks", f"chunks {_chunks_text(la)} in A, {_chunks_text(lb)} in B"))
    if _records(la, "sharding") and _records(lb, "sharding"):
        sa = la.sharding.to_json() if la.sharding is not None else None
        sb = lb.sharding.to_json() if lb.sharding is not None else None
        if sa != sb:
            ta, tb = _sharding_text(la), _sharding_text(lb)
            if ta != tb:
                message = f"sharding {ta} in A, {tb} in B"
            else:  # same mesh and spec, other device ids (or another detail): name what differs
                assert sa is not None and sb is not None
                fields = [k for k in dict.fromkeys([*sa, *sb]) if sa.get(k) != sb.get(k)]
                message = f"sharding {ta}: " + "; ".join(
                    f"{k} {short_repr(sa.get(k))} in A, {short_repr(sb.get(k))} in B" for k in fields
                )
            out.append(LeafDiff(path, "sharding", message))
    return out


def _records(leaf: ArrayLeaf, name: str) -> bool:
    recorded = leaf.extra.get("recorded_fields")
    return recorded is None or name in recorded


def _chunks_text(leaf: ArrayLeaf) -> str:
    shape = leaf.chunk_shape
    return f"{list(shape) if shape is not None else 'of several shapes'} x{leaf.chunk_count}"


def _sharding_text(leaf: ArrayLeaf) -> str:
    return leaf.sharding.describe() if leaf.sharding is not None else "none recorded"


@dataclass
class _Tally:
    mismatched: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0


def _compare_values(
    pairs: list[tuple[str, ArrayLeaf, ArrayLeaf]], rtol: float, atol: float, *,
    workers: int, memory: int, progress: Progress,
) -> list[LeafDiff]:
    """Compare every pair region by region along A's stored chunks.

    The read scheduler reads both sides by stored chunk: each chunk of A and
    of B is decoded once, whatever the other side's chunking, and the pairs
    of regions are compared as soon as both are read, within `memory`.

    A pair of different dtypes (a cast, with cast_ok) cannot be compared
    byte for byte: every block is compared in float64, whose working copies
    (_COMPARE_BYTES per element of a piece) count in the budget as the
    want's `extra`.
    """
    from .engine import output_chunk_limit

    block = output_chunk_limit(memory)
    piece = _compare_elements(memory)
    tallies = {path: _Tally() for path, _, _ in pairs}
    lock = threading.Lock()
    wants: list[Want] = []
    for path, la, lb in pairs:
        tally = tallies[path]
        cast = la.dtype != lb.dtype
        # a cast compares every block in float64, in pieces counted in the budget; the same
        # dtype only a block whose bytes differ, in pieces small enough to leave uncounted
        step = piece if cast else min(piece, _UNCOUNTED_ELEMENTS)

        def compare(arrays: list[np.ndarray], tally: _Tally = tally, step: int = step) -> int:
            n, max_abs, max_rel = _compare_block(arrays[0], arrays[1], rtol, atol, step)
            if n:
                with lock:
                    tally.mismatched += n
                    tally.max_abs = max(tally.max_abs, max_abs)
                    tally.max_rel = max(tally.max_rel, max_rel)
            return int(arrays[0].nbytes)

        # both sides through the scheduler, each stored chunk decoded once: a side whose
        # chunks are too large to decode whole is streamed together with the other's
        # (scheduler/joint.py), so a pair of regions is open from its first band to its last
        for region in chunk_regions(la, block):
            wants.append(Want([(la, region), (lb, region)], compare,
                              extra=_cast_cost(la, region, piece) if cast else 0))
    total = sum(la.nbytes for _, la, _ in pairs)
    progress("compare", 0, total)
    Scheduler(wants, memory=memory, workers=workers).run(on_done=lambda n: progress("compare", n, total))
    out = []
    for path, la, _ in pairs:
        t = tallies[path]
        if t.mismatched:
            out.append(LeafDiff(
                path, "values",
                f"{t.mismatched} of {la.size} elements differ (max abs {t.max_abs:.6g}, max rel {t.max_rel:.6g})",
                max_abs=t.max_abs, max_rel=t.max_rel, mismatched=t.mismatched,
            ))
    return out


def _region_nbytes(leaf: ArrayLeaf, region: Region) -> int:
    n = dtypes.get(leaf.dtype).itemsize
    for r in region:
        n *= r.stop - r.start
    return n


# elements compared at once when a block differs (the float64 copies take 8 bytes each, several times)
_COMPARE_ELEMENTS = 2**21
# elements compared at once where a block of one dtype differs: 3.5 MiB of float64 copies,
# left out of the budget (a cast's pieces are counted: every block of it is compared so)
_UNCOUNTED_ELEMENTS = 2**16
# peak bytes per element _compare_flat holds (float64 copies of both sides, the
# difference and its temporaries, masks): 52 measured with tracemalloc; twice for complex
_COMPARE_BYTES = 56


def _compare_elements(memory: int) -> int:
    """Elements compared at once: one piece's float64 working copies take at most
    an eighth of the budget (as an output chunk does), 2M elements at most."""
    return max(4096, min(_COMPARE_ELEMENTS, memory // 8 // _COMPARE_BYTES))


def _cast_cost(leaf: ArrayLeaf, region: Region, piece: int) -> int:
    """Bytes a cast pair's comparison of `region` holds beside the two regions read."""
    elements = 1
    for r in region:
        elements *= r.stop - r.start
    complex_ = dtypes.get(leaf.dtype).name.startswith("complex")
    return min(elements, piece) * _COMPARE_BYTES * (2 if complex_ else 1)


def _compare_block(a: np.ndarray, b: np.ndarray, rtol: float, atol: float,
                   piece: int = _COMPARE_ELEMENTS) -> tuple[int, float, float]:
    """(mismatched elements, max abs, max rel) of one pair of regions, `piece` elements at a time."""
    xa = np.ascontiguousarray(a).reshape(-1)
    xb = np.ascontiguousarray(b).reshape(-1)
    if rtol == 0 and atol == 0 and xa.dtype == xb.dtype and _same_bytes(xa, xb):
        return 0, 0.0, 0.0  # bit-identical: the common case for copies and conversions
    n, max_abs, max_rel = 0, 0.0, 0.0
    for start in range(0, xa.size, piece):
        part = slice(start, start + piece)
        k, pa, pr = _compare_flat(xa[part], xb[part], rtol, atol)
        if k:
            n += k
            max_abs, max_rel = max(max_abs, pa), max(max_rel, pr)
    return n, max_abs, max_rel


# bytes compared at once by _same_bytes (tobytes() of both sides copied a whole region twice)
_EQUAL_BYTES = 4 * 2**20


def _same_bytes(xa: np.ndarray, xb: np.ndarray) -> bool:
    """Whether two contiguous flat arrays hold the same bytes, a slice at a time (its
    mask is the only memory taken: _EQUAL_BYTES; 2 GB/s here, tobytes() 0.1 GB/s)."""
    va, vb = xa.view(np.uint8), xb.view(np.uint8)
    if va.size != vb.size:
        return False
    return all(np.array_equal(va[s : s + _EQUAL_BYTES], vb[s : s + _EQUAL_BYTES])
               for s in range(0, va.size, _EQUAL_BYTES))


def _compare_flat(xa: np.ndarray, xb: np.ndarray, rtol: float, atol: float) -> tuple[int, float, float]:
    # different dtypes (a cast): equal bytes say nothing, and values are compared as numbers only
    exact = rtol == 0 and atol == 0 and xa.dtype == xb.dtype
    if exact and _same_bytes(xa, xb):
        return 0, 0.0, 0.0
    fa = xa.astype(np.float64) if xa.dtype.kind not in "c" else xa.astype(np.complex128)
    fb = xb.astype(np.float64) if xb.dtype.kind not in "c" else xb.astype(np.complex128)
    both_nan = np.isnan(fa) & np.isnan(fb)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        delta = np.abs(fa - fb)
        delta = np.where(both_nan, 0.0, delta)
        delta = np.where(np.isnan(delta), np.inf, delta)  # NaN against a number
        same_inf = (fa == fb)
        delta = np.where(same_inf, 0.0, delta)
        bad = delta > atol + rtol * np.abs(fb)
        rel = np.where(np.abs(fb) > 0, delta / np.abs(fb), np.where(delta > 0, np.inf, 0.0))
    if exact:
        # bitwise differences that compare equal as numbers (-0.0 vs 0.0) still count
        bits_a = xa.view(np.uint8).reshape(xa.size, -1)
        bits_b = xb.view(np.uint8).reshape(xb.size, -1)
        bad = bad | ((bits_a != bits_b).any(axis=1) & ~both_nan)
    n = int(bad.sum())
    if not n:
        return 0, 0.0, 0.0
    return n, float(delta.max()), float(rel.max())


def _values_equal(a: Any, b: Any) -> bool:
    """Equal as trees (lists and tuples alike), each pair of shared containers compared once."""
    return values.equal(a, b, _scalars_equal)


def _scalars_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b
