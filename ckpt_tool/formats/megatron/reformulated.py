"""Megatron-Core's flattened-range tensors, shown and read as the logical tensors they hold.

The distributed optimizer of megatron-core <= 0.15 (`fully_sharded_model_space`) saves each
parameter's state as flat slices of its tensor-parallel block: DP rank r holds elements
[start, stop) of the block in C order. torch DCP cannot hold such slices of an N-d tensor, so
megatron stores them "nd-reformulated" (dist_checkpointing/strategies/torch.py and
resharding.py): a DCP tensor of size `grid + (prod(block),)`, where `grid` is the number of
blocks along each axis (axis_fragmentations) and `block = orig_shape // grid`; a rank's slice
of the block at grid index g is the chunk at offsets `g + (start,)`, sizes `(1,)*ndim +
(stop - start,)`. `.metadata`'s `mcore_data[key]["nd_reformulated_orig_global_shape"]` records
the logical shape.

So the logical tensor is a regular grid of `block`-shaped chunks, each the C-order reshape of
one row of the stored tensor; a region of it is read as the flat ranges of the stored rows it
touches (whole rows of a block are one range; a narrow slice, row by row), each read by byte
range from the DCP chunks (the scheduler streams a block larger than --memory in bands).
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ...core.contract import ArrayReader
from ...base import dtypes
from ...base.errors import CorruptMetadataError
from ...core.model import ArrayLeaf, ChunkList, Key, Region, RegularGrid

ORIG_SHAPE = "nd_reformulated_orig_global_shape"
_SLACK = 1 << 20  # bytes of extra span read to avoid a read per row


def grid_and_block(stored: tuple[int, ...], orig: tuple[int, ...], where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(grid, block) of a reformulated tensor, checked: the blocks tile `orig`, a block is one stored row."""
    grid = stored[:-1]
    if len(grid) != len(orig) or any(g <= 0 or o % g for g, o in zip(grid, orig)):
        raise CorruptMetadataError(
            f"stored as {list(stored)} but mcore_data gives the logical shape {list(orig)}: its blocks do not tile it",
            where)
    block = tuple(o // g for o, g in zip(orig, grid))
    if math.prod(block) != stored[-1]:
        raise CorruptMetadataError(
            f"a stored row holds {stored[-1]} elements, a {list(block)} block of {list(orig)} needs {math.prod(block)}",
            where)
    return grid, block


class ReformulatedReader(ArrayReader):
    """Regions of the logical tensor, read as flat ranges of the stored (DCP) rows."""

    reads_byte_ranges = True

    def __init__(self, stored: ArrayLeaf, grid: tuple[int, ...], block: tuple[int, ...]) -> None:
        self._stored = stored
        self._grid = grid
        self._block = block

    def _flat(self, g: tuple[int, ...], start: int, stop: int) -> np.ndarray:
        region = tuple(slice(i, i + 1) for i in g) + (slice(start, stop),)
        return self._stored.read(region).reshape(-1)

    def __call__(self, region: Region) -> np.ndarray:
        out = np.empty(tuple(r.stop - r.start for r in region), dtype=dtypes.numpy_dtype(self._stored.dtype))
        if out.size == 0:
            return out
        ranges = [range(r.start // b, (r.stop - 1) // b + 1) for r, b in zip(region, self._block)]
        for g in itertools.product(*ranges):
            lo = tuple(max(r.start - i * b, 0) for r, i, b in zip(region, g, self._block))
            hi = tuple(min(r.stop - i * b, b) for r, i, b in zip(region, g, self._block))
            target = out[tuple(slice(i * b + l - r.start, i * b + h - r.start)
                               for r, i, b, l, h in zip(region, g, self._block, lo, hi)) + (Ellipsis,)]
            self._fill(g, 0, self._block, lo, hi, target)
        return out

    def _fill(self, g: tuple[int, ...], base: int, shape: tuple[int, ...], lo: tuple[int, ...],
              hi: tuple[int, ...], out: np.ndarray) -> None:
        """Fill `out` with [lo, hi) of the C-ordered block part of `shape` starting at flat `base`."""
        if not shape:
            out[...] = self._flat(g, base, base + 1).reshape(())
            return
        row = math.prod(shape[1:])
        if all(l == 0 and h == n for l, h, n in zip(lo[1:], hi[1:], shape[1:])):
            out[...] = self._flat(g, base + lo[0] * row, base + hi[0] * row).reshape(out.shape)
            return
        itemsize = out.dtype.itemsize
        if (hi[0] - lo[0]) * row * itemsize <= 2 * out.nbytes + _SLACK:
            rows = self._flat(g, base + lo[0] * row, base + hi[0] * row).reshape((hi[0] - lo[0],) + shape[1:])
            out[...] = rows[(slice(None),) + tuple(slice(l, h) for l, h in zip(lo[1:], hi[1:]))]
            return
        for i in range(lo[0], hi[0]):  # a narrow slice of wide rows: row by row
            self._fill(g, base + i * row, shape[1:], lo[1:], hi[1:], out[i - lo[0]])

    def verify(self, index: int) -> None:
        """validate --deep: the CRC-32s of the stored chunks inside logical block `index` (C order)."""
        g = tuple(int(x) for x in (np.unravel_index(index, self._grid) if self._grid else ()))
        layout = self._stored.layout
        if self._stored.verifier is None or not isinstance(layout, ChunkList):
            return
        for j, chunk in enumerate(layout.chunks):
            if tuple(chunk.offsets[:-1]) == g:
                self._stored.verifier(j)


def logical_leaf(stored: ArrayLeaf, keys: tuple[Key, ...], orig: Any, where: str) -> ArrayLeaf:
    """The logical tensor of a reformulated DCP leaf (its mcore_data gives `orig`)."""
    if not isinstance(orig, (tuple, list)) or not all(type(d) is int and d >= 0 for d in orig):
        raise CorruptMetadataError(f"mcore_data {ORIG_SHAPE} {str(orig)[:60]} is not a shape", where)
    orig = tuple(orig)
    grid, block = grid_and_block(tuple(stored.shape), orig, where)
    reader = ReformulatedReader(stored, grid, block)
    return ArrayLeaf(
        keys=keys, name=stored.name, shape=orig, dtype=stored.dtype, layout=RegularGrid(block), sharding=None,
        reader=reader, verifier=reader.verify,
        extra={**stored.extra, "stored_shape": list(stored.shape), "reformulated": "flattened ranges (mcore_data)"},
        unreadable=stored.unreadable,
    )
