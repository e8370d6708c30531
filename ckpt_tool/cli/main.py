"""The `ckpt` command group and the one place errors become messages and exit codes.

Exit codes: 0 ok, 1 a problem with the input (or a finding), 2 usage.
A CkptError prints one line on stderr; any other exception is a bug and
prints one line too, unless CKPT_DEBUG=1 asks for the traceback.
"""
from __future__ import annotations

import os
import sys

import click

from .. import __version__
from ..errors import CkptError

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def cli() -> None:
    """Look inside, check, re-lay and convert distributed checkpoints
    (Orbax / JAX and torch.distributed.checkpoint)."""


def _register() -> None:
    # each command lives in its own module; importing them is cheap (no jax, no torch)
    from .diff_cmd import diff_command
    from .inspect_cmd import inspect_command
    from .validate_cmd import validate_command

    cli.add_command(inspect_command)
    cli.add_command(validate_command)
    cli.add_command(diff_command)


_register()


def _debug() -> bool:
    return os.environ.get("CKPT_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        cli.main(args=argv, prog_name="ckpt", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("ckpt: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code if exc.exit_code else EXIT_USAGE)
    except CkptError as exc:
        if _debug():
            raise
        click.echo(f"ckpt: error: {exc}", err=True)
        sys.exit(EXIT_PROBLEM)
    except KeyboardInterrupt:
        click.echo("ckpt: interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        # `ckpt inspect | head`: the reader went away; that is not an error
        sys.stderr.close()
        sys.exit(EXIT_OK)
    except Exception as exc:  # noqa: BLE001 - the last line of defence against tracebacks
        if _debug():
            raise
        click.echo(
            f"ckpt: internal error: {type(exc).__name__}: {exc} (set CKPT_DEBUG=1 for the traceback)",
            err=True,
        )
        sys.exit(EXIT_PROBLEM)
    sys.exit(EXIT_OK)
