"""A small parent process for a command run as one of several processes through jax.distributed.

Why it exists: process 0 serves jax's coordination service. When process 0 dies (SIGKILL, its
host gone) the client in every other process polls an error from the service at once and ends
its process with a fatal log: SIGABRT, exit 134, a C++ stack on stderr (jaxlib's
coordination_service_agent.cc and client.h). Nothing in jax turns that into a Python error:
`jax.distributed.initialize` has no such option, and the client's `missed_heartbeat_callback`
(jaxlib's binding takes a Python callable for a C++ std::function<void(absl::Status)>) cannot be
called: jaxlib registers no Python type for absl::Status, so the call fails with std::bad_cast
and std::terminate (jaxlib 0.10.2, checked by hand). jax's own guide says the same of process 0:
whatever the settings, when it fails every process fails.

So on that route the command runs in a child process, and this parent, which imports nothing
heavy, waits for it:

- the child's Python output is written to the parent's own stdout and stderr (a terminal stays a
  terminal: progress, colour); what C++ code writes on fds 1 and 2 (the libraries' log, gloo)
  comes to the parent through a pipe (route_native_output, in the child) and is passed on, less
  the libraries' log messages (dropped, as storage/nativelog.py drops them in a process that is
  not supervised); a FATAL message and what follows it (jaxlib's report and C++ stack) is held;
- when jaxlib ended the child that way, the parent writes one line instead of the report (which
  CKPT_DEBUG=1 shows, with every other line) and exits 1; the line names process 0 when the
  coordination service is what was lost;
- signals sent to the parent (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) are passed to
  the child, but not those the kernel sent to the whole process group (Ctrl-C at a terminal),
  which the child has had already;
- the child dies with the parent (PR_SET_PDEATHSIG): a launcher that kills the parent with
  SIGKILL ends the child too;
- otherwise the child's end is the parent's: its exit code, or the signal that killed it.

Linux only (prctl, sigwaitinfo); elsewhere the command runs as before, in one process.
"""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
from typing import Callable

from ..base import distributed
from ..base.distributed import DEFAULT_JOIN_TIMEOUT, JAX, JOIN_TIMEOUT_VARIABLE, library_for, process_spec

# set in the child: the pipe (its fd number) that takes the child's fd 2 (cli/main.py names it too)
SUPERVISOR_FD_VARIABLE = "CKPT_SUPERVISOR_FD"

# (by name: Windows has neither most of them nor this supervisor, but imports the module)
FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
                  if hasattr(signal, name))
SI_KERNEL = 0x80  # siginfo's si_code of a signal the kernel sent (a terminal's Ctrl-C to its foreground group)
PR_SET_PDEATHSIG = 1

# a line of the C++ libraries' log (abseil's format: severity, MMDD, time, thread id, file:line]),
# e.g. 'F1207 00:08:27.260534    8207 client.h:80] Terminating process because ...'
_LOG_LINE = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]\n]*\] ?(.*)$")
_LOG_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# what jaxlib says when its RPCs to the coordination service fail: the service's process (0) is gone
_SERVICE_GONE = (b"Failed to send RPC to coordination service", b"leader task was preempted/died")
_STACK = b"*** Check failure stack trace"
REPORT_LINES = 64  # of a FATAL report, kept for the one line that replaces it


def supervise(args: list[str]) -> int | None:
    """Run `ckpt ARGS` in a child under this supervisor when ARGS ask for a multi-process run
    through jax; its exit code. None when no supervisor is wanted (the caller runs the command)."""
    if os.environ.get(SUPERVISOR_FD_VARIABLE) or not sys.platform.startswith("linux"):
        return None
    flags = _process_flags(args)
    if flags is None:
        return None
    try:
        spec = process_spec(*flags)
        if not spec.requested or library_for(spec) != JAX:
            return None
    except Exception:  # noqa: BLE001 - (LaunchError) the command itself says what is wrong, in one line
        return None
    who = f"process {spec.process_id}" if spec.process_id is not None else "this process"
    return run_supervised([sys.executable, "-m", "ckpt_tool", *args], who)


