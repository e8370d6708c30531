"""Multi-process convert and reshard started by torchrun or as a Slurm step, without flags.

The runs are real: torchrun itself (python -m torch.distributed.run) starts
the workers, and the Slurm-style runs start one process per task with the
variables srun sets. Their outputs are restored by orbax and by torch
(library_reference: orbax's restore, torch's dcp_to_torch_save + torch.load)
and compared, value for value, with the source as its own library loads it.
A sitecustomize in the children blocks the library the run must not need
(jax on the torch route, torch on the jax route) and records which of them
each ckpt process loaded.
"""
from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ckpt_tool.base.distributed import (
    SLURM_PORT_BASE, JaxCoordinator, LaunchError, expand_hostlist, first_host, library_for, process_spec, slurm_port,
)
from conftest import ROOT, fixture_path, free_port
from library_reference import dcp_values, orbax_values

pytest.importorskip("torch")

# blocks imports of the modules CKPT_TEST_BLOCK names; at exit a ckpt process records which
# of torch / jax / orbax it had loaded (torchrun's own process, which runs no ckpt, records nothing)
SITECUSTOMIZE = r'''
import atexit, json, os, sys
_blocked = tuple(filter(None, os.environ.get("CKPT_TEST_BLOCK", "").split(",")))

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _blocked:
            raise ImportError(f"import of {name} blocked by the test")
        return None

if _blocked:
    sys.meta_path.insert(0, _Block())

def _record():
    if "ckpt_tool" not in sys.modules:
        return
    loaded = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "jax", "jaxlib", "orbax"})
    with open(os.path.join(os.environ["CKPT_TEST_RECORD"], f"{os.getpid()}.json"), "w") as f:
        json.dump({"loaded": loaded}, f)

if os.environ.get("CKPT_TEST_RECORD"):
    atexit.register(_record)
'''

LAUNCHER_PREFIXES = ("SLURM_", "JAX_", "TORCHELASTIC_", "MASTER_", "CKPT_")
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "XLA_FLAGS"}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables (the tests set their own)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_NAMES and not k.startswith(LAUNCHER_PREFIXES)}
    env.update(extra)
    return env


@pytest.fixture
def child_env(tmp_path):
    """Environment for ckpt children: the blocking/recording sitecustomize on their path."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    record = tmp_path / "record"
    record.mkdir()

    def make(block: str) -> tuple[dict[str, str], Path]:
        env = clean_env(PYTHONPATH=str(site), CKPT_TEST_BLOCK=block, CKPT_TEST_RECORD=str(record),
                        CKPT_JOIN_TIMEOUT="120", CKPT_BARRIER_TIMEOUT="120")
        return env, record

    return make


def loaded_modules(record: Path) -> list[list[str]]:
    return [json.loads(p.read_text())["loaded"] for p in sorted(record.glob("*.json"))]


def summaries(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def run_torchrun(n: int, args: list[str], env: dict[str, str], timeout: float = 300) -> list[dict]:
    """`torchrun --nproc-per-node N -m ckpt_tool ARGS --json`: every worker's JSON summary, by process."""
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", str(free_port()),
         "-m", "ckpt_tool", *args, "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = sorted(summaries(r.stdout), key=lambda s: s["process_index"])
    assert [s["process_index"] for s in out] == list(range(n)) and all(s["process_count"] == n for s in out), r.stdout
    return out


def slurm_job_id() -> int:
    """A job id whose derived coordinator port (step 0) is free on this host right now."""
    for _ in range(200):
        job = random.randrange(1, 10**7)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", slurm_port(job, 0)))
            except OSError:
                continue
            return job
    raise AssertionError("no free port in Slurm's derived range")


def slurm_task_env(env: dict[str, str], job: int, rank: int, n: int, nodelist: str) -> dict[str, str]:
    """What srun sets for task `rank` of an n-task step on one node (the variables ckpt reads among them)."""
    return {
        **env,
        "SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
        "SLURM_NTASKS": str(n), "SLURM_NPROCS": str(n), "SLURM_STEP_NUM_TASKS": str(n),
        "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_TASKS_PER_NODE": str(n),
        "SLURM_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
    }


