"""Commit on an object store (issue 43 item 5): the owner record, markers last, kills and races.

Against real servers on 127.0.0.1 that the tests start: the Go fake-gcs-server (gs://) and moto
(s3://). A convert to an object store writes in place (there is no rename), so:

- its owner record `DST/.ckpt-owner.json` goes first, created with a precondition (GCS
  `ifGenerationMatch=0`, S3 `If-None-Match: *`), and is deleted after the commit markers;
- a run killed midway leaves the record: `validate` says `incomplete-save` naming the run, and
  the next `--overwrite` removes exactly the keys the record says the run wrote (a user's object
  under DST stays);
- a second writer fails at once naming the first, and touches nothing of its.

fake-gcs-server 1.54 ignores ifGenerationMatch on uploadType=media uploads (the only upload
tensorstore makes; its multipart and resumable paths do check it): the GCS tests check that ckpt
asks for the precondition (the server's request log), and the simultaneous race runs on S3,
where moto enforces If-None-Match.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    ROOT,
    fake_gcs_serving,
    fixture_path,
    gcs_create_bucket,
    moto_s3_serving,
    run_ckpt,
    s3_client,
)
from http_front import HttpFront

pytestmark = pytest.mark.slow

BUCKET = "ckpt-commit"
OWNER = ".ckpt-owner.json"
SRC = str(fixture_path("dcp_single"))


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def _gcs_keys(endpoint: str, prefix: str) -> list[str]:
    q = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}/o?{q}", timeout=120) as r:
        return sorted(item["name"] for item in json.load(r).get("items", []))


def _gcs_get(endpoint: str, name: str) -> bytes:
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media",
                                timeout=120) as r:
        return r.read()


def _gcs_put(endpoint: str, name: str, data: bytes) -> None:
    req = urllib.request.Request(
        f"{endpoint}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={urllib.parse.quote(name, safe='')}",
        data=data, method="POST", headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(req, timeout=120).close()


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("gcs") / "requests.log"
    with fake_gcs_serving(log=log) as env:
        gcs_create_bucket(env["CKPT_TEST_GCS"], BUCKET)
        yield {**env, "_log": str(log)}


def _env(gcs: dict) -> dict:
    return {k: v for k, v in gcs.items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def big_source(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A safetensors file of 192 MiB in 48 tensors: a convert of it to gs:// in 4 MiB shards
    takes long enough to be killed midway."""
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("big") / "model.safetensors"
    rng = np.random.default_rng(0)
    save_file({f"layer{i:02d}.weight": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(48)},
              str(path))
    return str(path)


def test_a_convert_to_gs_commits_and_leaves_no_record(gcs):
    endpoint = gcs["CKPT_TEST_GCS"]
    dst = f"gs://{BUCKET}/plain/dcp"
    r = run_ckpt("convert", SRC, dst, "--to", "dcp", env=_env(gcs))
    assert r.returncode == 0, r.stderr
    keys = _gcs_keys(endpoint, "plain/dcp/")
    assert "plain/dcp/.metadata" in keys and f"plain/dcp/{OWNER}" not in keys, keys
    assert run_ckpt("validate", dst, env=_env(gcs)).returncode == 0
    # the record was created with the precondition that only one writer gets it
    log = Path(gcs["_log"]).read_text()
    created = [line for line in log.splitlines() if "name=plain%2Fdcp%2F.ckpt-owner.json" in line]
    assert created and all("ifGenerationMatch=0" in line for line in created), created


