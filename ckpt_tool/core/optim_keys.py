"""Optimizer state keyed by parameter ids or by FQNs: the same state, paired through param_groups.

`torch.save(optimizer.state_dict())` keys each parameter's state by an integer id (`state/0/exp_avg`)
and lists the ids in each param group (`param_groups/0/params == [0, 1, ...]`); DCP's
`get_state_dict` keys it by the parameter's FQN (`state/0.weight/exp_avg`) and lists the FQNs there
(`param_groups/0/params == ["0.weight", "0.bias", ...]`). torch maps one to the other by position
(torch/distributed/checkpoint/state_dict.py, `_get_optim_state_dict`: the id of a parameter is its
place in the chain of every group's params, and the FQN at that place is its name), so two such
states pair through their param_groups alone: the k-th param of group g on one side is the k-th of
group g on the other. Where the groups differ in count or size, or list their params in another
order (a paired param's state has another shape on the other side), nothing is paired (no guess).

Everything is read from the values each side stores: an optimizer state is any subtree holding
`param_groups` (a list of groups, each a dict with `params`; one value or split into many) and,
beside it, `state` whose entries are keyed by those params. No format is named here: the keys are
the leaves' own (a reader that splits an FQN at its dots, `state/0/weight/exp_avg`, is handled by
the FQN's dotted spelling).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Callable, Sequence

from ..base.errors import CkptError
from .model import ArrayLeaf, Key, Leaf, ValueLeaf
from ..base.names import dotted_name, join_keys

STATE = "state"
PARAM_GROUPS = "param_groups"
PARAMS = "params"

IDS = "ids"
FQNS = "FQNs"

Entry = tuple[tuple[Key, ...], Leaf]


@dataclass
class OptimizerState:
    """One optimizer state found among a side's leaves."""

    prefix: tuple[str, ...]  # the keys (as text) above `state` and `param_groups`
    groups: list[list[Any]]  # each param group's params, as stored (ids or FQNs)
    # index into the entries -> (the param it belongs to, keys its id takes: 1, or a split FQN's parts)
    state: dict[int, tuple[Any, int]] = field(default_factory=dict)
    param_groups: list[int] = field(default_factory=list)  # entries holding (part of) param_groups

    @property
    def scheme(self) -> str | None:
        """IDS, FQNS, or None (mixed, or no params: nothing to pair by)."""
        params = list(chain.from_iterable(self.groups))
        if params and all(isinstance(p, int) and not isinstance(p, bool) for p in params):
            return IDS
        if params and all(isinstance(p, str) for p in params):
            return FQNS
        return None

    @property
    def where(self) -> str:
        return join_keys(self.prefix + (PARAM_GROUPS,))

    def describe(self) -> str:
        """'keys its state by ids, 1 param group of 4 params' / '... by FQNs, 2 param groups of 2 + 3 params'."""
        sizes = [len(g) for g in self.groups]
        groups = "1 param group" if len(sizes) == 1 else f"{len(sizes)} param groups"
        return f"keys its state by {self.scheme or 'mixed params'}, {groups} of {' + '.join(map(str, sizes))} params"


@dataclass
class Pairing:
    """The params of `source` (one scheme) mapped onto those of `target` (the other), by position."""

    source: OptimizerState
    target: OptimizerState
    mapping: dict[Any, Any]  # a source param -> the target param at its place


def prefixes(entries: Sequence[Entry]) -> set[tuple[str, ...]]:
    """The places (keys as text) at which `entries` hold a `param_groups` (from the keys alone)."""
    return {tuple(str(k) for k in keys[:j]) for keys, _ in entries for j, k in enumerate(keys) if k == PARAM_GROUPS}


