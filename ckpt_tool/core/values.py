"""Decoded values as object graphs: walked once each, whatever they share.

A pickle (torch.save, a DCP bytes item) is a graph, not a tree: the pickler
memoises every container, so one list may sit at many places (Adam's `betas`
tuple in every param group, a sub-dict saved under two keys) and a container
may hold itself (`d['self'] = d`, which torch.load rebuilds as it was). Walking
such a value as a tree costs as many steps as it has paths: `x = [x, x]`
sixty times over is a 2 KB file with 2**60 paths. The helpers here visit each
object once (by identity), so their cost follows the pickle's size:

  * `nodes`: every distinct object reachable from a value;
  * `transform`: a copy with atoms replaced, sharing and cycles kept (the copy
    is a graph of the same shape, as torch.load's own result is);
  * `unfolded_size` / `check_tree`: what writing the value as a tree (a JSON
    document, an Orbax pytree) would cost, refused past a bound or on a cycle;
  * `equal`: structural equality of two graphs (diff), memoised by pairs;
  * `SameObject`: what a tree shows at a later path of a container it already
    shows at another.

Containers are lists, dicts, sets and frozensets (their subclasses too: an
OrderedDict is copied as a dict) and plain tuples; anything else is an atom (a
torch.Size, a tuple subclass, is one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..base.errors import CorruptMetadataError

# what one value may unfold to when it has to be written as a tree: the bound
# NeMo's model.yaml reader keeps for YAML aliases, far above any real config
MAX_UNFOLDED = 1 << 20

def is_container(value: Any) -> bool:
    return isinstance(value, (list, dict, set, frozenset)) or type(value) is tuple


@dataclass(frozen=True)
class SameObject:
    """A later reference to a container the tree already shows at `name` (its dotted name; ""
    for the file's top-level object): torch.load gives the one object at both places."""

    name: str

    def __repr__(self) -> str:
        return f"<the same object as {self.name or 'the top-level object'}>"


class SharedValueError(CorruptMetadataError):
    """A value that refers to itself, or unfolds past MAX_UNFOLDED, where a tree is needed."""


def children(value: Any) -> Iterator[Any]:
    """The objects a container holds directly (a dict's keys and values)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield v
    elif is_container(value):
        yield from value


def nodes(value: Any) -> Iterator[Any]:
    """Every distinct object reachable from `value` (itself first), once each; no recursion."""
    seen = {id(value)}
    stack = [value]
    while stack:
        node = stack.pop()
        yield node
        if is_container(node):
            for child in children(node):
                if id(child) not in seen:
                    seen.add(id(child))
                    stack.append(child)


def transform(value: Any, convert: Callable[[Any], Any], where: str | None = None,
              memo: dict[int, Any] | None = None, key: Callable[[Any], Any] | None = None) -> Any:
    """A copy of `value` with each non-container object replaced by `convert(obj)` (an object
    it replaces is replaced once, wherever it is shared); a container `convert` returns is
    copied in turn. Lists, dicts and sets
    keep their identity: what is shared stays shared, a cycle stays a cycle. `key(k)`, when
    given, replaces each dict key before it is copied. `memo` (id of an original -> its copy)
    may be shared between calls on parts of one graph; the originals must then stay alive as
    long as it does."""
    memo = {} if memo is None else memo
    # the originals behind the ids in `memo` stay alive for as long as this call runs
    keep: list[Any] = []

    def walk(v: Any) -> Any:
        vid = id(v)
        if vid in memo:
            return memo[vid]
        src = v
        if not is_container(v):
            src = convert(v)
            if src is v:
                return v  # (an atom kept as it is needs no memo entry: most of a value's objects)
            if not is_container(src):
                keep.append(v)
                memo[vid] = src
                return src
        keep.append(v)
        out: Any
        if isinstance(src, list):
            out = memo[vid] = []
            out.extend(walk(x) for x in src)
        elif isinstance(src, dict):
            out = memo[vid] = {}
            for k, x in list(src.items()):
                out[walk(key(k) if key is not None else k)] = walk(x)
        elif type(src) is tuple:
            # (a tuple cannot hold itself without a list or dict between: those are memoised first)
            out = memo[vid] = tuple(walk(x) for x in src)
        else:  # a set or frozenset: its elements are hashable atoms or tuples of them
            out = memo[vid] = type(src)(walk(x) for x in src)
        return out

    try:
        return walk(value)
    except RecursionError:
        raise CorruptMetadataError("value nested too deeply to decode", where) from None


def unfolded_size(value: Any, limit: int = MAX_UNFOLDED) -> int | None:
    """How many objects `value` is as a tree (a shared container counted at each place), or
    None when it holds itself or is more than `limit`. Each object is visited once."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, Iterator[Any] | None]] = [(value, None)]
    pending: list[int] = []  # the size so far of each container on the path
    while stack:
        node, it = stack[-1]
        if it is None:
            if not is_container(node):
                stack.pop()
                _add(pending, 1)
                continue
            nid = id(node)
            if nid in sizes:
                stack.pop()
                _add(pending, sizes[nid])
                if pending and pending[-1] > limit:
                    return None
                continue
            if nid in on_path:
                return None
            on_path.add(nid)
            it = children(node)
            stack[-1] = (node, it)
            pending.append(1)
        child = next(it, _END)
        if child is _END:
            stack.pop()
            size = pending.pop()
            on_path.discard(id(node))
            sizes[id(node)] = size
            _add(pending, size)
            if size > limit or (pending and pending[-1] > limit):
                return None
        else:
            stack.append((child, None))
    return sizes.get(id(value), 1)


_END = object()


def _add(pending: list[int], n: int) -> None:
    if pending:
        pending[-1] += n


def check_tree(value: Any, where: str | None, limit: int = MAX_UNFOLDED) -> None:
    """SharedValueError when `value` cannot be written out as a tree: it holds itself, or its
    shared parts unfold to more than `limit` objects."""
    if not is_container(value) or _small_tree(value, min(limit, _SMALL)) or unfolded_size(value, limit) is not None:
        return
    if _cyclic(value):
        raise SharedValueError("holds itself (a container inside its own contents, as torch.load gives it): "
                               "it has no form as a tree", where)
    raise SharedValueError(f"shares objects so that it unfolds to more than {limit:,} values as a tree "
                           "(torch.load gives one object at each shared place)", where)


_SMALL = 4096


def _small_tree(value: Any, budget: int) -> bool:
    """Whether `value` is a tree of at most `budget` objects as it unfolds (a cycle never is):
    most values are, and counting them costs less than unfolded_size's memo."""
    stack = [value]
    while stack:
        budget -= 1
        if budget < 0:
            return False
        node = stack.pop()
        if is_container(node):
            stack.extend(children(node))
    return True


def _cyclic(value: Any) -> bool:
    state: dict[int, bool] = {}  # id -> finished
    stack: list[tuple[Any, Iterator[Any]]] = [(value, children(value))]
    state[id(value)] = False
    while stack:
        node, it = stack[-1]
        child = next(it, _END)
        if child is _END:
            state[id(node)] = True
            stack.pop()
        elif is_container(child):
            done = state.get(id(child))
            if done is False:
                return True
            if done is None:
                state[id(child)] = False
                stack.append((child, children(child)))
    return False


def equal(a: Any, b: Any, scalar_equal: Callable[[Any, Any], bool] | None = None) -> bool:
    """Whether two values are equal as trees (lists and tuples alike, dicts by key), each pair
    of containers compared once; a pair met again inside its own comparison is taken as equal
    (two cycles of the same shape are equal). `scalar_equal` compares everything else."""
    same = scalar_equal or (lambda x, y: bool(x == y))
    known: set[tuple[int, int]] = set()  # pairs equal, or being compared
    keep: list[Any] = []
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if x is y and not isinstance(x, float):
            continue
        pair = (id(x), id(y))
        if pair in known:
            continue
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if len(x) != len(y):
                return False
            known.add(pair)
            keep.append((x, y))
            stack.extend(zip(x, y))
        elif isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys():
                return False
            known.add(pair)
            keep.append((x, y))
            stack.extend((x[k], y[k]) for k in x)
        elif not same(x, y):
            return False
    return True


def jsonable(value: Any, atom: Callable[[Any], Any], where: str | None = None,
             limit: int = MAX_UNFOLDED) -> Any:
    """`value` as JSON data (dict keys as strings, tuples and sets as lists, `atom(x)` for
    anything else); SharedValueError when it has no tree form within `limit` objects."""
    check_tree(value, where, limit)

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return atom(v)

    try:
        return walk(value)
    except RecursionError:
        raise CorruptMetadataError("value nested too deeply to write as JSON", where) from None