class _FaultyFront(HttpFront):
    """The HTTP front of tests/http_front.py before a GCS server, answering every `every`-th request
    itself with 503 or 429 (alternately) and forwarding the others: the answers a busy GCS gives.
    `delay`: seconds each forwarded request waits first (a slow store: a writer surely midway)."""

    def __init__(self, target: str, every: int = 0, delay: float = 0.0) -> None:
        self.count = 0
        self.refused: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._every, self._delay = every, delay
        super().__init__(target, answer=self._answer)

    def _answer(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes] | None:
        with self._lock:
            self.count += 1
            n = self.count
        if self._every and n % self._every == 0:
            code = 503 if (n // self._every) % 2 else 429
            self.refused.append((code, f"{method} {path}"))
            return code, json.dumps({"error": {"code": code, "message": "try again"}}).encode()
        time.sleep(self._delay)
        return None


def _kill_midway(argv: list[str], env: dict, ready) -> None:  # noqa: ANN001 - ready: () -> bool
    """Start `ckpt argv`, SIGKILL it once `ready()` holds (it must not have finished by then)."""
    full = {**os.environ, **env}
    full.pop("CKPT_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *argv], env=full, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300  # (a loaded machine starts python slowly)
    try:
        while not ready():
            assert proc.poll() is None, ("finished before it could be killed", proc.communicate())
            assert time.time() < deadline, "never got midway"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_convert_to_gs_killed_midway_is_an_incomplete_save_that_overwrite_cleans(gcs, big_source, tmp_path):
    endpoint, env = gcs["CKPT_TEST_GCS"], _env(gcs)
    prefix = "killed/st"
    dst = f"gs://{BUCKET}/{prefix}"

    def midway() -> bool:
        keys = _gcs_keys(endpoint, prefix + "/")
        return sum(k.endswith(".safetensors") for k in keys) >= 3

    slow = _FaultyFront(endpoint, delay=0.1)  # the killed run's store is slow: surely midway when killed
    try:
        _kill_midway(["convert", big_source, dst, "--to", "safetensors", "--max-shard-size", "4MiB"],
                     {**env, "TENSORSTORE_GCS_HTTP_URL": slow.url}, midway)
    finally:
        slow.close()
    keys = _gcs_keys(endpoint, prefix + "/")
    assert f"{prefix}/{OWNER}" in keys and not any(k.endswith(".index.json") for k in keys), keys
    record = json.loads(_gcs_get(endpoint, f"{prefix}/{OWNER}"))
    assert record["format"] == "safetensors" and record["tool"] == "ckpt", record
    # what the killed run left is read as no finished checkpoint: convert refuses it as a source
    line = _one_line(run_ckpt("convert", dst, str(tmp_path / "out"), "--to", "dcp", env=env))
    assert "uncommitted save" in line, line
    # a user's object arrives under the prefix meanwhile
    _gcs_put(endpoint, f"{prefix}/notes.txt", b"my notes")

    r = run_ckpt("validate", dst, "--json", env=env)
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    codes = {f["code"]: f for f in report["findings"]}
    assert "incomplete-save" in codes, report
    msg = codes["incomplete-save"]["message"]
    assert f"pid {record['pid']}" in msg and "no longer running" in msg and "--overwrite" in msg, msg
    assert codes["incomplete-save"]["file"] == OWNER

    # without --overwrite: one line naming the killed run, nothing touched
    line = _one_line(run_ckpt("convert", SRC, dst, "--to", "dcp", env=env))
    assert "incomplete save of ckpt's" in line and f"pid {record['pid']}" in line and "--overwrite" in line, line
    assert _gcs_keys(endpoint, prefix + "/") == keys + [f"{prefix}/notes.txt"] or \
        sorted(keys + [f"{prefix}/notes.txt"]) == _gcs_keys(endpoint, prefix + "/")

    # --overwrite removes exactly what the record says the run wrote; the user's object stays, and a
    # prefix holding it is refused as a directory holding other files is
    r = run_ckpt("convert", SRC, dst, "--to", "dcp", "--overwrite", env=env)
    line = _one_line(r)
    assert "notes.txt" in line and "refusing" in line and "removed the incomplete save" in line, line
    assert _gcs_keys(endpoint, prefix + "/") == [f"{prefix}/notes.txt"]
    assert _gcs_get(endpoint, f"{prefix}/notes.txt") == b"my notes"


def test_overwrite_of_a_killed_save_then_writes_a_complete_checkpoint(gcs, big_source):
    endpoint, env = gcs["CKPT_TEST_GCS"], _env(gcs)
    prefix = "killed2/orbax"
    dst = f"gs://{BUCKET}/{prefix}"

    def midway() -> bool:
        return len(_gcs_keys(endpoint, prefix + "/")) >= 3

    slow = _FaultyFront(endpoint, delay=0.1)
    try:
        _kill_midway(["convert", big_source, dst, "--to", "dcp", "--chunk-mb", "1"],
                     {**env, "TENSORSTORE_GCS_HTTP_URL": slow.url}, midway)
    finally:
        slow.close()
    assert f"{prefix}/{OWNER}" in _gcs_keys(endpoint, prefix + "/")
    assert run_ckpt("validate", dst, env=env).returncode == 1
    r = run_ckpt("convert", SRC, dst, "--to", "orbax", "--overwrite", env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "removed the incomplete save" in r.stdout + r.stderr
    keys = _gcs_keys(endpoint, prefix + "/")
    assert f"{prefix}/{OWNER}" not in keys and not any(k.endswith(".distcp") for k in keys), keys
    assert run_ckpt("validate", dst, "--deep", env=env).returncode == 0


def test_a_second_writer_fails_at_once_naming_the_first_and_touches_nothing(gcs, big_source):
    endpoint, env = gcs["CKPT_TEST_GCS"], _env(gcs)
    prefix = "race/st"
    dst = f"gs://{BUCKET}/{prefix}"
    # the first writer talks to a slow store (each request 0.2 s late): surely still writing below
    slow = _FaultyFront(endpoint, delay=0.2)
    full = {**os.environ, **env, "TENSORSTORE_GCS_HTTP_URL": slow.url}
    full.pop("CKPT_DEBUG", None)
    first = subprocess.Popen([sys.executable, "-m", "ckpt_tool", "convert", big_source, dst, "--to", "safetensors",
                              "--max-shard-size", "4MiB"], env=full, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while f"{prefix}/{OWNER}" not in _gcs_keys(endpoint, prefix + "/"):
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.02)
        # paused, so that it is surely still writing (alive, its record there) while the others try
        first.send_signal(signal.SIGSTOP)
        before = _gcs_keys(endpoint, prefix + "/")
        for overwrite in ([], ["--overwrite"]):
            started = time.monotonic()
            line = _one_line(run_ckpt("convert", SRC, dst, "--to", "dcp", *overwrite, env=env))
            assert f"pid {first.pid}" in line and "another ckpt is writing this destination" in line, line
            assert time.monotonic() - started < 60  # at once: python's start-up, one LIST, one read
        assert _gcs_keys(endpoint, prefix + "/") == before
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=600)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
        slow.close()
    keys = _gcs_keys(endpoint, prefix + "/")
    assert f"{prefix}/{OWNER}" not in keys and not any(k.endswith(".distcp") for k in keys), keys
    assert run_ckpt("validate", dst, env=env).returncode == 0


# -- S3 (moto enforces If-None-Match: the race itself) -----------------------------------------


def test_two_converts_racing_to_one_s3_prefix_exactly_one_wins(tmp_path):
    bucket = "ckpt-commit-race"
    with moto_s3_serving(bucket, []) as env:
        dst = f"s3://{bucket}/race/dcp"
        full = {**os.environ, **env}
        full.pop("CKPT_DEBUG", None)
        results: list[subprocess.CompletedProcess] = [None, None]  # type: ignore[list-item]

        def run(i: int) -> None:
            results[i] = subprocess.run([sys.executable, "-m", "ckpt_tool", "convert", SRC, dst, "--to", "dcp"],
                                        env=full, cwd=ROOT, capture_output=True, text=True, timeout=180)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r.returncode for r in results)
        assert codes == [0, 1], [(r.returncode, r.stderr) for r in results]
        loser = next(r for r in results if r.returncode == 1)
        line = _one_line(loser)
        assert ("another ckpt is writing this destination" in line or "destination appeared" in line
                or "destination exists" in line), line
        assert run_ckpt("validate", dst, env=env).returncode == 0
        s3 = s3_client(env["AWS_ENDPOINT_URL"])
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="race/")["Contents"]]
        assert f"race/dcp/{OWNER}" not in keys, keys


