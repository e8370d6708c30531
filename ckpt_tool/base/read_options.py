"""The reader options of the command being run ({"weights": "module"}): set by the CLI around its
call into the core (formats.read_options), read by the registry and validate, which pass the ones
a format takes to its read() and check_path() as keyword arguments (a format's shallow checks read
what its reader would). A context variable, not a parameter of every command's path: see
docs/architecture.md ("Values that travel in context variables").
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
