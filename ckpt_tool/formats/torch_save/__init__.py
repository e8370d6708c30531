"""torch.save archives: one `.pt` / `.pth` / `.bin` file, a directory of them, a Hugging Face
sharded `.bin` set (`pytorch_model-0000K-of-0000N.bin` + `pytorch_model.bin.index.json`).

reader.py builds the tree from each archive's pickle (through the allow-list
unpickler in ckpt_tool/machinery/torch_save/, nothing executed) and reads tensors by byte
range of their storages; checks.py is validate's shallow checks and --deep's
CRC-32 of every storage. ckpt does not write torch.save files (convert to
safetensors, DCP or Orbax instead). The package's interface is the registry's:
NAME, detect, read, and for one file given by its path split_file and read_file.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["NAME", "detect", "layout_text", "read", "read_file", "split_file"]

NAME = "torch"  # (reader.NAME)

# The reader (and the unpickler behind it) is imported when a torch.save checkpoint is
# asked something: the registry asks every one-file format whether a path is its file,
# and `ckpt inspect DIR` on another format's directory should not pay for this one.


def split_file(url: str) -> tuple[str, str] | None:
    """(directory, file name) when `url` names one torch.save file (reader.split_local_file)."""
    if "://" not in url or url.startswith("file://"):
        local = os.path.abspath(os.path.expanduser(url[len("file://"):] if url.startswith("file://") else url))
        if os.path.isdir(local):
            return None  # a directory is never one file
    from .reader import split_local_file

    return split_local_file(url)


def detect(storage: Any) -> bool:
    from .reader import detect as detect_

    return detect_(storage)


def read(storage: Any, **kwargs: Any) -> Any:
    from .reader import read as read_

    return read_(storage, **kwargs)


def read_file(storage: Any, name: str, **kwargs: Any) -> Any:
    from .reader import read_file as read_file_

    return read_file_(storage, name, **kwargs)


def layout_text(ck: Any) -> str:
    from .reader import layout_text as layout_text_

    return layout_text_(ck)


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the type checker holds the package, its checks.py and write.py to the format contract (core/contract.py)
    from ...core import contract as _contract
    from . import checks as _checks
    from .. import torch_save as _package

    _conforms: _contract.FormatModule = _package
    _checks_conform: _contract.FormatChecksModule = _checks
