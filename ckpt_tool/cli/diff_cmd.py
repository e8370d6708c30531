"""`ckpt diff A B`: exit 0 when the two checkpoints hold the same leaves (and values), 1 otherwise."""
from __future__ import annotations

import sys

import click

from ..parallel import default_workers

from .. import open as open_checkpoint
from ..diff import diff_checkpoints
from .render import Output, esc


@click.command("diff")
@click.argument("a")
@click.argument("b")
@click.option("--values", is_flag=True, help="Also compare array data chunk by chunk (bounded memory) and decoded values.")
@click.option("--rtol", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Relative tolerance for --values.")
@click.option("--atol", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Absolute tolerance for --values.")
@click.option("--rename", multiple=True, metavar="REGEX=REPL", help="Rename A's '/'-joined keys before matching (repeatable).")
@click.option("--step-a", help="Step of A when A is a CheckpointManager root.")
@click.option("--step-b", help="Step of B when B is a CheckpointManager root.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--workers", type=click.IntRange(min=1), default=default_workers, show_default="min(4, 2 x cores)", help="Leaves compared in parallel.")
def diff_command(
    a: str, b: str, values: bool, rtol: float, atol: float, rename: tuple[str, ...],
    step_a: str | None, step_b: str | None, as_json: bool, workers: int,
) -> None:
    """Compare checkpoints A and B (either format) by their keys: leaves only in
    one, changed shape or dtype, and with --values the max absolute and
    relative difference per leaf. Exit 1 on any difference."""
    ck_a = open_checkpoint(a, step=step_a)
    ck_b = open_checkpoint(b, step=step_b)
    report = diff_checkpoints(ck_a, ck_b, values=values, rtol=rtol, atol=atol, rename=list(rename), workers=workers)
    out = Output(json_mode=as_json)
    if as_json:
        out.json(report.to_json())
    else:
        for d in report.differences:
            colour = {"only_a": "red", "only_b": "green"}.get(d.kind, "yellow")
            out.line(f"[{colour}]{d.kind:7}[/{colour}] {esc(d.path)}: {esc(d.message)}")
        what = "leaves and values" if values else "leaves (structure, shapes, dtypes)"
        if report.same:
            out.line(f"[bold green]same[/bold green]: {report.compared} {what} match")
        else:
            out.line(f"[bold red]different[/bold red]: {len(report.differences)} difference(s) in {report.compared} common leaves")
    sys.exit(0 if report.same else 1)
