#!/usr/bin/env python3
"""Run every bench/*_bench.py in turn (sorted by file name).

    python bench/run_all.py [--bench NAME ...] [ARGS ...]

Every argument run_all does not know itself (e.g. --runs 5, --json, --regen)
is passed through to each bench unchanged, so a new bench plugs in just by
being named bench/<what>_bench.py. ``--bench inspect`` (repeatable) runs only
the benches whose name contains that text.

A header goes before each bench (on stderr with --json, so that stdout holds
only the benches' own output). The exit status is 0 when every bench exited 0,
else 1; a failing bench does not stop the ones after it.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False, add_help=True)
    ap.add_argument("--bench", action="append", default=[], metavar="NAME",
                    help="only benches whose file name contains NAME (repeatable)")
    args, passthrough = ap.parse_known_args(argv)

    benches = sorted(glob.glob(os.path.join(HERE, "*_bench.py")))
    if args.bench:
        benches = [b for b in benches if any(n in os.path.basename(b) for n in args.bench)]
    if not benches:
        print("run_all: no bench matched", file=sys.stderr)
        return 1

    header_out = sys.stderr if "--json" in passthrough else sys.stdout
    failed = []
    for path in benches:
        name = os.path.basename(path)[: -len("_bench.py")]
        print(f"\n===== bench: {name} ({os.path.relpath(path)}) =====", file=header_out, flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, path, *passthrough])
        print(f"===== {name}: exit {rc}, {time.monotonic() - t0:.1f}s =====", file=header_out, flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"\nrun_all: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
