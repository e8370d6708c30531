"""Run roots' steps: what a run root holds, and which step a path opens.

list_run() lists a run root's steps with their status by their writer's rule,
from one LIST of the root (plus the framework's pointer file). resolve_step()
picks the step inspect, validate, diff and convert open on any run root
(--step, else the one the framework resumes from) and records it for the CLI
to say; every_step() lists the steps validate --step all checks one by one.
open_checkpoint (the registry) asks it, so it sits below validate and ops/runs.py:
`ckpt ls --check` and `ckpt latest` (ops/runs.py) validate the steps listed here.

Which framework a root belongs to, and each framework's rules, are the run
layouts' table (roots.py); nothing here names a framework or format: the
registry's table (`formats`, in detection order) is handed in by the caller,
for the format of each step.
Nothing here prints: the commands render what these return.
"""
from __future__ import annotations

import contextlib
import contextvars
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..base.errors import CkptError, CorruptMetadataError, IncompleteCheckpointError, NotFoundError, UsageError
from ..storage import Storage, check_url
from ..base.text import is_ascii_number
from . import roots
from .roots import COMMITTED, IN_PROGRESS, Entry, RootListing, RunLayout, RunRules
from ..base.names import OWNER_FILE

if TYPE_CHECKING:
    from . import FormatInfo

__all__ = ["StepRow", "RunListing", "OpenedStep", "Pick", "framework_pick", "confirm_steps", "confirm_row", "list_run", "resolve_step", "step_path", "recording",
           "opened_steps", "unrecorded", "every_step", "step_checkpoint"]

# stat requests in flight on object stores (each is a request there; local stats are cheap)
_STAT_WORKERS = 32


@dataclass
class StepRow:
    """One step of a run root, as `ckpt ls` shows it."""

    name: str  # the entry's name in the root
    step: int | None
    format: str
    status: str  # roots.COMMITTED / INCOMPLETE / IN_PROGRESS
    reason: str | None  # why it is not committed
    files: int
    size: int | None  # bytes; None where sizes were not asked for (object stores: a request per file)
    mtime: float | None  # the newest file's modification time (local roots only)
    url: str  # the step's path
    is_dir: bool = True
    pointer: bool = False  # the framework's pointer file names this step
    # whether the pointer agrees with the files: on the step it names, that it is the newest complete
    # step; on steps newer than it, that they are not complete (None: no pointer, or a step below it)
    pointer_agrees: bool | None = None
    check: dict[str, Any] | None = None  # validate's verdict with check=True
    # a committed step that fails validate (its cheap check, runs.list_run(screen=True), or check=True):
    # "code: message (file)" of its first error; None when it passes or was not checked
    fails: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "name": self.name, "format": self.format, "status": self.status,
            "reason": self.reason, "size": self.size, "files": self.files, "mtime": self.mtime,
            "pointer": self.pointer, "pointer_agrees": self.pointer_agrees, "path": self.url, "check": self.check,
            "fails": self.fails,
        }


@dataclass
class RunListing:
    """A run root's steps, in order, and what its pointer file (if any) names."""

    root: str
    layout: RunLayout
    steps: list[StepRow]
    pointer_file: str | None = None  # the pointer file's name when it is there
    pointer_names: str | None = None  # the entry it names
    pointer_problem: str | None = None  # why it names nothing usable
    # the one LIST it was made from (a layout's confirm reads beside it)
    listing: RootListing | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root, "layout": self.layout.name, "title": self.layout.title,
            "pointer": None if self.pointer_file is None else {
                "file": self.pointer_file, "names": self.pointer_names, "problem": self.pointer_problem},
            "steps": [s.to_json() for s in self.steps],
        }


def _open_root(root: str, formats: Sequence[FormatInfo], storage: Storage | None = None,
               ) -> tuple[Storage, RootListing, RunLayout, list[tuple[Entry, int | None]]]:
    check_url(root)
    storage = storage or Storage.open(root)
    listing = RootListing.of(storage, formats)
    found = roots.identify(listing)
    if found is None:
        raise NotFoundError(
            "not a run root: no step directories of a framework ckpt knows ("
            + ", ".join(layout.named.split(" ")[0].strip("`") for layout in roots.LAYOUTS) + ")", storage.url)
    layout, entries = found
    return storage, listing, layout, entries