def test_the_s3_record_is_created_only_where_none_is(tmp_path):
    """moto answers If-None-Match: * with 412 where the record exists: a run that finds one
    in its way fails naming it; a record of a dead run is an incomplete save."""
    bucket = "ckpt-commit-s3"
    with moto_s3_serving(bucket, []) as env:
        s3 = s3_client(env["AWS_ENDPOINT_URL"])
        record = {"tool": "ckpt", "destination": f"s3://{bucket}/w", "host": os.uname().nodename, "pid": 2**22 + 7,
                  "pid_start": None, "boot_id": None, "machine_id": None, "started": time.time(), "run": "ab" * 16,
                  "format": "dcp", "writes": [".metadata", "*.distcp"], "markers": [".metadata"],
                  "updated": time.time()}
        s3.put_object(Bucket=bucket, Key=f"w/{OWNER}", Body=json.dumps(record).encode())
        s3.put_object(Bucket=bucket, Key="w/__0_0.distcp", Body=b"partial")
        line = _one_line(run_ckpt("convert", SRC, f"s3://{bucket}/w", "--to", "dcp", env=env))
        assert "incomplete save of ckpt's" in line and "pid 4194311" in line, line
        r = run_ckpt("convert", SRC, f"s3://{bucket}/w", "--to", "orbax", "--overwrite", env=env)
        assert r.returncode == 0, r.stderr
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="w/")["Contents"])
        assert "w/__0_0.distcp" not in keys and f"w/{OWNER}" not in keys and "w/commit_success.txt" in keys, keys


