"""CRC-32 (the zip / torch.save checksum) at memory speed, and CRC-32C (OCDBT nodes, zarr v3 shard indexes).

torch.save archives carry a CRC-32 of every member, so converting 2 GiB to
or from DCP checksums 2 GiB. zlib-ng's SIMD crc32 runs at ~25 GB/s here
against ~2 GB/s for the system zlib's, which made the checksum a third of a
convert's CPU time. Both compute the same standard CRC-32.
"""
from __future__ import annotations

from typing import Any, Callable


def _load_crc32(data: Any, value: int = 0) -> int:
    _load()
    return _crc32(data, value)


def _load_crc32_combine(first: int, second: int, second_length: int) -> int:
    _load()
    return _crc32_combine(first, second, second_length)


def _load() -> None:
    """zlib-ng, imported at the first CRC-32 (an Orbax reshard needs only CRC-32C, and zlib-ng
    brings gzip with it): the two names below are rebound to its functions, so no later call
    pays for the import."""
    global _crc32, _crc32_combine
    from zlib_ng.zlib_ng import crc32 as found, crc32_combine as found_combine

    _crc32, _crc32_combine = found, found_combine


_crc32: Callable[[Any, int], int] = _load_crc32
_crc32_combine: Callable[[int, int, int], int] = _load_crc32_combine


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of a bytes-like object, continuing from `value`."""
    return _crc32(data, value)


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of A + B from the CRC-32s of A and B (B of `second_length` bytes):
    pieces of one member read apart (bands, in any order) check it without a second read."""
    return _crc32_combine(first, second, second_length)


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli) by google-crc32c, a megabyte at a time: it takes bytes only, and one
    copy of a whole OCDBT node (tens of MB) would add its size to the peak."""
    import google_crc32c

    view = memoryview(data).cast("B")
    crc = 0
    for i in range(0, len(view), 1 << 20):
        crc = google_crc32c.extend(crc, view[i : i + (1 << 20)].tobytes())
    return crc


class CrcTiling:
    """The CRC-32 of one byte range [start, end), put together from the CRC-32s
    of pieces of it read in any order.

    Pieces that continue the checked prefix extend it; others wait (at most
    `max_pending`, beyond which tiling gives up and the caller falls back to
    reading the range once more). Overlapping pieces that do not continue
    the prefix never extend it.
    """

    def __init__(self, start: int, end: int, max_pending: int = 4096) -> None:
        self.end = end
        self._prefix_end = start
        self._prefix_crc = 0
        self._pending: dict[int, tuple[int, int]] = {}
        self._max_pending = max_pending
        self.gave_up = False

    def add(self, start: int, end: int, crc: int) -> int | None:
        """Add the CRC-32 of [start, end); the CRC-32 of the whole range once it is covered, else None."""
        if self.gave_up or end <= self._prefix_end or start < self._prefix_end:
            return None  # read before (an overlap), or a re-read of what is already counted
        if start > self._prefix_end:
            if len(self._pending) >= self._max_pending:
                self.gave_up, self._pending = True, {}
                return None
            self._pending.setdefault(start, (end, crc))
            return None
        self._prefix_crc = crc32_combine(self._prefix_crc, crc, end - start)
        self._prefix_end = end
        while self._prefix_end in self._pending:
            nxt_end, nxt_crc = self._pending.pop(self._prefix_end)
            self._prefix_crc = crc32_combine(self._prefix_crc, nxt_crc, nxt_end - self._prefix_end)
            self._prefix_end = nxt_end
        return self._prefix_crc if self._prefix_end == self.end else None
