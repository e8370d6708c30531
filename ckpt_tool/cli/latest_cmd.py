"""`ckpt latest ROOT`: the path of the step a launcher should resume from, or exit 1."""
from __future__ import annotations

import sys

import click

from ..runs import latest
from ..text import printable
from .helptext import run_roots
from .render import Output


# the run roots it knows come from their table (helptext), so that the list cannot go stale
@click.command("latest", help=(
    f"Print the path of the newest step of the run root ROOT ({run_roots()}) that is complete by its "
    "writer's rule and passes validate (shallow; --deep decodes it too): what a training launcher resumes "
    "from. Steps passed over (in progress, incomplete, failing validate, the pointer file's target included) "
    "are named on stderr. Exit 1, with one line, when no step qualifies."))
@click.argument("root")
@click.option("--deep", is_flag=True, help="Also decode every chunk of the step (validate --deep) before naming it.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def latest_command(root: str, deep: bool, as_json: bool) -> None:
    found = latest(root, deep=deep)
    out = Output(json_mode=as_json)
    if not as_json and found.path is not None:
        for s in found.skipped:
            pointed = f" (named by {found.pointer_file})" if s["pointer"] else ""
            click.echo(printable(f"ckpt: latest: skipped {s['name']}{pointed}: {s['status']}: {s['reason']}"), err=True)
        if found.pointer_problem:
            click.echo(printable(f"ckpt: latest: {found.pointer_file}: {found.pointer_problem}"), err=True)
    if as_json:
        out.json(found.to_json())
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
    sys.exit(0 if found.path is not None else 1)
