"""Buffers for decoded chunks, used again once their arrays are gone: fresh memory is dear on VMs.

The first touch of each page of freshly allocated memory is a fault the
kernel serves. Filling 1 GiB of fresh memory took 1.4 s against 0.7 s for
memory used before on this machine (a Firecracker VM), and 3.2 s against
1.6 s on a TPU VM, whose gVisor kernel serves every fault itself
(bench/host_io_probe.py). A copy that decodes every chunk into a new array,
and reads every compressed chunk into new bytes, pays that for each byte of
the checkpoint, twice: glibc hands big blocks back to the kernel when they
are freed (anything over 32 MiB, and trimmed heaps), so the next chunk's
buffer faults again.

So the decoders take their buffers from here. A buffer is free again once
nothing but the pool refers to it: every array, view or memoryview made
from it holds a reference to it, so a buffer still in use anywhere is never
handed out twice. At most `limit` bytes of free buffers are kept (the
oldest dropped first); in-flight buffers are the memory the scheduler's
budget already counts. The scheduler sets the limit from --memory (a quarter);
small buffers (under MIN_BYTES) come from numpy as before.
"""
from __future__ import annotations

import math
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
# (numpy imported when a buffer is first asked for: the storage layer, which every command
# imports, holds the pool, and a local DCP inspect asks for none, issue 46)

MIN_BYTES = 1 << 20
# free bytes kept when nobody set a limit (a quarter of the default --memory)
DEFAULT_LIMIT = 128 << 20
# a free buffer serves a request of at least this share of its size (bounds the bytes left unused)
MIN_FILL = 0.5


class BufferPool:
    """Byte buffers handed out as arrays, taken back when nothing else refers to them."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] = []  # every pooled buffer, in use or free, oldest first
        self.reused = 0  # bytes handed out from free buffers (for tests and benches)
        self.allocated = 0  # bytes of new buffers

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised, writable, C-contiguous array of `shape` and `dtype`."""
        import numpy as np

        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes < MIN_BYTES or self.limit <= 0:
            return np.empty(shape, dtype=dt)
        with self._lock:
            buf = self._take(nbytes)
            if buf is None:
                buf = np.empty(nbytes, dtype=np.uint8)
                self.allocated += nbytes
            else:
                self.reused += nbytes
            self._buffers.append(buf)  # (most recently used last)
        return buf[:nbytes].view(dt).reshape(shape)

    def bytes(self, nbytes: int) -> memoryview:
        """An uninitialised, writable byte buffer of `nbytes` (for reading compressed bytes into)."""
        return memoryview(self.empty((nbytes,), "uint8")).cast("B")  # type: ignore[arg-type]  # (an ndarray is a buffer)

    def _take(self, nbytes: int) -> np.ndarray | None:
        """The best free buffer for `nbytes`, removed from the list; drops free buffers over the limit (lock held)."""
        best = -1
        free_bytes = 0
        free: list[int] = []
        buffers = self._buffers
        for i in range(len(buffers)):
            # references when free: the list's and getrefcount's argument (no local name on purpose)
            if sys.getrefcount(buffers[i]) > 2:
                continue
            size = buffers[i].nbytes
            free.append(i)
            free_bytes += size
            if size * MIN_FILL <= nbytes <= size and (best < 0 or size < buffers[best].nbytes):
                best = i
        taken = self._buffers[best] if best >= 0 else None
        drop = set()
        if taken is not None:
            free_bytes -= taken.nbytes
            drop.add(best)
        for i in free:  # oldest first
            if free_bytes <= self.limit:
                break
            if i not in drop:
                drop.add(i)
                free_bytes -= self._buffers[i].nbytes
        if drop:
            self._buffers = [b for i, b in enumerate(self._buffers) if i not in drop]
        return taken

    def clear(self) -> None:
        """Forget every buffer (those in use stay with their users)."""
        with self._lock:
            self._buffers = []


POOL = BufferPool()
