"""Remote storage failures are ckpt's one line on stderr (issue 18, item 10).

Against real servers on 127.0.0.1 (moto for S3, gcp-storage-emulator for
GCS) and a host name that never resolves (`.invalid`, RFC 2606): no line of
the C++ libraries' own logging (abseil, the AWS C SDK) unless CKPT_DEBUG=1,
a name that does not resolve fails at once instead of after every retry, and
a credentials variable naming a missing file is said so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import ckpt_tool
from conftest import FIXTURES, gcs_emulator_serving, moto_s3_serving

# the ckpt_tool this test imports is the one the CLI runs (python -m from its own tree)
CODE_ROOT = Path(ckpt_tool.__file__).resolve().parent.parent

BUCKET = "ckpt-remote-errors"
NOWHERE = "http://nonexistent.invalid:9"  # .invalid never resolves: no request leaves the machine


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without any cloud credentials or endpoints, HOME an empty directory."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("AWS_", "GOOGLE_", "CLOUDSDK_", "GCE_", "TENSORSTORE_GCS")) and k != "CKPT_DEBUG"
    }
    # a metadata-server probe (GCE) goes to a closed port on loopback, never to the network
    env.update(HOME=str(home), GCE_METADATA_ROOT="127.0.0.1:9", AWS_EC2_METADATA_DISABLED="true")
    env.update(extra)
    return env


def _run(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ckpt_tool", *args], capture_output=True, text=True, env=env,
                       cwd=CODE_ROOT, timeout=120)
    return r, time.monotonic() - start


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ckpt: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def s3():
    with moto_s3_serving(BUCKET, ["dcp_multirank"]) as env:
        yield env["AWS_ENDPOINT_URL"]


@pytest.fixture(scope="module")
def gcs():
    """A GCS JSON-API server (gcp-storage-emulator) on 127.0.0.1 holding fixtures/dcp_multirank at gs://BUCKET/ckpt."""
    with gcs_emulator_serving() as endpoint:

        def post(path: str, data: bytes, content_type: str = "application/octet-stream") -> None:
            req = urllib.request.Request(f"{endpoint}{path}", data=data, method="POST", headers={"Content-Type": content_type})
            with urllib.request.urlopen(req, timeout=10):
                pass

        post("/storage/v1/b?project=test", json.dumps({"name": BUCKET}).encode(), "application/json")
        src = FIXTURES / "dcp_multirank"
        for p in sorted(src.rglob("*")):
            if p.is_file():
                query = urllib.parse.urlencode({"uploadType": "media", "name": f"ckpt/{p.relative_to(src)}"})
                post(f"/upload/storage/v1/b/{BUCKET}/o?{query}", p.read_bytes())
        yield endpoint


# -- a host name that does not resolve ------------------------------------------------

KEYS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}


@pytest.mark.parametrize("keys", [True, False], ids=["with-keys", "no-credentials"])
@pytest.mark.parametrize("command", ["inspect", "validate", "diff", "convert"])
def test_s3_host_that_does_not_resolve_is_one_line(tmp_path, command, keys):
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL=NOWHERE, **(KEYS if keys else {}))
    url = f"s3://{BUCKET}/run/dcp_multirank"
    args = {
        "inspect": ["inspect", url],
        "validate": ["validate", url, "--deep"],
        "diff": ["diff", str(FIXTURES / "dcp_multirank"), url],
        "convert": ["convert", str(FIXTURES / "dcp_multirank"), f"s3://{BUCKET}/out", "--to", "orbax"],
    }[command]
    r, _ = _run(env, *args)
    line = _one_line(r)
    assert "cannot resolve host name nonexistent.invalid" in line and "not retried" in line, line
    assert f"s3://{BUCKET}/" in line


