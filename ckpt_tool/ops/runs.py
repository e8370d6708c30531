"""Run roots: the steps a training run saved, which are finished, and which one to resume from.

list_run() lists a run root (`ckpt ls`): one row per step with its status by
its writer's rule (formats/steps.py); `check=True` runs validate's shallow
checks (`deep`: --deep) on each step. latest() picks what a launcher resumes
from (`ckpt latest`): the newest step complete by its writer's rule that
passes validate; a step the pointer names but that fails is reported, never
returned. Which step a path opens (resolve_step, --step) is formats/steps.py's,
below the registry's open_checkpoint; its names are here too for the commands.

Which framework a root belongs to, and each framework's rules, are the run
layouts' table (formats/roots.py); nothing here names a framework or format.
Nothing here prints: the commands render what these return.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..base.errors import (
    CkptError, NoSpaceError, NotFoundError, StorageUnavailableError, UnknownFormatError, UsageError,
)
from ..base.findings import ERROR
from ..formats import registered, steps
from ..formats.roots import COMMITTED, RunLayout
from ..formats.steps import OpenedStep, RunListing, StepRow, opened_steps, recording, step_checkpoint
from ..storage import Storage

__all__ = ["StepRow", "RunListing", "Latest", "OpenedStep", "list_run", "latest", "working_step", "name_working_step", "resolve_step", "step_path",
           "recording", "opened_steps", "every_step", "step_checkpoint"]


@dataclass
class Latest:
    """What `ckpt latest` found: the step to resume from (or none) and the steps passed over."""

    root: str
    layout: str
    deep: bool
    chosen: StepRow | None
    skipped: list[dict[str, Any]] = field(default_factory=list)  # newer steps not returned, and why
    pointer_file: str | None = None
    pointer_names: str | None = None
    pointer_problem: str | None = None
    title: str = ""  # the framework's name ("Megatron-LM")
    # the step the framework's own resume opens (its pointer file, else its rule: formats/steps.py
    # framework_pick), None when it opens none; `pick_problem` why it fails (None: it is `chosen`)
    pick: StepRow | None = None
    pick_rule: str = ""
    pick_problem: str | None = None
    explicit: str = ""  # how to make the framework open the printed step instead

    @property
    def path(self) -> str | None:
        return self.chosen.url if self.chosen is not None else None

    @property
    def step(self) -> int | None:
        """The printed step's number (None: no step, or a step named without one, a DeepSpeed tag)."""
        return self.chosen.step if self.chosen is not None else None

    @property
    def differs(self) -> bool:
        """Whether the step printed is not the one the framework would resume from by itself:
        a launcher must then pass it explicitly (`explicit`)."""
        return self.chosen is not None and (self.pick is None or self.pick.name != self.chosen.name)

    def framework_line(self) -> str | None:
        """What the framework would do instead, why that fails, and that the printed step must be
        passed explicitly (None: the framework picks the printed step itself)."""
        if not self.differs or self.chosen is None:
            return None
        if self.pick is None:
            would = f"{self.title} would resume from no step: {self.pick_problem}"
        else:
            would = (f"{self.title} would resume from {self.pick.name} ({self.pick_rule}), "
                     + (f"which {self.pick_problem}" if self.pick_problem else f"not {self.chosen.name}"))
        how = f" ({self.explicit})" if self.explicit else ""
        return f"{would}; pass {self.chosen.name} explicitly{how}"

    def to_json(self) -> dict[str, Any]:
        c = self.chosen
        p = self.pick
        return {
            "ok": c is not None, "root": self.root, "layout": self.layout, "deep": self.deep,
            "path": self.path, "step": c.step if c else None, "name": c.name if c else None,
            "format": c.format if c else None,
            "pointer": None if self.pointer_file is None else {
                "file": self.pointer_file, "names": self.pointer_names, "problem": self.pointer_problem},
            # the framework's own pick, beside the step printed; `differs`: the printed step must be
            # passed to the framework explicitly
            "framework": {"name": p.name if p else None, "step": p.step if p else None,
                          "path": p.url if p else None, "rule": self.pick_rule, "problem": self.pick_problem,
                          "explicit": self.explicit},
            "differs": self.differs,
            "skipped": self.skipped,
        }


