"""One storage layer over tensorstore's kvstore drivers.

A Storage is a checkpoint root (a local directory, file://, gs://, s3:// or
memory://) seen as a flat key space: list keys, read a value or a byte range,
ask a value's size. Every reader goes through it, so the rule that no key
may leave the root (`..`, absolute keys, symlinks pointing out, FIFOs and
other non-files) is enforced here, once.

`Storage.ocdbt()` gives the same interface over an OCDBT database (Orbax's
key space inside `manifest.ocdbt` + data files), so readers handle OCDBT and
plain directories alike.

The package is cut where a local root and a remote one differ; each part
knows nothing of the others' cases, and Storage picks the part a key needs:

  core.py         Storage (with ReadLog, PendingReads and the tensorstore contexts)
  containment.py  local roots: keys, symlinks and special files that would leave the root
  local.py        local files read by pread/preadv, written by pwritev (LocalFileWriter), fsynced
  remote.py       paths and URLs as kvstore specs; remote stores' retries, deadlines, fail-fast and
                  preflight checks; tensorstore's errors worded as one line
  nativelog.py    the C++ libraries' log lines dropped from stderr once a remote store is opened
"""
from __future__ import annotations

from .containment import check_local_path
from .core import _CONTEXT, PendingReads, ReadLog, Storage
from .local import LocalFileWriter
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
    "IO_RETRIES", "IO_TIMEOUT", "LocalFileWriter", "PendingReads", "ReadLog", "Storage", "check_local_path",
    "check_url", "local_path", "ocdbt_truncated_message", "quiet_native_logs", "raise_if_unavailable",
    "ts_error_text",
]
# private names other modules and tests import from here: _CONTEXT (one context for every open),
# _kvstore_spec (output.py), _forward_stderr (the stderr filter's test)