def test_gs_host_that_does_not_resolve_is_one_line(tmp_path):
    # no credentials either: tensorstore's "Could not find the credentials file" line is dropped too
    r, _ = _run(_clean_env(tmp_path, TENSORSTORE_GCS_HTTP_URL=NOWHERE), "inspect", f"gs://{BUCKET}/ckpt")
    line = _one_line(r)
    assert line.startswith(
        f"ckpt: error: gs://{BUCKET}/ckpt: cannot open storage: storage endpoint {NOWHERE} cannot be reached: "
        "cannot resolve host name nonexistent.invalid ("  # the resolver's reason follows
    ) and line.endswith("); not retried"), line


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_host_that_does_not_resolve_fails_within_two_seconds(monkeypatch, scheme):
    """Timed in this process, so the interpreter's start is not counted: tensorstore's
    4 attempts with backoff took 3.75 s and more for the same line."""
    from ckpt_tool.base.errors import StorageUnavailableError

    host = f"nowhere-{scheme}-{os.getpid()}.invalid"  # a name no earlier test has looked up
    if scheme == "s3":
        for k, v in KEYS.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:9")
    else:
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", f"http://{host}:9")
        monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "test")
    monkeypatch.setenv("CKPT_DEBUG", "1")  # leave this process's fd 2 alone
    start = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=f"cannot resolve host name {host}"):
        ckpt_tool.open(f"{scheme}://{BUCKET}/run/dcp_multirank")
    assert time.monotonic() - start < 2.0


# -- credentials ---------------------------------------------------------------------


@pytest.mark.slow
def test_s3_without_credentials_is_one_line_and_fast(tmp_path, s3):
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL=s3, AWS_REGION="us-east-1")
    _, baseline = _run(env, "inspect", str(FIXTURES / "dcp_multirank"))  # the interpreter's start, on this machine now
    r, took = _run(env, "inspect", f"s3://{BUCKET}/run/dcp_multirank")
    line = _one_line(r)  # the AWS C SDK's 5-9 lines of credential probing are gone
    assert line == (
        f"ckpt: error: s3://{BUCKET}/run/dcp_multirank/.metadata: cannot read: access denied (HTTP 403); no AWS "
        "credentials in the environment or ~/.aws (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
        "or write ~/.aws/credentials)"
    )
    assert took - baseline < 2.0, (took, baseline)


@pytest.mark.slow
@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
def test_s3_validate_without_credentials_is_the_runs_one_error(tmp_path, s3, deep):
    """Not a finding per file on stdout: every request is refused alike."""
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL=s3, AWS_REGION="us-east-1")
    r, _ = _run(env, "validate", f"s3://{BUCKET}/run/dcp_multirank", *(["--deep"] if deep else []))
    assert "access denied (HTTP 403); no AWS credentials" in _one_line(r)
    assert "error bad-metadata" not in r.stdout, r.stdout


def test_s3_library_lines_come_back_with_ckpt_debug(tmp_path, s3):
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL=s3, AWS_REGION="us-east-1", CKPT_DEBUG="1")
    r, _ = _run(env, "inspect", f"s3://{BUCKET}/run/dcp_multirank")
    assert r.returncode == 1
    assert any(line.startswith("E") and "] " in line and "AWS_ERROR" in line for line in r.stderr.splitlines()), r.stderr


def test_s3_with_keys_reads_with_nothing_on_stderr(tmp_path, s3):
    r, _ = _run(_clean_env(tmp_path, AWS_ENDPOINT_URL=s3, **KEYS), "inspect", f"s3://{BUCKET}/run/dcp_multirank")
    assert r.returncode == 0 and r.stderr == "", r.stderr


@pytest.mark.parametrize("variable", ["AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"])
def test_aws_credentials_variable_naming_a_missing_file(tmp_path, s3, variable):
    missing = tmp_path / "no-such-dir" / "credentials"
    r, _ = _run(_clean_env(tmp_path, AWS_ENDPOINT_URL=s3, **{variable: str(missing)}),
                "inspect", f"s3://{BUCKET}/run/dcp_multirank")
    assert _one_line(r) == (
        f"ckpt: error: s3://{BUCKET}/run/dcp_multirank: cannot open storage: {variable} names {missing}, "
        "which does not exist (point it at the credentials file, or unset it)"
    )


