"""The `ckpt` console script: starts the process, runs the command (app.py), ends the process.

Kept light: `ckpt --version` and `ckpt --help` are answered here without importing click or any
command (see _without_click); every other command line goes to app.py, the click group and the
one place errors become messages and exit codes (docs/exit-codes.md). The process then ends
without the interpreter's teardown (see _teardown_needless). Names of app.py (cli, COMMANDS,
_run, ...) are still reachable from here, for the callers and tests that import them from here.
"""
from __future__ import annotations

import gc
import os
import sys

from .exits import EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE  # noqa: F401 - (importers of main's names)
from .exits import debug as _debug


# commands that stream chunks through I/O threads
STREAMING = {"convert", "reshard", "validate", "diff"}


# allocations between cycle collections (CPython's default is 700)
GC_THRESHOLD = 100_000


# commands that only read: their process may end without interpreter teardown even where jax or
# torch is loaded (nothing to shut down with other processes: they wrote nothing)
READ_ONLY = {"inspect", "validate", "diff", "ls", "latest"}
# the libraries whose distributed runtime shuts down at exit (distributed.LIBRARIES' packages)
DISTRIBUTED_PACKAGES = ("jax", "torch")
# commands that may run as one of several processes (distributed.join), and what asks for that:
# flags, or the variables distributed.process_spec reads (a one-process run looks no further)
MULTI_PROCESS = {"convert", "reshard"}
PROCESS_FLAGS = ("--coordinator", "--num-processes", "--process-id")
SUPERVISOR_FD_VARIABLE = "CKPT_SUPERVISOR_FD"  # cli/supervise.py's (importing it costs the commands that need none)
PROCESS_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "RANK", "WORLD_SIZE",
                     "SLURM_STEP_ID")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else None
    # ckpt does no linear algebra: without this, importing numpy starts an
    # OpenBLAS thread per core that spins for ~50 ms of CPU, which on a small
    # machine slows the command itself. (No effect once numpy is loaded.)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if command in MULTI_PROCESS:
        # through jax, the command runs in a child under a small supervisor (cli/supervise.py: jaxlib
        # aborts a process whose process 0 is gone; the supervisor says so in one line)
        if SUPERVISOR_FD_VARIABLE in os.environ:
            from .supervise import route_native_output

            route_native_output()  # this process is that child
        elif _asks_for_processes(args):
            from .supervise import supervise

            supervised = supervise(args)
            if supervised is not None:
                _finish(supervised, fast=True)
    if command in STREAMING:
        # a process-wide allocator setting: the command line owns its process,
        # a notebook importing ckpt_tool does not
        from ..base.parallel import limit_allocator_growth

        limit_allocator_growth()
    # Reading metadata allocates tens of thousands of small, acyclic objects
    # per thousand leaves; at the default threshold (700) the cycle collector
    # runs hundreds of times over the growing heap, a third of inspect's read
    # time. A higher threshold still collects, just far less often. inspect
    # reads metadata only and exits: it needs no cycle collection at all.
    if command == "inspect":
        gc.disable()
    else:
        gc.set_threshold(GC_THRESHOLD)
    quick = _without_click(args)
    if quick is not None:
        code = quick
    else:
        from .app import _run

        code = _run(argv)
    _finish(code, fast=_teardown_needless(command))


def _asks_for_processes(args: list[str]) -> bool:
    """Whether ARGS or the environment may ask for a multi-process run (cheap: no import)."""
    return any(a.partition("=")[0] in PROCESS_FLAGS for a in args) or any(v in os.environ for v in PROCESS_VARIABLES)


def _without_click(args: list[str]) -> int | None:
    """`ckpt --version` and `ckpt --help` answered here, as click answers them, without importing
    click, the registry or the commands (issue 46: within 1.5x of a bare `python -c pass`, where
    importing click alone doubles it); the exit code, or None for click to answer.

    The help is click's own rendering at 78 columns (tophelp.py, kept equal to it by a test),
    which click uses on a terminal of 80 columns or more and in a pipe; a narrower terminal is
    click's to wrap."""
    if args == ["--version"]:
        from ..base.version import __version__

        sys.stdout.write(f"ckpt, version {__version__}\n")
        return EXIT_OK
    if args in (["--help"], ["-h"]) and _columns() >= 80:
        from .tophelp import TOP_HELP

        sys.stdout.write(TOP_HELP)
        return EXIT_OK
    return None


def _columns() -> int:
    """The terminal's width as click's help formatter sees it (shutil.get_terminal_size's rule,
    without importing shutil)."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns if columns > 0 else 80


def _teardown_needless(command: str | None) -> bool:
    """Whether the process may end without the interpreter's teardown once the command returned.

    Every command, and `ckpt --help`, `--version` or a usage error (command None or not a command),
    has by then printed what it prints; a writing command has fsynced and committed its output (an
    object store's uploads included) or removed it. What is left is freeing buffers, thread pools
    and modules, and atexit work: 0.04 s of a convert here, tensorstore's pools ~30 ms of an
    inspect, more on a TPU VM's gVisor kernel, where every unmapping is a call into the sandbox.
    Not where jax or torch is loaded by a command that writes: jax.distributed and
    torch.distributed shut down with the other processes at exit. Not under CKPT_DEBUG, for
    tracebacks at exit. (The library is unaffected: only the console script's main() ends so.)
    """
    if _debug():
        return False
    if command in READ_ONLY:
        return True
    # the packages of distributed.LIBRARIES, named here: importing that module (socket, json, ...)
    # would cost `ckpt --version` more than the teardown it saves
    return not any(package in sys.modules for package in DISTRIBUTED_PACKAGES)


def _finish(code: int, *, fast: bool) -> None:
    if not fast:
        sys.exit(code)
    # Skip the interpreter's teardown (see _teardown_needless): tensorstore's
    # thread pools and caches take ~30 ms to unwind, a tenth of an inspect of
    # a 3,000-leaf checkpoint. What the interpreter's end would still do that
    # matters is done here: the buffered output is flushed, and a flush that
    # fails fails the process (the interpreter's end says so and exits 120;
    # os._exit would end 0 with the output cut short, on a full disk say).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # the reader went away (`| head`), or the stream is closed: not an error
        except OSError as exc:
            if stream is sys.stdout:
                try:
                    sys.stderr.write(f"ckpt: error: cannot write the output: {exc.strerror or exc}\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
            code = code or EXIT_PROBLEM
    os._exit(code)


def __getattr__(name: str) -> object:
    # app.py's names (cli, COMMANDS, LazyGroup, _run, _json_requested, ...), loaded on first use
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import app

    try:
        return getattr(app, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
