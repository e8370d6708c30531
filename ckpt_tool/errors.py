"""Errors the user can act on.

Every failure caused by the input (a missing path, damaged or hostile
metadata, an unknown layout) is a CkptError carrying one line that says what
is wrong and where. The CLI prints that line and exits 1 (2 for a
UsageError); anything else is a bug and keeps its traceback. Each class has a
`code`, the stable name `--json` reports a hard error under.
"""
from __future__ import annotations

from typing import Any


class CkptError(Exception):
    """A problem with the input, reported as one line: `<where>: <what>`."""

    code = "error"
    # the items behind the one line, where there are several (every difference from a
    # --like reference): the CLI prints them on stdout before it, and in --json's error
    details: tuple[str, ...] = ()

    def __init__(self, message: str, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class NotFoundError(CkptError):
    """The path, or a file the checkpoint needs, does not exist."""

    code = "not-found"


class UnknownFormatError(CkptError):
    """The path holds nothing ckpt recognises as a checkpoint."""

    code = "unknown-format"


class CorruptMetadataError(CkptError):
    """Metadata that cannot be parsed or contradicts itself."""

    code = "corrupt-metadata"


class UnsafePickleError(CorruptMetadataError):
    """A pickle referring to a global outside the allow-list; nothing ran."""

    code = "unsafe-pickle"

    def __init__(self, module: str, name: str, where: str | None = None) -> None:
        self.module = module
        self.name = name
        super().__init__(
            f"refused to unpickle global {module}.{name} (not in the allow-list; nothing was executed)",
            where,
        )


class PathEscapeError(CkptError):
    """A key or relative path that would leave the checkpoint root."""

    code = "path-escape"


class StorageUnavailableError(CkptError):
    """A remote store that does not answer (dead, unreachable, or past its deadline).

    Nothing more can be read or written there in this run: the storage layer
    remembers the first one and fails every later remote operation at once,
    and validate reports it as the run's one error instead of a finding per chunk.
    """

    code = "storage-unavailable"


class IncompleteCheckpointError(CkptError):
    """An uncommitted or partially written save."""

    code = "incomplete"


class UnsupportedLeafError(CkptError):
    """A leaf the target format cannot hold (e.g. a dict of objects into Orbax)."""

    code = "unsupported-leaf"


class NoMatchError(CkptError):
    """A --filter, --select or --exclude pattern that matches no leaf (most
    likely a typo): exit 1, as a problem with what was asked of this checkpoint."""

    code = "no-match"


class UsageError(CkptError):
    """A bad option value or a combination of options that cannot work.

    Raised by the core where an option is parsed (--mesh, --rename, --dtype,
    --step, a rules file, a size); the CLI prints it as click prints its own
    usage errors and exits 2. A CkptError, so API callers catch it as before.
    """

    code = "usage"


class DestinationExistsError(CkptError):
    """The output path is already there and may not be replaced."""

    code = "destination-exists"


def a_type(value: Any) -> str:
    """"an int", "a str", "an ndarray": the type of `value` named with its article, for messages."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def short_repr(value: Any, limit: int = 60) -> str:
    """A value as it appears in a one-line message: repr, cut to `limit`, never failing."""
    try:
        text = repr(value)
    except Exception:  # a stand-in with odd state; never let repr fail the report
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
