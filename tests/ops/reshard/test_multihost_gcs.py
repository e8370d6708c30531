"""Several hosts, one object store (issue 43 item 4): `ckpt reshard gs:// -> gs://` run as 4 processes.

A pod runs the same command on every host. Here 4 local processes join through ckpt's own
multi-process flags (`--coordinator 127.0.0.1:PORT --num-processes 4 --process-id i`) and reshard
an Orbax checkpoint that orbax wrote from 4 CPU devices (data=4) for the mesh data=2,model=2,
from the real Go fake-gcs-server to the same server:

- each process reads about its share of the array bytes (at most 1.1/N, plus the metadata): as
  ckpt counts it (the `bytes_read` of --json: storage.ReadLog) and as the wire shows it. The
  server's own log has one line a request but no byte count for a download (it logs 0 for a
  streamed body), so each process talks to the server through its own logging HTTP proxy
  (tests/http_front.py: each request's method, object, Range header, status and the length of the body
  it answered); the server's log is checked to hold exactly the requests the proxies passed on,
  so no read went round them;
- the output is one checkpoint that orbax restores on the new mesh, equal to what was saved;
- the root database process 0 merges from the 4 per-process ones is written by ckpt (its node
  file and manifest through Storage.write, each checked against the crc32c GCS stored); a byte
  flipped in either on the way to GCS fails process 0 with one line, and nothing commits;
- one process SIGKILLed midway (at its first chunk read) fails every other with exit 1 and one
  line within 60 s, and `ckpt validate` finds no complete checkpoint at DST (incomplete-save);
  the next run with --overwrite removes what the killed run wrote. Killed: process 2, process 0
  (which serves jax's coordination service), and process 0's worker alone (cli/supervise.py).

The two runs are slow (whole processes, a server); a fast test checks bytes_read in one process.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from conftest import ROOT, fake_gcs_serving, fixture_path, free_port, gcs_create_bucket, gcs_upload_tree, run_ckpt
from http_front import HttpFront

N = 4
BUCKET = "ckpt-pod"
MESH = "data=2,model=2"

# orbax's save from 4 CPU devices: 4 arrays sharded over data=4 (each stored as 4 chunks of
# 256 rows), one replicated; 28 MiB of random floats (zstd leaves them about that size)
_GENERATE = r"""
import os, sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax.checkpoint as ocp

out, arrays = sys.argv[1], sys.argv[2]
mesh = Mesh(np.array(jax.devices()).reshape(4), ("data",))
rng = np.random.default_rng(0)
tree, plain = {}, {}
for name, shape in [("w1", (1024, 2048)), ("w2", (2048, 1024)), ("emb", (4096, 512)), ("w3", (512, 2048))]:
    plain[name] = rng.standard_normal(shape, dtype=np.float32)
    tree[name] = jax.device_put(plain[name], NamedSharding(mesh, P("data", None)))
plain["bias"] = np.arange(1024, dtype=np.float32)
tree["bias"] = jax.device_put(plain["bias"], NamedSharding(mesh, P()))
ckptr = ocp.StandardCheckpointer()
ckptr.save(out, tree)
ckptr.wait_until_finished()
np.savez(arrays, **plain)
"""

# orbax restores the output on a data=2,model=2 mesh of 4 CPU devices, each array with the
# sharding the output's metadata records, and compares it with what was saved
_RESTORE = r"""
import json, sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax.checkpoint as ocp

path, arrays = sys.argv[1], sys.argv[2]
saved = np.load(arrays)
ckptr = ocp.StandardCheckpointer()
meta = ckptr.metadata(path).item_metadata
target, specs = {}, {}
for name, m in meta.items():
    sm = m.sharding
    mesh = Mesh(np.array(jax.devices()).reshape(sm.shape), tuple(sm.axis_names))
    spec = P(*sm.partition_spec)
    specs[name] = [dict(zip(sm.axis_names, (int(s) for s in sm.shape))), list(sm.partition_spec)]
    target[name] = jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=NamedSharding(mesh, spec))
restored = ckptr.restore(path, target)
for name, arr in restored.items():
    assert np.array_equal(np.asarray(arr), saved[name]), name
    for shard in arr.addressable_shards:  # each device holds its own block of the array
        assert np.array_equal(np.asarray(shard.data), saved[name][shard.index]), (name, shard.index)
