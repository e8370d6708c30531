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

import os
import threading
from typing import Callable

from ..base.parallel import copy_workers
from ..base.sizes import parse_size
from .wants import ReadStats

MiB = 2**20
DEFAULT_MEMORY = 512 * MiB
# the smallest budget accepted: below it the bands and windows alone would not fit
MIN_MEMORY = 4 * MiB
# the command line's default on many-core hosts: this much per copy worker, up to this (default_memory)
MEMORY_PER_WORKER = 128 * MiB
MAX_DEFAULT_MEMORY = 2048 * MiB


def default_memory(workers: int | None = None, machine: int | None = None) -> int:
    """--memory's default: 128 MiB per copy worker (parallel.copy_workers), at least 512 MiB (so 512
    MiB up to 4 workers, as on 2 cores), at most 2 GiB and an eighth of the machine's memory.

    The budget bounds the chunks in flight, never the checkpoint: a chunk of 64 MiB decoded whole
    counts 128 MiB (decoded_cost), so 512 MiB keeps about 4 of them in flight. On a 13-core TPU VM
    that left 5 to 8 of its 13 copy threads busy on a checkpoint of 44 MiB chunks; at 2 GiB all 13
    were, and an Orbax -> DCP convert took 3.74 s against 4.16 s (medians of 3, interleaved).
    `machine`: its memory in bytes (default: the cgroup's limit where lower than the RAM)."""
    if workers is None:
        workers = copy_workers()
    if machine is None:
        machine = machine_memory()
    wanted = min(MAX_DEFAULT_MEMORY, MEMORY_PER_WORKER * max(1, workers))
    if machine > 0:
        wanted = min(wanted, machine // 8)
    return max(DEFAULT_MEMORY, wanted)


def machine_memory() -> int:
    """The memory this process may use, in bytes: the RAM, or the cgroup's limit where lower;
    0 where neither can be read."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, v1
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            return min(physical, int(text)) if physical > 0 else int(text)
    return physical


def parse_memory(text: str | int) -> int:
    """--memory: '512MiB', '2GiB', '512MB' (10^6), '1G' (2^30) or plain bytes."""
    return parse_size(text, "--memory", minimum=MIN_MEMORY, examples="512MiB, 2GiB, 512MB")


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
