"""Run roots: the steps a training run saved, which are finished, and which one to resume from.

list_run() lists a run root (`ckpt ls`): one row per step with its status by
its writer's rule, from one LIST of the root (plus the framework's pointer
file); `check=True` runs validate's shallow checks (`deep`: --deep) on each
step. latest() picks what a launcher resumes from (`ckpt latest`): the
newest step complete by its writer's rule that passes validate; a step the
pointer names but that fails is reported, never returned. step_path()
resolves `--step` on any run root (diff across steps).

Which framework a root belongs to, and each framework's rules, are the run
layouts' table (formats/roots.py); nothing here names a framework or format.
Nothing here prints: the commands render what these return.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import CkptError, NotFoundError, UnknownFormatError, UsageError
from .findings import ERROR
from .formats import roots
from .formats.roots import COMMITTED, IN_PROGRESS, Entry, RootListing, RunLayout
from .storage import Storage, check_url
from .text import is_ascii_number

__all__ = ["StepRow", "RunListing", "Latest", "list_run", "latest", "step_path"]

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

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "name": self.name, "format": self.format, "status": self.status,
            "reason": self.reason, "size": self.size, "files": self.files, "mtime": self.mtime,
            "pointer": self.pointer, "pointer_agrees": self.pointer_agrees, "path": self.url, "check": self.check,
        }


@dataclass
class RunListing:
    root: str
    layout: RunLayout
    steps: list[StepRow]
    pointer_file: str | None = None  # the pointer file's name when it is there
    pointer_names: str | None = None  # the entry it names
    pointer_problem: str | None = None  # why it names nothing usable

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root, "layout": self.layout.name, "title": self.layout.title,
            "pointer": None if self.pointer_file is None else {
                "file": self.pointer_file, "names": self.pointer_names, "problem": self.pointer_problem},
            "steps": [s.to_json() for s in self.steps],
        }


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

    @property
    def path(self) -> str | None:
        return self.chosen.url if self.chosen is not None else None

    def to_json(self) -> dict[str, Any]:
        c = self.chosen
        return {
            "ok": c is not None, "root": self.root, "layout": self.layout, "deep": self.deep,
            "path": self.path, "step": c.step if c else None, "name": c.name if c else None,
            "format": c.format if c else None,
            "pointer": None if self.pointer_file is None else {
                "file": self.pointer_file, "names": self.pointer_names, "problem": self.pointer_problem},
            "skipped": self.skipped,
        }


def _open_root(root: str) -> tuple[Storage, RootListing, RunLayout, list[tuple[Entry, int | None]]]:
    check_url(root)
    storage = Storage.open(root)
    listing = RootListing.of(storage)
    found = roots.identify(listing)
    if found is None:
        raise NotFoundError(
            "not a run root: no step directories of a framework ckpt knows ("
            + ", ".join(layout.named.split(" ")[0].strip("`") for layout in roots.LAYOUTS) + ")", storage.url)
    layout, entries = found
    return storage, listing, layout, entries


def _stats(storage: Storage, keys: list[str], want_sizes: bool) -> dict[str, tuple[int, float | None]]:
    if not want_sizes:
        return {}
    if storage.local_root is not None:
        return {k: storage.stat(k) for k in keys}
    with ThreadPoolExecutor(max_workers=_STAT_WORKERS, thread_name_prefix="ckpt-stat") as pool:
        return dict(zip(keys, pool.map(storage.stat, keys)))


def list_run(root: str, *, check: bool = False, deep: bool = False, sizes: bool | None = None,
             progress: Callable[[str, int, int], None] | None = None) -> RunListing:
    """The steps of the run root at `root`, sorted by step (listing only unless `check`).

    `sizes`: add each step's bytes (default: on local roots; on object stores each file's size
    is a request, so only when asked). `check`: run validate on each step (`deep`: --deep)."""
    storage, listing, layout, entries = _open_root(root)
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
    for entry, step in entries:
        own = [f"{entry.name}/{k}" for k in listing.under.get(entry.name, [])] if entry.is_dir else [entry.name]
        status = layout.status_of(listing, entry)
        known = [stats[k] for k in own if k in stats]
        rows.append(StepRow(
            entry.name, step, roots.format_of(listing, layout, entry), status.status, status.reason,
            files=len(own), size=sum(s for s, _ in known) if want_sizes else None,
            mtime=max((t for _, t in known if t is not None), default=None),
            url=f"{storage.url}/{entry.name}", is_dir=entry.is_dir,
        ))
    rows.sort(key=lambda r: (r.step is None, r.step if r.step is not None else 0, r.name))
    _apply_pointer(rows, layout, pointer_names if problem is None else None)
    result = RunListing(storage.url, layout, rows, layout.pointer if layout.pointer in listing.files else None,
                        pointer_names, problem)
    if check:
        for i, row in enumerate(rows):
            if progress is not None:
                progress("checking steps", i, len(rows))
            row.check = _checked(storage.url, layout, row, deep)
        if progress is not None:
            progress("checking steps", len(rows), len(rows))
    return result


def _apply_pointer(rows: list[StepRow], layout: RunLayout, target: str | None) -> None:
    """Mark the step the pointer names; where the writer moves the pointer last, a newer step is a
    save in progress whatever its files say."""
    if target is None:
        return
    done = [r for r in rows if r.status == COMMITTED and r.step is not None]
    newest = max(done, key=lambda r: r.step) if done else None  # type: ignore[arg-type,return-value]
    hit = next((r for r in rows if r.name == target), None)
    if hit is None:
        return
    hit.pointer = True
    hit.pointer_agrees = hit.status == COMMITTED and (newest is None or hit.step is None or newest.step <= hit.step)
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


def _validate(root_url: str, layout: RunLayout, row: StepRow, deep: bool) -> Any:
    """validate's report on one step (shallow, or deep)."""
    from .validate import validate_checkpoint

    by_root = {"step": row.step if row.step is not None else row.name, "deep": deep}
    if not row.is_dir:
        # a file step (Flax checkpoint_N): through the root, by the format's own step rules, so that
        # object stores work too
        return validate_checkpoint(root_url, **by_root)
    url = f"{row.url}/{layout.payload}" if layout.payload else row.url
    try:
        # the step alone (through the root, orbax's reader would read every step's metadata first)
        return validate_checkpoint(url, deep=deep)
    except UnknownFormatError:
        if not layout.own_root:
            raise
        # a step that is not a checkpoint on its own (orbax <= 0.4's named items): through the root
        return validate_checkpoint(root_url, **by_root)


