"""Flax's checkpoint_N files and T5X's checkpoint_N/ directories, for formats/roots.py's table
(contract.RunRules): their step names and temporary names are the light detection module's (the
reader's own), asked here rather than copied; the msgpack reader itself is never loaded for them."""
from __future__ import annotations

from ...core.contract import COMMITTED, INCOMPLETE, IN_PROGRESS, Entry, RootView, RunRules, StepStatus
from . import detection


class FlaxFiles(RunRules):
    """flax.training.checkpoints (orbax off): `checkpoint_N` files, `checkpoint_tmp` while writing."""

    def step_of(self, name: str) -> int | None:
        if not name.startswith("checkpoint"):
            return None
        if detection.FLAX_TMP.match(name):
            return -1  # flax's `checkpoint_tmp`: a save in progress, of no step yet
        return detection.step_of(name) if name.startswith("checkpoint_") else None

    def status_of(self, listing: RootView, entry: Entry) -> StepStatus:
        if detection.FLAX_TMP.match(entry.name):
            return StepStatus(IN_PROGRESS, "flax's temporary file: renamed to checkpoint_N when written")
        return StepStatus(COMMITTED)


class T5xDirectories(RunRules):
    """t5x/checkpoints.py: `checkpoint_N/` holding the `checkpoint` tree file (orbax <= 0.4's too)."""

    def step_of(self, name: str) -> int | None:
        return detection.step_of(name) if name.startswith("checkpoint_") else None

    def owns(self, listing: RootView, entry: Entry) -> bool:
        if detection.is_tmp(entry.name):
            return True
        dirs, files = listing.top(entry.name)
        if detection.ORBAX_TREE_METADATA in files:
            return False  # orbax >= 0.5's
        # the tree file, or (a save torn before it) t5x's per-array directories, named after the tree's keys
        return detection.TREE_FILE in files or any(d.startswith(("target.", "state.")) for d in dirs)

    def status_of(self, listing: RootView, entry: Entry) -> StepStatus:
        if detection.is_tmp(entry.name):
            return StepStatus(IN_PROGRESS, "temporary directory name: t5x renames checkpoint_N.tmp-<time> when written")
        _, files = listing.top(entry.name)
        if detection.TREE_FILE not in files:
            return StepStatus(INCOMPLETE, f"no {detection.TREE_FILE} file (the tree, written last)")
        return StepStatus(COMMITTED)


RULES: dict[str, RunRules] = {"flax": FlaxFiles(), "t5x": T5xDirectories()}
