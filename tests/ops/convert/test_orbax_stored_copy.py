"""Chunks too large to assemble under --memory, copied as they are stored (stored_copy.StoredCopies).

A reshard to the layout a checkpoint already has would otherwise cut a chunk larger than
--memory allows for an assembled output chunk (on a TPU host, a 393 MiB embedding saved from one
chip became 8 chunks, each decoded, assembled and compressed again). Where the writer stores
that grid as the source does, the chunk keeps its shape and its stored bytes are copied a window
at a time, each window decoded as it passes (the check that the chunk holds what its metadata
claims). orbax and tensorstore are the oracles: the output's chunks are the source's bytes and
restore with orbax to the source's values; a damaged chunk fails the reshard, as a decode does.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

# the orbax-written sources are sharded over 8 CPU devices; set before anything imports jax
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
import pytest
from click.testing import CliRunner

from ckpt_tool.ops import stored_copy
from ckpt_tool.cli.main import cli
from ckpt_tool.formats.orbax import write
from ckpt_tool.core.model import RegularGrid
from ckpt_tool.core.write_plan import TargetArray

from library_reference import orbax_values
from orbax_sharded import ocdbt_values, save_sharded_source

runner = CliRunner()
# --memory 8MiB: output chunks over 1 MiB are not assembled (stored_copy.output_chunk_limit)
RESHARD = ["--mesh", "data=4,model=2", "--devices", "8", "--memory", "8MiB", "--json"]


@pytest.fixture(scope="module", params=[False, True], ids=["zarr2", "zarr3"])
def orbax_source(request, tmp_path_factory):
    return save_sharded_source(tmp_path_factory.mktemp("src") / "ckpt", request.param), request.param


@pytest.fixture
def copies(monkeypatch):
    """The chunks streaming.stream copied as stored: (array, chunk index)."""
    done = []
    real = stored_copy.StoredCopies._copy

    def spy(self, item, on_done):
        done.append((item[0].path, item[2]))
        return real(self, item, on_done)

    monkeypatch.setattr(stored_copy.StoredCopies, "_copy", spy)
    return done


def _reshard(src, dst, zarr3, *extra):
    return runner.invoke(cli, ["reshard", str(src), str(dst), *RESHARD, *(["--zarr3"] if zarr3 else []), *extra])


def test_large_chunks_keep_their_grid_and_bytes(tmp_path, orbax_source, copies):
    src, zarr3 = orbax_source
    result = _reshard(src, tmp_path / "out", zarr3)
    assert result.exit_code == 0, result.output
    # orbax wrote 8 chunks of 300 x 1800 (1.03 MiB; each shard split over its 2 replicas)
    assert sorted(copies) == [("e", i) for i in range(8)]  # "w"'s 1 MiB chunks go through the scheduler
    meta = json.loads((tmp_path / "out" / "_METADATA").read_text())
    assert meta  # (a committed orbax output)
    theirs, ours = ocdbt_values(src), ocdbt_values(tmp_path / "out")
    e_chunks = [k for k in theirs if k.startswith(b"e/") and not k.endswith((b".zarray", b"zarr.json"))]
    assert len(e_chunks) == 8
    for key in e_chunks:
        assert ours[key] == theirs[key], key  # byte for byte: zarr v3's shard index too
    want, got = orbax_values(src), orbax_values(tmp_path / "out")
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=str(key))


def test_convert_keeps_large_chunks_too(tmp_path, orbax_source, copies):
    """convert --to orbax (here with --exclude, as when an optimizer state is dropped) plans and copies
    them alike; a cast, which changes the bytes, cuts them."""
    src, zarr3 = orbax_source
    out = tmp_path / "out"
    result = runner.invoke(cli, ["convert", str(src), str(out), "--to", "orbax", "--memory", "8MiB", "--exclude", "w",
                                 *(["--zarr3"] if zarr3 else [])])
    assert result.exit_code == 0, result.output
    assert sorted(copies) == [("e", i) for i in range(8)]
    theirs, ours = ocdbt_values(src), ocdbt_values(out)
    e_chunks = [k for k in theirs if k.startswith(b"e/") and not k.endswith((b".zarray", b"zarr.json"))]
    assert e_chunks and all(ours[k] == theirs[k] for k in e_chunks)
    np.testing.assert_array_equal(np.asarray(orbax_values(out)[("e",)]), np.asarray(orbax_values(src)[("e",)]))
    copies.clear()
    cast = tmp_path / "cast"
    result = runner.invoke(cli, ["convert", str(src), str(cast), "--to", "orbax", "--memory", "8MiB", "--dtype", "float32",
                                 *(["--zarr3"] if zarr3 else [])])
    assert result.exit_code == 0, result.output
    assert copies == []
    np.testing.assert_array_equal(np.asarray(orbax_values(cast)[("e",)]),
                                  np.asarray(orbax_values(src)[("e",)]).astype(np.float32))


def test_another_encoding_cuts_the_chunks(tmp_path, orbax_source, copies):
    """zarr v2 <-> v3: no chunk is the output's; the large ones are cut to fit --memory, as before."""
    src, zarr3 = orbax_source
    result = _reshard(src, tmp_path / "out", not zarr3)
    assert result.exit_code == 0, result.output
    assert copies == []
    want, got = orbax_values(src), orbax_values(tmp_path / "out")
    np.testing.assert_array_equal(np.asarray(got[("e",)]), np.asarray(want[("e",)]))


