"""A rich progress bar fed by the core's progress callback (terminal only)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..base.findings import Progress, no_progress
from ..base.text import printable
from .render import Output, human_bytes, human_rate


def _columns() -> list[Any]:
    """Description, bar, done/total, rate, time left; sizes in binary units (GiB), as every summary prints them."""
    from rich.progress import BarColumn, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class Done(ProgressColumn):
        def render(self, task: Any) -> Text:
            done = human_bytes(task.completed)
            return Text(done if task.total is None else f"{done} / {human_bytes(task.total)}", style="progress.download")

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else human_rate(int(speed), 1.0), style="progress.data.speed")

    return [TextColumn("[progress.description]{task.description}"), BarColumn(), Done(), Rate(), TimeRemainingColumn()]


class ProgressBar:
    def __init__(self, out: Output, description: str) -> None:
        from rich.progress import Progress

        self._progress = Progress(*_columns(), console=out.console, transient=True)
        self._task = self._progress.add_task(description, total=None)
        self._description = description
        self._progress.start()

    def update(self, what: str, done: int, total: int) -> None:
        if what.startswith("step "):  # validate --deep on a root: one bar per step, named
            # a step's name comes from the input: escaped, and out of rich markup
            from rich.markup import escape

            self._progress.update(self._task, description=escape(printable(f"{self._description}, {what}")),
                                  completed=done, total=total)
            return
        self._progress.update(self._task, completed=done, total=total)

    def close(self) -> None:
        self._progress.stop()


@contextlib.contextmanager
def progress_for(out: Output, description: str, *, show: bool = True) -> Iterator[Progress]:
    """The core's progress callback: a bar on a terminal (unless --json), a no-op otherwise."""
    if not (show and out.is_terminal and not out.json_mode):
        yield no_progress
        return
    bar = ProgressBar(out, description)
    try:
        yield bar.update
    finally:
        bar.close()
