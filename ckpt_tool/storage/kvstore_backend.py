"""Object and memory stores (s3://, gs://, memory://) read and written through a tensorstore kvstore.

Every request goes through tensorstore, under the remote deadline (Backend.wait). A kvstore has no
stat: a value's size comes from a byte range past its end, whose refusal states the size (S3's
<ActualObjectSize>, the memory driver), and a range past the end of a shorter value is worded as a
local file's would be.

GCS refuses such a range with a bare 416, and tensorstore's drivers return no object metadata. The
size is then found by one-byte reads, each asking whether byte N exists (size_by_probes): a round
of them in flight together, never the value itself. Reading the whole value instead (as this did
before) held every data file of a checkpoint in memory at once: a shallow `validate` of a 350 MiB
Orbax checkpoint on gs:// peaked at 1 GiB.

On gs://, data read into a buffer (read_into, an OCDBT view's located values) goes by plain ranged
GETs straight into it (gcs_reads.py), tensorstore answering what they do not. A whole value written to
gs:// goes by one plain upload from ckpt's buffer (gcs_uploads.py: no copy in the process, and the
answer's CRC-32C and size are compared with what was sent); one that goes through tensorstore
instead is checked once stored (gcs_verify.py): tensorstore sends GCS no checksum with an upload and
compares none, so the CRC-32C of the bytes sent is compared with the one GCS reports.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from ..base.errors import CkptError, StorageUnavailableError
from .backend import Backend, Capabilities, missing, open_kvstore
from .remote import _SIZE_IN_ERROR, _TRANSPORT, _text

# far past the end of any value: the driver's refusal names the value's size
_PROBE = slice(1 << 62, (1 << 62) + 1)
# one-byte reads in flight together per round of a size search: the first round brackets the size
# between powers of 4 (31 reads cover up to 4 EiB), each later one cuts the bracket 32-fold
# (a 1 GiB value: 7 rounds after the first)
_PROBES_PER_ROUND = 31
# a large value is read from an object store as ranged reads of at most this many bytes, several in
# flight together: one stream of an object store moves far less than the link does (on GCS, and
# through tensorstore's HTTP here)
RANGE_PIECE = 16 * 2**20
# pieces of one read_into in flight at once: each holds its bytes until copied into the caller's
# buffer, so this bounds what one large read adds to memory (4 x 16 MiB)
_PIECES_IN_FLIGHT = 4


def range_pieces(length: int) -> list[tuple[int, int]]:
    """[start, stop) of each ranged read of a `length`-byte value (one for a small one)."""
    return [(a, min(length, a + RANGE_PIECE)) for a in range(0, length, RANGE_PIECE)] or [(0, 0)]


class KvstoreBackend(Backend):
    """A root on a tensorstore kvstore other than a local directory (s3, gcs, memory drivers)."""

    @classmethod
    def open(cls, spec: dict[str, Any], url: str) -> KvstoreBackend:
        """The root at `url` (its kvstore `spec`), opened under the remote checks."""
        return cls(open_kvstore(spec, url), url, spec)

    @property
    def kind(self) -> str:
        return str(self.spec.get("driver", "kvstore"))

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(writable=True, local_files=False, symlinks=False,
                            deadlines=self.endpoint is not None, bulk_reads=False)

    def child(self, rel: str) -> KvstoreBackend:
        return type(self)(self.kvstore / (rel + "/"), f"{self.url}/{rel}", self.spec_for(rel + "/"))

    def exists(self, rel: str) -> bool:
        try:
            res = self.wait_raw(self.kvstore.read(rel, byte_range=slice(0, 0)), "cannot read", self.where(rel))
        except StorageUnavailableError:
            raise
        except Exception as exc:
            if isinstance(exc, CkptError) or not _TRANSPORT.search(_text(exc)):
                return True  # it exists but is shorter than the probe: still exists
            raise self.error(exc, "cannot read", self.where(rel)) from exc
        return bool(res.state == "value")

    def read(self, rel: str, byte_range: slice | None) -> bytes:
        fut = self.kvstore.read(rel) if byte_range is None else self.kvstore.read(rel, byte_range=byte_range)
        return self._value(fut, rel, byte_range)

    @property
    def _gcs(self) -> tuple[str, str, str] | None:
        """(endpoint, bucket, object name prefix) of a gs:// root, for ckpt's own requests to GCS
        (gcs_reads.py, gcs_uploads.py); None for any other store."""
        if self.spec.get("driver") != "gcs" or self._endpoint is None:
            return None
        return self._endpoint, str(self.spec["bucket"]), str(self.spec.get("path", ""))

    def reads_direct(self, nbytes: int) -> bool:
        """Whether read_direct would try a read of `nbytes` (a caller need not fill a buffer for one
        that goes through tensorstore)."""
        if self._gcs is None:
            return False
        from . import gcs_reads

        return gcs_reads.takes(nbytes)

    def read_direct(self, rel: str, start: int, view: memoryview) -> bool:
        """On gs://, fill `view` from offset `start` by ranged GETs straight into it (gcs_reads.py:
        a third of the CPU tensorstore's reads take); False where that does not apply or did not
        give exactly those bytes (the caller then reads through tensorstore, which says why)."""
        gcs = self._gcs
        if gcs is None:
            return False
        from . import gcs_reads

        endpoint, bucket, prefix = gcs
        return gcs_reads.read_into(endpoint, bucket, prefix + rel, start, view, self.where(rel))

    def read_into(self, rel: str, start: int, view: memoryview) -> None:
        """Fill `view` from offset `start`: a large range as pieces in flight together, each copied
        into place as it lands (never the whole range held twice)."""
        if self.read_direct(rel, start, view):
            return
        pieces = range_pieces(view.nbytes)
        if len(pieces) == 1:
            view[:] = self.read(rel, slice(start, start + view.nbytes))
            return
        pending: deque[tuple[int, int, Any]] = deque()
        for a, b in pieces:
            pending.append((a, b, self.kvstore.read(rel, byte_range=slice(start + a, start + b))))
            if len(pending) >= _PIECES_IN_FLIGHT:
                a, b, fut = pending.popleft()
                view[a:b] = self._value(fut, rel, slice(start + a, start + b))
        while pending:
            a, b, fut = pending.popleft()
            view[a:b] = self._value(fut, rel, slice(start + a, start + b))

    def _value(self, future: Any, rel: str, byte_range: slice | None) -> bytes:
        """What a read of `rel` (all of it, or `byte_range`) returned; a range the value is too short
        for is named as a local file's would be."""
        where = self.where(rel)
        try:
            res = self.wait_raw(future, "cannot read", where,
                                nbytes=0 if byte_range is None else byte_range.stop - byte_range.start)
        except ValueError as exc:
            msg = str(exc)
            if "OUT_OF_RANGE" in msg and byte_range is not None:
                m = _SIZE_IN_ERROR.search(msg)
                have = f"it has {m.group(1)} bytes" if m else "it is shorter"
                raise CkptError(f"truncated: needed bytes [{byte_range.start}, {byte_range.stop}) but {have}",
                                where) from exc
            raise self.error(exc, "cannot read", where) from exc
        if res.state != "value":
            raise missing(where)
        return bytes(res.value)

    def size(self, rel: str) -> int | None:
        """The value's size, from a refused read past its end, else by one-byte probes (never by
        reading the value)."""
        where = self.where(rel)
        try:
            res = self.wait_raw(self.kvstore.read(rel, byte_range=_PROBE), "cannot read", where)
        except ValueError as exc:
            m = _SIZE_IN_ERROR.search(str(exc))
            if m:
                return int(m.group(1))
            if _TRANSPORT.search(_text(exc)) or "OUT_OF_RANGE" not in str(exc):
                raise self.error(exc, "cannot read", where) from exc
            return self.size_by_probes(rel)
        if res.state != "value":
            raise missing(where)
        return None  # (a value over 4 EiB: the store answered a read past any real size)

    def shortfall(self, rel: str, need: int) -> int | None:
        """One one-byte read at `need` - 1 (its answer is the whole question); the size is searched
        for only when the value is short."""
        where = self.where(rel)
        if need <= 0:
            if not self.exists(rel):
                raise missing(where)
            return None
        if self._byte_present(self.kvstore.read(rel, byte_range=slice(need - 1, need)), where):
            return None
        size = self.size(rel)
        return self.size_by_probes(rel) if size is None else size

    def size_by_probes(self, rel: str) -> int:
        """The value's size found by rounds of one-byte reads in flight together (a byte at offset N
        exists iff the size is over N): first at 4^k - 1, then evenly across the bracket left."""
        where = self.where(rel)
        lo, hi = 0, 1 << 62  # the size is in [lo, hi]
        offsets = [4**k - 1 for k in range(_PROBES_PER_ROUND)]
        while lo < hi:
            futures = [(o, self.kvstore.read(rel, byte_range=slice(o, o + 1))) for o in offsets]
            for offset, future in futures:
                if self._byte_present(future, where):
                    lo = max(lo, offset + 1)
                else:
                    hi = min(hi, offset)
            step = max(1, -(-(hi - lo) // (_PROBES_PER_ROUND + 1)))
            offsets = list(range(lo + step - 1, hi, step))[:_PROBES_PER_ROUND] if hi - lo > 1 else [lo]
            if lo == hi:
                break
        return lo

    def _byte_present(self, future: Any, where: str) -> bool:
        """Whether a one-byte read found its byte (False: the value ends before it)."""
        try:
            res = self.wait_raw(future, "cannot read", where)
        except ValueError as exc:
            if "OUT_OF_RANGE" in str(exc) and not _TRANSPORT.search(_text(exc)):
                return False
            raise self.error(exc, "cannot read", where) from exc
        if res.state != "value":
            raise missing(where)
        return True

    def write(self, rel: str, data: bytes | bytearray) -> None:
        """Backend.write. On gs://, one plain upload from `data` whose answer's CRC-32C and size are
        compared with what was sent (gcs_uploads.py); where that does not apply, through tensorstore,
        then the stored object's CRC-32C and size asked for (one metadata request, in the writing
        thread: other uploads stay in flight meanwhile)."""
        from . import gcs_uploads, gcs_verify

        gcs = self._gcs
        if gcs is not None and gcs_uploads.upload(gcs[0], gcs[1], gcs[2] + rel, data, self.where(rel)):
            return  # (one plain POST from `data` itself, checked against its answer: gcs_uploads.py)
        if self.spec.get("driver") != "gcs" or not gcs_verify.enabled():
            super().write(rel, data)
            return
        fut = self.kvstore.write(rel, data)  # type: ignore[arg-type]  # any buffer; the stubs say bytes

        def hold(_future: Any, _keep: bytes | bytearray = data) -> None:  # (see Backend.write)
            pass

        fut.add_done_callback(hold)
        from ..base.checksum import crc32c

        sent = crc32c(data)  # while the upload runs
        where = self.where(rel)
        self.wait(fut, "cannot write", where, nbytes=len(data))
        gcs_verify.check(str(self.spec["bucket"]), str(self.spec.get("path", "")) + rel, sent, len(data), where)

    def stat(self, rel: str) -> tuple[int, float | None]:
        # tensorstore's S3/GCS drivers return no object time (a read's stamp is the time of the read)
        size = self.size(rel)
        return (self.size_by_probes(rel) if size is None else size), None
