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
from ..storage import ReadLog, Storage, check_url


class FormatModule(Protocol):
    NAME: str

    def detect(self, storage: Storage) -> bool: ...

    def read(self, storage: Storage, *, step: str | int | None = None) -> Checkpoint: ...


# order matters only when two formats could claim one directory
# msgpack first: an orbax <= 0.4 save has OCDBT files but no _METADATA
FORMATS = ("msgpack", "orbax", "dcp", "safetensors")


def format_module(name: str) -> FormatModule:
    return importlib.import_module(f"{__name__}.{name}")  # type: ignore[return-value]


def detect(storage: Storage) -> FormatModule:
    for name in FORMATS:
        module = format_module(name)
        if module.detect(storage):
            return module
    from .unknown import describe

    # say what is there: checkpoints one level down (and how to pick one), or the files found
    raise UnknownFormatError(describe(storage, FORMATS, format_module), storage.url)


def open_checkpoint(url: str, *, step: str | int | None = None, log: ReadLog | None = None) -> Checkpoint:
    """Open the checkpoint at `url`, detecting its format; reads metadata only."""
    check_url(url)  # before a file's URL is cut to its directory: the error names the URL whole
    if url.rstrip("/").endswith(".safetensors"):  # one file, not a directory
        from .safetensors import reader as safetensors

        single = safetensors.split_file_url(url)
        if single is not None:
            return safetensors.read_file(Storage.open(single[0], log=log), single[1])
    from .msgpack.reader import split_local_file

    single_file = split_local_file(url)  # a Flax msgpack file's path
    if single_file is not None:
        from .msgpack import reader as msgpack_tree

        return msgpack_tree.read_file(Storage.open(single_file[0], log=log), single_file[1])
    from .unknown import refuse_file

    refuse_file(url)  # any other file: the checkpoint it sits in, or what it is
    storage = Storage.open(url, log=log)
    ckpt = detect(storage).read(storage, step=step)
    if TMP_MARKER in storage.url.rstrip("/").rsplit("/", 1)[-1]:
        # the temporary directory of an interrupted `ckpt convert` / `reshard`
        ckpt.committed = False
        ckpt.notes.insert(0, "unfinished ckpt output (temporary directory of an interrupted convert or reshard)")
    return ckpt


# temporary output directories of convert/reshard carry this in their name
TMP_MARKER = ".ckpt-tmp"
