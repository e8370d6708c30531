"""`ckpt validate`: is this checkpoint complete and consistent, and if not, what and where.

validate_checkpoint() detects the format, runs that format's shallow checks
(metadata, key listings and sizes; no chunk is read) and, with deep=True,
reads and decodes every chunk. It returns a ValidationReport; the command
decides the exit code and rendering.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import dataclasses

from ...base.errors import CkptError, PathEscapeError, UnknownFormatError, UnsafePickleError, UsageError
from ...base.findings import ERROR, WARNING, CODES, Finding, Findings, Progress, no_progress
from ...formats.roots import COMMITTED, IN_PROGRESS
from ...storage import Storage, raise_if_unavailable

if TYPE_CHECKING:
    from ...core.model import Checkpoint

__all__ = ["validate_checkpoint", "validate_opened", "ValidationReport", "CODES", "screen_steps"]


@dataclass
class ValidationReport:
    path: str
    format: str | None
    findings: list[Finding]
    checked: dict[str, int] = field(default_factory=dict)
    deep: bool = False

    def ok(self, strict: bool = False) -> bool:
        return not any(f.severity == ERROR or strict for f in self.findings)

    def to_json(self, strict: bool = False) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok(strict),
            "deep": self.deep,
            "findings": [f.to_json() for f in self.findings],
            "checked": self.checked,
        }


def validate_checkpoint(
    path: str,
    *,
    step: str | int | None = None,
    deep: bool = False,
    workers: int = 4,
    progress: Progress = no_progress,
    memory: int | None = None,
    manifest: str | None = None,
) -> ValidationReport:
    """Check the checkpoint at `path`; collects every finding instead of stopping at the first.

    `memory`: the --deep read scheduler's budget in bytes, and the unpickler's (None: the default).
    `manifest`: an integrity manifest kept elsewhere (default: the checkpoint's own, when it has one)."""
    from ...machinery.torch_save.pickle_budget import memory_budget

    with memory_budget(memory):
        return _validate_checkpoint(path, step=step, deep=deep, workers=workers, progress=progress,
                                    memory=memory, manifest=manifest)


def validate_opened(ckpt: Checkpoint, *, step: str | int | None = None) -> ValidationReport:
    """validate_checkpoint(ckpt.path, step=step) (its shallow checks), of a checkpoint opened already
    in this run: convert's, reshard's and diff's preflight. The checks start from the Storage its
    reader read through (its listing taken) and what the reader parsed of its metadata
    (Checkpoint.storage, Checkpoint.parsed; ChecksModule.check_opened), so that a run reads the
    source's metadata once; the findings are validate_checkpoint's. A checkpoint opened otherwise
    (no Storage kept, or one for another path) is validated by its path."""
    from ... import formats
    from ...machinery.torch_save.pickle_budget import memory_budget

    storage, path = ckpt.storage, ckpt.path
    single = formats.split_file(path) if storage is not None else None
    where = (single[1][0] if single is not None else path).rstrip("/") or "/"
    if storage is not None and where.startswith(storage.url.rstrip("/") + "/"):
        # a reader that opened a run root at a step names the checkpoint by the step's directory
        try:
            storage = storage.child(where[len(storage.url.rstrip("/")) + 1:])
        except CkptError:
            storage = None  # (validate of the path says what is wrong with it)
    if storage is None or storage.url != where:
        return validate_checkpoint(path, step=step)
    # its reads are not the run's reads of the source (what convert reports as read is the reader's)
    storage = storage.counted_in()
    with memory_budget(None):
        return _validate_checkpoint(path, step=step, deep=False, workers=4, progress=no_progress, memory=None,
                                    manifest=None, storage=storage, parsed=ckpt.parsed, single=single is not None)


def _validate_checkpoint(
    path: str,
    *,
    step: str | int | None,
    deep: bool,
    workers: int,
    progress: Progress,
    memory: int | None,
    manifest: str | None,
    storage: Storage | None = None,
    parsed: dict[str, Any] | None = None,
    single: bool = False,
) -> ValidationReport:
    """validate_checkpoint's work. `storage`, `parsed`: a checkpoint opened already (validate_opened):
    the Storage of `path` (of its directory where it is one file: `single`) its reader read through,
    and what the reader parsed of its metadata."""
    from ...storage import check_url

    check_url(path)  # the error names the URL whole, not the directory of a file's URL
    from ... import formats
    from ...formats.steps import every_step, resolve_step

    if step == "all":
        run = every_step(path, formats.registered())
        if run is not None and not run.layout.own_root:
            # a root whose steps are each a checkpoint (torchtitan, HF Trainer, NeMo 2, verl): each
            # step's directory in turn
            return _validate_every_step(run, deep=deep, workers=workers, progress=progress, memory=memory)
        if run is not None:
            # the format's reader checks every step it reads; a torn step it passes over (a tag
            # directory without states files, a checkpoint_N/ without its tree) is named still
            report = _validate_one(path, step=step, deep=deep, workers=workers, progress=progress,
                                   memory=memory, manifest=manifest)
            _name_torn_steps(report, run)
            return report
    # a run root of any framework: the step asked for, else the one the framework resumes from
    # (the run layouts' table; the step opened is recorded for the CLI to say)
    given = path
    path, step, opened = resolve_step(path, step, formats.registered(), None if single else storage)
    if path != given:  # a run root's step, in a directory of its own: not the checkpoint opened
        storage, parsed = None, None
    try:
        report = _validate_one(path, step=step, deep=deep, workers=workers, progress=progress, memory=memory,
                               manifest=manifest, storage=storage, parsed=parsed)
    except UsageError:
        raise
    except CkptError:
        if opened is None or opened.chosen_by == "requested" or opened.status == COMMITTED or opened.run is None:
            raise
        # the step the framework resumes from is torn so far that it reads as nothing (an HF
        # checkpoint-N/ killed before its first file): the finding says so, not "not a checkpoint"
        report = ValidationReport(path, opened.run.layout.fallback_format, [], {}, deep)
    if opened is not None and opened.chosen_by != "requested":
        _fail_torn_resume_step(report, opened)
        _warn_no_pick(report, opened)
        _warn_other_steps(report, opened)
        _check_other_steps(report, opened, memory)
    return report


# other steps checked at once (on an object store each check is a few requests; locally cheap)
_OTHER_STEP_WORKERS = 8
_REMOTE_STEP_WORKERS = 32


def _check_other_steps(report: ValidationReport, opened: Any, memory: int | None) -> None:
    """validate of a run root checks the step a resume opens; every other committed step gets a
    cheap check (screen_steps), and damage found there is a warning naming the step and
    `--step all`, which checks every step as the one opened is."""
    run = opened.run
    if run is None:
        return
    others = [r for r in run.steps if r.name != opened.name and r.status == COMMITTED]
    if not others:
        return
    root = run.root.rstrip("/")
    verdicts = screen_steps(run, others, memory=memory)
    base = "" if report.path.rstrip("/") == root else root + "/"
    for row, verdict in zip(others, verdicts):
        if verdict is None or (not base and _named(report, row.name)):
            continue
        code, message = verdict
        report.findings.append(Finding(
            WARNING, code, f"{row.name} fails validate: {message} (not the step a resume opens; "
            "--step all checks every step)", None, base + row.name + ("/" if row.is_dir else "")))


def screen_steps(run: Any, rows: list[Any], *, memory: int | None = None) -> list[tuple[str, str] | None]:
    """The cheap check of each step of `rows` (steps.StepRow of the run root `run`): validate's
    shallow checks of the step alone (its listing and its metadata, never array data), all steps
    in flight together (on an object store each is a few requests; locally cheap). Per step, the
    (code, message) of its first error, or None when it passes. validate of a root gives it to
    the steps it does not open, `ckpt ls` to every committed step."""
    from concurrent.futures import ThreadPoolExecutor

    from ...formats.steps import step_checkpoint, unrecorded

    root = run.root.rstrip("/")
    # the root's Storage, which holds the root's listing: each step's part of it serves the step's
    # checks (on an object store a LIST per step saved; a Storage per step, for the threads)
    listed = run.listing.storage if run.listing is not None else None

    def part(rel: str = "") -> Storage | None:
        return None if listed is None else listed.child(rel) if rel else listed

    def one(row: Any) -> tuple[str, str] | None:
        try:
            with unrecorded():  # not the step the command opened
                if not row.is_dir:  # a file step (Flax checkpoint_N): through the root, at that step
                    rep = _validate_one(root, step=row.step, deep=False, workers=1, progress=no_progress,
                                        memory=memory, manifest=None)
                else:
                    url = step_checkpoint(run, row)
                    try:
                        rep = _validate_one(url, step=None, deep=False, workers=1, progress=no_progress,
                                            memory=memory, manifest=None, storage=part(url[len(root) + 1:]))
                    except UnknownFormatError:
                        if not run.layout.own_root:
                            raise
                        # a step that is no checkpoint alone (orbax <= 0.4's named items): through the root
                        rep = _validate_one(root, step=row.step if row.step is not None else row.name, deep=False,
                                            workers=1, progress=no_progress, memory=memory, manifest=None)
        except UsageError:
            return None
        except CkptError as exc:
            return "bad-metadata", exc.message
        first = next((f for f in rep.findings if f.severity == ERROR), None)
        if first is None:
            return None
        return first.code, first.message + (f" ({first.file})" if first.file else "")

    if not rows:
        return []
    # (on an object store each check is a few requests, waited for: more of them in flight)
    workers = _OTHER_STEP_WORKERS if listed is None or listed.local_root is not None else _REMOTE_STEP_WORKERS
    with ThreadPoolExecutor(max_workers=min(workers, len(rows)), thread_name_prefix="ckpt-steps") as pool:
        return list(pool.map(one, rows))


def _warn_no_pick(report: ValidationReport, opened: Any) -> None:
    """The framework's own resume opens no step here (no pointer file, no `-last` copy: it starts
    afresh): validate checks the newest complete step instead, and says that a launcher must pass
    it explicitly (unless the format's checks already named the missing pointer)."""
    if opened.no_pick is None or opened.run is None:
        return
    pointer = opened.run.layout.pointer
    if pointer is not None and any(pointer in f.message or f.file in (pointer, ".") for f in report.findings
                                   if f.code == "missing-metadata"):
        return
    how = f" ({opened.explicit})" if opened.explicit else ""
    report.findings.append(Finding(
        WARNING, "missing-metadata",
        f"{opened.layout} would resume from no step here ({opened.no_pick}: a fresh start, or its error); "
        f"validate checks {opened.name}, the newest complete step: pass it explicitly{how}",
        None, pointer if pointer is not None else None))


def _fail_torn_resume_step(report: ValidationReport, opened: Any) -> None:
    """The step a resume opens (by the framework's own rule: its pointer file, get_last_checkpoint,
    NeMo's `-last`) is torn: the resume fails or resumes a half-written save, whatever its files
    read as, so validate of the root fails (an error naming it, unless the format's checks already
    found one)."""
    if opened.status == COMMITTED or any(f.severity == ERROR for f in report.findings):
        return
    done = [s for s in opened.steps if s["status"] == COMMITTED]
    hint = ""
    if done:
        last = done[-1]
        hint = f"; the newest complete step is {last['name']} (--step {last['name'] if last['step'] is None else last['step']})"
    base = "" if report.path.rstrip("/") == opened.root.rstrip("/") else opened.root.rstrip("/") + "/"
    report.findings.insert(0, Finding(
        ERROR, "uncommitted-save",
        f"{opened.name} is {opened.status}: {opened.reason}; {opened.layout} resumes from it{hint}", None,
        base + opened.name + ("/" if opened.name in opened.dirs else "")))


def _warn_other_steps(report: ValidationReport, opened: Any) -> None:
    """validate of a run root checks the step a resume opens; a torn step beside it (newer, or
    older) is a warning, so that CI sees it without failing on it: `--step all` checks them all.
    A step the format's own checks already named keeps their finding alone."""
    # the findings' files are relative to the path checked: the root itself where the format's
    # reader opens the root at a step, else the step's own directory (the others named whole)
    base = "" if report.path.rstrip("/") == opened.root.rstrip("/") else opened.root.rstrip("/") + "/"
    for other in opened.others():
        name = other["name"]
        if not base and _named(report, name):
            continue
        report.findings.append(Finding(
            WARNING, "uncommitted-save",
            f"{name} is {other['status']}: {other['reason']} (not checked: validate checks {opened.name}, "
            "the step a resume opens; --step all checks every step)", None,
            base + name + ("/" if name in opened.dirs else "")))


def _named(report: ValidationReport, name: str) -> bool:
    """Whether a finding of the report is about step `name` (its entry, or a file in it)."""
    return any(f.file is not None and (f.file.rstrip("/") == name or f.file.startswith(name + "/"))
               for f in report.findings)


def _name_torn_steps(report: ValidationReport, run: Any) -> None:
    """validate --step all through a format's reader: each step the run layouts' table finds torn
    and the reader's findings do not name: an error where it is named as finished but is not
    (incomplete), a warning where its writer is still at it (in-progress)."""
    for row in run.steps:
        if row.status == COMMITTED or _named(report, row.name):
            continue
        severity = WARNING if row.status == IN_PROGRESS else ERROR
        report.findings.append(Finding(severity, "uncommitted-save", f"{row.name} is {row.status}: {row.reason}",
                                       None, row.name + ("/" if row.is_dir else "")))


def _validate_every_step(run: Any, *, deep: bool, workers: int, progress: Progress,
                         memory: int | None) -> ValidationReport:
    """validate --step all on a root whose steps are each a checkpoint: every step's findings,
    named by the step's directory; a save still in progress is a warning (its writer has not
    finished it), and one step no reader opens is that step's one error."""
    from ...formats.steps import step_checkpoint

    findings = Findings()
    formats_seen: list[str] = []
    for row in run.steps:
        findings.count("steps")
        if row.status == IN_PROGRESS:
            findings.warning("uncommitted-save", f"{row.status}: {row.reason} (not checked)", file=row.name + "/")
            continue
        url = step_checkpoint(run, row)
        prefix = url[len(run.root.rstrip("/")) + 1:] + "/"
        try:
            report = _validate_one(url, step=None, deep=deep, workers=workers, progress=progress, memory=memory,
                                   manifest=None)
        except UsageError:
            raise
        except CkptError as exc:
            code = "uncommitted-save" if row.status != COMMITTED else "bad-metadata"
            findings.error(code, (f"{row.status}: {row.reason}; " if row.reason else "") + exc.message,
                           file=row.name + "/")
            continue
        if report.format and report.format not in formats_seen:
            formats_seen.append(report.format)
        for f in report.findings:
            f = dataclasses.replace(f, file=prefix + f.file if f.file not in (None, ".", "") else prefix)
            (findings.error if f.severity == ERROR else findings.warning)(f.code, f.message, leaf=f.leaf, file=f.file)
        for what, n in report.checked.items():
            if what != "steps":
                findings.count(what, n)
        if row.status != COMMITTED and report.ok():
            # complete as a checkpoint of its format, not by its framework's rule (an HF Trainer
            # step without trainer_state.json, a verl step missing a rank's optimizer file):
            # the framework does not resume from it
            findings.error("uncommitted-save", f"{row.name} is {row.status}: {row.reason}", file=row.name + "/")
    if not run.steps:
        findings.error("no-steps", "no step in this run root", file=".")
    return ValidationReport(run.root, ", ".join(formats_seen) or run.layout.fallback_format, findings.items,
                            findings.checked, deep)


def _validate_single_file(path: str, parts: tuple[str, str], check_file: Callable[[Storage, str, Findings], str], *, deep: bool, workers: int,
                          progress: Progress) -> ValidationReport:
    """`ckpt validate FILE` where the format checks one file its own way (check_single_file:
    a Flax msgpack file), `parts` its directory and name; --deep skips the leaves found broken."""
    from .deep import deep_check

    storage = Storage.open(parts[0])
    findings = Findings()
    family = check_file(storage, parts[1], findings)
    if deep:
        broken = {f.leaf for f in findings.errors if f.leaf}
        deep_check(path, family, findings, workers=workers, progress=progress, skip_leaves=broken)
    return ValidationReport(path, family, findings.items, findings.checked, deep)  # as the user typed it


def _validate_one(
    path: str,
    *,
    step: str | int | None,
    deep: bool,
    workers: int,
    progress: Progress,
    memory: int | None,
    manifest: str | None,
    storage: Storage | None = None,
    parsed: dict[str, Any] | None = None,
) -> ValidationReport:
    """The format's checks of the checkpoint at `path` (a run root's step already chosen).
    `storage`: `path` opened already (a run root's step, its part of the root's listing known; the
    directory of a one-file checkpoint its reader opened); `parsed`: what that reader parsed of its
    metadata (Checkpoint.parsed), handed to the format's checks (ChecksModule.check_opened)."""
    from ... import formats
    from ...formats import TMP_MARKER, detect_one
    from . import integrity

    integrity_args = dict(manifest=manifest, deep=deep, workers=workers, memory=memory, progress=progress)
    if manifest is not None:
        integrity.require(path, manifest)  # one line when the file given is not there
    # a path naming one file a format reads as a checkpoint (a .safetensors file, a Flax msgpack file)
    split = formats.split_file(path)
    single = None
    info = None
    if split is not None:
        info, single = split
        check_file = info.checks().check_single_file
        if check_file is not None:  # the format checks such a file its own way
            report = _validate_single_file(path, single, check_file, deep=deep, workers=workers, progress=progress)
            return integrity.add_to(report, path, checks=info.checks(), **integrity_args)

    findings = Findings()
    fmt = None
    if single is None:
        from ...formats.unknown import refuse_file

        refuse_file(path, formats.registered(), command="validate")  # a file inside a checkpoint, or one ckpt does not read
    # (a one-file checkpoint's own check_single_file opens its directory itself, above)
    storage = storage if storage is not None else Storage.open(single[0] if single else path)
    incomplete = None
    if single is None:
        # an owner record of ckpt's at the root: a convert/reshard to an object store wrote here and
        # has not committed (killed, or still writing), whatever its files read as
        from ..destination import OWNER_FILE
        from ..destination_remote import incomplete_save

        incomplete = incomplete_save(storage)
        if incomplete is not None:
            findings.error("incomplete-save", incomplete, file=OWNER_FILE)
    try:
        if single is None:
            info = formats.get(detect_one(storage).NAME)
        assert info is not None
        fmt = info.name
        if TMP_MARKER in storage.url.rstrip("/").rsplit("/", 1)[-1]:
            findings.error(
                "uncommitted-save",
                "temporary directory of an interrupted ckpt convert/reshard: not a finished checkpoint",
                file=".",
            )
        # the format's shallow checks; a format of several families (msgpack: flax, orbax
        # <= 0.4 or t5x) says which one it found
        # (the reader options the format takes, passed as open_checkpoint passes them to its read())
        options = {k: v for k, v in formats.given_read_options().items() if k in info.read_options}
        family = info.checks().check_opened(storage, findings, parsed or {}, step=step,
                                            only=single[1] if single else None, **options)
        fmt = family or fmt
        if deep:
            from .deep import deep_check_steps

            # every step the shallow checks covered, one after another (leaves
            # already reported broken are not read again)
            deep_check_steps(path, fmt, findings, step=step, workers=workers, progress=progress,
                             **({"memory": memory} if memory is not None else {}))
    except UnsafePickleError as exc:
        findings.error("unsafe-pickle", exc.message, file=exc.where)
    except PathEscapeError as exc:
        where = exc.where or ""
        for root in (storage.url, storage.local_root or storage.url):  # named relative to the checkpoint
            if where.startswith(root.rstrip("/") + "/"):
                where = where[len(root.rstrip("/")) + 1 :]
                break
        findings.error("path-escape", exc.message, file=where or exc.where)
    except UsageError:
        raise  # the command line's problem (--step abc), not a finding about the checkpoint
    except CkptError as exc:
        if fmt is None and incomplete is not None:
            # what a killed save left may not read as any format yet: the record says what it is
            raise_if_unavailable(since=storage.opened_at)
            return ValidationReport(storage.url, None, findings.items, findings.checked, deep)
        if fmt is None:
            raise  # not a checkpoint at all: one error line, like inspect
        findings.error("bad-metadata", exc.message, file=exc.where)
    if info is not None:  # the checkpoint's integrity manifest, when it has one (its own findings)
        integrity.add_to(findings, path, checks=info.checks(), **integrity_args)
    if single is None and storage.local_root is not None:
        # `.5.ckpt-tmp-1a2b3c4d/` in a run root: what a killed convert/reshard left (never a step)
        from ..destination import stale_temporaries

        for name, message in stale_temporaries(storage.local_root):
            findings.warning("stale-temporary", message, file=name)
    if single is None:
        # a huggingface_hub download into this directory that stopped (its partial file): what
        # explains shards that are not there (the root's listing is made already)
        from ...storage.hf_downloads import unfinished_downloads

        for download in unfinished_downloads(storage):
            findings.warning("unfinished-download", download.describe(), file=download.partial)
    # symlinks out of the root, symlink loops, FIFOs/devices/sockets anywhere
    # under it (the storage layer never opens them): each one the checks above
    # did not already name
    # (not for one file given by its path: its directory may be a home
    # directory, and reading the file itself already refuses what is unsafe)
    named = [f.file for f in findings.items if f.code == "path-escape" and f.file]
    for rel, message in ([] if single else storage.containment_problems()):
        if not any(n == rel or n.endswith("/" + rel) for n in named):
            findings.error("path-escape", message, file=rel)
    # a remote store that stopped answering is the run's one error, not a finding per chunk
    raise_if_unavailable(since=storage.opened_at)
    url = path if single else storage.url  # one file: as the user typed it (a directory's url is)
    return ValidationReport(url, fmt, findings.items, findings.checked, deep)
