"""Format registry: each format is one module with `detect` and `read`.

Adding a format (safetensors, Megatron) means a new module and one line in
FORMATS; nothing above the readers changes. Modules import lazily so that
`ckpt inspect` on a DCP checkpoint never loads the Orbax reader and vice versa.
"""
from __future__ import annotations

import importlib
from typing import Protocol

from ..errors import UnknownFormatError
from ..model import Checkpoint
from ..storage import ReadLog, Storage


class FormatModule(Protocol):
    NAME: str

    def detect(self, storage: Storage) -> bool: ...

    def read(self, storage: Storage, *, step: str | int | None = None) -> Checkpoint: ...


# order matters only when two formats could claim one directory
FORMATS = ("orbax", "dcp")


def format_module(name: str) -> FormatModule:
    return importlib.import_module(f"{__name__}.{name}")  # type: ignore[return-value]


def detect(storage: Storage) -> FormatModule:
    for name in FORMATS:
        module = format_module(name)
        if module.detect(storage):
            return module
    _, files = storage.listdir()
    seen = ", ".join(sorted(files)[:5]) or "no files"
    raise UnknownFormatError(
        f"not an Orbax or torch.distributed.checkpoint checkpoint (found {seen})", storage.url
    )


def open_checkpoint(url: str, *, step: str | int | None = None, log: ReadLog | None = None) -> Checkpoint:
    """Open the checkpoint at `url`, detecting its format; reads metadata only."""
    storage = Storage.open(url, log=log)
    ckpt = detect(storage).read(storage, step=step)
    if TMP_MARKER in storage.url.rstrip("/").rsplit("/", 1)[-1]:
        # the temporary directory of an interrupted `ckpt convert` / `reshard`
        ckpt.committed = False
        ckpt.notes.insert(0, "unfinished ckpt output (temporary directory of an interrupted convert or reshard)")
    return ckpt


# temporary output directories of convert/reshard carry this in their name
TMP_MARKER = ".ckpt-tmp"