# -- 429 and 503 answers are retried with backoff -----------------------------------------------


def test_429_and_503_answers_are_retried_and_the_output_commits(gcs):
    front = _FaultyFront(gcs["CKPT_TEST_GCS"], every=4)
    try:
        env = {**_env(gcs), "TENSORSTORE_GCS_HTTP_URL": front.url}
        dst = f"gs://{BUCKET}/busy/orbax"
        r = run_ckpt("convert", str(fixture_path("orbax_ocdbt_zarr2")), dst, "--to", "orbax", env=env)
        assert r.returncode == 0, r.stderr
        codes = {code for code, _ in front.refused}
        assert codes == {429, 503}, front.refused
        # the record was created through the retries and is gone; the output is whole
        assert f"busy/orbax/{OWNER}" not in _gcs_keys(gcs["CKPT_TEST_GCS"], "busy/orbax/")
        r = run_ckpt("validate", dst, "--deep", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        front.close()


def test_a_convert_to_gs_stopped_by_sigterm_removes_what_it_wrote_and_its_record(gcs, big_source):
    endpoint, env = gcs["CKPT_TEST_GCS"], _env(gcs)
    prefix = "stopped/st"
    slow = _FaultyFront(endpoint, delay=0.1)
    full = {**os.environ, **env, "TENSORSTORE_GCS_HTTP_URL": slow.url}
    full.pop("CKPT_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", "convert", big_source, f"gs://{BUCKET}/{prefix}",
                             "--to", "safetensors", "--max-shard-size", "4MiB"], env=full, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while sum(k.endswith(".safetensors") for k in _gcs_keys(endpoint, prefix + "/")) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    slow.close()
    assert proc.returncode == 130, err
    assert _gcs_keys(endpoint, prefix + "/") == []


def _start_gcs(root: Path) -> tuple[subprocess.Popen, dict]:
    """The Go fake-gcs-server on `root`'s file system (what it stored survives a restart)."""
    from conftest import fake_gcs_binary, free_port, wait_until_serving

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([fake_gcs_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                               "-external-url", endpoint, "-log-level", "error", "-backend", "filesystem",
                               "-filesystem-root", str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until_serving(server, f"{endpoint}/storage/v1/b", "fake-gcs-server")
    return server, {"TENSORSTORE_GCS_HTTP_URL": endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",
                    "CKPT_TEST_GCS": endpoint, "CKPT_IO_TIMEOUT": "5", "CKPT_IO_RETRIES": "2"}


def test_the_server_stopped_mid_upload_leaves_an_incomplete_save(tmp_path, big_source):
    root = tmp_path / "gcs"
    server, env = _start_gcs(root)
    prefix = "dead/st"
    dst = f"gs://{BUCKET}/{prefix}"
    try:
        gcs_create_bucket(env["CKPT_TEST_GCS"], BUCKET)
        full = {**os.environ, **env}
        full.pop("CKPT_DEBUG", None)
        proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", "convert", big_source, dst, "--to", "safetensors",
                                 "--max-shard-size", "4MiB"], env=full, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while sum(k.endswith(".safetensors") for k in _gcs_keys(env["CKPT_TEST_GCS"], prefix + "/")) < 3:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        server.kill()  # mid-upload
        server.wait(timeout=10)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1 and len(err.strip().splitlines()) == 1, err
        assert "does not answer" in err or "gave no answer" in err, err
    finally:
        if server.poll() is None:
            server.kill()
    server, env = _start_gcs(root)  # the same objects, served again
    try:
        keys = _gcs_keys(env["CKPT_TEST_GCS"], prefix + "/")
        assert f"{prefix}/{OWNER}" in keys and not any(k.endswith(".index.json") for k in keys), keys
        r = run_ckpt("validate", dst, "--json", env=env)
        assert r.returncode == 1
        assert "incomplete-save" in {f["code"] for f in json.loads(r.stdout)["findings"]}, r.stdout
        r = run_ckpt("convert", SRC, dst, "--to", "dcp", "--overwrite", env=env)
        assert r.returncode == 0, r.stderr
        keys = _gcs_keys(env["CKPT_TEST_GCS"], prefix + "/")
        assert not any(k.endswith(".safetensors") for k in keys) and f"{prefix}/{OWNER}" not in keys, keys
        assert run_ckpt("validate", dst, env=env).returncode == 0
    finally:
        server.kill()
        server.wait(timeout=10)


def test_a_reshard_to_gs_killed_midway_is_an_incomplete_save_and_overwrite_writes_it_whole(gcs, big_source):
    endpoint, env = gcs["CKPT_TEST_GCS"], _env(gcs)
    prefix = "resharded/orbax"
    dst = f"gs://{BUCKET}/{prefix}"
    argv = ["reshard", big_source, dst, "--mesh", "data=2,model=4", "--devices", "8", "--fsdp", "model"]

    def midway() -> bool:
        return any(k.startswith(f"{prefix}/d/") for k in _gcs_keys(endpoint, prefix + "/"))

    slow = _FaultyFront(endpoint, delay=0.1)
    try:
        _kill_midway(argv, {**env, "TENSORSTORE_GCS_HTTP_URL": slow.url}, midway)
    finally:
        slow.close()
    keys = _gcs_keys(endpoint, prefix + "/")
    assert f"{prefix}/{OWNER}" in keys and f"{prefix}/commit_success.txt" not in keys, keys
    r = run_ckpt("validate", dst, "--json", env=env)
    assert r.returncode == 1 and "incomplete-save" in {f["code"] for f in json.loads(r.stdout)["findings"]}
    r = run_ckpt(*argv, "--overwrite", env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    keys = _gcs_keys(endpoint, prefix + "/")
    assert f"{prefix}/{OWNER}" not in keys and f"{prefix}/commit_success.txt" in keys, keys
    assert run_ckpt("validate", dst, env=env).returncode == 0


def test_the_s3_record_is_created_with_if_none_match_and_taken_over_by_generation(monkeypatch):
    """The precondition itself, on a server that enforces it (moto): a second create of the record
    fails, a take-over conditioned on a stale generation fails, one on the current one wins."""
    from ckpt_tool.ops.destination_remote import _no_value, _OwnerObject
    from ckpt_tool.storage import Storage

    bucket = "ckpt-commit-cond"
    with moto_s3_serving(bucket, []) as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        owner = _OwnerObject(Storage.create(f"s3://{bucket}/p"))
        first = owner.write_if(b"one", _no_value())
        assert first is not None
        assert owner.write_if(b"two", _no_value()) is None  # If-None-Match: * answered 412
        data, gen = owner.read()
        assert (data, gen) == (b"one", first)
        newer = owner.write_if(b"three", gen)
        assert newer is not None and newer != gen
        assert owner.write_if(b"four", gen) is None  # stale generation
        assert owner.read()[0] == b"three"
        assert owner.write_if(None, newer) is not None  # our own record goes
        assert owner.read()[0] is None


def test_a_run_roots_step_holding_a_record_is_not_what_a_resume_opens(gcs, tmp_path):
    """A convert into gs://run/step-30 that has not committed (its record there) is no step a resume
    opens, whatever its files say: `ckpt latest` passes over it, naming the record."""
    import shutil

    from conftest import gcs_upload_tree

    local = tmp_path / "run"
    shutil.copytree(fixture_path("runs_torchtitan"), local)
    (local / "step-30" / OWNER).write_text("{}")
    root = gcs_upload_tree(gcs["CKPT_TEST_GCS"], BUCKET, local, "titan")
    r = run_ckpt("latest", root, env=_env(gcs))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{root}/step-20", r.stdout
    assert f"skipped step-30: in-progress: {OWNER} is there" in r.stderr, r.stderr


def _foreign_record(destination: str, updated: float) -> bytes:
    """An owner record as a run on another host writes it."""
    return json.dumps({"tool": "ckpt", "destination": destination, "host": "tpu-host-7", "pid": 4242,
                       "pid_start": 1, "boot_id": "b", "machine_id": "not-this-machine", "started": updated - 60,
                       "run": "cd" * 16, "format": "dcp", "writes": [".metadata", "*.distcp"],
                       "markers": [".metadata"], "updated": updated}).encode()


def test_a_record_from_another_host_is_taken_over_only_once_it_is_no_longer_refreshed(gcs):
    endpoint, env = gcs["CKPT_TEST_GCS"], _env(gcs)
    prefix = "elsewhere/dcp"
    dst = f"gs://{BUCKET}/{prefix}"
    _gcs_put(endpoint, f"{prefix}/{OWNER}", _foreign_record(dst, time.time()))
    _gcs_put(endpoint, f"{prefix}/__0_0.distcp", b"partial")
    # refreshed a moment ago: its run may be writing, on a host ckpt cannot look at
    line = _one_line(run_ckpt("convert", SRC, dst, "--to", "dcp", "--overwrite", env=env))
    assert "another ckpt is writing this destination" in line and "tpu-host-7" in line and "another host" in line, line
    assert _gcs_keys(endpoint, prefix + "/") == [f"{prefix}/{OWNER}", f"{prefix}/__0_0.distcp"]
    # not refreshed for 11 minutes (a run refreshes it every minute): abandoned, and --overwrite takes it over
    _gcs_put(endpoint, f"{prefix}/{OWNER}", _foreign_record(dst, time.time() - 660))
    r = run_ckpt("validate", dst, "--json", env=env)
    assert "not refreshed for over 10 min" in r.stdout, r.stdout
    r = run_ckpt("convert", SRC, dst, "--to", "dcp", "--overwrite", env=env)
    assert r.returncode == 0, r.stderr
    assert run_ckpt("validate", dst, env=env).returncode == 0


def test_a_writing_run_refreshes_its_record_and_removes_it_when_done(gcs):
    """The heartbeat: while a run writes, its record's `updated` moves (under a generation
    condition, so the run still holds it), and the record goes when the run is done. In a process
    of its own: tensorstore keeps one GCS endpoint per process."""
    endpoint = gcs["CKPT_TEST_GCS"]
    prefix = "heartbeat/dcp"
    script = f"""
import json, sys, time, urllib.request
from ckpt_tool.ops import destination_remote as output_remote
output_remote.HEARTBEAT_EVERY = 0.1
def record():
    url = "{endpoint}/storage/v1/b/{BUCKET}/o/" + "{prefix}/{OWNER}".replace("/", "%2F") + "?alt=media"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)
out = output_remote.prepare_output({SRC!r}, "gs://{BUCKET}/{prefix}", overwrite=False, writes="dcp")
first = record()["updated"]
deadline = time.time() + 60
while record()["updated"] == first:
    assert time.time() < deadline, "never refreshed"
    time.sleep(0.05)
output_remote.confirm_output(out)  # still ours: the refreshes kept its generation in step
output_remote.finalize_output(out, overwrite=False)
print("refreshed")
"""
    full = {**os.environ, **_env(gcs)}
    r = subprocess.run([sys.executable, "-c", script], env=full, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "refreshed", r.stderr
    assert _gcs_keys(endpoint, prefix + "/") == []


def test_a_lost_race_whose_winner_already_finished_claims_again_and_judges_what_it_left(monkeypatch):
    """The interleaving CI met: our create of the record fails because another run's record is
    there, and by the time we read it that run has finished and removed it. That is not "another
    run is starting to write": the claim is made again, and what the winner left is then judged
    (here: nothing, so DST is ours)."""
    from ckpt_tool.ops.destination_remote import RemoteOutput, _claim, _new_record, _no_value, _OwnerObject
    from ckpt_tool.storage import Storage

    bucket = "ckpt-commit-gone"
    with moto_s3_serving(bucket, []) as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        dst = f"s3://{bucket}/p"
        winner = _OwnerObject(Storage.create(dst))

        class Racing(_OwnerObject):
            raced = False

            def write_if(self, data, generation):
                if self.raced:
                    return super().write_if(data, generation)
                self.raced = True
                theirs = winner.write_if(b'{"run": "theirs"}', _no_value())  # the winner's create
                ours = super().write_if(data, generation)  # ... beats ours (412)
                assert ours is None and theirs is not None
                assert winner.write_if(None, theirs) is not None  # ... and it finishes
                return ours

        out = RemoteOutput(dst, dst, None)
        out.run, out.record = _new_record(dst, "dcp")
        owner = Racing(Storage.create(dst))
        _claim(out, owner)
        assert out.generation is not None
        assert owner.read() == (out.record, out.generation)