def find_states(entries: Sequence[Entry], only: set[tuple[str, ...]] | None = None) -> list[OptimizerState]:
    """Every optimizer state among `entries` ((keys, leaf); the keys may be renamed ones) whose
    param_groups can be read (values with a loader; an inspect JSON side has none); `only`: at
    those places alone (the others' values are not loaded)."""
    text = [tuple(str(k) for k in keys) for keys, _ in entries]
    under: dict[tuple[str, ...], list[int]] = {}
    for i, keys in enumerate(text):
        for j, k in enumerate(keys):
            if k == PARAM_GROUPS and (only is None or keys[:j] in only):
                under.setdefault(keys[:j], []).append(i)
    found = []
    for prefix, indices in under.items():
        groups = _read_groups([(text[i][len(prefix) + 1:], entries[i][1]) for i in indices])
        if groups is None:
            continue
        state = OptimizerState(prefix, groups, param_groups=indices)
        params = list(chain.from_iterable(groups))
        by_text = {str(p): p for p in params}
        n = len(prefix)
        for i, keys in enumerate(text):
            if len(keys) > n + 1 and keys[:n] == prefix and keys[n] == STATE:
                owner = _owner(keys[n + 1:], by_text)
                if owner is not None:
                    state.state[i] = owner
        found.append(state)
    return found


def _read_groups(parts: list[tuple[tuple[str, ...], Leaf]]) -> list[list[Any]] | None:
    """Each group's params, from param_groups stored whole or split into values (relative keys)."""
    values = [(rel, leaf) for rel, leaf in parts if isinstance(leaf, ValueLeaf) and leaf.loader is not None]
    if len(values) != len(parts):  # an array among them, or no value to read (an inspect JSON side)
        return None
    root = _Node()
    whole: Any = None
    try:
        for rel, leaf in values:
            value = leaf.load()
            if not rel:
                whole = value
                continue
            node = root
            for k in rel[:-1]:
                node = node.setdefault(k, _Node())
                if not isinstance(node, _Node):  # below a loaded value: never written into (a reader's own)
                    return None
            if rel[-1] in node:
                return None
            node[rel[-1]] = value
    except CkptError:
        return None  # an undecodable value: diff and convert say so where they load it
    if whole is not None and root:
        return None  # stored whole and in parts: not one param_groups
    groups = whole if whole is not None else _as_list(root)
    if not isinstance(groups, (list, tuple)):
        return None
    out = []
    for group in groups:
        group = _as_list(group) if isinstance(group, dict) and PARAMS not in group else group
        if not isinstance(group, dict) or PARAMS not in group:
            return None
        params = group[PARAMS]
        params = _as_list(params) if isinstance(params, dict) else params
        if not isinstance(params, (list, tuple)):
            return None
        out.append(list(params))
    return out


class _Node(dict):  # type: ignore[type-arg]
    """A part of param_groups assembled from its leaves (told apart from a dict a leaf held)."""


def _as_list(node: Any) -> Any:
    """A dict of the keys '0'..'n-1' (a list split into leaves) as that list; anything else as it is."""
    if isinstance(node, dict) and node and all(isinstance(k, str) for k in node):
        if set(node) == {str(i) for i in range(len(node))}:
            return [_as_list(node[str(i)]) for i in range(len(node))]
    return node


def _owner(rest: tuple[str, ...], by_text: dict[str, Any]) -> tuple[Any, int] | None:
    """(param, keys it takes) of a state entry's keys below `state`: its first key is the param's
    id or FQN, or the first keys spell the FQN split at its dots; the longest such FQN wins."""
    for n in range(len(rest) - 1, 0, -1):  # (at least one key after it: the state's own name)
        name = dotted_name(rest[:n])
        if name in by_text:
            return by_text[name], n
    return None


def mismatch(a: OptimizerState, b: OptimizerState, names: tuple[str, str] = ("A", "B")) -> str | None:
    """Why the params of `a` and `b` cannot be paired by position (their groups differ in count
    or size, a param is listed twice), naming both sides; None when they can."""
    sizes_a, sizes_b = [len(g) for g in a.groups], [len(g) for g in b.groups]
    flat_a, flat_b = list(chain.from_iterable(a.groups)), list(chain.from_iterable(b.groups))
    if len(sizes_a) != len(sizes_b):
        why = "the param groups differ in count"
    elif sizes_a != sizes_b:
        why = "the param groups differ in size"
    elif len(set(map(str, flat_a))) != len(flat_a) or len(set(map(str, flat_b))) != len(flat_b):
        why = "a param is listed twice"
    else:
        return None
    return f"{why} ({names[0]} {a.describe()}; {names[1]} {b.describe()}): not paired"


