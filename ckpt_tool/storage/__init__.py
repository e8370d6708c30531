"""One storage layer over tensorstore's kvstore drivers.

A Storage is a checkpoint root (a local directory, file://, gs://, s3:// or
memory://) seen as a flat key space: list keys, read a value or a byte range,
ask a value's size. Every reader goes through it, so the rule that no key
may leave the root (`..`, absolute keys, symlinks pointing out, FIFOs and
other non-files) is enforced here, once.

`Storage.ocdbt()` gives the same interface over an OCDBT database (Orbax's
key space inside `manifest.ocdbt` + data files), so readers handle OCDBT and
plain directories alike.

Storage checks keys, remembers listings and logs reads for every kind of
root alike; behind it sits one backend per kind (the interface and what
the kinds share: backend.py), and the suite in tests/storage_suite.py is
what every backend passes:

  core.py             Storage (with ReadLog): one interface over a root, whatever its kind
  backend.py          the Backend ABC, Capabilities, the shared tensorstore contexts, deadlines and point reads
  local_backend.py    a local directory: pread reads, containment, local files for bulk writes
  kvstore_backend.py  s3://, gs://, memory://: tensorstore kvstore requests, sizes by probe
  ocdbt_view.py       an OCDBT database read as a directory, many keys by one walk of its B+tree
  containment.py      local roots: keys, symlinks and special files that would leave the root
  local.py            local files read by pread/preadv, written by pwritev (LocalFileWriter), fsynced
  remote.py           paths and URLs as kvstore specs; remote stores' retries, deadlines, fail-fast and
                      preflight checks; tensorstore's errors worded as one line
  nativelog.py        the C++ libraries' log lines dropped from stderr once a remote store is opened
  ocdbt_bulk.py, ocdbt_node.py  the B+tree walk behind an OCDBT view's bulk reads
  ocdbt_encode.py, ocdbt_writer.py  a new OCDBT database written whole by ckpt (local roots: the
                      Orbax writer's output), B+tree and manifest encoded as tensorstore reads them
  ocdbt_entries.py    every entry of a database, read by ckpt (the Orbax writer's multi-process merge)
"""
from __future__ import annotations

from .containment import check_local_path
from .backend import Backend, Capabilities, PendingReads, Reads
from .core import ReadLog, Storage
from .local import FileCloser, LocalFileWriter, place_range
from .nativelog import _forward_stderr, quiet_native_logs
from .remote import (
    IO_RETRIES,
    IO_TIMEOUT,
    _kvstore_spec,
    check_url,
    local_path,
    ocdbt_truncated_message,
    raise_if_unavailable,
    ts_error_text,
)

__all__ = [
    "Backend", "Capabilities", "Reads", "IO_RETRIES", "IO_TIMEOUT", "FileCloser", "LocalFileWriter", "PendingReads", "ReadLog", "Storage", "check_local_path", "place_range",
    "check_url", "local_path", "ocdbt_truncated_message", "quiet_native_logs", "raise_if_unavailable",
    "ts_error_text",
]
# private names other modules and tests import from here: _CONTEXT (one context for every open,
# made with tensorstore's import when first asked for: __getattr__),
# _kvstore_spec (ops/destination.py), _forward_stderr (the stderr filter's test)


def __getattr__(name: str) -> object:
    if name == "_CONTEXT":
        from .backend import shared_context

        return shared_context()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
