"""Large local writes go to the disk with O_DIRECT, aligned, and every byte still lands where it was placed."""
from __future__ import annotations

import errno
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from ckpt_tool.base import directio
from ckpt_tool.storage import Storage
from test_pagecache import cached_fraction

KiB, MiB = 2**10, 2**20


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not directio.supported(str(tmp_path)):
        kind = directio.file_system_type(str(tmp_path))
        pytest.skip(f"O_DIRECT is off here (CKPT_DIRECT_IO={os.environ.get('CKPT_DIRECT_IO')}, statfs type {kind if kind is None else hex(kind)})")
    return tmp_path


def _place_all(writer, lengths: list[int]) -> list[tuple[int, int]]:
    """Reserve the ranges one after another, as the DCP writer does; (offset, length) each."""
    cursor, placed = 0, []
    for n in lengths:
        offset, cursor = writer.place(cursor, n)
        placed.append((offset, n))
    return placed


def test_large_ranges_go_direct_and_every_byte_lands(direct_dir: Path, monkeypatch) -> None:
    calls: list[int] = []
    real = directio.write_direct

    def spy(fd: int, offset: int, parts) -> None:
        calls.append(offset)
        real(fd, offset, parts)

    monkeypatch.setattr(directio, "write_direct", spy)
    storage = Storage.create(str(direct_dir / "out"))
    writer = storage.create_local_file("data.bin")
    assert writer is not None
    # small and large ranges mixed; one larger than the staging window; odd lengths throughout
    lengths = [1000, 300 * KiB + 1, 5000, MiB + 7, directio.WINDOW_BYTES + 3 * MiB + 11, 17, 256 * KiB]
    placed = _place_all(writer, lengths)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]
    jobs = list(zip(placed, data))
    random.Random(0).shuffle(jobs)

    def put(job) -> None:
        (offset, n), blob = job
        cut = n // 3  # several parts per range, as an archive's header, data and trailer
        writer.write_at(offset, [blob[:cut], np.frombuffer(blob[cut:], dtype=np.uint8)])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(put, jobs))
    writer.close()

    big = [(o, n) for o, n in placed if n >= directio.MIN_DIRECT_BYTES]
    assert sorted(calls) == sorted(o for o, _ in big)
    assert all(o % directio.ALIGNMENT == 0 for o, _ in big)
    # what went direct never entered the page cache (checked before reading it back)
    assert cached_fraction(direct_dir / "out" / "data.bin") < 0.5
    raw = (direct_dir / "out" / "data.bin").read_bytes()
    last_offset, last_len = placed[-1]
    assert len(raw) == last_offset + last_len  # the padding after the last range is cut off
    for (offset, n), blob in zip(placed, data):
        assert raw[offset:offset + n] == blob, (offset, n)


def test_direct_writes_leave_no_cached_pages(direct_dir: Path) -> None:
    storage = Storage.create(str(direct_dir / "out"))
    writer = storage.create_local_file("big.bin")
    blob = os.urandom(16 * MiB)
    offset, _ = writer.place(0, len(blob))
    writer.write_at(offset, [blob])
    path = direct_dir / "out" / "big.bin"
    # before close: buffered, all 16 MiB would still be cached (the write-behind window is 64 MiB)
    assert cached_fraction(path) == 0.0
    writer.close()
    assert path.read_bytes() == blob


def test_a_refused_alignment_falls_back_to_buffered(direct_dir: Path, monkeypatch) -> None:
    def refuse(fd: int, offset: int, parts) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(directio, "write_direct", refuse)
    open_fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = open_fds()
    storage = Storage.create(str(direct_dir / "out"))
    writer = storage.create_local_file("data.bin")
    first, second = os.urandom(MiB + 3), os.urandom(MiB + 5)
    offset, cursor = writer.place(100, len(first))
    assert offset % directio.ALIGNMENT == 0 and offset > 100
    writer.write_at(offset, [first])  # refused: written buffered instead
    offset2, _ = writer.place(cursor, len(second))
    assert offset2 == cursor  # from now on nothing is aligned for O_DIRECT
    writer.write_at(offset2, [second])
    writer.close()
    assert open_fds() == before  # both descriptors closed
    raw = (direct_dir / "out" / "data.bin").read_bytes()
    assert raw[offset:offset + len(first)] == first
    assert raw[offset2:] == second


