"""Joint streams: wants fed by several stored chunks of which one at least is too large to decode whole.

A stream (ops/streaming.py) hands out its bands in C order and frees each
region as soon as its last band is in: that holds when the stream alone
feeds the region. A `diff --values` of a one-chunk Orbax array against the
torch-written DCP twin of it pairs each region of A with the same region of
B: the two sides are two streams, and run as two units one after the other
the first one opened every region's buffer and held it until the second one
caught up (768 MiB per array, above any budget: measured 1.1 GiB peak RSS
under the default 512 MiB). An output chunk of convert or reshard straddling
two streamed stored chunks has the same shape.

So the stored chunks feeding a set of such wants (the connected component of
chunks and wants) are read by one unit that advances their streams together,
want by want in the wants' order: each stream is pulled just up to the last
band the next want needs from it, so a region's buffers are open from its
first band to its last, across the streams. The order of the steps is known
before anything is read, so the plan simulates it: the open buffers and the
open streams (their bands and compressed windows) at every step. Wants are
put in passes that keep that load within the budget (a compressed stream is
decoded from its start on each pass; a DCP chunk reads only its own bands).
Every stream here only moves forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..base.errors import CkptError
from ..core.model import Region
from .regions import _intersect
from .streaming import _Streamer
from .wants import Want

Piece = tuple[int, int, Region]  # (want, part, region)


@dataclass
class JointPass:
    """One pass of a joint stream: the steps (member, band) in order, and each member's pieces in it."""

    steps: list[tuple[int, int]] = field(default_factory=list)
    pieces: dict[int, list[Piece]] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)  # member -> index of its last step
    wants: list[int] = field(default_factory=list)


@dataclass
class JointPlan:
    """How the members of a joint unit are streamed: their streamers, the passes, the memory it takes."""

    streamers: list[_Streamer]
    passes: list[JointPass]
    cost: int


class _PassBuilder:
    """A pass grown want by want, with the load at each of its steps (see the module docstring)."""

    def __init__(self, streamers: Sequence[_Streamer], member_cost: Sequence[int], active: int) -> None:
        self.streamers = streamers
        self.member_cost = member_cost
        self.active = active  # the band being decoded beside those held
        self.p = JointPass()
        self.step_of: dict[tuple[int, int], int] = {}
        self.ptr: dict[int, int] = {}  # member -> next band it may hand out
        self.first: dict[int, int] = {}  # member -> its first step
        self.load: list[int] = []  # open buffers, per step
        self.mem: list[int] = []  # open members, per step
        self.peak = 0

    def try_add(self, wi: int, nbytes: int, needs: list[tuple[int, list[int], Piece]], limit: int) -> bool:
        """Add want `wi` (its pieces: member, bands they need, piece) if the pass stays within `limit`
        (or is empty); False when it belongs to a new pass."""
        new_steps: list[tuple[int, int]] = []
        ptr = dict(self.ptr)
        steps_at: dict[tuple[int, int], int] = {}
        n = len(self.p.steps)
        for m, bands, _ in needs:
            for b in bands:
                if (m, b) in self.step_of or (m, b) in steps_at:
                    continue
                if b < ptr.get(m, 0):
                    return False  # a stream would go back: a new pass (an empty pass has no streams yet)
                steps_at[(m, b)] = n + len(new_steps)
                new_steps.append((m, b))
                ptr[m] = b + 1
        found = [self.step_of.get(k, steps_at.get(k)) for m, bands, _ in needs for k in ((m, b) for b in bands)]
        where = [s for s in found if s is not None]
        if not where:
            return True  # nothing to read (an empty piece)
        opened, closed = min(where), max(where)
        load = self.load + [0] * len(new_steps)
        mem = self.mem + [0] * len(new_steps)
        for s in range(opened, closed + 1):
            load[s] += nbytes
        # members' spans grow to their new last steps
        last = dict(self.p.last_step)
        first = dict(self.first)
        for m, b in new_steps:
            s = steps_at[(m, b)]
            if m not in first:
                first[m] = s
                lo = s
            else:
                lo = last[m] + 1
            for t in range(lo, s + 1):
                mem[t] += self.member_cost[m]
            last[m] = s
        peak = max((a + b for a, b in zip(load, mem)), default=0) + self.active
        if self.p.wants and peak > limit:
            return False
        self._commit(wi, needs, new_steps, steps_at, ptr, load, mem, last, first, peak)
        return True

    def _commit(self, wi: int, needs: list[tuple[int, list[int], Piece]], new_steps: list[tuple[int, int]],
                steps_at: dict[tuple[int, int], int], ptr: dict[int, int], load: list[int], mem: list[int],
                last: dict[int, int], first: dict[int, int], peak: int) -> None:
        self.p.steps += new_steps
        self.step_of.update(steps_at)
        self.ptr, self.load, self.mem, self.first, self.peak = ptr, load, mem, first, peak
        self.p.last_step = last
        self.p.wants.append(wi)
        for m, _, piece in needs:
            self.p.pieces.setdefault(m, []).append(piece)


