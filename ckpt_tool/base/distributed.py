"""Several processes running the same command: who they are, and their barriers.

A multi-process run is asked for by flags (--coordinator / --num-processes /
--process-id), by jax's variables (JAX_COORDINATOR_ADDRESS ...), or by the
launcher that started the process: torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) or a Slurm job step (SLURM_PROCID, SLURM_STEP_NUM_TASKS, the
first node of SLURM_STEP_NODELIST). Flags win over the variables.

The processes meet through one of two libraries behind the same small
interface (`Coordinator`: process_index, process_count, barrier(name)):
torch.distributed over gloo (TorchCoordinator) or jax.distributed
(JaxCoordinator). A launcher's run takes torch when it is importable, else
jax; a run asked for by flags or JAX_* takes jax when importable (its device
ids are what `reshard` lays out for), else torch; CKPT_DISTRIBUTED=torch|jax
forces one, CKPT_DISTRIBUTED=off ignores the launchers' variables.

Neither library is imported unless a run of more than one process is asked
for, so single-process commands never load them. Joining has a deadline
(CKPT_JOIN_TIMEOUT, 300 s) and so does every barrier (CKPT_BARRIER_TIMEOUT,
3600 s: a barrier waits for the slowest process's writes): a missing peer, an
unreachable coordinator or processes that disagree on their number end in
one line and a non-zero exit, never a hang.

On the jax route ckpt watches its processes itself: jax's coordination
service declares a process dead only after its heartbeat timeout (100 s)
and then ends every other process with SIGABRT, and a process that exits
after a failure waits in jax's shutdown for the others. So each process
beats a counter in the service's key-value store every second; process 0,
whose barrier waits watch the counters, posts a process silent for
CKPT_PEER_TIMEOUT (20 s) as failed, as a failing process posts its own
error; the others read it at their barrier, and after a failure every
process ends without jax's shutdown (process 0, which serves the store,
last), exit 1 and one line. Process 0's own loss cannot be seen here: jaxlib
aborts every other process at once (its coordination service is gone); the
command's parent process (cli/supervise.py) says that in one line.

Every process calls the same barriers in the same order; none is guarded by
a process-index check (seed 000: such a guard around a collective hung a
pod). The torch coordinator checks the order: a process reaching a barrier
under another name than its peers fails at once.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from itertools import product
from types import TracebackType
from typing import Any, Mapping, Protocol

from .errors import CkptError, UsageError
from .text import is_ascii_number

# which library coordinates: auto (by the rules above), torch, jax; off: ignore launcher variables
CHOICE_VARIABLE = "CKPT_DISTRIBUTED"
# the two libraries, by the module that coordinates (CKPT_DISTRIBUTED names the package)
TORCH, JAX = LIBRARIES = ("torch.distributed", "jax.distributed")
JOIN_TIMEOUT_VARIABLE = "CKPT_JOIN_TIMEOUT"
BARRIER_TIMEOUT_VARIABLE = "CKPT_BARRIER_TIMEOUT"
DEFAULT_JOIN_TIMEOUT = 300.0
DEFAULT_BARRIER_TIMEOUT = 3600.0
# jax route: how long a process may leave its alive counter unchanged before process 0 posts it as
# failed (jax's own heartbeat timeout is 100 s, after which it aborts every process)
PEER_TIMEOUT_VARIABLE = "CKPT_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT = 20.0
ALIVE_INTERVAL = 1.0  # seconds between two beats of a process's alive counter
# how long process 0, which serves the store, stays after a failure for the others to read it
ABORT_LINGER = 10.0
# how much longer than process 0 the others wait at the join, so that process 0 names the missing
READY_GRACE = 10.0
# jax route: set in a command's process run under ckpt's supervisor (cli/supervise.py), which reports
# jaxlib's abort of the process; how long a process that lost the coordinator waits for that abort
supervised = False
SUPERVISED_ABORT_WAIT = 10.0

# Slurm gives no port: one is derived from the job and step ids, in 61440..65535 (above Linux's
# ephemeral range, so no outgoing connection holds it), shifted from the port jax's own Slurm
# detection picks for the same job (61440 + job id mod 4096) so that the two never meet
SLURM_PORT_BASE = 61440
SLURM_PORT_SPAN = 4096
SLURM_PORT_SHIFT = 2048


class LaunchError(CkptError):
    """The processes of a multi-process run could not meet, or disagree."""

    code = "distributed"


class Coordinator(Protocol):
    """What the engine needs of a multi-process run (engine.Coordinator: the single-process one)."""

    process_index: int
    process_count: int

    def barrier(self, name: str) -> None: ...


@dataclass(frozen=True)
class ProcessSpec:
    coordinator: str | None  # host:port
    num_processes: int | None
    process_id: int | None
    source: str = "flags"  # where the values came from: flags, JAX_* variables, torchrun, Slurm
    # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT: every process joins it as a client
    agent_store: bool = False
    store_prefix: str = ""  # keys of this run in a store shared with other runs (torchrun restarts)

    @property
    def requested(self) -> bool:
        if self.num_processes is not None:
            return self.num_processes > 1
        return bool(self.coordinator)  # jax finds the rest itself (its cluster detection)

    @property
    def launcher(self) -> bool:
        return self.source in ("torchrun", "Slurm")


# -- where the processes come from -------------------------------------------------------


def _int_var(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    text = env.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not a whole number") from None
    if value < minimum:
        raise LaunchError(f"{name}={value} is below {minimum}")
    return value


def _check_rank(rank: int | None, count: int | None, rank_name: str, count_name: str) -> None:
    if rank is not None and count is not None and rank >= count:
        raise LaunchError(f"{rank_name}={rank} is outside 0..{count - 1} ({count_name}={count})")


def _torchrun_spec(env: Mapping[str, str]) -> ProcessSpec | None:
    """torchrun's worker variables (also set by other launchers that follow torch's env:// rules)."""
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    world = _int_var(env, "WORLD_SIZE", minimum=1)
    rank = _int_var(env, "RANK")
    if world == 1 and rank in (0, None):
        return ProcessSpec(None, 1, 0, "torchrun")
    missing = [n for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(n, "").strip()]
    if missing:
        have = ", ".join(n for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if n not in missing)
        raise LaunchError(
            f"torchrun variables half set: {have} set but {', '.join(missing)} not; set all four "
            f"(torchrun does), or unset them ({CHOICE_VARIABLE}=off ignores them)"
        )
    _check_rank(rank, world, "RANK", "WORLD_SIZE")
    port = _int_var(env, "MASTER_PORT", minimum=1)
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    prefix = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/" if agent else ""
    return ProcessSpec(f"{env['MASTER_ADDR'].strip()}:{port}", world, rank, "torchrun", agent, prefix)