def list_run(root: str, *, check: bool = False, deep: bool = False, sizes: bool | None = None,
             screen: bool = False, progress: Callable[[str, int, int], None] | None = None) -> RunListing:
    """The steps of the run root at `root`, sorted by step (listing only unless `check` or `screen`).

    `sizes`: add each step's bytes (default: on local roots; on object stores each file's size
    is a request, so only when asked). `check`: run validate on each step (`deep`: --deep).
    `screen`: the cheap check validate of a root gives the steps it does not open (the step's
    listing and a few small metadata reads, never array data, the steps in flight together) on
    each committed step; a step that fails it has `fails` set (`ckpt ls` by default)."""
    result = steps.list_run(root, formats=registered(), sizes=sizes)
    if check:
        rows = result.steps
        for i, row in enumerate(rows):
            if progress is not None:
                progress("checking steps", i, len(rows))
            row.check = _checked(result.root, result.layout, row, deep)
            if row.status == COMMITTED and not row.check["ok"]:
                row.fails = row.check["first"]
        if progress is not None:
            progress("checking steps", len(rows), len(rows))
    elif screen:
        from .validate import screen_steps  # (lazily: a listing alone never loads validate)

        done = [r for r in result.steps if r.status == COMMITTED]
        for row, verdict in zip(done, screen_steps(result, done)):
            if verdict is not None:
                row.fails = f"{verdict[0]}: {verdict[1]}"
    return result


def resolve_step(root: str, step: str | int | None,
                 storage: Storage | None = None) -> tuple[str, str | int | None, OpenedStep | None]:
    """(path to open, step for the format's reader, the step opened) for `root` and --step `step`
    (steps.resolve_step, with the registry's formats)."""
    return steps.resolve_step(root, step, registered(), storage)


def step_path(root: str, step: str | int) -> tuple[str, str | int | None]:
    """(path, step for the format's reader) of step `step` of the run root at `root`: a number,
    an entry's name or 'latest' (resolve_step, without what it says about the step)."""
    return steps.step_path(root, step, registered())


def every_step(root: str) -> RunListing | None:
    """The listing of `root` when it is a run root, None for any other path (steps.every_step)."""
    return steps.every_step(root, registered())


def _validate(root_url: str, layout: RunLayout, row: StepRow, deep: bool) -> Any:
    """validate's report on one step (shallow, or deep)."""
    from .validate import validate_checkpoint  # (lazily: `ckpt ls` without --check never loads it)

    step: str | int = row.step if row.step is not None else row.name  # (through the root)
    if not row.is_dir:
        # a file step (Flax checkpoint_N): through the root, by the format's own step rules, so that
        # object stores work too
        return validate_checkpoint(root_url, step=step, deep=deep)
    url = f"{row.url}/{layout.payload}" if layout.payload else row.url
    try:
        # the step alone (through the root, orbax's reader would read every step's metadata first)
        return validate_checkpoint(url, deep=deep)
    except UnknownFormatError:
        if not layout.own_root:
            raise
        # a step that is not a checkpoint on its own (orbax <= 0.4's named items): through the root
        return validate_checkpoint(root_url, step=step, deep=deep)


def _checked(root_url: str, layout: RunLayout, row: StepRow, deep: bool) -> dict[str, Any]:
    """validate's verdict on one step; a step no reader opens fails with that one line."""
    try:
        with steps.unrecorded():  # not the step a command opened
            return _verdict(_validate(root_url, layout, row, deep))
    except UsageError:
        raise
    except CkptError as exc:
        return {"ok": False, "errors": 1, "warnings": 0, "first": f"{exc.code}: {exc}"}


def _verdict(report: Any) -> dict[str, Any]:
    errors = [f for f in report.findings if f.severity == ERROR]
    first = errors[0] if errors else None
    return {
        "ok": report.ok(), "errors": len(errors), "warnings": len(report.findings) - len(errors),
        "first": f"{first.code}: {first.message}" + (f" ({first.file})" if first.file else "") if first else None,
    }


