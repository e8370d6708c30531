"""s3:// through the storage layer, against a real S3-compatible server (moto) on 127.0.0.1."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import (ROOT, S3_TEST_CREDENTIALS, fixture_path, free_port, moto_s3_serving, run_ckpt,
                      s3_client, upload_fixture, wait_until_serving)

BUCKET = "ckpt-test"
S3_FIXTURES = ["orbax_ocdbt_zarr2", "orbax_two_process", "dcp_multirank"]




@pytest.fixture(scope="module")
def s3_env():
    with moto_s3_serving(BUCKET, S3_FIXTURES) as env:
        yield env


@pytest.mark.slow
@pytest.mark.parametrize("name", S3_FIXTURES)
def test_inspect_s3_equals_local(s3_env, name):
    remote = run_ckpt("inspect", f"s3://{BUCKET}/run/{name}", "--json", "--values", env=s3_env)
    assert remote.returncode == 0, remote.stderr
    assert remote.stderr == ""  # no credential-probing noise
    local = run_ckpt("inspect", str(fixture_path(name)), "--json", "--values")
    a, b = json.loads(remote.stdout), json.loads(local.stdout)
    assert a["leaves"] == b["leaves"] and a["summary"] == b["summary"]


@pytest.mark.slow
@pytest.mark.parametrize("name", S3_FIXTURES)
def test_validate_deep_and_diff_over_s3(s3_env, name):
    r = run_ckpt("validate", f"s3://{BUCKET}/run/{name}", "--deep", "--json", env=s3_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["ok"]
    d = run_ckpt("diff", f"s3://{BUCKET}/run/{name}", str(fixture_path(name)), "--values", env=s3_env)
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.slow
def test_missing_s3_prefix_is_one_line(s3_env):
    r = run_ckpt("inspect", f"s3://{BUCKET}/nothing/here", env=s3_env)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.slow
def test_convert_between_s3_and_local(s3_env, tmp_path):
    src = f"s3://{BUCKET}/run/orbax_ocdbt_zarr2"
    dst = f"s3://{BUCKET}/out/dcp_from_orbax"
    r = run_ckpt("convert", src, dst, "--to", "dcp", "--json", env=s3_env)
    assert r.returncode == 0, r.stderr
    assert run_ckpt("validate", dst, "--deep", env=s3_env).returncode == 0
    d = run_ckpt("diff", str(fixture_path("orbax_ocdbt_zarr2")), dst, "--values", env=s3_env)
    assert d.returncode == 0, d.stdout + d.stderr
    # an existing S3 destination is refused without --overwrite
    again = run_ckpt("convert", src, dst, "--to", "dcp", env=s3_env)
    assert again.returncode == 1 and "destination exists" in again.stderr
    # and back from S3 to a local Orbax checkpoint
    local = tmp_path / "orbax_again"
    r = run_ckpt("convert", dst, str(local), "--to", "orbax", env=s3_env)
    assert r.returncode == 0, r.stderr
    d = run_ckpt("diff", str(fixture_path("orbax_ocdbt_zarr2")), str(local), "--values")
    assert d.returncode == 0, d.stdout + d.stderr
    # a local DCP checkpoint into an S3 Orbax one
    r = run_ckpt("convert", str(fixture_path("dcp_multirank")), f"s3://{BUCKET}/out/orbax_from_dcp", "--to", "orbax", env=s3_env)
    assert r.returncode == 0, r.stderr
    assert run_ckpt("validate", f"s3://{BUCKET}/out/orbax_from_dcp", "--deep", env=s3_env).returncode == 0

# -- a server that dies, hangs or was never there ------------------------------------
#
# Each case runs the command as a whole process against its own moto server,
# which is frozen (SIGSTOP) once it has answered a few of the command's
# requests and killed a moment later: the command is then mid-way, with
# requests in flight and more to make. The deadline the issue asks for is
# one line on stderr naming the endpoint, exit 1, within 60 s, and no
# temporary output left.
WALL_LIMIT_S = 60


class MotoServer:
    """A moto S3 server of one test, with the checkpoints it serves and a request counter."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self._lock = threading.Lock()
        self.requests: list[str] = []
        self._trigger: tuple[str, int, threading.Event] | None = None
        threading.Thread(target=self._read_log, daemon=True).start()
        wait_until_serving(self.proc, self.endpoint, "moto server")
        self.s3 = s3_client(self.endpoint)
        self.s3.create_bucket(Bucket=BUCKET)
        self.env = {**S3_TEST_CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def _read_log(self) -> None:
        # werkzeug logs one line per request: ... "GET /bucket/key HTTP/1.1" 200 -
        # (some in colour)
        for line in self.proc.stderr:  # type: ignore[union-attr]
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            if '"' not in line:
                continue
            with self._lock:
                self.requests.append(line)
                trigger = self._trigger
                if trigger is not None:
                    method, count, fired = trigger
                    if self._count(method) >= count and not fired.is_set():
                        self.proc.send_signal(signal.SIGSTOP)  # no answer from here on
                        fired.set()

    def _count(self, method: str) -> int:
        return sum(f'"{method} ' in r for r in self.requests)

    def upload(self, name: str) -> str:
        return upload_fixture(self.s3, BUCKET, name)

    def freeze_after(self, count: int, method: str = "GET") -> threading.Event:
        """Stop answering once `count` more requests of `method` were served."""
        fired = threading.Event()
        with self._lock:
            already = self._count(method)
            self._trigger = (method, already + count, fired)
        return fired

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # a stopped process dies too
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


@pytest.fixture
def moto():
    server = MotoServer()
    try:
        yield server
    finally:
        server.stop()


def _run_killing(server: MotoServer, args: list[str], *, after: int, method: str = "GET",
                 env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run ckpt; freeze the server after `after` requests of `method`, kill it 0.5 s later."""
    full_env = dict(os.environ)
    full_env.pop("CKPT_DEBUG", None)
    full_env.update(server.env)
    # two attempts per request: the defaults are timed by the closed-port tests
    full_env["CKPT_IO_RETRIES"] = "2"
    full_env.update(env or {})
    fired = server.freeze_after(after, method)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *args], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if fired.wait(timeout=WALL_LIMIT_S):
        time.sleep(0.5)  # requests are in flight to a server that does not answer
        server.kill()
    try:
        out, err = proc.communicate(timeout=WALL_LIMIT_S + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"ckpt {' '.join(args)} hung: {err}")
    elapsed = time.monotonic() - started
    assert fired.is_set(), f"the command finished before the server was stopped: {err}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), elapsed


def _assert_one_line_naming(r: subprocess.CompletedProcess, elapsed: float, endpoint: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert endpoint.split("//", 1)[1] in lines[0] and "Traceback" not in r.stderr, lines[0]
    assert "internal error" not in lines[0] and "SystemError" not in r.stderr
    assert elapsed < WALL_LIMIT_S, elapsed


def _no_temp_output(dst: Path) -> None:
    assert not dst.exists()
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]
    assert leftovers == [], leftovers


# `after`: GETs answered before the server stops, set from a live run's
# requests: inspect makes 7 GETs; validate --deep 16 for the shallow checks (the OCDBT walk's
# manifest and node reads through Storage) and 8-10 more for --deep (24-26 in all, varying with how
# tensorstore batches); diff --values 7 for
# the metadata and 2-4 for chunks (both sides through the scheduler: each stored chunk read once)
@pytest.mark.slow
@pytest.mark.parametrize("args, after", [
    (["inspect", "{src}", "--json"], 3),
    (["validate", "{src}", "--deep"], 19),
    (["diff", "{src}", str(fixture_path("orbax_ocdbt_zarr2")), "--values"], 7),
])
def test_server_killed_mid_read(moto, args, after):
    src = moto.upload("orbax_ocdbt_zarr2")
    r, elapsed = _run_killing(moto, [a.format(src=src) for a in args], after=after)
    _assert_one_line_naming(r, elapsed, moto.endpoint)
    if args[0] == "inspect":
        # --json: the hard error is also one JSON object on stdout, and nothing else is printed there
        doc = json.loads(r.stdout)
        assert doc["ok"] is False and doc["error"]["code"] == "storage-unavailable", doc
        assert moto.endpoint in doc["error"]["message"]


# orbax -> dcp: 7 GETs of metadata, then fewer than 7 for chunks (small leaves are read together); dcp -> orbax:
# 6 of metadata, then 36 for chunks
@pytest.mark.slow
@pytest.mark.parametrize("name, to, after", [("orbax_ocdbt_zarr2", "dcp", 9), ("dcp_multirank", "orbax", 15)])
def test_server_killed_mid_convert_from_s3(moto, tmp_path, name, to, after):
    src = moto.upload(name)
    dst = tmp_path / "out"
    r, elapsed = _run_killing(moto, ["convert", src, str(dst), "--to", to], after=after)
    _assert_one_line_naming(r, elapsed, moto.endpoint)
    _no_temp_output(dst)


class CuttingProxy:
    """A TCP proxy in front of the moto server that forwards `limit` PUT requests whole and,
    at the next one, kills the server and stops listening: a write cut off exactly mid-way
    (the server's own log comes too late to stop it between two quick PUTs)."""

    def __init__(self, server: MotoServer, limit: int) -> None:
        import socket

        self.server = server
        self.limit = limit
        self.puts = 0
        self.cut = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[Any] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self.cut.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.server.port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: Any, dst: Any) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def _requests(self, client: Any, upstream: Any) -> None:
        """Forward whole requests (head, then Content-Length bytes of body), counting PUTs."""
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = client.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                if head.startswith(b"PUT "):
                    with self._lock:
                        self.puts += 1
                        over = self.puts > self.limit
                    if over:
                        self._cut_off()
                        return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                upstream.sendall(head + b"\r\n\r\n")
                while len(buf) < length:
                    data = client.recv(65536)
                    if not data:
                        return
                    buf += data
                upstream.sendall(buf[:length])
                buf = buf[length:]
        except OSError:
            pass

    def _cut_off(self) -> None:
        if self.cut.is_set():
            return
        self.cut.set()
        self.server.kill()
        self.listener.close()  # from now on: connection refused
        with self._lock:
            for sock in self._socks:
                try:
                    sock.close()
                except OSError:
                    pass


# orbax -> dcp writes the data file, then .metadata (cut at .metadata); dcp -> orbax ~15 PUTs
@pytest.mark.slow
@pytest.mark.parametrize("name, to, limit", [("orbax_ocdbt_zarr2", "dcp", 1), ("dcp_multirank", "orbax", 4)])
def test_server_killed_mid_write(moto, name, to, limit):
    proxy = CuttingProxy(moto, limit)
    dst = f"s3://{BUCKET}/out/{name}"
    env = {**moto.env, "AWS_ENDPOINT_URL": proxy.endpoint, "CKPT_IO_RETRIES": "2"}
    started = time.monotonic()
    r = run_ckpt("convert", str(fixture_path(name)), dst, "--to", to, env=env, timeout=WALL_LIMIT_S + 30)
    elapsed = time.monotonic() - started
    assert proxy.cut.is_set(), f"the write finished before the cut: {r.stdout}{r.stderr}"
    _assert_one_line_naming(r, elapsed, proxy.endpoint)
    assert "cannot write" in r.stderr or "cannot create" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name, command", [
    ("dcp_multirank", ["convert", "{src}", "{dst}", "--to", "orbax"]),
    ("orbax_ocdbt_zarr2", ["convert", "{src}", "{dst}", "--to", "dcp"]),
    ("orbax_ocdbt_zarr2", ["validate", "{src}", "--deep"]),
])
def test_hung_server_hits_the_deadline(moto, tmp_path, name, command):
    """A server that accepts connections and never answers: CKPT_IO_TIMEOUT ends the run."""
    src = moto.upload(name)
    moto.proc.send_signal(signal.SIGSTOP)  # the kernel still accepts connections; nothing answers
    dst = tmp_path / "out"
    started = time.monotonic()
    r = run_ckpt(*[c.format(src=src, dst=dst) for c in command], env={**moto.env, "CKPT_IO_TIMEOUT": "3"}, timeout=WALL_LIMIT_S)
    elapsed = time.monotonic() - started
    _assert_one_line_naming(r, elapsed, moto.endpoint)
    assert "no answer within 3 s" in r.stderr and "CKPT_IO_TIMEOUT" in r.stderr
    assert elapsed < 15, elapsed
    _no_temp_output(dst)


