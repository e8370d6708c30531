"""A rich progress bar fed by the core's progress callback (terminal only)."""
from __future__ import annotations

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
