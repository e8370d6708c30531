"""An OCDBT database (Orbax's key space inside `manifest.ocdbt` + data files) read as a directory.

Point reads go through tensorstore's OCDBT driver, like any kvstore; many keys at once are read by
one walk of the database's B+tree instead (ocdbt_bulk), with the values stored out of line read by
byte range from their data files. The view is read-only: ckpt writes OCDBT databases whole
(ocdbt_writer.py) or through tensorstore's array writes, never key by key into an existing one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..bufferpool import POOL
from ..errors import CkptError, NotFoundError, TruncatedFileError
from . import ocdbt_bulk
from .backend import Backend, Capabilities, Reads, open_kvstore
from .kvstore_backend import RANGE_PIECE, KvstoreBackend, range_pieces
from .remote import ocdbt_truncated_cause

if TYPE_CHECKING:
    import tensorstore as ts

# what an OCDBT view's url adds to its database directory's
_OCDBT_SUFFIX = " (ocdbt)"

class OcdbtBackend(KvstoreBackend):
    """The OCDBT database whose manifest lies at the root of `base`, or a key prefix of it."""

    def __init__(self, kvstore: ts.KvStore, url: str, spec: dict[str, Any], base: Backend, prefix: str = "") -> None:
        super().__init__(kvstore, url, spec)
        # the root holding the database's manifest and data files, and this view's key prefix in it
        self.base = base
        self.prefix = prefix

    @classmethod
    def open_database(cls, base: Backend) -> OcdbtBackend:
        """The database whose manifest lies at the root of `base` (already guarded by the caller)."""
        spec = {"driver": "ocdbt", "base": base.spec}
        kv = open_kvstore(spec, base.url, "cannot open OCDBT database")
        return cls(kv, base.url + _OCDBT_SUFFIX, spec, base)

    @property
    def kind(self) -> str:
        return "ocdbt"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(writable=False, local_files=False, symlinks=False,
                            deadlines=self.endpoint is not None, bulk_reads=True)

    def child(self, rel: str) -> OcdbtBackend:
        return OcdbtBackend(self.kvstore / (rel + "/"), f"{self.url}/{rel}", self.spec_for(rel + "/"),
                            self.base, self.prefix + rel + "/")

    def start_reads(self, rels: dict[str, str]) -> Reads:
        if len(rels) >= ocdbt_bulk.BULK_MIN_KEYS:
            return OcdbtBulkReads(self, rels)
        return super().start_reads(rels)

    def locate_values(self, rels: list[str]) -> dict[str, bytes | ocdbt_bulk.IndirectValue]:
        """Each present key's value if stored in line, else where it lies (read it with read_located),
        by one walk of the B+tree; absent keys are left out."""

        def wait(future: Any) -> Any:
            return self.wait(future, "cannot read OCDBT B+tree", self.url)

        try:
            inline, indirect = ocdbt_bulk.read_keys(self.base.kvstore, [self.prefix + rel for rel in rels], wait)
        except ocdbt_bulk.OcdbtTreeError as exc:
            raise CkptError(f"cannot read OCDBT B+tree: {exc}", self.url) from None
        cut = len(self.prefix)
        out: dict[str, bytes | ocdbt_bulk.IndirectValue] = {k[cut:]: v for k, v in inline.items()}
        out.update((k[cut:], v) for k, v in indirect.items())
        return out

    def read_located(self, refs: dict[str, ocdbt_bulk.IndirectValue], *,
                     pooled: bool = False) -> dict[str, bytes | memoryview]:
        """Out-of-line values, read concurrently by byte range from the data files (relative to the
        database root) the B+tree walk found them in."""
        base_url = self.url[: -len(_OCDBT_SUFFIX)] if self.url.endswith(_OCDBT_SUFFIX) else self.url
        out: dict[str, bytes | memoryview] = {}
        if self.base.capabilities.local_files and len(refs) == 1:
            # one value of a local database (a chunk a reader asked for): by pread. Through the file
            # kvstore, which opens the file per read and hands its buffer over as a copy, 2 GiB of
            # chunks cost 2.9 CPU-seconds here, and far more on a sandboxed kernel (gVisor)
            (key, ref), = refs.items()
            try:
                if pooled:  # into a reused buffer (bufferpool.py): fresh memory faults on every page
                    buf = POOL.bytes(ref.length)
                    self.base.read_into(ref.path, ref.offset, buf)
                    out[key] = buf
                else:
                    out[key] = self.base.read(ref.path, slice(ref.offset, ref.offset + ref.length))
            except TruncatedFileError as exc:  # said in the same words as below
                self._check_length(key, ref, max(0, exc.size - ref.offset), f"{base_url}/{ref.path}")
            except NotFoundError:  # (the file kvstore reads a missing file as empty)
                self._check_length(key, ref, 0, f"{base_url}/{ref.path}")
            return out
        # a large value as several ranged reads in flight together: one stream of an object store
        # moves far less than the link does (on GCS, and through tensorstore's HTTP here)
        futures = {key: [self.base.kvstore.read(ref.path, byte_range=slice(ref.offset + a, ref.offset + b))
                         for a, b in range_pieces(ref.length)]
                   for key, ref in refs.items()}
        for key, pieces in futures.items():
            ref = refs[key]
            where = f"{base_url}/{ref.path}"  # the data file, as validate names it
            parts = []
            for fut in pieces:
                res = self.wait(fut, "cannot read", where, nbytes=min(ref.length, RANGE_PIECE))
                parts.append(bytes(res.value) if res.state == "value" else b"")
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            del parts
            self._check_length(key, ref, len(data), where)
            out[key] = data
        return out

    @staticmethod
    def _check_length(key: str, ref: ocdbt_bulk.IndirectValue, got: int, where: str) -> None:
        """An error unless `got` (the bytes read) is the value's length."""
        if got != ref.length:
            # (a read that ends short ends at the end of the file)
            raise TruncatedFileError(f"value of {key} ({ref.length} bytes at offset {ref.offset}) is cut short: "
                                     f"the data file holds {got} of them", where,
                                     size=ref.offset + got, cause=ocdbt_truncated_cause(ref.offset + got))


class OcdbtBulkReads:
    """Many keys of an OCDBT view, read at `.result()` by one walk of its B+tree (see ocdbt_bulk):
    the answer point reads give, without a point read per key."""

    def __init__(self, view: OcdbtBackend, rels: dict[str, str]) -> None:
        self._view = view
        self._rels = rels

    def result(self) -> dict[str, bytes | None]:
        located = self._view.locate_values(list(self._rels.values()))
        # values stored out of line: read from their data files where the walk found them
        refs = {rel: v for rel, v in located.items() if isinstance(v, ocdbt_bulk.IndirectValue)}
        read = self._view.read_located(refs) if refs else {}
        out: dict[str, bytes | None] = {}
        for key, rel in self._rels.items():
            value = read[rel] if rel in read else located.get(rel)
            out[key] = value if isinstance(value, bytes) else None
        return out
