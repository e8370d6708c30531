"""Object and memory stores (s3://, gs://, memory://) read and written through a tensorstore kvstore.

Every request goes through tensorstore, under the remote deadline (Backend.wait). A kvstore has no
stat: a value's size comes from a byte range past its end, whose refusal states the size, and a
range past the end of a shorter value is worded as a local file's would be.
"""
from __future__ import annotations

from typing import Any

from ..errors import CkptError, StorageUnavailableError
from .backend import Backend, Capabilities, missing, open_kvstore
from .remote import _SIZE_IN_ERROR, _TRANSPORT, _text

# far past the end of any value: the driver's refusal names the value's size
_PROBE = slice(1 << 62, (1 << 62) + 1)


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
        where = self.where(rel)
        try:
            if byte_range is None:
                fut = self.kvstore.read(rel)
            else:
                fut = self.kvstore.read(rel, byte_range=byte_range)
            res = self.wait_raw(fut, "cannot read", where,
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

    def read_into(self, rel: str, start: int, view: memoryview) -> None:
        view[:] = self.read(rel, slice(start, start + view.nbytes))

    def size(self, rel: str) -> int | None:
        where = self.where(rel)
        try:
            res = self.wait_raw(self.kvstore.read(rel, byte_range=_PROBE), "cannot read", where)
        except ValueError as exc:
            m = _SIZE_IN_ERROR.search(str(exc))
            if m:
                return int(m.group(1))
            if _TRANSPORT.search(_text(exc)):
                raise self.error(exc, "cannot read", where) from exc
            return None
        if res.state != "value":
            raise missing(where)
        return None

    def stat(self, rel: str) -> tuple[int, float | None]:
        # tensorstore's S3/GCS drivers return no object time (a read's stamp is the time of the read)
        size = self.size(rel)
        return (len(self.read(rel, None)) if size is None else size), None
