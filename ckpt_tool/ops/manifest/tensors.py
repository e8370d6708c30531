"""Per-tensor digests: the sha256 of each array leaf's logical bytes.

The logical bytes of a leaf are its values in C order, little-endian, as a safetensors file or
`np.ascontiguousarray(a).tobytes()` holds them: the same for a tensor whatever format or chunk
layout stores it (a zarr chunk grid, DCP chunks, a safetensors slice). They name the tensor a
changed byte is in, where a file digest names only the file.

Each leaf is cut into C-order bands (whole rows, then parts of rows for rows over the block) and
the read scheduler reads them, every stored chunk decoded once, within --memory. sha256 needs
the bands in order: a band that arrives before its predecessor is kept (a copy, counted in the
want's `extra`) until the hash reaches it; units run in order, so few ever wait.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Callable

import numpy as np

from ...base import dtypes
from ...base.errors import CkptError
from ...base.findings import Progress, no_progress
from ...core.model import ArrayLeaf, Checkpoint, Chunk, split_to_cap
from ...scheduler import Scheduler, Want
from ...machinery.integrity.schema import TensorDigest

BLOCK_BYTES = 16 << 20


class _Ordered:
    """One leaf's sha256, fed its bands in order whatever order they arrive in."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.next = 0
        self.waiting: dict[int, bytes] = {}
        self.lock = threading.Lock()
        self.failed: str | None = None
        self.bands = 0

    def add(self, index: int, data: np.ndarray) -> None:
        with self.lock:
            if index != self.next:
                # the scheduler reuses its buffers after deliver: a copy
                self.waiting[index] = _little_endian(data).tobytes()
                return
            self.hash.update(_little_endian(data).data)
            self.next += 1
            while self.next in self.waiting:
                self.hash.update(self.waiting.pop(self.next))
                self.next += 1


def _little_endian(data: np.ndarray) -> np.ndarray:
    """The values' bytes as uint8, C order, little-endian (a bfloat16 array has no buffer format
    memoryview takes; its bytes do)."""
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def tensor_digests(
    ckpt: Checkpoint,
    *,
    workers: int,
    memory: int,
    progress: Progress = no_progress,
) -> tuple[dict[str, TensorDigest], dict[str, str]]:
    """(digest per array leaf path, why per leaf path that could not be read)."""
    leaves = [leaf for leaf in ckpt.arrays() if leaf.unreadable is None]
    failed = {leaf.path: leaf.unreadable for leaf in ckpt.arrays() if leaf.unreadable is not None}
    block = max(1 << 20, min(BLOCK_BYTES, memory // 8))
    states = {leaf.path: _Ordered() for leaf in leaves}
    total = sum(leaf.nbytes for leaf in leaves)

    def deliver(leaf: ArrayLeaf, index: int) -> Callable[[list[np.ndarray]], int]:
        def run(arrays: list[np.ndarray]) -> int:
            states[leaf.path].add(index, arrays[0])
            return int(arrays[0].nbytes)
        return run

    wants = []
    for leaf in leaves:
        itemsize = dtypes.get(leaf.dtype).itemsize
        whole = Chunk(tuple(0 for _ in leaf.shape), tuple(leaf.shape))
        bands = split_to_cap(whole, itemsize, block) if leaf.size else []
        states[leaf.path].bands = len(bands)
        for i, band in enumerate(bands):
            wants.append(Want([(leaf, band.region)], deliver(leaf, i), extra=band_bytes(band, itemsize)))

    def on_error(leaf: ArrayLeaf, index: int, exc: CkptError) -> None:
        states[leaf.path].failed = exc.message

    progress("tensors", 0, total)
    Scheduler(wants, memory=memory, workers=workers).run(on_done=lambda n: progress("tensors", n, total),
                                                         on_error=on_error)
    out = {}
    for leaf in leaves:
        st = states[leaf.path]
        if st.failed is not None:
            failed[leaf.path] = st.failed
        elif st.next != st.bands:
            failed[leaf.path] = "part of it could not be read"
        else:
            out[leaf.path] = TensorDigest(st.hash.hexdigest(), leaf.dtype, tuple(leaf.shape))
    return out, failed


def band_bytes(band: Chunk, itemsize: int) -> int:
    n = itemsize
    for s in band.sizes:
        n *= s
    return n
