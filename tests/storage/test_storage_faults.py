"""Local storage faults: FIFOs, devices and symlinks anywhere tensorstore or ckpt opens a file,
symlink loops, a source truncated while it is converted, SIGTERM, two converts racing for one DST.

Every case runs on a copy of a real fixture. Reads that might block (a FIFO
opened for reading waits for a writer forever) run on a daemon thread with a
deadline, so a regression fails the test instead of hanging the suite.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from ckpt_tool.ops import engine
from ckpt_tool.ops.engine import ConvertOptions, convert
from ckpt_tool.base.errors import CkptError, PathEscapeError
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import ROOT, fixture_path, run_ckpt

DEADLINE_S = 20


def within_deadline(fn: Callable[[], Any]) -> Any:
    """fn() on a daemon thread; its result or exception; a test failure if it blocks."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    if t.is_alive():
        pytest.fail(f"blocked for {DEADLINE_S} s (a FIFO or device was opened?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def first(path: Path, pattern: str) -> Path:
    found = sorted(path.glob(pattern))
    assert found, pattern
    return found[0]


# where tensorstore or ckpt opens a file: (fixture, glob of the file replaced)
PLACES = [
    ("orbax_ocdbt_zarr2", "manifest.ocdbt"),
    ("orbax_ocdbt_zarr2", "ocdbt.process_0/manifest.ocdbt"),
    ("orbax_ocdbt_zarr2", "d/*"),
    ("orbax_ocdbt_zarr2", "ocdbt.process_0/d/*"),
    ("orbax_ocdbt_zarr2", "_METADATA"),
    ("orbax_two_process", "ocdbt.process_1/manifest.ocdbt"),
    ("orbax_plain_zarr2", "params.dense.kernel/1.1"),
    ("orbax_plain_zarr2", "params.dense.kernel/.zarray"),
    ("dcp_multirank", ".metadata"),
    ("dcp_multirank", "__0_0.distcp"),
]
IDS = [f"{n}:{p}" for n, p in PLACES]
# inspect reads metadata only: a plain chunk or a DCP data file is never opened by it
READ_BY_INSPECT = {p for p in PLACES if not p[1].endswith(("1.1", ".distcp"))}


def _other(name: str) -> str:
    return "dcp" if name.startswith("orbax") else "orbax"


def _replace(copy_fixture, name: str, pattern: str, make: Callable[[Path], None]) -> tuple[Path, str]:
    ckpt = copy_fixture(name)
    target = first(ckpt, pattern)
    rel = str(target.relative_to(ckpt))
    target.unlink()
    make(target)
    return ckpt, rel


def _check_refused(ckpt: Path, rel: str, place: tuple[str, str], tmp_path: Path, what: str) -> None:
    """validate names it as path-escape; inspect (when it reads it) and convert refuse it in one line."""
    report = within_deadline(lambda: validate_checkpoint(str(ckpt), deep=True))
    escapes = [f for f in report.findings if f.code == "path-escape"]
    assert [f.file for f in escapes] == [rel], report.findings
    assert what in escapes[0].message
    assert not report.ok()
    if place in READ_BY_INSPECT:
        with pytest.raises(PathEscapeError, match=what):
            within_deadline(lambda: open_checkpoint(str(ckpt)))
    dst = tmp_path / "out"
    with pytest.raises(PathEscapeError, match=what) as info:
        within_deadline(lambda: convert(str(ckpt), str(dst), ConvertOptions(to=_other(place[0]))))
    assert rel in str(info.value)
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("place", PLACES, ids=IDS)
def test_fifo_is_refused_before_any_read(copy_fixture, tmp_path, place):
    ckpt, rel = _replace(copy_fixture, *place, lambda p: os.mkfifo(p))
    _check_refused(ckpt, rel, place, tmp_path, "not a regular file")


@pytest.mark.parametrize("place", PLACES, ids=IDS)
def test_symlink_out_of_the_root_is_never_followed(copy_fixture, tmp_path, place):
    # the link points at a FIFO outside: following it even once would block
    bait = tmp_path / "outside.fifo"
    os.mkfifo(bait)
    ckpt, rel = _replace(copy_fixture, *place, lambda p: os.symlink(bait, p))
    _check_refused(ckpt, rel, place, tmp_path, "outside the checkpoint")


@pytest.mark.parametrize("place", [p for p in PLACES if p[1] in ("d/*", "params.dense.kernel/1.1", "__0_0.distcp")],
                         ids=lambda p: f"{p[0]}:{p[1]}")
def test_data_linked_to_dev_zero_is_refused(copy_fixture, tmp_path, place):
    ckpt, rel = _replace(copy_fixture, *place, lambda p: os.symlink("/dev/zero", p))
    report = within_deadline(lambda: validate_checkpoint(str(ckpt)))  # shallow
    assert [(f.code, f.file) for f in report.findings if f.code == "path-escape"] == [("path-escape", rel)]
    assert "/dev/zero" in report.findings[0].message or any("/dev/zero" in f.message for f in report.findings)
    _check_refused(ckpt, rel, place, tmp_path, "outside the checkpoint")


@pytest.mark.parametrize("place", [p for p in PLACES if p[1] in ("manifest.ocdbt", "params.dense.kernel/1.1", ".metadata")],
                         ids=lambda p: f"{p[0]}:{p[1]}")
def test_symlink_loop_is_one_clean_error(copy_fixture, tmp_path, place):
    ckpt, rel = _replace(copy_fixture, *place, lambda p: os.symlink(p, p))
    _check_refused(ckpt, rel, place, tmp_path, "symlink loop")
    # and as a whole command: one line, no OSError text
    r = run_ckpt("convert", str(ckpt), str(tmp_path / "out2"), "--to", _other(place[0]))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "symlink loop (Too many levels of symbolic links)" in lines[0], r.stderr
    assert "OSError" not in r.stderr and "internal error" not in r.stderr


def test_process_database_directory_linked_out_is_refused(copy_fixture, tmp_path):
    ckpt = copy_fixture("orbax_ocdbt_zarr2")
    moved = tmp_path / "elsewhere"
    (ckpt / "ocdbt.process_0").rename(moved)
    os.symlink(moved, ckpt / "ocdbt.process_0")
    report = within_deadline(lambda: validate_checkpoint(str(ckpt), deep=True))
    assert [(f.code, f.file) for f in report.findings if f.code == "path-escape"] == [("path-escape", "ocdbt.process_0")]
    with pytest.raises(PathEscapeError, match="outside the checkpoint"):
        within_deadline(lambda: open_checkpoint(str(ckpt)))


def test_links_that_stay_inside_the_root_are_fine(copy_fixture, tmp_path):
    """Containment is about where a link leads, not about links: inside the root they are read."""
    ckpt = copy_fixture("orbax_ocdbt_zarr2")
    keep = ckpt / "ocdbt.process_0" / "kept"
    keep.mkdir()
    for f in sorted((ckpt / "ocdbt.process_0" / "d").iterdir()):
        f.rename(keep / f.name)
        os.symlink(Path("..") / "kept" / f.name, f)  # relative, inside the root
    (ckpt / "ocdbt.process_0" / "manifest.ocdbt").rename(ckpt / "manifest.process_0")
    os.symlink(ckpt / "manifest.process_0", ckpt / "ocdbt.process_0" / "manifest.ocdbt")  # absolute, inside
    report = within_deadline(lambda: validate_checkpoint(str(ckpt), deep=True))
    assert report.ok(), report.findings
    dst = tmp_path / "out"
    convert(str(ckpt), str(dst), ConvertOptions(to="dcp"))
    r = run_ckpt("diff", str(fixture_path("orbax_ocdbt_zarr2")), str(dst), "--values")
    assert r.returncode == 0, r.stdout + r.stderr


def test_fifo_as_the_checkpoint_root_or_step_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "root.fifo")
    r = run_ckpt("inspect", str(tmp_path / "root.fifo"), timeout=DEADLINE_S)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    r = run_ckpt("validate", str(tmp_path / "loop"), timeout=DEADLINE_S)
    assert r.returncode == 1 and "symlink loop" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_fifo_swapped_in_after_the_check_does_not_block(tmp_path):
    """The race the lstat cannot close: the open itself is non-blocking and re-checks the type."""
    from ckpt_tool.storage import Storage

    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "a.bin").write_bytes(b"0123456789")
    st = Storage.open(str(root))
    real_check = st._check_local_path

    def swap_after_check(rel: str, *, want_dir: bool) -> None:
        real_check(rel, want_dir=want_dir)
        (root / "a.bin").unlink()
        os.mkfifo(root / "a.bin")  # between the check and the open

    st._check_local_path = swap_after_check  # type: ignore[method-assign]
    with pytest.raises(PathEscapeError, match="not a regular file"):
        within_deadline(lambda: st.read_range("a.bin", 0, 4))


