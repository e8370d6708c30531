"""Planning: the units of work that read every stored chunk a list of wants needs, and their order.

Reading each wanted region on its own decodes a stored chunk again for
every region inside it (tensorstore decodes whole chunks), so the plan is
made by SOURCE chunk: a unit decodes one stored chunk once and hands every
region it feeds its piece. On many small chunks one read per chunk costs
more than the decode, so units are merged where that saves reads: a want
whose chunks feed nothing else is read whole; a small leaf is read in one
go; wants that share their chunks are read together (a cluster); small
reads are started together (a group). A chunk too large to decode whole
is streamed (ops/streaming.py), and so is one larger than an eighth of the
budget where it can be (streams_by_choice). Streams run first; the other
units in the order of the first region they feed (the consumers' own
order), so assembled regions complete soon after they start.

The plan is made once, before anything is read, and is plain data: what
each unit costs comes from admission.py, and running the units is
execution.py's job. `validate --deep` asks it for facts (how many chunks
it decodes, which are decoded whole) before the run.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from ..base.errors import CkptError
from ..core.contract import reader_of
from ..core.model import ArrayLeaf, Region
from .admission import MiB, MemoryBudget, decoded_cost
from .regions import LeafChunks, _intersect, _size
from .joint import JointPlan, plan_joint
from .streaming import StreamPlan, _Streamer, band_bytes, plan_passes
from .wants import Want

# a leaf up to this size (decoded, twice: see decoded_cost) is read in one go when it has several chunks
BATCH_BYTES = 8 * MiB
# small reads started together, as one unit of work: at most this much memory and this many reads
GROUP_BYTES = 32 * MiB
GROUP_UNITS = 256
# wants sharing their chunks, read region by region together: at most this much memory
CLUSTER_BYTES = 64 * MiB


def streams_by_choice(nbytes: int, budget: int) -> bool:
    """Whether a stored chunk of `nbytes` that the budget could decode whole is streamed all the same.

    A chunk larger than an eighth of the budget (the largest output chunk,
    engine.output_chunk_limit, so its output pieces are bands of the stream)
    would hold a quarter of the budget or more while one thread decodes it
    whole, and the other threads wait for room: on a 13-core TPU VM at
    --memory 2GiB, a 393 MiB embedding decoded whole took 2.2 s on one thread
    after everything else was done. As a stream it holds a few bands, its
    output pieces are written as they are decoded, and it starts first
    (Plan._first). Only where it streams in one pass (else it would be
    decoded once per pass) and its codecs stream at all.
    """
    return nbytes > budget // 8


def _starts_reads(leaf: ArrayLeaf) -> bool:
    """Whether the leaf's reader can start a read and wait for it later (tensorstore-backed readers)."""
    return reader_of(leaf).starts_reads


@dataclass
class _Unit:
    """One stored chunk decoded once for the pieces it feeds; or (`want` set) one
    want read whole through the format's reader (see `_reads_whole`)."""

    lc: LeafChunks
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
    # a joint stream: the chunks (`members`) feeding wants that a streamed chunk feeds too, streamed together
    joint: JointPlan | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.lc.chunks[self.index].sizes) * self.lc.itemsize