def _frame_start(stored: bytes, zarr3: bool) -> int:
    """Where a stored chunk's zstd frame starts (zarr v3: at the offset its shard index gives)."""
    return struct.unpack_from("<Q", stored, len(stored) - 20)[0] if zarr3 else 0


def test_a_damaged_chunk_fails_the_copy(tmp_path, orbax_source):
    """A chunk whose frame declares one byte more than it holds: the copy's decode fails it, one line,
    nothing left at DST."""
    import shutil

    src, zarr3 = orbax_source
    damaged = tmp_path / "src"
    shutil.copytree(src, damaged)
    key = "e/c/1/0" if zarr3 else "e/1.0"
    stored = ocdbt_values(damaged)[key.encode()]
    start = _frame_start(stored, zarr3)
    frame = stored[start:]
    fhd = frame[4]
    assert fhd >> 6 >= 2, "expected a 4- or 8-byte frame content size"
    at = 4 + 1 + (0 if fhd & 0x20 else 1) + (0, 1, 2, 4)[fhd & 3]
    size_bytes = 4 if fhd >> 6 == 2 else 8
    declared = int.from_bytes(frame[at:at + size_bytes], "little")
    patched = frame[:at] + (declared + 1).to_bytes(size_bytes, "little") + frame[at + size_bytes:at + size_bytes + 64]
    # the chunk's bytes, found in the data files and patched in place (the same length)
    found = 0
    for path in damaged.rglob("d/*"):
        data = path.read_bytes()
        pos = data.find(frame[:at + size_bytes + 64])
        if pos >= 0:
            path.write_bytes(data[:pos] + patched + data[pos + len(patched):])
            found += 1
    assert found == 1
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "ckpt_tool", "reshard", str(damaged), str(out), *RESHARD[:-1],
                        *(["--zarr3"] if zarr3 else [])], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if not line.startswith("chunk [")]  # (plan notes)
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"(ocdbt)/{key}: chunk does not decode" in errors[0], errors[0]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_planned_only_where_the_writer_takes_stored_chunks(tmp_path, monkeypatch):
    target = TargetArray(("e",), "e", (2400, 1800), "bfloat16", RegularGrid((600, 1800)))
    local = write.stored_chunk_encoding(str(tmp_path / "out"), target, False)
    assert local == ("zarr2", "zstd", "bfloat16", (600, 1800))
    assert write.stored_chunk_encoding(str(tmp_path / "out"), target, True) == (
        "zarr3", "shard", "zstd", "bfloat16", (600, 1800))
    # not on an object store: a data file is uploaded from memory there, so chunks keep to --memory
    assert write.stored_chunk_encoding("gs://bucket/out", target, False) is None
    monkeypatch.setenv("CKPT_OCDBT_WRITER", "tensorstore")
    assert write.stored_chunk_encoding(str(tmp_path / "out"), target, False) is None
