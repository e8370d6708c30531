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
chunks in flight, the regions being assembled and what the consumer keeps.
Units are admitted in order against it; a stored chunk whose whole decode
would not fit is decoded as a stream of bands instead, alone, in as many
passes as the regions it feeds need.

The package is cut where the work is: each part can be read (and changed)
without the others.

  wants.py      Want (what a caller asks for) and ReadStats (what a run read)
  regions.py    region arithmetic; which stored chunks a region overlaps
  planning.py   Plan: the units of work, merged where that saves reads, in the order they run
  admission.py  MemoryBudget: what a decode costs, --memory, units admitted against it
  ops/streaming.py  a chunk too large to decode whole: its bands and the passes over them
  execution.py  Executor: runs the units in a pool, assembles the regions, delivers them

Scheduler (below) puts them together: the Plan is made from the wants
against the budget, and the Executor runs it within that budget.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..base.errors import CkptError
from ..core.model import ArrayLeaf
from ..base.bufferpool import POOL
from ..storage.remote import in_flight
from .admission import DEFAULT_MEMORY, MIN_MEMORY, MiB, MemoryBudget, decoded_cost, default_memory, parse_memory
from .execution import Executor
from .planning import Plan, _Unit
from .regions import LeafChunks  # (reshard's planner counts stored chunks with it)
from .streaming import band_bytes
from .wants import ReadStats, Want

__all__ = [
    "DEFAULT_MEMORY", "MIN_MEMORY", "LeafChunks", "MiB", "ReadStats", "Scheduler", "Want", "band_bytes", "decoded_cost",
    "default_memory", "parse_memory",
]


class Scheduler:
    """Plans wants by source chunk and runs them within a memory budget (see the package docstring).

    memory: the budget in bytes; reserve: what of it the caller keeps for
    itself (a writer's pending windows); workers: units run at a time (up
    to twice as many admitted).
    """

    def __init__(self, wants: Sequence[Want], *, memory: int = DEFAULT_MEMORY, workers: int = 4,
                 reserve: int = 0) -> None:
        self.memory = memory
        # (on an object store more units wait on round trips than there are cores: the budget still
        # bounds what they hold)
        self.workers = in_flight(max(1, workers))
        # the decoders' idle buffers kept for the next chunks (base/bufferpool.py): a share of the budget
        POOL.limit = memory // 4
        self.stats = ReadStats(budget=memory)
        self.admission = MemoryBudget(memory, reserve, self.stats)
        self.budget = self.admission.limit
        self.plan = Plan(wants, self.admission)
        self.wants = self.plan.wants
        self.units: list[_Unit] = self.plan.units
        self.executor = Executor(self.plan, self.admission, self.stats)

    @property
    def planned_chunks(self) -> int:
        """How many stored chunks the plan decodes (each once; a streamed chunk once per pass)."""
        return self.plan.planned_chunks

    def decodes_whole(self, leaf: ArrayLeaf, index: int) -> bool:
        """Whether stored chunk `index` of `leaf` is decoded whole (not as a stream)."""
        return self.plan.decodes_whole(leaf, index)

    def check_streamable(self) -> None:
        """Refuse before any work starts when a chunk too large to decode whole has no streaming decoder."""
        self.plan.check_streamable()

    def run(self, *, on_done: Callable[[int], None] | None = None,
            on_error: Callable[[ArrayLeaf, int, CkptError], None] | None = None) -> int:
        """Decode every needed chunk once (per pass) and deliver every want; the sum of deliver's results.

        on_done(bytes delivered so far) after each delivery. on_error(leaf,
        chunk index, error): a chunk that does not read is reported there
        (the wants it feeds are dropped) instead of raising.
        """
        if on_error is None:
            self.check_streamable()
        return self.executor.run(self.workers, on_done=on_done, on_error=on_error)
