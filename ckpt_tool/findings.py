"""Findings: what `ckpt validate` reports, with stable codes.

A check never raises on damage it can describe: it adds a Finding (severity,
code, leaf and/or file, and a message a person can act on) and goes on, so
one run lists every problem. The codes are a contract for CI scripts; the
README lists them from CODES.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

ERROR = "error"
WARNING = "warning"

# code -> what it means (documented in the README; tests check they match)
CODES: dict[str, str] = {
    "uncommitted-save": "an interrupted or unfinished save: tmp directory name, no commit marker or no commit timestamp",
    "no-commit-marker": "a committed Orbax step on gs:// without commit_success.txt, which orbax needs there to restore it",
    "missing-metadata": "a metadata file the format needs is absent (_METADATA, .zarray, zarr.json, DCP .metadata)",
    "bad-metadata": "a metadata file that cannot be parsed or contradicts itself",
    "bad-array-metadata": ".zarray / zarr.json unreadable or disagreeing with _METADATA or array_metadatas",
    "bad-sharding": "_sharding inconsistent with the array (shape not divisible, mesh and device ids disagree)",
    "leaf-missing": "a leaf named in the tree metadata has no stored array (or a stored array is not in the tree)",
    "missing-chunk": "a chunk of an array's chunk grid is not stored; a restore may fill it with zeros",
    "empty-chunk": "a stored chunk with no bytes",
    "lost-process-data": "an OCDBT manifest or data file is missing or shorter than the manifest says",
    "unmerged-ocdbt": "per-process OCDBT databases without a root manifest (the merge step did not run; orbax cannot restore it)",
    "empty-file": "a data file with no bytes while the metadata places items in it",
    "truncated-file": "a data file shorter than offset+length of an item stored in it",
    "missing-file": "a data file the metadata refers to does not exist",
    "coverage-gap": "part of a tensor is covered by no chunk (restored values there are undefined)",
    "chunk-overlap": "two chunks of a tensor cover the same elements",
    "duplicate-mismatch": "copies of a replicated duplicate chunk that hold different bytes (--deep)",
    "chunk-out-of-bounds": "a chunk extends past the tensor's shape",
    "missing-storage-entry": "a chunk without a storage entry saying where its bytes are",
    "orphan-storage-entry": "a storage entry that belongs to no chunk or item",
    "stray-file": "a data file no metadata refers to, or a leftover temporary file",
    "unsafe-pickle": "a pickle that refers to a global outside the allow-list; refused, nothing ran",
    "path-escape": "a stored path that leaves the checkpoint (.., absolute, symlink out, not a regular file)",
    "bad-chunk": "a chunk that does not decode, or decodes to the wrong size or dtype (--deep)",
    "non-finite": "a float array holding NaN or Inf values (--deep)",
    "no-steps": "a CheckpointManager root with no committed step",
    "stale-temporary": "a temporary output (.NAME.ckpt-tmp-*) of a ckpt convert/reshard whose run is gone (warning)",
    "digest-mismatch": "a file (or, with per-tensor digests, a tensor) whose sha256 differs from its integrity manifest's (--deep, manifest verify)",
    "size-mismatch": "a file whose size differs from the one its integrity manifest records",
    "unlisted-file": "a file of the checkpoint its integrity manifest does not name: added later, not protected by it (warning)",
}


@dataclass(frozen=True)
class Finding:
    severity: str  # ERROR | WARNING
    code: str
    message: str
    leaf: str | None = None
    file: str | None = None

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "severity": self.severity, "code": self.code, "leaf": self.leaf,
            "file": self.file, "message": self.message,
        }


# findings of one severity and code for one leaf past this many are counted,
# not listed: a tensor claiming 2^62 chunks must not print 2^62 lines
MAX_PER_LEAF = 50


@dataclass
class Findings:
    """An append-only collector the checks share (thread-safe: --deep adds from workers).

    Per leaf, the first MAX_PER_LEAF findings of each (severity, code) are
    kept; the rest are counted in one closing finding "... and N more".
    """

    items: list[Finding] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)
    # (severity, code, leaf) -> [findings seen, index of the "and N more" item or -1]
    _per_leaf: dict[tuple[str, str, str], list[int]] = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _add(self, finding: Finding) -> None:
        with self._lock:
            if finding.leaf is None:
                self.items.append(finding)
                return
            key = (finding.severity, finding.code, finding.leaf)
            seen = self._per_leaf.setdefault(key, [0, -1])
            seen[0] += 1
            if seen[0] <= MAX_PER_LEAF:
                self.items.append(finding)
                return
            more = seen[0] - MAX_PER_LEAF
            summary = Finding(
                finding.severity, finding.code,
                f"... and {more:,} more {finding.code} finding{'s' if more > 1 else ''} for this leaf (not listed)",
                finding.leaf, None,
            )
            if seen[1] < 0:
                seen[1] = len(self.items)
                self.items.append(summary)
            else:
                self.items[seen[1]] = summary

    def error(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None:
        self._add(Finding(ERROR, code, message, leaf, file))

    def warning(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None:
        self._add(Finding(WARNING, code, message, leaf, file))

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.items if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.items if f.severity == WARNING]


# progress callback: (what, done, total) — the core never prints
Progress = Callable[[str, int, int], None]


def no_progress(what: str, done: int, total: int) -> None:
    return None
