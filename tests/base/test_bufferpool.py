"""ckpt_tool/base/bufferpool.py: a buffer is handed out again only once nothing else refers to it."""
from __future__ import annotations

import numpy as np

from ckpt_tool.base.bufferpool import MIN_BYTES, BufferPool

MiB = 1 << 20


def test_a_buffer_in_use_is_never_handed_out_twice():
    pool = BufferPool(limit=64 * MiB)
    a = pool.empty((MiB,), np.float32)
    view = a[::2]  # a view keeps the buffer in use after `a` is gone
    del a
    b = pool.empty((MiB,), np.float32)
    assert pool.reused == 0
    view[:] = 1.0
    b[:] = 2.0
    assert not np.shares_memory(view, b) and view.sum() == view.size
    del view
    c = pool.empty((MiB,), np.float32)  # now the first buffer is free
    assert pool.reused == 4 * MiB
    assert c.flags.writeable and c.flags.c_contiguous and c.shape == (MiB,) and c.dtype == np.float32
    assert not np.shares_memory(b, c)


def test_a_memoryview_holds_its_buffer_too():
    pool = BufferPool(limit=64 * MiB)
    mv = pool.bytes(3 * MiB)
    data = mv[10:20]
    del mv
    pool.bytes(3 * MiB)
    assert pool.reused == 0
    del data
    pool.bytes(2 * MiB)  # a smaller request fits a free buffer at least twice its size
    assert pool.reused == 2 * MiB


def test_free_buffers_are_kept_up_to_the_limit_and_small_ones_not_at_all():
    pool = BufferPool(limit=8 * MiB)
    arrays = [pool.empty((4 * MiB,), np.uint8) for _ in range(5)]
    del arrays
    pool.empty((MIN_BYTES // 2,), np.uint8)  # below MIN_BYTES: plain numpy, the pool is not asked
    assert len(pool._buffers) == 5
    pool.empty((4 * MiB,), np.uint8)  # takes one free buffer, drops the free ones over 8 MiB
    free = [b for b in pool._buffers if b.nbytes]
    assert sum(b.nbytes for b in free) <= 8 * MiB + 4 * MiB  # (the one just handed out is in use)
    assert pool.reused == 4 * MiB


def test_no_limit_means_no_pooling():
    pool = BufferPool(limit=0)
    a = pool.empty((2 * MiB,), np.uint8)
    del a
    pool.empty((2 * MiB,), np.uint8)
    assert pool.reused == 0 and not pool._buffers
