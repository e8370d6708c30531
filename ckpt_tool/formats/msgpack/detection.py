"""What the registry asks the msgpack package before anything is read: whether a directory may
be a msgpack checkpoint, and whether a local file is one. Imports nothing heavy: `ckpt inspect`
of an Orbax or DCP directory asks this package first and must not load its reader (nor the
Orbax zarr plumbing the reader shares) to hear "no".

The cheap test here (may_hold) only answers "no" when the reader's own detect would look at
nothing: no `checkpoint` file, no step-named sub-directory and no file it would sniff. Anything
else goes to reader.detect, which decides (the package's detect asks both: this module never
imports the reader, which imports it).
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...storage import Storage

NAME = "msgpack"

TREE_FILE = "checkpoint"  # orbax's aggregate file, and T5X's
# orbax >= 0.5 writes it beside (or instead of) `checkpoint`, and then the Orbax reader reads the
# step (the Orbax reader's TREE_METADATA; named here so that asking costs no import of it)
ORBAX_TREE_METADATA = "_METADATA"
# loose files with a dot in their name that may hold a tree all the same
TREE_SUFFIXES = (".msgpack", ".mpk", ".flax")
# a step entry: `checkpoint_12` (flax, t5x; any prefix), or `12`
_STEP_NAME = re.compile(r"^(?:.*\D)?(\d+)$")
# unfinished saves: flax's `checkpoint_tmp` file, t5x's `checkpoint_12.tmp-<time>`, orbax's tmp suffixes
FLAX_TMP = re.compile(r"^(?:.*_)?tmp$")
T5X_TMP = re.compile(r"\.tmp-\d+$")
_ORBAX_TMP = re.compile(r"\.orbax-checkpoint-tmp(-\d+)?$")


def _untmp(name: str) -> str:
    return T5X_TMP.sub("", _ORBAX_TMP.sub("", name))


def is_tmp(name: str) -> bool:
    """Whether a step entry's name is that of a save still being written (flax, t5x, orbax)."""
    return bool(_ORBAX_TMP.search(name)) or bool(T5X_TMP.search(name)) or bool(FLAX_TMP.match(name))


def step_of(name: str) -> int | None:
    """The step number in a step entry's name (`checkpoint_12`, `12`, unfinished ones too), or None."""
    m = _STEP_NAME.match(_untmp(name))
    return int(m.group(1)) if m else None


def sniffed_file(name: str) -> bool:
    """Whether the reader looks at a top-level file's first bytes (reader._entries' rule)."""
    if name.startswith((".", "_")):
        return False
    stepish = step_of(name) is not None or FLAX_TMP.match(name)
    return bool(stepish) or "." not in name or name.endswith(TREE_SUFFIXES)


def may_hold(storage: Storage) -> bool:
    """False when the reader's detect would look at nothing in the directory (see above)."""
    dirs, files = storage.listdir()
    if ORBAX_TREE_METADATA in files:
        return False
    return TREE_FILE in files or any(step_of(d) is not None for d in dirs) or any(sniffed_file(f) for f in files)


def split_local_file(url: str) -> tuple[str, str] | None:
    """(directory, file name) when `url` is a local path naming a file that holds a msgpack tree."""
    if "://" in url and not url.startswith("file://"):
        return None  # object stores: a checkpoint is a prefix (directory) there
    path = os.path.abspath(os.path.expanduser(url[len("file://"):] if url.startswith("file://") else url))
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError:
        return None
    from .scan import sniff

    return (os.path.dirname(path), os.path.basename(path)) if sniff(head) else None