def _process_flags(args: list[str]) -> tuple[str | None, int | None, int | None] | None:
    """--coordinator / --num-processes / --process-id as click would read them; None where one is
    malformed (the command's own usage error then says so)."""
    found: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        if name in ("--coordinator", "--num-processes", "--process-id"):
            if not eq:
                if i + 1 >= len(args):
                    return None
                value = args[i + 1]
                i += 1
            found[name] = value
        i += 1
    try:
        count = int(found["--num-processes"]) if "--num-processes" in found else None
        rank = int(found["--process-id"]) if "--process-id" in found else None
    except ValueError:
        return None
    return found.get("--coordinator"), count, rank


def route_native_output() -> None:
    """In the supervised child, first thing: fd 2 to the supervisor's pipe; sys.stderr keeps the
    real stderr, so ckpt's own lines (and a terminal's progress) go where they went. Fd 1 follows
    fd 2 once the run joins (distributed._keep_stdout_for_output points it at fd 2)."""
    from ..storage.nativelog import leave_native_logs_to_supervisor

    text = os.environ.pop(SUPERVISOR_FD_VARIABLE, "")
    try:
        fd = int(text)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
    except (ValueError, OSError):  # not a pipe of a supervisor's (a stale variable): leave fd 2 as it is
        return
    sys.stderr.flush()
    real_stderr = os.dup(2)
    sys.stderr = os.fdopen(real_stderr, "w", buffering=1, encoding=sys.stderr.encoding, errors=sys.stderr.errors)
    os.dup2(fd, 2)
    os.close(fd)
    leave_native_logs_to_supervisor()
    distributed.supervised = True


