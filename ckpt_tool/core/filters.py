"""Leaf filters: the one glob syntax of `--filter` (inspect, diff) and
`--select`/`--exclude` (convert, reshard).

A leaf has two spellings and a pattern matches a leaf when it matches either:

- its key path, the keys joined by `/` (`params/dense/kernel`, `model/layers/0/mlp/up_proj/weight`)
  with base/names.py's one reversible escape (a key holding `/` or `%` spells them `%2F` and `%25`:
  the safetensors tensor `a/b` is `a%2Fb`, never the `a/b` of the tensor `a.b`):
  `*` and `?` stay within one key, `**` spans keys (`params/**/kernel`);
- its flat name, the keys joined by `.` (`params.dense.kernel`,
  `model.layers.0.mlp.up_proj.weight`), and the format's own flat name where
  that differs (an Orbax item's parameter name, without the item, as
  `inspect --json` shows it under `name`): here a dot is an ordinary
  character, because keys may hold dots themselves (Hugging Face tensor names,
  torch FQNs such as `0.weight`), so `*` crosses dots and
  `model.layers.0.*` is everything under layer 0. A pattern holding a `/` is a key
  path only: it is never matched against a flat name (where a `/` would be a key's
  own character, and `a/b` would pick the tensor `a/b` besides the key path `a/b`).

`[...]` is a character class in both. A pattern that matches no leaf is
almost always a typo (a key spelled wrong, a `.` where the tree has `/`): it
is an error naming the pattern (NoMatchError), never an empty result.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from ..base.errors import NoMatchError
from ..base.names import dotted_name

if TYPE_CHECKING:
    from .model import Key, Leaf


def _translate(pattern: str, *, keys: bool) -> str:
    """The regex of a glob: over '/'-joined keys (`keys`) or over a flat name."""
    out = []
    i = 0
    while i < len(pattern):
        if keys and pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            ch = pattern[i]
            if ch == "*":
                out.append("[^/]*" if keys else ".*")
            elif ch == "?":
                out.append("[^/]" if keys else ".")
            elif ch == "[":
                j = pattern.find("]", i)
                if j == -1:
                    out.append(re.escape(ch))
                else:
                    out.append(fnmatch.translate(pattern[i : j + 1])[4:-3])
                    i = j
            else:
                out.append(re.escape(ch))
            i += 1
    return "".join(out)


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Glob over '/'-joined keys: `*` stays within one key, `**` spans keys."""
    return re.compile(_translate(pattern, keys=True))


def flat_names(keys: Sequence[Key], name: str | None = None) -> tuple[str, ...]:
    """A leaf's flat spellings: its keys joined by '.', and the format's own name where that differs."""
    dotted = dotted_name(tuple(keys))
    return (dotted,) if not name or name == dotted else (dotted, name)


@dataclass(frozen=True)
class Glob:
    """One filter pattern, as given to `option` (named in errors)."""

    pattern: str
    option: str = "--filter"
    _keys: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _flat: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_keys", glob_to_regex(self.pattern))
        # (a pattern with a '/' is a key path only: see the module docstring)
        flat = None if "/" in self.pattern else re.compile(_translate(self.pattern, keys=False), re.DOTALL)
        object.__setattr__(self, "_flat", flat)

    def matches(self, path: str, names: Iterable[str] = ()) -> bool:
        """Whether the pattern matches the joined key `path` (model.keys_path) or one of the flat `names`."""
        if self._keys.fullmatch(path) is not None:
            return True
        flat = self._flat
        return flat is not None and any(flat.fullmatch(n) is not None for n in names)

    def matches_leaf(self, leaf: Leaf) -> bool:
        return self.matches(leaf.path, flat_names(leaf.keys, leaf.name))

    def no_match(self, leaves: Sequence[Leaf], where: str | None = None, what: str = "") -> NoMatchError:
        """The error for this pattern matching none of `leaves` (`what`: whose leaves, e.g.
        " of A (...) and B (...)"): one line, with how a leaf there is spelled."""
        n = len(leaves)
        if not n:
            return NoMatchError(f"{self.option} {self.pattern!r} matches no leaf: there are none{what}", where)
        first = leaves[0]
        dotted = flat_names(first.keys, first.name)[0]
        none = f"matches none of the {n} leaves" if n != 1 else "does not match the one leaf"
        text = (f"{self.option} {self.pattern!r} {none}{what}; a pattern matches a leaf's "
                f"'/'-joined keys or its dotted name, e.g. {first.path!r} or {dotted!r}")
        return NoMatchError(text, where)


def filter_leaves(leaves: Sequence[Leaf], pattern: str | None, *, option: str = "--filter",
                  where: str | None = None) -> list[Leaf]:
    """The leaves `pattern` matches (all of them without one); NoMatchError when it matches none."""
    if not pattern:
        return list(leaves)
    glob = Glob(pattern, option)
    out = [leaf for leaf in leaves if glob.matches_leaf(leaf)]
    if not out:
        raise glob.no_match(leaves, where)
    return out


class Selection:
    """--select/--exclude over a checkpoint's leaves: keep a leaf when it
    matches some --select pattern (or none is given) and no --exclude pattern.

    Every pattern must match at least one leaf of the checkpoint (an --exclude
    is checked against all leaves, not just the selected ones): a pattern that
    matches nothing is refused before anything is planned or written.
    """

    def __init__(self, select: Sequence[str], exclude: Sequence[str], leaves: Sequence[Leaf],
                 where: str | None = None) -> None:
        sel = [Glob(p, "--select") for p in select]
        exc = [Glob(p, "--exclude") for p in exclude]
        hit: set[Glob] = set()
        self._kept: set[int] = set()
        for leaf in leaves:
            path, names = leaf.path, flat_names(leaf.keys, leaf.name)
            in_sel = [g for g in sel if g.matches(path, names)]
            in_exc = [g for g in exc if g.matches(path, names)]
            hit.update(in_sel, in_exc)
            if (in_sel or not sel) and not in_exc:
                self._kept.add(id(leaf))
        for glob in [*sel, *exc]:
            if glob not in hit:
                raise glob.no_match(leaves, where)

    def keeps(self, leaf: Leaf) -> bool:
        return id(leaf) in self._kept