def _name_run_root_below(exc: NotFoundError, root: str, formats: Sequence[FormatInfo]) -> None:
    """`not a run root`, where a sub-directory is one (a training run's experiment directory:
    NeMo's, above its checkpoints/): the error names it. Only on this error's path (`ckpt ls`,
    `latest`): resolve_step asks every path whether it is a run root, and this lists the
    sub-directory (unknown.run_roots_below: only where there is one)."""
    from .unknown import run_roots_below

    if not exc.message.startswith("not a run root"):
        return
    try:
        storage = Storage.open(root)
        below = run_roots_below(storage, storage.listdir()[0], formats)
    except CkptError:
        return
    if below:
        name, title, n = below[0]
        exc.message += f"; {name}/ in it is one ({title}, {n} step{'s' * (n != 1)}): try {storage.url.rstrip('/')}/{name}"
        exc.args = (f"{exc.where}: {exc.message}" if exc.where else exc.message,)


def _stats(storage: Storage, keys: list[str], want_sizes: bool) -> dict[str, tuple[int, float | None]]:
    if not want_sizes:
        return {}
    if storage.local_root is not None:
        return {k: storage.stat(k) for k in keys}
    with ThreadPoolExecutor(max_workers=_STAT_WORKERS, thread_name_prefix="ckpt-stat") as pool:
        return dict(zip(keys, pool.map(storage.stat, keys)))


def list_run(root: str, *, formats: Sequence[FormatInfo], sizes: bool | None = None,
             _opened: tuple[Storage, RootListing, RunLayout, list[tuple[Entry, int | None]]] | None = None,
             ) -> RunListing:
    """The steps of the run root at `root`, sorted by step, from its listing (runs.list_run
    checks them too).

    `sizes`: add each step's bytes (default: on local roots; on object stores each file's size
    is a request, so only when asked)."""
    if _opened is None:
        try:
            _opened = _open_root(root, formats)
        except NotFoundError as exc:
            _name_run_root_below(exc, root, formats)
            raise
    storage, listing, layout, entries = _opened
    want_sizes = storage.local_root is not None if sizes is None else sizes
    pointer_names, problem = roots.read_pointer(listing, layout)
    named = {e.name for e, _ in entries}
    if pointer_names is not None and pointer_names not in named:
        if layout.pointer_names_any and pointer_names in listing.dirs:
            entries.append((Entry(pointer_names, True), None))  # a DeepSpeed tag of any name
        else:
            problem = f"names {pointer_names}, which is not a step here"
    keys = [f"{e.name}/{k}" if e.is_dir else e.name
            for e, _ in entries for k in (listing.under.get(e.name, []) if e.is_dir else [""])]
    stats = _stats(storage, keys, want_sizes)
    rows: list[StepRow] = []
    rules = listing.rules(layout)
    assert rules is not None  # (identify found its entries by them)
    for entry, step in entries:
        own = [f"{entry.name}/{k}" for k in listing.under.get(entry.name, [])] if entry.is_dir else [entry.name]
        status = rules.status_of(listing, entry)
        if entry.is_dir and listing.has(entry.name, OWNER_FILE):
            # a ckpt convert/reshard to an object store writes a step in place: until its owner
            # record goes (after the commit markers) it is not committed, whatever its files say
            status = roots.StepStatus(IN_PROGRESS, f"{OWNER_FILE} is there: a ckpt convert/reshard writing it "
                                                   "in place has not committed (killed, or still writing)")
        known = [stats[k] for k in own if k in stats]
        rows.append(StepRow(
            entry.name, step, roots.format_of(listing, layout, entry, formats), status.status, status.reason,
            files=len(own), size=sum(s for s, _ in known) if want_sizes else None,
            mtime=max((t for _, t in known if t is not None), default=None),
            url=f"{storage.url}/{entry.name}", is_dir=entry.is_dir,
        ))
    rows.sort(key=lambda r: (r.step is None, r.step if r.step is not None else 0, r.name))
    _apply_pointer(rows, layout, pointer_names if problem is None else None)
    result = RunListing(storage.url, layout, rows, layout.pointer if layout.pointer in listing.files else None,
                        pointer_names, problem, listing)
    return result


