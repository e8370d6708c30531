"""The stream: every output chunk of a write plan, read from its source leaf and given to the writer.

The read scheduler decodes each source chunk once and assembles the output chunks from it,
within --memory; chunks the writer stores as the source does and too large to assemble are
copied as they are stored beside it (ops/stored_copy.py). At most a few chunks are in flight,
so peak memory is bounded whatever the checkpoint size; the work runs in threads because
tensorstore, zstd and numpy release the GIL.
"""
from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from ..core import casting, unstack
from ..base import dtypes
from ..core.blocks import block_shape, blocks
from ..base.findings import Progress, no_progress
from ..core.contract import CheckpointWriter
from ..core.model import ArrayLeaf, Region, RegularGrid, stored_chunks
from ..base.names import key_text
from ..scheduler import DEFAULT_MEMORY, Scheduler, Want
from .stored_copy import StoredCopies, copies_stored
from ..core.write_plan import TargetArray, WritePlan

if TYPE_CHECKING:
    from .planner import Sources


def chunk_regions(target: TargetArray) -> Iterator[tuple[int, Region]]:
    """(chunk index, region) of every output chunk, in the order writers index them."""
    for i, c in enumerate(stored_chunks(target.shape, target.layout)):
        yield i, c.region


def stream(
    plan: WritePlan,
    sources: Sources,
    writer: CheckpointWriter,
    *,
    workers: int = 4,
    progress: Progress = no_progress,
    owns: Callable[[int], bool] = lambda n: True,
    memory: int = DEFAULT_MEMORY,
    chunk_blocks: bool = False,
    overflow: casting.Overflow | None = None,
) -> tuple[int, int]:
    """Copy every chunk this process owns; returns (chunks, bytes) written.

    The read scheduler decodes each source chunk once and assembles the
    output chunks from it, within `memory` (less what the writer keeps
    pending: its write-behind window). `chunk_blocks`: the writer takes a
    block of whole chunks of a regular grid as one region (core/blocks.py).
    """
    work = _Work(writer, owns, memory, overflow)
    for target in plan.arrays():
        work.add(target, sources[key_text(target.keys)], chunk_blocks)
    # the Orbax writer keeps bytes copied into tensorstore, not yet committed (and encodes them)
    reserve = int(writer.pending_bytes_limit)
    copier = StoredCopies(writer, work.copies, workers, memory)
    scheduler = Scheduler(work.wants, memory=memory, workers=workers, reserve=reserve + copier.memory)
    report = _Report(progress, work.total)
    copier.start(report.copied)
    try:
        read = scheduler.run(on_done=report.read)
    except BaseException:
        copier.stop()
        raise
    return work.chunks, read + copier.wait()


class _Work:
    """The chunks of a plan this process owns, as the scheduler's wants or as stored copies.

    Chunks are numbered across the plan in the order writers index them (`owns(n)`);
    `total` counts the bytes they hold, `chunks` how many there are.
    """

    def __init__(self, writer: CheckpointWriter, owns: Callable[[int], bool], memory: int,
                 overflow: casting.Overflow | None) -> None:
        self.writer, self.owns, self.memory, self.overflow = writer, owns, memory, overflow
        self.wants: list[Want] = []
        self.copies: list[tuple[TargetArray, ArrayLeaf, int, Region]] = []
        self.n = 0  # the plan's chunks seen so far
        self.total = 0
        self.chunks = 0

    def add(self, target: TargetArray, leaf: ArrayLeaf, chunk_blocks: bool) -> None:
        """The owned chunks of `target`, read from `leaf`."""
        itemsize = dtypes.get(target.dtype).itemsize
        if copies_stored(self.writer, target, leaf, itemsize, self.memory):
            self._add_copies(target, leaf, itemsize)
            return
        per = None
        if chunk_blocks and isinstance(target.layout, RegularGrid):
            per = block_shape(target.shape, target.layout, leaf, itemsize, self.memory)
        if per is None:
            self._add_chunks(target, leaf, itemsize)
        else:
            self._add_blocks(target, leaf, itemsize, per)

    def _add_copies(self, target: TargetArray, leaf: ArrayLeaf, itemsize: int) -> None:
        for index, region in chunk_regions(target):
            if self.owns(self.n):
                self.copies.append((target, leaf, index, region))
                self.total += math.prod(r.stop - r.start for r in region) * itemsize
                self.chunks += 1
            self.n += 1

    def _add_chunks(self, target: TargetArray, leaf: ArrayLeaf, itemsize: int) -> None:
        for index, region in chunk_regions(target):
            if self.owns(self.n):
                self._want(target, leaf, itemsize, index, region)
                self.chunks += 1
            self.n += 1

    def _add_blocks(self, target: TargetArray, leaf: ArrayLeaf, itemsize: int, per: tuple[int, ...]) -> None:
        """Blocks of whole chunks of a regular grid, each one region for the writer (core/blocks.py)."""
        assert isinstance(target.layout, RegularGrid)
        grid = stored_chunks(target.shape, target.layout)
        for members, region in blocks(target.shape, target.layout.chunk_shape, per):
            mine = [i for i in members if self.owns(self.n + i)]
            if len(mine) == len(members):
                self._want(target, leaf, itemsize, members[0], region)
            else:  # chunks of other processes inside: this one writes its own, one by one
                for i in mine:
                    self._want(target, leaf, itemsize, i, grid[i].region)
            self.chunks += len(mine)
        self.n += len(grid)

    def _want(self, target: TargetArray, leaf: ArrayLeaf, itemsize: int, index: int, region: Region) -> None:
        # an unstacked leaf is asked of its stored leaf: each stored chunk is still decoded once
        stored, stored_region = unstack.base_region(leaf, region)
        copy = _copier(self.writer, target, index, region, self.overflow)
        self.wants.append(Want([(stored, stored_region)], copy, keeps=True))
        self.total += math.prod(r.stop - r.start for r in region) * itemsize


class _Report:
    """progress("write", ...) of the bytes the scheduler delivered and those copied as stored,
    each a running total reported from its own threads."""

    def __init__(self, progress: Progress, total: int) -> None:
        self._progress, self._total = progress, total
        self._lock = threading.Lock()
        self._done = [0, 0]  # bytes delivered by the scheduler, bytes copied as stored
        progress("write", 0, total)

    def read(self, n: int) -> None:
        self._set(0, n)

    def copied(self, n: int) -> None:
        self._set(1, n)

    def _set(self, part: int, n: int) -> None:
        with self._lock:
            self._done[part] = n
            self._progress("write", self._done[0] + self._done[1], self._total)


def _copier(writer: CheckpointWriter, target: TargetArray, index: int, region: Region,
            overflow: casting.Overflow | None = None) -> Callable[[list[np.ndarray]], int]:
    shape = tuple(r.stop - r.start for r in region)

    def copy(arrays: list[np.ndarray]) -> int:
        data = arrays[0]
        if data.shape != shape:  # read from the stored leaf of an unstacked one: its axis of 1 dropped
            data = data.reshape(shape)
        if target.source_dtype is not None:
            data, lost = casting.cast_array(data, target.dtype)
            if overflow is not None:
                overflow.add(target.path, lost)
        writer.write_array(target, index, region, data)
        return int(data.nbytes)

    return copy

