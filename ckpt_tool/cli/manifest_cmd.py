"""`ckpt manifest write|verify CKPT`: a checkpoint's sha256 integrity manifest (ckpt_tool/ops/manifest/)."""
from __future__ import annotations

import sys

import click

from ..ops.manifest import verify, write
from ..base.parallel import default_workers
from ..ops.validate import ValidationReport
from .helptext import formats_read
from .options import memory_option
from .progress import progress_for
from .render import Output, esc, human_bytes, human_rate, plural
from .validate_cmd import _human

_MANIFEST_HELP = ("The manifest file (a path or URL; default: integrity.json in the checkpoint directory, "
                  "FILE.integrity.json beside a one-file checkpoint).")


# the formats come from the registry (helptext), so that the list cannot go stale
@click.group("manifest", help=(
    f"Write or verify the integrity manifest of a checkpoint ({formats_read()}): the sha256 of every "
    "file, in Megatron-Core's integrity.json schema (with sizes, and per-tensor digests with --tensors). "
    "`ckpt validate` checks it too when present (names and sizes; digests with --deep)."))
def manifest_group() -> None:
    """`ckpt manifest`: its subcommands do the work (the help text is the decorator's)."""


@manifest_group.command("write", short_help="Hash every file of a checkpoint and write its manifest.")
@click.argument("ckpt")
@click.option("--tensors", is_flag=True, help="Also record the sha256 of each array's values (names the tensor a "
              "changed byte is in; reads and decodes every chunk).")
@click.option("--manifest", "manifest_file", metavar="FILE", help=_MANIFEST_HELP)
@click.option("--overwrite", is_flag=True, help="Replace a manifest ckpt did not write (Megatron's own).")
@click.option("--rebaseline", is_flag=True, help="Record the files as they are now as the new reference, "
              "even where they differ from the manifest there (without it, a file that changed or is gone "
              "since that manifest was written makes the write refuse, naming each: the damage would "
              "become the reference).")
@click.option("--workers", type=click.IntRange(min=1), default=default_workers, show_default="min(4, 2 x cores)",
              help="Files hashed in parallel.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@memory_option
def write_command(ckpt: str, tensors: bool, manifest_file: str | None, overwrite: bool, rebaseline: bool,
                  workers: int, as_json: bool, memory: int) -> None:
    """Hash every file of the checkpoint at CKPT and write its manifest (atomically; no other
    file of the checkpoint is touched). A manifest there already is the reference: a file it
    names that changed or is gone is refused, one line each, unless --rebaseline."""
    out = Output(json_mode=as_json)
    with progress_for(out, "hashing") as progress:
        result = write(ckpt, manifest=manifest_file, tensors=tensors, overwrite=overwrite, rebaseline=rebaseline,
                       workers=workers, memory=memory, progress=progress)
    if as_json:
        out.json({"ok": True, "manifest": result.url, "files": result.files, "bytes": result.bytes,
                  "tensors": result.tensors, "seconds": round(result.seconds, 3), "replaced": result.replaced,
                  "rebaselined": list(result.rebaselined), "added": result.added})
        return
    for line in result.rebaselined:  # what --rebaseline accepted, said before the line that wrote it
        out.line(f"  rebaselined {esc(line)}")
    tensors_text = f", {plural(result.tensors, 'tensor')}" if result.tensors is not None else ""
    added = f"; {plural(result.added, 'file')} added since" if result.added else ""
    replaced = f" (replaced {result.replaced}{added})" if result.replaced else ""
    out.line(f"wrote {esc(result.url)}: sha256 of {plural(result.files, 'file')}{tensors_text}, "
             f"{human_bytes(result.bytes)} in {result.seconds:.1f} s ({human_rate(result.bytes, result.seconds)})"
             f"{replaced}")


@manifest_group.command("verify", short_help="Check every file a manifest names: size and sha256.")
@click.argument("ckpt")
@click.option("--manifest", "manifest_file", metavar="FILE", help=_MANIFEST_HELP)
@click.option("--strict", is_flag=True, help="Count warnings (files the manifest does not name) as errors.")
@click.option("--workers", type=click.IntRange(min=1), default=default_workers, show_default="min(4, 2 x cores)",
              help="Files hashed in parallel.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@memory_option
def verify_command(ckpt: str, manifest_file: str | None, strict: bool, workers: int, as_json: bool,
                   memory: int) -> None:
    """Check every file the manifest names: present, of its recorded size, with its sha256.
    Exit 0 when all match, 1 otherwise (validate --deep does this and the format's checks)."""
    out = Output(json_mode=as_json)
    with progress_for(out, "hashing") as progress:
        loc, findings, fmt = verify(ckpt, manifest=manifest_file, workers=workers, memory=memory, progress=progress)
    report = ValidationReport(loc.storage.url if loc.single is None else f"{loc.storage.url}/{loc.single}", fmt,
                              findings.items, findings.checked, deep=True)
    if as_json:
        out.json({**report.to_json(strict), "manifest": loc.url})
    else:
        _human(out, report, strict)
    sys.exit(0 if report.ok(strict) else 1)