def _apply_pointer(rows: list[StepRow], layout: RunLayout, target: str | None) -> None:
    """Mark the step the pointer names; where the writer moves the pointer last, a newer step is a
    save in progress whatever its files say."""
    if target is None:
        return
    newest = max((r.step for r in rows if r.status == COMMITTED and r.step is not None), default=None)
    hit = next((r for r in rows if r.name == target), None)
    if hit is None:
        return
    hit.pointer = True
    hit.pointer_agrees = hit.status == COMMITTED and (newest is None or hit.step is None or newest <= hit.step)
    if hit.step is None:
        return
    for r in rows:
        if r is hit or r.step is None or r.step <= hit.step:
            continue
        r.pointer_agrees = r.status != COMMITTED
        if layout.pointer_is_commit and r.status == COMMITTED:
            r.status = IN_PROGRESS
            r.reason = (f"newer than {layout.pointer} ({target}), which the writer updates after a save: "
                        "this save may not have finished")


@dataclass
class Pick:
    """The step the framework's own resume opens, by its own rule (its pointer file where it
    has one, else layout.pick, else the newest committed step), or None when it opens none."""

    row: StepRow | None
    rule: str  # the rule in words (RunLayout.resume)
    problem: str | None = None  # why it opens none: no pointer file, a pointer naming nothing usable
    fails: bool = False  # its resume fails before it opens a step (not a fresh start)


def framework_pick(run: RunListing) -> Pick:
    """Which step of `run` the framework would resume from (its status says whether that works)."""
    layout = run.layout
    if layout.pointer_is_commit:
        if run.pointer_file is None:
            return Pick(None, layout.resume, f"no {layout.pointer}")
        if run.pointer_problem is not None:
            return Pick(None, layout.resume, f"{run.pointer_file}: {run.pointer_problem}")
        return Pick(next((r for r in run.steps if r.pointer), None), layout.resume)
    if layout.pick is not None and run.listing is not None:
        row = layout.pick(run.listing, run.steps)
        if isinstance(row, str):
            return Pick(None, layout.resume, row, fails=True)
        return Pick(row, layout.resume, None if row is not None else f"no step by its rule ({layout.resume})")
    done = [r for r in run.steps if r.status == COMMITTED]
    return Pick(done[-1] if done else None, layout.resume, None if done else "no committed step")


def confirm_steps(run: RunListing, listing: RootListing) -> None:
    """Where the layout has a commit rule that reads more than the listing (its rules confirm),
    apply it to the newest committed step, and the next one down while one is not (a small read
    each): what the framework's resume and `ckpt latest` judge by."""
    rules = listing.rules(run.layout)
    if rules is not None and rules.confirms:
        _confirm_newest(listing, rules, run.steps)


def confirm_row(run: RunListing, row: StepRow) -> None:
    """The layout's confirm rule on one committed step (a small read): a step its writer's whole rule denies
    is marked incomplete, with the reason."""
    rules = run.listing.rules(run.layout) if run.listing is not None else None
    if rules is None or not rules.confirms or run.listing is None or row.status != COMMITTED:
        return
    status = rules.confirm(run.listing, Entry(row.name, row.is_dir))
    if status.status != COMMITTED:
        row.status, row.reason = status.status, status.reason


def every_step(root: str, formats: Sequence[FormatInfo]) -> RunListing | None:
    """The listing of `root` when it is a run root (validate --step all: where each step is a
    checkpoint of its own, torchtitan, HF Trainer, NeMo 2, verl, validate checks them one by one;
    elsewhere the format's reader checks every step, and the listing says which steps are torn);
    None for any other path."""
    try:
        check_url(root)
        if not _may_be_run_root(Storage.open(root), formats):
            return None
        opened = _open_root(root, formats)
    except CkptError:
        return None
    return list_run(root, formats=formats, sizes=False, _opened=opened)


def step_checkpoint(run: RunListing, row: StepRow) -> str:
    """The path of the checkpoint of step `row` (inside its directory where the layout says so)."""
    return f"{row.url}/{run.layout.payload}" if run.layout.payload else row.url


# -- which step a path opens: the default (the newest complete step) and --step ---------------------

