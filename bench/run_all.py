#!/usr/bin/env python3
"""Run every bench/*_bench.py in turn (sorted by file name), then print one table of them all.

    python bench/run_all.py [--bench NAME ...] [--json] [ARGS ...]

Every argument run_all does not know itself (e.g. --runs 5, --regen) is passed
through to each bench unchanged, so a new bench plugs in just by being named
bench/<what>_bench.py. ``--bench inspect`` (repeatable) runs only the benches
whose name contains that text.

Each bench runs with --json: its stdout (one JSON document) is captured, its
stderr (progress) goes to the terminal as it comes. run_all then prints the
bench's own table, rendered from that document by the bench's own printer, and
at the end one overall table: the rows each bench's ``summary_rows(doc)`` gives,
in one form (bench, case, ckpt, baseline, ratio, target, met, ckpt peak RSS).
The overall table is also written as JSON to bench/out/summary.json. With
--json, stdout holds only the combined JSON document (the rows and every
bench's own document); the headers and tables go nowhere else.

The exit status is 0 when every bench exited 0, else 1; a failing bench does
not stop the ones after it, and shows in the overall table as a row saying so.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
from types import ModuleType

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARY_PATH = os.path.join(HERE, "out", "summary.json")
COLUMNS = ("bench", "case", "ckpt", "baseline (what)", "ratio", "target", "met", "ckpt peak RSS")


def load_bench(path: str) -> ModuleType:
    """Import bench/<name>_bench.py by path (benches import each other by name, so bench/ goes on sys.path)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    name = os.path.basename(path)[: -len(".py")]
    if name in sys.modules:  # already imported by another bench (e.g. convert_bench by safetensors_bench)
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def failure_row(name: str, what: str) -> dict:
    """The row of a bench that gave no rows of its own (it failed, or printed no JSON)."""
    return {"bench": name, "case": what, "ckpt_s": None, "baseline": None, "baseline_s": None, "ratio": None,
            "target": None, "met": None, "rss_mib": None, "error": what}


def bench_rows(name: str, mod: ModuleType | None, doc: dict | None, rc: int, stdout: str) -> list[dict]:
    """The overall table's rows for one bench run: its summary_rows(doc), or one row saying what went wrong."""
    if doc is None:
        tail = (stdout.strip().splitlines() or ["no output"])[-1][:120]
        return [failure_row(name, f"FAILED: exit {rc}, no JSON on stdout ({tail})")]
    fn = getattr(mod, "summary_rows", None) if mod is not None else None
    if fn is None:
        return [failure_row(name, f"exit {rc}: the bench has no summary_rows()")]
    try:
        rows = fn(doc)
    except Exception as exc:  # noqa: BLE001 - a bench's JSON of another form must not stop the others
        return [failure_row(name, f"exit {rc}: summary_rows() failed: {type(exc).__name__}: {exc}")]
    if not rows:
        return [failure_row(name, f"exit {rc}: no rows in its JSON" + (" (FAILED)" if rc else ""))]
    if rc != 0:  # the rows stand, but the bench's failure must show in the table too
        rows = rows + [failure_row(name, f"FAILED: exit {rc} (see its table above)")]
    return rows


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_row(r: dict) -> list[str]:
    """One row's cells, in COLUMNS order."""
    ckpt = _s(r.get("ckpt_s"))
    if r.get("ckpt_s") is None and r.get("error"):
        ckpt = "-"
    base = "-" if r.get("baseline") is None else f"{_s(r.get('baseline_s'))} ({r['baseline']})"
    if r.get("baseline") is not None and r.get("baseline_s") is None and r.get("note"):
        base = f"{r['note']} ({r['baseline']})"
    ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
    met = {True: "met", False: "MISSED", None: "-"}[r.get("met")]
    if r.get("target") and r.get("met") is None:
        met = "not measured"
    rss = "-" if r.get("rss_mib") is None else f"{r['rss_mib']:.0f} MiB"
    if r.get("rss_target"):
        verdict = {True: "met", False: "OVER", None: "not measured"}[r.get("rss_met")]
        rss += f" ({r['rss_target']}: {verdict})"
    case = r.get("case") or "-"
    if r.get("error") and r.get("error") != case:
        case += f" (FAILED: {r['error'][-120:]})"
    return [_cell(c) for c in (r.get("bench", "?"), case, ckpt, base, ratio, r.get("target") or "none", met, rss)]


