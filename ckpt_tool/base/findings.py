"""Findings: what `ckpt validate` reports, with stable codes.

A check never raises on damage it can describe: it adds a Finding (severity,
code, leaf and/or file, and a message a person can act on) and goes on, so
one run lists every problem. The codes are a contract for CI scripts; the
README lists them from CODES.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

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
    "unreadable-file": "a data file that is there but cannot be read (permission denied, an I/O error)",
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
    "unfinished-download": "a huggingface_hub download into the directory that did not finish: its partial file (.cache/huggingface/download/*.incomplete) is there (warning)",
    "stale-temporary": "a temporary output (.NAME.ckpt-tmp-*) of a ckpt convert/reshard whose run is gone (warning)",
    "incomplete-save": "a convert/reshard to an object store that has not committed (its owner record .ckpt-owner.json is there: killed, or still writing)",
    "digest-mismatch": "a file (or, with per-tensor digests, a tensor) whose sha256 differs from its integrity manifest's (--deep, manifest verify)",
    "size-mismatch": "a file whose size differs from the one its integrity manifest records",
    "unlisted-file": "a file of the checkpoint its integrity manifest does not name: added later, not protected by it (warning)",
    "device-location": "tensors saved on a device (cuda:0, mps, meta): torch.load needs map_location='cpu' without it (warning)",
}


# findings about a file as a whole: every item stored in it is hurt by the same cause, so a
# file has one of them, with the leaves it affects, not a finding per item or chunk
FILE_CAUSES = frozenset({
    "missing-file", "unreadable-file", "empty-file", "truncated-file", "lost-process-data",
})
# of those, the ones no byte of the file can be read past: any chunk of the file that does
# not decode is one of the leaves the file's finding affects
_WHOLE_FILE = frozenset({"missing-file", "unreadable-file", "empty-file"})
# affected leaves named in the text line of a file's finding (--json lists them all)
_NAMED_LEAVES = 3


@dataclass(frozen=True)
class Finding:
    """One problem found: its severity, code and message, and the leaf or file it is about."""

    severity: str  # ERROR | WARNING
    code: str
    message: str
    leaf: str | None = None
    file: str | None = None
    # a finding about a file (FILE_CAUSES): the leaves stored in it that the cause hurts
    leaves: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "severity": self.severity, "code": self.code, "leaf": self.leaf,
            "file": self.file, "message": self.message,
        }
        if self.leaves:
            out["leaves"] = list(self.leaves)
            out["count"] = len(self.leaves)
        return out


# findings of one severity and code for one leaf past this many are counted,
# not listed: a tensor claiming 2^62 chunks must not print 2^62 lines
MAX_PER_LEAF = 50


class FindingSink(Protocol):
    """What a check reports into: Findings, or a wrapper of it (Megatron's per-rank leaf names)."""

    def error(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None: ...

    def warning(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None: ...

    def count(self, what: str, n: int = 1) -> None: ...


@dataclass
class Findings:
    """An append-only collector the checks share (thread-safe: --deep adds from workers).

    Per leaf, the first MAX_PER_LEAF findings of each (severity, code) are
    kept; the rest are counted in one closing finding "... and N more".
    The first error of FILE_CAUSES about a file is that file's finding: the
    chunks and values that fail because of it (`file_problem`; any chunk of a
    file no byte of which can be read) add their leaf to its `leaves` instead
    of a line each. (Another check's finding about the file keeps its line.)
    """

    _items: list[Finding] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)
    # file -> index in _items of its FILE_CAUSES error; that finding's message before its count
    # of leaves, and the leaves (an ordered set)
    _causes: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    _cause_text: dict[int, str] = field(default_factory=dict, repr=False, compare=False)
    _affected: dict[int, dict[str, None]] = field(default_factory=dict, repr=False, compare=False)
    _stale: set[int] = field(default_factory=set, repr=False, compare=False)
    # (severity, code, leaf) -> [findings seen, index of the "and N more" item or -1]
    _per_leaf: dict[tuple[str, str, str], list[int]] = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def items(self) -> list[Finding]:
        """Every finding so far, in the order reported (a file's one with its leaves counted)."""
        with self._lock:
            for index in self._stale:
                f, leaves = self._items[index], tuple(self._affected[index])
                self._items[index] = dataclasses.replace(
                    f, message=self._cause_text[index] + _affects_text(leaves), leaves=leaves)
            self._stale.clear()
            return self._items

    def _add(self, finding: Finding, affects: str | None = None) -> None:
        with self._lock:
            if finding.severity == ERROR and finding.file is not None and self._file_cause(finding, affects):
                return
            if finding.leaf is None:
                self._items.append(finding)
                return
            key = (finding.severity, finding.code, finding.leaf)
            seen = self._per_leaf.setdefault(key, [0, -1])
            seen[0] += 1
            if seen[0] <= MAX_PER_LEAF:
                self._items.append(finding)
                return
            more = seen[0] - MAX_PER_LEAF
            summary = Finding(
                finding.severity, finding.code,
                f"... and {more:,} more {finding.code} finding{'s' if more > 1 else ''} for this leaf (not listed)",
                finding.leaf, None,
            )
            if seen[1] < 0:
                seen[1] = len(self._items)
                self._items.append(summary)
            else:
                self._items[seen[1]] = summary

    def _file_cause(self, finding: Finding, affects: str | None) -> bool:
        """Count `finding` as its file's one FILE_CAUSES error (the first, or added to it), or a
        chunk failed by its file's unreadable bytes; False: a finding of its own (under the lock)."""
        file = finding.file
        assert file is not None
        index = self._causes.get(file)
        leaf = affects or finding.leaf
        if finding.code in FILE_CAUSES:
            if index is not None and affects is None:
                return False  # another check's own word on the file (an integrity manifest's): its own line
            if index is None:  # the file's first: its finding
                self._causes[file] = index = len(self._items)
                self._items.append(finding)
                self._cause_text[index] = finding.message
                self._affected[index] = {}
            if leaf is not None:
                self._affected[index][leaf] = None
                self._stale.add(index)
            return True
        if index is None or finding.leaf is None or finding.code != "bad-chunk" \
                or self._items[index].code not in _WHOLE_FILE:
            return False
        self._affected[index][finding.leaf] = None  # a chunk of a file none of which can be read
        self._stale.add(index)
        return True

    def error(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None:
        self._add(Finding(ERROR, code, message, leaf, file))

    def warning(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None:
        self._add(Finding(WARNING, code, message, leaf, file))

    def file_problem(self, code: str, message: str, *, file: str, leaf: str | None = None) -> None:
        """An error about `file` as a whole (a FILE_CAUSES code) that hurts `leaf`: one finding per
        file, listing the leaves (added to the file's finding when it has one already)."""
        if code not in FILE_CAUSES:
            raise ValueError(f"{code!r} is not a finding about a file")
        self._add(Finding(ERROR, code, message, None, file), affects=leaf)

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.items if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.items if f.severity == WARNING]


def _affects_text(leaves: tuple[str, ...]) -> str:
    """" (2 leaves affected: a, b)": the count of a file's finding, with the first few names."""
    if not leaves:
        return ""
    named = ", ".join(leaves[:_NAMED_LEAVES])
    more = f" and {len(leaves) - _NAMED_LEAVES:,} more" if len(leaves) > _NAMED_LEAVES else ""
    return f" ({len(leaves):,} lea{'f' if len(leaves) == 1 else 'ves'} affected: {named}{more})"


# progress callback: (what, done, total) — the core never prints
Progress = Callable[[str, int, int], None]


def no_progress(what: str, done: int, total: int) -> None:
    return None