def run_slurm(n: int, args: list[str], env: dict[str, str], nodelist: str = "localhost",
              timeout: float = 300) -> list[dict]:
    """n processes of `python -m ckpt_tool ARGS --json` as the tasks of one srun step."""
    job = slurm_job_id()
    procs = [
        subprocess.Popen([sys.executable, "-m", "ckpt_tool", *args, "--json"], cwd=ROOT,
                         env=slurm_task_env(env, job, i, n, nodelist),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(n)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    result = [summaries(out)[0] for out, _ in outs]
    assert [s["process_index"] for s in result] == list(range(n)) and all(s["process_count"] == n for s in result)
    return result


def _flatten_lists(values: dict) -> dict:
    """DCP keeps a list of plain values as one item (as torch does); Orbax has one leaf per element."""
    out = {}
    for key, value in values.items():
        if isinstance(value, (list, tuple)) and not any(isinstance(v, np.ndarray) for v in value):
            out.update({key + (i,): v for i, v in enumerate(value)})
        else:
            out[key] = value
    return out


def assert_same_values(want: dict, got: dict) -> None:
    want, got = _flatten_lists(want), _flatten_lists(got)
    assert set(want) == set(got)
    for key, w in want.items():
        g = got[key]
        if isinstance(w, np.ndarray) or isinstance(g, np.ndarray):
            w, g = np.asarray(w), np.asarray(g)
            assert (w.dtype, w.shape) == (g.dtype, g.shape) and w.tobytes() == g.tobytes(), key
        else:
            assert type(w) is type(g) and w == g, key


def check_output(to: str, name: str, dst: Path, runs: list[dict]) -> None:
    """DST restores, in its own library, to exactly the source's values as the source's library loads them."""
    assert all(s["chunks"] > 0 for s in runs), runs  # every process wrote its share
    src = fixture_path(name)
    want = dcp_values(src) if name.startswith("dcp") else orbax_values(src)
    if to == "dcp":
        n = len(runs)
        assert {f"__{i}_0.distcp" for i in range(n)} <= {p.name for p in dst.iterdir()}
        assert_same_values(want, dcp_values(dst))
    else:
        assert all((dst / f"ocdbt.process_{i}").is_dir() for i in range(len(runs)))
        assert_same_values(want, orbax_values(dst))


def assert_route(record: Path, n: int, library: str) -> None:
    """Each of the n ckpt processes loaded `library` to coordinate and never the other one."""
    other = {"torch": {"jax", "jaxlib", "orbax"}, "jax": {"torch"}}[library]
    loaded = loaded_modules(record)
    assert len(loaded) == n, loaded
    assert all(library in mods and not other & set(mods) for mods in loaded), loaded


CONVERT_SOURCES = {"orbax": "dcp_multirank", "dcp": "orbax_two_process"}


def convert_args(to: str, dst: Path) -> list[str]:
    extra = ["--skip-unsupported"] if to == "orbax" else []
    return ["convert", str(fixture_path(CONVERT_SOURCES[to])), str(dst), "--to", to, *extra]


def reshard_args(dst: Path) -> list[str]:
    return ["reshard", str(fixture_path("orbax_ocdbt_zarr2")), str(dst), "--mesh", "data=2,model=4"]


def check_reshard(dst: Path, runs: list[dict]) -> None:
    n = len(runs)
    mesh = runs[0]["mesh"]
    # no jax devices on the torch route: the mesh's 8 devices, process p owning [p*8/n, (p+1)*8/n)
    assert mesh["origin"] == "--devices" and mesh["device_ids"] == list(range(8)) and mesh["processes"] == n
    assert all(s["chunks"] > 0 for s in runs)
    assert all((dst / f"ocdbt.process_{i}").is_dir() for i in range(n))
    assert_same_values(orbax_values(fixture_path("orbax_ocdbt_zarr2")), orbax_values(dst))


# -- torchrun ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("to,n", [("orbax", 2), ("dcp", 4)])
def test_torchrun_convert_without_jax(tmp_path, child_env, to, n):
    env, record = child_env("jax,jaxlib,orbax")
    dst = tmp_path / "out"
    runs = run_torchrun(n, convert_args(to, dst), env)
    check_output(to, CONVERT_SOURCES[to], dst, runs)
    assert_route(record, n, "torch")


@pytest.mark.slow
def test_torchrun_reshard_without_jax(tmp_path, child_env):
    env, record = child_env("jax,jaxlib,orbax")
    dst = tmp_path / "out"
    runs = run_torchrun(2, reshard_args(dst), env)
    check_reshard(dst, runs)
    assert_route(record, 2, "torch")


# -- Slurm ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("to,n,nodelist", [("orbax", 4, "127.0.0.[1-4]"), ("dcp", 2, "localhost")])
def test_slurm_convert_without_jax(tmp_path, child_env, to, n, nodelist):
    env, record = child_env("jax,jaxlib,orbax")
    dst = tmp_path / "out"
    runs = run_slurm(n, convert_args(to, dst), env, nodelist)
    check_output(to, CONVERT_SOURCES[to], dst, runs)
    assert_route(record, n, "torch")


@pytest.mark.slow
def test_slurm_reshard_four_tasks(tmp_path, child_env):
    env, record = child_env("jax,jaxlib,orbax")
    dst = tmp_path / "out"
    runs = run_slurm(4, reshard_args(dst), env, "localhost,otherhost")
    check_reshard(dst, runs)
    assert_route(record, 4, "torch")


@pytest.mark.slow
def test_slurm_without_torch_coordinates_through_jax(tmp_path, child_env):
    """No torch importable: the same step meets through jax.distributed; the DCP output still loads in torch."""
    env, record = child_env("torch")
    dst = tmp_path / "out"
    runs = run_slurm(2, convert_args("dcp", dst), env)
    check_output("dcp", CONVERT_SOURCES["dcp"], dst, runs)
    assert_route(record, 2, "jax")


# -- failures: one line, non-zero exit, within the deadline ---------------------------------------


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("ckpt: error: "), stderr
    return lines[0]


def run_ckpt_env(args: list[str], env: dict[str, str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ckpt_tool", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return r, time.monotonic() - start


def test_half_set_environment_is_one_line(tmp_path, ckpt, monkeypatch):
    """In this process (each case fails before anything is imported or joined)."""
    dst = tmp_path / "out"
    for name in list(os.environ):
        if name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    cases = [
        ({"RANK": "1"}, "torchrun variables half set: RANK set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT not"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT not"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"},
         "RANK=2 is outside 0..1 (WORLD_SIZE=2)"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not a whole number"),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"},
         "no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST names the nodes"),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-"},
         "SLURM_NODELIST: unclosed '['"),
        ({"CKPT_DISTRIBUTED": "mpi", "RANK": "0", "WORLD_SIZE": "2"}, "CKPT_DISTRIBUTED='mpi'"),
    ]
    for extra, message in cases:
        with monkeypatch.context() as m:
            for name, value in extra.items():
                m.setenv(name, value)
            r = ckpt(*convert_args("dcp", dst))
        assert r.returncode == 1, (extra, r.stderr)
        assert message in one_line(r.stderr), (extra, r.stderr)
        assert not dst.exists()


@pytest.mark.serial
def test_unreachable_coordinator_is_one_line_within_the_deadline(tmp_path):
    dst = tmp_path / "out"
    port = free_port()  # nothing listens there
    env = clean_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CKPT_JOIN_TIMEOUT="2")
    r, seconds = run_ckpt_env(convert_args("dcp", dst), env)
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert f"cannot reach the coordinator at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 2 s" in line, line
    assert seconds < 2 + 30  # the deadline, plus starting Python and importing torch on a loaded machine
    # the same on the jax route (jax's own client would end the process with a fatal log and a C++ stack)
    r, _ = run_ckpt_env(convert_args("dcp", dst), {**env, "CKPT_DISTRIBUTED": "jax"})
    assert r.returncode == 1
    assert f"cannot reach the coordinator at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 2 s" in one_line(r.stderr)
    # a host that does not resolve: at once
    r, _ = run_ckpt_env(convert_args("dcp", dst), {**env, "MASTER_ADDR": "no-such-host.invalid"})
    assert r.returncode == 1 and "cannot resolve the coordinator's host 'no-such-host.invalid'" in one_line(r.stderr)
    # a peer that never comes: process 0 waits as long, then says which, and so does every process that came
    # (8 s: time enough for the two that come to import torch and join, this test running alone)
    other = free_port()
    args = ["-m", "ckpt_tool", *convert_args("dcp", dst)]
    (c0, e0), (c1, e1) = spawn([args, args], [torchrun_env(0, 3, other, CKPT_JOIN_TIMEOUT="8"),
                                              torchrun_env(1, 3, other, CKPT_JOIN_TIMEOUT="8")])
    assert c0 == c1 == 1
    missing = "process 0 waited 8 s for process 2 to join at 127.0.0.1:"
    assert missing in one_line(e0) and f"process 0 failed: {missing}" in one_line(e1)
    assert not dst.exists()