# the Orbax writer's ~15 PUTs leave room to go silent between them (the DCP
# writer's two do not: the freeze, read off the server's log, comes too late)
@pytest.mark.slow
@pytest.mark.parametrize("name, to", [("dcp_multirank", "orbax")])
def test_server_silent_mid_write_hits_the_deadline(moto, name, to):
    """The server stops answering (never dies) after a few uploads: every writer wait has the deadline."""
    dst = f"s3://{BUCKET}/out/{name}-silent"
    env = dict(os.environ)
    env.pop("CKPT_DEBUG", None)
    env.update(moto.env, CKPT_IO_TIMEOUT="3", CKPT_IO_RETRIES="2")
    fired = moto.freeze_after(2, "PUT")
    started = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "ckpt_tool", "convert", str(fixture_path(name)), dst, "--to", to],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=WALL_LIMIT_S + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"convert to a silent server hung past {WALL_LIMIT_S + 30} s")
    elapsed = time.monotonic() - started
    assert fired.is_set(), f"the write finished before the server went silent: {r.stdout}{r.stderr}"
    _assert_one_line_naming(r, elapsed, moto.endpoint)
    assert elapsed < 30, elapsed


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    ["inspect", f"s3://{BUCKET}/run/x"],
    ["validate", f"s3://{BUCKET}/run/x", "--deep"],
    ["convert", f"s3://{BUCKET}/run/x", "{tmp}/out", "--to", "dcp"],
    ["convert", str(fixture_path("dcp_multirank")), f"s3://{BUCKET}/out/y", "--to", "orbax"],
])
def test_closed_port_is_one_line_within_the_deadline(tmp_path, command):
    """Nothing listens on the endpoint: the default settings give up well within a minute."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint, "CKPT_IO_TIMEOUT": "", "CKPT_IO_RETRIES": ""}
    started = time.monotonic()
    r = run_ckpt(*[c.format(tmp=tmp_path) for c in command], env=env, timeout=WALL_LIMIT_S + 30)
    elapsed = time.monotonic() - started
    _assert_one_line_naming(r, elapsed, endpoint)
    assert "does not answer" in r.stderr and "CKPT_IO_RETRIES" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_io_settings_are_checked():
    r = run_ckpt("inspect", f"s3://{BUCKET}/run/x", env={"CKPT_IO_TIMEOUT": "soon"})
    assert r.returncode == 1 and r.stderr.strip() == "ckpt: error: CKPT_IO_TIMEOUT must be a number of seconds >= 0.001, got 'soon'"