def _checked(root_url: str, layout: RunLayout, row: StepRow, deep: bool) -> dict[str, Any]:
    """validate's verdict on one step; a step no reader opens fails with that one line."""
    try:
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


def latest(root: str, deep: bool = False) -> Latest:
    """The newest step of the run root at `root` that is complete by its writer's rule and passes
    validate's shallow checks (`deep`: decodes every chunk too). `.path` is None when there is none;
    `.skipped` says why each newer step was passed over (the pointer's target included)."""
    listing = list_run(root, sizes=False)
    found = Latest(listing.root, listing.layout.name, deep, None, pointer_file=listing.pointer_file,
                   pointer_names=listing.pointer_names, pointer_problem=listing.pointer_problem)
    # newest first; where the writer moves its pointer last, a pointer's step without a number (a
    # DeepSpeed tag of any name) first: it is the newest by the writer's rule
    first = listing.layout.pointer_is_commit
    order = sorted(listing.steps, reverse=True,
                   key=lambda r: (first and r.pointer and r.step is None, r.step is not None, r.step or 0, r.name))
    for row in order:
        if row.status != COMMITTED:
            found.skipped.append({"name": row.name, "step": row.step, "status": row.status, "reason": row.reason,
                                  "pointer": row.pointer})
            continue
        verdict = _checked(listing.root, listing.layout, row, deep)
        if verdict["ok"]:
            found.chosen = row
            break
        found.skipped.append({"name": row.name, "step": row.step, "status": "fails validate",
                              "reason": verdict["first"], "pointer": row.pointer})
    return found


def step_path(root: str, step: str | int) -> tuple[str, str | int | None]:
    """(path, step for the format's reader) of step `step` of the run root at `root`: a number,
    an entry's name or 'latest'. Roots whose format reader has its own step rules (Orbax, Flax/T5X,
    Megatron, DeepSpeed) are left to it, and so is a path that is not a run root: (root, step)."""
    try:
        _, listing, layout, entries = _open_root(root)
    except CkptError:
        return root, step  # not a run root (one checkpoint, a file): the reader says what --step means there
    if layout.own_root:
        return root, step
    text = str(step)
    if text == "latest":
        found = latest(root)
        if found.path is None:
            raise NotFoundError("--step latest: no complete step that passes validate", listing.storage.url)
        chosen = found.path
    else:
        names = {e.name: e for e, _ in entries}
        matches = [e for e, n in entries if e.name == text or (is_ascii_number(text) and n == int(text))]
        if not matches:
            have = ", ".join(sorted((str(n) for _, n in entries if n is not None), key=int)[-6:]) or "none"
            raise UsageError(f"--step {text}: no such step in {listing.storage.url} (steps: {have})")
        # a step named twice (NeMo's `-last` copy beside the step's own directory): the complete one first
        matches.sort(key=lambda e: (layout.status_of(listing, e).status != COMMITTED, e.name))
        chosen = f"{listing.storage.url}/{names[matches[0].name].name}"
    return (f"{chosen}/{layout.payload}" if layout.payload else chosen), None
