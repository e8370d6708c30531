"""Ranged reads of gs:// objects straight into the caller's buffer, over kept-alive HTTP connections.

Why not tensorstore's `gcs` driver for these. A stored chunk read through it (kvstore.read with a
byte range) is received by curl on tensorstore's HTTP threads in 16 KiB writes appended to an
absl::Cord, then copied into a std::string and again into Python bytes: three copies of every byte
in the process, plus fresh pages for each, and the receive loop's wake-ups. Reading the 946 MiB of
remote_bench's 1 GiB Orbax source as 8 MB ranges, 8 in flight, against fake-gcs-server on 127.0.0.1:
tensorstore took 0.83-1.2 CPU-seconds in ckpt's process (1.3-1.4 s wall), for any
TENSORSTORE_HTTP_THREADS from 1 to 16; http.client reading each answer into its buffer
(recv_into: the kernel's copy only) took 0.28-0.31 CPU-seconds (0.65-0.73 s wall), the server's own
CPU the same (0.4-0.5 s) either way. On the bench's 2 cores, shared with the server, that CPU is
what decides how close a `validate --deep` or a reshard from gs:// gets to the same command on a
local copy. tensorstore's Python API has no read into a given buffer.

What goes here: the bulk reads of data only, of MIN_BYTES and more (an OCDBT value a reader decodes,
read into a pooled buffer; a DCP or safetensors range read into its tensor), and only an answer that is exactly the
bytes asked for. Anything else returns False and the caller reads through tensorstore as before,
whose errors ckpt words as always (missing, truncated, access denied, 429/5xx retried, a dead
endpoint after CKPT_IO_RETRIES attempts): a status other than 206 (200 for the whole object), a
body of another length, a connection that fails twice (a kept-alive one the server closed is tried
once more on a new one), an HTTP proxy in the environment (curl's business), credentials not found.
So errors have one code path, and a fault costs at most one extra request. The one failure said
here is an endpoint that accepts but does not answer within the deadline (CKPT_IO_TIMEOUT, plus a
second per MiB): the same line as such a read through tensorstore, and the rest of the run fails
fast on that endpoint (remote.raise_if_unavailable).

The request is the one tensorstore's driver makes (`GET {endpoint}/storage/v1/b/B/o/NAME?alt=media`
with a `Range` header), to TENSORSTORE_GCS_HTTP_URL or https://storage.googleapis.com, with the
token gcs_verify finds as tensorstore finds its own; https verifies against the system's CAs or
TENSORSTORE_CA_BUNDLE / TENSORSTORE_CA_PATH. CKPT_GCS_DIRECT_READS=0 reads everything through
tensorstore (the bench's A/B).
"""
from __future__ import annotations

import http.client
import os
import socket
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..base.errors import CkptError
from .kept_alive import KeptAlive

# smaller reads go through tensorstore: its requests cost less CPU each (20,000 ranged reads of 32 KiB:
# 4.8 CPU-seconds through tensorstore, 5.8 here, http.client's header parsing), and their copies little
MIN_BYTES = 256 << 10
# ranges read by one request; a larger read goes as pieces of this size in flight together (one
# stream of an object store moves far less than the link does: kvstore_backend.RANGE_PIECE)
PIECE = 16 * 2**20
# the threads reading the pieces of large reads after their first (each on a connection of its own)
_PIECE_WORKERS = 8


def enabled() -> bool:
    """Whether gs:// data reads go here (CKPT_GCS_DIRECT_READS=0: through tensorstore)."""
    return os.environ.get("CKPT_GCS_DIRECT_READS", "1").strip().lower() not in ("0", "false", "no", "off")


# kept-alive connections not in use, per endpoint: any reader thread takes one
_pool = KeptAlive()
_lock = threading.Lock()
# endpoint -> (scheme, host:port, path prefix), or None where curl must do it (a proxy, another scheme)
_targets: dict[str, tuple[str, str, str] | None] = {}
_pieces: ThreadPoolExecutor | None = None


def _target(endpoint: str) -> tuple[str, str, str] | None:
    with _lock:
        if endpoint in _targets:
            return _targets[endpoint]
    from .remote import _proxied

    parts = urllib.parse.urlsplit(endpoint)
    usable = parts.scheme in ("http", "https") and parts.hostname and not _proxied(parts.hostname)
    target = (parts.scheme, parts.netloc, parts.path.rstrip("/")) if usable else None
    with _lock:
        _targets[endpoint] = target
    return target


_ssl_context: Any = None


