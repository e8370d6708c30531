"""What convert/reshard may replace, what they leave behind, and what their errors name (issue 18).

Real files beside DST and asserts that they survive: `--overwrite` replaces
only a checkpoint ckpt recognises or an empty directory; a SIGKILLed run's
temporary output is found by the next run (removed when its owner is gone,
a refusal while its owner runs) and by `ckpt validate`; errors name DST, not
the hidden temporary directory.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

import ckpt_tool
from ckpt_tool.ops.engine import ConvertOptions, convert
from ckpt_tool.base.errors import CkptError
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import (
    OWNER_RECORD as OWNER,
    ROOT,
    convert_until_owner_record,
    empty_dst_filled_meanwhile,
    fixture_path,
    moto_s3_serving,
    run_ckpt,
    s3_client,
    upload_fixture,
)

SRC = str(fixture_path("dcp_single"))


def _run(*args: str, cwd: Path | str = ROOT, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`python -m ckpt_tool` as a whole process from `cwd` (run_ckpt always runs from the repository)."""
    full = dict(os.environ)
    full.pop("CKPT_DEBUG", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *args], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=120, **kw)


def _snapshot(path: Path) -> dict[str, str]:
    """Every file under `path` (or the file itself) with a hash of its bytes."""
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def _project(path: Path) -> Path:
    """A user's directory: notes, a script, a sub-directory of code."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "notes.txt").write_text("what I tried on Tuesday\n")
    (path / "run.py").write_text("print('training')\n")
    (path / "src").mkdir()
    (path / "src" / "model.py").write_text("class Model: ...\n")
    return path


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def _temps(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if ".ckpt-tmp" in p.name)


# -- --overwrite replaces only a checkpoint or an empty directory ---------------------


@pytest.mark.slow
def test_overwrite_refuses_a_directory_of_notes_and_a_script(tmp_path):
    dst = _project(tmp_path / "work")
    before = _snapshot(dst)
    line = _one_line(run_ckpt("convert", SRC, str(dst), "--to", "orbax", "--overwrite"))
    assert str(dst) in line and "not a checkpoint" in line and "notes.txt" in line and "run.py" in line, line
    assert "refusing to replace it" in line
    # without the flag: DST exists, and the message does not suggest a flag that would be refused too
    line = _one_line(run_ckpt("convert", SRC, str(dst), "--to", "orbax"))
    assert "destination exists" in line and "--overwrite" not in line, line
    assert _snapshot(dst) == before
    assert _temps(tmp_path) == []


@pytest.mark.slow
def test_overwrite_refuses_a_regular_file(tmp_path):
    dst = tmp_path / "train.py"
    dst.write_text("import torch\nprint('my training script')\n")
    before = _snapshot(dst)
    line = _one_line(run_ckpt("convert", SRC, str(dst), "--to", "dcp", "--overwrite"))
    assert "regular file" in line and "refusing to replace it" in line, line
    assert dst.is_file() and _snapshot(dst) == before
    assert _temps(tmp_path) == []


@pytest.mark.slow
def test_overwrite_refuses_the_working_directory(tmp_path):
    project = _project(tmp_path / "project")
    before = _snapshot(project)
    line = _one_line(_run("convert", SRC, ".", "--to", "dcp", "--overwrite", cwd=project))
    assert "working directory" in line, line
    assert _snapshot(project) == before
    # its parent holds it: refused too
    line = _one_line(_run("convert", SRC, "..", "--to", "dcp", "--overwrite", cwd=project))
    assert "working directory" in line, line
    assert _snapshot(project) == before


@pytest.mark.slow
def test_overwrite_refuses_the_home_directory(tmp_path):
    home = _project(tmp_path / "home")
    (home / ".bashrc").write_text("export PATH=$PATH\n")
    before = _snapshot(home)
    for dst in ("~", str(home)):
        line = _one_line(_run("convert", SRC, dst, "--to", "orbax", "--overwrite", env={"HOME": str(home)},
                              cwd=tmp_path))
        assert "home directory" in line, line
    assert _snapshot(home) == before


@pytest.mark.slow
def test_overwrite_refuses_an_ancestor_of_the_source(tmp_path):
    project = _project(tmp_path / "project")
    shutil.copytree(SRC, project / "ckpt")
    before = _snapshot(project)
    line = _one_line(run_ckpt("convert", str(project / "ckpt"), str(project), "--to", "orbax", "--overwrite"))
    assert "source" in line, line
    assert _snapshot(project) == before


def test_overwrite_refuses_a_version_controlled_checkpoint_directory(tmp_path):
    # a model repository cloned with git: a checkpoint ckpt reads, and someone's work
    clone = tmp_path / "clone"
    shutil.copytree(fixture_path("safetensors_numpy"), clone)
    (clone / ".git").mkdir()
    (clone / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    before = _snapshot(clone)
    line = _one_line(run_ckpt("convert", SRC, str(clone), "--to", "orbax", "--overwrite"))
    assert "version-controlled" in line, line
    assert _snapshot(clone) == before


@pytest.mark.slow
def test_overwrite_replaces_a_checkpoint_ckpt_wrote(tmp_path):
    dst = tmp_path / "out"
    assert run_ckpt("convert", SRC, str(dst), "--to", "orbax").returncode == 0
    assert ckpt_tool.open(str(dst)).format == "orbax"
    line = _one_line(run_ckpt("convert", SRC, str(dst), "--to", "dcp"))
    assert "destination exists" in line and "--overwrite" in line, line  # the hint where it would work
    r = run_ckpt("convert", SRC, str(dst), "--to", "dcp", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert ckpt_tool.open(str(dst)).format == "dcp" and validate_checkpoint(str(dst)).ok()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # neither the old output nor a temporary stays
    assert not (dst / OWNER).exists()


@pytest.mark.slow
def test_overwrite_replaces_an_empty_directory(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    r = run_ckpt("convert", SRC, str(dst), "--to", "dcp", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert validate_checkpoint(str(dst)).ok()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_destination_that_became_a_non_checkpoint_meanwhile_is_not_replaced(tmp_path):
    """Checked when the run starts AND on what is moved aside at the end: DST may change in between."""
    dst, progress = empty_dst_filled_meanwhile(tmp_path)  # empty: accepted when the run starts
    with pytest.raises(CkptError, match="refusing to replace it") as info:
        convert(SRC, str(dst), ConvertOptions(to="dcp", overwrite=True), progress=progress)
    assert "notes.txt" in str(info.value) and ".ckpt-tmp" not in str(info.value)
    assert (dst / "notes.txt").read_text() == "written while the convert ran\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# -- temporaries of killed runs ---------------------------------------------------------


def _killed_convert(src: Path, dst: Path) -> tuple[Path, int]:
    """Start a real convert into `dst`, SIGKILL it once its temporary output holds its owner record."""
    proc, temp = convert_until_owner_record(src, dst)
    time.sleep(0.1)  # a few chunks in
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the convert ended before it could be killed"
    assert temp is not None and temp.is_dir() and not dst.exists()
    return temp, proc.pid


@pytest.mark.slow
def test_sigkilled_convert_is_listed_by_validate_and_removed_by_the_next_run(tmp_path, big_safetensors):
    run = tmp_path / "run"
    assert run_ckpt("convert", SRC, str(run / "5"), "--to", "orbax").returncode == 0  # a run root of steps
    temp, pid = _killed_convert(big_safetensors, run / "6")
    owner = json.loads((temp / OWNER).read_text())
    assert owner["pid"] == pid and owner["host"] == socket.gethostname()

    # validate on the run root: the leftover is a warning (the checkpoint itself is fine)
    r = run_ckpt("validate", str(run), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    stale = [f for f in report["findings"] if f["code"] == "stale-temporary"]
    assert len(stale) == 1 and stale[0]["severity"] == "warning" and stale[0]["file"] == temp.name, report
    assert f"pid {pid}" in stale[0]["message"]
    assert run_ckpt("validate", str(run), "--strict").returncode == 1

    # the next run to the same DST removes it, and says so in one line
    r = run_ckpt("convert", SRC, str(run / "6"), "--to", "dcp")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if temp.name in line]
    assert len(said) == 1 and said[0].startswith("removed 1 temporary output") and f"pid {pid}" in said[0], r.stdout
    assert not temp.exists()
    assert sorted(p.name for p in run.iterdir()) == ["5", "6"]
    assert validate_checkpoint(str(run / "6")).ok()


def _fake_temp(parent: Path, base: str, owner: dict | None, suffix: str = "-0a1b2c3d") -> Path:
    temp = parent / f".{base}.ckpt-tmp{suffix}"
    temp.mkdir(parents=True)
    (temp / "__0_0.distcp").write_bytes(b"partial data")
    if owner is not None:
        (temp / OWNER).write_text(json.dumps(owner))
    return temp


def _pid_start(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[19])


def _owner(pid: int, pid_start: int | None, host: str | None = None, started: float | None = None) -> dict:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    machine = Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").exists() else None
    return {"tool": "ckpt", "destination": "out", "host": host or socket.gethostname(), "pid": pid,
            "pid_start": pid_start, "boot_id": boot, "machine_id": machine, "started": started or time.time()}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_temporary_whose_owner_runs_makes_the_run_refuse(tmp_path):
    me = os.getpid()
    temp = _fake_temp(tmp_path, "out", _owner(me, _pid_start(me)))
    before = _snapshot(temp)
    line = _one_line(run_ckpt("convert", SRC, str(tmp_path / "out"), "--to", "dcp"))
    assert "another ckpt is writing this destination" in line and f"pid {me} on {socket.gethostname()}" in line, line
    assert str(tmp_path / "out") in line
    assert _snapshot(temp) == before and not (tmp_path / "out").exists()
    assert _temps(tmp_path) == [temp]
    # and validate does not call a running write stale
    report = validate_checkpoint(str(fixture_path("orbax_manager")))
    assert not [f for f in report.findings if f.code == "stale-temporary"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_reused_pid_is_not_the_owner(tmp_path):
    """The owner's pid runs again, but started at another time: another process; its temporary goes."""
    me = os.getpid()
    temp = _fake_temp(tmp_path, "out", _owner(me, _pid_start(me) - 1))
    r = run_ckpt("convert", SRC, str(tmp_path / "out"), "--to", "dcp", "--json")
    assert r.returncode == 0, r.stderr
    [line] = json.loads(r.stdout)["cleanup"]  # --json: the same line, in the summary
    assert line.startswith("removed 1 temporary output") and temp.name in line and f"pid {me}" in line, line
    assert not temp.exists()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_reshard_removes_a_temporary_whose_owner_is_gone_and_says_so(tmp_path):
    me = os.getpid()
    temp = _fake_temp(tmp_path, "out", _owner(me, _pid_start(me) + 1))
    r = run_ckpt("reshard", str(fixture_path("orbax_ocdbt_zarr2")), str(tmp_path / "out"), "--mesh", "data=1",
                 "--devices", "1")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if temp.name in line]
    assert len(said) == 1 and said[0].startswith("removed 1 temporary output"), r.stdout
    assert not temp.exists() and validate_checkpoint(str(tmp_path / "out")).ok()


