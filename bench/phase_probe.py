"""Where a ckpt convert's or reshard's process time goes, phase by phase (issue 46's overhead).

    python bench/phase_probe.py convert SRC DST --to dcp --json

runs `ckpt ARGS...` in this process as the console script would, and writes to
stderr one line `phases {...}`: the wall clock (time.time(), comparable with
the parent's) at the script's first line (the interpreter and `site` are done),
after ckpt's CLI is imported, when the command's core starts its timed work
(engine._convert, or reshard's plan), when that work ends, and at the
process's exit (os._exit, as the console script ends, or main's return). A parent that notes the
clock before it starts the process and after it ends has every phase:
interpreter start, imports, the CLI before the work, the work, after the work,
and the exit. Run as a script from the bench folder, not with -m, so that the
installed ckpt_tool is the one measured.
"""
from __future__ import annotations

import json
import os
import sys
import time

MARKS: dict[str, float] = {"script": time.time()}

from ckpt_tool.cli.main import main  # noqa: E402 (after the first mark)

MARKS["cli imported"] = time.time()


def _wrap(module: object, name: str, start: str, end: str) -> None:
    original = getattr(module, name)

    def wrapped(*args: object, **kwargs: object) -> object:
        MARKS.setdefault(start, time.time())
        try:
            return original(*args, **kwargs)
        finally:
            MARKS[end] = time.time()

    setattr(module, name, wrapped)


def _install() -> None:
    # imported here, as the command would import them, and only the one it runs: a convert must not
    # pay for the reshard's modules, which would skew the comparison this probe is for
    if sys.argv[1:2] == ["reshard"]:
        import ckpt_tool.ops.reshard as reshard

        _wrap(reshard, "reshard", "work in", "work out")
    else:
        import ckpt_tool.ops.engine as engine

        _wrap(engine, "_convert", "work in", "work out")
    exit_ = os._exit

    def ending(code: int) -> None:
        _report()
        exit_(code)

    os._exit = ending  # type: ignore[assignment]


def _report() -> None:
    MARKS["exit"] = time.time()
    sys.stderr.write("phases " + json.dumps(MARKS) + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    _install()
    sys.argv = ["ckpt", *sys.argv[1:]]
    try:
        main()  # ends with os._exit where the teardown is needless (cli/main.py)
    finally:
        _report()  # else (jax or torch loaded): the interpreter's teardown follows, in "the exit"
