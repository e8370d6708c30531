"""Zarr v3 chunks larger than --memory, decoded as a stream (ckpt_tool/core/codecs.py).

orbax writes zarr v3 arrays as one shard per chunk holding one inner chunk
(`sharding_indexed`: bytes + zstd inside, a crc32c-checked index at the
end). Real orbax writes the fixture (one device: a 24 MiB array is one
chunk) in a tmp dir; with --memory 8MiB the chunk is streamed from the
inner chunk's byte range. Values are compared with orbax's own restore and
torch's load of the converted output; a damaged shard index is one line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

from ckpt_tool.formats import open_checkpoint
from ckpt_tool.scheduler import Scheduler, Want, parse_memory

from conftest import run_ckpt
from library_reference import dcp_values, orbax_values

GEN = r'''
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import warnings; warnings.filterwarnings("ignore")
import numpy as np, jax, orbax.checkpoint as ocp
out = sys.argv[1]
rng = np.random.default_rng(3)
big = rng.standard_normal((1536, 4096), dtype=np.float32)   # 24 MiB: one stored chunk
big[::5] = 0.0
small = np.arange(12, dtype=np.int32).reshape(3, 4)
ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True))
ck.save(os.path.join(out, "z3"), {"big": jax.device_put(big), "small": small})
'''


@pytest.fixture(scope="module")
def z3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("z3")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", GEN, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "z3"


@pytest.mark.slow
def test_orbax_zarr3_chunk_is_a_one_chunk_shard(z3):
    """What the stream relies on: orbax's zarr v3 layout (so a change in orbax shows here first)."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(z3) + "/"}}).result()
    meta = json.loads(kv.read("big/zarr.json").result().value)
    (codec,) = meta["codecs"]
    assert codec["name"] == "sharding_indexed"
    assert codec["configuration"]["chunk_shape"] == meta["chunk_grid"]["configuration"]["chunk_shape"] == [1536, 4096]


def test_streamed_zarr3_chunk_reads_exactly_once(z3):
    ck = open_checkpoint(str(z3))
    big = ck["big"]
    reference = np.asarray(orbax_values(z3)[("big",)])
    got = {}

    def keep(start):
        def deliver(arrays):
            got[start] = arrays[0].copy()
            return arrays[0].nbytes
        return deliver

    wants = [Want([(big, (slice(r, min(r + 100, 1536)), slice(0, 4096)))], keep(r)) for r in range(0, 1536, 100)]
    sched = Scheduler(wants, memory=parse_memory("8MiB"), workers=2)
    sched.run()
    assert dict(sched.stats.decodes) == {("big", 0): 1} and ("big", 0) in sched.stats.streamed
    for r, arr in got.items():
        assert arr.tobytes() == reference[r : r + 100].tobytes(), r


@pytest.mark.slow
def test_convert_deep_validate_and_diff_of_a_streamed_zarr3_chunk(z3, tmp_path):
    out = tmp_path / "dcp"
    r = run_ckpt("convert", str(z3), str(out), "--to", "dcp", "--memory", "8MiB")
    assert r.returncode == 0, r.stderr
    reference = orbax_values(z3)
    got = dcp_values(out)
    for key in (("big",), ("small",)):
        assert np.asarray(got[key]).tobytes() == np.asarray(reference[key]).tobytes(), key
    r = run_ckpt("validate", str(z3), "--deep", "--memory", "8MiB", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_ckpt("diff", str(z3), str(out), "--values", "--memory", "8MiB")
    assert r.returncode == 0 and "same" in r.stdout, r.stdout + r.stderr


def test_damaged_shard_index_is_one_line(z3, tmp_path):
    """A flipped bit in the 16-byte index of the one-chunk shard: the crc32c check names the chunk."""
    import shutil

    src = tmp_path / "z3"
    shutil.copytree(z3, src)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(src) + "/"}}).result()
    value = bytearray(kv.read("big/c/0/0").result().value)
    value[-12] ^= 0x01  # inside the index's nbytes field
    kv.write("big/c/0/0", bytes(value)).result()
    r = run_ckpt("validate", str(src), "--deep", "--memory", "8MiB", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    bad = [f for f in doc["findings"] if f["code"] == "bad-chunk"]
    assert len(bad) == 1 and bad[0]["leaf"] == "big" and "crc32c" in bad[0]["message"], bad
    assert "Traceback" not in r.stderr
