"""The reader options of the command being run ({"weights": "module"}): set by the CLI around its
call into the core (formats.read_options), passed by open_checkpoint to the format's read(), and
read by a format's shallow checks (which read what its reader would). A context variable in the
base layer, so that a format package asks it without importing the registry above it.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_READ_OPTIONS: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("read_options", default={})


@contextlib.contextmanager
def read_options(**options: str | None) -> Iterator[None]:
    """Within it, checkpoints are opened with these reader options (None: not given)."""
    token = _READ_OPTIONS.set({k: v for k, v in options.items() if v is not None})
    try:
        yield
    finally:
        _READ_OPTIONS.reset(token)


def given_read_options() -> dict[str, str]:
    """The reader options in force (a format's shallow checks read what its reader would)."""
    return dict(_READ_OPTIONS.get())