def _slurm_spec(env: Mapping[str, str]) -> ProcessSpec | None:
    """The task variables srun sets in a job step.

    Only inside a step (SLURM_STEP_ID): a batch script has SLURM_PROCID=0 and
    SLURM_NTASKS of the whole allocation too, but it is one process.
    """
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    count_name = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    count = _int_var(env, count_name, minimum=1)
    rank = _int_var(env, "SLURM_PROCID")
    if count is None:
        raise LaunchError("Slurm variables half set: SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS")
    _check_rank(rank, count, "SLURM_PROCID", count_name)
    if count == 1:
        return ProcessSpec(None, 1, 0, "Slurm")
    host = env.get("MASTER_ADDR", "").strip()
    if not host:
        list_name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)), None)
        if list_name is None:
            raise LaunchError("Slurm variables half set: SLURM_PROCID is set but no SLURM_STEP_NODELIST / "
                              "SLURM_JOB_NODELIST / SLURM_NODELIST names the nodes (or set MASTER_ADDR)")
        host = first_host(env[list_name], list_name)
    port = _int_var(env, "MASTER_PORT", minimum=1)
    if port is None:
        job = _int_var(env, "SLURM_JOB_ID")
        if job is None:
            raise LaunchError("Slurm variables half set: no SLURM_JOB_ID to derive the coordinator's port from "
                              "(or set MASTER_PORT)")
        step = _int_var(env, "SLURM_STEP_ID") or 0
        port = slurm_port(job, step)
    return ProcessSpec(f"{host}:{port}", count, rank, "Slurm")


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The coordinator's port of a Slurm step: the same on every node of the step."""
    return SLURM_PORT_BASE + (job_id + step_id + SLURM_PORT_SHIFT) % SLURM_PORT_SPAN


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_HOSTS = 1_000_000  # a Slurm host list expanded (no cluster has more nodes)


