"""Errors the user can act on.

Every failure caused by the input (a missing path, damaged or hostile
metadata, an unknown layout) is a CkptError carrying one line that says what
is wrong and where. The CLI prints that line and exits 1; anything else is a
bug and keeps its traceback.
"""
from __future__ import annotations

from typing import Any


class CkptError(Exception):
    """A problem with the input, reported as one line: `<where>: <what>`."""

    def __init__(self, message: str, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class NotFoundError(CkptError):
    """The path, or a file the checkpoint needs, does not exist."""


class UnknownFormatError(CkptError):
    """The path holds nothing ckpt recognises as a checkpoint."""


class CorruptMetadataError(CkptError):
    """Metadata that cannot be parsed or contradicts itself."""


class UnsafePickleError(CorruptMetadataError):
    """A pickle referring to a global outside the allow-list; nothing ran."""

    def __init__(self, module: str, name: str, where: str | None = None) -> None:
        self.module = module
        self.name = name
        super().__init__(
            f"refused to unpickle global {module}.{name} (not in the allow-list; nothing was executed)",
            where,
        )


class PathEscapeError(CkptError):
    """A key or relative path that would leave the checkpoint root."""


class StorageUnavailableError(CkptError):
    """A remote store that does not answer (dead, unreachable, or past its deadline).

    Nothing more can be read or written there in this run: the storage layer
    remembers the first one and fails every later remote operation at once,
    and validate reports it as the run's one error instead of a finding per chunk.
    """


class IncompleteCheckpointError(CkptError):
    """An uncommitted or partially written save."""


class UnsupportedLeafError(CkptError):
    """A leaf the target format cannot hold (e.g. a dict of objects into Orbax)."""


def short_repr(value: Any, limit: int = 60) -> str:
    """A value as it appears in a one-line message: repr, cut to `limit`, never failing."""
    try:
        text = repr(value)
    except Exception:  # a stand-in with odd state; never let repr fail the report
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
