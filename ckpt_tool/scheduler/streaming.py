"""Streaming: a stored chunk too large to decode whole, decoded as bands in C order.

A stored chunk whose whole decode would not fit the budget (twice its size:
tensorstore's decoded buffer and the copy it returns) is decoded as a
stream instead (core/codecs.py): its compressed bytes are read in windows and
decoded in bands of rows, in C order, each band feeding the regions it
overlaps. Such a chunk runs alone, and when the regions it feeds would not
fit at once (columns of a chunk streamed in rows), they are served in
several passes over the stream, each pass stopping after the last band it
needs. DCP chunks are raw (or zstd-framed) archives read by byte ranges: a
band there is a ranged read of just its bytes.

What a stream is (its bands, how they are decoded) and how its pieces are
split into passes is its own business, apart from the planning of ordinary
units (planning.py) and from running them (execution.py, which feeds the
bands handed out here into the regions).
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any, Callable, NamedTuple, Sequence

from ..core.contract import reader_of
from ..core.model import ArrayLeaf, Region, RegularGrid
from .admission import MiB
from .regions import LeafChunks, _intersect
from .wants import Want


def band_bytes(memory: int) -> int:
    """The decoded band size of a streamed chunk under a budget."""
    return max(MiB, min(64 * MiB, memory // 16))


class _Streamer:
    """Bands of one stored chunk, in C order, decoded once front to back."""

    def __init__(self, lc: LeafChunks, index: int, band: int, window: int) -> None:
        self.lc = lc
        self.index = index
        self.window = window  # compressed bytes per read (codecs.window_bytes)
        chunk = lc.chunks[index]
        self.chunk = chunk
        leaf = lc.leaf
        self.zarr = None
        self.stored_shape: tuple[int, ...] = tuple(chunk.sizes)
        if isinstance(leaf.layout, RegularGrid):
            # a zarr chunk (its reader says where it is) is decoded as a stream
            stored = reader_of(leaf).stored_chunk(lc.grid_index(index))
            if stored is not None:
                self.zarr = stored
                # zarr stores edge chunks padded to the whole chunk shape
                self.stored_shape = tuple(leaf.layout.chunk_shape)
        self.bands = _bands(self.stored_shape, lc.itemsize, band)

    def decoder_bytes(self) -> int:
        """Memory the decoder holds besides the bands: a compressed zarr chunk's
        windows (the one being decoded, the one fetched ahead, and the next
        fetch started as the decoder takes it); DCP bands are read straight
        into their buffers."""
        return 0 if self.zarr is None else 3 * self.window

    def problem(self) -> str | None:
        """Why this chunk cannot be streamed, or None."""
        if self.zarr is not None:
            from ..core.codecs import zarr2_stream_problem

            from ..core.codecs import zarr3_stream_problem

            _, _, zmeta, zarr3 = self.zarr
            return zarr3_stream_problem(zmeta) if zarr3 else zarr2_stream_problem(zmeta)
        if _reads_byte_ranges(self.lc.leaf):
            return None  # byte-range reads of the archive (DCP)
        return "its format has no streaming reader"

    def global_band(self, band: Region) -> Region | None:
        """A band (stored-chunk coordinates) in array coordinates, clipped to the array."""
        out = []
        for b, o, s in zip(band, self.chunk.offsets, self.chunk.sizes):
            lo, hi = o + b.start, min(o + b.stop, o + s)
            if lo >= hi:
                return None
            out.append(slice(lo, hi))
        return tuple(out)

    def iterate(self, last: int, first: int = 0) -> Any:
        """(band region in array coordinates or None, decoded band clipped) for bands first..last.

        A compressed zarr chunk is a stream: its bands before `first` are
        decoded too (and handed out, to no piece). A DCP chunk is read by byte
        ranges: a pass reads only its own bands, so several passes over one
        chunk read each band once, not the chunk's head again each time.
        """
        if self.zarr is not None:
            from ..core.codecs import ChunkStream

            storage, key, zmeta, zarr3 = self.zarr
            stream = ChunkStream(storage, key, zmeta, math.prod(self.stored_shape) * self.lc.itemsize, zarr3,
                                 window=self.window)
            try:
                for i, band in enumerate(self.bands[: last + 1]):
                    data = stream.read_band(tuple(b.stop - b.start for b in band))
                    region = self.global_band(band)
                    if region is None:
                        yield None, None
                        continue
                    yield region, data[tuple(slice(0, r.stop - r.start) for r in region)]
                if last == len(self.bands) - 1:
                    stream.finish()
            finally:
                stream.close()
            return
        for band in self.bands[first : last + 1]:
            region = self.global_band(band)
            yield region, (self.lc.leaf.read(region) if region is not None else None)


def _reads_byte_ranges(leaf: ArrayLeaf) -> bool:
    """A reader that reads any part of a stored chunk by byte ranges of its raw bytes (it says so)."""
    return reader_of(leaf).reads_byte_ranges


def _band_index(streamer: "_Streamer") -> Callable[[Region], tuple[int, int]]:
    """For a region inside the chunk: the first and last band it overlaps (first > last: none)."""
    bands = [streamer.global_band(b) for b in streamer.bands]

    def span(region: Region) -> tuple[int, int]:
        hit = [i for i, b in enumerate(bands) if b is not None and (not region or _intersect(region, b) is not None)]
        return (hit[0], hit[-1]) if hit else (1, 0)

    return span


def _bands(shape: tuple[int, ...], itemsize: int, band: int) -> list[Region]:
    """Consecutive C-order bands of a chunk of `shape`, each at most `band` bytes
    (at least one element): a range along the first dimension whose trailing
    block fits, the dimensions before it one index at a time."""
    if not shape:
        return [()]
    ndim = len(shape)
    d = 0
    while d < ndim - 1 and math.prod(shape[d + 1 :]) * itemsize > band:
        d += 1
    step = max(1, band // max(1, math.prod(shape[d + 1 :]) * itemsize))
    out = []
    for prefix in itertools.product(*(range(s) for s in shape[:d])):
        for a in range(0, shape[d], step):
            out.append(
                tuple(slice(i, i + 1) for i in prefix) + (slice(a, min(a + step, shape[d])),)
                + tuple(slice(0, s) for s in shape[d + 1 :])
            )
    return out


class StreamPlan(NamedTuple):
    """How a chunk is streamed: the pieces of each pass, the (first, last) band of each, and the memory it takes."""

    streamer: _Streamer
    passes: list[list[tuple[int, int, Region]]]
    bounds: list[tuple[int, int]]
    cost: int
    # a region delivered while the next ones are assembled (False: the stream waits for each
    # delivery, when the budget cannot also hold the region being written)
    behind: bool = True


def plan_passes(streamer: _Streamer, pieces: list[tuple[int, int, Region]], wants: Sequence[Want],
                feeds: Sequence[int], budget: int, band: int) -> StreamPlan:
    """Split the pieces (want, part, region) a streamed chunk feeds into passes that fit `budget`.

    A piece needs an assembly buffer from its first band to its last unless
    it lies in one band (and is all its want needs: `feeds`, the pieces
    feeding each want); the passes keep the buffers open at any band within
    the budget.
    """
    rows = _band_index(streamer)
    spans = []
    for wi, pi, inter in pieces:
        first, last = rows(inter)
        if first > last:
            continue
        want = wants[wi]
        direct = first == last and len(want.parts) == 1 and feeds[wi] == 1
        spans.append((first, last, (0 if direct else want.nbytes) + want.extra, (wi, pi, inter)))
    # the region being written behind (execution.py's third thread) while the next ones are
    # assembled: left out, validate --deep of torch's 768 MiB DCP items took 423 MiB under 256MiB.
    # When the budget cannot hold it beside one pass's buffers, each delivery is waited for instead.
    behind = max((wants[wi].nbytes + wants[wi].extra for _, _, _, (wi, _, _) in spans), default=0)
    largest = max((s[2] for s in spans), default=0)
    if largest + 2 * band + streamer.decoder_bytes() + behind > budget:
        behind = 0
    limit = max(band, budget - 2 * band - streamer.decoder_bytes() - behind)
    groups = _group(spans, limit)
    passes = [[s[3] for s in g] for g in groups]
    bounds = [(min(s[0] for s in g), max(s[1] for s in g)) for g in groups]
    peak = 0
    for g in groups:
        load: Counter = Counter()
        for first, last, nbytes, _ in g:
            for b in range(first, last + 1):
                load[b] += nbytes
        peak = max(peak, max(load.values(), default=0))
    return StreamPlan(streamer, passes, bounds, peak + 2 * band + streamer.decoder_bytes() + behind, behind > 0)


def _group(spans: list[tuple[int, int, int, Any]], limit: int) -> list[list[tuple[int, int, int, Any]]]:
    """Pieces of a streamed chunk in passes whose assembly buffers fit `limit` at every band.

    A piece holds its buffer from its first band to its last (first, last,
    bytes); the greedy fill keeps stream order, so each pass reads the
    stream up to the last band it needs.
    """
    passes: list[tuple[list[Any], Counter]] = []
    for span in sorted(spans, key=lambda s: (s[0], s[1])):
        first, last, nbytes, _ = span
        for members, load in passes:
            if nbytes == 0 or all(load[b] + nbytes <= limit for b in range(first, last + 1)):
                members.append(span)
                for b in range(first, last + 1):
                    load[b] += nbytes
                break
        else:
            opened: Counter = Counter()
            for b in range(first, last + 1):
                opened[b] += nbytes
            passes.append(([span], opened))
    return [members for members, _ in passes]
