"""An Orbax output to gs:// and s3:// is written by ckpt itself, every object through Storage.write.

ckpt writes each process's OCDBT database itself on object stores as on a local directory
(formats/orbax/direct.py, storage/ocdbt_writer.py): each data file (`d/<hex>`, sealed at 16 MiB) is
staged on local disk and uploaded whole, then the B+tree's node file and the manifest, then the
commit markers. So every object of the output is one ckpt holds the bytes of, and on GCS each is
checked against the crc32c GCS stored: the one its upload's answer gives (storage/gcs_uploads.py),
or, uploaded through tensorstore, the one asked for after (storage/gcs_verify.py). Before, tensorstore's OCDBT driver
uploaded the data files, manifests and B+tree nodes, which no check covered.

The servers are real: the Go fake-gcs-server and moto's S3 server. The outputs are read back by
orbax itself (from a downloaded copy, as tests/ops/reshard/test_multihost_gcs.py does), equal to the source.
"""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import fake_gcs_serving, gcs_create_bucket, moto_s3_serving, run_ckpt, s3_client
from test_remote_upload_checksums import CorruptingProxy, _uploaded

pytestmark = pytest.mark.slow

BUCKET = "ckpt-orbax-direct"
MESH = "data=2,model=2"

# orbax restores an output on 4 CPU devices (each jax.Array with the sharding its metadata records,
# or on one device where none is recorded) and prints the sha of each array's bytes
_RESTORE = r"""
import json, sys, hashlib
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
import orbax.checkpoint as ocp

path = sys.argv[1]
ckptr = ocp.StandardCheckpointer()
meta = ckptr.metadata(path).item_metadata
target = {}
for name, m in meta.items():
    sm = m.sharding
    if sm is None:
        sharding = SingleDeviceSharding(jax.devices()[0])
    else:
        mesh = Mesh(np.array(jax.devices()[:int(np.prod(sm.shape))]).reshape(sm.shape), tuple(sm.axis_names))
        sharding = NamedSharding(mesh, P(*sm.partition_spec))
    target[name] = jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding)
restored = ckptr.restore(path, target)
print(json.dumps({name: hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()
                  for name, a in restored.items()}))
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A safetensors file of ~56 MiB (several 16 MiB data files per output), and each array's sha."""
    import hashlib

    from safetensors.numpy import save_file

    out = tmp_path_factory.mktemp("orbax-direct-src")
    rng = np.random.default_rng(7)
    arrays = {"w1": rng.standard_normal((2048, 2048), dtype=np.float32),
              "w2": rng.standard_normal((1024, 4096), dtype=np.float32),
              "emb": rng.standard_normal((4096, 512), dtype=np.float32),
              "bias": np.arange(1024, dtype=np.float32)}
    save_file(arrays, str(out / "model.safetensors"))
    return out / "model.safetensors", {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in arrays.items()}


@pytest.fixture(scope="module")
def gcs():
    with fake_gcs_serving() as env:
        gcs_create_bucket(env["CKPT_TEST_GCS"], BUCKET)
        yield env


def _gcs_download(endpoint: str, prefix: str, local: Path) -> list[str]:
    q = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}/o?{q}", timeout=60) as r:
        names = sorted(item["name"] for item in json.load(r).get("items", []))
    for name in names:
        path = local / name[len(prefix):]
        path.parent.mkdir(parents=True, exist_ok=True)
        quoted = urllib.parse.quote(name, safe="")
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}/o/{quoted}?alt=media", timeout=60) as r:
            path.write_bytes(r.read())
    return names


def _s3_download(endpoint: str, prefix: str, local: Path) -> list[str]:
    s3 = s3_client(endpoint)
    names = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))
    for name in names:
        path = local / name[len(prefix):]
        path.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(BUCKET, name, str(path))
    return names


def _restored(local: Path) -> dict[str, str]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _RESTORE, str(local)], capture_output=True, text=True, env=env,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _command(kind: str, src: Path, dst: str) -> list[str]:
    if kind == "convert":
        return ["convert", str(src), dst, "--to", "orbax"]
    return ["reshard", str(src), dst, "--mesh", MESH, "--devices", "4"]


