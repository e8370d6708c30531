"""The read scheduler: every stored chunk fetched and decoded once, within a memory budget.

convert and reshard (engine.stream), `validate --deep` and `diff --values`
each say which regions of which leaves they need (`Want`s: an output chunk;
a block to check; a pair of regions to compare). Reading each region on its
own decodes a stored chunk again for every region inside it (tensorstore
decodes whole chunks), so a 768 MiB chunk feeding 8 output chunks was
decoded 8 times. Here the work is planned by SOURCE chunk instead: a unit of
work decodes one stored chunk once and hands every region it feeds its
piece; a region spanning several chunks is assembled from the pieces and
handed over when its last piece arrives.

Memory. A byte budget (`--memory`, default 512 MiB) covers the decoded
chunks in flight, the regions being assembled and what the consumer keeps
(the writers' pending windows are reserved from it by the caller). Units are
admitted in order against it, in parallel across chunks; one unit always
runs when nothing else does, so a region larger than the budget still
completes (alone). A stored chunk whose whole decode would not fit (twice
its size: tensorstore's decoded buffer and the copy it returns) is decoded
as a stream instead (codecs.py): its compressed bytes are read in windows
and decoded in bands of rows, in C order, each band feeding the regions it
overlaps; such a chunk runs alone, and when the regions it feeds would not
fit at once (columns of a chunk streamed in rows), they are served in
several passes over the stream, each pass stopping after the last band it
needs. DCP chunks are raw (or zstd-framed) archives read by byte ranges: a
band there is a ranged read of just its bytes.

Units run in the order of the first region they feed (the consumers' own
order), so assembled regions complete soon after they start.
"""
from __future__ import annotations

import itertools
import math
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import dtypes
from ..errors import CkptError
from ..model import ArrayLeaf, Chunk, ChunkList, Region, RegularGrid, stored_chunks
from ..sizes import parse_size

MiB = 2**20
DEFAULT_MEMORY = 512 * MiB
# the smallest budget accepted: below it the bands and windows alone would not fit
MIN_MEMORY = 4 * MiB
# a leaf up to this size (decoded, twice: see decoded_cost) is read in one go when it has several chunks
BATCH_BYTES = 8 * MiB
# small reads started together, as one unit of work: at most this much memory and this many reads
GROUP_BYTES = 32 * MiB
GROUP_UNITS = 256
# wants sharing their chunks, read region by region together: at most this much memory
CLUSTER_BYTES = 64 * MiB

def parse_memory(text: str | int) -> int:
    """--memory: '512MiB', '2GiB', '512MB' (10^6), '1G' (2^30) or plain bytes."""
    return parse_size(text, "--memory", minimum=MIN_MEMORY, examples="512MiB, 2GiB, 512MB")


@dataclass
class Want:
    """Regions a consumer needs, handed to `deliver` together once all are read.

    parts: (leaf, region) pairs (one for a writer or a check; two for a diff).
    deliver(arrays) returns a byte count (summed by run()). `keeps`: deliver
    keeps the arrays (a writer that holds chunks until committed): it is
    given arrays of its own, never views into a larger decoded chunk.
    order: units run in the order of the smallest order among the wants
    they feed (default: the wants' positions).
    """

    parts: list[tuple[ArrayLeaf, Region]]
    deliver: Callable[[list[np.ndarray]], int]
    keeps: bool = False
    order: int | None = None
    # bytes deliver holds beside the arrays while it runs (a diff's read of the other side)
    extra: int = 0

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(leaf, region) for leaf, region in self.parts)


@dataclass
class ReadStats:
    """What a run read: decodes per stored chunk (path, chunk index), and the budget's high mark."""

    decodes: Counter = field(default_factory=Counter)
    streamed: set = field(default_factory=set)
    passes: int = 0
    peak_bytes: int = 0
    budget: int = 0

    @property
    def chunks(self) -> int:
        return len(self.decodes)


# -- geometry -----------------------------------------------------------------------


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


class _LeafChunks:
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


# -- what a stored chunk's decode looks like ------------------------------------------


def streams(leaf: ArrayLeaf, memory: int) -> bool:
    """Whether some stored chunk of `leaf` is too large to decode whole under `memory` (so it is streamed)."""
    itemsize = dtypes.get(leaf.dtype).itemsize
    layout = leaf.layout
    if isinstance(layout, RegularGrid):
        largest = math.prod(min(c, s) for c, s in zip(layout.chunk_shape, leaf.shape))
    else:
        largest = max((math.prod(c.sizes) for c in layout.chunks), default=0)
    return decoded_cost(largest * itemsize) > memory


