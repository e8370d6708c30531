"""Checkpoints whose tree is a msgpack document: Flax legacy, orbax <= 0.4, T5X.

reader.py reads the three families; scan.py walks a msgpack document without
loading array data; checks.py is validate's shallow checks. The package's
interface is the registry's: NAME, detect, read, and for one file given by its
path split_file and read_file.
"""
from __future__ import annotations

from typing import Any

from .reader import NAME, detect, read, read_file
from .reader import split_local_file as split_file

__all__ = ["NAME", "detect", "read", "layout_text", "read_file", "split_file"]


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