def expand_hostlist(text: str, name: str = "the node list") -> list[str]:
    """Slurm's compressed host list, expanded as `scontrol show hostnames` prints it.

    'node[01-03,07],gpu-a[1-2]-x[3,5]' -> node01 node02 node03 node07 gpu-a1-x3 gpu-a1-x5
    gpu-a2-x3 gpu-a2-x5: commas outside brackets separate entries; each
    bracket holds numbers and ranges, zero-padded to the width written; several
    brackets in one entry multiply out, the first varying slowest.
    """
    entries: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"{name}: nested '[' in {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"{name}: unmatched ']' in {text!r}")
        elif ch == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"{name}: unclosed '[' in {text!r}")
    entries.append(text[start:])
    hosts: list[str] = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        parts = re.split(r"\[([^\]]*)\]", entry)  # literal, bracket, literal, bracket, ..., literal
        choices: list[list[str]] = []
        for k, part in enumerate(parts):
            choices.append([part] if k % 2 == 0 else _expand_bracket(part, text, name))
        # brackets multiply: 'n[0-999999][0-999999]' is 10**12 names, each bracket plausible alone
        count = 1
        for c in choices:
            count *= len(c)
        if len(hosts) + count > MAX_HOSTS:
            raise LaunchError(f"{name}: {text!r} names more than {MAX_HOSTS:,} nodes")
        hosts.extend("".join(p) for p in product(*choices))
    if not hosts:
        raise LaunchError(f"{name} is empty")
    return hosts


def _expand_bracket(body: str, text: str, name: str) -> list[str]:
    out: list[str] = []
    for item in (s.strip() for s in body.split(",")):
        m = _RANGE.match(item)
        if not m:
            raise LaunchError(f"{name}: {item!r} in {text!r} is not a number or a range N-M")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise LaunchError(f"{name}: the range {item!r} in {text!r} runs backwards")
        if int(hi) - int(lo) >= 1_000_000:
            raise LaunchError(f"{name}: the range {item!r} in {text!r} is implausibly long")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def first_host(text: str, name: str = "SLURM_NODELIST") -> str:
    """The first node of a Slurm host list: where task 0 of a step runs, so where the coordinator listens."""
    return expand_hostlist(text, name)[0]


def process_spec(
    coordinator: str | None, num_processes: int | None, process_id: int | None,
    env: Mapping[str, str] | None = None,
) -> ProcessSpec:
    """Flags first, then jax's variables, then the launcher's (torchrun, then Slurm)."""
    env = os.environ if env is None else env
    choice = _choice(env)
    jax_coordinator = env.get("JAX_COORDINATOR_ADDRESS") or None
    jax_count = _int_var(env, "JAX_NUM_PROCESSES", minimum=1)
    jax_id = _int_var(env, "JAX_PROCESS_ID")
    explicit = ProcessSpec(
        coordinator or jax_coordinator,
        num_processes if num_processes is not None else jax_count,
        process_id if process_id is not None else jax_id,
        "flags" if (coordinator or num_processes is not None or process_id is not None) else "JAX_* variables",
    )
    given = [explicit.coordinator, explicit.num_processes, explicit.process_id]
    if choice == "off":
        return explicit
    launched = _torchrun_spec(env) or _slurm_spec(env)
    if launched is None:
        return explicit
    if all(v is None for v in given):
        return launched
    # flags (or JAX_*) win field by field; the launcher fills the rest
    return ProcessSpec(
        explicit.coordinator or launched.coordinator,
        explicit.num_processes if explicit.num_processes is not None else launched.num_processes,
        explicit.process_id if explicit.process_id is not None else launched.process_id,
        explicit.source,
        launched.agent_store and not explicit.coordinator,
        launched.store_prefix if not explicit.coordinator else "",
    )


def _choice(env: Mapping[str, str]) -> str:
    choice = (env.get(CHOICE_VARIABLE) or "auto").strip().lower()
    if choice not in ("auto", "off") and f"{choice}.distributed" not in LIBRARIES:
        raise LaunchError(f"{CHOICE_VARIABLE}={choice!r}: expected auto, torch, jax or off")
    return choice


