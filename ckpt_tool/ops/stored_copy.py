"""Output chunks copied as the source stores them, never assembled.

A chunk too large to assemble under --memory (output_chunk_limit) whose writer stores
it as the source does (the same grid, dtype and encoding) keeps its shape: planning
asks plans_stored_copy, the stream asks copies_stored, and StoredCopies copies such
chunks from the source's stored bytes a window at a time, beside the read scheduler.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from ..base import dtypes
from ..core.codecs import window_bytes
from ..core.contract import CheckpointWriter, WriterModule, reader_of
from ..core.model import ArrayLeaf, Region, RegularGrid
from ..core.write_plan import TargetArray


def output_chunk_limit(memory: int) -> int:
    """The largest output chunk under a memory budget: a chunk is assembled, then
    encoded (zarr) or archived (DCP) whole, and the writer keeps some pending."""
    return max(2**20, memory // 8)


def _same_stored_grid(target: TargetArray, leaf: ArrayLeaf) -> bool:
    """`target`'s chunks are `leaf`'s stored chunks cell for cell: the same shape and regular grid, no cast."""
    return (target.source_dtype is None and tuple(leaf.shape) == tuple(target.shape)
            and isinstance(target.layout, RegularGrid) and isinstance(leaf.layout, RegularGrid)
            and tuple(leaf.layout.chunk_shape) == tuple(target.layout.chunk_shape))


def plans_stored_copy(write: WriterModule, destination: str, target: TargetArray, leaf: ArrayLeaf, zarr3: bool) -> bool:
    """For planning (convert's and reshard's): whether a writer to `destination` would take `leaf`'s
    stored chunks as they are for `target` (in its layout), so that the grid is kept however large
    its chunks (stream() then copies them: copies_stored)."""
    if not _same_stored_grid(target, leaf):
        return False
    encoding = reader_of(leaf).stored_encoding()
    return encoding is not None and encoding == write.stored_chunk_encoding(destination, target, zarr3)


def copies_stored(writer: CheckpointWriter, target: TargetArray, leaf: ArrayLeaf, itemsize: int, memory: int) -> bool:
    """Whether `target`'s chunks are `leaf`'s stored chunks, copied as they are stored: the same grid
    and dtype, the writer storing them as the source does, and chunks too large to assemble under
    the budget (planning keeps such a grid where the writer takes them: plans_stored_copy).
    Smaller ones go through the scheduler, which decodes them (and the Orbax writer still stores a
    whole decoded chunk's bytes as they are: machinery/arrays/stored_chunks.py)."""
    if not _same_stored_grid(target, leaf) or math.prod(target.layout.chunk_shape) * itemsize <= output_chunk_limit(memory):
        return False
    encoding = reader_of(leaf).stored_encoding()
    return encoding is not None and encoding == writer.stored_encoding(target)


class StoredCopies:
    """Output chunks copied from the source's stored bytes (ArrayReader.copy_stored into
    CheckpointWriter.write_stored), beside the scheduler's work: a window at a time, each window
    decoded as it passes as the check, so a chunk of any size takes a few windows of memory."""

    def __init__(self, writer: CheckpointWriter, copies: list[tuple[TargetArray, ArrayLeaf, int, Region]],
                 workers: int, memory: int) -> None:
        self._writer = writer
        self._copies = copies
        self._threads = min(len(copies), max(1, workers // 4))
        self.window = window_bytes(memory)
        # the windows each copy holds (the one read, the one fetched ahead, the decoder's)
        self.memory = self._threads * 3 * self.window
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[int]] = []
        self._lock = threading.Lock()
        self._copied = 0
        self._stopped = False

    def start(self, on_done: Callable[[int], None]) -> None:
        if not self._copies:
            return
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="ckpt-copy")
        self._futures = [self._pool.submit(self._copy, c, on_done) for c in self._copies]

    def _copy(self, item: tuple[TargetArray, ArrayLeaf, int, Region], on_done: Callable[[int], None]) -> int:
        if self._stopped:
            return 0
        target, leaf, index, region = item
        assert isinstance(leaf.layout, RegularGrid)
        grid_index = tuple(r.start // c for r, c in zip(region, leaf.layout.chunk_shape))
        reader = reader_of(leaf)
        self._writer.write_stored(target, index, region,
                                  lambda write: reader.copy_stored(grid_index, write, self.window))
        nbytes = math.prod(r.stop - r.start for r in region) * dtypes.get(target.dtype).itemsize
        with self._lock:
            self._copied += nbytes
            copied = self._copied
        on_done(copied)
        return nbytes

    def wait(self) -> int:
        """Every copy done (the first failure raised); the bytes copied."""
        try:
            return sum(f.result() for f in self._futures)
        finally:
            self.stop()

    def stop(self) -> None:
        """No copy starts any more; those running finish (a failed run's output is discarded)."""
        self._stopped = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