def test_other_write_errors_are_reported(direct_dir: Path, monkeypatch) -> None:
    def full(fd: int, offset: int, parts) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directio, "write_direct", full)
    writer = Storage.create(str(direct_dir / "out")).create_local_file("data.bin")
    offset, _ = writer.place(0, MiB)
    from ckpt_tool.base.errors import CkptError

    with pytest.raises(CkptError, match="No space left on device"):
        writer.write_at(offset, [bytes(MiB)])
    writer.discard()


def test_on_for_local_disks_off_by_the_environment_and_on_tmpfs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CKPT_DIRECT_IO", "0")
    assert not directio.supported(str(tmp_path))
    monkeypatch.delenv("CKPT_DIRECT_IO")
    if directio.file_system_type(str(tmp_path)) in (0xEF53, 0x58465342, 0x9123683E):  # ext4, XFS, btrfs
        assert directio.supported(str(tmp_path))
    if os.path.isdir("/dev/shm") and directio.file_system_type("/dev/shm") == 0x01021994:
        assert not directio.supported("/dev/shm")
    assert directio.file_system_type(str(tmp_path / "absent")) is None


def test_dcp_with_direct_archives_loads_bit_exact_in_torch(direct_dir: Path) -> None:
    """Archives on aligned offsets with zeros between them: torch's reader takes them as they are."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpt_tool.formats.dcp.write import DcpWriter
    from ckpt_tool.core.model import RegularGrid
    from ckpt_tool.core.write_plan import TargetArray, WritePlan

    rng = np.random.default_rng(1)
    arrays = {
        "big": rng.standard_normal((700, 300)).astype(np.float32),  # 4 chunks of ~205 KiB and ~615 KiB
        "small": rng.standard_normal((3, 5)).astype(np.float32),
        "mid": rng.integers(-9, 9, (1000, 97), dtype=np.int64),
    }
    grids = {"big": (600, 200), "small": (3, 5), "mid": (500, 97)}
    targets = [TargetArray((k,), k, a.shape, str(a.dtype), RegularGrid(grids[k])) for k, a in arrays.items()]
    plan = WritePlan(targets)
    out = direct_dir / "dcp"
    writer = DcpWriter(Storage.create(str(out)))
    writer.begin(plan)
    for t in targets:
        a, g = arrays[t.name], grids[t.name]
        i = 0
        for r0 in range(0, a.shape[0], g[0]):
            for c0 in range(0, a.shape[1], g[1]):
                region = (slice(r0, min(r0 + g[0], a.shape[0])), slice(c0, min(c0 + g[1], a.shape[1])))
                writer.write_array(t, i, region, a[region])
                i += 1
    writer.finish_process()
    writer.commit()

    meta = dcp.FileSystemReader(str(out)).read_metadata()
    offsets = [(v.offset, v.length) for v in meta.storage_data.values()]
    assert any(off % directio.ALIGNMENT == 0 and n >= directio.MIN_DIRECT_BYTES for off, n in offsets)
    sd = {k: torch.zeros(a.shape, dtype=torch.float32 if a.dtype == np.float32 else torch.int64) for k, a in arrays.items()}
    dcp.load(sd, checkpoint_id=str(out))
    for k, a in arrays.items():
        np.testing.assert_array_equal(sd[k].numpy(), a, err_msg=k)
    dcp_to_torch_save(str(out), str(direct_dir / "all.pt"))
    loaded = torch.load(direct_dir / "all.pt")
    for k, a in arrays.items():
        np.testing.assert_array_equal(loaded[k].numpy(), a, err_msg=k)
