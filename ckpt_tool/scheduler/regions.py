"""Region arithmetic, and which stored chunks of a leaf a region overlaps.

The scheduler plans by stored chunk and assembles regions from pieces of
chunks, so every part of it asks the same geometric questions: planning,
to cut each want into the pieces its chunks feed; execution, to copy a
piece into place in its region's buffer; streaming, to find the bands a
piece spans. They are answered here, once, with nothing about memory or
threads. (reshard's planner uses LeafChunks too.)
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..base import dtypes
from ..core.model import ArrayLeaf, Chunk, ChunkList, Region, RegularGrid, stored_chunks


def _nbytes(leaf: ArrayLeaf, region: Region) -> int:
    return math.prod(r.stop - r.start for r in region) * dtypes.get(leaf.dtype).itemsize


def _size(region: Region) -> int:
    return math.prod(r.stop - r.start for r in region)


def _intersect(a: Region, b: Region) -> Region | None:
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def _local(region: Region, origin: Region) -> tuple[slice, ...]:
    return tuple(slice(r.start - o.start, r.stop - o.start) for r, o in zip(region, origin))


class LeafChunks:
    """A leaf's stored chunks, and which of them a region overlaps."""

    def __init__(self, leaf: ArrayLeaf) -> None:
        self.leaf = leaf
        self.itemsize = dtypes.get(leaf.dtype).itemsize
        self.chunks: list[Chunk] = stored_chunks(tuple(leaf.shape), leaf.layout)
        self._starts = self._ends = None
        if isinstance(leaf.layout, ChunkList) and leaf.shape and self.chunks:
            self._starts = np.array([c.offsets for c in self.chunks], dtype=np.int64).reshape(len(self.chunks), -1)
            self._ends = self._starts + np.array([c.sizes for c in self.chunks], dtype=np.int64).reshape(len(self.chunks), -1)

    def overlapping(self, region: Region) -> list[int]:
        if not region:
            return [0] if self.chunks else []
        if any(r.stop <= r.start for r in region):
            return []
        layout = self.leaf.layout
        if isinstance(layout, RegularGrid):
            cs = [max(1, c) for c in layout.chunk_shape]
            counts = [-(-s // c) for s, c in zip(self.leaf.shape, cs)]
            ranges = [range(r.start // c, -(-r.stop // c)) for r, c in zip(region, cs)]
            out = []
            for idx in itertools.product(*ranges):
                flat = 0
                for i, n in zip(idx, counts):
                    flat = flat * n + i
                out.append(flat)
            return out
        assert self._starts is not None and self._ends is not None
        lo = np.array([r.start for r in region])
        hi = np.array([r.stop for r in region])
        hit = ((self._starts < hi) & (self._ends > lo) & (self._ends > self._starts)).all(axis=1)
        return [int(i) for i in np.nonzero(hit)[0]]

    def grid_index(self, i: int) -> tuple[int, ...]:
        layout = self.leaf.layout
        assert isinstance(layout, RegularGrid)
        return tuple(o // max(1, c) for o, c in zip(self.chunks[i].offsets, layout.chunk_shape))
