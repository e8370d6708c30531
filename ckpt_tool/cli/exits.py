"""The `ckpt` command's exit codes (docs/exit-codes.md's table) and its debug switch, shared by
main.py (the process's start and end, kept light) and app.py (the click group)."""
from __future__ import annotations

import os

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def debug() -> bool:
    """CKPT_DEBUG=1: tracebacks instead of one-line errors, and the interpreter's own end."""
    return os.environ.get("CKPT_DEBUG", "") not in ("", "0")
