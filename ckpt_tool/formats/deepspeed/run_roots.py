"""A DeepSpeed root (global_stepN/ tags and the `latest` file) for formats/roots.py's table
(contract.RunRules): the tag names, what a step holds and how `latest` reads are the DeepSpeed
reader's, asked here rather than copied."""
from __future__ import annotations

from ...base.errors import CorruptMetadataError
from ...core.contract import COMMITTED, INCOMPLETE, Entry, RootView, RunRules, StepStatus


class DeepSpeedRoot(RunRules):
    """deepspeed/runtime/engine.py's save_checkpoint: a tag directory per save, `latest` written after."""

    def step_of(self, name: str) -> int | None:
        from . import reader

        m = reader.STEP_DIR.match(name)
        return int(m.group(1)) if m else None

    def status_of(self, listing: RootView, entry: Entry) -> StepStatus:
        from . import reader

        _, files = listing.top(entry.name)
        if reader.is_step_listing(sorted(files)):
            return StepStatus(COMMITTED)
        return StepStatus(INCOMPLETE, "no model or optimizer states files")

    def read_pointer(self, listing: RootView) -> str:
        from . import reader

        tag, problem = reader.read_latest(listing.storage)
        if tag is None:
            raise CorruptMetadataError(f"{reader.LATEST}: {problem}", f"{listing.storage.url}/{reader.LATEST}")
        return tag


RULES: dict[str, RunRules] = {"deepspeed": DeepSpeedRoot()}
