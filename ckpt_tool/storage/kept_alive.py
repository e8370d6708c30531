"""Kept-alive HTTP connections not in use, per endpoint: ckpt's own requests to GCS take one, or open
one, and give it back once its answer was read whole.

Any thread takes any idle connection: the copy and upload threads come and go, and a new connection
per request would cost a TCP (and on GCS a TLS) handshake each. Used by the ranged reads
(gcs_reads.py), the uploads (gcs_uploads.py) and the crc32c checks (gcs_verify.py), each with a pool
of its own.
"""
from __future__ import annotations

import http.client
import threading
from typing import Callable, Hashable


class KeptAlive:
    """The idle connections of each endpoint (any hashable key naming where they go)."""

    def __init__(self) -> None:
        self._idle: dict[Hashable, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def take(self, key: Hashable, connect: Callable[[], http.client.HTTPConnection], timeout: float | None, *,
             fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to `key` (unless `fresh`), its deadline set to `timeout`, else a new one
        from `connect()` (whose errors the caller handles); and whether it was kept alive (the server
        may have closed it meanwhile: the caller tries once more on a fresh one)."""
        conn = None
        if not fresh:
            with self._lock:
                idle = self._idle.get(key)
                conn = idle.pop() if idle else None
        if conn is None:
            return connect(), False
        if timeout is not None:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
        return conn, True

    def give(self, key: Hashable, conn: http.client.HTTPConnection) -> None:
        """`conn` back among the idle ones, its answer read whole."""
        with self._lock:
            self._idle.setdefault(key, []).append(conn)