@pytest.mark.parametrize("kind", ["convert", "reshard"])
def test_an_orbax_output_to_gs_is_uploaded_by_ckpt_checked_and_restored_by_orbax(gcs, source, tmp_path, kind):
    src, shas = source
    endpoint = gcs["CKPT_TEST_GCS"]
    proxy = CorruptingProxy(urllib.parse.urlsplit(endpoint).netloc, lambda line: False)
    prefix = f"gs-{kind}/orbax"
    try:
        r = run_ckpt(*_command(kind, src, f"gs://{BUCKET}/{prefix}"), "--memory", "64MiB",
                     env={**gcs, "TENSORSTORE_GCS_HTTP_URL": proxy.url}, timeout=300)
        assert r.returncode == 0, r.stderr
    finally:
        proxy.close()
    names = _gcs_download(endpoint, prefix + "/", tmp_path / "out")
    data_files = [n for n in names if n.startswith(f"{prefix}/ocdbt.process_0/d/")]
    assert len(data_files) >= 3, names  # sealed at 16 MiB: several of them
    # every object of the output went up through ckpt and was checked: the process's data files,
    # its B+tree and manifest, the root's, the markers. An upload by ckpt's own request
    # (storage/gcs_uploads.py; http.client sends no User-Agent, tensorstore's curl names itself) is
    # checked against the crc32c in its answer; one through tensorstore by asking for its crc32c after
    checked = set()
    for line, agent in zip(proxy.requests, proxy.agents):
        if _uploaded(line) is not None and "tensorstore" not in agent:
            checked.add(_uploaded(line))
        elif line.startswith(f"GET /storage/v1/b/{BUCKET}/o/") and "fields=crc32c" in line:
            checked.add(urllib.parse.unquote(line.split(" ")[1].split("?")[0].rsplit("/o/", 1)[1]))
    unchecked = [n for n in names if n not in checked]
    assert not unchecked, unchecked
    assert all(f"{prefix}/{m}" in names for m in ("manifest.ocdbt", "ocdbt.process_0/manifest.ocdbt",
                                                   "commit_success.txt", "_CHECKPOINT_METADATA"))
    assert _restored(tmp_path / "out") == shas
    r = run_ckpt("validate", f"gs://{BUCKET}/{prefix}", "--deep", env=gcs)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("kind", ["convert", "reshard"])
