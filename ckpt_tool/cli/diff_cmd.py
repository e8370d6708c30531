"""`ckpt diff A B`: exit 0 when the two checkpoints hold the same leaves (and values), 1 otherwise.

Either side may be an `ckpt inspect --json` document instead of a
checkpoint (the structure CI expects): a local regular file holding JSON.
"""
from __future__ import annotations

import sys

import click

from ..base.parallel import default_workers

from .. import formats
from ..ops.diff import diff_checkpoints
from ..core.model import Checkpoint
from ..ops.runs import OpenedStep, resolve_step
from ..ops.structure import is_inspect_json_file, load_structure
from .helptext import formats_read
from .opened import take as take_opened
from .options import memory_option, weights_option
from .progress import progress_for
from .render import Output, esc, plural


# the formats it reads come from the registry (helptext), so that the list cannot go stale
@click.command("diff", help=(
    f"Compare checkpoints A and B (any formats ckpt reads, alike or not: {formats_read()}) by their keys: "
    "leaves only in one, changed kind, shape or dtype, and with --values the max absolute and relative "
    "difference per leaf. Exit 1 on any difference.\n\n"
    "Two steps of one run: `ckpt diff ROOT --step-a N --step-b M` (any run root `ckpt ls` lists).\n\n"
    "A or B may be a file written by `ckpt inspect CKPT --json` (the expected structure): then keys, kinds, "
    "shapes and dtypes are checked against it, without a reference checkpoint."))