@pytest.mark.slow
def test_only_ckpt_temporaries_with_an_owner_record_are_removed(tmp_path):
    # no record (an older ckpt): left, and said; one from another host, recent: left, and said
    unowned = _fake_temp(tmp_path, "out", None, "-11111111")
    elsewhere = _fake_temp(tmp_path, "out", _owner(4242, 1, host="another-host.example"), "-22222222")
    # not ours by name: a user's file and directory that merely look alike
    lookalike_dir = tmp_path / ".out.ckpt-tmp-notes"
    lookalike_dir.mkdir()
    (lookalike_dir / OWNER).write_text(json.dumps(_owner(1, 1)))
    lookalike_file = tmp_path / ".out.ckpt-tmp-33333333"
    lookalike_file.write_text("a file, not a directory")
    # another destination's leftover is not this run's business
    other = _fake_temp(tmp_path, "other", _owner(1, 1, started=0.0), "-44444444")
    before = {p.name: _snapshot(p) for p in (unowned, elsewhere, lookalike_dir, lookalike_file, other)}
    r = run_ckpt("convert", SRC, str(tmp_path / "out"), "--to", "dcp")
    assert r.returncode == 0, r.stderr
    left = [line for line in r.stdout.splitlines() if line.startswith("left ")]
    assert len(left) == 1 and unowned.name in left[0] and elsewhere.name in left[0], r.stdout
    assert "another-host.example" in left[0]
    assert {p.name: _snapshot(p) for p in (unowned, elsewhere, lookalike_dir, lookalike_file, other)} == before