def decoded_cost(nbytes: int) -> int:
    """Memory a whole decode of a chunk of `nbytes` takes: tensorstore's decoded
    chunk and the array it returns."""
    return 2 * nbytes


def band_bytes(memory: int) -> int:
    """The decoded band size of a streamed chunk under a budget."""
    return max(MiB, min(64 * MiB, memory // 16))


class _Streamer:
    """Bands of one stored chunk, in C order, decoded once front to back."""

    def __init__(self, lc: _LeafChunks, index: int, band: int, window: int) -> None:
        self.lc = lc
        self.index = index
        self.window = window  # compressed bytes per read (codecs.window_bytes)
        chunk = lc.chunks[index]
        self.chunk = chunk
        leaf = lc.leaf
        self.zarr = None
        self.stored_shape: tuple[int, ...] = tuple(chunk.sizes)
        owner = getattr(leaf.reader, "__self__", None)
        if isinstance(leaf.layout, RegularGrid) and hasattr(owner, "stored_chunk"):
            storage, key, zmeta, zarr3 = owner.stored_chunk(lc.grid_index(index))
            self.zarr = (storage, key, zmeta, zarr3)
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
            from ..codecs import zarr2_stream_problem

            from ..codecs import zarr3_stream_problem

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
            from ..codecs import ChunkStream

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


def _starts_reads(leaf: ArrayLeaf) -> bool:
    """Whether the leaf's reader can start a read and wait for it later (tensorstore-backed readers)."""
    return callable(getattr(getattr(leaf.reader, "__self__", None), "start_read", None))


def _reads_into(leaf: ArrayLeaf) -> bool:
    """Whether the leaf's reader can read a region into a given buffer (tensorstore-backed readers)."""
    return callable(getattr(getattr(leaf.reader, "__self__", None), "start_read_into", None))


def _start_read(leaf: ArrayLeaf, region: Region) -> Callable[[], np.ndarray]:
    """Start reading `region` of `leaf`; the returned call waits for it and checks its shape."""
    finish = leaf.reader.__self__.start_read(region)  # type: ignore[union-attr]
    want = tuple(r.stop - r.start for r in region)

    def result() -> np.ndarray:
        out = finish()
        if tuple(out.shape) != want:
            raise CkptError(f"reader returned shape {tuple(out.shape)}, expected {want}", leaf.name)
        return out

    return result


def _reads_byte_ranges(leaf: ArrayLeaf) -> bool:
    """A reader that reads any part of a stored chunk by byte ranges of its raw bytes (it says so)."""
    return bool(getattr(leaf.reader, "reads_byte_ranges", False))


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


# -- the run -----------------------------------------------------------------------------


class _WantState:
    __slots__ = ("want", "left", "bufs", "charged", "failed", "lock", "units", "done")

    def __init__(self, want: Want) -> None:
        self.want = want
        self.left = [_size(region) for _, region in want.parts]
        self.bufs: list[np.ndarray | None] = [None] * len(want.parts)
        self.charged = 0
        self.failed = False
        self.done = False
        self.lock = threading.Lock()
        self.units = 0  # units feeding it

    def take_whole(self) -> bool:
        """Mark the want as read whole (nothing left to assemble); False if it
        failed or another unit already delivered it."""
        with self.lock:
            if self.failed or self.done:
                return False
            self.done = True
            self.left = [0] * len(self.left)
            return True


@dataclass
class _Unit:
    """One stored chunk decoded once for the pieces it feeds; or (`want` set) one
    want read whole through the format's reader (see `_reads_whole`)."""

    lc: _LeafChunks
    index: int
    order: int
    pieces: list[tuple[int, int, Region]] = field(default_factory=list)  # (want, part, region)
    streamed: bool = False
    want: int | None = None
    # a whole-want read: the chunk units it stands for (each chunk inside the want, feeding only it);
    # a leaf batch: the chunk units of one small leaf, read in one region
    members: list["_Unit"] = field(default_factory=list)
    batch: Region | None = None
    # a group: small units whose reads are started together, then fed one by one
    group: list["_Unit"] = field(default_factory=list)
    # a cluster: wants that share their chunks (`members`), each read whole, all reads started together
    cluster: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.lc.chunks[self.index].sizes) * self.lc.itemsize


class Scheduler:
    """Plans wants by source chunk and runs them (see the module docstring)."""

    def __init__(self, wants: Sequence[Want], *, memory: int = DEFAULT_MEMORY, workers: int = 4,
                 reserve: int = 0) -> None:
        self.memory = memory
        self.budget = max(MIN_MEMORY // 2, memory - reserve)
        self.workers = max(1, workers)
        self.band = band_bytes(self.budget)
        from ..codecs import window_bytes

        self.window = window_bytes(self.budget)
        self.wants = list(wants)
        self.stats = ReadStats(budget=memory)
        self._leaves: dict[int, _LeafChunks] = {}
        self.states = [_WantState(w) for w in self.wants]
        units: dict[tuple[int, int], _Unit] = {}
        self.empty: list[int] = []
        # wants whose regions the stored chunks do not tile exactly (a gap, or DCP chunks
        # that overlap): read through the format's reader, which checks coverage itself
        self.direct: list[int] = []
        for wi, want in enumerate(self.wants):
            order = want.order if want.order is not None else wi
            found: list[tuple[_LeafChunks, int, int, Region]] = []
            exact = True
            for pi, (leaf, region) in enumerate(want.parts):
                lc = self._chunks_of(leaf)
                if _size(region) == 0 and region:
                    continue
                covered = 0
                for ci in lc.overlapping(region):
                    inter = _intersect(region, lc.chunks[ci].region) if region else ()
                    if inter is None:
                        continue
                    found.append((lc, ci, pi, inter))
                    covered += _size(inter)
                exact = exact and covered == _size(region)
            if not exact:
                self.direct.append(wi)
                continue
            for lc, ci, pi, inter in found:
                key = (id(lc.leaf), ci)
                unit = units.get(key)
                if unit is None:
                    unit = units[key] = _Unit(lc, ci, order)
                unit.order = min(unit.order, order)
                unit.pieces.append((wi, pi, inter))
            self.states[wi].units = len(found)
            if not found:
                self.empty.append(wi)
        chunk_units = self._reads_whole(units)
        for unit in chunk_units:
            unit.streamed = unit.want is None and unit.batch is None and decoded_cost(unit.nbytes) > self.budget
        # wants the chunks do not tile run in the pool too, through the format's reader
        chunk_units += [self._want_unit(wi, []) for wi in self.direct]
        self.units = self._grouped(sorted(chunk_units, key=lambda u: (u.order, id(u.lc), u.index)))
        self._cond = threading.Condition()
        self._used = 0
        self._running = 0

    def _reads_whole(self, units: dict[tuple[int, int], _Unit]) -> list[_Unit]:
        """The units to run: a want whose stored chunks all lie inside it and feed
        nothing else is read whole, in one read through the format's reader.

        Each of those chunks is still decoded once (tensorstore decodes every
        chunk of a region once, into the region), but one read of a region
        costs far less than a read, a copy and an assembly per chunk: on many
        small chunks (3,000 leaves of 4 to 8 chunks each, per-device shards
        gathered into larger outputs) the per-chunk path was slower than
        reading the regions directly.
        """
        by_want: dict[int, list[_Unit]] = {}
        for unit in units.values():
            whole = unit.lc.chunks[unit.index].region
            wis = {wi for wi, _, _ in unit.pieces}
            if len(wis) == 1 and all(inter == whole for _, _, inter in unit.pieces):
                by_want.setdefault(next(iter(wis)), []).append(unit)
        merged: set[int] = set()
        out: list[_Unit] = []
        for wi, members in by_want.items():
            st = self.states[wi]
            # only when every piece of the want comes whole from its own chunks,
            # the read fits the budget, and it saves reads (one chunk: nothing to save)
            if len(members) != st.units or st.units < 2 or decoded_cost(st.want.nbytes) + st.want.extra > self.budget:
                continue
            out.append(self._want_unit(wi, members))
            merged.update(id(u) for u in members)
        rest = [u for u in units.values() if id(u) not in merged]
        # a small leaf of several chunks (3,000 leaves of 1 to 16 KiB each, each
        # in 4 or 8 chunks): one read of the whole leaf, its chunks each fed from it
        small = min(BATCH_BYTES, self.budget // 8)
        of_leaf: dict[int, list[_Unit]] = {}
        for unit in rest:
            of_leaf.setdefault(id(unit.lc), []).append(unit)
        for members in of_leaf.values():
            lc = members[0].lc
            if len(members) < 2 or len(members) != len(lc.chunks) or not lc.leaf.shape:
                out += members
                continue
            if decoded_cost(lc.leaf.nbytes) > small or sum(u.nbytes for u in members) != lc.leaf.nbytes:
                out += members  # too large, or chunks that do not tile the leaf exactly
                continue
            region = tuple(slice(0, n) for n in lc.leaf.shape)
            out.append(_Unit(lc, min(u.index for u in members), min(u.order for u in members),
                             members=members, batch=region))
        return self._clusters(out)

    def _clusters(self, units: list[_Unit]) -> list[_Unit]:
        """Wants that share their chunks and nothing else, read whole with their reads started together.

        Per-device shards regathered (reshard: each output region takes half
        of each of two stored chunks, each chunk feeds two regions) are
        faster read region by region than chunk by chunk and assembled:
        reads of one chunk started together share one decode in
        tensorstore's cache (measured: the CPU time of reading both halves
        at once is that of reading the chunk once), and each region comes
        back as the array delivered, with no copy of ours.
        """
        plain = [u for u in units if u.want is None and u.batch is None and not u.members
                 and decoded_cost(u.nbytes) <= self.budget]
        parent: dict[int, int] = {}

        def find(x: int) -> int:
            while parent.setdefault(x, x) != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for unit in plain:  # wants are joined through the chunks they share
            wis = [wi for wi, _, _ in unit.pieces]
            for wi in wis[1:]:
                parent[find(wis[0])] = find(wi)
        of_root: dict[int, list[_Unit]] = {}
        for unit in plain:
            of_root.setdefault(find(unit.pieces[0][0]), []).append(unit)
        limit = min(CLUSTER_BYTES, self.budget // 8)
        taken: set[int] = set()
        out: list[_Unit] = []
        for members in of_root.values():
            wants = sorted({wi for u in members for wi, _, _ in u.pieces})
            pieces = Counter(wi for u in members for wi, _, _ in u.pieces)
            ok = (
                len(wants) > 1
                and all(pieces[wi] == self.states[wi].units for wi in wants)  # no chunk of theirs elsewhere
                and all(_starts_reads(leaf) for wi in wants for leaf, _ in self.wants[wi].parts)
                and sum(decoded_cost(self.wants[wi].nbytes) for wi in wants) <= limit
            )
            if not ok:
                continue
            first = min(members, key=lambda u: (u.order, u.index))
            out.append(_Unit(first.lc, first.index, first.order, members=members, cluster=wants))
            taken.update(id(u) for u in members)
        return out + [u for u in units if id(u) not in taken]

    def _grouped(self, units: list[_Unit]) -> list[_Unit]:
        """Consecutive small reads in groups whose reads start together (see `_run_group`)."""
        limit = min(GROUP_BYTES, self.budget // 8)
        out: list[_Unit] = []
        group: list[_Unit] = []
        cost = 0

        def close() -> None:
            nonlocal group, cost
            if len(group) > 1:
                out.append(_Unit(group[0].lc, group[0].index, group[0].order, group=group))
            else:
                out.extend(group)
            group, cost = [], 0

        for unit in units:
            small = unit.want is None and not unit.cluster and not unit.streamed and _starts_reads(unit.lc.leaf)
            c = self._unit_cost(unit) if small else 0
            if not small or c > limit // 4:
                close()
                out.append(unit)
                continue
            if cost + c > limit or len(group) >= GROUP_UNITS:
                close()
            group.append(unit)
            cost += c
        close()
        return out

    def _unit_cost(self, unit: _Unit) -> int:
        """The memory a (non-streamed) unit is admitted for."""
        if unit.group:
            return sum(self._unit_cost(m) for m in unit.group)
        if unit.cluster:
            return sum(decoded_cost(self.wants[wi].nbytes) for wi in unit.cluster) + max(
                self.wants[wi].extra for wi in unit.cluster)
        if unit.want is not None:
            want = self.wants[unit.want]
            return decoded_cost(want.nbytes) + want.extra
        if unit.batch is not None:
            return decoded_cost(unit.lc.leaf.nbytes) + max(
                (self.wants[wi].extra for m in unit.members for wi, _, _ in m.pieces), default=0)
        # its deliveries run one after another in its thread: the largest extra counts
        return decoded_cost(unit.nbytes) + max((self.wants[wi].extra for wi, _, _ in unit.pieces), default=0)

    def _want_unit(self, wi: int, members: list[_Unit]) -> _Unit:
        want = self.wants[wi]
        lc = self._chunks_of(want.parts[0][0])
        order = want.order if want.order is not None else wi
        first = min((u.index for u in members if u.lc is lc), default=0)
        return _Unit(lc, first, order, want=wi, members=members)

    @property
    def planned_chunks(self) -> int:
        """How many stored chunks the plan decodes (each once; a streamed chunk once per pass)."""
        def count(unit: _Unit) -> int:
            if unit.group:
                return sum(count(m) for m in unit.group)
            if unit.members:
                return len(unit.members)
            return 0 if unit.want is not None else 1  # a want the chunks do not tile: its reader's business

        return sum(count(u) for u in self.units)

    def _chunks_of(self, leaf: ArrayLeaf) -> _LeafChunks:
        lc = self._leaves.get(id(leaf))
        if lc is None:
            lc = self._leaves[id(leaf)] = _LeafChunks(leaf)
        return lc

    # -- planning facts ----------------------------------------------------------------
    def decodes_whole(self, leaf: ArrayLeaf, index: int) -> bool:
        """Whether stored chunk `index` of `leaf` is decoded whole (not as a stream)."""
        lc = self._chunks_of(leaf)
        return decoded_cost(math.prod(lc.chunks[index].sizes) * lc.itemsize) <= self.budget

    def check_streamable(self) -> None:
        """Refuse before any work starts when a chunk too large to decode whole has no streaming decoder."""
        for unit in self.units:
            if not unit.streamed:
                continue
            problem = _Streamer(unit.lc, unit.index, self.band, self.window).problem()
            if problem:
                need = self._memory_needed(unit)
                raise CkptError(
                    f"stored chunk {unit.index} decodes to {unit.nbytes / MiB:.1f} MiB, more than the memory budget "
                    f"allows, and {problem}; use --memory {need}MiB or more",
                    unit.lc.leaf.path,
                )

    def _memory_needed(self, unit: _Unit) -> int:
        """The --memory (MiB) under which `unit`'s chunk would be decoded whole."""
        return -(-(decoded_cost(unit.nbytes) + self.memory - self.budget) // MiB) + 1

    # -- budget ---------------------------------------------------------------------------
    def _take(self, n: int) -> None:
        with self._cond:
            self._used += n
            self.stats.peak_bytes = max(self.stats.peak_bytes, self._used)

    def _give(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()

    # -- delivering -----------------------------------------------------------------------
    def _feed(self, unit: _Unit, pieces: list[tuple[int, int, Region]], origin: Region, block: np.ndarray,
              deliver: Callable[[int, list[np.ndarray]], None], lazy_charge: bool) -> None:
        """Hand the pieces of `block` (covering `origin`) to the wants they feed."""
        for wi, pi, inter in pieces:
            sub = _intersect(inter, origin) if origin else ()
            if sub is None:
                continue
            st = self.states[wi]
            want = st.want
            src = block[_local(sub, origin)] if origin else block
            part_region = want.parts[pi][1]
            n = _size(sub) if sub else 1
            whole_part = n == (_size(part_region) if part_region else 1)
            with st.lock:
                if st.failed or st.done:
                    continue
                if whole_part and st.bufs[pi] is None:
                    # the block holds the whole part: no assembly
                    own = (want.keeps or len(want.parts) > 1) and src.nbytes != block.nbytes
                    st.bufs[pi] = np.array(src) if own else src
                    copy = False
                else:
                    if st.bufs[pi] is None:
                        need = want.nbytes
                        if lazy_charge and not st.charged:
                            self._take(need)
                            st.charged = need
                        st.bufs[pi] = np.empty(tuple(r.stop - r.start for r in part_region),
                                               dtype=dtypes.numpy_dtype(want.parts[pi][0].dtype))
                    copy = True
            if copy:
                st.bufs[pi][_local(sub, part_region)] = src  # type: ignore[index]
            self._piece_done(st, wi, pi, n, deliver)

    def _piece_done(self, st: _WantState, wi: int, pi: int, n: int,
                    deliver: Callable[[int, list[np.ndarray]], None]) -> None:
        """`n` more elements of part `pi` are in place; deliver the want when it is complete."""
        want = st.want
        with st.lock:
            st.left[pi] -= n
            ready = not st.done and not st.failed and all(x <= 0 for x in st.left)
            if ready:
                st.done = True
        if ready:
            arrays = [
                b if b is not None else np.empty(tuple(r.stop - r.start for r in reg), dtype=dtypes.numpy_dtype(lf.dtype))
                for b, (lf, reg) in zip(st.bufs, want.parts)
            ]
            st.bufs = [None] * len(st.bufs)
            try:
                deliver(wi, arrays)  # type: ignore[arg-type]
            finally:
                if st.charged:
                    self._give(st.charged)
                    st.charged = 0

    def _fail_unit(self, unit: _Unit) -> None:
        for member in unit.group:
            self._fail_unit(member)
        fed = [wi for m in [unit, *unit.members] for wi, _, _ in m.pieces] + ([unit.want] if unit.want is not None else [])
        for wi in fed:
            st = self.states[wi]
            with st.lock:
                if st.done:
                    continue
                st.failed = True
                st.bufs = [None] * len(st.bufs)
                charged, st.charged = st.charged, 0
            if charged:
                self._give(charged)

    def _run_into(self, unit: _Unit, deliver: Callable[[int, list[np.ndarray]], None]) -> None:
        """A chunk feeding several regions: tensorstore writes each piece straight into its region's buffer.

        The pieces' reads start together, and concurrent reads of one chunk
        share its cache entry in tensorstore, so the chunk is still decoded
        once; what this saves is the whole decoded chunk as an array of its
        own and the copy out of it (per-device shards regathered by reshard:
        4.8 s against 5.1 s for 2 GiB).
        """
        start_into = unit.lc.leaf.reader.__self__.start_read_into  # type: ignore[union-attr]
        started = []
        for wi, pi, inter in unit.pieces:
            st = self.states[wi]
            want = st.want
            part_region = want.parts[pi][1]
            with st.lock:
                if st.failed or st.done:
                    continue
                if st.bufs[pi] is None:
                    if not st.charged:
                        self._take(want.nbytes)
                        st.charged = want.nbytes
                    st.bufs[pi] = np.empty(tuple(r.stop - r.start for r in part_region),
                                           dtype=dtypes.numpy_dtype(want.parts[pi][0].dtype))
                dest = st.bufs[pi][_local(inter, part_region)]  # type: ignore[index]
            started.append((st, wi, pi, _size(inter), start_into(inter, dest)))
        for *_, finish in started:
            finish()
        self.stats.decodes[(unit.lc.leaf.path, unit.index)] += 1
        for st, wi, pi, n, _ in started:
            self._piece_done(st, wi, pi, n, deliver)

    def _run_whole(self, unit: _Unit, deliver: Callable[[int, list[np.ndarray]], None]) -> None:
        if len(unit.pieces) > 1 and unit.lc.leaf.shape and _reads_into(unit.lc.leaf):
            self._run_into(unit, deliver)
            return
        region = unit.lc.chunks[unit.index].region
        data = unit.lc.leaf.read(region)
        self.stats.decodes[(unit.lc.leaf.path, unit.index)] += 1
        self._feed(unit, unit.pieces, region, data, deliver, lazy_charge=True)

    def _run_batch(self, unit: _Unit, deliver: Callable[[int, list[np.ndarray]], None],
                   on_error: Callable[[ArrayLeaf, int, CkptError], None] | None) -> None:
        """Read a small leaf whole and feed each of its chunks' pieces from that one read."""
        assert unit.batch is not None
        try:
            data = unit.lc.leaf.read(unit.batch)
        except CkptError:
            self._run_members(unit, deliver, on_error)
            return
        for member in unit.members:
            self.stats.decodes[(member.lc.leaf.path, member.index)] += 1
            self._feed(member, member.pieces, unit.batch, data, deliver, lazy_charge=True)

    def _run_group(self, unit: _Unit, deliver: Callable[[int, list[np.ndarray]], None],
                   on_error: Callable[[ArrayLeaf, int, CkptError], None] | None) -> None:
        """Start the reads of every unit in the group, then feed each as its read completes, in order."""
        started: list[tuple[_Unit, Region, Callable[[], np.ndarray] | CkptError]] = []
        for member in unit.group:  # the arrays' opens overlap too
            opener = getattr(member.lc.leaf.reader.__self__, "start_open", None)  # type: ignore[union-attr]
            try:
                opener() if opener is not None else None
            except CkptError:
                pass  # reported by its read below
        for member in unit.group:
            region = member.batch if member.batch is not None else member.lc.chunks[member.index].region
            try:
                started.append((member, region, _start_read(member.lc.leaf, region)))
            except CkptError as exc:
                started.append((member, region, exc))
        for member, region, handle in started:
            try:
                if isinstance(handle, CkptError):
                    raise handle
                data = handle()
            except CkptError as exc:
                if member.batch is not None:
                    self._run_members(member, deliver, on_error)
                    continue
                self._fail_unit(member)
                if on_error is None:
                    raise
                on_error(member.lc.leaf, member.index, exc)
                continue
            for chunk in member.members if member.batch is not None else [member]:
                self.stats.decodes[(chunk.lc.leaf.path, chunk.index)] += 1
                self._feed(chunk, chunk.pieces, region, data, deliver, lazy_charge=True)

    def _run_cluster(self, unit: _Unit, deliver: Callable[[int, list[np.ndarray]], None],
                     on_error: Callable[[ArrayLeaf, int, CkptError], None] | None) -> None:
        """Start every region read of the cluster's wants at once, then deliver each want."""
        try:
            started = [(wi, [_start_read(leaf, region) for leaf, region in self.wants[wi].parts])
                       for wi in unit.cluster]
            arrays = [(wi, [finish() for finish in handles]) for wi, handles in started]
        except CkptError:
            self._run_members(unit, deliver, on_error)  # which chunk failed, each with its own error
            return
        for member in unit.members:
            self.stats.decodes[(member.lc.leaf.path, member.index)] += 1
        for wi, got in arrays:
            if self.states[wi].take_whole():
                deliver(wi, got)

    def _run_members(self, unit: _Unit, deliver: Callable[[int, list[np.ndarray]], None],
                     on_error: Callable[[ArrayLeaf, int, CkptError], None] | None) -> None:
        """After a combined read failed: decode its chunks one by one, so each bad chunk reports its own error."""
        for member in unit.members:
            try:
                self._run_whole(member, deliver)
            except CkptError as err:
                self._fail_unit(member)
                if on_error is None:
                    raise
                on_error(member.lc.leaf, member.index, err)

    def _run_want(self, unit: _Unit, deliver: Callable[[int, list[np.ndarray]], None],
                  on_error: Callable[[ArrayLeaf, int, CkptError], None] | None) -> None:
        """Read a want's regions whole and deliver them (a unit made by `_reads_whole`, or a `direct` want)."""
        wi = unit.want
        assert wi is not None
        st = self.states[wi]
        want = st.want
        try:
            arrays = [leaf.read(region) for leaf, region in want.parts]
        except CkptError as exc:
            if not unit.members:
                if on_error is None:
                    raise
                leaf = want.parts[0][0]
                on_error(leaf, (self._chunks_of(leaf).overlapping(want.parts[0][1]) or [0])[0], exc)
                return
            self._run_members(unit, deliver, on_error)
            return
        for member in unit.members:
            self.stats.decodes[(member.lc.leaf.path, member.index)] += 1
        if st.take_whole():
            deliver(wi, arrays)

    def _plan_stream(
        self, unit: _Unit
    ) -> tuple[_Streamer, list[list[tuple[int, int, Region]]], list[tuple[int, int]], int]:
        """How a chunk is streamed: (streamer, pieces of each pass, (first, last) band of each pass, memory it takes).

        A piece needs an assembly buffer from its first band to its last unless
        it lies in one band (and is all its want needs); the passes keep the
        buffers open at any band within the budget.
        """
        streamer = _Streamer(unit.lc, unit.index, self.band, self.window)
        problem = streamer.problem()
        if problem:
            need = self._memory_needed(unit)
            raise CkptError(
                f"stored chunk {unit.index} decodes to {unit.nbytes / MiB:.1f} MiB, more than the memory budget "
                f"allows, and {problem}; use --memory {need}MiB or more", unit.lc.leaf.path,
            )
        bands = [streamer.global_band(b) for b in streamer.bands]
        rows = _band_index(streamer)
        spans = []
        for wi, pi, inter in unit.pieces:
            first, last = rows(inter)
            if first > last:
                continue
            st = self.states[wi]
            direct = first == last and len(st.want.parts) == 1 and st.units == 1
            spans.append((first, last, (0 if direct else st.want.nbytes) + st.want.extra, (wi, pi, inter)))
        del bands
        limit = max(self.band, self.budget - 2 * self.band - streamer.decoder_bytes())
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
        return streamer, passes, bounds, peak + 2 * self.band + streamer.decoder_bytes()

    def _run_streamed(self, unit: _Unit, plan: Any, deliver: Callable[[int, list[np.ndarray]], None]) -> None:
        streamer, passes, bounds, _ = plan
        self.stats.streamed.add((unit.lc.leaf.path, unit.index))
        # each decoded band is handed to another thread, which copies it into the
        # regions it feeds and delivers (writes) the regions it completes, while
        # this one decodes the next band: the stream runs alone, so both cores
        # work on it. One band in hand-off at a time: the plan counts two bands.
        # The regions it completes are written by a third thread, one at a time
        # (memory: one region more than the plan).
        pending: list[Future[None]] = []
        writing: list[Future[None]] = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-feed") as handoff, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-deliver") as writer:

            def write_behind(wi: int, arrays: list[np.ndarray]) -> None:
                if writing:
                    writing.pop().result()
                writing.append(writer.submit(deliver, wi, arrays))

            try:
                for pieces, (first, last) in zip(passes, bounds):
                    self.stats.decodes[(unit.lc.leaf.path, unit.index)] += 1
                    self.stats.passes += 1
                    for region, data in streamer.iterate(last, first):
                        if region is None:
                            continue
                        if pending:
                            pending.pop().result()  # its failure stops the stream here
                        # the unit's admission covered its bands and assembly buffers
                        pending.append(handoff.submit(self._feed, unit, pieces, region, data, write_behind, False))
            except BaseException:
                for fut in pending + writing:  # the first failure is the one reported
                    fut.exception()
                raise
            while pending:
                pending.pop().result()
            while writing:
                writing.pop().result()

    def run(self, *, on_done: Callable[[int], None] | None = None,
            on_error: Callable[[ArrayLeaf, int, CkptError], None] | None = None) -> int:
        """Decode every needed chunk once (per pass) and deliver every want; the sum of deliver's results.

        on_error(leaf, chunk index, error): a chunk that does not read is
        reported there (the wants it feeds are dropped) instead of raising.
        """
        self.check_streamable() if on_error is None else None
        total = 0
        lock = threading.Lock()

        def deliver(wi: int, arrays: list[np.ndarray]) -> None:
            nonlocal total
            n = self.wants[wi].deliver(arrays)
            with lock:
                total += int(n or 0)
                done = total
            if on_done is not None:
                on_done(done)

        for wi in self.empty:
            want = self.wants[wi]
            deliver(wi, [np.empty(tuple(r.stop - r.start for r in region), dtype=dtypes.numpy_dtype(leaf.dtype))
                         for leaf, region in want.parts])
        error: list[BaseException] = []

        def work(unit: _Unit, cost: int, plan: Any) -> None:
            try:
                if unit.group:
                    self._run_group(unit, deliver, on_error)
                elif unit.cluster:
                    self._run_cluster(unit, deliver, on_error)
                elif unit.want is not None:
                    self._run_want(unit, deliver, on_error)
                elif unit.batch is not None:
                    self._run_batch(unit, deliver, on_error)
                elif unit.streamed:
                    self._run_streamed(unit, plan, deliver)
                else:
                    self._run_whole(unit, deliver)
            except CkptError as exc:
                self._fail_unit(unit)
                if on_error is None:
                    raise
                on_error(unit.lc.leaf, unit.index, exc)
            except BaseException:
                self._fail_unit(unit)
                raise
            finally:
                with self._cond:
                    self._used -= cost
                    self._running -= 1
                    self._cond.notify_all()

        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="ckpt-read") as pool:
            futures: list[Future[None]] = []

            def collect(block: bool) -> None:
                keep = []
                for fut in futures:
                    if fut.done():
                        exc = fut.exception()
                        if exc is not None and not error:
                            error.append(exc)
                    else:
                        keep.append(fut)
                futures[:] = keep

            for unit in self.units:
                plan = None
                if unit.streamed:
                    try:
                        plan = self._plan_stream(unit)
                    except CkptError as exc:
                        if on_error is None:
                            error.append(exc)
                            break
                        self._fail_unit(unit)
                        on_error(unit.lc.leaf, unit.index, exc)
                        continue
                    cost = plan[3]
                else:
                    cost = self._unit_cost(unit)
                with self._cond:
                    while True:
                        collect(False)
                        if error:
                            break
                        ok = self._running < self.workers * 2 and (
                            self._running == 0 or self._used + cost <= self.budget)
                        if ok:
                            break
                        self._cond.wait(0.05)
                    if error:
                        break
                    self._used += cost
                    self.stats.peak_bytes = max(self.stats.peak_bytes, self._used)
                    self._running += 1
                futures.append(pool.submit(work, unit, cost, plan))
            for fut in futures:
                try:
                    fut.result()
                except BaseException as exc:  # noqa: BLE001
                    if not error:
                        error.append(exc)
        if error:
            raise error[0]
        lost = [st for st in self.states if not st.done and not st.failed and st.units]
        if lost:  # cannot happen when the chunks tile the regions (checked above); never a silent gap
            leaf, region = lost[0].want.parts[0]
            raise CkptError(f"region {[(r.start, r.stop) for r in region]} was not completely read", leaf.path)
        return total


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
            load: Counter = Counter()
            for b in range(first, last + 1):
                load[b] += nbytes
            passes.append(([span], load))
    return [members for members, _ in passes]