# -- a source that shrinks while it is converted ----------------------------------------

# the convert runs as a whole process; a hook in the format's reader truncates
# the source's data files the first time array data is read, so every read
# after that finds the file shorter than the metadata says (as when another
# job rewrites the checkpoint underneath)
_TRUNCATING_CONVERT = textwrap.dedent("""
    import os, sys, threading
    from pathlib import Path
    src, dst, to, pattern, reader = sys.argv[1:6]
    import ckpt_tool.formats.orbax.reader as ob
    import ckpt_tool.machinery.dcp.reader as dcp
    # dcp: the first range read of an archive (a small tensor's data comes from the archive read whole to
    # locate its payload: no read_range_into is left to hook for the fixtures' small tensors)
    cls, attr = {"orbax": (ob.ZarrRegionReader, "read"), "dcp": (dcp.Storage, "read_range")}[reader]
    real = getattr(cls, attr)
    done = threading.Event()
    lock = threading.Lock()
    def hooked(self, *a, **k):
        with lock:
            if not done.is_set():
                for f in Path(src).glob(pattern):
                    os.truncate(f, f.stat().st_size // 3)
                done.set()
        return real(self, *a, **k)
    setattr(cls, attr, hooked)
    from ckpt_tool.cli.main import main
    main(["convert", src, dst, "--to", to])
""")


