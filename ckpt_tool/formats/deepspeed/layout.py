"""Where each parameter of a DeepSpeed ZeRO checkpoint lies in the ranks' flat fp32 partitions.

Pure arithmetic on what the files record (no I/O): the parameter order and
shapes (`param_shapes`, per group, in the model-states file), the data-parallel
degree, each rank's partition lengths and paddings. The result is, per
parameter, its pieces: which rank's flat tensor of which group holds which run
of the parameter's elements (in C order). reader.py reads those runs by byte
range; checks.py reports the problems found here. See the package's reader.py
docstring for how DeepSpeed lays the partitions out and where each rule below
comes from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...core.model import ArrayLeaf, Key, RegularGrid


@dataclass(frozen=True)
class Piece:
    """A run of a parameter's elements stored in one rank's flat tensor of one group."""

    rank: int
    group: int
    start: int  # element offset in that flat tensor
    count: int  # elements
    at: int  # element offset in the parameter (C order)


@dataclass
class Mapping:
    """Per parameter (by name, in DeepSpeed's order) its pieces; and what does not add up."""

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    group_of: dict[str, int] = field(default_factory=dict)  # parameter -> its param group
    numel: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # partition lengths against shapes and padding


def _overlap(lo: int, hi: int, a: int, b: int) -> tuple[int, int] | None:
    s, e = max(lo, a), min(hi, b)
    return (s, e) if s < e else None


def zero12(
    shapes: list[list[tuple[str, int]]],
    lengths: list[list[int]],
    group_paddings: list[list[int]] | None,
    param_paddings: list[list[int]] | None,
) -> Mapping:
    """ZeRO stages 1 and 2 (DeepSpeedZeroOptimizer; also BF16_Optimizer's layout).

    Per group g, the parameters (in `shapes[g]` order, each followed by its
    alignment padding `param_paddings[g][i]`) are one flat vector padded at
    its end to a multiple of 2 x DP degree, cut into DP equal partitions of P
    elements; rank r holds [r*P, (r+1)*P). The files store each rank's
    partition without the end padding (`lengths[r][g]` = P - group_paddings
    [r][g]). Without recorded group paddings (older DeepSpeed), P is rank 0's
    stored length.
    """
    out = Mapping()
    world = len(lengths)
    if world == 0:
        out.problems.append("no optimizer-states files")
        return out
    for g, params in enumerate(shapes):
        if any(len(rank) <= g for rank in lengths):
            out.problems.append(f"group {g}: {len(params)} parameters recorded, but a rank's file has "
                                f"{min(len(r) for r in lengths)} flat partitions")
            continue
        stored = [rank[g] for rank in lengths]
        if group_paddings is not None and all(len(p) > g for p in group_paddings):
            sizes = {stored[r] + group_paddings[r][g] for r in range(world)}
            if len(sizes) != 1:
                out.problems.append(f"group {g}: the ranks' partitions plus padding differ in length "
                                    f"({', '.join(f'rank {r}: {stored[r]}+{group_paddings[r][g]}' for r in range(world))})")
                continue
            part = sizes.pop()
        else:
            part = stored[0]
        pads = param_paddings[g] if param_paddings is not None and len(param_paddings) > g else None
        if pads is not None and len(pads) != len(params):
            out.problems.append(f"group {g}: {len(pads)} parameter alignment paddings for {len(params)} parameters")
            pads = None
        offset = 0
        for i, (name, numel) in enumerate(params):
            pieces = []
            for r in range(world):
                hit = _overlap(offset, offset + numel, r * part, r * part + stored[r])
                if hit is not None:
                    pieces.append(Piece(r, g, hit[0] - r * part, hit[1] - hit[0], hit[0] - offset))
            out.pieces[name] = pieces
            out.group_of[name] = g
            out.numel[name] = numel
            if sum(p.count for p in pieces) != numel:
                out.problems.append(f"group {g}: {name} needs elements [{offset}, {offset + numel}) of the group, "
                                    f"past the {sum(stored)} stored")
            offset += numel + (pads[i] if pads else 0)
        # zero_to_fp32's sanity check: what the shapes consume and what is stored agree up to
        # the alignment to 2 x DP degree (DeepSpeed's flat groups are padded to it)
        align = 2 * world
        if math.ceil(offset / align) * align != math.ceil(sum(stored) / align) * align:
            out.problems.append(f"group {g}: the recorded shapes take {offset} elements but the {world} partitions "
                                f"hold {sum(stored)} (DeepSpeed pads only to a multiple of {align})")
    return out


def zero3(shapes: list[tuple[str, int]], lengths: list[list[int]]) -> Mapping:
    """ZeRO stage 3 (DeepSpeedZeroOptimizer_Stage3).

    Every parameter is partitioned on its own: padded to a multiple of the DP
    degree, each rank holds ceil(numel / DP) elements of it (rank r: elements
    [r*n, (r+1)*n), the last rank's tail being padding). A rank's flat groups
    (`fp32_flat_groups`), concatenated, hold its partitions of every
    parameter back to back, in the order of the recorded shapes (all groups'
    dicts merged, as zero_to_fp32 does), so a partition may in principle
    straddle two groups. Every rank's groups have the same lengths.
    """
    out = Mapping()
    world = len(lengths)
    if world == 0:
        out.problems.append("no optimizer-states files")
        return out
    if any(rank != lengths[0] for rank in lengths):
        out.problems.append("the ranks' flat groups differ in length: "
                            + "; ".join(f"rank {r}: {lengths[r]}" for r in range(world)))
        return out
    bounds = [0]
    for n in lengths[0]:
        bounds.append(bounds[-1] + n)
    total = bounds[-1]
    offset = 0  # in one rank's concatenated groups
    for name, numel in shapes:
        part = math.ceil(numel / world)
        pieces: list[Piece] = []
        for r in range(world):
            hit = _overlap(r * part, (r + 1) * part, 0, numel)
            if hit is None:
                continue
            # elements [hit) of the parameter sit at offset + (hit - r*part) of rank r's groups
            lo, hi = offset + hit[0] - r * part, offset + hit[1] - r * part
            for g in range(len(lengths[0])):
                run = _overlap(lo, hi, bounds[g], bounds[g + 1])
                if run is not None:
                    pieces.append(Piece(r, g, run[0] - bounds[g], run[1] - run[0], hit[0] + run[0] - lo))
        out.pieces[name] = pieces
        out.group_of[name] = next((g for g in range(len(lengths[0])) if bounds[g] <= offset < bounds[g + 1]), 0)
        out.numel[name] = numel
        if sum(p.count for p in pieces) != numel:
            out.problems.append(f"{name}: its partitions end past the {total} elements each rank stores")
        offset += part
    # zero_to_fp32's sanity check, exactly: the partitions fill the flat groups
    if offset != total:
        out.problems.append(f"the recorded shapes take {offset} elements per rank but each rank's flat groups "
                            f"hold {total}")
    return out


def frozen3(numel: int, lengths: list[int]) -> tuple[list[Piece], str | None]:
    """A frozen parameter at stage 3: each rank's model-states file holds its partition (its
    `ds_tensor`, ceil(numel / DP) elements); zero_to_fp32 concatenates them and keeps numel."""
    pieces = []
    at = 0
    for r, n in enumerate(lengths):
        take = min(n, numel - at)
        if take <= 0:
            break
        pieces.append(Piece(r, 0, 0, take, at))
        at += take
    return pieces, None if at == numel else f"its partitions hold {at} of its {numel} elements"


def array_leaf(keys: tuple[Key, ...], name: str, shape: tuple[int, ...], dtype: str, reader: Any,
           extra: dict[str, Any], unreadable: str | None = None) -> ArrayLeaf:
    """An array leaf of a DeepSpeed file (one tensor, or one assembled from flat partitions)."""
    return ArrayLeaf(keys=keys, name=name, shape=shape, dtype=dtype, layout=RegularGrid(shape), reader=reader,
                     verifier=getattr(reader, "verify", None), extra=extra, unreadable=unreadable)
