"""The storage layer beyond what every backend's suite checks (tests/storage_suite.py,
tests/storage/test_storage_backends.py): opening roots, the shared memory context, and the listing a
reader relies on being taken once."""
from __future__ import annotations

import pytest

from ckpt_tool.base.errors import NotFoundError
from ckpt_tool.storage import Storage


def test_missing_root(tmp_path):
    with pytest.raises(NotFoundError, match="no such directory"):
        Storage.open(str(tmp_path / "absent"))


def test_file_as_root_is_refused(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x")
    with pytest.raises(NotFoundError, match="is a file, not a checkpoint directory"):
        Storage.open(str(tmp_path / "a.bin"))


def test_memory_store_shared_within_process():
    import tensorstore as ts

    from ckpt_tool.storage import _CONTEXT

    kv = ts.KvStore.open({"driver": "memory", "path": "t1/"}, context=_CONTEXT).result()
    kv.write("x/y", b"abc").result()
    st = Storage.open("memory://t1")
    assert st.read("x/y") == b"abc"
    assert st.size("x/y") == 3
    assert st.list() == ["x/y"]


def test_listing_is_remembered_until_a_write(tmp_path):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"0123456789")
    (root / "sub" / "b.txt").write_text("hello")
    st = Storage.open(str(root))
    first = st.list()
    (root / "added_behind_its_back").write_text("x")
    assert st.list() == first  # a snapshot: listed once
    assert st.child("sub").list() == ["b.txt"]  # children take their part of it
    st.write("written.bin", b"1")
    after = st.list()
    assert "written.bin" in after and "added_behind_its_back" in after


def test_reading_a_checkpoint_lists_its_root_once(monkeypatch):
    from conftest import fixture_path
    from ckpt_tool.formats import open_checkpoint

    calls: list[tuple[str, str]] = []
    real = Storage._list_uncached

    def spy(self, rel):
        calls.append((self.url, rel))
        return real(self, rel)

    monkeypatch.setattr(Storage, "_list_uncached", spy)
    for name in ("orbax_manager", "orbax_ocdbt_zarr2", "dcp_multirank"):
        calls.clear()
        open_checkpoint(str(fixture_path(name)))
        # OCDBT views list their own database; the directory tree is listed once
        assert [c for c in calls if "(ocdbt)" not in c[0]] == [(str(fixture_path(name)), "")], name


def _open_fds_under(path) -> int:
    import os

    prefix = str(path)
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(prefix)
        except OSError:
            pass
    return n


def test_bulk_reads_keep_a_few_checked_files_open(tmp_path, monkeypatch):
    """read_range_into opens (and checks) a file once and reads it through the same descriptor
    until it is evicted; at most `keep` idle descriptors stay open, none once the root is gone."""
    import gc
    import os

    from ckpt_tool.storage import local as localfs

    root = tmp_path / "ckpt"
    root.mkdir()
    for i in range(6):
        (root / f"f{i}").write_bytes(bytes([i]) * 4096)
    st = Storage.open(str(root))
    st.backend._reads._keep = 2
    opens = []
    real_open = localfs._open_regular
    monkeypatch.setattr(localfs, "_open_regular", lambda path, where: opens.append(path) or real_open(path, where))
    buf = bytearray(16)
    for _ in range(3):
        st.read_range_into("f0", 100, buf)
    assert bytes(buf) == b"\x00" * 16 and len(opens) == 1
    for i in range(6):
        st.read_range_into(f"f{i}", 0, buf)
        assert bytes(buf) == bytes([i]) * 16
    assert _open_fds_under(root) == 2
    # the file read through a kept descriptor is the one that was checked: swapping the
    # path for a link out of the root afterwards does not make the next read follow it
    (tmp_path / "outside").write_bytes(b"\xff" * 4096)
    os.remove(root / "f5")
    os.symlink(tmp_path / "outside", root / "f5")
    st.read_range_into("f5", 0, buf)
    assert bytes(buf) == b"\x05" * 16
    del st
    gc.collect()
    assert _open_fds_under(root) == 0


def test_a_link_out_of_the_root_is_refused_at_the_first_bulk_read(tmp_path):
    from ckpt_tool.base.errors import PathEscapeError

    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "secret").write_bytes(b"s" * 64)
    (root / "data").symlink_to(tmp_path / "secret")
    st = Storage.open(str(root))
    with pytest.raises(PathEscapeError, match="outside the checkpoint"):
        st.read_range_into("data", 0, bytearray(8))
    assert _open_fds_under(tmp_path) == 0


def test_new_local_files_check_their_directory_once(tmp_path, monkeypatch):
    """create_local_file makes and checks a directory once; a later file in it is created O_EXCL,
    so an entry put there meanwhile (a link out of the root) is refused, never written through."""
    from ckpt_tool.base.errors import CkptError

    st = Storage.create(str(tmp_path / "out"))
    checks = []
    real_check = st.backend.check_key
    monkeypatch.setattr(st.backend, "check_key", lambda rel, **kw: checks.append(rel) or real_check(rel, **kw))
    for name in ("d/a", "d/b"):
        f = st.create_local_file(name)
        f.write_at(0, [b"x" * 10])
        f.close()
    assert checks == ["d/a"]
    (tmp_path / "elsewhere").write_bytes(b"keep")
    (tmp_path / "out" / "d" / "c").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CkptError, match="cannot create"):
        st.create_local_file("d/c")
    assert (tmp_path / "elsewhere").read_bytes() == b"keep"


def test_a_local_write_is_the_file_kvstores_without_tensorstore(tmp_path):
    """A destination made and written by Storage opens no kvstore (storage/local_backend.write): the
    files are what tensorstore's file kvstore writes (bytes, mode, no lock file left), a value is
    replaced whole, and a failure is one line."""
    import os
    import stat

    import tensorstore as ts

    from ckpt_tool.base.errors import CkptError

    ours = Storage.create(str(tmp_path / "ours"))
    for key, data in [("a", b"x" * 5), ("d/e/f.json", bytearray(b'{"k": 1}')), ("a", b"shorter"), ("empty", b"")]:
        ours.write(key, data)
    assert ours.backend._kvstore is None  # (no kvstore opened, tensorstore not needed)
    theirs = ts.KvStore.open(f"file://{tmp_path}/theirs/").result()
    for key, data in [("a", b"x" * 5), ("d/e/f.json", b'{"k": 1}'), ("a", b"shorter"), ("empty", b"")]:
        theirs.write(key, data).result()
    for key in ("a", "d/e/f.json", "empty"):
        mine, its = tmp_path / "ours" / key, tmp_path / "theirs" / key
        assert mine.read_bytes() == its.read_bytes(), key
        assert stat.S_IMODE(mine.stat().st_mode) == stat.S_IMODE(its.stat().st_mode), key
    assert sorted(os.listdir(tmp_path / "ours")) == ["a", "d", "empty"]
    assert sorted(ours.list("")) == ["a", "d/e/f.json", "empty"]
    (tmp_path / "ours" / "file").write_bytes(b"")
    with pytest.raises(CkptError) as err:
        ours.write("file/under", b"x")  # a file where its directory would be
    assert "\n" not in str(err.value) and "cannot write" in str(err.value)
    (tmp_path / "ours" / "dir" / "k").mkdir(parents=True)
    with pytest.raises(CkptError, match="cannot write"):
        ours.write("dir/k", b"x")  # a directory where the value would be
    assert not [p for p in (tmp_path / "ours").rglob("*.__lock")]
