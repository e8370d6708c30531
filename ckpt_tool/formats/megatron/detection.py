"""Whether a directory is a Megatron save or run root, from its listing: the registry asks every
format in turn, so this module imports nothing but `re` (the reader, the DCP and torch.save
packages behind it load only when a directory is Megatron's, or names its metadata.json)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...storage import Storage

NAME = "megatron"
CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^iter_(\d{7,})$")
LEGACY_RANK_DIR = re.compile(r"^mp_rank_\d{2}(?:_\d{3}){0,2}$")


def detect(storage: Storage) -> bool:
    """A save (metadata.json naming a sharded backend), or a run root (the tracker, or iter_N/ directories)."""
    dirs, files = storage.listdir()
    if CONFIG_FILE in files:
        if COMMON_FILE in files:
            return True  # (a damaged metadata.json beside common.pt is still a Megatron save, reported as such)
        from .reader import backend_of

        if backend_of(storage, quiet=True) is not None:
            return True
    if COMMON_FILE in files and ".metadata" in files:
        return True  # a save whose metadata.json was never written: interrupted
    if TRACKER_FILE in files:
        return True
    if any(LEGACY_RANK_DIR.match(d) for d in dirs):
        return True  # a legacy (--ckpt-format torch) step directory
    if "weights" in dirs and "context" in dirs:
        from . import nemo

        if nemo.is_nemo(storage, dirs):
            return True  # a NeMo 2 checkpoint
    return any(STEP_DIR.match(d) for d in dirs)
