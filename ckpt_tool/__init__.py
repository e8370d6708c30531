"""ckpt: look inside, check, re-lay and convert distributed checkpoints.

    >>> import ckpt_tool
    >>> ck = ckpt_tool.open("gs://bucket/run/checkpoints/1000")
    >>> leaf = ck["params/dense/kernel"]
    >>> leaf.shape, leaf.dtype          # from metadata alone
    >>> leaf[0:4, :]                    # reads just that region
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import CkptError

if TYPE_CHECKING:
    from .model import ArrayLeaf, Checkpoint, ValueLeaf

__version__ = "0.1.0"
__all__ = ["open", "Checkpoint", "ArrayLeaf", "ValueLeaf", "CkptError", "__version__"]

# the model (and with it numpy) loads on first use, so that the `ckpt`
# command can set up the process before numpy starts
_FROM_MODEL = frozenset({"ArrayLeaf", "Checkpoint", "ValueLeaf"})


def __getattr__(name: str) -> Any:
    if name in _FROM_MODEL:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open(path: str, *, step: str | int | None = None) -> Checkpoint:  # noqa: A001 - mirrors io.open
    """Open a checkpoint (Orbax or torch DCP) by path or URL; reads metadata only.

    `step` picks a step of an Orbax CheckpointManager root: an int, or
    "latest" (the default: the newest committed step).
    """
    from .formats import open_checkpoint

    return open_checkpoint(path, step=step)