def test_an_orbax_output_to_s3_is_written_by_ckpt_and_restored_by_orbax(source, tmp_path, kind):
    src, shas = source
    with moto_s3_serving(BUCKET, []) as env:
        prefix = f"s3-{kind}/orbax"
        r = run_ckpt(*_command(kind, src, f"s3://{BUCKET}/{prefix}"), "--memory", "64MiB", env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        names = _s3_download(env["AWS_ENDPOINT_URL"], prefix + "/", tmp_path / "out")
        # ckpt's own database: one version, written once (tensorstore's driver commits many), its
        # data files sealed at 16 MiB
        import tensorstore as ts
        dumped = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/out/ocdbt.process_0/").result()).result()
        assert [v["generation_number"] for v in dumped["versions"]] == [1], dumped["versions"]
        data = [tmp_path / "out" / n[len(prefix) + 1:] for n in names if n.startswith(f"{prefix}/ocdbt.process_0/d/")]
        assert len(data) >= 3 and all(p.stat().st_size <= 17 * 2**20 for p in data), names
        r = run_ckpt("validate", f"s3://{BUCKET}/{prefix}", "--deep", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
    assert _restored(tmp_path / "out") == shas


def test_the_tensorstore_switch_still_writes_through_tensorstore(gcs, source, tmp_path):
    """CKPT_OCDBT_WRITER=tensorstore: tensorstore's zarr and OCDBT drivers write the output, which
    orbax restores the same."""
    src, shas = source
    prefix = "gs-tensorstore/orbax"
    r = run_ckpt("convert", str(src), f"gs://{BUCKET}/{prefix}", "--to", "orbax",
                 env={**gcs, "CKPT_OCDBT_WRITER": "tensorstore"}, timeout=300)
    assert r.returncode == 0, r.stderr
    _gcs_download(gcs["CKPT_TEST_GCS"], prefix + "/", tmp_path / "out")
    assert _restored(tmp_path / "out") == shas


def test_a_corrupted_upload_of_an_orbax_data_file_is_one_line_and_nothing_commits(gcs, source):
    src, _ = source
    endpoint = gcs["CKPT_TEST_GCS"]
    prefix = "gs-corrupt/orbax"
    flip_first: list[str] = []

    def corrupt(line: str) -> bool:  # the first data file of the process's database
        name = _uploaded(line) or ""
        if f"{prefix}/ocdbt.process_0/d/" in name and not flip_first:
            flip_first.append(name)
            return True
        return False

    proxy = CorruptingProxy(urllib.parse.urlsplit(endpoint).netloc, corrupt)
    dst = f"gs://{BUCKET}/{prefix}"
    try:
        r = run_ckpt("convert", str(src), dst, "--to", "orbax", env={**gcs, "TENSORSTORE_GCS_HTTP_URL": proxy.url},
                     timeout=300)
    finally:
        proxy.close()
    assert proxy.flipped, proxy.requests
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    victim = flip_first[0][len(prefix) + 1:]
    assert lines[0].startswith(f"ckpt: error: {dst}/{victim}: upload corrupted: GCS stored crc32c "), lines[0]
    q = urllib.parse.urlencode({"prefix": prefix + "/"})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}/o?{q}", timeout=60) as resp:
        keys = [item["name"] for item in json.load(resp).get("items", [])]
    assert not any(k.endswith(("commit_success.txt", "/manifest.ocdbt")) for k in keys), keys
    assert run_ckpt("validate", dst, env=gcs).returncode != 0


def test_two_processes_to_s3_merge_through_ckpt_and_orbax_restores(monkeypatch, tmp_path):
    """Two processes' writers (in this one) to s3://: the primary's merge reads the other's manifest
    and B+tree back from S3 and writes the root's node file and manifest itself (Storage.write), its
    values in the process databases' data files; orbax restores the output."""
    import hashlib

    from ckpt_tool.core.model import RegularGrid
    from ckpt_tool.core.write_plan import TargetArray, WritePlan
    from ckpt_tool.formats.orbax.write import OrbaxWriter
    from ckpt_tool.storage import Storage
    from ckpt_tool.storage import core as storage_core

    arr = np.random.default_rng(3).standard_normal((768, 512)).astype(np.float32)
    target = TargetArray(("a",), "a", arr.shape, "float32", RegularGrid((128, 512)))
    with moto_s3_serving(BUCKET, []) as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        url = f"s3://{BUCKET}/two-s3/orbax"
        writes: list[str] = []
        real_write = storage_core.Storage.write

        def counted(self, key, data):  # every object the primary's commit uploads
            writes.append(key)
            return real_write(self, key, data)

        writers = [OrbaxWriter(Storage.create(url)) for _ in range(2)]
        for i, w in enumerate(writers):
            w.begin(WritePlan([target], process_index=i, process_count=2))
        for c in range(6):
            writers[c % 2].write_array(target, c, (slice(c * 128, (c + 1) * 128), slice(0, 512)),
                                       arr[c * 128:(c + 1) * 128])
        for w in writers:
            w.finish_process()
        monkeypatch.setattr(storage_core.Storage, "write", counted)
        writers[0].commit()
        names = _s3_download(env["AWS_ENDPOINT_URL"], "two-s3/orbax/", tmp_path / "out")
    root = [n[len("two-s3/orbax/"):] for n in names if re.fullmatch(r"two-s3/orbax/(d/[0-9a-f]+|manifest\.ocdbt)", n)]
    assert len(root) == 2 and set(root) <= set(writes), (root, writes)
    import tensorstore as ts
    kv = ts.KvStore.open(f"file://{tmp_path}/out/").result()
    dumped = ts.ocdbt.dump(kv).result()
    entries = ts.ocdbt.dump(kv, dumped["versions"][-1]["root"]["location"]).result()["entries"]
    where = sorted({e["indirect_value"].split(":")[1] for e in entries if "indirect_value" in e})
    assert where == ["ocdbt.process_0/", "ocdbt.process_1/"], entries
    assert _restored(tmp_path / "out") == {"a": hashlib.sha256(arr.tobytes()).hexdigest()}
