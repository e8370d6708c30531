"""The memory bound on big stored chunks, both sides of a diff included (issue 23, item 0).

The shape that broke it, scaled down with its ratios kept: arrays saved by
real orbax on one device (one zstd-compressed zarr chunk each, orbax's
default) three times the size of --memory (768 MiB against 256MiB there;
48 MiB against 16MiB here), with a twin written by
torch.distributed.checkpoint.save (one item per tensor) and one written by
orbax without compression. Each command runs in a process of its own; its
peak RSS (the kernel's, from wait4) may exceed that of an `inspect` of the
same checkpoint (the interpreter and libraries) by the budget and a little:
before the joint streams of ckpt_tool/scheduler/joint.py, `diff --values`
held every region of one side until the other side's stream reached it
(the whole 48 MiB array, and 768 MiB on the full-size shape).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_tool.cli.main import cli

from conftest import ROOT

# peak RSS within the budget and a 16 MiB slack: alone, in make test's serial pass
pytestmark = [pytest.mark.slow, pytest.mark.serial]

MIB = 2**20
MEMORY = 16 * MIB
# what a command may hold beyond the budget, over an inspect of the same checkpoint
# (threads' stacks, the codecs' contexts, allocator slack). Measured: diff 8-11 MiB over
# the inspect, validate --deep 7 MiB; before joint streams diff took 53-61 MiB over it
SLACK = 16 * MIB

GEN = r'''
import os, sys
import warnings; warnings.filterwarnings("ignore")
import numpy as np, jax, orbax.checkpoint as ocp, torch
import torch.distributed.checkpoint as dcp
out = sys.argv[1]
rng = np.random.default_rng(23)
arrays = {f"w{i}": rng.standard_normal((3072, 4096), dtype=np.float32) for i in range(2)}  # 48 MiB each
tree = {k: jax.device_put(v) for k, v in arrays.items()}
ck = ocp.StandardCheckpointer(); ck.save(os.path.join(out, "zstd"), tree); ck.wait_until_finished()
ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)).save(os.path.join(out, "raw"), tree)
dcp.save({k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, checkpoint_id=os.path.join(out, "dcp"))
changed = arrays["w1"].copy(); changed[5, 7] += 1.0; changed[3000, 4095] = np.nan; changed[1536, 0] *= -1
dcp.save({"w0": torch.from_numpy(arrays["w0"].copy()), "w1": torch.from_numpy(changed)},
         checkpoint_id=os.path.join(out, "dcp_changed"))
'''


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bound")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", GEN, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _peak_rss(*args: str) -> int:
    """Peak RSS in bytes of `ckpt ARGS` run in a process of its own (exit 0 or 1: a diff that differs)."""
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read().decode()[-2000:]
    return usage.ru_maxrss * 1024


@pytest.fixture(scope="module")
def base(ckpts) -> int:
    return max(_peak_rss("inspect", str(ckpts / "zstd")), _peak_rss("inspect", str(ckpts / "dcp")))


@pytest.mark.parametrize("a, b, workers", [
    ("zstd", "dcp", 1),  # one stream after the other: the whole of A was held (1.1 GiB at full size)
    ("zstd", "dcp", 4),
    ("dcp", "raw", 2),  # torch's item against an uncompressed zarr chunk
    ("zstd", "raw", 4),  # two zarr streams
])
def test_diff_values_of_two_streamed_sides_within_the_budget(ckpts, base, a, b, workers):
    peak = _peak_rss("diff", str(ckpts / a), str(ckpts / b), "--values", "--memory", f"{MEMORY // MIB}MiB",
                     "--workers", str(workers))
    assert peak - base <= MEMORY + SLACK, ((peak - base) / MIB, base / MIB)


@pytest.mark.parametrize("args", [
    ["validate", "{dcp}", "--deep"],  # torch's items read in bands, a region written behind
    ["convert", "{dcp}", "{out}", "--to", "safetensors"],
    ["convert", "{zstd}", "{out}", "--to", "dcp"],
])
def test_streamed_commands_within_the_budget(ckpts, base, tmp_path, args):
    argv = [a.format(dcp=ckpts / "dcp", zstd=ckpts / "zstd", out=tmp_path / "out") for a in args]
    peak = _peak_rss(*argv, "--memory", f"{MEMORY // MIB}MiB", "--workers", "4")
    assert peak - base <= MEMORY + SLACK, ((peak - base) / MIB, base / MIB)


def test_joint_streams_find_every_difference(ckpts):
    """The values compared through the joint streams are the libraries' values: three changed
    elements of one array (one a NaN, one a sign) are counted, the other array matches."""
    res = CliRunner().invoke(cli, ["diff", str(ckpts / "zstd"), str(ckpts / "dcp_changed"), "--values",
                                   "--memory", "16MiB", "--json"])
    assert res.exit_code == 1, res.output
    (d,) = json.loads(res.output)["differences"]
    assert d["path"] == "w1" and d["mismatched"] == 3, d
    res = CliRunner().invoke(cli, ["diff", str(ckpts / "raw"), str(ckpts / "dcp"), "--values", "--memory", "16MiB",
                                   "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["same"], res.output
