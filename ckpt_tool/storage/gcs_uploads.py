"""Whole-object uploads to gs:// by one plain media POST each, checked against the answer's crc32c.

Why not tensorstore's `gcs` driver for these. Its Python binding copies a value into an absl::Cord
before the request, curl then copies it again into its send buffers, and its answer (the object's
metadata, crc32c included) is parsed for the generation alone: ckpt then asked GCS for each
object's crc32c and size by a second request (gcs_verify.py). In a 1 GiB `convert LOCAL gs://DST
--to dcp` to fake-gcs-server on the bench's 2 cores (remote_bench's source, 128 objects of 8 MiB),
bench/sampler.py put 10.4 of the upload threads' 51.8 busy thread-seconds in that second request,
and the server spent 4.5 CPU-seconds per GiB with it against 3.5 without (its file-system backend
reads the whole object back to answer it). Here the body goes from ckpt's own buffer to the socket
(http.client sends a memoryview as it is: the kernel's copy only), its CRC-32C is computed while
the server stores it, and the JSON answer of the upload carries the crc32c and size compared with
what was sent: one request per object, no copy in the process.

The request is the one tensorstore's driver makes (`POST {endpoint}/upload/storage/v1/b/B/o?
uploadType=media&name=NAME`, no precondition: Storage.write replaces any value, as kvstore.write
without `if_equal` does), to TENSORSTORE_GCS_HTTP_URL or https://storage.googleapis.com, with the
token and connections gcs_reads.py uses. The owner record's create-once write (its
`ifGenerationMatch=0`) and the deletes stay with tensorstore.

What happens when. 429 and 5xx answers are retried with backoff (0.25-2 s, CKPT_IO_RETRIES attempts
in all), then one line. An endpoint that accepts but does not answer within the deadline
(CKPT_IO_TIMEOUT, plus a second per MiB) is the same line as through tensorstore, and the rest of
the run fails fast on it. An answer whose crc32c or size is not what was sent is one line naming
the object and both checksums (gcs_verify's words). Anything else unexpected (another status, a
connection that fails twice, an HTTP proxy in the environment, no credentials found) returns False
and the caller uploads through tensorstore as before, which words its errors as always: so a fault
costs at most one extra request, and errors keep one code path. CKPT_GCS_DIRECT_UPLOADS=0 uploads
everything through tensorstore (the bench's A/B).
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import time
import urllib.parse

from ..base.errors import CkptError
from .kept_alive import KeptAlive

# kept-alive connections not in use, per endpoint (apart from the readers': an upload's answer is
# waited for while its connection is out of the pool)
_pool = KeptAlive()


def enabled() -> bool:
    """Whether whole-object writes to gs:// go here (CKPT_GCS_DIRECT_UPLOADS=0: through tensorstore)."""
    return os.environ.get("CKPT_GCS_DIRECT_UPLOADS", "1").strip().lower() not in ("0", "false", "no", "off")


def upload(endpoint: str, bucket: str, name: str, data: bytes | bytearray | memoryview, where: str) -> bool:
    """Store `data` as object `name` of `bucket`, checked (unless CKPT_VERIFY_UPLOADS=0) against the
    crc32c and size of the answer; False when this did not apply or something unexpected came back
    (nothing raised: the caller then writes through tensorstore)."""
    if not enabled():
        return False
    from . import gcs_reads, gcs_verify
    from .remote import IO_RETRIES

    prepared = gcs_reads.request_target(endpoint)
    if prepared is None:
        return False
    target, auth = prepared
    view = memoryview(data).cast("B")
    path = (f"{target[2]}/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?uploadType=media&name="
            f"{urllib.parse.quote(name, safe='')}")
    headers = {**auth, "Content-Type": "application/octet-stream", "Content-Length": str(view.nbytes)}
    verify = gcs_verify.enabled()
    sent: list[int] = []  # the body's CRC-32C, computed once (while the server stores the first attempt)
    delay = 0.25
    for attempt in range(1, IO_RETRIES + 1):
        status, body = _post(endpoint, target, path, headers, view, sent if verify else None, where)
        if status == 200:
            break
        if status not in gcs_verify.RETRIED_STATUSES:
            return False  # (tensorstore uploads it and says what is wrong, as before)
        if attempt == IO_RETRIES:
            raise CkptError(f"cannot write: HTTP {status} from {endpoint}; gave up after {IO_RETRIES} attempts "
                            "(CKPT_IO_RETRIES)", where)
        time.sleep(delay)
        delay = min(2.0, delay * 2)
    if not verify:
        return True
    try:
        doc = json.loads(body)
        crc, size = int.from_bytes(base64.b64decode(doc["crc32c"]), "big"), int(doc["size"])
    except (ValueError, KeyError, TypeError):  # stored, but the answer does not say what: ask for it
        gcs_verify.check(bucket, name, sent[0], view.nbytes, where)
        return True
    if crc != sent[0] or size != view.nbytes:
        raise CkptError(f"upload corrupted: GCS stored crc32c {crc:08x} ({size} bytes), ckpt sent crc32c "
                        f"{sent[0]:08x} ({view.nbytes} bytes)", where)
    return True


def _post(endpoint: str, target: tuple[str, str, str], path: str, headers: dict[str, str], view: memoryview,
          crc: list[int] | None, where: str) -> tuple[int | None, bytes]:
    """One upload request: (status, body of the answer); status None where the connection failed
    (on a fresh connection too: the caller falls back) or the answer was not HTTP."""
    from . import gcs_reads
    from .remote import _deadline, no_answer

    timeout = _deadline(view.nbytes)
    scheme, netloc, _ = target
    for fresh in (False, True):
        try:
            conn, reused = _pool.take(endpoint, lambda: gcs_reads._connect(scheme, netloc, timeout), timeout, fresh=fresh)
        except OSError:
            return None, b""
        try:
            conn.request("POST", path, body=view, headers=headers)  # (a memoryview is sent as it is)
            if crc is not None and not crc:
                from ..base.checksum import crc32c

                crc.append(crc32c(view))  # while the server stores the body
            resp = conn.getresponse()
            body = resp.read()
        except (socket.timeout, TimeoutError):
            conn.close()
            raise no_answer("cannot write", endpoint, timeout, where) from None
        except (http.client.HTTPException, OSError):
            conn.close()
            if reused:  # a kept-alive connection the server had closed: once more on a new one
                continue
            return None, b""
        if resp.will_close:
            conn.close()
        else:
            _pool.give(endpoint, conn)
        return resp.status, body
    return None, b""
