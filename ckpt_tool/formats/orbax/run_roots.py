"""An Orbax CheckpointManager root's rules for formats/roots.py's table (contract.RunRules): its
step names, markers and commit rules are the reader's (per orbax version), asked here rather than
copied. The reader is imported only when an entry may be a step: a root of another framework asks
this module too."""
from __future__ import annotations

from ...core.contract import COMMITTED, INCOMPLETE, IN_PROGRESS, Entry, RootView, RunRules, StepStatus


class ManagerRoot(RunRules):
    confirms = True

    def step_of(self, name: str) -> int | None:
        from . import reader

        return reader.step_number(name)

    def owns(self, listing: RootView, entry: Entry) -> bool:
        from . import reader

        if reader.is_tmp_name(entry.name):
            return True
        dirs, files = listing.top(entry.name)
        # (not manifest.ocdbt alone: orbax <= 0.4's checkpoint_N/ has one and no _METADATA: the msgpack reader's)
        markers = (reader.CHECKPOINT_METADATA, reader.TREE_METADATA, reader.COMMIT_MARKER)
        if any(m in files for m in markers):
            return True
        # items (<item>/_METADATA); orbax <= 0.4's items hold the msgpack `checkpoint` file instead
        return any(listing.has(entry.name, f"{d}/{reader.TREE_METADATA}") or listing.has(entry.name, f"{d}/checkpoint")
                   for d in dirs)

    def status_of(self, listing: RootView, entry: Entry) -> StepStatus:
        from . import reader

        if reader.is_tmp_name(entry.name):
            return StepStatus(IN_PROGRESS, "temporary directory name: orbax renames it at commit")
        _, files = listing.top(entry.name)
        status = reader.listed_commit_status(listing.storage, entry.name, sorted(files))
        return StepStatus(COMMITTED) if status.committed else StepStatus(INCOMPLETE, status.reason)

    def confirm(self, listing: RootView, entry: Entry) -> StepStatus:
        """orbax's whole commit rule: _CHECKPOINT_METADATA read (a damaged one is no commit)."""
        from . import reader

        if reader.is_tmp_name(entry.name):
            return self.status_of(listing, entry)
        _, files = listing.top(entry.name)
        step = listing.storage.child(entry.name)
        status = reader.commit_status(step, entry.name, sorted(files), reader.read_step_metadata(step, sorted(files)))
        return StepStatus(COMMITTED) if status.committed else StepStatus(INCOMPLETE, status.reason)


RULES: dict[str, RunRules] = {"orbax": ManagerRoot()}
