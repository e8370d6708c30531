"""Checkpoints whose tree is a msgpack document: Flax legacy, orbax <= 0.4, T5X.

reader.py reads the three families; scan.py walks a msgpack document without
loading array data; detection.py answers the registry's questions (is this
directory, this file, a msgpack checkpoint?) without importing the reader;
checks.py is validate's shallow checks. The package's interface is the
registry's: NAME, detect, read, and for one file given by its path split_file
and read_file.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .detection import NAME, may_hold
from .detection import split_local_file as split_file

if TYPE_CHECKING:
    from ...storage import Storage

__all__ = ["NAME", "detect", "read", "layout_text", "read_file", "split_file"]

# The reader (numpy, and the Orbax reader's zarr plumbing it shares) is imported when a msgpack
# checkpoint is asked something: the registry asks this package about every directory and
# every file given, and `ckpt inspect` of another format's checkpoint should not pay for it.


def detect(storage: Storage) -> bool:
    if not may_hold(storage):
        return False  # nothing here the reader would look at: it stays unimported
    from .reader import detect as detect_

    return detect_(storage)


def read(storage: Any, **kwargs: Any) -> Any:
    from .reader import read as read_

    return read_(storage, **kwargs)


def read_file(storage: Any, name: str, **kwargs: Any) -> Any:
    from .reader import read_file as read_file_

    return read_file_(storage, name, **kwargs)


def layout_text(ck: Any) -> str:
    """inspect's "format" row: "Flax msgpack (checkpoint_3)", "T5X v3, zarr2 array directories"
    (an orbax <= 0.4 save says "orbax": the Orbax package describes it)."""
    lay = ck.layout
    if ck.format == "flax":
        return f"Flax msgpack ({lay['file']})" if lay.get("file") else "Flax msgpack"
    if ck.format == "t5x":
        text = "T5X" + (f" v{lay['t5x_version']}" if lay.get("t5x_version") is not None else "")
        return text + (f", zarr{lay['zarr']} array directories" if lay.get("zarr") else "")
    return str(ck.format)


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the type checker holds the package, its checks.py and write.py to the format contract (core/contract.py)
    from ...core import contract as _contract
    from . import checks as _checks
    from .. import msgpack as _package

    _conforms: _contract.FormatModule = _package
    _checks_conform: _contract.FormatChecksModule = _checks
