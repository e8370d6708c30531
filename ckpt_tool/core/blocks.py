"""Write blocks: neighbouring output chunks of a regular grid handed to a writer as one region.

A layout for many devices cuts every array into small chunks (a 2x4 ->
16x16 reshard of an 800 MiB checkpoint: 1,176 chunks -> 37,632), and every
chunk handed over on its own costs the same fixed work however small it is:
a want planned and assembled, a copy, a tensorstore write and its futures.
That per-chunk cost, not the bytes, made such a reshard 2.6x slower than one
to 8 devices. A writer whose format stores a regular grid through a library
that cuts a region into its chunks itself (Orbax: tensorstore encodes each
zarr chunk of a write exactly as if it had been written alone) can take a
block of whole chunks in one write instead.

Along each dimension where the output grid divides the source grid (a finer
layout), a block holds the output chunks inside one source chunk, so it is
fed by the same decoded source chunks as each of its chunks was. Only chunks
smaller than SMALL_CHUNK_BYTES are blocked (from there on the fixed cost is
small beside the bytes), and no block is larger than BLOCK_BYTES nor a 32nd
of the memory budget (a source chunk too large to decode whole is streamed
in bands: a block then stays small).
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator

from .model import ArrayLeaf, ChunkLayout, Region, RegularGrid, as_regular_grid

# a block's largest size, decoded; at most a 32nd of the memory budget (many are in flight)
BLOCK_BYTES = 16 * 2**20
# output chunks from this size up are written one by one
SMALL_CHUNK_BYTES = 2**20


def block_shape(shape: tuple[int, ...], layout: ChunkLayout, source: ArrayLeaf, itemsize: int,
                memory: int) -> tuple[int, ...] | None:
    """Chunks per block along each dimension, or None where each chunk is its own write (no
    regular output grid, no regular source grid of the same rank, chunks of SMALL_CHUNK_BYTES or
    more, or no grid finer than the source's)."""
    if not isinstance(layout, RegularGrid) or not shape or tuple(source.shape) != tuple(shape):
        return None
    src = as_regular_grid(source.layout, tuple(source.shape))
    if src is None or len(src) != len(shape):
        return None
    out = layout.chunk_shape
    if math.prod(min(c, n) for c, n in zip(out, shape)) * itemsize >= SMALL_CHUNK_BYTES:
        return None
    per = [s // c if c and s > c and s % c == 0 else 1 for s, c in zip(src, out)]
    cap = max(1, min(BLOCK_BYTES, memory // 32))
    for d in range(len(per)):  # shrink from the leading dimensions, keeping the source's alignment
        while per[d] > 1 and math.prod(min(p * c, n) for p, c, n in zip(per, out, shape)) * itemsize > cap:
            per[d] = max(q for q in range(1, per[d]) if per[d] % q == 0)
    return tuple(per) if any(p > 1 for p in per) else None


def blocks(shape: tuple[int, ...], chunk_shape: tuple[int, ...], per: tuple[int, ...]
           ) -> Iterator[tuple[list[int], Region]]:
    """(the C-order indices of its chunks, the region they cover) of every block, in C order of the blocks."""
    grid = [-(-s // c) for s, c in zip(shape, chunk_shape)]
    strides = [math.prod(grid[d + 1:]) for d in range(len(grid))]
    for corner in itertools.product(*(range(0, g, p) for g, p in zip(grid, per))):
        spans = [range(i, min(i + p, g)) for i, p, g in zip(corner, per, grid)]
        members = [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*spans)]
        region = tuple(slice(r.start * c, min(r.stop * c, n)) for r, c, n in zip(spans, chunk_shape, shape))
        yield members, region