@dataclass
class OpenedStep:
    """The step of a run root that a command opened, and why that one (inspect, validate, diff,
    convert say it: one line on stderr, `opened` in --json)."""

    root: str
    name: str
    step: int | None
    status: str  # roots.STATUSES: the opened step's own state (a pointer may name a torn step)
    reason: str | None
    # "requested" (--step), "newest-complete", "pointer" (the framework's pointer file), "resume-rule"
    # (the framework's own rule picks a step that is not the newest complete one: HF Trainer, NeMo 2)
    chosen_by: str
    layout: str  # the framework's title
    pointer_file: str | None
    complete: list[str]  # the names of the root's committed steps, oldest first
    # every step of the root: name, step, status (the one table of states: committed / incomplete /
    # in-progress, as `ckpt ls` says it), reason
    steps: list[dict[str, Any]] = field(default_factory=list)
    requested: str | None = None  # --step's value, when given
    dirs: frozenset[str] = field(default=frozenset(), repr=False)  # the steps that are directories
    rule: str = ""  # how the framework picks the step it resumes from (RunLayout.resume)
    # the root's listing it was chosen from (validate of the root checks the other steps cheaply)
    run: RunListing | None = field(default=None, repr=False, compare=False)
    # opened by default where the framework's own resume opens no step (no pointer file, no `-last`
    # copy): why it opens none (it starts afresh), and how to pass this step to it explicitly
    no_pick: str | None = None
    explicit: str = ""

    def line(self) -> str:
        """`opened step-30 of ROOT (the newest of 3 complete steps; step-40 is incomplete: no .metadata ...)`."""
        return f"opened {self.name} of {self.root} ({self.why()})"

    def why(self) -> str:
        """Why this step, and the state of the newer ones passed over: `the newest of 3 complete
        steps; step-40 is incomplete: no .metadata ...` (inspect's header says it after the name)."""
        this = next((s for s in self.steps if s["name"] == self.name), None)
        newer = [s for s in self.steps if s["name"] != self.name and s["status"] != COMMITTED and this is not None
                 and (s["step"] is None or this["step"] is None or s["step"] >= this["step"])]
        if self.chosen_by == "requested":
            why = f"--step {self.requested}"
        elif self.chosen_by == "pointer":
            why = f"named by {self.pointer_file}, the step {self.layout} resumes from"
        elif self.chosen_by == "resume-rule":
            why = f"the step {self.layout} resumes from: {self.rule}"
        else:
            why = f"the newest of {_count(len(self.complete), 'complete step')}"
        parts = [why]
        if self.status != COMMITTED:
            parts.append(f"it is {self.status}: {self.reason}")
            if self.complete and self.name not in self.complete:
                parts.append(f"the newest complete step is {self.complete[-1]}")
        elif self.chosen_by != "requested" and newer:
            shown = newer[-1]
            more = f" (and {len(newer) - 1} more not complete)" if len(newer) > 1 else ""
            parts.append(f"{shown['name']} is {shown['status']}: {shown['reason']}{more}")
        return "; ".join(parts)

    def fallback(self) -> str | None:
        """What to say when the step opened by default does not open: `the newest complete step;
        --step 20 reads the one before` (None: asked for by --step, or no complete step before it)."""
        if self.chosen_by == "requested" or self.step is None:
            return None
        before = [s for s in self.steps if s["status"] == COMMITTED and s["step"] is not None and s["step"] < self.step]
        if not before:
            return None
        which = ("the newest complete step" if self.chosen_by == "newest-complete" else
                 f"the step {self.pointer_file} names" if self.chosen_by == "pointer" else
                 f"the step {self.layout} resumes from")
        return f"{which}; --step {before[-1]['step']} reads the one before"

    def others(self) -> list[dict[str, Any]]:
        """The root's other steps that are not complete (name, step, status, reason), oldest first:
        what validate of the root warns about besides the step it checks."""
        return [s for s in self.steps if s["name"] != self.name and s["status"] != COMMITTED]

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "name": self.name, "step": self.step, "status": self.status,
                "reason": self.reason, "chosen_by": self.chosen_by, "requested": self.requested,
                "layout": self.layout, "pointer": self.pointer_file, "complete": len(self.complete),
                "steps": self.steps, "line": self.line()}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


# the steps opened while a command runs (recording()): the CLI says them, the core never prints
_OPENED: contextvars.ContextVar[tuple[list[OpenedStep], Callable[[OpenedStep], None] | None] | None] = \
    contextvars.ContextVar("opened_steps", default=None)


