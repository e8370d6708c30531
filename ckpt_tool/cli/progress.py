"""A rich progress bar fed by the core's progress callback (terminal only)."""
from __future__ import annotations

import contextlib
from typing import Iterator

from ..findings import Progress, no_progress
from .render import Output


class ProgressBar:
    def __init__(self, out: Output, description: str) -> None:
        from rich.progress import (
            BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=out.console, transient=True,
        )
        self._task = self._progress.add_task(description, total=None)
        self._progress.start()

    def update(self, what: str, done: int, total: int) -> None:
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