def pair(source: OptimizerState, target: OptimizerState) -> Pairing | None:
    """`source`'s params mapped onto `target`'s by position, when they can be (mismatch says why
    not) and the two key their state differently (one by ids, the other by FQNs); else None."""
    if source.scheme is None or target.scheme is None or source.scheme == target.scheme:
        return None
    if mismatch(source, target) is not None:
        return None
    return Pairing(source, target, dict(zip(chain.from_iterable(source.groups), chain.from_iterable(target.groups))))


def shape_conflict(pairing: Pairing, source: Sequence[Entry], target: Sequence[Entry],
                   names: tuple[str, str] = ("A", "B")) -> str | None:
    """Why the pairing is not the one each side's state describes, or None: a paired param whose
    state array has another shape on the other side (`exp_avg` of a [8, 4] weight paired with that
    of a [2, 8] one), which is what groups of equal sizes listed in another order give. `names`:
    how to call the source and the target."""
    def arrays(state: OptimizerState, entries: Sequence[Entry]) -> dict[tuple[str, str], tuple[str, ArrayLeaf]]:
        out = {}
        n = len(state.prefix)
        for i, (param, taken) in state.state.items():
            keys, leaf = entries[i]
            if isinstance(leaf, ArrayLeaf):
                out[(str(param), dotted_name(keys[n + 1 + taken:]))] = (join_keys(keys), leaf)
        return out

    theirs = arrays(pairing.target, target)
    mapping = {str(mine): str(other) for mine, other in pairing.mapping.items()}
    for (param, rest), (path, leaf) in sorted(arrays(pairing.source, source).items()):
        other = theirs.get((mapping.get(param, ""), rest))
        if other is not None and tuple(other[1].shape) != tuple(leaf.shape):
            return (f"the param groups list their params in another order: paired by position, {path} in "
                    f"{names[0]} is {list(leaf.shape)} and {other[0]} in {names[1]} is {list(other[1].shape)}")
    return None


def rekey(entries: Sequence[Entry], pairing: Pairing) -> tuple[list[Entry], int]:
    """`entries` (the source side's) with each state entry of `pairing.source` keyed by the target's
    param at its place, and its param_groups' params mapped likewise; the others as they are.
    Also the number of state entries re-keyed."""
    src = pairing.source
    n = len(src.prefix)
    out = list(entries)
    moved = 0
    for i, (param, taken) in src.state.items():
        keys, leaf = entries[i]
        new = pairing.mapping.get(param)
        if new is None:
            continue
        out[i] = (tuple(keys[:n + 1]) + (new,) + tuple(keys[n + 1 + taken:]), leaf)
        moved += 1
    for i in src.param_groups:
        keys, leaf = entries[i]
        assert isinstance(leaf, ValueLeaf)
        rel = tuple(str(k) for k in keys[n + 1:])
        out[i] = (keys, _mapped_leaf(leaf, rel, pairing.mapping))
    return out, moved


def _mapped_leaf(leaf: ValueLeaf, rel: tuple[str, ...], mapping: dict[Any, Any]) -> ValueLeaf:
    """The param_groups value `leaf` (at `rel` below param_groups) with its params mapped."""
    load = leaf.load

    def loader() -> Any:
        return _map_params(load(), rel, lambda p: mapping.get(p, p))

    return replace(leaf, loader=loader)


