"""Chunks stored as the source stored them (machinery/arrays/stored_chunks.py): a convert or reshard that keeps an
Orbax checkpoint's grid and encoding copies each chunk's stored bytes instead of encoding it again.

orbax and tensorstore are the oracles: the copy restores with orbax to the source's values, and its
chunks are the source's bytes. Anything that changes the bytes (a cast, a slice, another encoding)
is encoded as before.
"""
from __future__ import annotations

import json
import os

# the orbax-written sources are sharded over 8 CPU devices; set before anything imports jax
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
import pytest
from click.testing import CliRunner

from ckpt_tool.machinery.arrays import reading, stored_chunks
from ckpt_tool.cli.main import cli
from ckpt_tool.formats.orbax import direct

from conftest import fixture_path
from library_reference import orbax_values
from orbax_sharded import ocdbt_values, save_sharded_source

runner = CliRunner()


def _convert(src, dst, *extra) -> dict:
    result = runner.invoke(cli, ["convert", str(src), str(dst), "--to", "orbax", "--json", *extra],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.fixture
def count_copies(monkeypatch):
    copied = []
    real = direct.ProcessDatabase.write_region

    def spy(self, name, chunk_shape, region, data, zmeta, *, stored=None):
        done = real(self, name, chunk_shape, region, data, zmeta, stored=stored)
        copied.append(int(done))
        return done

    monkeypatch.setattr(direct.ProcessDatabase, "write_region", spy)
    return copied


@pytest.fixture(scope="module", params=[False, True], ids=["zarr2", "zarr3"])
def orbax_source(request, tmp_path_factory):
    return save_sharded_source(tmp_path_factory.mktemp("src") / "ckpt", request.param), request.param


@pytest.mark.parametrize("name", ["orbax_ocdbt_zarr2", "orbax_ocdbt_zarr3", "orbax_v0_11/standard"])
def test_small_fixtures_convert_alike(tmp_path, name):
    """Tiny leaves are read whole (several chunks at once): encoded as before, the same values."""
    src = fixture_path(name.split("/")[0]) / "/".join(name.split("/")[1:])
    zarr3 = name.endswith("zarr3")
    _convert(src, tmp_path / "out", *(["--zarr3"] if zarr3 else []))
    want, got = orbax_values(src), orbax_values(tmp_path / "out")
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=str(key))


def test_same_grid_and_encoding_copies_the_stored_chunks(tmp_path, orbax_source, count_copies):
    src, zarr3 = orbax_source
    _convert(src, tmp_path / "out", *(["--zarr3"] if zarr3 else []))
    assert len(count_copies) >= 17 and all(n == 1 for n in count_copies)  # every chunk written was copied
    theirs, ours = ocdbt_values(src), ocdbt_values(tmp_path / "out")
    chunks = [k for k in theirs if not k.endswith((b".zarray", b"zarr.json"))]
    scalars = {k for k in chunks if k.count(b"/") == 1 and k.endswith((b"/0", b"/c"))}
    for key in chunks:
        if key not in scalars:  # (0-d values are written by tensorstore, whatever the source)
            assert ours[key] == theirs[key], key
    want, got = orbax_values(src), orbax_values(tmp_path / "out")
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=str(key))


# the convert from gs://, in a process of its own: tensorstore keeps the first GCS endpoint a process
# uses, and another test on the same worker may have used another server
_CONVERT_COUNTING_COPIES = """
import json, sys
from click.testing import CliRunner
from ckpt_tool.cli.main import cli
from ckpt_tool.formats.orbax import direct
copied = []
real = direct.ProcessDatabase.write_region
def spy(self, name, chunk_shape, region, data, zmeta, *, stored=None):
    done = real(self, name, chunk_shape, region, data, zmeta, stored=stored)
    copied.append(int(done))
    return done
direct.ProcessDatabase.write_region = spy
result = CliRunner().invoke(cli, ["convert", *sys.argv[1:], "--to", "orbax", "--json"], catch_exceptions=False)
assert result.exit_code == 0, result.output
print(json.dumps({"copied": copied, "report": json.loads(result.output)}))
"""


def test_chunks_read_from_gcs_are_stored_as_downloaded(tmp_path, orbax_source):
    """From an object store the stored bytes are kept while the decoded chunk lives (reading them
    again would download the chunk twice): a reshard or convert gs:// -> local of the same grid and
    encoding copies them as well, downloading each once. They were encoded again: zstd took 7 of a
    1 GiB reshard's 20 busy thread-seconds, 2.7x the same reshard of a local copy."""
    import subprocess
    import sys

    from conftest import ROOT, fake_gcs_serving, gcs_create_bucket, gcs_upload_tree

    src, zarr3 = orbax_source
    with fake_gcs_serving() as env:
        gcs_create_bucket(env["TENSORSTORE_GCS_HTTP_URL"], "stored-chunks")
        url = gcs_upload_tree(env["TENSORSTORE_GCS_HTTP_URL"], "stored-chunks", src, "src")
        run = subprocess.run([sys.executable, "-c", _CONVERT_COUNTING_COPIES, url, str(tmp_path / "out"),
                              *(["--zarr3"] if zarr3 else [])],
                             capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got_run = json.loads(run.stdout.strip().splitlines()[-1])
    copied, report = got_run["copied"], got_run["report"]
    assert len(copied) >= 17 and all(n == 1 for n in copied)  # every chunk written was copied
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    assert report["bytes_read"] <= stored  # each chunk downloaded once
    theirs, ours = ocdbt_values(src), ocdbt_values(tmp_path / "out")
    for key in theirs:
        if not key.endswith((b".zarray", b"zarr.json")) and not (key.count(b"/") == 1 and key.endswith((b"/0", b"/c"))):
            assert ours[key] == theirs[key], key
    want, got = orbax_values(src), orbax_values(tmp_path / "out")
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=str(key))


