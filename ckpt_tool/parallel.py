"""Run many small I/O tasks on a few threads with a bounded number in flight.

tensorstore, zstd, zlib and numpy release the GIL, so threads overlap the
work; bounding what is in flight bounds memory to a few chunks whatever the
number of tasks.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def run_bounded(
    tasks: Iterable[T],
    work: Callable[[T], int],
    *,
    workers: int,
    on_done: Callable[[int], None] | None = None,
    name: str = "ckpt",
) -> int:
    """Run work(task) for every task with at most workers*2 in flight; return the sum of the results.

    The first exception a task raises is re-raised here (the remaining
    in-flight tasks finish first, the queued ones never start).
    """
    workers = max(1, workers)
    total = 0
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        pending: set[Future[int]] = set()
        it = iter(tasks)
        while True:
            while len(pending) < workers * 2:
                task = next(it, None)
                if task is None:
                    break
                pending.add(pool.submit(work, task))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                total += fut.result()
            if on_done is not None:
                on_done(total)
    return total