def _timeout(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise LaunchError(f"{name}={text!r}: expected a positive number of seconds")
    return value


def _importable(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def library_for(spec: ProcessSpec, env: Mapping[str, str] | None = None) -> str:
    """TORCH or JAX: the library this run coordinates through (nothing imported)."""
    env = os.environ if env is None else env
    choice = _choice(env)
    if f"{choice}.distributed" in LIBRARIES:
        return f"{choice}.distributed"
    order = (TORCH, JAX) if spec.launcher else (JAX, TORCH)
    for lib in order:
        if _importable(lib.partition(".")[0]):  # the package: finding a submodule would import it
            return lib
    raise LaunchError(f"a {spec.num_processes or 'multi'}-process run ({spec.source}) needs torch or jax to coordinate; "
                      "neither is installed: pip install torch (or jax)")


def join(
    coordinator: str | None, num_processes: int | None, process_id: int | None,
) -> TorchCoordinator | JaxCoordinator | None:
    """This process's place in a multi-process run, joined; None for a single-process run.

    Close it (or use it as a context manager) when the command is over: a
    failure inside the block is posted to the other processes, which stop at
    their next barrier with this process's message instead of waiting.
    """
    spec = process_spec(coordinator, num_processes, process_id)
    if not spec.requested:
        return None
    env = os.environ
    join_timeout = _timeout(env, JOIN_TIMEOUT_VARIABLE, DEFAULT_JOIN_TIMEOUT)
    barrier_timeout = _timeout(env, BARRIER_TIMEOUT_VARIABLE, DEFAULT_BARRIER_TIMEOUT)
    if library_for(spec) == TORCH:
        return TorchCoordinator(spec, join_timeout=join_timeout, barrier_timeout=barrier_timeout)
    return JaxCoordinator(spec, join_timeout=join_timeout, barrier_timeout=barrier_timeout,
                          peer_timeout=_timeout(env, PEER_TIMEOUT_VARIABLE, DEFAULT_PEER_TIMEOUT))


def _keep_stdout_for_output() -> None:
    """Point fd 1 at stderr for the rest of the process; sys.stdout keeps the real stdout.

    gloo and XLA print connection lines on fd 1 from C++ (some only when
    their buffers flush at exit); the command's own output (--json) must
    stay parseable.
    """
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real_stdout, "w", buffering=1)


def _debug() -> bool:
    return os.environ.get("CKPT_DEBUG", "") not in ("", "0")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _split_address(address: str, source: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")  # [::1]:1234
    if not sep or not host or not is_ascii_number(port) or not 0 < int(port) < 65536:
        raise LaunchError(f"coordinator address {address!r} ({source}) is not HOST:PORT")
    return host, int(port)


def _origin(spec: ProcessSpec) -> str:
    return {
        "torchrun": "MASTER_ADDR:MASTER_PORT",
        "Slurm": "the first node of the Slurm step, port from SLURM_JOB_ID (or MASTER_ADDR / MASTER_PORT)",
        "flags": "--coordinator",
        "JAX_* variables": "JAX_COORDINATOR_ADDRESS",
    }.get(spec.source, spec.source)


class _Joined:
    """What both coordinators share: the context-manager protocol around a command."""

    kind = ""
    process_index = 0
    process_count = 1

    def abort(self, message: str) -> None:
        """Tell the other processes that this one failed (best effort)."""

    def close(self) -> None:
        """Leave the run."""

    def __enter__(self) -> _Joined:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if exc is not None and not isinstance(exc, SystemExit):  # SystemExit: the command chose its exit code
                self.abort(_first_line(exc) if not isinstance(exc, KeyboardInterrupt) else "interrupted")
        finally:
            self.close()


class TorchCoordinator(_Joined):
    """Barriers over torch.distributed's gloo backend; joining through a TCPStore.

    Process 0 serves the store at the coordinator address (torchrun's agent
    serves it already: then every process is a client). Before gloo starts,
    every process registers under its rank with its count of processes, so
    a duplicated rank or a WORLD_SIZE that differs between processes is one
    line on every side instead of a rendezvous that waits forever.
    """

    kind = TORCH

    def __init__(self, spec: ProcessSpec, *, join_timeout: float, barrier_timeout: float) -> None:
        if spec.num_processes is None or spec.process_id is None:
            raise LaunchError(f"a run coordinated through torch needs the number of processes and this process's id "
                              f"(--num-processes / --process-id; {spec.source} gave "
                              f"{'neither' if spec.num_processes is None and spec.process_id is None else 'one'})")
        if spec.coordinator is None:
            raise LaunchError("a run coordinated through torch needs the coordinator's address (--coordinator HOST:PORT)")
        host, port = _split_address(spec.coordinator, spec.source)
        self._where = f"{host}:{port} ({_origin(spec)})"
        self._join_start = time.monotonic()
        deadline = self._join_start + join_timeout
        serve = self._serving = spec.process_id == 0 and not spec.agent_store
        if not _debug():
            # c10d logs each failed connection attempt with a C++ stack; ckpt says it in one line
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        if not serve:
            # importing torch takes seconds of CPU: it runs while this process waits for process 0
            # (itself importing torch) to answer, instead of after
            loader = threading.Thread(target=_import_quietly, args=(TORCH,), name="ckpt-import", daemon=True)
            loader.start()
            try:
                _wait_until_reachable(host, port, deadline, join_timeout, self._where)
            finally:
                loader.join()  # never leave an import half done behind an error
        try:
            import torch.distributed as dist
        except ImportError:
            raise LaunchError(f"a run started by {spec.source} coordinates through torch here, which is not "
                              f"installed ({CHOICE_VARIABLE}=jax for jax)") from None
        if not dist.is_available() or not dist.is_gloo_available():
            raise LaunchError("this torch build has no torch.distributed gloo backend")
        from datetime import timedelta

        self._dist = dist
        self._timedelta = timedelta
        self.spec = spec
        self.process_index = spec.process_id
        self.process_count = spec.num_processes
        self.join_timeout = join_timeout
        self.barrier_timeout = barrier_timeout
        self._seq = 0
        self._pg = False
        self._posted = self._known_failure = self._acknowledged = False
        _keep_stdout_for_output()
        try:
            store = dist.TCPStore(host, port, None, serve, timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
                                  wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - DistNetworkError / RuntimeError variants
            if serve:
                raise LaunchError(f"process 0 cannot serve the coordinator at {self._where}: {_first_line(exc)} "
                                  "(another run on this port? choose another port)") from None
            raise LaunchError(f"cannot join the coordinator at {self._where}: {_first_line(exc)}") from None
        self._store = dist.PrefixStore(f"ckpt/{spec.store_prefix}", store)
        try:
            self._handshake(deadline)
        except LaunchError:
            self._linger()
            raise
        remaining = max(1.0, deadline - time.monotonic())
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore("pg", self._store), rank=self.process_index,
                                    world_size=self.process_count, timeout=timedelta(seconds=remaining))
        except Exception as exc:  # noqa: BLE001
            raise self._failure("starting gloo", exc) from None
        self._pg = True
        store.set_timeout(timedelta(seconds=barrier_timeout))

    # -- joining ---------------------------------------------------------------------

    def _handshake(self, deadline: float) -> None:
        s, rank, count = self._store, self.process_index, self.process_count
        try:
            if s.add(f"claim/{rank}", 1) > 1:
                raise self._abort_all(f"two processes claim process id {rank} ({self.spec.source}): each needs its own")
            s.set(f"join/{rank}", json.dumps({"count": count, "host": socket.gethostname(), "pid": os.getpid()}))
            # process 0 checks everyone against itself; everyone checks itself against process 0: O(n) in all
            others = range(1, count) if rank == 0 else [0]
            for other in others:
                info = json.loads(self._wait_for(f"join/{other}", deadline, f"process {other} to join"))
                if info.get("count") != count:
                    raise self._abort_all(
                        f"the processes disagree on their number: process {rank} was told {count}, process {other} "
                        f"(on {info.get('host')}) {info.get('count')} ({self._count_name()})")
            if rank == 0:
                s.set("ready", str(count))
            else:
                # process 0 says who is missing at its deadline: the others give it a little longer
                self._wait_for("ready", deadline + READY_GRACE, "process 0 to see every process")
        except LaunchError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store's connection lost (process 0 gone) and the like
            raise LaunchError(f"lost the coordinator at {self._where} while joining: {_first_line(exc)}") from None

    def _count_name(self) -> str:
        return {"torchrun": "WORLD_SIZE", "Slurm": "SLURM_STEP_NUM_TASKS / SLURM_NTASKS",
                "flags": "--num-processes"}.get(self.spec.source, "the number of processes")

    def _wait_for(self, key: str, deadline: float, what: str) -> str:
        """The key's value once set; polls (the abort key too) until the join deadline."""
        s = self._store
        pause = 0.005
        while True:
            if s.check([key]):
                return s.get(key).decode()
            self._raise_if_aborted()
            if time.monotonic() > deadline:
                if self.process_index == 0:
                    missing = [r for r in range(1, self.process_count) if not s.check([f"join/{r}"])]
                    what = f"{'process' if len(missing) == 1 else 'processes'} {_ranges(missing)} to join"
                raise self._abort_all(
                    f"process {self.process_index} waited {deadline - self._join_start:g} s for {what} at {self._where} "
                    f"({self.process_count} processes expected; {JOIN_TIMEOUT_VARIABLE} sets the deadline)")
            time.sleep(pause)
            pause = min(0.25, pause * 2)

    def _abort_info(self) -> dict[str, Any] | None:
        """The failure a process posted, if any (read once, each other process acknowledges it)."""
        s = self._store
        if not s.check(["abort"]):
            return None
        info = json.loads(s.get("abort").decode())
        self._known_failure = True
        self._acknowledge()
        return info

    def _acknowledge(self) -> None:
        # process 0 serves the store: it stays until every other process has had the message
        if self.process_index != 0 and not self._acknowledged:
            self._acknowledged = True
            try:
                self._store.add("abort-seen", 1)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def _raise_if_aborted(self) -> None:
        info = self._abort_info()
        if info is not None:
            raise LaunchError(f"process {info['rank']} failed: {info['message']}")

    def _abort_all(self, message: str) -> LaunchError:
        """Post this failure for the others (the first posted wins); the error to raise here."""
        self._post_abort(message)
        return LaunchError(message)

    def _post_abort(self, message: str) -> None:
        if self._posted:
            return
        self._posted = self._known_failure = True
        try:
            self._store.compare_set("abort", "", json.dumps({"rank": self.process_index, "message": message}))
            self._acknowledge()
        except Exception:  # noqa: BLE001 - best effort: the store may be gone already
            pass

    def _peer_failure(self) -> str | None:
        try:
            info = self._abort_info()
        except Exception:  # noqa: BLE001 - process 0 (the store) is gone
            return None
        if info is not None and info.get("rank") != self.process_index:
            return f"process {info['rank']} failed: {info['message']}"
        return None

    def _failure(self, during: str, exc: BaseException) -> LaunchError:
        peer = self._peer_failure()
        if peer:
            return LaunchError(peer)
        text = _first_line(exc)
        # gloo's monitored barrier on a process whose peer died (process 0 SIGKILLed): not a late arrival
        gone = re.search(r"received errors while waiting for send/recv from rank (\d+)", text)
        if gone:
            return LaunchError(f"process {self.process_index}: {during}: lost contact with process {gone.group(1)} "
                               f"(it exited or was killed; its own output says why): {text}")
        if "monitoredBarrier" in text or "timed out" in text.lower() or "timeout" in text.lower():
            return LaunchError(f"process {self.process_index}: {during}: another process did not arrive in time ({text})")
        return LaunchError(f"process {self.process_index}: {during}: lost contact with another process "
                           f"(it exited or was killed; its own output says why): {text}")

    # -- the interface -------------------------------------------------------------------

    def barrier(self, name: str) -> None:
        seq = self._seq
        self._seq += 1
        try:
            self._raise_if_aborted()
            first = self._store.compare_set(f"barrier/{seq}", "", name).decode()
        except LaunchError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._failure(f"barrier {name!r}", exc) from None
        if first != name:
            raise self._abort_all(f"process {self.process_index} reached barrier {name!r} where another process "
                                  f"reached {first!r} (barrier {seq}): the processes run different commands")
        try:
            self._dist.monitored_barrier(timeout=self._timedelta(seconds=self.barrier_timeout), wait_all_ranks=True)
        except Exception as exc:  # noqa: BLE001
            raise self._failure(f"barrier {name!r}", exc) from None

    def abort(self, message: str) -> None:
        self._post_abort(message)

    def close(self) -> None:
        if self._pg:
            # first: a process waiting for this one in a gloo barrier fails at once and reads the store
            self._pg = False
            try:
                self._dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving: nothing left to report to
                pass
        self._linger()

    def _linger(self) -> None:
        """After a failure, process 0 (whose exit takes the store along) stays until the others have read why."""
        if not (self._known_failure and self._serving):
            return
        deadline = time.monotonic() + ABORT_LINGER
        try:  # the processes that joined: one never seen cannot read it either
            joined = sum(self._store.check([f"join/{r}"]) for r in range(1, self.process_count))
        except Exception:  # noqa: BLE001
            return
        while time.monotonic() < deadline:
            try:
                if self._store.add("abort-seen", 0) >= joined:
                    break
            except Exception:  # noqa: BLE001
                break
            time.sleep(0.05)


def _ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7' (thousands of missing processes stay one short line)."""
    parts: list[list[int]] = []
    for n in numbers:
        if parts and parts[-1][1] == n - 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _import_quietly(module: str) -> None:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - the importing thread of the caller says what failed
        pass


def _wait_until_reachable(host: str, port: int, deadline: float, timeout: float, where: str) -> None:
    """Connect to the coordinator until it answers or the deadline passes (process 0 may start last)."""
    pause = 0.05
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            why = f": {last}" if last else ""
            raise LaunchError(f"cannot reach the coordinator at {where} within {timeout:g} s{why} "
                              f"({JOIN_TIMEOUT_VARIABLE} sets the deadline)")
        try:
            with socket.create_connection((host, port), timeout=min(left, 5.0)):
                return
        except socket.gaierror as exc:
            raise LaunchError(f"cannot resolve the coordinator's host {host!r} ({exc.strerror or exc}); "
                              f"the address came from {where}") from None
        except OSError as exc:
            last = exc.strerror or exc  # type: ignore[assignment]
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(1.0, pause * 2)


class JaxCoordinator(_Joined):
    """Barriers over jax.distributed (its coordination service's named barriers)."""

    kind = JAX

    def __init__(self, spec: ProcessSpec, *, join_timeout: float = DEFAULT_JOIN_TIMEOUT,
                 barrier_timeout: float = DEFAULT_BARRIER_TIMEOUT, peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> None:
        if spec.agent_store:
            raise LaunchError("torchrun's agent holds MASTER_PORT, where jax's coordinator would listen: under torchrun "
                              "ckpt coordinates through torch (not importable here); for jax pass --coordinator "
                              "HOST:PORT with a free port")
        if spec.coordinator and spec.process_id:
            # jax's client ends the process with a fatal log (SIGABRT, a C++ stack) when it cannot
            # register: a coordinator that does not answer is said here first, in one line
            host, port = _split_address(spec.coordinator, spec.source)
            _wait_until_reachable(host, port, time.monotonic() + join_timeout, join_timeout,
                                  f"{host}:{port} ({_origin(spec)})")
        try:
            import jax
        except ImportError:
            raise LaunchError("multi-host runs coordinate through torch or jax here, and neither is installed: "
                              "pip install jax (or torch)") from None
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _keep_stdout_for_output()
        try:
            jax.distributed.initialize(
                coordinator_address=spec.coordinator,
                num_processes=spec.num_processes,
                process_id=spec.process_id,
                initialization_timeout=max(1, int(join_timeout)),
            )
        except Exception as exc:  # noqa: BLE001 - jax raises RuntimeError/ValueError variants
            raise LaunchError(f"jax.distributed.initialize failed ({spec.source}): {_first_line(exc)}") from exc
        from jax._src import distributed as state

        self._jax = jax
        self.spec = spec
        self.barrier_timeout = barrier_timeout
        self.peer_timeout = peer_timeout
        self._seq = 0
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self._client: Any = state.global_state.client
        self._posted = self._known_failure = self._acknowledged = False
        self._exit_code = 1
        self._dead: set[int] = set()
        self._seen: dict[int, tuple[str | None, float]] = {}  # process 0: each peer's counter, when it last changed
        self._last_look = 0.0
        self._stop = threading.Event()
        if self._client is not None and self.process_count > 1:
            threading.Thread(target=self._beat, name="ckpt-alive", daemon=True).start()
            # runs before jax's own exit handler (registered when jax was imported): after a failure
            # that one would wait in the service's shutdown barrier for a process that is gone
            atexit.register(self._leave)

    # -- watching the processes ------------------------------------------------------------

    def _beat(self) -> None:
        """Advance this process's alive counter every ALIVE_INTERVAL (a thread; stops at close)."""
        key, n = f"ckpt/alive/{self.process_index}", 0
        while not self._stop.is_set():
            n += 1
            try:
                self._client.key_value_set(key, str(n), allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the service is gone: the barrier says so
                return
            self._stop.wait(ALIVE_INTERVAL)

    def _check_peers(self) -> None:
        """Raise when another process posted a failure, or (process 0) one has gone silent."""
        try:
            text = self._client.key_value_try_get("ckpt/abort")
        except Exception as exc:  # noqa: BLE001 - NOT_FOUND: no failure posted; else the service is gone
            if "NOT_FOUND" not in str(exc):
                self._known_failure = True
                if supervised:
                    # jaxlib's own poll of the service failed as this call did: it ends the process
                    # in a moment, and the supervisor says so in one line; a line of ours first
                    # would make two
                    time.sleep(SUPERVISED_ABORT_WAIT)
                raise LaunchError(f"process {self.process_index}: lost the coordinator (process 0, which serves "
                                  f"jax's coordination service; it exited or was killed): {_first_line(exc)}") from None
        else:
            info = json.loads(text)
            self._known_failure = True
            self._acknowledge()
            if info.get("rank") != self.process_index:
                raise LaunchError(f"process {info['rank']} failed: {info['message']}")
        now = time.monotonic()
        if self.process_index != 0 or now - self._last_look < ALIVE_INTERVAL:
            return
        self._last_look = now
        try:
            counters = dict(self._client.key_value_dir_get("ckpt/alive/"))
        except Exception:  # noqa: BLE001 - (this process serves the store: not expected)
            return
        for rank in range(1, self.process_count):
            value = counters.get(f"ckpt/alive/{rank}")
            seen = self._seen.get(rank)
            if seen is None or seen[0] != value:
                self._seen[rank] = (value, now)
        silent = [r for r, (_, since) in sorted(self._seen.items()) if now - since > self.peer_timeout]
        if silent:
            self._dead.update(silent)
            who = f"process {silent[0]}" if len(silent) == 1 else f"processes {_ranges(silent)}"
            raise self._abort_all(f"{who} stopped answering for {self.peer_timeout:g} s (killed, or its host is gone; "
                                  f"{PEER_TIMEOUT_VARIABLE} sets how long a process may be silent)")

    def _abort_all(self, message: str) -> LaunchError:
        self._post_abort(message)
        return LaunchError(message)

    def _post_abort(self, message: str) -> None:
        """Post this process's failure for the others (the first posted stays)."""
        self._known_failure = True
        if self._posted or self._client is None:
            return
        self._posted = True
        try:
            self._client.key_value_set("ckpt/abort", json.dumps({"rank": self.process_index, "message": message}))
        except Exception:  # noqa: BLE001 - another failure was posted first, or the service is gone
            pass
        self._acknowledge()

    def _acknowledge(self) -> None:
        if self.process_index != 0 and not self._acknowledged:
            self._acknowledged = True
            try:
                self._client.key_value_increment("ckpt/abort-seen", 1)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def abort(self, message: str) -> None:
        self._post_abort(message)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None and not isinstance(exc, SystemExit):
            # the code the command ends with (cli/main.py's rule), for the exit that skips jax's shutdown
            self._exit_code = 130 if isinstance(exc, KeyboardInterrupt) else 2 if isinstance(exc, UsageError) else 1
        super().__exit__(kind, exc, tb)

    def close(self) -> None:
        self._stop.set()
        if not (self._known_failure and self.process_index == 0 and self._client is not None):
            return
        # process 0 serves the store and jax's service: it stays until the others have read the
        # failure (bounded), for a process that loses the service is aborted by jax
        expected = self.process_count - 1 - len(self._dead)
        deadline = time.monotonic() + ABORT_LINGER
        while time.monotonic() < deadline:
            try:
                if self._client.key_value_increment("ckpt/abort-seen", 0) >= expected:
                    break
            except Exception:  # noqa: BLE001
                break
            time.sleep(0.05)

    def _leave(self) -> None:
        """At exit after a failure: end now, with the command's code, without jax's shutdown."""
        if not self._known_failure:
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if self.process_index == 0:
            time.sleep(0.2)  # the others, which have read the failure, are ending too
        os._exit(self._exit_code)

    def barrier(self, name: str) -> None:
        from jax._src import distributed as state

        seq = self._seq
        self._seq += 1
        client = state.global_state.client
        if client is None:  # not expected after initialize; jax's public barrier then
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(name)
            return
        self._check_peers()
        # a named barrier of the coordination service, with a deadline (orbax syncs its hosts the same
        # way), waited for in a thread while this one watches for a failed or silent process
        outcome: list[BaseException | None] = []
        done = threading.Event()

        def wait() -> None:
            try:
                client.wait_at_barrier(f"ckpt-{seq}-{name}", int(self.barrier_timeout * 1000))
                outcome.append(None)
            except Exception as exc:  # noqa: BLE001 - XlaRuntimeError: DEADLINE_EXCEEDED, a peer gone
                outcome.append(exc)
            done.set()

        threading.Thread(target=wait, name="ckpt-barrier", daemon=True).start()
        pause = 0.005
        while not done.wait(pause):
            pause = min(0.25, pause * 2)
            self._check_peers()
        error = outcome[0]
        if error is not None:
            self._known_failure = True
            self._check_peers()  # a posted failure says more than the barrier's own error
            raise LaunchError(f"process {self.process_index}: barrier {name!r}: {_first_line(error)}") from None
