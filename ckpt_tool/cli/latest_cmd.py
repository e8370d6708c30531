"""`ckpt latest ROOT`: the path of the step a launcher should resume from, or exit 1."""
from __future__ import annotations

import sys

import click

from ..ops.runs import latest
from ..base.text import printable
from .helptext import run_roots
from .render import Output


# the run roots it knows come from their table (helptext), so that the list cannot go stale
@click.command("latest", help=(
    f"Print the path of the newest step of the run root ROOT ({run_roots()}) that is complete by its "
    "writer's rule and passes validate (shallow; --deep decodes it too): what a training launcher resumes "
    "from. Steps passed over (in progress, incomplete, failing validate, the pointer file's target included) "
    "are named on stderr; where the step printed is not the one the framework would resume from by itself "
    "(a broken pointer, a torn or damaged newest step), stderr says what the framework would pick, why that "
    "fails, and that the printed step must be passed explicitly. Exit 1, with one line, when no step "
    "qualifies (and with --strict, when the framework would not pick the printed step itself)."))
@click.argument("root")
@click.option("--deep", is_flag=True, help="Also decode every chunk of the step (validate --deep) before naming it.")
@click.option("--strict", is_flag=True,
              help="Exit 1 when the framework would not resume from the printed step by itself (it must be passed explicitly).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def latest_command(root: str, deep: bool, strict: bool, as_json: bool) -> None:
    found = latest(root, deep=deep)
    out = Output(json_mode=as_json)
    refused = strict and found.differs
    framework = found.framework_line()
    if not as_json and found.path is not None and not refused:
        for s in found.skipped:
            pointed = f" (named by {found.pointer_file})" if s["pointer"] else ""
            click.echo(printable(f"ckpt: latest: skipped {s['name']}{pointed}: {s['status']}: {s['reason']}"), err=True)
        if found.pointer_problem:
            click.echo(printable(f"ckpt: latest: {found.pointer_file}: {found.pointer_problem}"), err=True)
        if framework is not None:
            click.echo(printable(f"ckpt: latest: {framework}"), err=True)
    if as_json:
        doc = found.to_json()
        out.json({**doc, "ok": doc["ok"] and not refused})  # "ok" as the exit status says
    elif refused:
        # --strict: the one error line, and no path a script could resume from by mistake
        click.echo(printable(f"ckpt: error: {found.root}: {framework} (--strict)"), err=True)
    elif found.path is not None:
        # escaped like every shown name: a path holding a newline must not become two paths
        out.text_line(found.path)
    else:
        # one line: the newest step passed over says why
        why = ""
        if found.skipped:
            s = found.skipped[0]
            why = f" ({len(found.skipped)} passed over; newest: {s['name']}: {s['status']}: {s['reason']})"
        click.echo(printable(f"ckpt: error: {found.root}: no step that is complete and passes validate{why}"), err=True)
    sys.exit(0 if found.path is not None and not refused else 1)
