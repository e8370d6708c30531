"""Megatron-Core `dist_checkpointing` saves (torch_dist) and Megatron-LM run roots (iter_N/ + tracker).

reader.py reads a save through the DCP and torch.save packages (torch_dist's `.metadata` and
items, `common.pt`) with Megatron's pickled classes admitted by name as data (pickled.py), the
distributed optimizer's flattened ranges shown as their logical tensors (reformulated.py);
detection.py names what tells a Megatron directory from its listing (detect, here, asks it
first); checks.py is validate's. ckpt does not write Megatron checkpoints. The package's interface is the registry's: NAME, detect, read,
layout_text.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .detection import NAME, may_hold

if TYPE_CHECKING:
    from ...storage import Storage

__all__ = ["NAME", "detect", "layout_text", "read"]

# The reader (and the DCP / torch.save machinery behind it) is imported when a Megatron
# checkpoint is asked something: the registry asks Megatron first whether a directory is its
# own, and `ckpt inspect` of an Orbax or DCP checkpoint should not pay for this package.


def detect(storage: Storage) -> bool:
    """A save (metadata.json naming a sharded backend), or a run root (the tracker, or iter_N/
    directories): the reader decides where the listing names anything Megatron writes."""
    dirs, files = storage.listdir()
    if not may_hold(dirs, files):
        return False  # the reader stays unimported
    from .reader import detect as detect_

    return detect_(storage)


def read(storage: Any, **kwargs: Any) -> Any:
    from .reader import read as read_

    return read_(storage, **kwargs)


def layout_text(ck: Any) -> str:
    from .reader import layout_text as layout_text_

    return layout_text_(ck)


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the type checker holds the package, its checks.py and write.py to the format contract (core/contract.py)
    from ...core import contract as _contract
    from . import checks as _checks
    from .. import megatron as _package

    _conforms: _contract.FormatModule = _package
    _checks_conform: _contract.FormatChecksModule = _checks
