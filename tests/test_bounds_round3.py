"""Issue 44, items 8-11: bounds kept and no internal error from input, measured on whole processes.

- 8: a reshard for a billion devices is refused at once (the mesh's device limit), and a mesh whose
  `_sharding` would outgrow a metadata file is refused before DST is touched;
- 9: parsers of files and environment variables the user does not control (a deep config.json under
  `convert --like`, TPU_* variables) answer with one line, never a traceback;
- 10: a `--dtype` cast that overflows names its leaves and refuses unless --allow-overflow;
- 11: the pickle memory bound (--memory + 512 MiB) holds for a torch.save of millions of small objects.

Time and memory are measured on the whole process (psutil, polled), not on what ckpt charges itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
MiB = 2**20


def measure(argv: list[str], *, env: dict[str, str] | None = None, kill_rss: int = 3 * 2**30,
            timeout: float = 120) -> tuple[int, str, str, float, int]:
    """Run `ckpt argv` as its own process: (exit code, stdout, stderr, wall seconds, peak RSS bytes).

    RSS is polled every few milliseconds; a process past `kill_rss` (the old code's runaway) is
    killed there, so a failing run does not take the machine's memory with it."""
    full_env = dict(os.environ, **(env or {}))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=full_env, cwd=ROOT)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.Error:
            break
        if peak > kill_rss or time.monotonic() - t0 > timeout:
            proc.kill()
            break
        time.sleep(0.003)
    out, err = proc.communicate()
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - t0, peak


# -- 8: a reshard's plan is bounded by what is written, not by the device count -------------------


@pytest.mark.serial
@pytest.mark.parametrize("mesh", ["data=1000000000", "data=1000,model=1000000"])
def test_reshard_billion_devices_refused_at_once(tmp_path: Path, mesh: str) -> None:
    # orbax_ocdbt_zarr2: a 3 KB checkpoint written by orbax-checkpoint (fixtures/README)
    dst = tmp_path / "r"
    for extra in ([], ["--dry-run"]):
        rc, out, err, wall, peak = measure(
            ["reshard", str(FIXTURES / "orbax_ocdbt_zarr2"), str(dst), "--mesh", mesh, "--devices", "1000000000", *extra],
            kill_rss=1 << 30, timeout=30)
        assert rc == 2, (rc, err[-2000:])
        assert "Traceback" not in err and "internal error" not in err
        errors = [line for line in err.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and "1,000,000,000 devices" in errors[0] and "limit of 1,048,576" in errors[0], err
        assert wall < 1.0, f"{wall:.2f} s"
        assert peak < 200 * MiB, f"{peak / MiB:.0f} MiB"
        assert not dst.exists()


@pytest.mark.serial
def test_reshard_devices_over_limit_with_a_small_mesh(tmp_path: Path) -> None:
    rc, _, err, wall, peak = measure(
        ["reshard", str(FIXTURES / "orbax_ocdbt_zarr2"), str(tmp_path / "r"), "--mesh", "data=8", "--devices", "1000000000"],
        kill_rss=1 << 30, timeout=30)
    assert rc == 2 and "Traceback" not in err and ("limit" in err or "--devices is 1000000000" in err), err
    assert wall < 1.0 and peak < 200 * MiB, (wall, peak / MiB)


@pytest.mark.serial
def test_reshard_sharding_metadata_over_the_reader_limit_refused_before_dst(tmp_path: Path) -> None:
    # 2**20 devices is within the mesh limit, but each of the fixture's 15 mesh arrays lists every
    # id in `_sharding`: 282 MB, more than a metadata file may have (ckpt itself refused to read it back).
    # The old code spent 20 s and 1.2 GB writing it.
    dst = tmp_path / "r"
    n = str(2**20)
    rc, out, err, wall, peak = measure(
        ["reshard", str(FIXTURES / "orbax_ocdbt_zarr2"), str(dst), "--mesh", f"data={n}", "--devices", n],
        kill_rss=1 << 30, timeout=60)
    assert rc == 1, (rc, out, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "_sharding" in lines[0] and "268,435,456" in lines[0], err
    assert not dst.exists()
    assert wall < 3.0 and peak < 300 * MiB, (wall, peak / MiB)


@pytest.mark.slow
def test_reshard_many_devices_within_limits_writes_what_orbax_reads(tmp_path: Path) -> None:
    """65,536 devices: planned and written in bounded memory; the `_sharding` text (spelled without
    a dict per device) is what orbax's own metadata reader parses, every id in mesh order."""
    dst = tmp_path / "r"
    n = 65536
    rc, out, err, wall, peak = measure(
        ["reshard", str(FIXTURES / "orbax_ocdbt_zarr2"), str(dst), "--mesh", f"data={n // 4},model=4",
         "--devices", str(n)], timeout=120)
    assert rc == 0, err[-2000:]
    assert peak < 400 * MiB, f"{peak / MiB:.0f} MiB"
    from orbax.checkpoint._src.metadata import sharding as sharding_metadata  # orbax's own parser

    entries = json.loads((dst / "_sharding").read_text())
    assert entries
    for text in entries.values():
        meta = sharding_metadata.from_serialized_string(text)
        assert isinstance(meta, sharding_metadata.NamedShardingMetadata)
        assert tuple(meta.shape) == (n // 4, 4)
        ids = [d.id for row in meta.device_mesh.mesh for d in row]
        assert ids == list(range(n))