def _child_setup(old_mask: set[int | signal.Signals]) -> Callable[[], None]:
    """What the child runs between fork and exec: the signal mask as it was, and SIGKILL when the
    parent dies (PR_SET_PDEATHSIG; a parent already gone ends it at once). Prepared here, in the
    parent: nothing is imported after the fork."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return setup


class _NativeOutput:
    """The child's C++ output (fds 1 and 2), read in a thread and passed to this process's stderr.

    The C++ libraries' log messages are dropped, as storage/nativelog.py drops them in a process
    that is not supervised (it leaves fd 2 to this reader here): a message is its abseil-formatted
    line and the lines written with it (a status's further lines), i.e. up to the end of that read
    from the pipe. From a FATAL message on everything is held: it is jaxlib's report before it
    aborts. Under CKPT_DEBUG=1 every line is passed on as it comes.
    """

    def __init__(self, fd: int, debug: bool) -> None:
        self._fd = fd
        self._debug = debug
        self.held: list[bytes] = []
        self.fatal: bytes | None = None  # the FATAL message's first line
        self.report: list[bytes] = []  # the FATAL message and what follows, up to its C++ stack
        self.thread = threading.Thread(target=self._read, name="ckpt-native-output", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with os.fdopen(self._fd, "rb", buffering=0) as pipe:
            pending = b""
            in_message = False  # the lines of a log message continue (they came in the same write)
            while True:
                data = pipe.read(1 << 16)
                if not data:
                    break
                if not pending:
                    in_message = False  # a read that starts a line starts afresh
                *lines, pending = (pending + data).split(b"\n")
                out: list[bytes] = []
                for line in lines:
                    in_message = self._take(line + b"\n", in_message, out)
                if out:
                    _write(b"".join(out))
            if pending:
                out = []
                self._take(pending, in_message, out)
                _write(b"".join(out))

    def _take(self, line: bytes, in_message: bool, out: list[bytes]) -> bool:
        """Sort one line: passed on (out), held or dropped; whether a log message goes on after it."""
        m = _LOG_LINE.match(line.rstrip(b"\n"))
        if m and m.group(1) == b"F" and self.fatal is None:
            self.fatal = m.group(2)
        if self.fatal is not None and len(self.report) < REPORT_LINES and not any(_STACK in r for r in self.report):
            self.report.append(line)
        if self._debug:
            out.append(line)
        elif self.fatal is not None:
            self.held.append(line)
        elif not (m or in_message or line.startswith(_LOG_PREAMBLE)):
            out.append(line)
        return bool(m) or in_message

    def release(self) -> None:
        lines, self.held = self.held, []
        _write(b"".join(lines))


def _write(data: bytes) -> None:
    while data:
        try:
            data = data[os.write(2, data):]
        except OSError:
            return  # stderr closed: nothing to tell


def run_supervised(argv: list[str], who: str) -> int:
    """Run ARGV as the supervised child (see the module's note); the exit code for this process.

    A child ended by a signal other than jaxlib's abort ends this process with the same signal."""
    debug = os.environ.get("CKPT_DEBUG", "") not in ("", "0")
    waited = {*FORWARDED, signal.SIGCHLD}
    # blocked before the child starts (and in the reader thread, which inherits the mask): every
    # signal meant for this process is taken below with sigtimedwait, none interrupts it
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)

    read_fd, write_fd = os.pipe()
    env = {**os.environ, SUPERVISOR_FD_VARIABLE: str(write_fd)}
    try:
        child = subprocess.Popen(argv, env=env, pass_fds=(write_fd,), preexec_fn=_child_setup(old_mask))
    except OSError as exc:
        os.close(read_fd)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _write(f"ckpt: error: cannot start the command's process: {exc.strerror or exc}\n".encode())
        return 1
    finally:
        os.close(write_fd)
    native = _NativeOutput(read_fd, debug)
    while child.poll() is None:
        info = signal.sigtimedwait(waited, 0.25)
        if info is not None and info.si_signo != signal.SIGCHLD and info.si_code != SI_KERNEL:
            try:
                child.send_signal(info.si_signo)
            except OSError:
                pass
    native.thread.join(5.0)  # the pipe's end: every writer (the child) gone
    code = child.returncode
    if code != 0 and native.fatal is not None:
        # jaxlib ended the child (LOG(FATAL): SIGABRT; LOG(QFATAL) in older jaxlibs: exit 1)
        _write(f"ckpt: error: {_fatal_line(who, native)}\n".encode())
        return 1
    native.release()
    if code < 0:
        # the child's death is this process's: the same signal, with its default action
        sig = -code
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (those two take no handler and no mask)
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        return 128 + sig
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    return code


def _fatal_line(who: str, native: _NativeOutput) -> str:
    """The one line that replaces jaxlib's fatal report."""
    report = b"".join(native.report).split(_STACK, 1)[0]
    if any(s in report for s in _SERVICE_GONE):
        return (f"{who}: lost process 0, which serves jax's coordination service (it exited or was killed, or its "
                f"host is gone; its own output says why); jax ended this process (CKPT_DEBUG=1 shows jax's report)")
    text = report.decode("utf-8", "replace")
    status = re.search(r"absl::Status: ([^\n]*)", text)
    rpc = re.search(r"^RPC: (\S+)", text, re.MULTILINE)
    said = status.group(1).strip() if status else (native.fatal or b"").decode("utf-8", "replace").strip()
    if len(said) > 300:
        said = said[:297] + "..."
    if rpc and rpc.group(1).endswith("/RegisterTask"):
        # jax's join (initialization_timeout is ckpt's join deadline) ended before every process came
        timeout = os.environ.get(JOIN_TIMEOUT_VARIABLE) or f"{DEFAULT_JOIN_TIMEOUT:g}"
        return (f"{who}: not every process joined within {timeout} s ({JOIN_TIMEOUT_VARIABLE} sets the deadline); "
                f"jax's coordination service ended this process ({said})")
    where = f" (in {rpc.group(1).rsplit('/', 1)[-1]})" if rpc else ""
    return f"{who}: jax ended this process: {said}{where} (CKPT_DEBUG=1 shows jax's report)"
