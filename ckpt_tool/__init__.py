"""ckpt: look inside, check, re-lay and convert distributed checkpoints.

    >>> import ckpt_tool
    >>> ck = ckpt_tool.open("gs://bucket/run/checkpoints/1000")
    >>> leaf = ck["params/dense/kernel"]
    >>> leaf.shape, leaf.dtype          # from metadata alone
    >>> leaf[0:4, :]                    # reads just that region
    >>> ckpt_tool.latest("gs://bucket/run/checkpoints").path   # the step to resume from, or None
"""
from __future__ import annotations

from .base.errors import CkptError
from .base.version import __version__

# (not typing's: importing typing costs `ckpt --version` ~5 ms; the type checker knows the name)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .core.model import ArrayLeaf, Checkpoint, ValueLeaf
    from .ops.runs import Latest

__all__ = ["open", "latest", "Checkpoint", "ArrayLeaf", "ValueLeaf", "CkptError", "__version__"]

# the model (and with it numpy) loads on first use, so that the `ckpt`
# command can set up the process before numpy starts
_FROM_MODEL = frozenset({"ArrayLeaf", "Checkpoint", "ValueLeaf"})


def __getattr__(name: str) -> Any:
    if name in _FROM_MODEL:
        from .core import model

        return getattr(model, name)
    if name == 'manifest':  # documented as `from ckpt_tool import manifest` (docs/python-api.md)
        from .ops import manifest

        return manifest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open(path: str, *, step: str | int | None = None) -> Checkpoint:  # noqa: A001 - mirrors io.open
    """Open the checkpoint at `path` (a directory, a one-file checkpoint, or a file://, gs://,
    s3:// or memory:// URL) in any format ckpt reads, detected; reads metadata only. The formats
    are those of the registry, ckpt_tool.formats.shown() (`ckpt --help` lists them).

    `step` picks a step of a run root (any framework `ckpt ls` lists): an int, a step's name, or
    "latest" (the default: the step the framework's own resume opens, by its rule: docs/run-roots.md).
    """
    from .formats import open_checkpoint

    return open_checkpoint(path, step=step)


def latest(root: str, deep: bool = False) -> Latest:
    """The step of the run root `root` to resume from: the newest one complete by its writer's
    rule (Orbax commit, DCP's .metadata, Megatron's tracker, ...) that passes validate's shallow
    checks (`deep=True`: decodes every chunk too). `.path` is its path, or None when no step
    qualifies; `.skipped` lists the newer steps passed over and why (the pointer file's target
    included, when it fails). Reads listings and metadata only; raises CkptError when `root`
    is not a run root ckpt knows."""
    from .ops.runs import latest as _latest

    return _latest(root, deep=deep)
