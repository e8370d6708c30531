"""The object a torch.save file holds, as a tree of key paths: each object walked once.

torch.load gives an object graph: the pickler memoises every container, so a
sub-dict saved under two keys is one dict at both, and a dict may hold itself
(`d['self'] = d`). This walk shows each container it descends into once, at
the first path it meets it (depth first, in the pickle's order); a later path
to the same container is a `Reference` to that first path (for a cycle, to an
enclosing path). Tensors are not containers: a tensor at two paths (tied
weights) is a leaf at both. Whether a list or tuple holds a tensor is found in
one pass over the graph, so the walk costs one step per stored reference,
whatever the sharing unfolds to (`x = [x, x]` sixty times over is 2**60 paths
in a 2 KB file).

The reader formats (torch.save, Megatron's rank files, DeepSpeed's model
states) all walk their objects through `walk`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from ...core.model import Key
from ...core.values import children, is_container
from .safe_pickle import NumpyArray, TensorRef

# containers deeper than this are one value each (their key paths would grow
# with the square of the depth); no real state dict nests that far
MAX_DEPTH = 100

TENSORS = (TensorRef, NumpyArray, np.ndarray)


@dataclass(frozen=True)
class Reference:
    """A later path to a container the walk showed at `first` (a key path; () is the top)."""

    target: Any
    first: tuple[Key, ...]


_UNSEEN, _TOP = object(), object()  # (tensor_holders: a container not met yet; the top, without a parent)


def tensor_holders(obj: Any, *, everywhere: bool = False) -> set[int]:
    """The ids of the containers from which a tensor can be reached: through dict values and
    list and tuple items (`everywhere`: through dict keys and sets as well, as a value's
    decoding goes). One pass over each object and each reference, cycles included.

    What it keeps is bounded by the containers a tensor could be under: an empty container, or a
    set where sets are not walked, is never recorded (a pickle of 2 million empty sets, 4 MB,
    once took 300 bytes each here); a container's parent is one int until it has a second."""
    walked: tuple[type, ...] = (dict, list, tuple, set, frozenset) if everywhere else (dict, list, tuple)
    parents: dict[int, Any] = {id(obj): _TOP}  # also the set of containers seen
    holding: list[int] = []
    stack = [obj]
    while stack:
        node = stack.pop()
        if everywhere:
            if not is_container(node):
                continue
            inner: Any = children(node)
        elif isinstance(node, dict):
            inner = node.values()
        elif isinstance(node, (list, tuple)):
            inner = node
        else:
            continue
        nid = id(node)  # (one int object for all its children's entries)
        for child in inner:
            if isinstance(child, TENSORS):
                holding.append(nid)
            elif isinstance(child, walked) and child:  # (numbers and strings hold nothing, nor empties)
                cid = id(child)
                known = parents.get(cid, _UNSEEN)
                if known is _UNSEEN:
                    parents[cid] = nid
                    stack.append(child)
                elif known is _TOP:  # the top, met again inside itself
                    parents[cid] = nid
                elif isinstance(known, list):
                    known.append(nid)
                else:
                    parents[cid] = [known, nid]
    found: set[int] = set()
    while holding:  # up from the containers holding a tensor, through every path to them
        nid = holding.pop()
        if nid not in found:
            found.add(nid)
            up = parents.get(nid, _TOP)
            if isinstance(up, list):
                holding.extend(up)
            elif up is not _TOP:
                holding.append(up)
    return found


def _is_subtree(value: Any, holders: set[int]) -> bool:
    """A dict of str and int keys, no two of them the same text, or a list or tuple holding a
    tensor (at any depth)."""
    if isinstance(value, dict):
        # {0: a, "0": b} stays one value: as a subtree its two children would share the key path
        # `0` (a key is its text: names.key_text), and every output but a pickle would hold one
        return (bool(value) and all(type(k) in (str, int) for k in value)
                and (all(type(k) is str for k in value) or len({str(k) for k in value}) == len(value)))
    return isinstance(value, (list, tuple)) and bool(value) and id(value) in holders


def walk(obj: Any, keys: tuple[Key, ...] = ()) -> Iterator[tuple[tuple[Key, ...], Any]]:
    """(key path, value) for each leaf of a torch.save object, depth first in its order:

    * a dict (str and int keys) is a subtree by key; a list or tuple holding a tensor, by index;
    * a container met again (shared, or enclosing itself) is a `Reference` to its first path;
    * anything else (a tensor, a number, a list without tensors, a container nested deeper
      than MAX_DEPTH) is one leaf.
    """
    holders = tensor_holders(obj)
    first: dict[int, tuple[Key, ...]] = {}
    stack: list[tuple[tuple[Key, ...], Any]] = [(keys, obj)]
    while stack:
        path, value = stack.pop()
        if not (len(path) - len(keys) <= MAX_DEPTH and _is_subtree(value, holders)):
            yield path, value
            continue
        seen = first.get(id(value))
        if seen is not None:
            yield path, Reference(value, seen)
            continue
        first[id(value)] = path
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        stack.extend((path + (k,), v) for k, v in reversed(items))


def has_tensor(value: Any) -> bool:
    """Whether a tensor can be reached from `value` (through dict values, list and tuple items)."""
    return isinstance(value, TENSORS) or id(value) in tensor_holders(value)