def _map_params(value: Any, rel: tuple[str, ...], fn: Callable[[Any], Any]) -> Any:
    """The params inside a part of param_groups (the whole list, a group, its params, one param)."""
    def each(items: Any, f: Callable[[Any], Any]) -> Any:
        # a new list or tuple (never the loaded one changed: a reader may hand it out again)
        return tuple(map(f, items)) if isinstance(items, tuple) else list(map(f, items))

    def group(g: Any) -> Any:
        if isinstance(g, dict) and isinstance(g.get(PARAMS), (list, tuple)):
            return {**g, PARAMS: each(g[PARAMS], fn)}
        return g

    if not rel:
        return each(value, group) if isinstance(value, (list, tuple)) else value
    if len(rel) == 1:
        return group(value)
    if rel[1] != PARAMS:
        return value
    if len(rel) == 2:
        return each(value, fn) if isinstance(value, (list, tuple)) else value
    return fn(value) if len(rel) == 3 else value


def with_keys(leaf: Leaf, keys: tuple[Key, ...]) -> Leaf:
    """`leaf` under other keys (its data and loader the same)."""
    if tuple(leaf.keys) == keys:
        return leaf
    return replace(leaf, keys=keys, name=dotted_name(keys)) if isinstance(leaf, (ArrayLeaf, ValueLeaf)) else leaf


@dataclass
class Rekeyed:
    """What `convert --optimizer-keys-like REF` did to one optimizer state of the source."""

    where: str  # its param_groups path
    was: str  # how the source keyed it: IDS or FQNS
    now: str  # how REF keys it
    leaves: int  # state leaves re-keyed

    def line(self) -> str:
        if self.was == self.now:
            return f"optimizer state under {self.where} is keyed by {self.now} already, as the reference keys it"
        noun = "leaf" if self.leaves == 1 else "leaves"
        return (f"re-keyed {self.leaves} optimizer state {noun} from {self.was} to {self.now} through "
                f"{self.where}, as the reference keys them")

    def to_json(self) -> dict[str, Any]:
        return {"where": self.where, "was": self.was, "now": self.now, "leaves": self.leaves}


def rekey_like(entries: Sequence[Entry], reference: Sequence[Entry], source_path: str,
               reference_path: str) -> tuple[list[Entry], list[Rekeyed]]:
    """The source's entries with each optimizer state keyed as the reference keys its own (ids or
    FQNs), paired through their param_groups by position; the state at the same place in the
    reference, or the only one of each. CkptError, one line naming both, when a side holds no
    optimizer state, its params are of neither scheme, or the groups differ in count or size."""
    option = "--optimizer-keys-like"
    mine, theirs = find_states(entries), find_states(reference)
    if not mine:
        raise CkptError(f"{option}: the source holds no optimizer state (a `state` beside a `param_groups` "
                        "whose groups list their `params`)", source_path)
    if not theirs:
        raise CkptError(f"{option}: the reference holds no optimizer state (a `state` beside a `param_groups` "
                        "whose groups list their `params`)", reference_path)
    by_prefix = {st.prefix: st for st in theirs}
    out = list(entries)
    done = []
    for st in mine:
        ref = by_prefix.get(st.prefix) or (theirs[0] if len(mine) == 1 and len(theirs) == 1 else None)
        if ref is None:
            have = ", ".join(t.where for t in theirs)
            raise CkptError(f"{option}: the reference has no optimizer state at {st.where} (it has {have})",
                            reference_path)
        for side, path in ((st, source_path), (ref, reference_path)):
            if side.scheme is None:
                raise CkptError(f"{option}: {side.where}: its params are neither all integer ids nor all FQNs", path)
        why = mismatch(st, ref, ("the source", "the reference"))
        if why is not None:
            raise CkptError(f"{option}: {st.where} in the source, {ref.where} in the reference: {why}",
                            reference_path)
        assert st.scheme is not None and ref.scheme is not None
        pairing = pair(st, ref)
        moved = 0
        if pairing is not None:
            conflict = shape_conflict(pairing, entries, reference, ("the source", "the reference"))
            if conflict is not None:
                raise CkptError(f"{option}: {st.where}: {conflict}; not paired", reference_path)
            out, moved = rekey(out, pairing)
        done.append(Rekeyed(st.where, st.scheme, ref.scheme, moved))
    return out, done
