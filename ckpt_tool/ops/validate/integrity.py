"""validate's integrity-manifest step, for every format (the checks are ckpt_tool/ops/manifest/'s).

When the checkpoint has a manifest (integrity.json inside it, `<file>.integrity.json` beside a
one-file checkpoint, or `--manifest FILE`), shallow validate checks the files it names are there
with their recorded sizes, and --deep checks their sha256. A checkpoint without one is validated
exactly as before: no finding, nothing read.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...base.errors import NotFoundError
from ...base.findings import Findings, Progress

if TYPE_CHECKING:
    from ...core.contract import ChecksModule


def check(
    path: str,
    findings: Findings,
    *,
    manifest: str | None,
    deep: bool,
    workers: int,
    memory: int | None,
    progress: Progress,
    checks: ChecksModule | None = None,
) -> None:
    """The manifest's findings added to `findings` (`checks`: the format's checks module, whose
    `manifest_covers(name)` says which unnamed files of another writer's
    manifest are worth a warning)."""
    from .. import manifest as core

    loc = core.locate(path, manifest)
    if not loc.present():
        if loc.explicit:
            raise NotFoundError("--manifest: no such file", loc.url)
        return
    core.check_shallow(loc, findings, covers=checks.manifest_covers if checks is not None else None, workers=workers)
    if deep:
        core.check_digests(loc, findings, workers=workers, progress=progress, checkpoint=path,
                           **({"memory": memory} if memory is not None else {}))


def require(path: str, manifest: str) -> None:
    """NotFoundError (one line) when `--manifest FILE` names no file."""
    from .. import manifest as core

    loc = core.locate(path, manifest)
    if not loc.present():
        raise NotFoundError("--manifest: no such file", loc.url)


def add_to(report: Any, path: str, *, checks: Any = None, **kwargs: Any) -> Any:
    """`report` (Findings, or a ValidationReport a format made its own way for one file) with the
    manifest's findings; a manifest that cannot be read is a finding, never an exception."""
    from ...base.errors import CkptError, PathEscapeError

    findings = report if isinstance(report, Findings) else Findings()
    try:
        check(path, findings, checks=checks, **kwargs)
    except PathEscapeError as exc:
        findings.error("path-escape", exc.message, file=exc.where)
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=exc.where)
    if findings is report:
        return report
    report.findings.extend(findings.items)
    for key, n in findings.checked.items():
        report.checked[key] = report.checked.get(key, 0) + n
    return report
