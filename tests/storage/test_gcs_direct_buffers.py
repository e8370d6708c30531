"""Which reads take a pooled buffer for ckpt's own ranged GETs (storage/gcs_reads.py): only gs://
reads of gcs_reads.MIN_BYTES and more, with CKPT_GCS_DIRECT_READS on. An OCDBT view reading an
out-of-line value asks first (KvstoreBackend.reads_direct), so that an s3:// value, or a small one,
is read through tensorstore without a buffer filled for nothing."""
from __future__ import annotations

import pytest

from ckpt_tool.storage import gcs_reads
from ckpt_tool.storage.kvstore_backend import KvstoreBackend


def _backend(driver: str) -> KvstoreBackend:
    spec = {"driver": driver, "bucket": "b", "path": "run/"}
    if driver == "s3":
        spec["endpoint"] = "http://127.0.0.1:9"
    return KvstoreBackend(None, f"{'gs' if driver == 'gcs' else driver}://b/run", spec)  # nothing is opened


def test_gcs_reads_of_min_bytes_and_more_go_direct(monkeypatch):
    monkeypatch.delenv("CKPT_GCS_DIRECT_READS", raising=False)
    gcs = _backend("gcs")
    assert gcs.reads_direct(gcs_reads.MIN_BYTES) and gcs.reads_direct(1 << 30)
    assert not gcs.reads_direct(gcs_reads.MIN_BYTES - 1)


@pytest.mark.parametrize("off", ["0", "false", "no", "off"])
def test_the_switch_sends_every_gcs_read_through_tensorstore(monkeypatch, off):
    monkeypatch.setenv("CKPT_GCS_DIRECT_READS", off)
    assert not _backend("gcs").reads_direct(1 << 30)


def test_s3_and_memory_reads_never_go_direct(monkeypatch):
    monkeypatch.delenv("CKPT_GCS_DIRECT_READS", raising=False)
    assert not _backend("s3").reads_direct(1 << 30)
    assert not _backend("memory").reads_direct(1 << 30)
