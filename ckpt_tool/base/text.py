"""Text read from a checkpoint, made safe to show and to parse.

Names, file names, step names and tracker files come from the input. They
may hold what a terminal acts on (ESC sequences, a carriage return, a
newline that forges an output line, a bidi override that reverses what
follows) or lone surrogates (a pickle's surrogatepass str, a file name that
is not UTF-8), which a UTF-8 stream refuses to encode. `printable` is the one
escaping every text output uses; `is_ascii_number` the one test of "this
text is a step number" (str.isdigit() also accepts '²', which int() refuses,
and '٣' or '１', which no framework writes).
"""
from __future__ import annotations

import re

# C0 (tab and newline included: a name holding either would not stay one cell, one line), DEL, C1;
# the Unicode line and paragraph separators (str.splitlines breaks there); the bidi controls
# (they reorder the rest of the line on a terminal); lone surrogates (not encodable as UTF-8)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    if c in _SHORT:
        return _SHORT[c]
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` as one line that is safe on a terminal and encodable as UTF-8: control characters,
    line separators, bidi controls and lone surrogates written as escapes (\\n, \\x1b, \\udc80)."""
    return _UNSAFE.sub(_escape, text)


def is_ascii_number(text: str | bytes) -> bool:
    """Whether `text` is a non-empty run of ASCII digits 0-9, the only step numbers and counts
    ckpt reads from text (`int()` of what passes never fails)."""
    return text.isascii() and text.isdigit()


_SURROGATE = re.compile("[\ud800-\udfff]")


def is_unicode_text(text: str) -> bool:
    """Whether `text` is Unicode text any UTF-8 file can hold: no lone surrogates (a name a pickle
    stored with surrogatepass, or a non-UTF-8 file name Python decoded with surrogateescape)."""
    return _SURROGATE.search(text) is None


def joined(names: list[str], conjunction: str = "or") -> str:
    """"a, b or c"."""
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + f" {conjunction} " + names[-1]
