"""The storage layer: reads, ranges, sizes, and the one place containment is enforced."""
from __future__ import annotations

import os

import pytest

from ckpt_tool.errors import CkptError, NotFoundError, PathEscapeError
from ckpt_tool.storage import Storage


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"0123456789")
    (root / "sub" / "b.txt").write_text("hello")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    os.symlink(outside / "secret", root / "link_out")
    os.symlink(outside, root / "dir_out")
    os.symlink(root / "a.bin", root / "link_in")
    os.mkfifo(root / "fifo")
    return root


def test_read_range_size_list(tree):
    st = Storage.open(str(tree))
    assert st.read("a.bin") == b"0123456789"
    assert st.read_range("a.bin", 2, 5) == b"234"
    assert st.size("a.bin") == 10
    assert "sub/b.txt" in st.list()
    assert st.list("sub") == ["sub/b.txt"]
    dirs, files = st.listdir()
    assert "sub" in dirs and "a.bin" in files
    assert st.read_many(["a.bin", "missing"]) == {"a.bin": b"0123456789", "missing": None}
    assert st.log.reads["a.bin"] >= 2


def test_file_url_and_child(tree):
    st = Storage.open("file://" + str(tree))
    assert st.child("sub").read("b.txt") == b"hello"


def test_missing_and_truncated(tree):
    st = Storage.open(str(tree))
    with pytest.raises(NotFoundError, match="missing"):
        st.read("nope")
    with pytest.raises(CkptError, match=r"truncated: needed bytes \[5, 20\) but it has 10 bytes"):
        st.read_range("a.bin", 5, 20)


@pytest.mark.parametrize("url", ["local", "memory"])
def test_read_range_into_fills_the_buffer(tree, url):
    if url == "local":
        st = Storage.open(str(tree))
    else:
        st = Storage.open("memory://range_into")
        st.write("a.bin", b"0123456789")
    buf = bytearray(4)
    st.read_range_into("a.bin", 3, buf)
    assert buf == b"3456"
    with pytest.raises(CkptError, match=r"truncated: needed bytes \[8, 12\) but it has 10 bytes"):
        st.read_range_into("a.bin", 8, bytearray(4))
    with pytest.raises(NotFoundError, match="missing"):
        st.read_range_into("nope", 0, bytearray(1))


def test_read_range_into_keeps_containment(tree):
    st = Storage.open(str(tree))
    with pytest.raises(PathEscapeError):
        st.read_range_into("link_out", 0, bytearray(1))
    with pytest.raises(PathEscapeError, match="not a regular file"):
        st.read_range_into("fifo", 0, bytearray(1))


@pytest.mark.parametrize("key", ["../outside/secret", "sub/../../outside/secret", "/etc/passwd", "C:\\x"])
def test_escaping_keys_refused(tree, key):
    st = Storage.open(str(tree))
    with pytest.raises(PathEscapeError):
        st.read(key)


def test_symlink_out_refused_symlink_in_allowed(tree):
    st = Storage.open(str(tree))
    with pytest.raises(PathEscapeError, match="outside the checkpoint"):
        st.read("link_out")
    with pytest.raises(PathEscapeError):
        st.child("dir_out")
    assert st.read("link_in") == b"0123456789"


def test_fifo_refused_without_blocking(tree):
    st = Storage.open(str(tree))
    with pytest.raises(PathEscapeError, match="not a regular file"):
        st.read("fifo")


def test_missing_root(tmp_path):
    with pytest.raises(NotFoundError, match="no such directory"):
        Storage.open(str(tmp_path / "absent"))


def test_memory_store_shared_within_process():
    import tensorstore as ts

    from ckpt_tool.storage import _CONTEXT

    kv = ts.KvStore.open({"driver": "memory", "path": "t1/"}, context=_CONTEXT).result()
    kv.write("x/y", b"abc").result()
    st = Storage.open("memory://t1")
    assert st.read("x/y") == b"abc"
    assert st.size("x/y") == 3
    assert st.list() == ["x/y"]


def test_listing_is_remembered_until_a_write(tree):
    st = Storage.open(str(tree))
    first = st.list()
    (tree / "added_behind_its_back").write_text("x")
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
