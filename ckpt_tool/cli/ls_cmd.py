"""`ckpt ls ROOT`: the steps of a run root, their status by their writer's rule, one row each."""
from __future__ import annotations

import datetime as _dt
import sys

import click

from ..ops import destination as output
from ..base.errors import NotFoundError
from ..ops.destination import Temporary
from ..ops.runs import RunListing, StepRow, list_run
from ..base.text import printable
from .helptext import run_roots
from .render import Output, esc, human_bytes, plural

_COLOURS = {"committed": "green", "incomplete": "red", "in-progress": "yellow"}


# the run roots it knows come from their table (helptext), so that the list cannot go stale
@click.command("ls", help=(
    f"List the steps of the run root ROOT ({run_roots()}): step, format, status (committed, incomplete, "
    "in-progress), size, file count, modification time, and whether the framework's pointer file (Megatron's "
    "tracker, DeepSpeed's latest) agrees. From one listing, plus validate's cheap check of each committed step "
    "(a few small metadata reads, in flight together; no array data): a step that fails it is named below the "
    "table. Exit 1 when --check finds a committed step that fails."))
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--check/--no-check", default=None,
              help="--check: run validate's shallow checks on every step, in a column (reads metadata); "
                   "--no-check: the listing alone (not even the cheap check of committed steps).")
@click.option("--deep", is_flag=True, help="With --check: validate --deep every step (decodes every chunk).")
@click.option("--sizes/--no-sizes", default=None,
              help="Sum each step's file sizes (default: on local roots; on S3/GCS each file's size is a request).")
def ls_command(root: str, as_json: bool, check: bool | None, deep: bool, sizes: bool | None) -> None:
    if deep and not check:
        raise click.UsageError("--deep applies to --check: add --check")
    try:
        # (without --check: every committed step gets validate's cheap check, as validate of a root
        # gives the steps it does not open; a step failing it is named below the table)
        listing = list_run(root, check=bool(check), deep=deep, sizes=sizes, screen=check is None)
    except NotFoundError:
        # not a run root: still the place to find what a killed convert/reshard left beside its DST
        stale = output.stale_outputs(root)
        if not stale:
            raise
        _stale_only(Output(json_mode=as_json), root, stale)
        sys.exit(0)
    stale = output.stale_outputs(root)
    # a save in progress failing is what it is; a committed step failing is the problem
    failed = bool(check) and any(s.check is not None and not s.check["ok"] and s.status == "committed" for s in listing.steps)
    out = Output(json_mode=as_json)
    if as_json:
        # "ok" as the exit status says
        out.json({"ok": not failed, **listing.to_json(), "stale_temporaries": [t.to_json() for t in stale]})
    else:
        _table(out, listing, bool(check))
        _stale_lines(out, stale)
    sys.exit(1 if failed else 0)


def _stale_only(out: Output, root: str, stale: list[Temporary]) -> None:
    """A directory that is not a run root, holding stale temporary outputs."""
    if out.json_mode:
        out.json({"ok": True, "root": root, "layout": None, "title": None, "pointer": None, "steps": [],
                  "stale_temporaries": [t.to_json() for t in stale]})
        return
    out.line(f"[bold]{esc(root)}[/bold]  (not a run root; {plural(len(stale), 'stale temporary output')})")
    _stale_lines(out, stale)


def _stale_lines(out: Output, stale: list[Temporary]) -> None:
    """Each temporary output of a convert/reshard that no longer runs: its size, owner, and the
    command that removes it (the next convert or reshard to its DST removes it too)."""
    if not stale:
        return
    n = len(stale)
    out.line(f"[yellow]{plural(n, 'stale temporary output')}[/yellow] (left by a ckpt convert or reshard that no longer "
             f"runs; the next run to the same destination removes {'it' if n == 1 else 'them'} too):")
    for t in stale:
        owner = f"{t.owner.describe()}, {t.why()}" if t.owner is not None else t.why()
        out.line(f"  {esc(t.name)}  {human_bytes(t.nbytes)}  ({esc(owner)})")
        out.line(f"    {esc(output.remove_command(t.path))}")


def _when(t: float | None) -> str:
    return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t is not None else "-"


def _pointer_cell(step: StepRow) -> str:
    if step.pointer:
        return "<- pointer" + ("" if step.pointer_agrees else " (disagrees)")
    return "beyond pointer" if step.pointer_agrees is False else ""


def _table(out: Output, listing: RunListing, check: bool) -> None:
    out.line(f"[bold]{esc(listing.root)}[/bold]  ({esc(listing.layout.title)}, {plural(len(listing.steps), 'step')})")
    head = ["step", "name", "format", "status", "size", "files", "modified", "pointer"] + (["check"] if check else [])
    rows = []
    for s in listing.steps:
        cells = [
            "-" if s.step is None else str(s.step), s.name, s.format, s.status,
            "-" if s.size is None else human_bytes(s.size), str(s.files), _when(s.mtime), _pointer_cell(s),
        ]
        if check:
            c = s.check or {}
            cells.append("ok" if c.get("ok") else f"FAILED: {c.get('first')}")
        # measured as shown: a name's escapes (\n, \x1b) are wider than the characters they stand for
        rows.append([printable(c) for c in cells])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out.line("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    for s, cells in zip(listing.steps, rows):
        text = "  ".join(esc(c.ljust(w)) for c, w in zip(cells, widths)).rstrip()
        colour = _COLOURS.get(s.status)
        status = esc(s.status.ljust(widths[3]))
        if colour and status in text:
            text = text.replace(status, f"[{colour}]{status}[/{colour}]", 1)
        out.line(text)
    for s in listing.steps:
        if s.reason:
            out.line(f"  {esc(s.name)}: {esc(s.reason)}")
        if s.fails and not check:  # (--check says it in its column)
            step = s.name if s.step is None else str(s.step)
            # one line: the finding's first clause where it lists much (validate prints it whole)
            first = s.fails if len(s.fails) <= 200 else s.fails.split("; ")[0][:200] + " ..."
            out.line(f"  {esc(s.name)}: [red]fails validate[/red] (`ckpt latest` passes over it; "
                     f"`ckpt validate {esc(listing.root)} --step {esc(step)}` for every finding): {esc(first)}")
    if listing.pointer_file is not None:
        said = listing.pointer_problem or f"names {listing.pointer_names}"
        out.line(f"{esc(listing.pointer_file)}: {esc(said)}")
