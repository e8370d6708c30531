"""Admission: the memory budget (`--memory`) and the work let in against it.

A byte budget covers the decoded chunks in flight, the regions being
assembled and what the consumer keeps (the writers' pending windows are
reserved from it by the caller). Units of work are admitted in order
against it, in parallel across chunks; one unit always runs when nothing
else does, so a region larger than the budget still completes (alone).

This is the one place that counts bytes in flight: planning asks it what a
decode costs and how large the budget is, execution charges and frees
through it, so the rule "within --memory" is enforced in one lock.
"""
from __future__ import annotations

import threading
from typing import Callable

# the budget's default and parsing live in base/memory.py (the command line reads them without the scheduler)
from ..base.memory import DEFAULT_MEMORY, MIN_MEMORY, MiB, default_memory, machine_memory, parse_memory  # noqa: F401
from .wants import ReadStats


def decoded_cost(nbytes: int) -> int:
    """Memory a whole decode of a chunk of `nbytes` takes: tensorstore's decoded
    chunk and the array it returns."""
    return 2 * nbytes


class MemoryBudget:
    """The bytes in flight against the budget, and the units running.

    `limit`: what a run may hold, --memory less what the caller reserved
    for itself. Units are admitted for the cost planning gave them;
    assembly buffers opened while a unit runs are charged on top (`take`)
    and freed when their region is delivered (`give`). The high mark goes
    to the run's ReadStats.
    """

    def __init__(self, memory: int, reserve: int, stats: ReadStats) -> None:
        self.memory = memory
        self.limit = max(MIN_MEMORY // 2, memory - reserve)
        self._stats = stats
        self._cond = threading.Condition()
        self._used = 0
        self._running = 0

    def take(self, n: int) -> None:
        """Charge `n` bytes."""
        with self._cond:
            self._used += n
            self._stats.peak_bytes = max(self._stats.peak_bytes, self._used)

    def give(self, n: int) -> None:
        """Free `n` bytes charged before; a unit waiting for room may start."""
        with self._cond:
            self._used -= n
            self._cond.notify_all()

    def admit(self, cost: int, most: int, stop: Callable[[], bool]) -> bool:
        """Wait until a unit of `cost` bytes may start, then charge it; False (nothing charged) once `stop()`.

        It starts when fewer than `most` units run and its cost fits beside
        theirs, or when none runs. `stop()` is asked under the budget's
        lock before each look (the run collects finished work there).
        """
        with self._cond:
            while True:
                if stop():
                    return False
                if self._running < most and (self._running == 0 or self._used + cost <= self.limit):
                    break
                self._cond.wait(0.05)
            self.take(cost)  # (the condition's lock is re-entrant)
            self._running += 1
            return True

    def release(self, cost: int) -> None:
        """A unit admitted for `cost` is over: its bytes are free and its place taken by the next."""
        with self._cond:
            self._used -= cost
            self._running -= 1
            self._cond.notify_all()

    def memory_needed(self, nbytes: int) -> int:
        """The --memory (MiB) under which a stored chunk of `nbytes` would be decoded whole."""
        return -(-(decoded_cost(nbytes) + self.memory - self.limit) // MiB) + 1
