"""What an unfinished huggingface_hub download left in a directory.

`hf download REPO --local-dir DIR` (hf_hub_download / snapshot_download with local_dir) keeps its
bookkeeping in DIR/.cache/huggingface/download/ (huggingface_hub's _local_folder.py): for each file
`X` (a repo path, its directories mirrored there), `X.lock` while it is fetched, `X.metadata` once it
is there, and the bytes in flight in `<h>.<etag>[.<8 hex>].incomplete` beside them, `h` being
urlsafe-base64(sha1("<basename of X>.metadata")) (`_short_hash`; file_download.py's
`_download_to_tmp_and_move` adds the 8 hex digits, unique per process, since huggingface_hub 1.x).
The partial file is renamed to X when the download finishes and removed when it fails in Python;
a killed process (SIGKILL, OOM, a lost node) leaves it. A checkpoint with shards missing beside
one is a download that stopped, not a checkpoint with a wrong index.
"""
from __future__ import annotations

import base64
import posixpath
from dataclasses import dataclass

from ..base.errors import CkptError
from .core import Storage

CACHE_DIR = ".cache"
DOWNLOAD_DIR = ".cache/huggingface/download"
PARTIAL_SUFFIX = ".incomplete"


@dataclass(frozen=True)
class UnfinishedDownload:
    """One partial file of a huggingface_hub download that stopped."""

    partial: str  # the .incomplete file, relative to the checkpoint directory
    size: int | None  # the bytes it holds
    target: str | None  # the repo file it was fetching (relative to the directory), when known
    finished_later: bool  # the target was downloaded since (its .metadata is there): a leftover

    def describe(self) -> str:
        """One sentence for a note or a finding (the partial file's name is the finding's file)."""
        held = f"{self.size:,} bytes" if self.size is not None else "its bytes"
        if self.target is None:
            return f"an unfinished huggingface_hub download ({held} so far): download the repository again"
        if self.finished_later:
            return (f"a leftover of an unfinished huggingface_hub download of {self.target} ({held}), "
                    f"downloaded again since: the partial file can be deleted")
        return f"huggingface_hub's download of {self.target} did not finish ({held} so far): download it again"


def _short_hash(name: str) -> str:
    # huggingface_hub's _local_folder._short_hash, of the metadata file's name
    import hashlib  # (here: every checkpoint opened asks this module, most without a download to name)

    return base64.urlsafe_b64encode(hashlib.sha1(name.encode()).digest()).decode()


def unfinished_downloads(storage: Storage) -> list[UnfinishedDownload]:
    """The partial files of huggingface_hub downloads into this directory, each with the file it was
    fetching where the download's lock names it. Nothing (and no request) unless the directory's
    listing, which every reader has already made, holds `.cache/`."""
    try:
        if CACHE_DIR not in storage.listdir()[0]:
            return []
        keys = storage.list(DOWNLOAD_DIR)
    except (CkptError, OSError):
        return []
    inside = [k[len(DOWNLOAD_DIR) + 1:] for k in keys if k.startswith(DOWNLOAD_DIR + "/")]
    present = set(inside)
    # a file being fetched has its lock; its short hash names the partial file beside it
    by_hash: dict[tuple[str, str], str] = {}
    for key in inside:
        if key.endswith(".lock"):
            target = key[: -len(".lock")]
            folder, base = posixpath.split(target)
            by_hash[(folder, _short_hash(base + ".metadata"))] = target
    out = []
    for key in inside:
        if not key.endswith(PARTIAL_SUFFIX):
            continue
        folder, base = posixpath.split(key)
        fetching = by_hash.get((folder, base.split(".", 1)[0]))
        try:
            size: int | None = storage.size(f"{DOWNLOAD_DIR}/{key}")
        except (CkptError, OSError):
            size = None
        out.append(UnfinishedDownload(f"{DOWNLOAD_DIR}/{key}", size, fetching,
                                      fetching is not None and f"{fetching}.metadata" in present))
    return out
