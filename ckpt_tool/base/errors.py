"""Errors the user can act on.

Every failure caused by the input (a missing path, damaged or hostile
metadata, an unknown layout) is a CkptError carrying one line that says what
is wrong and where. The CLI prints that line and exits 1 (2 for a
UsageError); anything else is a bug and keeps its traceback. Each class has a
`code`, the stable name `--json` reports a hard error under.
"""
from __future__ import annotations

# (typing for the type checker only: the package imports this module, and `ckpt --version`,
# which must start about as fast as a bare interpreter, with it; importing typing costs ~5 ms)
TYPE_CHECKING = False
if TYPE_CHECKING:
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


class UnreadableFileError(CkptError):
    """A file that is there but cannot be read (permission denied, an I/O error).

    A property of the file, not of any item in it: every item stored there
    fails alike, so validate reports the file once (`unreadable-file`) with the
    leaves it holds, not a finding per item."""

    code = "unreadable"


class TruncatedFileError(CkptError):
    """A file shorter than an item stored in it needs. `size`: the bytes it has.

    `cause` says what is wrong with the file itself, the same words for every
    item past its end (the message says which bytes this read needed): validate
    groups the items of one short file under one finding with it."""

    def __init__(self, message: str, where: str | None = None, *, size: int, cause: str | None = None) -> None:
        self.size = size
        self.cause = cause or f"truncated: it has {size:,} bytes, fewer than the items stored in it need"
        super().__init__(message, where)


class NoSpaceError(CkptError):
    """The destination's file system is full (ENOSPC, EDQUOT), or would be by the output's size."""

    code = "no-space"


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
    a rules file, a size); the CLI prints it as click prints its own usage
    errors and exits 2. A CkptError, so API callers catch it as before. Not for
    a --step the run root does not have: that is NotFoundError (exit 1), like a
    path that is not there, on every framework's root (runs.resolve_step).
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
    """A value as it appears in a one-line message: repr, cut to `limit`, never failing.

    Lists, tuples, dicts and sets are spelled here, only as far as `limit` reaches: a
    decoded pickle may share one list at 2**60 places or hold itself, where repr() would
    never end (a cycle reads `[...]`, as repr spells it)."""
    parts: list[str] = []
    room = [limit + 1]  # characters still wanted; one past the limit shows that it was cut
    on_path: set[int] = set()

    def put(text: str) -> None:
        parts.append(text[: room[0]])
        room[0] -= len(parts[-1])

    def spell(v: Any) -> None:
        if room[0] <= 0:
            return
        t = type(v)
        if t in (list, tuple, dict, set, frozenset) and v:
            if id(v) in on_path:
                put("[...]" if t is list else "{...}" if t is dict else "(...)")
                return
            on_path.add(id(v))
            brackets: dict[type, tuple[str, str]] = {list: ("[", "]"), tuple: ("(", ")"), dict: ("{", "}")}
            opening, closing = brackets.get(t, ("{", "}"))
            if t is frozenset:
                opening, closing = "frozenset({", "})"
            put(opening)
            for i, item in enumerate(v.items() if t is dict else v):
                if room[0] <= 0:
                    break
                if i:
                    put(", ")
                if t is dict:
                    spell(item[0])
                    put(": ")
                    spell(item[1])
                else:
                    spell(item)
            put("," + closing if t is tuple and len(v) == 1 else closing)
            on_path.discard(id(v))
            return
        if t in (str, bytes, bytearray) and len(v) > room[0]:
            v = v[: room[0]]  # (repr of a 100 MB string would copy it all to show a line)
        try:
            put(repr(v))
        except Exception:  # a stand-in with odd state; never let repr fail the report
            put(f"<{t.__name__}>")

    try:
        spell(value)
    except RecursionError:  # nested past the interpreter's depth: show what was spelled
        pass
    text = "".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."