@pytest.mark.slow
def test_google_application_credentials_naming_a_missing_file(tmp_path, gcs):
    missing = tmp_path / "key.json"
    env = _clean_env(tmp_path, TENSORSTORE_GCS_HTTP_URL=gcs, GOOGLE_APPLICATION_CREDENTIALS=str(missing))
    _, baseline = _run(env, "inspect", str(FIXTURES / "dcp_multirank"))
    r, took = _run(env, "inspect", f"gs://{BUCKET}/ckpt")
    assert _one_line(r) == (
        f"ckpt: error: gs://{BUCKET}/ckpt: cannot open storage: GOOGLE_APPLICATION_CREDENTIALS names {missing}, "
        "which does not exist (point it at the credentials file, or unset it)"
    )
    assert took - baseline < 2.0, (took, baseline)


def test_google_application_credentials_naming_a_directory(tmp_path, gcs):
    env = _clean_env(tmp_path, TENSORSTORE_GCS_HTTP_URL=gcs, GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path))
    r, _ = _run(env, "inspect", f"gs://{BUCKET}/ckpt")
    assert "GOOGLE_APPLICATION_CREDENTIALS names" in _one_line(r) and "is a directory" in r.stderr


@pytest.mark.slow
def test_gcs_anonymous_read_prints_nothing(tmp_path, gcs):
    """No gcloud credentials: tensorstore logs that it found none, then reads anonymously (a public bucket)."""
    env = _clean_env(tmp_path, TENSORSTORE_GCS_HTTP_URL=gcs)
    r, _ = _run(env, "inspect", f"gs://{BUCKET}/ckpt", "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert json.loads(r.stdout)["format"] == "dcp"
    # the line is there to drop: CKPT_DEBUG=1 shows it
    debug, _ = _run({**env, "CKPT_DEBUG": "1"}, "inspect", f"gs://{BUCKET}/ckpt", "--json")
    assert debug.returncode == 0 and "Could not find the credentials file" in debug.stderr, debug.stderr


# -- the filter itself --------------------------------------------------------------


def test_native_log_filter_keeps_everything_else():
    from ckpt_tool import storage

    src_r, src_w = os.pipe()
    out_r, out_w = os.pipe()
    import threading

    t = threading.Thread(target=storage._forward_stderr, args=(src_r, out_w))
    t.start()
    os.write(src_w, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n")
    os.write(src_w, b"E1202 06:36:09.123456    8648 common-io:5] static: Failed to open file.\n")
    os.write(src_w, b"terminate called after throwing an instance of 'x'\n")
    os.write(src_w, b"W0101 00:00:00.000001 12 google_auth_provider.cc:188] Could not find\nprogress 50%\r")
    os.write(src_w, b"Fatal Python error: Segmentation fault\n")
    os.close(src_w)
    t.join(5)
    os.close(out_w)
    with os.fdopen(out_r, "rb") as fh:
        got = fh.read()
    assert got == b"terminate called after throwing an instance of 'x'\nprogress 50%\rFatal Python error: Segmentation fault\n"


@pytest.mark.slow
def test_truncated_ocdbt_data_file_on_s3_is_worded_as_validate_words_it(tmp_path, s3):
    """The object store's own words for a short object (`... and total size 100`) become validate's."""
    from conftest import s3_client

    src = FIXTURES / "orbax_ocdbt_zarr2"
    data = next((src / "d").iterdir())
    client = s3_client(s3)
    for p in sorted(src.rglob("*")):
        if p.is_file():
            body = p.read_bytes()[:100] if p == data else p.read_bytes()
            client.put_object(Bucket=BUCKET, Key=f"trunc/{p.relative_to(src)}", Body=body)
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL=s3, **KEYS)
    r, _ = _run(env, "inspect", f"s3://{BUCKET}/trunc")
    wording = f"OCDBT data file has 100 bytes but the database needs {data.stat().st_size}"
    assert _one_line(r) == f"ckpt: error: s3://{BUCKET}/trunc/d/{data.name}: {wording}"
    r, _ = _run(env, "validate", f"s3://{BUCKET}/trunc", "--json")
    # (the file held the merged index: its finding goes on to name the arrays it takes)
    assert wording in [f["message"].split(" (")[0] for f in json.loads(r.stdout)["findings"]
                       if f["code"] == "lost-process-data"]
