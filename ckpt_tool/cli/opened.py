"""The step of a run root a command opened (runs.OpenedStep): said once, where the command's answer is.

inspect, validate, diff and convert say it in their own output (a header row, the first line,
`opened` in --json) and take() it from here; whatever step another command opened is one stderr
line once the command has finished (said_after). A command that fails says its error line alone
(one stderr line on failure: the error names the step's path).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import click

from ..base.text import printable

# ids of the opened steps a command has rendered itself (within said_after)
_SAID: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar("opened_said", default=None)


def take() -> list[Any]:
    """The run-root steps opened so far (runs.OpenedStep), marked as said by the caller's output."""
    from ..ops.runs import opened_steps

    opened = opened_steps()
    said = _SAID.get()
    if said is not None:
        said.update(id(o) for o in opened)
    return opened


def first_json() -> dict[str, Any] | None:
    """`opened` of inspect/validate --json: the step opened, or None where PATH was no run root."""
    opened = take()
    return opened[0].to_json() if opened else None


@contextlib.contextmanager
def said_after() -> Iterator[None]:
    """Record the steps opened while the command runs; when it finishes (its own exit code
    included: validate's and diff's 1), one stderr line for each step its output did not say."""
    from ..base.errors import CkptError
    from ..ops.runs import name_working_step, recording

    said: set[int] = set()
    token = _SAID.set(said)
    try:
        with recording() as opened:
            try:
                yield
            except SystemExit:
                _say(opened, said)
                raise
            except CkptError as exc:
                # a step opened by default refused (damaged): the error names the step that works
                name_working_step(exc, opened)
                raise
            _say(opened, said)
    finally:
        _SAID.reset(token)


def _say(opened: list[Any], said: set[int]) -> None:
    for o in opened:
        if id(o) not in said:
            click.echo(printable(f"ckpt: {o.line()}"), err=True)