class Plan:
    """The units that read a list of wants, in the order they run (see the module docstring)."""

    def __init__(self, wants: Sequence[Want], admission: MemoryBudget) -> None:
        self._admission = admission
        self.budget = admission.limit
        self.band = band_bytes(self.budget)
        from ..core.codecs import window_bytes

        self.window = window_bytes(self.budget)
        self.wants = list(wants)
        self._leaves: dict[int, LeafChunks] = {}
        # how many pieces (a stored chunk's part of one of its regions) feed each want
        self.feeds = [0] * len(self.wants)
        units: dict[tuple[int, int], _Unit] = {}
        self.empty: list[int] = []
        # wants whose regions the stored chunks do not tile exactly (a gap, or DCP chunks
        # that overlap): read through the format's reader, which checks coverage itself
        self.direct: list[int] = []
        for wi, want in enumerate(self.wants):
            order = want.order if want.order is not None else wi
            found: list[tuple[LeafChunks, int, int, Region]] = []
            exact = True
            for pi, (leaf, region) in enumerate(want.parts):
                lc = self.chunks_of(leaf)
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
            self.feeds[wi] = len(found)
            if not found:
                self.empty.append(wi)
        chunk_units = self._reads_whole(units)
        for unit in chunk_units:
            if unit.want is None and unit.batch is None:
                unit.streamed = decoded_cost(unit.nbytes) > self.budget or self._streams_in_one_pass(unit)
        chunk_units = self._joint(chunk_units)
        # wants the chunks do not tile run in the pool too, through the format's reader
        chunk_units += [self._want_unit(wi, []) for wi in self.direct]
        self.units = self._first(self._grouped(sorted(chunk_units, key=lambda u: (u.order, id(u.lc), u.index))))
        # the stored chunks decoded as streams (by size or by choice), for decodes_whole
        self._streamed = {(id(u.lc.leaf), u.index) for u in self.units if u.streamed} | {
            (id(m.lc.leaf), m.index) for u in self.units if u.joint is not None for m in u.members}

    def _streams_in_one_pass(self, unit: _Unit) -> bool:
        """Whether a chunk the budget could decode whole is streamed instead (streams_by_choice)."""
        if unit.cluster or unit.members or not streams_by_choice(unit.nbytes, self.budget):
            return False
        try:
            streamer = _Streamer(unit.lc, unit.index, self.band, self.window)
        except CkptError:
            return False
        if streamer.problem():
            return False
        return len(plan_passes(streamer, unit.pieces, self.wants, self.feeds, self.budget, self.band).passes) == 1

    @staticmethod
    def _first(units: list[_Unit]) -> list[_Unit]:
        """The streams first, then the rest in their order: a stream is the longest unit (one thread
        decodes a large chunk front to back), so started last it alone would set the run's end."""
        return [u for u in units if u.streamed or u.joint is not None] + [
            u for u in units if not (u.streamed or u.joint is not None)]

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
            want, feeds = self.wants[wi], self.feeds[wi]
            # only when every piece of the want comes whole from its own chunks,
            # the read fits the budget, and it saves reads (one chunk: nothing to save)
            if len(members) != feeds or feeds < 2 or decoded_cost(want.nbytes) + want.extra > self.budget:
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
                and all(pieces[wi] == self.feeds[wi] for wi in wants)  # no chunk of theirs elsewhere
                and all(_starts_reads(leaf) for wi in wants for leaf, _ in self.wants[wi].parts)
                and sum(decoded_cost(self.wants[wi].nbytes) for wi in wants) <= limit
            )
            if not ok:
                continue
            first = min(members, key=lambda u: (u.order, u.index))
            out.append(_Unit(first.lc, first.index, first.order, members=members, cluster=wants))
            taken.update(id(u) for u in members)
        return out + [u for u in units if id(u) not in taken]

    def _joint(self, units: list[_Unit]) -> list[_Unit]:
        """The chunks feeding wants that a streamed chunk feeds too, as one joint stream each (joint.py).

        A want fed by a streamed chunk and by other chunks is complete only
        when all of them have reached it: run as units of their own, the
        first one held every region it opened until the others caught up.
        A set of chunks joined through such wants is read by one unit that
        advances their streams together. When one of them has no streaming
        decoder the units stay as they are (each is decoded as before).
        """
        if not any(u.streamed for u in units):
            return units
        plain = [u for u in units if u.want is None and u.batch is None and not u.cluster and not u.members]
        parent: dict[int, int] = {}

        def find(x: int) -> int:
            while parent.setdefault(x, x) != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        by_want: dict[int, list[_Unit]] = {}
        for unit in plain:
            for wi, _, _ in unit.pieces:
                by_want.setdefault(wi, []).append(unit)
        for members in by_want.values():
            for unit in members[1:]:
                parent[find(id(members[0]))] = find(id(unit))
        comps: dict[int, list[_Unit]] = {}
        for unit in plain:
            comps.setdefault(find(id(unit)), []).append(unit)
        joined: set[int] = set()
        out: list[_Unit] = []
        for members in comps.values():
            if len(members) < 2 or not any(u.streamed for u in members):
                continue
            members.sort(key=lambda u: (u.order, u.index))
            streamers = []
            for unit in members:
                try:
                    streamer = _Streamer(unit.lc, unit.index, self.band, self.window)
                except CkptError:
                    streamer = None
                if streamer is None or streamer.problem():
                    break
                streamers.append(streamer)
            else:
                plan = plan_joint(streamers, [u.pieces for u in members], self.wants, self.feeds, self.budget,
                                  self.band)
                first = members[0]
                out.append(_Unit(first.lc, first.index, min(u.order for u in members), members=members, joint=plan))
                joined.update(id(u) for u in members)
        return out + [u for u in units if id(u) not in joined]

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
            small = (unit.want is None and not unit.cluster and not unit.streamed and unit.joint is None
                     and _starts_reads(unit.lc.leaf))
            c = self.unit_cost(unit) if small else 0
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

    def unit_cost(self, unit: _Unit) -> int:
        """The memory a (non-streamed) unit is admitted for."""
        if unit.joint is not None:
            return unit.joint.cost
        if unit.group:
            return sum(self.unit_cost(m) for m in unit.group)
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
        lc = self.chunks_of(want.parts[0][0])
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

    def chunks_of(self, leaf: ArrayLeaf) -> LeafChunks:
        lc = self._leaves.get(id(leaf))
        if lc is None:
            lc = self._leaves[id(leaf)] = LeafChunks(leaf)
        return lc

    # -- planning facts ----------------------------------------------------------------
    def decodes_whole(self, leaf: ArrayLeaf, index: int) -> bool:
        """Whether stored chunk `index` of `leaf` is decoded whole (not as a stream)."""
        lc = self.chunks_of(leaf)
        if (id(leaf), index) in self._streamed:
            return False
        return decoded_cost(math.prod(lc.chunks[index].sizes) * lc.itemsize) <= self.budget

    def check_streamable(self) -> None:
        """Refuse before any work starts when a chunk too large to decode whole has no streaming decoder."""
        for unit in self.units:
            if unit.streamed:
                self.streamer(unit)

    def streamer(self, unit: _Unit) -> _Streamer:
        """The stream of a streamed unit's chunk; refused as one line when nothing can stream it."""
        streamer = _Streamer(unit.lc, unit.index, self.band, self.window)
        problem = streamer.problem()
        if problem:
            need = self._admission.memory_needed(unit.nbytes)
            raise CkptError(
                f"stored chunk {unit.index} decodes to {unit.nbytes / MiB:.1f} MiB, more than the memory budget "
                f"allows, and {problem}; use --memory {need}MiB or more",
                unit.lc.leaf.path,
            )
        return streamer

    def stream_plan(self, unit: _Unit) -> StreamPlan:
        """How a streamed unit's chunk is read: its passes, and the memory they take (see ops/streaming.py)."""
        return plan_passes(self.streamer(unit), unit.pieces, self.wants, self.feeds, self.budget, self.band)
