"""The parts of help texts that name formats and run roots, made from the registries.

A help text that lists formats by hand goes stale as soon as a format is added
(`inspect --help` once named 4 of the 8 formats it reads); these phrases are
made from formats.REGISTRY and the run layouts' table instead. Both modules
are light (no numpy, no format package), so `ckpt --help` stays cheap.
"""
from __future__ import annotations

import textwrap

from .. import formats

# click's help width (HelpFormatter's max_width): lines shown verbatim ("\b" blocks) are wrapped to it here
HELP_WIDTH = 80


def formats_read() -> str:
    """"Orbax, DCP, safetensors, ... or DeepSpeed universal": every format ckpt reads, as lists name them."""
    return formats.joined([f.label for f in formats.shown()])


def formats_written() -> str:
    """"Orbax, DCP, safetensors or DeepSpeed universal": the formats `convert --to` writes."""
    return formats.joined(formats.writable_labels())


def run_roots() -> str:
    """"Orbax CheckpointManager, Flax checkpoint_N, ... or verl": the run roots `ckpt ls` knows."""
    from ..formats.roots import LAYOUTS

    return formats.joined([layout.title for layout in LAYOUTS])


def verbatim(text: str, indent: str, width: int = HELP_WIDTH) -> list[str]:
    """`text` as lines of a "\\b" block (which click does not rewrap): wrapped to `width` once
    click's two-space indent is added, continuation lines indented two more."""
    room = width - 2  # click indents the help text by two spaces
    return textwrap.wrap(text, room, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False)
