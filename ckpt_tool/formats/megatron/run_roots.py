"""Megatron-LM's iter_N/ roots and NeMo 2's step directories, for formats/roots.py's table
(contract.RunRules): the step names, the tracker and what a save writes last are the Megatron
reader's (and its NeMo layout's), asked here rather than copied. Imported when a root's names may
be these frameworks' steps; the reader only when one is asked about."""
from __future__ import annotations

import re

from ...core.contract import COMMITTED, INCOMPLETE, IN_PROGRESS, Entry, RootView, RunRules, StepStatus


class MegatronRoot(RunRules):
    """megatron/training/checkpointing.py: iter_NNNNNNN/ (release/) and latest_checkpointed_iteration.txt."""

    def step_of(self, name: str) -> int | None:
        from . import reader

        m = reader.STEP_DIR.match(name)
        return int(m.group(1)) if m else (0 if name == reader.RELEASE_DIR else None)

    def status_of(self, listing: RootView, entry: Entry) -> StepStatus:
        from . import reader

        dirs, files = listing.top(entry.name)
        # the reader's rule (reader._steps): metadata.json is written last by rank 0; legacy saves are rank directories
        if reader.CONFIG_FILE in files or any(reader.LEGACY_RANK_DIR.match(d) for d in dirs):
            return StepStatus(COMMITTED)
        return StepStatus(INCOMPLETE, f"no {reader.CONFIG_FILE}: Megatron writes it last")

    def read_pointer(self, listing: RootView) -> str:
        from . import reader

        name = reader.read_tracker(listing.storage)
        assert name is not None  # called only when the file is there
        return name


_NEMO_STEP = re.compile(r"(?:^|-)step=(\d+)(?:-|$)")
NEMO_UNFINISHED = "-unfinished"


class NemoRoot(RunRules):
    """NeMo 2's ModelCheckpoint: `<name>--<metric>-step=N-consumed_samples=M/` (and its -last copy),
    each a Megatron-Core save under weights/ with the model's config under context/."""

    def step_of(self, name: str) -> int | None:
        m = _NEMO_STEP.search(name)
        return int(m.group(1)) if m else None

    def owns(self, listing: RootView, entry: Entry) -> bool:
        from . import nemo

        dirs, _ = listing.top(entry.name)
        return nemo.WEIGHTS in dirs or nemo.CONTEXT in dirs or f"{entry.name}{NEMO_UNFINISHED}" in listing.files

    def status_of(self, listing: RootView, entry: Entry) -> StepStatus:
        from . import nemo

        # ModelCheckpoint._save_checkpoint touches `<name>-unfinished` beside the directory before
        # the save and removes it once the (async) save is finalized
        if f"{entry.name}{NEMO_UNFINISHED}" in listing.files:
            return StepStatus(IN_PROGRESS, f"{entry.name}{NEMO_UNFINISHED} is there: NeMo removes it when the save is finalized")
        dirs, _ = listing.top(entry.name)
        _, weights = listing.top(entry.name, nemo.WEIGHTS)
        if "metadata.json" not in weights:
            return StepStatus(INCOMPLETE, f"no {nemo.WEIGHTS}/metadata.json: Megatron writes it last")
        if nemo.CONTEXT not in dirs:
            return StepStatus(INCOMPLETE, f"no {nemo.CONTEXT}/ (the model's config)")
        return StepStatus(COMMITTED)


RULES: dict[str, RunRules] = {"megatron": MegatronRoot(), "nemo2": NemoRoot()}
