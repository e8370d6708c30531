"""gs:// data is read by plain ranged GETs straight into ckpt's buffers (storage/gcs_reads.py, issue 43).

tensorstore's gcs driver copies every byte it downloads three times in the process (curl into a Cord,
a string, Python bytes): on the bench's 2 cores that CPU decided how far a `validate --deep` or a
reshard from gs:// stayed from the same command on a local copy. Stored chunks and DCP/safetensors
ranges are now read by http.client into their buffers, and anything but exactly the bytes asked for
is read again through tensorstore, whose errors ckpt words as before.

Against the real GCS server (the Go fake-gcs-server): its request log tells ckpt's GETs from
tensorstore's (tensorstore adds a `tensorstore=` parameter to each). Each command runs in a process
of its own (tensorstore keeps the first GCS endpoint a process uses).
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, fake_gcs_serving, gcs_create_bucket, gcs_upload_tree

BUCKET = "ckpt-gcs-reads"
MIB = 2**20


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return {**env, **extra}


def _ckpt(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *args], cwd=ROOT, env=_env(env),
                          capture_output=True, text=True, timeout=180)


def _data_gets(log: Path, since: int) -> tuple[list[str], list[str]]:
    """(ckpt's, tensorstore's) GETs of OCDBT data files logged after byte `since` of the log."""
    lines = log.read_text()[since:].splitlines()
    gets = [m.group(1) for line in lines if (m := re.search(r'"GET (/storage/v1/b/[^ ]*%2Fd%2F[^ ]*) HTTP', line))]
    return [g for g in gets if "tensorstore=" not in g], [g for g in gets if "tensorstore=" in g]


# orbax saves (zarr v2 and zarr3) of host arrays: chunks of 2 MiB, and one of 20 MiB (read as 16 MiB pieces)
GEN = r'''
import os, sys
import numpy as np, orbax.checkpoint as ocp
out = sys.argv[1]
rng = np.random.default_rng(43)
tree = {f"w{i}": rng.standard_normal((512, 1024), dtype=np.float32) for i in range(4)}
tree["big"] = rng.standard_normal((2560, 2048), dtype=np.float32)
for zarr3 in (False, True):
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)) as ck:
        ck.save(os.path.join(out, "zarr3" if zarr3 else "zarr2"), args=ocp.args.PyTreeSave(tree))
'''


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gcs-reads")
    r = subprocess.run([sys.executable, "-c", GEN, str(out)], env=_env({}), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("kind", ["zarr2", "zarr3"])
def test_validate_deep_reads_chunks_by_plain_ranged_gets(tmp_path, sources, kind):
    log = tmp_path / "gcs.log"
    with fake_gcs_serving(log=log) as env:
        gcs_create_bucket(env["TENSORSTORE_GCS_HTTP_URL"], BUCKET)
        url = gcs_upload_tree(env["TENSORSTORE_GCS_HTTP_URL"], BUCKET, sources / kind, "run")
        mark = log.stat().st_size
        direct = _ckpt(env, "validate", "--deep", url)
        ours, theirs = _data_gets(log, mark)
        mark = log.stat().st_size
        through_ts = _ckpt({**env, "CKPT_GCS_DIRECT_READS": "0"}, "validate", "--deep", url)
        ours_off, _ = _data_gets(log, mark)
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert direct.stdout == through_ts.stdout and direct.stderr == through_ts.stderr
    assert "5 chunks read" in direct.stdout, direct.stdout
    # every chunk read once by ckpt's own GETs (the 20 MiB one as two); tensorstore reads only
    # the B+tree's node
    assert len(ours) == 6, (ours, theirs)
    assert not ours_off


def _damaged(src: Path, dst: Path, how: str) -> None:
    shutil.copytree(src, dst)
    data = max((p for p in (dst / "ocdbt.process_0" / "d").iterdir()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    if how == "cut":
        raw = raw[: len(raw) // 2]
    else:  # bytes of a chunk's zstd frame changed: the GET answers in full
        raw[len(raw) // 4: len(raw) // 4 + 4096] = bytes(4096)
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["cut", "zeroed"])
def test_a_damaged_data_file_reads_as_it_did_through_tensorstore(tmp_path, sources, how):
    """A data file cut short answers ckpt's GET with fewer bytes (or a 416): tensorstore reads that
    chunk again and its error is the finding it was; changed bytes read in full and are checked alike."""
    src = tmp_path / "src"
    _damaged(sources / "zarr2", src, how)
    with fake_gcs_serving() as env:
        gcs_create_bucket(env["TENSORSTORE_GCS_HTTP_URL"], BUCKET)
        url = gcs_upload_tree(env["TENSORSTORE_GCS_HTTP_URL"], BUCKET, src, "run")
        direct = _ckpt(env, "validate", "--deep", url)
        through_ts = _ckpt({**env, "CKPT_GCS_DIRECT_READS": "0"}, "validate", "--deep", url)
    assert direct.returncode == through_ts.returncode, direct.stdout + direct.stderr
    assert direct.stdout == through_ts.stdout
    # (zeroed bytes in a raw block of the frame decode, to values that are no longer finite)
    assert (" error " if how == "cut" else " warning non-finite") in direct.stdout, direct.stdout


READ = r'''
import sys
from ckpt_tool.storage import Storage
url, start, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = bytearray(size)
Storage.open(url).read_range_into("blob.bin", start, buf)
sys.stdout.buffer.write(bytes(buf))
'''


def test_a_large_range_goes_as_pieces_of_plain_gets_into_the_buffer_a_small_one_through_tensorstore(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = np.random.default_rng(43).integers(0, 256, 40 * MIB + 17, dtype=np.uint8).tobytes()
    (src / "blob.bin").write_bytes(data)
    log = tmp_path / "gcs.log"
    with fake_gcs_serving(log=log) as env:
        gcs_create_bucket(env["TENSORSTORE_GCS_HTTP_URL"], BUCKET)
        url = gcs_upload_tree(env["TENSORSTORE_GCS_HTTP_URL"], BUCKET, src, "run")
        mark = log.stat().st_size
        r = subprocess.run([sys.executable, "-c", READ, url, "7", str(len(data) - 7)], cwd=ROOT, env=_env(env),
                           capture_output=True, timeout=120)
        mark_small = log.stat().st_size
        small = subprocess.run([sys.executable, "-c", READ, url, "1000", str(64 << 10)], cwd=ROOT, env=_env(env),
                               capture_output=True, timeout=120)

    def gets(since: int, until: int | None = None) -> list[str]:
        return [line for line in log.read_text()[since:until].splitlines()
                if "GET /storage/v1/b/" + BUCKET + "/o/run%2Fblob.bin" in line]

    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == data[7:]
    big = gets(mark, mark_small)
    assert len(big) == 3 and not any("tensorstore=" in g for g in big), big  # 16 + 16 + 8 MiB
    # a small read costs less CPU through tensorstore (gcs_reads.MIN_BYTES)
    assert small.returncode == 0 and small.stdout == data[1000:1000 + (64 << 10)], small.stderr[-2000:]
    assert [("tensorstore=" in g) for g in gets(mark_small)] == [True]


SILENT = r'''
import sys, time
from ckpt_tool.base.errors import StorageUnavailableError
from ckpt_tool.storage import gcs_reads
endpoint = sys.argv[1]
for attempt in range(2):
    t = time.monotonic()
    try:
        gcs_reads.read_into(endpoint, "bucket", "run/d/x", 0, memoryview(bytearray(1 << 20)), "gs://bucket/run/d/x")
        print("read")
    except StorageUnavailableError as exc:
        print(f"{time.monotonic() - t:.1f} {exc}")
'''


def test_an_endpoint_that_does_not_answer_is_one_line_within_the_deadline_then_fails_fast():
    """A server that accepts the connection and never answers: the deadline's line (as through
    tensorstore), and the next read on that endpoint fails at once."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        r = subprocess.run([sys.executable, "-c", SILENT, endpoint], cwd=ROOT, timeout=60, capture_output=True, text=True,
                           env=_env({"CKPT_IO_TIMEOUT": "1", "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x"}))
    finally:
        stop.set()
        thread.join()
        for s in held:
            s.close()
        listener.close()
    assert r.returncode == 0, r.stderr[-2000:]
    first, second = r.stdout.splitlines()
    seconds, line = first.split(" ", 1)
    # (the deadline: CKPT_IO_TIMEOUT plus a second per MiB asked for)
    assert 1.9 <= float(seconds) < 6, first
    assert line == (f"gs://bucket/run/d/x: cannot read: storage endpoint {endpoint} gave no answer within 2 s "
                    "(CKPT_IO_TIMEOUT)"), line
    assert float(second.split(" ", 1)[0]) < 0.5 and second.split(" ", 1)[1] == line, second
