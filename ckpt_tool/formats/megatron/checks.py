"""validate for Megatron saves and run roots: metadata.json, the DCP part, common.pt, the tracker.

A save: metadata.json present (a save without it is interrupted: `uncommitted-save`), valid and
naming a backend megatron writes (`bad-metadata`); the torch_dist part gets every check DCP
gets (ckpt_tool/machinery/dcp/checks.py: `.metadata`, each rank's `.distcp` there and long enough,
chunks tiling their tensors, ...) with Megatron's pickled plan classes admitted by name, and
findings naming the leaves as `ckpt inspect` does; `common.pt` gets the torch.save checks (a
file torch could not load: `bad-metadata`, `truncated-file`; a global outside Megatron's data
classes: `unsafe-pickle`). `--deep` adds DCP's (every bytes item decoded, replicated
duplicates) and decodes every common.pt value.

A run root: latest_checkpointed_iteration.txt readable and naming a step directory that exists
(`missing-file`), step directories without metadata.json (`uncommitted-save`, a warning: an
interrupted save megatron's loader never picks), then the chosen step (the tracker's, or
--step) checked as a save, its files named under their step directory.
"""
from __future__ import annotations

from typing import Any

from ...base.errors import CkptError, PathEscapeError
from ...base.findings import Findings
from ...core.model import keys_path
from ...storage import Storage
from . import pickled
from . import reader as mg
from .common import split_name


class _Under:
    """Findings of a step directory's checks, their files named from the root."""

    def __init__(self, findings: Findings, prefix: str) -> None:
        self._findings = findings
        self._prefix = prefix

    def _file(self, file: str | None) -> str:
        return f"{self._prefix}/{file}" if file else self._prefix

    def error(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None:
        self._findings.error(code, message, leaf=leaf, file=self._file(file))

    def warning(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None:
        self._findings.warning(code, message, leaf=leaf, file=self._file(file))

    def count(self, what: str, n: int = 1) -> None:
        self._findings.count(what, n)

    @property
    def errors(self) -> list[Any]:
        return self._findings.errors


def manifest_covers(name: str) -> bool:
    """For validate's manifest check: the top-level files a Megatron integrity.json names."""
    from . import integrity

    return integrity.covers(name)


def leaf_path(fqn: str) -> str:
    return keys_path(split_name(fqn))


def check_path(storage: Storage, findings: Findings, *, step: str | int | None = None, only: str | None = None) -> None:
    dirs, files = storage.listdir()
    from . import nemo

    if mg.CONFIG_FILE not in files and nemo.is_nemo(storage, dirs):
        nemo.check(storage, findings, _check_save, _Under)
        return
    if mg.CONFIG_FILE in files or mg.COMMON_FILE in files or \
            not (mg.TRACKER_FILE in files or any(mg.STEP_DIR.match(d) for d in dirs)):
        _check_save(storage, findings)
        return
    try:
        tracker = mg.read_tracker(storage)
    except PathEscapeError:
        raise
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=mg.TRACKER_FILE)
        tracker = None
    steps = mg._steps(storage, tracker)
    names = {s.name for s in steps}
    if tracker is not None and tracker not in names:
        findings.error("missing-file", f"names {tracker}, which does not exist (Megatron's load fails on it)",
                       file=mg.TRACKER_FILE)
    for s in steps:
        if not s.committed:
            findings.warning("uncommitted-save", s.reason or "not complete", file=s.name)
    findings.count("steps", len(steps))
    if step == "all":  # validate --step all: every complete step (a torn one is the warning above)
        done = [s for s in steps if s.committed]
        for s in done:
            _check_save(storage.child(s.name), _Under(findings, s.name))  # type: ignore[arg-type]
        if not done:
            findings.error("no-steps", "no complete step directory", file=".")
        return
    try:
        chosen = mg._chosen(storage, step, tracker if tracker in names else None, steps)
    except CkptError as exc:
        if not findings.errors:
            findings.error("no-steps", exc.message, file=".")
        return
    _check_save(storage.child(chosen), _Under(findings, chosen))  # type: ignore[arg-type]


def _check_save(storage: Storage, findings: Findings) -> None:
    dirs, files = storage.listdir()
    if mg.CONFIG_FILE not in files and mg.COMMON_FILE not in files and any(mg.LEGACY_RANK_DIR.match(d) for d in dirs):
        from . import legacy

        legacy.check(storage, findings)
        return
    if mg.CONFIG_FILE not in files:
        findings.error("uncommitted-save", "no metadata.json: an interrupted Megatron save (rank 0 writes it last)",
                       file=mg.CONFIG_FILE)
        return
    try:
        config = mg.read_config(storage)
    except PathEscapeError:
        raise
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=mg.CONFIG_FILE)
        return
    from . import integrity

    if integrity.FILE in files and isinstance(findings, _Under):
        # a save inside what validate was given (a run root's step, NeMo's weights/); the
        # manifest of the path itself is validate's to check, for every format
        integrity.check(storage, findings)
    backend = config["sharded_backend"]
    if backend == "zarr":
        from . import zarr_backend

        zarr_backend.check(storage, findings, leaf_path)
        _check_common(storage, findings)
        return
    if backend != "torch_dist":
        findings.error("bad-metadata", f"sharded_backend {backend!r}: not a backend Megatron-Core writes",
                       file=mg.CONFIG_FILE)
        return
    from ...machinery.dcp import checks as dcp_checks

    dcp_checks.check_path(storage, findings, allow=pickled.ALLOW, leaf_path=leaf_path)
    _check_common(storage, findings)


def _check_common(storage: Storage, findings: Findings) -> None:
    from ...machinery.torch_save import checks as ts_checks

    if not storage.exists(mg.COMMON_FILE):
        findings.error("missing-file", "rank 0 writes it with every save; Megatron's load needs it", file=mg.COMMON_FILE)
        return
    ts_checks.check_file(storage, mg.COMMON_FILE, findings, allow=pickled.ALLOW)


def check_deep(storage: Storage, ckpt: Any, findings: Findings, skip_leaves: set[str]) -> None:
    """--deep beyond the tensors: DCP's (every bytes item, replicated duplicates) on the step read,
    and every common.pt value decoded."""
    from ...machinery.dcp import checks as dcp_checks

    save = storage
    dirs, files = storage.listdir()
    if ckpt.steps:
        # a run root's step: --deep opens the step itself (ckpt.path is the step directory), and
        # its files are named from the root, as the shallow checks name them
        name = mg.step_dir(ckpt.step) if ckpt.step else mg.RELEASE_DIR
        if storage.url.rstrip("/").rsplit("/", 1)[-1] != name:
            save = storage.child(name)
        findings = _Under(findings, name)  # type: ignore[assignment]
    elif mg.CONFIG_FILE not in files and ckpt.layout.get("nemo"):
        save = storage.child("weights")  # a NeMo 2 checkpoint's save
        findings = _Under(findings, "weights")  # type: ignore[assignment]
    from . import integrity, legacy

    if isinstance(findings, _Under) and integrity.FILE in save.listdir()[1]:
        integrity.check_deep(save, findings)  # (the given path's own manifest: validate checks it)
    if ckpt.layout.get("backend") == legacy.BACKEND:
        legacy.check_deep(save, ckpt, findings, skip_leaves)
        return
    if ckpt.layout.get("backend") == "zarr":
        from . import zarr_backend

        zarr_backend.check_deep(save, ckpt, findings, skip_leaves)
        return
    dcp_checks.check_deep(save, ckpt, findings, skip_leaves, allow=pickled.ALLOW, leaf_path=leaf_path)
