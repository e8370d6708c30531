"""The OCDBT writer hands a full data file to its closer outside its lock, and a discard still waits
for that hand-over (storage/ocdbt_writer.py `_seal`).

Outside the lock because a closer's first submits start its threads, and each start waits for the
GIL among the busy copy threads: every other put waited for that when it ran under the lock. A
discard that did not wait for a hand-over under way could return while a close (an fsync, an
upload) is still to be submitted, and that close would land after the caller removed the output.
"""
from __future__ import annotations

import os
import threading

import pytest

from ckpt_tool.base.errors import CkptError
from ckpt_tool.storage import Storage
from ckpt_tool.storage import ocdbt_writer
from ckpt_tool.storage.ocdbt_encode import Config
from ckpt_tool.storage.ocdbt_writer import OcdbtDatabaseWriter

VALUE = b"x" * 4096


def _writer(directory: str) -> OcdbtDatabaseWriter:
    # data files of 8 KiB: the third value seals the first file
    return OcdbtDatabaseWriter(Storage.create(directory), Config.new(max_inline_value_bytes=16),
                               target_data_file_size=8192)


class _SlowCloser:
    """A closer whose submit blocks until released, as a thread start waiting for the GIL does."""

    def __init__(self, real: ocdbt_writer.FileCloser) -> None:
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()

    def submit(self, close):  # noqa: ANN001 - the closer's signature
        self.entered.set()
        assert self.release.wait(10)
        self.real.submit(close)

    def wait(self) -> None:
        self.real.wait()


def test_puts_go_on_while_a_full_file_is_handed_to_the_closer(tmp_path):
    writer = _writer(str(tmp_path / "db"))
    slow = _SlowCloser(writer._closer)
    writer._closer = slow
    sealing = threading.Thread(target=lambda: [writer.put(f"a{i}".encode(), VALUE) for i in range(3)])
    sealing.start()
    assert slow.entered.wait(10)
    # another thread's put does not wait for the hand-over (it used to: the lock was held)
    done = threading.Event()
    other = threading.Thread(target=lambda: (writer.put(b"b0", VALUE), done.set()))
    other.start()
    assert done.wait(5)
    slow.release.set()
    sealing.join(10)
    other.join(10)
    writer.finish()
    assert {k for k, _ in writer.entries} == {b"a0", b"a1", b"a2", b"b0"}


def test_discard_waits_for_a_hand_over_under_way(tmp_path):
    writer = _writer(str(tmp_path / "db"))
    slow = _SlowCloser(writer._closer)
    writer._closer = slow
    closed: list[str] = []
    real_close = ocdbt_writer._OpenDataFile.close

    def close(self):  # noqa: ANN001
        closed.append(self.file.path)
        real_close(self)

    ocdbt_writer._OpenDataFile.close = close  # type: ignore[method-assign]
    try:
        def puts() -> None:
            with pytest.raises(CkptError, match="write after the OCDBT database is discarded"):
                for i in range(3):
                    writer.put(f"a{i}".encode(), VALUE)

        sealing = threading.Thread(target=puts)
        sealing.start()
        assert slow.entered.wait(10)
        discarded = threading.Event()
        discarding = threading.Thread(target=lambda: (writer.discard(), discarded.set()))
        discarding.start()
        assert not discarded.wait(0.5), "discard returned while a sealed file was still being handed over"
        slow.release.set()
        assert discarded.wait(10)
        # by the time discard returned, the sealed file's close had run: nothing lands afterwards
        assert len(closed) == 1
        sealing.join(10)
        discarding.join(10)
    finally:
        ocdbt_writer._OpenDataFile.close = real_close  # type: ignore[method-assign]
    assert os.path.isdir(tmp_path / "db")