def render_table(rows: list[dict]) -> str:
    """The overall table, markdown like the benches' own."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(render_row(r)) + " |" for r in rows]
    lines.append("")
    lines.append("ratio: baseline/ckpt where the target is >= (ckpt is that many times faster), ckpt/baseline where "
                 "it is <= (ckpt takes that many times as long); wall times as each bench says (inspect and cli_start: medians; others: best); peak RSS of the ckpt process.")
    return "\n".join(lines)


def print_own_table(name: str, mod: ModuleType | None, doc: dict) -> None:
    """The bench's own human table, rendered from its JSON by the bench's own printer."""
    if mod is None:
        return
    try:
        for fn_name in ("_print_report", "_print_table"):
            if hasattr(mod, fn_name):
                getattr(mod, fn_name)(doc)
                return
        if hasattr(mod, "print_table"):  # shapes_bench: takes the rows
            mod.print_table(doc.get("results", []))
            return
        print(json.dumps(doc, indent=1))
    except Exception as exc:  # noqa: BLE001 - the overall table still comes
        print(f"({name}: its table could not be rendered from its JSON: {type(exc).__name__}: {exc})")


def run_bench(path: str, passthrough: list[str]) -> tuple[int, str, dict | None]:
    """(exit status, stdout, parsed JSON or None): stderr streams to the terminal."""
    p = subprocess.run([sys.executable, path, *passthrough, "--json"], stdout=subprocess.PIPE, text=True)
    try:
        doc = json.loads(p.stdout)
        if not isinstance(doc, dict):
            doc = None
    except ValueError:
        doc = None
    return p.returncode, p.stdout, doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False, add_help=True)
    ap.add_argument("--bench", action="append", default=[], metavar="NAME",
                    help="only benches whose file name contains NAME (repeatable)")
    ap.add_argument("--json", action="store_true", help="print only the combined JSON document")
    args, passthrough = ap.parse_known_args(argv)

    benches = sorted(glob.glob(os.path.join(HERE, "*_bench.py")))
    if args.bench:
        benches = [b for b in benches if any(n in os.path.basename(b) for n in args.bench)]
    if not benches:
        print("run_all: no bench matched", file=sys.stderr)
        return 1

    out = sys.stderr if args.json else sys.stdout
    failed, rows, runs, reports = [], [], [], {}
    for path in benches:
        name = os.path.basename(path)[: -len("_bench.py")]
        print(f"\n===== bench: {name} ({os.path.relpath(path)}) =====", file=out, flush=True)
        t0 = time.monotonic()
        rc, stdout, doc = run_bench(path, passthrough)
        wall = time.monotonic() - t0
        try:
            mod = load_bench(path)
        except Exception as exc:  # noqa: BLE001
            print(f"run_all: cannot import {os.path.relpath(path)}: {type(exc).__name__}: {exc}", file=sys.stderr)
            mod = None
        if not args.json:
            if doc is not None:
                print_own_table(name, mod, doc)
            elif stdout.strip():  # no JSON: show what it printed
                print(stdout.rstrip())
        print(f"===== {name}: exit {rc}, {wall:.1f}s =====", file=out, flush=True)
        rows += bench_rows(name, mod, doc, rc, stdout)
        runs.append({"bench": name, "rc": rc, "wall_s": round(wall, 1), "json": doc is not None})
        reports[name] = doc
        if rc != 0:
            failed.append(name)

    summary = {"bench": "all", "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
               "args": passthrough, "benches": runs, "rows": rows, "ok": not failed}
    os.makedirs(os.path.dirname(SUMMARY_PATH), exist_ok=True)
    with open(SUMMARY_PATH, "w") as f:
        json.dump(summary, f, indent=1)
    if args.json:
        print(json.dumps({**summary, "reports": reports}, indent=1))
    else:
        print(f"\n===== all benches ({os.path.relpath(SUMMARY_PATH)}) =====\n")
        print(render_table(rows))
    if failed:
        print(f"\nrun_all: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
