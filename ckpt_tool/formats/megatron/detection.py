"""The names that tell a Megatron save or run root from its listing: the registry asks every
format in turn, so this module imports nothing but `re` (the package's detect asks these names
first; the reader, and the DCP and torch.save machinery behind it, load only when a directory
is Megatron's, or names its metadata.json)."""
from __future__ import annotations

import re
NAME = "megatron"
CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^iter_(\d{7,})$")
LEGACY_RANK_DIR = re.compile(r"^mp_rank_\d{2}(?:_\d{3}){0,2}$")


def may_hold(dirs: list[str], files: list[str]) -> bool:
    """Whether a directory's listing names anything Megatron writes (reader.detect decides)."""
    return (CONFIG_FILE in files or (COMMON_FILE in files and ".metadata" in files) or TRACKER_FILE in files
            or any(LEGACY_RANK_DIR.match(d) or STEP_DIR.match(d) for d in dirs)
            or ("weights" in dirs and "context" in dirs))
