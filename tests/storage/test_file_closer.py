"""FileCloser (storage/local.py): closes and uploads behind the threads that filled the files; with
`bound`, no more than that many wait or run (each holds its file's bytes), and a failure stops the
next submit instead of letting the run fill more files for nothing."""
from __future__ import annotations

import threading
import time

import pytest

from ckpt_tool.base.errors import CkptError
from ckpt_tool.storage import FileCloser


def test_a_bound_holds_submit_until_a_place_is_free() -> None:
    closer = FileCloser("test-bound", 4, bound=2)
    release = threading.Event()
    running, most, lock = [0], [0], threading.Lock()

    def job() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(5)
        with lock:
            running[0] -= 1

    closer.submit(job)
    closer.submit(job)
    third = threading.Thread(target=closer.submit, args=(job,))
    third.start()
    time.sleep(0.2)
    assert third.is_alive()  # waits for a place: two are running
    release.set()
    third.join(5)
    assert not third.is_alive()
    closer.wait()
    assert most[0] == 2


def test_a_failure_stops_the_next_submit_and_is_raised_by_wait() -> None:
    closer = FileCloser("test-fail", 2, bound=2)

    def fail() -> None:
        raise CkptError("upload corrupted: test", "gs://b/x")

    closer.submit(fail)
    deadline = time.monotonic() + 5
    with pytest.raises(CkptError, match="upload corrupted"):
        while time.monotonic() < deadline:
            closer.submit(lambda: None)
            time.sleep(0.01)
    with pytest.raises(CkptError, match="upload corrupted"):
        closer.wait()


def test_without_a_bound_submit_never_waits() -> None:
    closer = FileCloser("test-free", 1)
    release = threading.Event()
    for _ in range(5):
        closer.submit(lambda: release.wait(5) and None)
    release.set()
    closer.wait()
