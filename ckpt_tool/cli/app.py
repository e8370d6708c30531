"""The `ckpt` command group (click) and the one place errors become messages and exit codes.

Exit codes (docs/exit-codes.md's table): 0 ok; 1 the checkpoint has a problem (or a
finding, or a diff that differs); 2 a usage error: an option value, a rules
file, flags that conflict. A usage error prints as click prints its own
(usage line, "Try 'ckpt X --help'", "Error: ..."); a CkptError prints one
line on stderr; any other exception is a bug and prints one line too, unless
CKPT_DEBUG=1 asks for the traceback. With --json, a hard error also puts
{"ok": false, "error": {"code", "message", "path"}} on stdout.

main.py, the console script's module, starts and ends the process and imports this module only
for a command that needs click (`ckpt --version` and `ckpt --help` do not: main.py).
"""
from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import click

from .. import __version__, formats
from ..base.errors import CkptError, UsageError
from ..base.text import printable
from .exits import EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from .exits import debug as _debug

# command name -> ("module:attribute", short help). A command's module is
# imported only when that command runs, so `ckpt inspect` pays for nothing
# else, and `ckpt --help` lists the commands from here, importing none of
# them (their modules load numpy and tensorstore).
COMMANDS = {
    "inspect": ("ckpt_tool.cli.inspect_cmd:inspect_command",
                "Show leaves, dtypes, shapes, sizes, sharding (metadata only)."),
    "validate": ("ckpt_tool.cli.validate_cmd:validate_command",
                 "Check that a checkpoint is complete and consistent."),
    "diff": ("ckpt_tool.cli.diff_cmd:diff_command",
             "Compare two checkpoints' leaves and values; exit 1 if they differ."),
    "ls": ("ckpt_tool.cli.ls_cmd:ls_command",
           "List a run root's steps: status, size, the pointer's target."),
    "latest": ("ckpt_tool.cli.latest_cmd:latest_command",
               "Print the newest complete step of a run root that validates."),
    # (the formats it writes are in the top help's "Writes ..." line: listed here they no longer fit one line)
    "convert": ("ckpt_tool.cli.convert_cmd:convert_command",
                "Convert to another format, streaming, all or nothing."),
    "reshard": ("ckpt_tool.cli.reshard_cmd:reshard_command",
                f"Rewrite as an {formats.reshard_format().label} checkpoint laid out for a new device mesh."),
    "manifest": ("ckpt_tool.cli.manifest_cmd:manifest_group",
                 "Write or verify a checkpoint's sha256 integrity manifest."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        entry = COMMANDS.get(name)
        if entry is None:
            return None
        module, attr = entry[0].split(":")
        command = getattr(importlib.import_module(module), attr)
        command.short_help = entry[1]
        return command

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else ""
        if name and name not in COMMANDS and not name.startswith("-") and not ctx.resilient_parsing:
            import difflib  # only for a mistyped command's suggestion

            close = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.6)
            if close:
                ctx.fail(f"No such command {name!r}. Did you mean {close[0]!r}?")
        return super().resolve_command(ctx, args)

    def get_help(self, ctx: click.Context) -> str:
        # made when shown, from the registry as it is then: a test that registers a throwaway format
        # and imports this module meanwhile would otherwise leave its name in every later help
        self.help = _top_help()
        return super().get_help(ctx)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # from the table: click's default imports every command for its help line
        with formatter.section("Commands"):
            formatter.write_dl([(name, entry[1]) for name, entry in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def cli() -> None:
    """Look inside, check, convert and re-lay ML checkpoints."""


def _top_help() -> str:
    """`ckpt --help`'s text: the formats it reads and writes come from the registry."""
    from .helptext import formats_written, verbatim

    # a "\b" block, which click shows as it is: each line wrapped here to click's 80 columns
    reads = [line for f in formats.shown() for line in verbatim(f.reads or f.title, "  ")]
    writes = verbatim(f"Writes {formats_written()} (convert), {formats.reshard_format().label} for a new mesh "
                      "(reshard).", "")
    return "\n".join([
        "Look inside, check, convert and re-lay ML checkpoints.",
        "",
        "\b",
        "Reads (detected, local or gs:// s3:// file:// memory:// URLs):",
        *reads,
        *writes,
        "",
        "Exit codes: 0 ok, 1 the checkpoint has a problem (or a diff differs),",
        "2 usage error. `ckpt COMMAND --help` for each command.",
    ])


def _run(argv: list[str] | None) -> int:
    """Run the command; the exit code, with every error turned into one line (and JSON with --json)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with _saying_opened_steps(args):
            cli.main(args=args, prog_name="ckpt", standalone_mode=False)
    except SystemExit as exc:  # commands that decide their own exit code (validate, diff)
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_PROBLEM)
    except click.exceptions.Abort as exc:
        # click turns Ctrl-C (and SIGTERM, which ckpt raises as KeyboardInterrupt) into Abort
        word = "interrupted" if isinstance(exc.__context__, KeyboardInterrupt) else "aborted"
        click.echo(f"ckpt: {word}", err=True)
        _json_error(args, "interrupted", word)
        return EXIT_INTERRUPTED
    except click.ClickException as exc:
        exc.message = printable(exc.message)  # type: ignore[misc]  # (Final in click) an option value echoed back may hold a terminal escape
        exc.show()
        _json_error(args, "usage" if isinstance(exc, click.UsageError) else "error", exc.format_message())
        return exc.exit_code if exc.exit_code else EXIT_USAGE
    except UsageError as exc:
        if _debug():
            raise
        # the core's usage errors (--mesh data:2, --step abc, a bad rules
        # file) print exactly as click's own: usage line, help hint, Error:
        click.UsageError(printable(str(exc)), _command_context(args)).show()
        _json_error(args, exc.code, str(exc), exc.where)
        return EXIT_USAGE
    except CkptError as exc:
        if _debug():
            raise
        if exc.details and not _json_requested(args):
            for line in exc.details:
                click.echo(f"  {printable(line)}")
        click.echo(f"ckpt: error: {printable(str(exc))}", err=True)
        _json_error(args, exc.code, str(exc), exc.where, exc.details)
        return EXIT_PROBLEM
    except KeyboardInterrupt:
        click.echo("ckpt: interrupted", err=True)
        _json_error(args, "interrupted", "interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `ckpt inspect | head`: the reader went away; that is not an error
        sys.stderr.close()
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - the last line of defence against tracebacks
        if _debug():
            raise
        message = f"{type(exc).__name__}: {exc}"
        click.echo(f"ckpt: internal error: {printable(message)} (set CKPT_DEBUG=1 for the traceback)", err=True)
        _json_error(args, "internal", message)
        return EXIT_PROBLEM
    return EXIT_OK


def _saying_opened_steps(args: list[str]) -> Any:
    """The step of a run root a command opens (by default, or --step), said once: in the command's
    own output (inspect, validate, diff, convert), else one stderr line when it has finished; never
    beside an error line (cli/opened.py). Not for help texts: ops/runs.py imports the storage layer
    (numpy, tensorstore), which `ckpt --help` never loads."""
    import contextlib

    if not args or args[0] not in COMMANDS or "--help" in args or "-h" in args:
        return contextlib.nullcontext()
    from .opened import said_after

    return said_after()


def _command_context(args: list[str]) -> click.Context:
    """A context naming the command in `args` (for its usage line), else the group's."""
    group = click.Context(cli, info_name="ckpt")
    name = args[0] if args else None
    command = cli.get_command(group, name) if name in COMMANDS else None
    if command is not None:
        return click.Context(command, info_name=name, parent=group)
    return group


def _json_requested(args: list[str]) -> bool:
    """Whether the command line asks for --json, as the command itself parses it.

    The command line is parsed again leniently (no errors, no callbacks that
    act), so that `--filter --json` (a pattern) does not count, and an error
    raised before the command ran (a bad option value) still knows.
    """
    name = args[0] if args else None
    if name not in COMMANDS or "--json" not in args:
        return False
    try:
        group = click.Context(cli, info_name="ckpt", resilient_parsing=True)
        command = cli.get_command(group, name)
        if command is None:
            return False
        rest = list(args[1:])
        if isinstance(command, click.Group) and rest and rest[0] in command.commands:
            # a command group (`ckpt manifest verify ... --json`): its subcommand's own options
            group, command, name, rest = (click.Context(command, info_name=name, parent=group), command.commands[rest[0]],
                                          rest[0], rest[1:])
        ctx = command.make_context(name, rest, parent=group, resilient_parsing=True)
        return bool(ctx.params.get("as_json"))
    except Exception:  # noqa: BLE001 - a command line click cannot even parse leniently
        return False


def _json_error(args: list[str], code: str, message: str, path: str | None = None,
                details: tuple[str, ...] = ()) -> None:
    """With --json, the error as one JSON object on stdout (scripts read stdout; stderr has the line)."""
    if not _json_requested(args):
        return
    error: dict[str, Any] = {"code": code, "message": message, "path": path}
    if details:
        error["details"] = list(details)
    try:
        sys.stdout.write(json.dumps({"ok": False, "error": error}) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass


def render_top_help(width: int = 78) -> str:
    """`ckpt --help` as click renders it at `width` (78: a terminal of 80 columns or more, and a
    pipe), ending in a newline: what main.py's TOP_HELP holds, so that `ckpt --help` runs without
    click (tests/imports/test_startup_imports.py keeps the two equal)."""
    # (make_context: the group's context_settings, -h among the help options, apply)
    ctx = cli.make_context("ckpt", [], resilient_parsing=True, terminal_width=width)
    return ctx.get_help() + "\n"


def write_top_help() -> None:
    """Regenerate tophelp.py from click's rendering (after a change to the commands or the registry)."""
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tophelp.py")
    with open(path, "w") as f:
        f.write(TOP_HELP_MODULE.format(text=render_top_help()))


TOP_HELP_MODULE = '''"""`ckpt --help` as click renders it at 78 columns: main.py prints it without importing click.
Generated by app.write_top_help() (tests/imports/test_startup_imports.py checks it against click's rendering):
    .venv/bin/python -c "from ckpt_tool.cli.app import write_top_help; write_top_help()"
"""

TOP_HELP = {text!r}
'''
