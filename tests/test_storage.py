"""The storage layer beyond what every backend's suite checks (tests/storage_suite.py,
tests/test_storage_backends.py): opening roots, the shared memory context, and the listing a
reader relies on being taken once."""
from __future__ import annotations

import pytest

from ckpt_tool.errors import NotFoundError
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
