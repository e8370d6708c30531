"""The C++ libraries' own log lines, dropped from stderr once a remote store is opened.

tensorstore's dependencies log to file descriptor 2 themselves: the AWS C
SDK when its default credentials chain finds no ~/.aws files or no IMDS,
tensorstore when no gcloud credentials file exists (an anonymous read of a
public bucket prints it too). None of it can be turned off from Python:
abseil's thresholds are not exposed by the tensorstore module, and neither
TENSORSTORE_VERBOSE_LOGGING nor GRPC_VERBOSITY touches these lines. So once
a remote store is opened, fd 2 becomes a pipe whose reader drops abseil's
lines and passes everything else on, and Python's sys.stderr writes to the
original stream directly (ordering and terminal detection unchanged).

A process-wide change to file descriptors, with nothing to do with any one
store: it sits apart from remote.py, which only asks for it (quiet_native_logs).
"""
from __future__ import annotations

import io
import os
import re
import sys
import threading


def _debug() -> bool:
    return os.environ.get("CKPT_DEBUG", "") not in ("", "0")


# abseil's prefix: severity, MMDD, time, thread id, file:line]
_NATIVE_LOG_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]\n]*\] ")
_NATIVE_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_NATIVE_LOG_START = re.compile(rb"^(?:[IWEF](?:\d{0,4}(?: [\d:.]*(?: +\d*(?: [^\]\n]*)?)?)?)?)$")
_native_quiet = False
_native_quiet_lock = threading.Lock()


def _is_native_log(line: bytes) -> bool:
    return bool(_NATIVE_LOG_LINE.match(line)) or line.startswith(_NATIVE_PREAMBLE)


def _forward_stderr(read_fd: int, write_fd: int) -> None:
    """Copy the pipe behind fd 2 to the real stderr, without the C++ libraries' log lines."""
    pending = b""
    while True:
        try:
            chunk = os.read(read_fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        out = [line + b"\n" for line in lines if not _is_native_log(line)]
        # a partial line (a progress bar's \r update) goes on at once unless it may be a log line's start
        if pending and not (_NATIVE_LOG_START.match(pending) or _NATIVE_PREAMBLE.startswith(pending)):
            out.append(pending)
            pending = b""
        _write_all(write_fd, b"".join(out))
    if pending and not _is_native_log(pending):
        _write_all(write_fd, pending)
    os.close(read_fd)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except OSError:
            return  # the reader of stderr went away: nothing more to show


def leave_native_logs_to_supervisor() -> None:
    """fd 2 is a pipe that ckpt's supervisor reads (cli/supervise.py): it drops these lines itself, and
    must see jaxlib's fatal report to say in one line why the process ended. Never redirect it."""
    global _native_quiet
    with _native_quiet_lock:
        _native_quiet = True


def quiet_native_logs() -> None:
    """Drop the C++ libraries' log lines from file descriptor 2 for the rest of the process.

    Called when the first remote store is opened (local runs never pay for
    it); a no-op with CKPT_DEBUG=1, which keeps every line, or where fd 2
    cannot be redirected. Everything that is not an abseil-formatted line
    still reaches stderr.
    """
    global _native_quiet
    if _native_quiet or _debug():
        return
    with _native_quiet_lock:
        if _native_quiet:
            return
        _native_quiet = True
        stream = sys.stderr
        try:
            rebind = stream is not None and stream.fileno() == 2
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            rebind = False  # a notebook's or a test runner's stream: not fd 2, leave it
        try:
            if stream is not None:
                stream.flush()
            real = os.dup(2)
            read_fd, write_fd = os.pipe()
        except (OSError, ValueError):
            return
        if rebind:
            # Python's own stderr writes bypass the pipe: same order, same terminal
            sys.stderr = io.TextIOWrapper(
                io.FileIO(real, "w", closefd=False), encoding=stream.encoding, errors=stream.errors,
                line_buffering=True, write_through=True,
            )
            import faulthandler

            if faulthandler.is_enabled():  # a crash report must not depend on the reader thread
                faulthandler.enable(file=sys.stderr)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        threading.Thread(target=_forward_stderr, args=(read_fd, real), name="ckpt-stderr", daemon=True).start()
