"""s3:// through the storage layer, against a real S3-compatible server (moto) on 127.0.0.1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import FIXTURES, fixture_path, free_port, run_ckpt

BUCKET = "ckpt-test"
S3_FIXTURES = ["orbax_ocdbt_zarr2", "orbax_two_process", "dcp_multirank"]




@pytest.fixture(scope="module")
def s3_env():
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    pytest.fail("moto server did not start")
                time.sleep(0.2)
        env = {
            "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
        }
        import boto3

        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
        s3.create_bucket(Bucket=BUCKET)
        for name in S3_FIXTURES:
            for dirpath, _, files in os.walk(FIXTURES / name):
                for f in files:
                    local = os.path.join(dirpath, f)
                    s3.upload_file(local, BUCKET, "run/" + os.path.relpath(local, FIXTURES))
        yield env
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize("name", S3_FIXTURES)
def test_inspect_s3_equals_local(s3_env, name):
    remote = run_ckpt("inspect", f"s3://{BUCKET}/run/{name}", "--json", "--values", env=s3_env)
    assert remote.returncode == 0, remote.stderr
    assert remote.stderr == ""  # no credential-probing noise
    local = run_ckpt("inspect", str(fixture_path(name)), "--json", "--values")
    a, b = json.loads(remote.stdout), json.loads(local.stdout)
    assert a["leaves"] == b["leaves"] and a["summary"] == b["summary"]


@pytest.mark.parametrize("name", S3_FIXTURES)
def test_validate_deep_and_diff_over_s3(s3_env, name):
    r = run_ckpt("validate", f"s3://{BUCKET}/run/{name}", "--deep", "--json", env=s3_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["ok"]
    d = run_ckpt("diff", f"s3://{BUCKET}/run/{name}", str(fixture_path(name)), "--values", env=s3_env)
    assert d.returncode == 0, d.stdout + d.stderr


def test_missing_s3_prefix_is_one_line(s3_env):
    r = run_ckpt("inspect", f"s3://{BUCKET}/nothing/here", env=s3_env)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


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
