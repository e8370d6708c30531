"""safetensors over s3://: headers and regions as ranged reads, against a real S3-compatible server (moto)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import FIXTURES, moto_s3_serving, run_ckpt

pytestmark = pytest.mark.slow

pytest.importorskip("moto")
BUCKET = "ckpt-st"
NAMES = ["safetensors_llama_sharded", "safetensors_dcp_distributed", "safetensors_numpy"]


@pytest.fixture(scope="module")
def s3_env():
    with moto_s3_serving(BUCKET, NAMES) as env:
        yield env


@pytest.mark.parametrize("name", NAMES)
def test_inspect_validate_diff_over_s3(s3_env, name):
    url = f"s3://{BUCKET}/run/{name}"
    remote = run_ckpt("inspect", url, "--json", env=s3_env)
    assert remote.returncode == 0 and remote.stderr == "", remote.stderr
    local = json.loads(run_ckpt("inspect", str(FIXTURES / name), "--json").stdout)
    assert json.loads(remote.stdout)["leaves"] == local["leaves"]
    r = run_ckpt("validate", url, "--deep", "--json", env=s3_env)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr
    d = run_ckpt("diff", url, str(FIXTURES / name), "--values", env=s3_env)
    assert d.returncode == 0, d.stdout + d.stderr


def test_single_file_and_region_over_s3(s3_env):
    url = f"s3://{BUCKET}/run/safetensors_numpy/model.safetensors"
    code = (
        "import ckpt_tool, numpy as np\n"
        f"ck = ckpt_tool.open({url!r})\n"
        f"ref = ckpt_tool.open({str(FIXTURES / 'safetensors_numpy')!r})\n"
        "w = ck['wide']\n"
        "assert np.array_equal(w[1:3, :, 5:9], ref['wide'][1:3, :, 5:9])\n"
        "assert np.array_equal(ck['float.bf16'][2:4], ref['float.bf16'][2:4])\n"
    )
    env = dict(os.environ, **s3_env)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert run_ckpt("validate", url, env=s3_env).returncode == 0


def test_convert_to_s3_and_back(s3_env, tmp_path):
    dst = f"s3://{BUCKET}/out/llama"
    r = run_ckpt("convert", str(FIXTURES / "safetensors_llama_sharded"), dst, "--to", "safetensors",
                 "--max-shard-size", "10KB", env=s3_env)
    assert r.returncode == 0, r.stdout + r.stderr
    d = run_ckpt("diff", dst, str(FIXTURES / "safetensors_llama_sharded"), "--values", env=s3_env)
    assert d.returncode == 0, d.stdout + d.stderr
    r = run_ckpt("validate", dst, "--deep", env=s3_env)
    assert r.returncode == 0, r.stdout
