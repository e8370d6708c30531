"""A destination without room for the output (issue 30 item 5, issue 29 follow-up).

A full disk while writing is one line naming DST and the bytes needed, for
every writer (Orbax through tensorstore, DCP, safetensors, DeepSpeed
universal's torch.save files), and the temporary output is gone. An output
larger than the destination's free space is refused before anything is
created (not for a compressing writer, whose size is not known in advance).
The full disks are real: small tmpfs mounts (root; skipped where mount fails).
Sources are written by torch and safetensors.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckpt_tool
from conftest import FIXTURES

# real tmpfs mounts and a wall-time bound: alone, in make test's serial pass
pytestmark = [pytest.mark.slow, pytest.mark.serial]

CODE_ROOT = Path(ckpt_tool.__file__).resolve().parent.parent


def ckpt(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *args], capture_output=True, text=True,
                          env=env, cwd=CODE_ROOT, timeout=300)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def _tmpfs(path: Path, size: str):
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB file system."""
    yield from _tmpfs(tmp_path / "disk", "4m")


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB file system."""
    yield from _tmpfs(tmp_path / "tiny", "1m")


@pytest.fixture(scope="module")
def eight_mib(tmp_path_factory) -> Path:
    """torch.save of 8 MiB of float32 (random: zstd cannot shrink it much)."""
    out = tmp_path_factory.mktemp("src") / "eight.pt"
    code = f"import torch; torch.manual_seed(0); torch.save({{'a': torch.randn(1024, 2048)}}, {str(out)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def many_small(tmp_path_factory) -> Path:
    """safetensors (the library's writer) of 5,000 one-element tensors with long names: 20 KB of
    data, whose files' headers (and DCP's archive per item) are far larger than it."""
    out = tmp_path_factory.mktemp("src") / "many.safetensors"
    code = (f"import torch, safetensors.torch as st; st.save_file({{('layer_%05d.' % i) + 'x' * 200: "
            f"torch.full((1,), float(i)) for i in range(5000)}}, {str(out)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    return out


def _empty(disk: Path) -> None:
    assert [p.name for p in disk.iterdir()] == []  # nothing left behind, no hidden temporary


def test_full_disk_during_orbax_write_is_one_line(small_disk, eight_mib):
    dst = small_disk / "out"
    line = one_error_line(ckpt("convert", str(eight_mib), str(dst), "--to", "orbax"))
    assert line.startswith(f"ckpt: error: {dst}: no space left on device: the output needs up to 8.0 MiB "
                           "(before compression), "), line
    assert line.endswith(" free") and "RESOURCE_EXHAUSTED" not in line
    _empty(small_disk)


@pytest.mark.parametrize("to", ["dcp", "safetensors"])
def test_output_larger_than_free_space_refused_before_writing(small_disk, eight_mib, to):
    dst = small_disk / "out"
    line = one_error_line(ckpt("convert", str(eight_mib), str(dst), "--to", to))
    assert line == f"ckpt: error: {dst}: not enough space: the output needs 8.0 MiB, 4.0 MiB free (nothing was written)"
    _empty(small_disk)


@pytest.mark.parametrize("to", ["dcp", "safetensors", "orbax"])
def test_full_disk_during_write_beyond_the_arrays(tiny_disk, many_small, to):
    """The arrays fit, the files holding them do not: ENOSPC while writing, one line."""
    dst = tiny_disk / "out"
    line = one_error_line(ckpt("convert", str(many_small), str(dst), "--to", to))
    assert line.startswith(f"ckpt: error: {dst}: no space left on device: the output needs more than the 1.0 MiB free "
                           "(19.5 KiB"), line
    _empty(tiny_disk)


@pytest.fixture
def disk_64k(tmp_path):
    """A real 64 KiB file system."""
    yield from _tmpfs(tmp_path / "disk64", "64k")


def test_full_disk_deepspeed_universal_torch_save_files(disk_64k):
    dst = disk_64k / "out"
    line = one_error_line(ckpt("convert", str(FIXTURES / "deepspeed_z1_fp32"), str(dst), "--to", "deepspeed-universal"))
    assert line.startswith(f"ckpt: error: {dst}: no space left on device: the output needs more than "
                           "the 64.0 KiB free"), line
    _empty(disk_64k)


def test_a_tib_expand_is_refused_before_writing(small_disk, tmp_path):
    """torch.save of torch.zeros(1, 1).expand(2**20, 2**18): 1.5 KB on disk, 1 TiB of output.
    (Onto a small file system: a ckpt that started writing it would fill that, not this disk.)"""
    src = tmp_path / "expand.pt"
    code = f"import torch; torch.save({{'w': torch.zeros(1, 1).expand(2**20, 2**18)}}, {str(src)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert src.stat().st_size < 4096
    for to in ("dcp", "safetensors"):
        dst = small_disk / f"out_{to}"
        started = time.monotonic()
        line = one_error_line(ckpt("convert", str(src), str(dst), "--to", to))
        assert line == f"ckpt: error: {dst}: not enough space: the output needs 1.0 TiB, 4.0 MiB free (nothing was written)"
        assert time.monotonic() - started < 60
        _empty(small_disk)