@pytest.mark.slow
def test_an_abandoned_temporary_of_another_host_is_removed(tmp_path):
    old = time.time() - 3 * 24 * 3600
    temp = _fake_temp(tmp_path, "out", _owner(4242, 1, host="another-host.example", started=old))
    for p in [temp, *temp.iterdir()]:
        os.utime(p, (old, old))
    r = run_ckpt("convert", SRC, str(tmp_path / "out"), "--to", "dcp")
    assert r.returncode == 0, r.stderr
    assert "removed 1 temporary output" in r.stdout and "another-host.example" in r.stdout
    assert not temp.exists()


# -- errors name DST ------------------------------------------------------------------


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """`path` refuses new entries, even to root (chattr +i), else by its mode."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
            pytest.skip("running as root on a file system without chattr +i")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)


def test_a_read_only_parent_names_the_destination(tmp_path):
    parent = tmp_path / "readonly"
    parent.mkdir()
    dst = parent / "out"
    with _read_only(parent):
        line = _one_line(run_ckpt("convert", SRC, str(dst), "--to", "dcp"))
    assert line.startswith(f"ckpt: error: {dst}: "), line
    assert ".ckpt-tmp" not in line, line
    assert list(parent.iterdir()) == []


def test_a_failed_write_names_the_destination(tmp_path, big_safetensors):
    """A real write failure from the OS (the file size limit: EFBIG, as a full disk gives ENOSPC)."""
    dst = tmp_path / "out"
    # the limit set in the child itself, which then becomes ckpt (no preexec_fn: a fork of a threaded process)
    limited = [sys.executable, "-c", "import os, resource, sys; "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); "
               "os.execv(sys.executable, [sys.executable, '-m', 'ckpt_tool', *sys.argv[1:]])"]
    env = dict(os.environ)
    env.pop("CKPT_DEBUG", None)
    r = subprocess.run([*limited, "convert", str(big_safetensors), str(dst), "--to", "dcp"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=120)
    line = _one_line(r)
    assert line.startswith(f"ckpt: error: {dst}/"), line
    assert ".ckpt-tmp" not in line and "File too large" in line, line
    assert list(tmp_path.iterdir()) == []


# -- object stores: the same rule for a prefix ---------------------------------------------


@pytest.mark.slow
def test_overwrite_on_s3_replaces_only_a_checkpoint_or_an_empty_prefix():
    bucket = "ckpt-output-safety"
    with moto_s3_serving(bucket, ["dcp_single"]) as env:
        s3 = s3_client(env["AWS_ENDPOINT_URL"])
        s3.put_object(Bucket=bucket, Key="work/notes.txt", Body=b"my notes")
        s3.put_object(Bucket=bucket, Key="work/src/run.py", Body=b"print(1)")
        line = _one_line(run_ckpt("convert", SRC, f"s3://{bucket}/work", "--to", "dcp", "--overwrite", env=env))
        assert "not a checkpoint" in line and "notes.txt" in line and "refusing to replace it" in line, line
        line = _one_line(run_ckpt("convert", SRC, f"s3://{bucket}/work", "--to", "dcp", env=env))
        assert "destination exists" in line and "--overwrite" not in line, line
        kept = {o["Key"]: s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
                for o in s3.list_objects_v2(Bucket=bucket, Prefix="work/")["Contents"]}
        assert kept == {"work/notes.txt": b"my notes", "work/src/run.py": b"print(1)"}
        # a whole bucket is never replaced
        line = _one_line(run_ckpt("convert", SRC, f"s3://{bucket}", "--to", "dcp", "--overwrite", env=env))
        assert "whole bucket" in line, line
        # a checkpoint there is: the hint says so, and --overwrite replaces it
        line = _one_line(run_ckpt("convert", SRC, f"s3://{bucket}/run/dcp_single", "--to", "orbax", env=env))
        assert "destination exists" in line and "--overwrite" in line, line
        r = run_ckpt("convert", str(fixture_path("orbax_ocdbt_zarr2")), f"s3://{bucket}/run/dcp_single", "--to", "dcp",
                      "--overwrite", env=env)
        assert r.returncode == 0, r.stderr
        assert run_ckpt("validate", f"s3://{bucket}/run/dcp_single", env=env).returncode == 0


def test_an_owner_that_exited_unreaped_is_not_alive():
    """A killed owner stays a zombie until reaped, and where nothing reaps orphans (a container whose
    PID 1 is no init: this sandbox's) it stays one: it answers signal 0 and keeps its start time.
    It writes nothing more, so its output is a dead run's (CI met it: a supervised process 0 killed,
    its worker killed with it, and `--overwrite` refused the worker as still writing)."""
    from ckpt_tool.ops.destination import Owner, _pid_start

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = _pid_start(child.pid)
        owner = Owner(socket.gethostname(), child.pid, start, None, None, time.time())
        assert owner.alive()
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not owner.alive()  # a zombie: exited, not reaped (we have not waited for it)
    finally:
        child.kill()
        child.wait()
