"""Round trips on an object store are paid in parallel, not one after another (issue 43, item 3).

A real GCS server on 127.0.0.1 (the Go fake-gcs-server) answers in a fraction of a millisecond;
tests/latency_proxy.py in front of it delays every request (and every new connection) by DELAY, as
a real store's 10-100 ms would. The same command runs direct and through the proxy, which counts
the requests (and connections) it forwarded. One request at a time would add paid x DELAY. What a
run may add is its chain of dependent metadata reads (the listing, the metadata files, the database
manifest, the B+tree's levels: CHAIN round trips at most) plus the rest at IN_FLIGHT at a time.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, fake_gcs_serving, gcs_create_bucket, gcs_upload_tree
from latency_proxy import LatencyProxy

# wall-time bounds: alone, in make test's serial pass
pytestmark = [pytest.mark.slow, pytest.mark.serial]

DELAY = 0.1
CHAIN = 30
IN_FLIGHT = 4  # (ckpt keeps 8 in flight on an object store: half of it is the bound here)

GEN = r'''
import sys
import warnings; warnings.filterwarnings("ignore")
import numpy as np, jax, orbax.checkpoint as ocp
rng = np.random.default_rng(3)
# 512 KiB chunks, each stored out of line in a data file (a ranged read each), and small ones inline
state = {f"layer{i:02d}": {"w": rng.standard_normal((256, 512), dtype=np.float32), "b": np.arange(64, dtype=np.int32)}
         for i in range(96)}
ck = ocp.StandardCheckpointer(); ck.save(sys.argv[1], state); ck.wait_until_finished()
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = tmp_path_factory.mktemp("latency") / "orbax"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", GEN, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with fake_gcs_serving() as gcs_env:
        endpoint = gcs_env["TENSORSTORE_GCS_HTTP_URL"]
        gcs_create_bucket(endpoint, "ckpts")
        url = gcs_upload_tree(endpoint, "ckpts", out, "run/orbax")
        host, port = endpoint.removeprefix("http://").split(":")
        with LatencyProxy((host, int(port)), DELAY) as proxy:
            yield url, gcs_env, proxy


def _timed(env: dict[str, str], *args: str) -> float:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ckpt_tool", *args], cwd=ROOT, env={**os.environ, **env},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return time.monotonic() - t


@pytest.mark.parametrize("args", [
    ["validate", "{src}", "--deep"],  # every chunk read
    ["convert", "{src}", "gs://ckpts/out/{n}", "--to", "dcp"],  # reads from and uploads to the store
])
def test_latency_is_paid_in_parallel(served, args):
    url, env, proxy = served
    n = [0]

    def argv(tag: str) -> list[str]:
        n[0] += 1
        return [a.format(src=url, n=f"{tag}{n[0]}") for a in args]

    direct = _timed(env, *argv("direct"))
    delayed_env = {**env, "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{proxy.port}"}
    before = proxy.requests + proxy.connections
    delayed = _timed(delayed_env, *argv("delayed"))
    paid = proxy.requests + proxy.connections - before
    allowed = (CHAIN + paid / IN_FLIGHT) * DELAY
    assert paid >= 3 * CHAIN, paid  # (enough round trips for one at a time to show)
    assert delayed - direct <= allowed, (
        f"{delayed:.2f} s delayed against {direct:.2f} s direct: {paid} requests and connections, "
        f"{paid * DELAY:.1f} s one at a time, {allowed:.1f} s allowed")
