"""An OCDBT database (Orbax's key space inside `manifest.ocdbt` + data files) read as a directory.

Point reads go through tensorstore's OCDBT driver, like any kvstore; many keys at once are read by
one walk of the database's B+tree instead (ocdbt_bulk), with the values stored out of line read by
byte range from their data files. A local database of the kind orbax writes (one manifest file, the
root a leaf node: ocdbt_node.single_leaf_manifest) is walked without tensorstore at all, for any
number of keys: its manifest and leaf node are decoded here and read by pread, and tensorstore is
opened (and imported) only for what else is asked of the view (issue 46: `ckpt inspect`). The view is read-only: ckpt writes OCDBT databases whole
(ocdbt_writer.py) or through tensorstore's array writes, never key by key into an existing one.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..base.bufferpool import POOL
from ..base.errors import CkptError, NotFoundError, TruncatedFileError
from . import ocdbt_bulk
from .backend import Backend, Capabilities, Reads, open_kvstore
from .ocdbt_node import LeafNode, Location, ManifestRoot, OcdbtNodeError, single_leaf_manifest
from .kvstore_backend import RANGE_PIECE, KvstoreBackend, range_pieces
from .remote import ocdbt_truncated_cause, ocdbt_truncated_message

if TYPE_CHECKING:
    import tensorstore as ts

# what an OCDBT view's url adds to its database directory's
_OCDBT_SUFFIX = " (ocdbt)"

class OcdbtBackend(KvstoreBackend):
    """The OCDBT database whose manifest lies at the root of `base`, or a key prefix of it."""

    _OPEN_WHAT = "cannot open OCDBT database"

    def __init__(self, kvstore: ts.KvStore | None, url: str, spec: dict[str, Any], base: Backend, prefix: str = "",
                 local_root: ManifestRoot | None = None) -> None:
        super().__init__(kvstore, url, spec)
        # the root holding the database's manifest and data files, and this view's key prefix in it
        self.base = base
        self.prefix = prefix
        # a local database walked without tensorstore: its manifest's root leaf (see the module docstring)
        self.local_tree = local_root

    @classmethod
    def open_database(cls, base: Backend) -> OcdbtBackend:
        """The database whose manifest lies at the root of `base` (already guarded by the caller)."""
        spec = {"driver": "ocdbt", "base": base.spec}
        local = _local_manifest(base)
        if local is not None:  # tensorstore opens it when something else is asked (Backend.kvstore)
            return cls(None, base.url + _OCDBT_SUFFIX, spec, base, local_root=local)
        kv = open_kvstore(spec, base.url, "cannot open OCDBT database")
        return cls(kv, base.url + _OCDBT_SUFFIX, spec, base)

    def _open_url(self) -> str:
        return self.base.url  # (as open_database names it)

    @property
    def kind(self) -> str:
        return "ocdbt"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(writable=False, local_files=False, symlinks=False,
                            deadlines=self.endpoint is not None, bulk_reads=True)

    def child(self, rel: str) -> OcdbtBackend:
        kvstore = self._kvstore / (rel + "/") if self._kvstore is not None else None  # else opened when used
        return OcdbtBackend(kvstore, f"{self.url}/{rel}", self.spec_for(rel + "/"),
                            self.base, self.prefix + rel + "/", self.local_tree)

    def start_reads(self, rels: dict[str, str]) -> Reads:
        # (a local leaf-rooted database: a walk of its one node, whatever the number of keys)
        if self.local_tree is not None or len(rels) >= ocdbt_bulk.BULK_MIN_KEYS:
            return OcdbtBulkReads(self, rels)
        return super().start_reads(rels)

    def locate_values(self, rels: list[str]) -> dict[str, bytes | ocdbt_bulk.IndirectValue]:
        """Each present key's value if stored in line, else where it lies (read it with read_located),
        by one walk of the B+tree; absent keys are left out."""

        def wait(future: Any) -> Any:
            return self.wait(future, "cannot read OCDBT B+tree", self.url)

        keys = [self.prefix + rel for rel in rels]
        try:
            if self.local_tree is not None:
                inline, indirect = self._local_keys(self.local_tree, keys)
            else:
                inline, indirect = ocdbt_bulk.read_keys(self.base.kvstore, keys, wait)
        except (ocdbt_bulk.OcdbtTreeError, OcdbtNodeError) as exc:
            raise CkptError(f"cannot read OCDBT B+tree: {exc}", self.url) from None
        cut = len(self.prefix)
        out: dict[str, bytes | ocdbt_bulk.IndirectValue] = {k[cut:]: v for k, v in inline.items()}
        out.update((k[cut:], v) for k, v in indirect.items())
        return out

    def _local_keys(self, tree: ManifestRoot, keys: list[str]
                    ) -> tuple[dict[str, bytes], dict[str, ocdbt_bulk.IndirectValue]]:
        """ocdbt_bulk.read_keys of a local leaf-rooted database: its root leaf read by pread and
        decoded here (the same decoder, the same errors for a node cut short or damaged)."""
        where: Location = tree.root
        short = f"B+tree node {where.path} [{where.offset}, +{where.length}) holds {{}} bytes"  # (as read_leaf says it)
        try:
            raw = self.base.read(where.path, slice(where.offset, where.offset + where.length))
        except TruncatedFileError as exc:  # the file cut short, in the words tensorstore's read gets (remote.py)
            local = self.base.local_root
            raise TruncatedFileError(ocdbt_truncated_message(exc.size, where.offset + where.length),
                                     os.path.join(local, where.path) if local else self.base.where(where.path),
                                     size=exc.size, cause=ocdbt_truncated_cause(exc.size)) from None
        except NotFoundError:
            raise OcdbtNodeError(short.format(0)) from None
        node = LeafNode(raw, where, max_decoded=ocdbt_bulk.decoded_limit({"max_decoded_node_bytes": tree.max_decoded_node_bytes}))
        found: dict[str, bytes] = {}
        indirect: dict[str, ocdbt_bulk.IndirectValue] = {}
        for key, value in node.lookup({k.encode() for k in keys}).items():
            if isinstance(value, ocdbt_bulk.IndirectValue):
                indirect[key.decode()] = value
            else:
                found[key.decode()] = value
        return found, indirect

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
                if pooled:  # into a reused buffer (base/bufferpool.py): fresh memory faults on every page
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
        if pooled and isinstance(self.base, KvstoreBackend):
            # on gs://, each value by ranged GETs into a pooled buffer (gcs_reads.py); what they do
            # not read goes through tensorstore below, which says what is wrong
            refs = dict(refs)
            for key, ref in list(refs.items()):
                if not self.base.reads_direct(ref.length):  # (s3://, a small value): no buffer taken
                    continue
                buf = POOL.bytes(ref.length)
                if self.base.read_direct(ref.path, ref.offset, buf):
                    out[key] = buf
                    del refs[key]
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


def _local_manifest(base: Backend) -> ManifestRoot | None:
    """The root leaf of a local database whose manifest ocdbt_node reads (else None: tensorstore's)."""
    if not base.capabilities.local_files:
        return None
    try:
        raw = base.read("manifest.ocdbt", None)
    except (CkptError, OSError):
        return None  # (tensorstore's open says what is wrong)
    return single_leaf_manifest(raw)


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
