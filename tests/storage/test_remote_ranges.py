"""A large range of an object-store value is read as several ranged reads in flight (issue 43, item 2).

One stream of an object store moves far less than the link does, so a DCP or safetensors tensor of
more than 16 MiB, read into its buffer by Storage.read_range_into, goes as 16 MiB ranged GETs with a
few in flight, each copied into place as it lands. Checked against the real GCS server on 127.0.0.1
(its request log counts the GETs) and moto's S3 server: the bytes are the object's, and a range the
object is too short for is still one line naming it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, fake_gcs_serving, gcs_create_bucket, gcs_upload_tree, moto_s3_serving

MIB = 2**20
SIZE = 40 * MIB + 123  # three 16 MiB pieces

READ = r'''
import sys
from ckpt_tool.base.errors import CkptError
from ckpt_tool.storage import Storage
url, size, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
st = Storage.open(url)
buf = bytearray(size - start)
st.read_range_into("blob.bin", start, buf)
sys.stdout.buffer.write(bytes(buf))
try:
    st.read_range_into("blob.bin", start + 1000, bytearray(size - start))
except CkptError as exc:
    sys.stderr.write(f"{exc}\n")
'''


@pytest.fixture(scope="module")
def blob(tmp_path_factory) -> tuple[Path, bytes]:
    src = tmp_path_factory.mktemp("ranges") / "src"
    src.mkdir()
    data = np.random.default_rng(43).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    (src / "blob.bin").write_bytes(data)
    return src, data


def _read(env: dict[str, str], url: str, start: int) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-c", READ, url, str(SIZE), str(start)], cwd=ROOT,
                          env={**run_env, **env}, capture_output=True, timeout=120)


def test_gcs_large_range_goes_as_pieces(blob, tmp_path):
    src, data = blob
    log = tmp_path / "gcs.log"
    with fake_gcs_serving(log=log) as env:
        endpoint = env["TENSORSTORE_GCS_HTTP_URL"]
        gcs_create_bucket(endpoint, "ckpts")
        url = gcs_upload_tree(endpoint, "ckpts", src, "run")
        r = _read(env, url, 100)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == data[100:]
    gets = [line for line in log.read_text().splitlines() if "GET /storage/v1/b/ckpts/o/run%2Fblob.bin?alt=media" in line]
    # 3 pieces for the read, at least 3 more for the short one (which fails on its last piece)
    assert len(gets) >= 6, gets
    assert "blob.bin: truncated: needed bytes" in r.stderr.decode()
    assert f"it has {SIZE} bytes" in r.stderr.decode() or "it is shorter" in r.stderr.decode()


def test_s3_large_range_goes_as_pieces(blob):
    src, data = blob
    with moto_s3_serving("ckpts", [], trees={"run": src}) as env:
        r = _read(env, "s3://ckpts/run", 5)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == data[5:]
    assert "blob.bin: truncated: needed bytes" in r.stderr.decode()