@click.argument("a")
@click.argument("b", required=False)
@click.option("--values", is_flag=True, help="Also compare array data chunk by chunk (bounded memory) and decoded values (not with an inspect JSON side).")
@click.option("--rtol", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Relative tolerance for --values.")
@click.option("--atol", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Absolute tolerance for --values.")
@click.option("--rename", multiple=True, metavar="REGEX=REPL", help="Rename A's '/'-joined keys before matching (repeatable).")
@click.option("--filter", "pattern", metavar="GLOB", help="Compare only leaves whose (renamed) '/'-joined keys or dotted names match, e.g. 'params/**' or 'model.layers.0.*' (as for inspect --filter); matching no leaf is an error.")
@click.option("--cast-ok", is_flag=True, help="A floating leaf whose dtype differs (e.g. after convert --dtype bfloat16) is no difference: with --values it is compared by value in float64 within --atol/--rtol; the dtype change is reported once.")
@click.option("--layout", is_flag=True, help="Also compare each array's chunk shape, chunk count and recorded sharding.")
@click.option("--step", help="Step of whichever side is a run root (both, when both are checkpoints): a number, a step's name or 'latest'.")
@click.option("--step-a", help="Step of A when A is a run root (any framework `ckpt ls` lists).")
@click.option("--step-b", help="Step of B when B is a run root; without B, of A: two steps of one run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--workers", type=click.IntRange(min=1), default=default_workers, show_default="min(4, 2 x cores)", help="Chunks read and compared in parallel.")
@memory_option
@weights_option
def diff_command(
    a: str, b: str | None, values: bool, rtol: float, atol: float, rename: tuple[str, ...], pattern: str | None,
    layout: bool, step: str | None, step_a: str | None, step_b: str | None, as_json: bool, workers: int,
    memory: int, cast_ok: bool, weights: str | None,
) -> None:
    if step is not None and (step_a is not None or step_b is not None):
        raise click.UsageError("--step applies to both sides; give it or --step-a/--step-b, not both")
    if b is None:
        if step_a is None or step_b is None:
            raise click.UsageError("B is missing: give B, or --step-a and --step-b to compare two steps of the run root A")
        b = a  # two steps of one run
    json_a, json_b = is_inspect_json_file(a), is_inspect_json_file(b)
    if step is not None and json_a and json_b:
        raise click.UsageError("--step: both A and B are inspect JSON documents; there is no checkpoint to pick a step of")
    from ..machinery.torch_save.pickle_budget import memory_budget

    # (both sides: each must take it; their pickles are read here, within --memory as diff's values are)
    with formats.read_options(weights=weights), memory_budget(memory):
        ck_a, opened_a = _open_side("A", a, json_a, step_a if step is None else step, explicit=step_a is not None,
                                    values=values)
        ck_b, opened_b = _open_side("B", b, json_b, step_b if step is None else step, explicit=step_b is not None,
                                    values=values)
    out = Output(json_mode=as_json)
    # the bytes compared so far, on a terminal (never on a pipe or with --json)
    with progress_for(out, "comparing", show=values) as progress:
        report = diff_checkpoints(
            ck_a, ck_b, values=values, rtol=rtol, atol=atol, rename=list(rename), workers=workers,
            layout=layout, pattern=pattern, memory=memory, cast_ok=cast_ok,
            steps=(step_a if step is None else step, step_b if step is None else step), progress=progress,
        )
    if as_json:
        take_opened()  # said here, per side (not again on stderr)
        # "ok" as the exit status says: 0 when the same; "opened": each run root's step compared
        out.json({"ok": report.same, **report.to_json(),
                  "opened": {"a": opened_a.to_json() if opened_a else None,
                             "b": opened_b.to_json() if opened_b else None}})
    else:
        # (the step of a run root compared: one stderr line once the diff is done, cli/opened.py;
        # stdout stays the differences and the verdict)
        if report.dotted:
            first = report.dotted[0]
            out.line(f"[cyan]{'dotted':8}[/cyan] matched {plural(len(report.dotted), 'leaf', 'leaves')} by dotted name "
                     f"(keys split at other dots: {esc(first.a)} in A, {esc(first.b)} in B)")
        for o in report.optimizer:  # optimizer state keyed by ids on one side, by FQNs on the other
            if o.note:
                out.line(f"[yellow]{'optim':8}[/yellow] {esc(o.where)}: {esc(o.note)}")
            else:
                how = (f" ({esc(o.example[0])} in A is {esc(o.example[1])} in B)" if o.example else "")
                out.line(f"[cyan]{'optim':8}[/cyan] paired {plural(o.paired, 'optimizer state leaf', 'optimizer state leaves')} "
                         f"through {esc(o.where)}: keyed by {o.a} in A, by {o.b} in B{how}")
        for t in report.tied:
            out.line(f"[cyan]{'tied':8}[/cyan] {esc(t.path)}: only in {t.side.upper()}, the same tensor as "
                     f"{esc(t.same_as)} (compared); {'B' if t.side == 'a' else 'A'} stores it once")
        for d in report.differences:
            colour = {"only_a": "red", "only_b": "green"}.get(d.kind, "yellow")
            out.line(f"[{colour}]{d.kind:8}[/{colour}] {esc(d.path)}: {esc(d.message)}")
        if report.only_casts:  # a `convert --dtype` output against its source: what accepts it, once
            pairs = "; ".join(f"{plural(len(c.paths), 'floating leaf', 'floating leaves')} {c.a} in A, {c.b} in B"
                              for c in report.only_casts)
            out.line(f"[cyan]{'cast?':8}[/cyan] only dtypes differ ({pairs}), as after convert --dtype: "
                     "--cast-ok accepts the cast, and with --values --atol/--rtol compares the values")
        for c in report.casts:
            n = len(c.paths)
            how = "compared by value in float64" if values else "values not compared (add --values)"
            out.line(f"[cyan]{'cast':8}[/cyan] {plural(n, 'leaf', 'leaves')} {c.a} in A, {c.b} in B "
                     f"(--cast-ok): {how}")
        # "1 leaf (...) matches", "3 leaves and values match": the count, its noun and the verb agree
        one = report.compared == 1
        if values:
            what = " and its values match" if one else " and values match"
        else:
            what = " (structure, shapes, dtypes" + (", chunks, shardings)" if layout else ")") + (" matches" if one else " match")
        if report.same:
            out.line(f"[bold green]same[/bold green]: {plural(report.compared, 'leaf', 'leaves')}{what}")
        else:
            out.line(f"[bold red]different[/bold red]: {plural(len(report.differences), 'difference')} in {plural(report.compared, 'common leaf', 'common leaves')}")
    sys.exit(0 if report.same else 1)


def _open_side(side: str, path: str, is_json: bool, step: str | None, *, explicit: bool,
               values: bool) -> tuple[Checkpoint, OpenedStep | None]:
    """The checkpoint at `path`, or the structure the inspect JSON file there records; and the step
    of a run root opened (--step, else the one its framework resumes from; None: no run root)."""
    if not is_json:
        # a run root of any framework: the run layouts' table picks the step
        path, reader_step, opened = resolve_step(path, step)
        # (what its reader parsed is kept for diff's check that the side is whole: diff.check_source_complete)
        return formats.open_checkpoint(path, step=reader_step, keep_parsed=True), opened
    # usage errors first: they are about the command line, whatever the file holds
    if values:
        raise click.UsageError(
            f"--values: {side} ({path}) is an inspect JSON document, which holds no array data; "
            "compare values against a checkpoint, or drop --values to check the structure"
        )
    if explicit:
        raise click.UsageError(
            f"--step-{side.lower()}: {side} ({path}) is an inspect JSON document, not a CheckpointManager root; "
            "it records one step already"
        )
    return load_structure(path), None
