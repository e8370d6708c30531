"""The `ckpt` command group and the one place errors become messages and exit codes.

Exit codes: 0 ok, 1 a problem with the input (or a finding), 2 usage.
A CkptError prints one line on stderr; any other exception is a bug and
prints one line too, unless CKPT_DEBUG=1 asks for the traceback.
"""
from __future__ import annotations

import gc
import importlib
import os
import sys

import click

from .. import __version__
from ..errors import CkptError

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2


# command name -> "module:attribute"; a command's module is imported only
# when that command runs, so `ckpt inspect` pays for nothing else
COMMANDS = {
    "inspect": "ckpt_tool.cli.inspect_cmd:inspect_command",
    "validate": "ckpt_tool.cli.validate_cmd:validate_command",
    "diff": "ckpt_tool.cli.diff_cmd:diff_command",
    "convert": "ckpt_tool.cli.convert_cmd:convert_command",
    "reshard": "ckpt_tool.cli.reshard_cmd:reshard_command",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def cli() -> None:
    """Look inside, check, re-lay and convert distributed checkpoints
    (Orbax / JAX and torch.distributed.checkpoint)."""


def _debug() -> bool:
    return os.environ.get("CKPT_DEBUG", "") not in ("", "0")


# commands that stream chunks through I/O threads
STREAMING = {"convert", "reshard", "validate", "diff"}


# allocations between cycle collections (CPython's default is 700)
GC_THRESHOLD = 100_000


# commands that only read: their process may end without interpreter teardown
READ_ONLY = {"inspect", "validate", "diff"}


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else None
    # ckpt does no linear algebra: without this, importing numpy starts an
    # OpenBLAS thread per core that spins for ~50 ms of CPU, which on a small
    # machine slows the command itself. (No effect once numpy is loaded.)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if command in STREAMING:
        # a process-wide allocator setting: the command line owns its process,
        # a notebook importing ckpt_tool does not
        from ..parallel import limit_allocator_growth

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
    _finish(_run(argv), fast=command in READ_ONLY and not _debug())


def _run(argv: list[str] | None) -> int:
    """Run the command; the exit code, with every error turned into one line."""
    try:
        cli.main(args=argv, prog_name="ckpt", standalone_mode=False)
    except SystemExit as exc:  # commands that decide their own exit code (validate, diff)
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_PROBLEM)
    except click.exceptions.Abort:
        click.echo("ckpt: aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code if exc.exit_code else EXIT_USAGE
    except CkptError as exc:
        if _debug():
            raise
        click.echo(f"ckpt: error: {exc}", err=True)
        return EXIT_PROBLEM
    except KeyboardInterrupt:
        click.echo("ckpt: interrupted", err=True)
        return 130
    except BrokenPipeError:
        # `ckpt inspect | head`: the reader went away; that is not an error
        sys.stderr.close()
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - the last line of defence against tracebacks
        if _debug():
            raise
        click.echo(
            f"ckpt: internal error: {type(exc).__name__}: {exc} (set CKPT_DEBUG=1 for the traceback)",
            err=True,
        )
        return EXIT_PROBLEM
    return EXIT_OK


def _finish(code: int, *, fast: bool) -> None:
    if not fast:
        sys.exit(code)
    # Read-only commands have nothing left to write: skip the interpreter's
    # teardown (tensorstore's thread pools and caches take ~30 ms to unwind),
    # which is a tenth of an inspect of a 3,000-leaf checkpoint.
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass
    try:
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        pass
    os._exit(code)
