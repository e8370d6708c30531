"""base/checksum.py: CRC-32 as zip / torch.save record it, and put together from pieces read apart."""
from __future__ import annotations

import random
import zlib

from ckpt_tool.base.checksum import CrcTiling, crc32, crc32_combine


def test_crc32_is_zlibs():
    data = random.Random(1).randbytes(100_003)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[50:], crc32(data[:50])) == zlib.crc32(data)
    assert crc32_combine(crc32(data[:7]), crc32(data[7:]), len(data) - 7) == zlib.crc32(data)


def test_tiling_in_any_order_gives_the_whole_ranges_crc():
    rng = random.Random(2)
    data = rng.randbytes(200_000)
    start, end = 1_000, 190_000  # a member inside its archive
    cuts = sorted(rng.sample(range(start + 1, end), 40))
    edges = [start, *cuts, end]
    pieces = list(zip(edges, edges[1:]))
    rng.shuffle(pieces)
    tiling = CrcTiling(start, end)
    results = [tiling.add(a, b, crc32(data[a:b])) for a, b in pieces]
    assert results[:-1] == [None] * (len(pieces) - 1)  # known only once every piece is in
    assert results[-1] == zlib.crc32(data[start:end])


def test_tiling_ignores_re_reads_and_waits_on_gaps():
    data = bytes(range(256)) * 40
    tiling = CrcTiling(0, len(data))
    assert tiling.add(0, 100, crc32(data[:100])) is None
    assert tiling.add(0, 100, crc32(data[:100])) is None  # read twice: counted once
    assert tiling.add(50, 150, crc32(data[50:150])) is None  # overlaps what is counted: ignored
    assert tiling.add(200, len(data), crc32(data[200:])) is None  # a gap at [100, 200)
    assert tiling.add(100, 200, crc32(data[100:200])) == zlib.crc32(data)


def test_tiling_gives_up_past_its_pending_limit():
    tiling = CrcTiling(0, 1000, max_pending=3)
    for a in (100, 200, 300, 400):
        assert tiling.add(a, a + 100, 0) is None
    assert tiling.gave_up
    assert tiling.add(0, 100, 0) is None  # the caller then reads the member once more
