"""One test suite every storage backend passes (the model: zarr-python's testing/store.py StoreTests).

A backend's tests subclass BackendTests and define the `populated` fixture: a Storage over a root
that holds exactly `Populated.contents`, written there by something other than the Storage itself
(the file system, boto3, the GCS JSON API, tensorstore's own kvstore drivers), so every answer the
Storage gives is checked against an independent source. A test that does not apply to a backend
(writes to a read-only view, symlinks where there is no file system, deadlines where there is no
remote endpoint) is skipped by the capability the backend declares (`Storage.capabilities`), never
silently passed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tensorstore as ts

from ckpt_tool.base.errors import CkptError, NotFoundError, PathEscapeError, StorageUnavailableError
from ckpt_tool.storage import Capabilities, Storage, ocdbt_bulk, remote

# what the backends that can be given any tree are populated with: nested directories, a value
# large enough for ranges across it, one too large to be stored in line by an OCDBT database
TREE: dict[str, bytes] = {
    "a.bin": b"0123456789",
    "sub/b.txt": b"hello",
    "sub/deep/c.bin": bytes(range(256)) * 8,
    "z/last": b"!",
}


@dataclass
class Populated:
    """A Storage whose root holds exactly `contents`; `root`: its local directory, where it has one."""

    storage: Storage
    contents: dict[str, bytes]
    root: Path | None = None


def needs(st: Storage, capability: str) -> None:
    """Skip the calling test, saying why, when the backend does not declare `capability`."""
    caps: Capabilities = st.capabilities
    if not getattr(caps, capability):
        pytest.skip(f"{st.backend_kind} storage has no {capability}")


class BackendTests:
    """What every kind of storage guarantees. Subclasses provide the `populated` fixture."""

    @pytest.fixture
    def populated(self) -> Populated:
        raise NotImplementedError("a backend's tests define the populated fixture")

    # -- helpers over the contents -------------------------------------------------------
    @staticmethod
    def largest(p: Populated) -> str:
        """The key with the longest value (ranges inside it and past its end)."""
        return max(sorted(p.contents), key=lambda k: len(p.contents[k]))

    @staticmethod
    def nested_dir(p: Populated) -> str:
        """A directory (key prefix) holding some but not all keys."""
        dirs = sorted({k.split("/", 1)[0] for k in p.contents if "/" in k})
        assert dirs, "the populated store needs a sub-directory"
        return dirs[0]

    # -- listing ---------------------------------------------------------------------------
    def test_list_is_every_key_sorted(self, populated: Populated) -> None:
        assert populated.storage.list() == sorted(populated.contents)

    def test_list_under_a_prefix(self, populated: Populated) -> None:
        st, d = populated.storage, self.nested_dir(populated)
        want = sorted(k for k in populated.contents if k.startswith(d + "/"))
        assert st.list(d) == want
        assert st.list(d + "/") == want
        assert st.list("no-such-dir") == []

    def test_listdir_splits_dirs_and_files(self, populated: Populated) -> None:
        dirs, files = populated.storage.listdir()
        assert dirs == sorted({k.split("/", 1)[0] for k in populated.contents if "/" in k})
        assert sorted(files) == sorted(k for k in populated.contents if "/" not in k)

    def test_listing_is_a_snapshot(self, populated: Populated) -> None:
        st = populated.storage
        first = st.list()
        assert st.list() == first
        d = self.nested_dir(populated)
        assert st.child(d).list() == [k[len(d) + 1:] for k in first if k.startswith(d + "/")]

    # -- reading ---------------------------------------------------------------------------
    def test_exists(self, populated: Populated) -> None:
        st = populated.storage
        for key in populated.contents:
            assert st.exists(key), key
        assert not st.exists("no-such-key")

    def test_read_whole_values(self, populated: Populated) -> None:
        st = populated.storage
        for key, value in populated.contents.items():
            assert st.read(key) == value, key

    def test_size_and_stat_are_the_stored_bytes(self, populated: Populated) -> None:
        st = populated.storage
        for key, value in populated.contents.items():
            assert st.size(key) == len(value), key
            size, mtime = st.stat(key)
            assert size == len(value)
            assert (mtime is not None) == st.capabilities.local_files

    def test_read_range(self, populated: Populated) -> None:
        st, key = populated.storage, self.largest(populated)
        value = populated.contents[key]
        n = len(value)
        assert st.read_range(key, 0, n) == value
        assert st.read_range(key, 1, n // 2) == value[1 : n // 2]
        assert st.read_range(key, n - 1, n) == value[-1:]
        assert st.read_range(key, 3, 3) == b""

    def test_read_range_past_the_end_is_truncated(self, populated: Populated) -> None:
        st, key = populated.storage, self.largest(populated)
        n = len(populated.contents[key])
        with pytest.raises(CkptError, match=rf"truncated: needed bytes \[{n - 1}, {n + 4}\) but it has {n} bytes"):
            st.read_range(key, n - 1, n + 4)

    def test_invalid_range_refused(self, populated: Populated) -> None:
        st, key = populated.storage, self.largest(populated)
        for start, end in ((-1, 2), (5, 4)):
            with pytest.raises(CkptError, match="invalid byte range"):
                st.read_range(key, start, end)
        with pytest.raises(CkptError, match="invalid byte range"):
            st.read_range_into(key, -1, bytearray(2))

    def test_read_range_into_fills_the_buffer(self, populated: Populated) -> None:
        st, key = populated.storage, self.largest(populated)
        value = populated.contents[key]
        buf = bytearray(len(value) - 2)
        st.read_range_into(key, 2, buf)
        assert buf == value[2:]
        st.read_range_into(key, 0, bytearray(0))  # nothing to read: no error
        n = len(value)
        with pytest.raises(CkptError, match=rf"truncated: needed bytes \[{n - 2}, {n + 2}\) but it has {n} bytes"):
            st.read_range_into(key, n - 2, bytearray(4))

    @pytest.mark.parametrize("bulk", [False, True], ids=["point-reads", "one-walk"])
    def test_read_many(self, populated: Populated, monkeypatch: pytest.MonkeyPatch, bulk: bool) -> None:
        # bulk: every read of several keys goes the way of many keys (OCDBT views: one B+tree walk)
        monkeypatch.setattr(ocdbt_bulk, "BULK_MIN_KEYS", 1 if bulk else 10**9)
        st = populated.storage
        keys = sorted(populated.contents)
        got = st.read_many([*keys, "no-such-key"])
        assert got == {**populated.contents, "no-such-key": None}
        pending = st.start_reads(keys[:1])
        assert pending.result() == {keys[0]: populated.contents[keys[0]]}

    def test_missing_key_is_not_found(self, populated: Populated) -> None:
        st = populated.storage
        for attempt in (lambda: st.read("nope"), lambda: st.read_range("nope", 0, 1),
                        lambda: st.read_range_into("nope", 0, bytearray(1)), lambda: st.size("nope"),
                        lambda: st.read(f"{self.nested_dir(populated)}/nope")):
            with pytest.raises(NotFoundError):
                attempt()

    def test_reads_are_logged_per_key(self, populated: Populated) -> None:
        st, key = populated.storage, self.largest(populated)
        st.read(key)
        st.read_range(key, 0, 1)
        st.read_range_into(key, 0, bytearray(1))
        st.read_many([key])
        assert st.log.reads[key] == 4
        st.size(key)
        st.exists(key)
        st.list()
        assert st.log.reads[key] == 4  # sizes, probes and listings read no value
        child = st.child(self.nested_dir(populated))
        assert child.log is st.log

    def test_child_reads_the_sub_directory(self, populated: Populated) -> None:
        st, d = populated.storage, self.nested_dir(populated)
        child = st.child(d)
        assert child.url == f"{st.url}/{d}"
        assert child.capabilities == st.capabilities
        for key, value in populated.contents.items():
            if key.startswith(d + "/"):
                assert child.read(key[len(d) + 1 :]) == value
        assert st.child("") is st

    def test_kvstore_spec_opens_the_same_values(self, populated: Populated) -> None:
        # what readers hand tensorstore to open arrays under a sub-directory themselves
        st, d = populated.storage, self.nested_dir(populated)
        for store, prefix in ((st, ""), (st.child(d), d + "/")):
            kv = store.wait(ts.KvStore.open(store.kvstore_spec(""), context=store.context), "open", store.url)
            for key, value in populated.contents.items():
                if key.startswith(prefix):
                    assert bytes(kv.read(key[len(prefix):]).result().value) == value, key
        sub = st.wait(ts.KvStore.open(st.kvstore_spec(d + "/"), context=st.context), "open", st.url)
        assert sorted(k.decode() for k in sub.list().result()) == st.child(d).list()

    def test_error_names_the_key_url(self, populated: Populated) -> None:
        st = populated.storage
        with pytest.raises(NotFoundError) as info:
            st.read("nope")
        assert info.value.where == f"{st.url}/nope"
        assert len(str(info.value).splitlines()) == 1

    # -- containment -----------------------------------------------------------------------
    @pytest.mark.parametrize("key", ["../x", "sub/../../x", "/etc/passwd", "C:\\x", "a\x00b"])
    def test_escaping_keys_refused(self, populated: Populated, key: str) -> None:
        st = populated.storage
        for attempt in (lambda: st.read(key), lambda: st.read_range(key, 0, 1), lambda: st.size(key),
                        lambda: st.exists(key), lambda: st.child(key), lambda: st.read_many([key])):
            with pytest.raises(PathEscapeError):
                attempt()

    def test_empty_key_refused(self, populated: Populated) -> None:
        with pytest.raises(CkptError, match="empty key"):
            populated.storage.read("")

    def test_symlinks_out_and_special_files_refused(self, populated: Populated, tmp_path: Path) -> None:
        st = populated.storage
        needs(st, "symlinks")
        assert populated.root is not None
        outside = tmp_path / "outside-the-root"
        outside.mkdir()
        (outside / "secret").write_text("secret")
        inside = self.largest(populated)
        os.symlink(outside / "secret", populated.root / "link_out")
        os.symlink(outside, populated.root / "dir_out")
        os.symlink(populated.root / inside, populated.root / "link_in")
        os.mkfifo(populated.root / "fifo")
        with pytest.raises(PathEscapeError, match="outside the checkpoint"):
            st.read("link_out")
        with pytest.raises(PathEscapeError, match="outside the checkpoint"):
            st.read_range_into("link_out", 0, bytearray(1))
        with pytest.raises(PathEscapeError):
            st.child("dir_out")
        for read_fifo in (lambda: st.read("fifo"), lambda: st.read_range_into("fifo", 0, bytearray(1))):
            with pytest.raises(PathEscapeError, match="not a regular file"):
                read_fifo()  # refused, never blocking on the FIFO
        assert st.read("link_in") == populated.contents[inside]
        # what tensorstore opens itself is scanned first (guard), and validate lists every problem
        with pytest.raises(PathEscapeError):
            st.guard()
        assert sorted(p for p, _ in st.containment_problems()) == ["dir_out", "fifo", "link_out"]
        with pytest.raises(PathEscapeError):
            st.kvstore_spec("")

    def test_symlink_loop_is_one_line(self, populated: Populated) -> None:
        st = populated.storage
        needs(st, "symlinks")
        assert populated.root is not None
        os.symlink(populated.root / "loop", populated.root / "loop")
        with pytest.raises(PathEscapeError, match="symlink loop|outside the checkpoint"):
            st.read("loop")

    # -- writing ---------------------------------------------------------------------------
    def test_write_read_back_and_delete(self, populated: Populated) -> None:
        st = populated.storage
        if not st.capabilities.writable:
            for attempt in (lambda: st.write("new", b"x"), lambda: st.delete(self.largest(populated)), st.delete_all):
                with pytest.raises(CkptError, match="read-only"):
                    attempt()
            assert st.list() == sorted(populated.contents)  # nothing was touched
        needs(st, "writable")
        before = st.list()  # remembered: a write must forget it
        st.write("new/x.bin", b"abc")
        assert st.read("new/x.bin") == b"abc"
        assert st.list() == sorted([*before, "new/x.bin"])
        st.write("new/x.bin", b"replaced")  # a whole value is replaced
        assert st.read("new/x.bin") == b"replaced"
        st.delete("new/x.bin")
        assert not st.exists("new/x.bin")
        assert st.list() == before
        st.delete("never-written")  # missing is fine
        with pytest.raises(CkptError, match="empty key"):
            st.write("", b"x")
        with pytest.raises(PathEscapeError):
            st.write("../escape", b"x")

    def test_delete_all_empties_the_root(self, populated: Populated) -> None:
        st = populated.storage
        needs(st, "writable")
        st.list()
        st.delete_all()
        assert st.list() == []

    def test_create_opens_a_new_root(self, populated: Populated) -> None:
        st = populated.storage
        needs(st, "writable")
        out = Storage.create(st.url + "/created-root")
        out.write("k", b"v")
        assert Storage.open(st.url + "/created-root").read("k") == b"v"

    def test_local_file_is_created_once_and_durable(self, populated: Populated) -> None:
        st = populated.storage
        if not st.capabilities.local_files:
            assert st.create_local_file("new.bin") is None  # callers fall back to write()
            assert st.page_cache_dropper("") is None
            st.fsync_tree("")  # nothing to sync: a value is held once its write returns
            pytest.skip(f"{st.backend_kind} storage has no local_files")
        writer = st.create_local_file("made/new.bin")
        assert writer is not None
        start, _ = writer.place(0, 5)
        writer.write_at(start, [b"hello"])
        writer.close()
        assert st.read("made/new.bin") == b"hello"
        with pytest.raises(CkptError):
            st.create_local_file("made/new.bin")  # never over an existing file
        with pytest.raises(PathEscapeError):
            st.create_local_file("../escape.bin")
        st.fsync_tree("made")

    # -- deadlines -------------------------------------------------------------------------
    def test_no_answer_within_the_deadline_fails_fast(self, populated: Populated,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
        st = populated.storage
        needs(st, "deadlines")
        assert st.endpoint is not None
        monkeypatch.setattr(remote, "IO_TIMEOUT", 0.2)
        monkeypatch.setattr(remote, "_FAILURES", [])  # this test's failure stays its own
        pair: tuple[Any, Any] = ts.Promise.new()  # (promise, future): a request the endpoint never answers
        never = pair[1]
        with pytest.raises(StorageUnavailableError, match=rf"storage endpoint {st.endpoint} gave no answer within 0.2 s"):
            st.wait(never, "cannot read", st.url + "/x")
        # the rest of the run fails at once with the same line, without another request
        with pytest.raises(StorageUnavailableError, match="gave no answer"):
            st.read(self.largest(populated))