def _connect(scheme: str, netloc: str, timeout: float) -> http.client.HTTPConnection:
    global _ssl_context
    if scheme == "https":
        import ssl

        with _lock:  # one context for every connection: loading the CAs costs milliseconds each time
            if _ssl_context is None:
                _ssl_context = ssl.create_default_context(cafile=os.environ.get("TENSORSTORE_CA_BUNDLE") or None,
                                                          capath=os.environ.get("TENSORSTORE_CA_PATH") or None)
        return http.client.HTTPSConnection(netloc, timeout=timeout, context=_ssl_context)
    return http.client.HTTPConnection(netloc, timeout=timeout)


def request_target(endpoint: str) -> tuple[tuple[str, str, str], dict[str, str]] | None:
    """Where ckpt's own requests to `endpoint` go (scheme, host:port, path prefix) and their
    authorization header; None where tensorstore must make them (a proxy, another scheme, no
    credentials found: tensorstore finds them or says why not). A dead endpoint raises its one line."""
    target = _target(endpoint)
    if target is None:
        return None
    from . import gcs_verify
    from .remote import raise_if_unavailable

    raise_if_unavailable(endpoint=endpoint)  # (a dead endpoint: its one line at once)
    try:
        return target, gcs_verify._token.header()
    except CkptError:
        return None


def takes(nbytes: int) -> bool:
    """Whether a read of `nbytes` goes here at all (read_into may still fall back)."""
    return nbytes >= MIN_BYTES and enabled()


def read_into(endpoint: str, bucket: str, name: str, start: int, view: memoryview, where: str) -> bool:
    """Fill `view` with bytes [start, start + len(view)) of object `name`; False when anything but
    exactly those bytes came back (the caller then reads through tensorstore). A large range goes
    as PIECE-sized requests in flight together."""
    n = view.nbytes
    if not takes(n):
        return False
    prepared = request_target(endpoint)
    if prepared is None:
        return False
    target, auth = prepared
    path = f"{target[2]}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/{urllib.parse.quote(name, safe='')}?alt=media"
    if n <= PIECE:
        return _get(endpoint, target, path, auth, start, view, where)
    global _pieces
    with _lock:
        if _pieces is None:
            _pieces = ThreadPoolExecutor(_PIECE_WORKERS, thread_name_prefix="ckpt-gcs-piece")
        pool = _pieces
    # the first piece in this thread, the others on the pool (its workers bound the pieces in
    # flight in the process); every piece is waited for before an error is raised, so none is still
    # writing into the caller's buffer
    futures = [pool.submit(_get, endpoint, target, path, auth, start + a, view[a:a + PIECE], where)
               for a in range(PIECE, n, PIECE)]
    results: list[bool | BaseException] = []
    for step in [None, *futures]:
        try:
            results.append(_get(endpoint, target, path, auth, start, view[:PIECE], where) if step is None
                           else step.result())
        except BaseException as exc:  # noqa: BLE001 - raised once every piece is done
            results.append(exc)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return all(results)


def _get(endpoint: str, target: tuple[str, str, str], path: str, auth: dict[str, str], start: int,
         view: memoryview, where: str) -> bool:
    """One ranged GET into `view` (see read_into)."""
    from .remote import _deadline, no_answer

    n = view.nbytes
    timeout = _deadline(n)
    headers = {**auth, "Range": f"bytes={start}-{start + n - 1}"}
    scheme, netloc, _ = target
    for fresh in (False, True):
        try:
            conn, reused = _pool.take(endpoint, lambda: _connect(scheme, netloc, timeout), timeout, fresh=fresh)
        except OSError:  # (TENSORSTORE_CA_BUNDLE unreadable, say: tensorstore says it)
            return False
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            exact = (resp.status == 206 and (resp.getheader("Content-Range") or "").startswith(f"bytes {start}-{start + n - 1}/")
                     ) or (resp.status == 200 and start == 0)
            if not exact or length != str(n):
                conn.close()  # (its body unread: tensorstore asks again and says what is wrong)
                return False
            got = 0
            while got < n:
                k = resp.readinto(view[got:])
                if not k:
                    break
                got += k
        except (socket.timeout, TimeoutError):
            conn.close()
            raise no_answer("cannot read", endpoint, timeout, where) from None
        except (http.client.HTTPException, OSError):
            conn.close()
            if reused:  # a kept-alive connection the server had closed: once more on a new one
                continue
            return False
        if got != n:
            conn.close()
            return False
        if resp.will_close or not resp.isclosed():
            conn.close()
        else:
            _pool.give(endpoint, conn)
        return True
    return False