def test_turned_off_every_chunk_is_encoded(tmp_path, monkeypatch, orbax_source, count_copies):
    src, zarr3 = orbax_source
    monkeypatch.setattr(reading, "STORED_CHUNKS", False)
    _convert(src, tmp_path / "out", *(["--zarr3"] if zarr3 else []))
    assert count_copies and not any(count_copies)


def test_another_encoding_or_dtype_is_encoded_again(tmp_path, orbax_source, count_copies):
    """zarr v2 <-> v3, or a cast: the same values, other bytes."""
    src, zarr3 = orbax_source
    _convert(src, tmp_path / "out", *([] if zarr3 else ["--zarr3"]))
    assert count_copies and not any(count_copies)
    count_copies.clear()
    _convert(src, tmp_path / "cast", *(["--zarr3"] if zarr3 else []), "--dtype", "float32")
    assert count_copies and sum(count_copies) < len(count_copies)  # the bfloat16 leaf is cast
    got = orbax_values(tmp_path / "cast")
    np.testing.assert_array_equal(got[("e",)], orbax_values(src)[("e",)].astype(np.float32))


def test_recall_only_the_whole_remembered_memory():
    chunk = np.arange(24, dtype=np.float32).reshape(4, 6)
    enc = ("zarr2", "zstd", "<f4", (4, 6))
    kept = stored_chunks.remember(chunk, enc, (1, 0), lambda: b"stored")
    assert stored_chunks.recall(kept).read() == b"stored"
    assert stored_chunks.recall(np.asarray(kept)) is None  # what np.asarray returns is no longer it
    assert stored_chunks.recall(kept[:2]) is None
    assert stored_chunks.recall(kept[:, 1:]) is None
    assert stored_chunks.recall(kept.copy()) is None
    assert stored_chunks.recall(kept.astype(np.float64)) is None
    assert stored_chunks.recall(kept.reshape(6, 4)) is None
    assert stored_chunks.recall(kept.view(np.int32)) is None
    assert stored_chunks.recall(chunk) is None
    # an edge chunk: the clipped view the reader hands out is the whole stored chunk
    edge = stored_chunks.remember(chunk[:3], enc, (1, 0), lambda: b"stored")
    assert stored_chunks.recall(edge[:3]) is not None and stored_chunks.recall(edge[:2]) is None


ZSTD2 = {"compressor": {"id": "zstd", "level": 1}, "filters": None, "order": "C", "dtype": "bfloat16", "chunks": [4, 4]}


def _zarr3(**conf):
    inner = conf.pop("codecs", [{"name": "bytes", "configuration": {"endian": "little"}},
                                {"name": "zstd", "configuration": {"level": 3}}])
    return {"data_type": "float32", "chunk_grid": {"configuration": {"chunk_shape": [4, 4]}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": conf.pop("chunk_shape", [4, 4]), "codecs": inner,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "index_location": "end"}}]}


def test_encoding_of():
    assert stored_chunks.encoding_of(ZSTD2, False) == stored_chunks.encoding_of(
        {**ZSTD2, "compressor": {"id": "zstd", "level": 5}}, False)  # any level decodes the same
    assert stored_chunks.encoding_of({**ZSTD2, "compressor": {"id": "blosc"}}, False) is None
    assert stored_chunks.encoding_of({**ZSTD2, "compressor": None}, False) is None
    assert stored_chunks.encoding_of({**ZSTD2, "filters": [{"id": "delta"}]}, False) is None
    assert stored_chunks.encoding_of({**ZSTD2, "order": "F"}, False) is None
    assert stored_chunks.encoding_of({**ZSTD2, "dtype": "<f2"}, False) != stored_chunks.encoding_of(ZSTD2, False)
    assert stored_chunks.encoding_of({**ZSTD2, "chunks": [2, 4]}, False) != stored_chunks.encoding_of(ZSTD2, False)
    assert stored_chunks.encoding_of(_zarr3(), True) is not None
    assert stored_chunks.encoding_of(_zarr3(chunk_shape=[2, 2]), True) is None  # several chunks per shard
    assert stored_chunks.encoding_of(_zarr3(codecs=[{"name": "bytes", "configuration": {"endian": "big"}},
                                                    {"name": "zstd"}]), True) is None
    assert stored_chunks.encoding_of(_zarr3(codecs=[{"name": "bytes"}, {"name": "gzip"}]), True) is None
    assert stored_chunks.encoding_of({"codecs": "junk"}, True) is None
    assert stored_chunks.encoding_of(ZSTD2, True) is None
