"""`ckpt validate PATH`: exit 0 when the checkpoint is complete and consistent, 1 with every finding when not."""
from __future__ import annotations

import sys
from collections import defaultdict

import click

from .. import formats
from ..base.parallel import default_workers

from ..base.findings import ERROR
from ..ops.validate import ValidationReport, validate_checkpoint
from . import opened as opened_step
from .helptext import formats_read
from .options import memory_option, weights_option
from .progress import progress_for
from ..base.text import printable
from .render import Output, esc, human_bytes, plural


# the formats it reads come from the registry (helptext), so that the list cannot go stale
@click.command("validate", help=(
    f"Check that the checkpoint at PATH ({formats_read()}, detected) is complete and consistent: commit "
    "markers, metadata, every array and chunk present, files long enough, DCP chunks covering each tensor, "
    "no unsafe pickle. Collects every finding.\n\n"
    "Exit 0 when there is no error (warnings allowed unless --strict), 1 otherwise."))
@click.argument("path")
@click.option("--deep", is_flag=True, help="Also read and decode every chunk; report NaN/Inf per float leaf.")
@click.option("--step", help="Run root (any framework `ckpt ls` lists): a step number, a step's name, 'latest' (the default: the step the framework resumes from; the other steps' states are warnings), or 'all' (every step).")
@click.option("--strict", is_flag=True, help="Count warnings as errors.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--format", "fmt", type=click.Choice(["human", "github"]), default="human",
    help="github: ::error / ::warning annotation lines for CI logs.",
)
@click.option("--workers", type=click.IntRange(min=1), default=default_workers, show_default="min(4, 2 x cores)", help="Parallel chunk reads for --deep.")
@click.option("--manifest", "manifest_file", metavar="FILE",
              help="An integrity manifest kept elsewhere (default: the checkpoint's integrity.json, when present).")
@memory_option
@weights_option
def validate_command(path: str, deep: bool, step: str | None, strict: bool, as_json: bool, fmt: str, workers: int,
                     memory: int, manifest_file: str | None, weights: str | None) -> None:
    out = Output(json_mode=as_json)
    with progress_for(out, "reading chunks", show=deep) as progress, formats.read_options(weights=weights):
        report = validate_checkpoint(path, step=step, deep=deep, workers=workers, progress=progress, memory=memory,
                                     manifest=manifest_file)
    if as_json:
        # the run root's step validated, as inspect --json says it
        out.json({**report.to_json(strict), "opened": opened_step.first_json()})
    elif fmt == "github":
        for o in opened_step.take():  # which step of the run root was checked: a notice, not a finding
            out.text_line(f"::notice title=ckpt validate::{o.line()}".replace("%", "%25"))
        _github(out, report)
    else:
        for o in opened_step.take():  # the first line: which step of the run root was checked, and why
            out.line(esc(o.line()))
        _human(out, report, strict)
    sys.exit(0 if report.ok(strict) else 1)


def _human(out: Output, report: ValidationReport, strict: bool) -> None:
    out.line(f"[bold]{esc(report.path)}[/bold]  ({report.format or 'unknown format'}{', deep' if report.deep else ''})")
    by_leaf: dict[str, list] = defaultdict(list)
    for f in report.findings:
        by_leaf[f.leaf or ""].append(f)
    for leaf in sorted(by_leaf, key=lambda k: (k != "", k)):
        if leaf:
            out.line(f"  [bold]{esc(leaf)}[/bold]")
        for f in by_leaf[leaf]:
            colour = "red" if f.severity == ERROR else "yellow"
            where = f"  [dim]{esc(f.file)}[/dim]" if f.file else ""
            indent = "    " if leaf else "  "
            out.line(f"{indent}[{colour}]{f.severity}[/{colour}] {f.code}: {esc(f.message)}{where}")
    checked = ", ".join(
        (f"{human_bytes(v)} read" if k == "bytes_read" else _counted(v, k))
        for k, v in report.checked.items()
    )
    errors = sum(f.severity == ERROR for f in report.findings)
    warnings = len(report.findings) - errors
    if report.ok(strict):
        verdict = "[bold green]OK[/bold green]"
    else:
        verdict = "[bold red]FAILED[/bold red]"
    out.line(f"{verdict}: {plural(errors, 'error')}, {plural(warnings, 'warning')}" + (f" (checked {checked})" if checked else ""))


# the nouns of the report's counters ("chunks_read", "bytes_items"), singular for a count of 1
_SINGULAR = {"steps": "step", "arrays": "array", "chunks": "chunk", "files": "file", "tensors": "tensor",
             "leaves": "leaf", "items": "item", "values": "value", "copies": "copy", "frames": "frame"}


def _counted(n: int, key: str) -> str:
    """"1 step", "2 steps", "1 chunk read", "1 json item": a counter of the report, its noun agreeing."""
    words = key.split("_")
    if n == 1:
        for i in range(len(words) - 1, -1, -1):  # the noun: the last word that has a singular
            if words[i] in _SINGULAR:
                words[i] = _SINGULAR[words[i]]
                break
    return f"{n:,} {' '.join(words)}"


def _github(out: Output, report: ValidationReport) -> None:
    for f in report.findings:
        level = "error" if f.severity == ERROR else "warning"
        where = f" {f.file}" if f.file else ""
        leaf = f" [{f.leaf}]" if f.leaf else ""
        # annotation text must stay on one line: GitHub's own escapes for CR and LF (%0D, %0A),
        # then the other control characters as every shown text has them (\x1b)
        message = f"{f.code}{leaf}: {f.message}{where}".replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
        out.text_line(f"::{level} title=ckpt validate::{message}")
    errors = sum(f.severity == ERROR for f in report.findings)
    out.text_line(f"ckpt validate {report.path}: {plural(errors, 'error')}, {plural(len(report.findings) - errors, 'warning')}")