@contextlib.contextmanager
def recording(on_open: Callable[[OpenedStep], None] | None = None) -> Iterator[list[OpenedStep]]:
    """Within it, each run-root step opened (by default or by --step) is appended to the list yielded,
    once per root and step, and passed to `on_open` as it is opened (the CLI's line on stderr)."""
    opened: list[OpenedStep] = []
    token = _OPENED.set((opened, on_open))
    try:
        yield opened
    finally:
        _OPENED.reset(token)


def opened_steps() -> list[OpenedStep]:
    """The steps opened so far within recording() (none outside it)."""
    current = _OPENED.get()
    return list(current[0]) if current is not None else []


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Within it, steps opened are not recorded: `ckpt ls --check` and `ckpt latest` validate each
    step through the root, and those are not the step a command opened."""
    token = _OPENED.set(None)
    try:
        yield
    finally:
        _OPENED.reset(token)


def _record(found: OpenedStep) -> None:
    current = _OPENED.get()
    if current is None:
        return
    opened, on_open = current
    if not any(o.root == found.root and o.name == found.name for o in opened):
        opened.append(found)
        if on_open is not None:
            on_open(found)


def _may_be_run_root(storage: Storage, formats: Sequence[FormatInfo]) -> bool:
    """Whether a top-level name is one a run layout names as a step or its pointer file: a cheap
    look (the directory's own listing) before the root's recursive LIST."""
    try:
        dirs, files = storage.listdir()
    except CkptError:
        return False
    for layout in roots.LAYOUTS:
        if layout.pointer and layout.pointer in files:
            return True
        names = roots.candidates(layout, dirs, files)
        rules = roots.rules_of(layout, formats) if names else None  # (no candidate: its rules are not loaded)
        if rules is not None and any(rules.step_of(n) is not None for n in names):
            return True
    return False


def resolve_step(root: str, step: str | int | None, formats: Sequence[FormatInfo],
                 storage: Storage | None = None) -> tuple[str, str | int | None, OpenedStep | None]:
    """(path to open, step for the format's reader, the step opened) for `root` and --step `step`.

    On a run root of any framework (roots.LAYOUTS): without --step (or --step latest) the step the
    framework resumes from: what its pointer file names where it has one (Megatron's tracker,
    DeepSpeed's `latest`, verl's tracker: their loaders open that step whether or not it is complete,
    so a torn one is opened and said to be torn), else the newest complete step by the writer's rule.
    --step N (a number or a step's name) opens that step whatever its state; a step that is not there
    is NotFoundError (exit 1, as a missing path). A path that is no run root is left to its reader:
    (root, step, None). Roots whose reader has its own step rules (Orbax, Flax/T5X, Megatron,
    DeepSpeed) get the root and the chosen step; the others the step's own directory."""
    try:
        check_url(root)
        # `storage`: the caller's, for `root`, so that its one listing serves the reader too
        storage = storage or Storage.open(root)
        if not _may_be_run_root(storage, formats):
            return root, step, None
        opened = _open_root(root, formats, storage)
    except CkptError:
        return root, step, None  # not a run root (one checkpoint, a file): the reader says what --step means there
    layout = opened[2]
    if step == "all":
        if layout.own_root:
            return root, step, None  # validate's every step: the format's reader checks them all
        # (validate --step all on these roots checks each step's directory: validate.every_step)
        raise UsageError("--step all: every step is validate's; give a step number, a step's name or 'latest'")
    run = list_run(root, formats=formats, sizes=False, _opened=opened)
    rows = run.steps
    text = None if step is None else str(step)
    if text in (None, "latest"):
        confirm_steps(run, opened[1])
    states = [{"name": r.name, "step": r.step, "status": r.status, "reason": r.reason} for r in rows]
    complete = [r.name for r in rows if r.status == COMMITTED]
    chosen_by = "requested"
    no_pick: str | None = None
    if text is not None and not text.strip():
        # never a step's name: the command line's mistake (exit 2), not a step the root lacks
        raise UsageError(f"--step {text!r}: empty; give a step number, a step's name or 'latest'")
    if text is None or text == "latest":
        if run.pointer_problem is not None and run.pointer_file is not None:
            if layout.own_root:
                # the format's reader reads the pointer file itself and says what is wrong with
                # it in its own words (validate: a finding naming the file)
                return root, step, None
            raise CorruptMetadataError(
                f"{run.pointer_problem}; {layout.title} resumes from the step it names: "
                "open a step with --step N (`ckpt ls` lists them)", f"{run.root}/{run.pointer_file}")
        # the step the framework's own resume opens, complete or not (a torn one is opened and
        # said to be torn: validate fails on it); where it opens none, the newest complete step
        pick = framework_pick(run)
        if pick.fails:
            # the framework's resume fails before it opens a step (torchtitan beside a step-N.bak/):
            # so does the default here, saying why, as with a pointer file that names nothing usable
            raise IncompleteCheckpointError(
                f"{pick.problem}: {layout.title} cannot resume here; open a step with --step N "
                "(`ckpt ls` lists them)", run.root)
        if pick.row is not None:
            done = [r for r in rows if r.status == COMMITTED]
            row = pick.row
            chosen_by = ("pointer" if layout.pointer_is_commit else
                         "newest-complete" if done and row is done[-1] else "resume-rule")
        else:
            done = [r for r in rows if r.status == COMMITTED]
            if not done and layout.own_root:
                # nothing complete: the format's reader says why in its own words (a DeepSpeed
                # step refused by name, a Megatron rank directory missing), as without a run root
                return root, step, None
            if not done:
                newest = rows[-1] if rows else None
                why = f" ({newest.name} is {newest.status}: {newest.reason})" if newest is not None else ""
                raise IncompleteCheckpointError(
                    f"no complete step to open{why}; `ckpt ls` lists the steps, --step N opens one anyway", run.root)
            no_pick = pick.problem
            # newest by number; among copies of one step (NeMo's `-last`), the later name
            row, chosen_by = done[-1], "newest-complete"
    else:
        matches = [r for r in rows if r.name == text or (is_ascii_number(text) and r.step == int(text))]
        if not matches and any(c.isnumeric() for c in text) and not is_ascii_number(text) \
                and all(c.isnumeric() or c.isspace() for c in text):
            # '²', '٣': digits Python would read, no writer names a step so: the value is wrong (exit 2)
            raise UsageError(f"--step {text!r}: a step number is ASCII digits 0-9 (or give a step's name)")
        if not matches:
            raise NotFoundError(f"--step {text}: no such step ({_steps_text(rows)})", run.root)
        # a step named twice (NeMo's `-last` copy beside the step's own directory): the complete one first
        matches.sort(key=lambda r: (r.status != COMMITTED, r.name))
        row = matches[0]
    found = OpenedStep(run.root, row.name, row.step, row.status, row.reason, chosen_by, layout.title,
                       run.pointer_file, complete, states, requested=text,
                       dirs=frozenset(r.name for r in rows if r.is_dir), rule=layout.resume, run=run,
                       no_pick=no_pick, explicit=layout.explicit)
    _record(found)
    if layout.own_root:
        # the format's reader opens the root at that step (its own step rules and notes apply)
        return root, (row.step if row.step is not None else row.name), found
    chosen = row.url
    return (f"{chosen}/{layout.payload}" if layout.payload else chosen), None, found


def _confirm_newest(listing: RootListing, rules: RunRules, rows: list[StepRow]) -> None:
    """Confirm the newest committed step by the writer's whole rule (rules.confirm: a small read),
    and the next one down while one is not: a step the listing calls committed but its commit
    record denies is marked incomplete (the reader passes over it, and so does the default)."""
    for row in sorted((r for r in rows if r.status == COMMITTED), key=lambda r: (r.step or 0, r.name), reverse=True):
        status = rules.confirm(listing, Entry(row.name, row.is_dir))
        if status.status == COMMITTED:
            return
        row.status, row.reason = status.status, status.reason


def _steps_text(rows: list[StepRow]) -> str:
    """"steps: 10, 20, 30 complete; 40 incomplete": the root's steps by state (the newest few)."""
    parts = []
    for status in roots.STATUSES:
        names = [str(r.step) if r.step is not None else r.name for r in rows if r.status == status]
        if names:
            shown = ", ".join(names[-6:]) + (" ..." if len(names) > 6 else "")
            parts.append(f"{shown} {status}")
    return "steps: " + "; ".join(parts) if parts else "no steps"


def step_path(root: str, step: str | int, formats: Sequence[FormatInfo]) -> tuple[str, str | int | None]:
    """(path, step for the format's reader) of step `step` of the run root at `root`: a number,
    an entry's name or 'latest' (resolve_step, without what it says about the step)."""
    path, for_reader, _ = resolve_step(root, step, formats)
    return path, for_reader
