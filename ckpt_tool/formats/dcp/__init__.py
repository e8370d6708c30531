"""torch.distributed.checkpoint (DCP) directories: `.metadata` and `__<rank>_<n>.distcp` files.

ckpt_tool/machinery/dcp/ reads and checks them without torch (the shared DCP machinery:
Megatron's torch_dist saves are DCP files too); write.py writes them (convert);
checks.py is validate's (distcp's checks). The package's interface is the
registry's: NAME, detect, read.
"""
from __future__ import annotations

from typing import Any

from ...core.model import Checkpoint
from ...storage import Storage

NAME = "dcp"

__all__ = ["NAME", "detect", "read", "layout_text"]

# The shared DCP reader (and its pickle checks, hashlib) is imported where a DCP is detected or
# read: a convert to DCP imports this package for its write.py, which needs none of it.


def detect(storage: Storage) -> bool:
    """A DCP directory: `.metadata`, or (an uncommitted save) top-level `.distcp` files."""
    from ...machinery.dcp import reader

    return reader.detect(storage)


def read(storage: Storage, *, step: str | int | None = None) -> Checkpoint:
    """Open a DCP checkpoint: reads `.metadata` and nothing else."""
    from ...machinery.dcp import reader

    return reader.read(storage, fmt=NAME, step=step, note_others=True)


def layout_text(ck: Any) -> str:
    """inspect's "format" row: "torch.distributed.checkpoint, 4 files, 4 ranks"."""
    lay = ck.layout
    text = "torch.distributed.checkpoint"
    if lay.get("files") is not None:
        text += f", {lay['files']} file{'s' if lay['files'] != 1 else ''}"
    if lay.get("ranks"):
        text += f", {lay['ranks']} rank{'s' if lay['ranks'] != 1 else ''}"
    return text


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the type checker holds the package, its checks.py and write.py to the format contract (core/contract.py)
    from ...core import contract as _contract
    from . import checks as _checks
    from . import write as _write
    from .. import dcp as _package

    _conforms: _contract.FormatModule = _package
    _checks_conform: _contract.FormatChecksModule = _checks
    _write_conforms: _contract.FormatWriteModule = _write