def working_step(opened: OpenedStep) -> str | None:
    """Where the step a command opened by default (`opened`: the one the framework resumes from)
    is refused, the step that works, by the rule of `ckpt latest` (the newest step complete by its
    writer's rule that passes validate): "3 is the step Orbax CheckpointManager resumes from;
    `ckpt latest` picks 2, ...: --step 2"; None where that is the step opened (or where the root
    reads as no run root now)."""
    try:
        found = latest(opened.root)
    except UsageError:
        raise
    except CkptError:
        return None
    if found.chosen is not None and found.chosen.name == opened.name:
        return None
    why = (f"{opened.name} is the newest complete step" if opened.no_pick is not None
           else f"{opened.name} is the step {opened.layout} resumes from ({opened.rule.split(':')[0]})")
    if found.chosen is None:
        return f"{why}, and no step passes validate (`ckpt latest` finds none)"
    row = found.chosen
    return (f"{why}; `ckpt latest` picks {row.name}, the newest step that passes validate: "
            f"--step {row.name if row.step is None else row.step}")


def name_working_step(error: CkptError, opened: list[OpenedStep]) -> None:
    """A command refused the step of a run root it opened by default (`opened`: the steps it
    opened, formats.steps.recording()): add to `error` the step that works, by `ckpt latest`'s
    rule (working_step). Only for damage found in that step (the error names a path in the
    root), never for a step asked for by --step."""
    if isinstance(error, (UsageError, NotFoundError, StorageUnavailableError, NoSpaceError)) or not error.where:
        return
    where = _comparable(error.where)
    for o in opened:
        root = _comparable(o.root)
        if o.chosen_by == "requested" or not (where == root or where.startswith(root + "/")):
            continue
        hint = working_step(o)
        target = hint.rsplit(": --step ", 1)[-1] if hint is not None and ": --step " in hint else None
        if hint is None or hint in error.message or (target is not None and f"--step {target} " in error.message + " "):
            return
        # (open_checkpoint's own hint names the step before by the listing alone: this one stands)
        fallback = o.fallback()
        message = error.message.replace(f" ({fallback})", "") if fallback else error.message
        error.message = f"{message}; {hint}"
        error.args = (f"{error.where}: {error.message}",)
        return


def _comparable(path: str) -> str:
    """A path or URL as typed, comparable with another: local paths made absolute."""
    import os

    path = path.rstrip("/")
    return path if "://" in path else os.path.abspath(path)


def latest(root: str, deep: bool = False) -> Latest:
    """The newest step of the run root at `root` that is complete by its writer's rule and passes
    validate's shallow checks (`deep`: decodes every chunk too). `.path` is None when there is none;
    `.skipped` says why each newer step was passed over (the pointer's target included)."""
    listing = list_run(root, sizes=False)
    layout = listing.layout
    # the framework's own pick first (its pointer, else its rule), judged by its own rules too
    if listing.listing is not None:
        steps.confirm_steps(listing, listing.listing)
    pick = steps.framework_pick(listing)
    found = Latest(listing.root, layout.name, deep, None, pointer_file=listing.pointer_file,
                   pointer_names=listing.pointer_names, pointer_problem=listing.pointer_problem,
                   title=layout.title, pick=pick.row, pick_rule=pick.rule, pick_problem=pick.problem,
                   explicit=layout.explicit)
    # newest first; where the writer moves its pointer last, a pointer's step without a number (a
    # DeepSpeed tag of any name) first: it is the newest by the writer's rule
    first = listing.layout.pointer_is_commit
    order = sorted(listing.steps, reverse=True,
                   key=lambda r: (first and r.pointer and r.step is None, r.step is not None, r.step or 0, r.name))
    for row in order:
        steps.confirm_row(listing, row)  # (a small read, where the layout's commit rule needs one)
        if row.status != COMMITTED:
            found.skipped.append({"name": row.name, "step": row.step, "status": row.status, "reason": row.reason,
                                  "pointer": row.pointer})
            if row is pick.row:
                found.pick_problem = f"is {row.status}: {row.reason}"
            continue
        verdict = _checked(listing.root, listing.layout, row, deep)
        if verdict["ok"]:
            found.chosen = row
            break
        found.skipped.append({"name": row.name, "step": row.step, "status": "fails validate",
                              "reason": verdict["first"], "pointer": row.pointer})
        if row is pick.row:
            found.pick_problem = f"fails validate: {verdict['first']}"
    if pick.row is not None and found.pick_problem is None and found.differs:
        # the framework's pick is older than the step printed (never reached above): say its state
        found.pick_problem = None if pick.row.status == COMMITTED else f"is {pick.row.status}: {pick.row.reason}"
    return found
