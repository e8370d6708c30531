"""`convert --unstack`: split a stacked axis of array leaves into one leaf per index.

Megatron-Core stores a transformer's layers stacked: `decoder.layers.mlp.linear_fc1.weight`
holds every layer's weight under one key with a leading layer axis (and MoE experts add
another axis); Flax models trained with `nn.scan` do the same. Hugging Face names each
layer's tensor apart (`model.layers.3.mlp.up_proj.weight`), so unstacking is the first
step of an export.

A spec is a glob over '/'-joined keys (core/filters.py's syntax) with one whole component
`{i}` marking where the new index key goes: `decoder/layers/{i}/**` unstacks axis 0 of
every array under `decoder/layers/` into `decoder/layers/0/...`, `decoder/layers/1/...`.
`{i:N}` takes axis N instead. The glob a leaf must match is the spec without its `{i}`
component; the components before `{i}` must each be one key (no `**`), so the index always
lands at the same depth. Specs apply in order, each to the leaves the previous ones made:
`--unstack 'decoder/layers/{i}/**' --unstack 'decoder/layers/*/mlp/experts/{i}/**'`
unstacks layers, then each layer's experts. `--rename` applies after: `params/layers/(\\d+)/
=params/layers_\\1/` turns a scanned Flax tree into `layers_0`, `layers_1`.

An unstacked leaf is a view of its source: it reads the source's region with the index
put back, so the scheduler still decodes each stored source chunk once, however many
layers it holds (base_region gives the engine the source leaf and region to ask for).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..base.errors import CkptError, UsageError
from .filters import Glob, flat_names
from .model import ArrayLeaf, Chunk, ChunkList, Key, Leaf, Region, RegularGrid

_MARK = re.compile(r"^\{i(?::(\d+))?\}$")


@dataclass(frozen=True)
class UnstackSpec:
    """One --unstack pattern: where its {i} is, and the axis it splits."""

    pattern: str  # as given
    glob: Glob  # the pattern without its {i} component
    position: int  # keys before the new index key
    axis: int


def parse_specs(patterns: Sequence[str]) -> list[UnstackSpec]:
    out = []
    for pattern in patterns:
        parts = pattern.split("/")
        marks = [i for i, p in enumerate(parts) if _MARK.match(p)]
        if len(marks) != 1:
            raise UsageError(f"--unstack {pattern!r}: needs exactly one '{{i}}' component marking where the index "
                             "goes, e.g. 'decoder/layers/{i}/**'")
        at = marks[0]
        if any("**" in p for p in parts[:at]):
            raise UsageError(f"--unstack {pattern!r}: the components before '{{i}}' must each be one key (no '**'): "
                             "the index must land at one depth")
        rest = parts[:at] + parts[at + 1:]
        if not rest or not any(rest[at:]):
            raise UsageError(f"--unstack {pattern!r}: '{{i}}' needs a pattern after it, e.g. '{{i}}/**'")
        axis = int(_MARK.match(parts[at]).group(1) or 0)  # type: ignore[union-attr]
        out.append(UnstackSpec(pattern, Glob("/".join(rest), "--unstack"), at, axis))
    return out


@dataclass(repr=False)
class UnstackedLeaf(ArrayLeaf):
    """Index `index` of axis `axis` of `base`: a view, read through the base leaf."""

    base: ArrayLeaf | None = field(default=None, compare=False)
    axis: int = 0
    index: int = 0


def _drop(values: tuple, axis: int) -> tuple:
    return values[:axis] + values[axis + 1:]


def _projected_layout(leaf: ArrayLeaf, axis: int, index: int) -> RegularGrid | ChunkList:
    if isinstance(leaf.layout, RegularGrid):
        return RegularGrid(_drop(leaf.layout.chunk_shape, axis))
    chunks = tuple(Chunk(_drop(c.offsets, axis), _drop(c.sizes, axis)) for c in leaf.layout.chunks
                   if c.offsets[axis] <= index < c.offsets[axis] + c.sizes[axis])
    return ChunkList(chunks)


def unstacked(leaf: ArrayLeaf, keys: tuple[Key, ...], axis: int, index: int) -> UnstackedLeaf:
    shape = _drop(tuple(leaf.shape), axis)

    def read(region: Region) -> np.ndarray:
        full = region[:axis] + (slice(index, index + 1),) + region[axis:]
        return leaf.read(full).reshape(tuple(r.stop - r.start for r in region))

    return UnstackedLeaf(
        keys=keys, name=".".join(str(k) for k in keys), shape=shape, dtype=leaf.dtype,
        layout=_projected_layout(leaf, axis, index), sharding=None, reader=read,
        extra={"unstacked_from": leaf.path, "axis": axis, "index": index},
        unreadable=leaf.unreadable, base=leaf, axis=axis, index=index,
    )


def base_region(leaf: ArrayLeaf, region: Region) -> tuple[ArrayLeaf, Region]:
    """The stored leaf and the region of it that `region` of a (possibly nested) view reads."""
    while isinstance(leaf, UnstackedLeaf) and leaf.base is not None:
        region = region[:leaf.axis] + (slice(leaf.index, leaf.index + 1),) + region[leaf.axis:]
        leaf = leaf.base
    return leaf, region


def apply(specs: Sequence[UnstackSpec], leaves: Sequence[Leaf], where: str | None = None) -> tuple[list[Leaf], list[str]]:
    """The leaves with every spec applied in order; and the value leaves a spec matched
    (they cannot be unstacked: the caller refuses them or, with --skip-unsupported, drops them).
    A spec that matches no leaf is refused (NoMatchError), as --select is."""
    out = list(leaves)
    values: list[str] = []
    for spec in specs:
        hit = False
        nxt: list[Leaf] = []
        for leaf in out:
            if not spec.glob.matches(leaf.path, flat_names(leaf.keys, leaf.name)):
                nxt.append(leaf)
                continue
            hit = True
            if not isinstance(leaf, ArrayLeaf):
                values.append(leaf.path)
                continue
            if leaf.ndim <= spec.axis:
                raise CkptError(f"--unstack {spec.pattern!r}: {leaf.path} has {leaf.ndim} dimension"
                                 f"{'s' if leaf.ndim != 1 else ''}, no axis {spec.axis} to unstack")
            if len(leaf.keys) < spec.position:
                raise CkptError(f"--unstack {spec.pattern!r}: {leaf.path} is too shallow for the index's place")
            keys = tuple(leaf.keys)
            for i in range(leaf.shape[spec.axis]):
                # the index as a str key, as a Hugging Face name reads back ("layers.3." -> "3")
                nxt.append(unstacked(leaf, keys[:spec.position] + (str(i),) + keys[spec.position:], spec.axis, i))
        if not hit:
            raise spec.glob.no_match(out, where)
        out = nxt
    return out, values
