"""The preflight: a source must be whole before anything is written from it.

A shard file missing from a partial download, a rank's lost `.distcp`, an OCDBT data
file gone: readers open such a checkpoint from its metadata and would copy what is
there. convert, reshard and diff run validate's shallow checks on the step they
read first, and refuse the first error in one line.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..base.errors import (
    CkptError, CorruptMetadataError, IncompleteCheckpointError, PathEscapeError, StorageUnavailableError,
)
from ..core.model import Checkpoint
from ..storage import ReadLog

if TYPE_CHECKING:
    from .validate import ValidationReport

# error findings of shallow validate that do not make a copy partial or wrong:
# a commit problem is refused before this with the reader's own wording, and
# ckpt reads unmerged per-process OCDBT databases whole (a convert is how to
# get the merged copy orbax needs)
_PREFLIGHT_EXEMPT = frozenset({"uncommitted-save", "unmerged-ocdbt"})
# findings that say stored data is gone or cut short (the others: damaged or refused)
_LOST_DATA = frozenset({
    "missing-file", "truncated-file", "empty-file", "lost-process-data", "missing-metadata", "leaf-missing",
    "missing-chunk", "missing-storage-entry", "coverage-gap",
})


def check_source_complete(src: Checkpoint, given: str | None = None, *, side: str = "the source") -> None:
    """Refuse a source that shallow validate finds incomplete or damaged, before anything is written.

    A shard file missing from a partial download, a rank's lost `.distcp`, an
    OCDBT data file gone: readers open such a checkpoint from its metadata and
    would copy what is there, silently leaving the rest out. The same checks
    as `ckpt validate SRC` (metadata, listings, file sizes; no chunk is read)
    run on the step being copied; the first error is named in one line.
    Every process of a multi-host run checks for itself (same files, same answer).
    `side`: what the line calls the checkpoint (diff: "A" or "B").
    The checks start from the checkpoint as it was opened (its Storage, its parsed metadata:
    validate.validate_opened), so that the run reads its metadata once.
    """
    from .validate import validate_opened

    # the chosen step only, not every step of a CheckpointManager root
    step = src.step if src.steps else None
    error = _refusal(lambda: validate_opened(src, step=step), step, given or src.path, side=side)
    if error is not None:
        raise error


def _refusal(
    validate: Callable[[], ValidationReport], step: int | str | None, shown: str,
    codes: frozenset[str] | None = None, *, side: str = "the source",
) -> CkptError | None:
    """The one-line refusal for the first error shallow validate (`validate()`, at `step`) finds, or None.

    `codes`: only findings of these codes count (None: every error but the exempt ones).
    Lost data is an IncompleteCheckpointError, a path-escape a PathEscapeError (what
    reading the file would have raised), anything else a CorruptMetadataError."""
    from ..base.findings import ERROR

    try:
        report = validate()
    except StorageUnavailableError:
        raise  # a store that stopped answering is the run's one error
    except (CkptError, ValueError, TypeError):
        return None  # not a checkpoint (or a step) validate can check: the caller's own error stands
    errors = [
        f for f in report.findings
        if f.severity == ERROR and f.code not in _PREFLIGHT_EXEMPT and (codes is None or f.code in codes)
    ]
    if not errors:
        return None
    first = errors[0]
    where = first.file or first.leaf or "."
    message = first.message
    if len(message) > 120:  # one line: its first clause (validate prints the whole finding)
        message = message.split("; ")[0]
        message = message if len(message) <= 300 else message[:297] + "..."
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    option = f" --step {step}" if step not in (None, "latest") else ""
    kind: type[CkptError]
    if first.code in _LOST_DATA:
        kind, what = IncompleteCheckpointError, f"{side} is incomplete"
    elif first.code == "path-escape":
        kind, what = PathEscapeError, f"{side} is refused"
    else:
        kind, what = CorruptMetadataError, f"{side} is damaged"
    return kind(
        f"{what}: {first.code}: {where}: {message}{more}; run `ckpt validate {shown}{option}` for every finding",
        shown,
    )


def open_source(source: str, step: str | int | None, log: ReadLog | None = None) -> Checkpoint:
    """open_checkpoint, except that a source too damaged to open says so as validate would
    (a lost OCDBT data file holding metadata: the finding, not the storage library's text).
    `log` counts what is read of it (the run's bytes_read)."""
    from ..formats import open_checkpoint

    try:
        # (what its reader parsed is kept for the preflight that follows: check_source_complete)
        return open_checkpoint(source, step=step, log=log, keep_parsed=True)
    except (IncompleteCheckpointError, PathEscapeError, StorageUnavailableError):
        raise
    except CkptError:
        from .validate import validate_checkpoint

        # nothing was opened: validate reads the source by its path
        better = _refusal(lambda: validate_checkpoint(source, step=step), step, source, _LOST_DATA)
        if better is not None:
            raise better from None
        raise