print(json.dumps(specs))
"""


def _object(path: str) -> str | None:
    """The object a JSON-API request names (`/storage/v1/b/B/o/NAME?...`), or None (listings, uploads)."""
    m = re.match(r"^/storage/v1/b/[^/]+/o/([^?]+)", path)
    return urllib.parse.unquote(m.group(1)) if m else None


def _uploaded(path: str) -> str | None:
    """The object an upload request (tensorstore's `uploadType=media` POST) names, or None."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    return query["name"][0] if query.get("uploadType") == ["media"] else None


def _gcs_keys(endpoint: str, prefix: str) -> list[str]:
    q = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}/o?{q}", timeout=10) as r:
        return sorted(item["name"] for item in json.load(r).get("items", []))


def _download(endpoint: str, prefix: str, local: Path) -> None:
    for name in _gcs_keys(endpoint, prefix):
        target = local / name[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        url = f"{endpoint}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media"
        with urllib.request.urlopen(url, timeout=30) as r:
            target.write_bytes(r.read())


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the Orbax checkpoint orbax wrote from 4 CPU devices, the arrays it holds as .npz)."""
    base = tmp_path_factory.mktemp("pod")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _GENERATE, str(base / "src"), str(base / "arrays.npz")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return base / "src", base / "arrays.npz"


@pytest.fixture
def server(tmp_path: Path, saved: tuple[Path, Path]) -> Iterator[tuple[dict[str, str], Path, str]]:
    """(the environment pointing at a fresh GCS server, its request log, gs:// of the uploaded source)."""
    log = tmp_path / "requests.log"
    with fake_gcs_serving(log=log) as env:
        endpoint = env["CKPT_TEST_GCS"]
        gcs_create_bucket(endpoint, BUCKET)
        yield env, log, gcs_upload_tree(endpoint, BUCKET, saved[0], "src")


def _start(argv: list[str], env: dict[str, str], proxies: list[HttpFront], port: int) -> list[subprocess.Popen]:
    """The same command in N processes, process i talking to the server through proxies[i]."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CKPT_DEBUG")}
    return [
        subprocess.Popen(
            [sys.executable, "-m", "ckpt_tool", *argv,
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(N), "--process-id", str(i)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # one CPU device a process: jax's devices of the run are the mesh's 4
            env={**base, **env, "JAX_PLATFORMS": "cpu", "TENSORSTORE_GCS_HTTP_URL": proxies[i].url},
        )
        for i in range(N)
    ]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


@pytest.mark.slow
def test_each_process_reads_its_share_and_orbax_restores_the_output(server, saved, tmp_path):
    env, log, src = server
    endpoint = env["CKPT_TEST_GCS"]
    sizes: dict[str, int] = {}
    for path in saved[0].rglob("*"):
        if path.is_file():
            sizes["src/" + path.relative_to(saved[0]).as_posix()] = path.stat().st_size
    # the chunks live in the per-process OCDBT databases' data files; the rest is metadata
    data_files = {k for k in sizes if re.match(r"src/ocdbt\.process_\d+/d/", k)}
    array_bytes = sum(sizes[k] for k in data_files)
    metadata_bytes = sum(sizes.values()) - array_bytes
    assert array_bytes > 20 * 2**20 and metadata_bytes < 64 * 2**10, (array_bytes, metadata_bytes)
    share = array_bytes / N

    logged_before = log.read_text().count("\n")
    proxies = [HttpFront(endpoint) for _ in range(N)]
    procs = _start(["reshard", src, f"gs://{BUCKET}/out", "--mesh", MESH, "--json"], env, proxies, free_port())
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        _stop(procs)
        for proxy in proxies:
            proxy.close()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out) for out, _ in outs]
    assert [r["process_index"] for r in results] == list(range(N))

    for i, (result, proxy) in enumerate(zip(results, proxies)):
        got = [(r, _object(r["path"])) for r in proxy.records if r["method"] == "GET"]
        data = sum(r["received"] for r, name in got if name in data_files)
        other = sum(r["received"] for r, name in got if name not in data_files)
        # on the wire: a quarter of the chunks' bytes (and the B+tree nodes beside them), and the
        # metadata files and listings, which every process reads
        assert 0.9 * share <= data <= 1.1 * share, (i, data, share)
        assert other <= 4 * metadata_bytes + 128 * 2**10, (i, other)
        # ckpt's own count of what this process read of SRC agrees
        assert 0.9 * share <= result["bytes_read"] <= 1.1 * share + 4 * metadata_bytes, (i, result["bytes_read"], share)
        print(f"process {i}: ckpt bytes_read {result['bytes_read']:,}; on the wire {data:,} of the data files "
              f"({data / array_bytes:.3f} of {array_bytes:,}) + {other:,} of metadata and listings, "
              f"{len(proxy.records)} requests")

    # the server served exactly the requests the proxies passed on: no process read round them
    served = collections.Counter()
    for line in log.read_text().splitlines()[logged_before:]:
        m = re.search(r'\\"(GET|POST|PUT|PATCH|DELETE) (\S+) HTTP', line)
        if m:
            served[(m.group(1), m.group(2))] += 1
    passed = collections.Counter((r["method"], r["path"]) for proxy in proxies for r in proxy.records)
    assert passed and all(served[k] >= n for k, n in passed.items()), (passed - served)
    src_reads = {k: n for k, n in served.items() if k[0] == "GET" and (_object(k[1]) or "").startswith("src/")}
    assert src_reads and all(passed[k] == n for k, n in src_reads.items())

    # the root database process 0 merged from the 4 per-process ones was written by ckpt: its B+tree's
    # node file and its manifest went up through Storage.write, each by ckpt's own upload, checked
    # against the crc32c in its answer, so with no request for it after (storage/gcs_uploads.py;
    # before, tensorstore's merge uploaded them and nothing checked them)
    root = [k for k in _gcs_keys(endpoint, "out/") if re.fullmatch(r"out/(d/[0-9a-f]+|manifest\.ocdbt)", k)]
    assert len(root) == 2, root
    for name in root:
        uploads = [i for i, r in enumerate(proxies[0].records)
                   if r["method"] == "POST" and _uploaded(r["path"]) == name]
        asked = [i for i, r in enumerate(proxies[0].records)
                 if r["method"] == "GET" and _object(r["path"]) == name and "fields=crc32c" in r["path"]]
        assert len(uploads) == 1 and asked == [], (name, uploads, asked)

    # one checkpoint, complete, that orbax restores on the new mesh
    r = run_ckpt("validate", f"gs://{BUCKET}/out", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    local = tmp_path / "out"
    _download(endpoint, "out/", local)
    restore_env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _RESTORE, str(local), str(saved[1])], capture_output=True, text=True,
                       env=restore_env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    specs = json.loads(r.stdout.strip().splitlines()[-1])
    assert specs["w1"] == [{"data": 2, "model": 2}, ["data"]], specs
    assert specs["bias"][0] == {"data": 2, "model": 2}, specs


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["d/", "manifest.ocdbt"], ids=["root-node-file", "root-manifest"])
def test_a_corrupted_upload_of_the_merged_root_is_one_line_and_nothing_commits(server, victim):
    """Process 0 merges the per-process databases into the root one at commit; a byte flipped on the
    way to GCS in one of the root's objects (its B+tree's node file, its manifest) fails process 0
    with one line naming it, and no commit marker is written."""
    from test_remote_upload_checksums import CorruptingProxy

    env, _, src = server
    endpoint = env["CKPT_TEST_GCS"]
    prefix = f"corrupt-root-{victim.strip('/').replace('.', '-')}"
    flipped: list[str] = []

    def corrupt(line: str) -> bool:  # the root's own object, not a process database's
        name = _uploaded(line.split(" ")[1]) or ""
        if name.startswith(f"{prefix}/{victim}") and not flipped:
            flipped.append(name)
            return True
        return False

    front = CorruptingProxy(urllib.parse.urlsplit(endpoint).netloc, corrupt)
    proxies = [HttpFront(endpoint) for _ in range(N)]
    proxies[0].close()
    dst = f"gs://{BUCKET}/{prefix}"
    procs = _start(["reshard", src, dst, "--mesh", MESH], env, [front, *proxies[1:]], free_port())
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        _stop(procs)
        front.close()
        for proxy in proxies[1:]:
            proxy.close()
    assert flipped, front.requests  # the proxy did damage the upload
    assert procs[0].returncode == 1, outs[0]
    lines = outs[0][1].strip().splitlines()
    assert len(lines) == 1, outs[0][1]
    assert lines[0].startswith(f"ckpt: error: gs://{BUCKET}/{flipped[0]}: upload corrupted: GCS stored crc32c "), lines[0]
    # nothing commits: no marker (a failed multi-process run leaves what it wrote, and its owner
    # record, for --overwrite: docs/storage.md), nor, when the node file was damaged, a root manifest
    keys = _gcs_keys(endpoint, f"{prefix}/")
    assert f"{prefix}/commit_success.txt" not in keys and f"{prefix}/.ckpt-owner.json" in keys, keys
    if victim == "d/":
        assert f"{prefix}/manifest.ocdbt" not in keys, keys
    r = run_ckpt("validate", dst, env=env)
    assert r.returncode != 0 and "incomplete-save" in r.stdout, r.stdout + r.stderr


def _worker(pid: int) -> int:
    """The process doing a supervised command's work: the only child of the one started (cli/supervise.py)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.slow