def spawn(args: list[list[str]], envs: list[dict[str, str]]) -> list[tuple[int, str]]:
    procs = [subprocess.Popen([sys.executable, *a], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a, e in zip(args, envs)]
    outs = [p.communicate(timeout=180) for p in procs]
    return [(p.returncode, err) for p, (_, err) in zip(procs, outs)]


def torchrun_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    return clean_env(**{"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "CKPT_JOIN_TIMEOUT": "60", **extra})


@pytest.mark.slow
def test_world_size_mismatch_fails_on_every_process(tmp_path):
    port = free_port()
    args = ["-m", "ckpt_tool", *convert_args("dcp", tmp_path / "out")]
    results = spawn([args, args], [torchrun_env(0, 2, port), torchrun_env(1, 3, port)])
    lines = [one_line(err) for code, err in results if code == 1]
    assert len(lines) == 2, results
    assert "the processes disagree on their number: process 0 was told 2, process 1" in lines[0]
    assert "the processes disagree on their number: process 1 was told 3, process 0" in lines[1]
    assert lines[0].endswith("3 (WORLD_SIZE)") and lines[1].endswith("2 (WORLD_SIZE)")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_failing_process_stops_the_others_with_its_message(tmp_path):
    """Process 0 cannot open its SRC: process 1 stops at its next barrier, naming why, instead of waiting."""
    port = free_port()
    dst = tmp_path / "out"
    good = ["-m", "ckpt_tool", *convert_args("dcp", dst)]
    bad = ["-m", "ckpt_tool", "convert", str(tmp_path / "missing"), str(dst), "--to", "dcp"]
    (c0, e0), (c1, e1) = spawn([bad, good], [torchrun_env(0, 2, port), torchrun_env(1, 2, port)])
    assert c0 == 1 and c1 == 1
    assert "missing: no such directory" in one_line(e0)
    assert "process 0 failed: " in one_line(e1) and "missing: no such directory" in e1
    assert not dst.exists()


@pytest.mark.slow
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_process_stops_the_others_on_the_jax_route(tmp_path, failing):
    """The same through jax.distributed (flags): the other process stops at its barrier with the failing
    one's message, and each exits 1 at once, with one line. (Before, the other waited at the barrier
    for CKPT_BARRIER_TIMEOUT, and a process leaving after a failure waited in jax's shutdown.)"""
    port = free_port()
    dst = tmp_path / "out"
    good = ["-m", "ckpt_tool", *convert_args("dcp", dst)]
    bad = ["-m", "ckpt_tool", "convert", str(tmp_path / "missing"), str(dst), "--to", "dcp"]
    args = [[*(bad if i == failing else good), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i)] for i in range(2)]
    start = time.monotonic()
    results = spawn(args, [clean_env(CKPT_DISTRIBUTED="jax", JAX_PLATFORMS="cpu")] * 2)
    assert time.monotonic() - start < 60, results
    (code_bad, err_bad), (code_good, err_good) = results[failing], results[1 - failing]
    assert code_bad == 1 and code_good == 1, results
    assert "missing: no such directory" in one_line(err_bad)
    assert f"process {failing} failed: " in one_line(err_good) and "missing: no such directory" in err_good
    assert not dst.exists()


def test_a_dead_process_0_is_lost_contact_not_a_late_arrival():
    """What gloo's monitored barrier says on process 1 when process 0 was SIGKILLed (seen in
    tests/ops/reshard/test_multihost_gcs.py's runs) is said as such, not as a process that came too late."""
    from ckpt_tool.base.distributed import TorchCoordinator

    coord = object.__new__(TorchCoordinator)
    coord.process_index = 1
    coord._peer_failure = lambda: None  # type: ignore[method-assign] - process 0, the store, is gone
    err = coord._failure("barrier 'ckpt-convert-written'", RuntimeError(
        "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0. "
        "Please check rank 0 logs for faulty rank."))
    assert str(err).startswith("process 1: barrier 'ckpt-convert-written': lost contact with process 0 "), str(err)
    late = coord._failure("barrier 'b'", RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete"))
    assert "another process did not arrive in time" in str(late)


BARRIER_SCRIPT = r'''
import sys
from ckpt_tool.base.distributed import LaunchError, join
try:
    with join(None, None, None) as coord:
        coord.barrier("both")
        coord.barrier(sys.argv[1])
except LaunchError as exc:
    print(exc, file=sys.stderr)
    sys.exit(1)
'''


@pytest.mark.slow
def test_barriers_out_of_step_fail_instead_of_pairing_up():
    port = free_port()
    results = spawn([["-c", BARRIER_SCRIPT, "written"], ["-c", BARRIER_SCRIPT, "done"]],
                    [torchrun_env(0, 2, port), torchrun_env(1, 2, port)])
    assert [code for code, _ in results] == [1, 1], results
    errs = " ".join(err for _, err in results)
    assert "reached barrier 'done' where another process reached 'written'" in errs or \
        "reached barrier 'written' where another process reached 'done'" in errs, errs


# -- where the processes come from (no process started) -------------------------------------------


def test_expand_hostlist():
    assert expand_hostlist("node01") == ["node01"]
    assert expand_hostlist("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand_hostlist("a[1-2],b3,c[08-10]") == ["a1", "a2", "b3", "c08", "c09", "c10"]
    assert expand_hostlist("rack[1-2]-n[3,5]") == ["rack1-n3", "rack1-n5", "rack2-n3", "rack2-n5"]
    assert expand_hostlist("127.0.0.[1-3]") == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert expand_hostlist("gpu[098-101]") == ["gpu098", "gpu099", "gpu100", "gpu101"]
    assert first_host("node[07,01-04]") == "node07"  # as written: Slurm lists them sorted anyway
    assert first_host("localhost") == "localhost"
    for bad, why in [("n[1-", "unclosed '['"), ("n]1", "unmatched ']'"), ("n[a-b]", "is not a number"),
                     ("n[5-2]", "runs backwards"), ("n[[1]]", "nested '['"), ("", "is empty"), (",", "is empty")]:
        with pytest.raises(LaunchError, match=re.escape(why)):
            expand_hostlist(bad, "SLURM_NODELIST")


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "LOCAL_RANK": "1"}
SLURM = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "2", "SLURM_PROCID": "3", "SLURM_NTASKS": "8",
         "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "gpu-[17-18]", "SLURM_JOB_NODELIST": "gpu-[10-18]"}


def test_process_spec_from_launchers():
    spec = process_spec(None, None, None, TORCHRUN)
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.source) == ("10.0.0.5:29500", 4, 1, "torchrun")
    assert spec.requested and not spec.agent_store
    agent = process_spec(None, None, None, {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True",
                                            "TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert agent.agent_store and agent.store_prefix == "r1/2/"  # a restart does not meet the last attempt's keys
    spec = process_spec(None, None, None, SLURM)
    # the step's own count and nodes; the port from the job and step ids
    assert (spec.num_processes, spec.process_id, spec.source) == (4, 3, "Slurm")
    assert spec.coordinator == f"gpu-17:{slurm_port(123456, 2)}"
    assert SLURM_PORT_BASE <= slurm_port(123456, 2) < 65536 and slurm_port(123456, 2) != 61440 + 123456 % 4096
    spec = process_spec(None, None, None, {**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert spec.coordinator == "head:4000"
    # torchrun inside a Slurm step (one torchrun per node): torchrun's variables name the worker
    assert process_spec(None, None, None, {**SLURM, **TORCHRUN}).source == "torchrun"


def test_jax_is_not_started_on_torchruns_agent_port():
    spec = process_spec(None, None, None, {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    with pytest.raises(LaunchError, match="torchrun's agent holds MASTER_PORT"):
        JaxCoordinator(spec)


def test_flags_and_choices_win_over_launchers():
    # a flag wins field by field: one process asked for is one process, whatever the launcher says
    assert not process_spec(None, 1, None, TORCHRUN).requested
    spec = process_spec("head:1234", None, None, TORCHRUN)
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.source) == ("head:1234", 4, 1, "flags")
    spec = process_spec(None, None, None, {**TORCHRUN, "JAX_COORDINATOR_ADDRESS": "j:1", "JAX_NUM_PROCESSES": "2",
                                           "JAX_PROCESS_ID": "0"})
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("j:1", 2, 0)
    assert not process_spec(None, None, None, {**TORCHRUN, "CKPT_DISTRIBUTED": "off"}).requested
    # a batch script (no job step) is one process, whatever the allocation's task count
    batch = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}
    assert not process_spec(None, None, None, batch).requested
    assert not process_spec(None, None, None, {**SLURM, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}).requested
    assert not process_spec(None, None, None, {"RANK": "0", "WORLD_SIZE": "1"}).requested
    assert not process_spec(None, None, None, {"MASTER_ADDR": "x", "MASTER_PORT": "1"}).requested
    # the library: a launcher's run takes torch, a jax-style one jax; CKPT_DISTRIBUTED forces either
    launched, flagged = process_spec(None, None, None, TORCHRUN), process_spec("h:1", 2, 0, {})
    assert library_for(launched, {}) == "torch.distributed" and library_for(flagged, {}) == "jax.distributed"
    assert library_for(launched, {"CKPT_DISTRIBUTED": "jax"}) == "jax.distributed"
    assert library_for(flagged, {"CKPT_DISTRIBUTED": "torch"}) == "torch.distributed"
