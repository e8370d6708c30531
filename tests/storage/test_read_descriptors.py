"""The descriptors a local root's bulk reads share (storage/local.py ReadDescriptors): a file is
checked and opened once, by one thread, however many threads ask for it at once; a failed check
is each asking thread's own error."""
from __future__ import annotations

import threading
import time

import pytest

from ckpt_tool.base.errors import CkptError
from ckpt_tool.storage.local import ReadDescriptors


def test_threads_asking_at_once_share_one_check_and_one_open(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"0123456789")
    reads = ReadDescriptors()
    checks: list[int] = []
    fds: list[int] = []
    start = threading.Barrier(8)

    def check() -> None:
        checks.append(1)
        time.sleep(0.2)  # a slow check (a realpath on a slow file server): the others arrive meanwhile

    def read() -> None:
        start.wait()
        with reads.use(str(path), "data", check) as fd:
            fds.append(fd)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(checks) == 1
    assert len(set(fds)) == 1 and len(fds) == 8


def test_a_failed_check_fails_every_thread_and_is_tried_again(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"x")
    reads = ReadDescriptors()
    checks: list[int] = []

    def check() -> None:
        checks.append(1)
        time.sleep(0.05)
        raise CkptError("resolves outside the checkpoint", "data")

    errors: list[str] = []
    start = threading.Barrier(4)

    def read() -> None:
        start.wait()
        try:
            with reads.use(str(path), "data", check):
                pass
        except CkptError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 4 and all("outside the checkpoint" in e for e in errors)
    assert len(checks) == 4  # nothing was opened: each thread checked (and failed) itself
    with pytest.raises(CkptError):
        with reads.use(str(path), "data", check):
            pass