@pytest.mark.parametrize("name, to, pattern, reader", [
    ("orbax_ocdbt_zarr2", "dcp", "**/d/*", "orbax"),
    ("orbax_plain_zarr2", "dcp", "*/[0-9]*", "orbax"),
    ("dcp_multirank", "orbax", "*.distcp", "dcp"),
])
def test_source_truncated_during_convert_is_one_line(copy_fixture, tmp_path, name, to, pattern, reader):
    src = copy_fixture(name)
    dst = tmp_path / "out"
    env = dict(os.environ)
    env.pop("CKPT_DEBUG", None)
    r = subprocess.run([sys.executable, "-c", _TRUNCATING_CONVERT, str(src), str(dst), to, pattern, reader],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr)  # not -SIGBUS (or 135 from a shell)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), r.stderr
    assert "internal error" not in lines[0] and "SystemError" not in r.stderr
    assert str(src) in lines[0] or any(p.name in lines[0] for p in src.glob(pattern)), lines[0]
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


# -- interrupted and racing converts ----------------------------------------------------

_SLOW_CONVERT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    src, dst, ready = sys.argv[1:4]
    import ckpt_tool.ops.engine as engine
    real = engine.stream
    def slow(*a, **k):
        Path(ready).write_text("writing")  # the temporary output exists now
        time.sleep(60)
        return real(*a, **k)
    engine.stream = slow
    from ckpt_tool.cli.main import main
    main(["convert", src, dst, "--to", "orbax"])
""")


def test_sigterm_mid_convert_leaves_no_temporary_output(tmp_path):
    dst = tmp_path / "out"
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, str(fixture_path("dcp_multirank")), str(dst), str(ready)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out")], "no temporary output to clean up"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (proc.returncode, err)  # unwound, not killed by the signal
    assert err.strip() in ("ckpt: aborted", "ckpt: interrupted")  # click turns the interrupt into its Abort
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_destination_appearing_at_the_rename_is_one_clean_line(tmp_path, monkeypatch):
    """The loser of two converts racing into one DST: its rename finds DST there (ENOTEMPTY)."""
    dst = tmp_path / "out"
    real_lexists = os.path.lexists
    calls = []

    def lexists(path):
        if Path(path) == dst:
            calls.append(path)
            if len(calls) == 2:  # the check just before the rename: the other run finishes now
                monkeypatch.setattr(engine.os.path, "lexists", real_lexists)
                convert(str(fixture_path("dcp_single")), str(dst), ConvertOptions(to="orbax"))
                return False  # what this run saw a moment before
        return real_lexists(path)

    monkeypatch.setattr(engine.os.path, "lexists", lexists)
    with pytest.raises(CkptError, match="destination appeared while converting; another run wrote it first") as info:
        convert(str(fixture_path("dcp_multirank")), str(dst), ConvertOptions(to="orbax"))
    assert "Directory not empty" not in str(info.value)
    monkeypatch.undo()
    assert validate_checkpoint(str(dst)).ok()  # the winner's output is intact
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the loser's temporary output is gone


@pytest.mark.slow
def test_two_converts_racing_into_one_destination(tmp_path):
    """Whole processes: one wins; the other says so in one line; nothing temporary stays."""
    dst = tmp_path / "out"
    env = dict(os.environ)
    env.pop("CKPT_DEBUG", None)
    procs = [
        subprocess.Popen([sys.executable, "-m", "ckpt_tool", "convert", str(fixture_path(name)), str(dst), "--to", "orbax"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in ("dcp_multirank", "dcp_single")
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = next(err for code, err in results if code == 1)
    assert len(loser.strip().splitlines()) == 1 and "destination" in loser, loser
    assert "Directory not empty" not in loser and "internal error" not in loser
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert validate_checkpoint(str(dst)).ok()


def test_rename_errors_other_than_the_race_are_one_line(tmp_path, monkeypatch):
    out = engine.prepare_output(str(fixture_path("dcp_single")), str(tmp_path / "out"), overwrite=False)
    os.makedirs(out.local_tmp)

    def refuse(a, b):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(engine.os, "rename", refuse)
    with pytest.raises(CkptError, match="cannot move the output into place: Permission denied"):
        engine.finalize_output(out, overwrite=False)


def test_one_file_validated_by_its_path_does_not_scan_its_directory(tmp_path):
    # the file's directory may be a home directory: what lies beside the file is not the checkpoint's
    import shutil

    shutil.copy(fixture_path("safetensors_numpy") / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "elsewhere").mkdir()
    os.symlink("/dev/zero", tmp_path / "elsewhere" / "zero")
    os.mkfifo(tmp_path / "pipe")
    report = within_deadline(lambda: validate_checkpoint(str(tmp_path / "model.safetensors")))
    assert report.ok(True), [f.to_json() for f in report.findings]
    # the file itself is still checked: a link out is refused
    os.symlink("/etc/passwd", tmp_path / "link.safetensors")
    report = within_deadline(lambda: validate_checkpoint(str(tmp_path / "link.safetensors")))
    assert [f.code for f in report.findings] == ["path-escape"]