@pytest.mark.parametrize("victim, target", [(2, "process"), (0, "process"), (0, "worker")])
def test_a_killed_process_fails_the_others_and_leaves_nothing_complete(server, victim, target):
    # jax.distributed coordinates (what a TPU pod has; the flags' default where jax is importable).
    # (CKPT_DISTRIBUTED=torch, gloo, ends the others the same way: 18.6 s here; not run, for time)
    # Process 2 is found silent by ckpt's own watch (CKPT_PEER_TIMEOUT). Process 0 serves jax's
    # coordination service: its loss makes jaxlib abort the others at once (SIGABRT, a C++ stack),
    # which ckpt's supervisor (cli/supervise.py) turns into one line and exit 1. Killed: the process
    # the launcher started (for process 0, the supervisor: the worker, its child, dies with it), or
    # process 0's worker alone (as the kernel's OOM killer picks it: the supervisor ends with it).
    library = "jax"
    env, _, src = server
    endpoint = env["CKPT_TEST_GCS"]
    reading, released = threading.Event(), threading.Event()

    def hold(record: dict) -> None:
        # the victim's first read of a stored chunk: it is midway (planned, joined, writing)
        if record["range"] and "ocdbt.process_" in record["path"] and record["received"] > 4096:
            reading.set()
            released.wait(90)

    proxies = [HttpFront(endpoint, hold=hold if i == victim else None) for i in range(N)]
    dst = f"gs://{BUCKET}/killed"
    # a silent process is posted failed after 6 s here, not the default 20: the same watch, in less of the suite
    procs = _start(["reshard", src, dst, "--mesh", MESH], {**env, "CKPT_DISTRIBUTED": library, "CKPT_PEER_TIMEOUT": "6"},
                   proxies, free_port())
    try:
        assert reading.wait(90), "the victim never read a chunk"
        os.kill(procs[victim].pid if target == "process" else _worker(procs[victim].pid), signal.SIGKILL)
        killed = time.monotonic()
        released.set()
        ended: dict[int, float] = {}
        outs: dict[int, tuple[str, str]] = {}
        for i, p in enumerate(procs):
            if i == victim:
                continue
            outs[i] = p.communicate(timeout=max(1.0, killed + 75 - time.monotonic()))
            ended[i] = time.monotonic() - killed
        victim_end = procs[victim].wait(30)  # (before _stop, which would kill it)
    finally:
        released.set()
        _stop(procs)
        for proxy in proxies:
            proxy.close()
    if target == "worker":
        assert victim_end == -signal.SIGKILL  # its supervisor ended as its worker did
    print(f"{library}: after the kill of process {victim}{'' if target == 'process' else ' (its worker)'} the others exited in "
          f"{', '.join(f'{t:.1f} s' for t in ended.values())}: {outs[min(outs)][1].strip()}")
    for i, (_, err) in outs.items():
        assert procs[i].returncode == 1, (i, procs[i].returncode, err[-3000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckpt: error:"), (i, err[-3000:])
        assert f"process {victim}" in lines[0], lines[0]
        assert ended[i] <= 60, (i, ended[i])
    # nothing at DST validates as complete: the run's owner record says a save of ckpt's stopped there
    r = run_ckpt("validate", dst, env=env)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "incomplete-save" in r.stdout, r.stdout + r.stderr
    left = _gcs_keys(endpoint, "killed/")
    assert "killed/.ckpt-owner.json" in left, left
    # the next run with --overwrite removes what the killed run's processes wrote, and commits
    r = run_ckpt("reshard", src, dst, "--mesh", MESH, "--devices", str(N), "--overwrite", env=env)
    assert r.returncode == 0, r.stderr
    assert "removed the incomplete save of an interrupted ckpt run" in r.stdout, r.stdout
    r = run_ckpt("validate", dst, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    now = _gcs_keys(endpoint, "killed/")
    # (the data files' names are random; one process now writes only ocdbt.process_0)
    assert not set(now) & {k for k in left if "/d/" in k}, now
    assert not [k for k in now if re.match(r"killed/ocdbt\.process_[1-9]", k)], now


def test_bytes_read_counts_what_a_convert_read_of_its_source(tmp_path):
    """One process (in this one): every stored chunk is read once, so bytes_read covers the OCDBT data
    files (less the B+tree nodes, which are read beside the storage layer) and stays within the source."""
    from ckpt_tool.ops import engine

    src = fixture_path("orbax_ocdbt_zarr2")
    files = [p for p in src.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    data = sum(p.stat().st_size for p in files if re.search(r"ocdbt\.process_\d+/d/", p.as_posix()))
    result = engine.convert(str(src), str(tmp_path / "out"), engine.ConvertOptions(to="dcp"))
    assert 0.9 * data <= result.bytes_read <= total, (result.bytes_read, data, total)
    assert result.to_json()["bytes_read"] == result.bytes_read
