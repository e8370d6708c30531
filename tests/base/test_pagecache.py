"""The writers' output leaves the page cache once it is on disk, and is still exactly what was written."""
from __future__ import annotations

import ctypes
import mmap
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import ckpt_tool
from ckpt_tool.base import pagecache
from ckpt_tool.ops.diff import diff_checkpoints
from ckpt_tool.ops.engine import ConvertOptions, convert
from ckpt_tool.base.pagecache import DirectoryDropper
from ckpt_tool.storage import Storage

# page-cache residency is the machine's: alone, in make test's serial pass
pytestmark = pytest.mark.serial

MiB = 2**20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def cached_fraction(path: Path) -> float:
    """The share of the file's pages in the page cache (mincore over a private mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            buf = ctypes.c_char.from_buffer(mm)
            try:
                if _libc.mincore(ctypes.addressof(buf), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), "mincore")
            finally:
                del buf
            return sum(v & 1 for v in vec) / pages
        finally:
            mm.close()


@pytest.fixture
def droppable(tmp_path):
    """Skip where the file system under tmp_path cannot drop clean pages (tmpfs) or pagecache is off."""
    if not pagecache.enabled():
        pytest.skip("no posix_fadvise on this platform")
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        f.write(os.urandom(4 * MiB))
        f.flush()
        os.fsync(f.fileno())
    if cached_fraction(probe) < 0.9:
        pytest.skip("this file system does not keep written files cached")
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached_fraction(probe) > 0.1:
        pytest.skip("this file system does not drop clean pages")
    probe.unlink()
    return tmp_path


def test_local_file_writer_drops_behind_itself_and_writes_every_byte(droppable, monkeypatch):
    monkeypatch.setattr(pagecache, "DEFAULT_WINDOW_BYTES", 2 * MiB)
    monkeypatch.setenv("CKPT_DIRECT_IO", "0")  # buffered writes (test_directio.py has the direct ones)
    storage = Storage.create(str(droppable / "out"))
    data = os.urandom(32 * MiB)
    pieces = [(off, data[off:off + MiB]) for off in range(0, len(data), MiB)]
    random.Random(0).shuffle(pieces)
    writer = storage.create_local_file("data.bin")
    assert writer is not None
    path = droppable / "out" / "data.bin"
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: writer.write_at(p[0], [p[1][: MiB // 2], p[1][MiB // 2:]]), pieces))
    writer._behind.wait()  # the dropping runs on a background thread
    # before close: all but the window (and pieces still being written back) has gone
    assert cached_fraction(path) < 0.5
    writer.close()
    assert cached_fraction(path) < 0.05
    assert path.read_bytes() == data


def test_directory_dropper_drops_files_written_by_someone_else(droppable):
    d = droppable / "d"
    d.mkdir()
    files = []
    for i in range(3):
        p = d / f"file{i}"
        with open(p, "wb") as f:
            f.write(os.urandom(4 * MiB))
            f.flush()
            os.fsync(f.fileno())
        files.append(p)
    dropper = DirectoryDropper(str(d), window=8 * MiB)
    dropper.written(4 * MiB)  # below the window: no sweep yet
    dropper.wait()
    assert all(cached_fraction(p) > 0.9 for p in files)
    dropper.written(4 * MiB)
    dropper.wait()  # the sweep runs on a background thread
    assert all(cached_fraction(p) < 0.05 for p in files)  # on disk already: dropped at first sight

    # a file that grows between sweeps is dropped again, also after it was first seen
    growing = d / "growing"
    with open(growing, "ab") as f:
        f.write(os.urandom(4 * MiB))
    dropper.written(8 * MiB)
    dropper.wait()
    with open(growing, "ab") as f:
        f.write(os.urandom(4 * MiB))
        f.flush()
        os.fsync(f.fileno())
    assert cached_fraction(growing) > 0.4
    dropper.finish()
    assert cached_fraction(growing) < 0.05
    assert growing.stat().st_size == 8 * MiB


def test_dropper_ignores_a_missing_directory(tmp_path):
    dropper = DirectoryDropper(str(tmp_path / "absent"), window=1)
    dropper.written(10)
    dropper.finish()


def test_converted_output_is_not_left_cached(droppable, monkeypatch):
    """DCP -> Orbax -> DCP of 24 MiB: neither output's data files stay cached, and the values survive."""
    import torch
    import torch.distributed.checkpoint as dcp

    monkeypatch.setattr(pagecache, "DEFAULT_WINDOW_BYTES", 4 * MiB)
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(512, 1024, generator=gen) for i in range(12)}
    src = droppable / "src"
    dcp.save(state, checkpoint_id=str(src))
    as_orbax, back = droppable / "orbax", droppable / "back"
    convert(str(src), str(as_orbax), ConvertOptions(to="orbax", chunk_mb=1))
    orbax_data = [p for p in as_orbax.rglob("*") if p.is_file() and p.parent.name == "d" and p.stat().st_size >= MiB]
    assert orbax_data
    for p in orbax_data:
        assert cached_fraction(p) < 0.05, p
    convert(str(as_orbax), str(back), ConvertOptions(to="dcp"))  # reads the Orbax files back in
    dcp_data = list(back.glob("*.distcp"))
    assert dcp_data
    for p in dcp_data:
        assert cached_fraction(p) < 0.05, p
    assert diff_checkpoints(ckpt_tool.open(str(src)), ckpt_tool.open(str(back)), values=True).same


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_background_thread(tmp_path):
    """The parent's background thread does not survive a fork; a child that
    writes must not wait forever for jobs nobody runs."""
    def write_some(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            behind = pagecache.WriteBehind(fd, window=MiB)
            for i in range(4):
                os.pwrite(fd, b"x" * MiB, i * MiB)
                behind.written(i * MiB, MiB)  # past the window: background jobs
            os.fsync(fd)
            behind.finish()
        finally:
            os.close(fd)

    write_some(tmp_path / "parent")  # the parent's thread is running now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its writer finishes
        try:
            write_some(tmp_path / "child")
            os._exit(0)
        except BaseException:
            os._exit(1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child hung waiting for background jobs")
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "child").stat().st_size == 4 * MiB


@pytest.mark.parametrize("setting, gvisor, enabled", [
    ("", False, True), ("", True, False),  # off by default on gVisor, where the hints only sync
    ("0", False, False), ("1", True, True),  # CKPT_PAGECACHE forces them off / on
])
def test_the_hints_are_off_on_gvisor_unless_forced(tmp_path, setting, gvisor, enabled):
    import subprocess
    import sys

    # gVisor is told by the kernel version it reports: a stand-in /proc/version through builtins.open
    version = "Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016\n" if gvisor else "Linux version 6.1.0\n"
    probe = (
        "import builtins, io, os\n"
        "real = builtins.open\n"
        f"builtins.open = lambda p, *a, **k: io.StringIO({version!r}) if p == '/proc/version' else real(p, *a, **k)\n"
        "from ckpt_tool.base import pagecache\n"
        "print(pagecache.enabled())\n"
    )
    env = {**os.environ, "CKPT_PAGECACHE": setting}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == str(enabled)
