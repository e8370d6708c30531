"""A local root is listed by the file system, not through tensorstore's file kvstore (issue 46: a
`ckpt inspect` of a local DCP imports no tensorstore), by the kvstore's own rule: the two listings
are equal on every fixture and on a tree of the odd entries a directory can hold."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import tensorstore as ts

from conftest import FIXTURES, ROOT

from ckpt_tool.base.errors import CkptError
from ckpt_tool.storage import Storage


def _kvstore_keys(path: str, prefix: str = "") -> list[str]:
    kv = ts.KvStore.open({"driver": "file", "path": path.rstrip("/") + "/"}).result()
    if prefix:
        keys = kv.list(ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=prefix[:-1] + "0")).result()
    else:
        keys = kv.list().result()
    return sorted(k for k in (k.decode("utf-8", "surrogateescape") for k in keys) if k.startswith(prefix))


def _ours(path: str, prefix: str = "") -> list[str]:
    return Storage.open(path).backend.list_keys(prefix)


def _odd_tree(root) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / ".hidden").mkdir()
    (root / "d.__lock").mkdir()  # a directory of that name is walked; a file of it is the kvstore's lock
    for name in ("f", "a/b/g", ".hidden/h", "x.__lock", "a/y.__lock", ".__lock", "a/z.__lockx", "d.__lock/in",
                 "sp ace", "back\\slash", "new\nline"):
        (root / name).write_text(name)
    os.symlink("f", root / "link_f")
    os.symlink("a", root / "link_d")  # a key, not walked
    os.symlink("nowhere", root / "broken")
    os.symlink("loop", root / "loop")
    os.symlink("/etc", root / "out")
    os.mkfifo(root / "fifo")
    with open(os.path.join(os.fsencode(root), b"bad\xff"), "w") as f:
        f.write("x")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(root / "sock"))
    except OSError:
        pass
    finally:
        s.close()


def test_odd_entries_listed_as_the_file_kvstore_lists_them(tmp_path):
    _odd_tree(tmp_path)
    assert _ours(str(tmp_path)) == _kvstore_keys(str(tmp_path))
    for prefix in ("a/", "a/b/", "link_d/", "empty/", "missing/", ".hidden/"):  # (d.__lock/: the kvstore refuses the key)
        assert _ours(str(tmp_path), prefix) == _kvstore_keys(str(tmp_path), prefix), prefix
    with pytest.raises(ValueError, match="Cannot list non-directory"):
        _kvstore_keys(str(tmp_path), "f/")
    with pytest.raises(CkptError, match="cannot list keys: not a directory"):
        _ours(str(tmp_path), "f/")
    assert "link_d" in _ours(str(tmp_path)) and "x.__lock" not in _ours(str(tmp_path))


def test_every_fixture_listed_as_the_file_kvstore_lists_it():
    seen = 0
    for top in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        for path in [top, *sorted(p for p in top.rglob("*") if p.is_dir() and not p.is_symlink())][:20]:
            assert _ours(str(path)) == _kvstore_keys(str(path)), path
            seen += 1
    assert seen > 100


def test_a_local_dcp_inspect_imports_no_tensorstore():
    code = ("import sys, io, contextlib, ckpt_tool.cli.main as m\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert m._run(['inspect', {str(FIXTURES / 'dcp_multirank')!r}, '--json']) == 0\n"
            f"    assert m._run(['validate', {str(FIXTURES / 'dcp_single')!r}]) == 0\n"
            "print('tensorstore' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
def test_an_unreadable_directory_is_one_line(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    os.chmod(tmp_path / "d", 0)
    try:
        with pytest.raises(Exception) as info:
            _ours(str(tmp_path))
        assert "cannot list keys" in str(info.value) and str(tmp_path / "d") in str(info.value)
    finally:
        os.chmod(tmp_path / "d", 0o755)