def band_hits(streamer: _Streamer, region: Region) -> list[int]:
    """The bands of a streamed chunk that overlap `region` (array coordinates), in order."""
    out = []
    for i, band in enumerate(streamer.bands):
        g = streamer.global_band(band)
        if g is not None and (not region or _intersect(region, g) is not None):
            out.append(i)
    return out


def plan_joint(streamers: Sequence[_Streamer], member_pieces: Sequence[list[Piece]], wants: Sequence[Want],
               feeds: Sequence[int], budget: int, band: int) -> JointPlan:
    """Passes over the members' streams that keep the open buffers and streams within `budget`.

    member_pieces[m]: the pieces (want, part, region) member m feeds. A want
    is in one pass whole; each pass keeps the wants' order.
    """
    by_want: dict[int, list[tuple[int, list[int], Piece]]] = {}
    for m, pieces in enumerate(member_pieces):
        for piece in pieces:
            by_want.setdefault(piece[0], []).append((m, band_hits(streamers[m], piece[2]), piece))
    order = sorted(by_want, key=lambda wi: (wants[wi].order if wants[wi].order is not None else wi, wi))
    # an open member holds its current band and its decoder's windows; one more band is being decoded
    member_cost = [band + s.decoder_bytes() for s in streamers]
    passes: list[JointPass] = []
    cost = 0
    builder = _PassBuilder(streamers, member_cost, band)
    for wi in order:
        needs = by_want[wi]
        want = wants[wi]
        direct = len(needs) == 1 and len(needs[0][1]) == 1 and len(want.parts) == 1 and feeds[wi] == 1
        nbytes = (0 if direct else want.nbytes) + want.extra
        if not builder.try_add(wi, nbytes, needs, budget):
            passes.append(builder.p)
            cost = max(cost, builder.peak)
            builder = _PassBuilder(streamers, member_cost, band)
            builder.try_add(wi, nbytes, needs, budget)
    if builder.p.wants:
        passes.append(builder.p)
        cost = max(cost, builder.peak)
    return JointPlan(list(streamers), passes, cost)


class _Cursor:
    """One member's stream in a pass: bands handed out by index, forward only."""

    def __init__(self, streamer: _Streamer, last: int) -> None:
        self.s = streamer
        self.last = last
        self._stream: Any = None
        self._next = 0  # the next band a compressed stream decodes

    def band(self, b: int) -> tuple[Region | None, np.ndarray | None]:
        s = self.s
        if s.zarr is None:  # DCP: any band by byte ranges
            region = s.global_band(s.bands[b])
            return region, (s.lc.leaf.read(region) if region is not None else None)
        if self._stream is None:
            from ..core.codecs import ChunkStream

            storage, key, zmeta, zarr3 = s.zarr
            self._stream = ChunkStream(storage, key, zmeta, math.prod(s.stored_shape) * s.lc.itemsize, zarr3,
                                       window=s.window)
        data = None
        while self._next <= b:  # bands before it feed nothing in this pass: decoded and dropped
            data = None
            band = s.bands[self._next]
            data = self._stream.read_band(tuple(r.stop - r.start for r in band))
            self._next += 1
        region = s.global_band(s.bands[b])
        if region is None:
            return None, None
        return region, data[tuple(slice(0, r.stop - r.start) for r in region)]  # type: ignore[index]

    def close(self) -> None:
        if self._stream is not None:
            try:
                if self._next == len(self.s.bands):
                    self._stream.finish()  # a chunk decoding to more than its shape is damaged
            finally:
                self._stream.close()
                self._stream = None


def run_joint(plan: JointPlan, feed: Callable[[int, list[Piece], Region, np.ndarray], None],
              on_pass: Callable[[int], None]) -> None:
    """Run the passes: each step pulls one band of one member and feeds the pass's pieces it overlaps.

    feed(member, pieces, band region, band data) hands the band to the wants
    (and delivers those it completes); on_pass(member) counts a member's pass.
    """
    for jp in plan.passes:
        cursors: dict[int, _Cursor] = {}
        try:
            for i, (m, b) in enumerate(jp.steps):
                cur = cursors.get(m)
                if cur is None:
                    cur = cursors[m] = _Cursor(plan.streamers[m], jp.last_step[m])
                    on_pass(m)
                region, data = cur.band(b)
                if region is not None and data is not None:
                    feed(m, jp.pieces.get(m, []), region, data)
                del data
                if jp.last_step.get(m) == i:
                    cursors.pop(m).close()
        except CkptError:
            raise
        finally:
            for cur in cursors.values():
                try:
                    cur._stream.close() if cur._stream is not None else None
                except Exception:  # noqa: BLE001 - the first failure is the one reported
                    pass
