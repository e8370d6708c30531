"""The supervisor of a command run through jax.distributed (ckpt_tool/cli/supervise.py, issue 43 item 4).

jaxlib ends a process whose coordination service (process 0) is gone with a fatal log: SIGABRT
and a C++ stack. The supervisor turns that into one line and exit 1, and otherwise stays out of
the way: output, exit codes and signals pass as if there were one process. Each case runs a real
process under `run_supervised` (a driver process, since the supervisor blocks signals and may end
itself with its child's signal); the jaxlib cases use jaxlib's own service and client.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, fixture_path, free_port

from ckpt_tool.cli import main as cli_main
from ckpt_tool.cli import supervise

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the supervisor is Linux's only")

# the supervised child: its fd 2 to the supervisor's pipe first, as `ckpt` does in the child
_CHILD_PREAMBLE = "from ckpt_tool.cli.supervise import route_native_output\nroute_native_output()\n"


def _driver(child: str, who: str = "process 1") -> str:
    return textwrap.dedent(f"""
        import sys
        from ckpt_tool.cli.supervise import run_supervised
        sys.exit(run_supervised([sys.executable, "-c", {_CHILD_PREAMBLE + textwrap.dedent(child)!r}], {who!r}))
    """)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CKPT_DEBUG", supervise.SUPERVISOR_FD_VARIABLE)}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def _start(child: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _driver(child)], cwd=ROOT, env=_env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# jaxlib's coordination service as process 0 runs it (jax.distributed.initialize's own calls)
_SERVICE = """
import sys, time
from jax._src.lib import _jax
service = _jax.get_distributed_runtime_service("[::]:" + sys.argv[1], 2, heartbeat_timeout=100)
client = _jax.get_distributed_runtime_client("127.0.0.1:" + sys.argv[1], 0, init_timeout=60, heartbeat_timeout=100)
client.connect()
print("serving", flush=True)
time.sleep(600)
"""

# process 1: connected, then waiting in a barrier for process 0; the barrier's own error (the
# service gone) races jaxlib's abort: it waits for the abort, as ckpt's processes do
_CLIENT = """
import sys, time
from jax._src.lib import _jax
client = _jax.get_distributed_runtime_client("127.0.0.1:{port}", 1, init_timeout=60, heartbeat_timeout=100)
client.connect()
print("connected", flush=True)
try:
    client.wait_at_barrier("never", 600_000)
except Exception:
    time.sleep(30)
"""


@pytest.mark.slow
@pytest.mark.parametrize("debug", ["", "1"])
def test_process_0_gone_is_one_line_and_exit_1(debug):
    port = free_port()
    service = subprocess.Popen([sys.executable, "-c", _SERVICE, str(port)], cwd=ROOT, env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proc = _start(_CLIENT.format(port=port), CKPT_DEBUG=debug)
    try:
        assert proc.stdout.readline() == "connected\n"
        assert service.stdout.readline() == "serving\n"
        service.kill()
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        ended = time.monotonic() - killed
    finally:
        for p in (service, proc):
            if p.poll() is None:
                p.kill()
            p.wait()
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    lines = err.strip().splitlines()
    assert lines[-1].startswith("ckpt: error: process 1: lost process 0, which serves jax's coordination service"), err
    if debug:  # jaxlib's report and its C++ stack, then the line
        assert "Terminating process because" in err and "Check failure stack trace" in err, err
    else:
        assert len(lines) == 1, err
    assert ended < 30, ended  # jaxlib aborts at once (no heartbeat timeout)


@pytest.mark.slow
def test_a_peer_that_never_joins_is_one_line_on_every_process(tmp_path):
    # the real command: 2 of 3 processes start; jax's join deadline (CKPT_JOIN_TIMEOUT) ends both
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ckpt_tool", "convert", str(fixture_path("orbax_ocdbt_zarr2")), str(tmp_path / f"o{i}"),
             "--to", "dcp", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "3", "--process-id", str(i)],
            cwd=ROOT, env=_env(CKPT_JOIN_TIMEOUT="3", CKPT_DISTRIBUTED="jax"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 1, (i, p.returncode, err[-3000:])
        assert err.strip().splitlines() == [
            f"ckpt: error: process {i}: not every process joined within 3 s (CKPT_JOIN_TIMEOUT sets the deadline); "
            "jax's coordination service ended this process (DEADLINE_EXCEEDED: Deadline Exceeded)"], err


def test_output_and_exit_code_pass_through():
    proc = _start("""
        import os, sys
        os.write(2, b"a line of C++ code's own\\n")
        os.write(2, b"W1207 00:14:57.787719   22474 some_file.cc:147] a log message\\nits status's next line\\n")
        print("ckpt's own line", file=sys.stderr)
        print("the output")
        sys.exit(3)
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert out == "the output\n"
    # the libraries' log messages are dropped (as storage/nativelog.py drops them), the rest kept
    assert sorted(err.splitlines()) == ["a line of C++ code's own", "ckpt's own line"], err


def test_signals_to_the_supervisor_reach_the_child():
    proc = _start("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
        print("ready", flush=True)
        time.sleep(60)
    """)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 7


def test_a_child_killed_by_a_signal_ends_the_supervisor_with_it():
    proc = _start("""
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err
    assert err == ""


def test_the_child_dies_with_the_supervisor():
    # a launcher's SIGKILL of the process it started (the supervisor) ends the command too
    proc = _start("""
        import os, time
        print(os.getpid(), flush=True)
        time.sleep(60)
    """)
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:  # a zombie (reaped by init soon) is gone too
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its supervisor")


def test_who_is_supervised(monkeypatch):
    for name in cli_main.PROCESS_VARIABLES + (supervise.SUPERVISOR_FD_VARIABLE, "CKPT_DISTRIBUTED"):
        monkeypatch.delenv(name, raising=False)
    assert cli_main.SUPERVISOR_FD_VARIABLE == supervise.SUPERVISOR_FD_VARIABLE
    # a one-process command asks nothing of the supervisor (cli/main.py never imports it)
    assert not cli_main._asks_for_processes(["convert", "a", "b", "--to", "dcp"])
    assert cli_main._asks_for_processes(["reshard", "a", "b", "--coordinator=h:1"])
    flags = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1"]
    assert supervise._process_flags(["reshard", "a", "b", *flags]) == ("127.0.0.1:1", 2, 1)
    assert supervise._process_flags(["reshard", "--num-processes=x"]) is None  # click says what is wrong
    # not supervised: one process, the torch route, a malformed command line
    assert supervise.supervise(["convert", "a", "b", "--num-processes", "1"]) is None
    monkeypatch.setenv("CKPT_DISTRIBUTED", "torch")
    assert supervise.supervise(["convert", "a", "b", *flags]) is None
    monkeypatch.setenv("CKPT_DISTRIBUTED", "mpi")
    assert supervise.supervise(["convert", "a", "b", *flags]) is None
