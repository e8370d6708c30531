#!/usr/bin/env python3
"""Benchmark the `ckpt` command's start: `ckpt --version` and `ckpt --help` against a bare `python -c pass`.

    python bench/cli_start_bench.py [--runs N] [--json]

All are WHOLE PROCESSES, ckpt as the .venv console script a user runs, each a
fresh interpreter; the floor is the same venv's `python -c pass` (the
interpreter, site and the venv's .pth files). `--version` and `--help` load
neither click nor any command (issue 46: click alone doubles a bare start; the
console script answers both itself). Each runs once as a warm-up (output
checked: the help lists every command and format, the version line is right),
then N times (default 20) in N rounds that run all three in turn, so a slow
stretch of a shared machine hits them alike; the median wall time counts (the
best is reported too). Peak RSS is the child's own (os.wait4).

Targets (issue 46): --version and --help each <= 1.5x `python -c pass`, by
medians. Also reported: --help / --version (issue 18's target, <= 1.5x), and
the heavy modules `--help` imports (`python -X importtime`), which must be
none. Exit 0 when every command ran and its output checked out (targets met or
not); 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from inspect_bench import _fmt_mib, run_once  # noqa: E402 - one way to time a child, shared by the benches

TARGET = 1.5  # --help / --version, and each of them / python -c pass
HEAVY = ("numpy", "tensorstore", "rich", "ml_dtypes", "click")
COMMANDS = ("inspect", "validate", "diff", "convert", "reshard")
FORMATS = ("Orbax", "DCP", "safetensors", "Flax", "T5X")


def ckpt_exe() -> list[str]:
    """The console script next to this interpreter (the .venv's), else `python -m ckpt_tool`."""
    exe = os.path.join(os.path.dirname(sys.executable), "ckpt")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "ckpt_tool"]


def check(name: str, out: str) -> list[str]:
    """What is wrong with a warm-up's output (nothing: [])."""
    if name == "python":
        return []
    if name == "version":
        return [] if out.startswith("ckpt, version ") else [f"--version printed {out[:80]!r}"]
    errors = [f"--help does not list {c}" for c in COMMANDS if f"\n  {c} " not in out]
    errors += [f"--help does not name {f}" for f in FORMATS if f not in out]
    return errors


def heavy_imports() -> tuple[list[str], int]:
    """(heavy modules `ckpt --help` imports, how many modules it imports at all)."""
    code = "import sys; from ckpt_tool.cli.main import main; sys.argv = ['ckpt', '--help']; main()"  # the script's
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    modules = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    return sorted({m for m in modules if m.split(".")[0] in HEAVY}), len(modules)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--runs", type=int, default=20, help="timed runs per command after one warm-up (default 20)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args, _unknown = ap.parse_known_args(argv)  # run_all passes every bench its own arguments (--regen, ...)

    exe = ckpt_exe()
    commands = {"python": [sys.executable, "-c", "pass"], "version": exe + ["--version"], "help": exe + ["--help"]}
    labels = {"python": "python -c pass", "version": "ckpt --version", "help": "ckpt --help"}
    results = {name: {"name": name, "command": labels[name], "ok": True, "error": None, "runs_s": [],
                      "best_s": None, "median_s": None, "peak_rss_kib": None, "check_errors": []}
               for name in commands}
    for name, argv_ in commands.items():
        r = run_once(argv_, capture=True)
        res = results[name]
        if r["rc"] != 0:
            res.update(ok=False, error=f"exit {r['rc']}: {r['stderr'].strip()[-200:]}")
        res["check_errors"] = check(name, r["stdout"])
    for i in range(max(args.runs, 1)):
        for name, argv_ in commands.items():
            r = run_once(argv_, capture=False)
            results[name]["runs_s"].append(round(r["wall"], 4))
            rss = results[name]["peak_rss_kib"]
            results[name]["peak_rss_kib"] = max(rss or 0, r["rss_kib"])
        print(f"round {i + 1}/{args.runs}: python -c pass {results['python']['runs_s'][-1]:.3f} s, "
              f"--version {results['version']['runs_s'][-1]:.3f} s, "
              f"--help {results['help']['runs_s'][-1]:.3f} s", file=sys.stderr, flush=True)
    for res in results.values():
        res["best_s"] = min(res["runs_s"])
        res["median_s"] = round(statistics.median(res["runs_s"]), 4)
    heavy, n_modules = heavy_imports()
    ratio = results["help"]["median_s"] / results["version"]["median_s"]
    floor = results["python"]["median_s"]
    # each ckpt start against the bare interpreter, by medians (issue 46)
    vs_python = [{"name": name, "command": results[name]["command"], "ratio": round(results[name]["median_s"] / floor, 2),
                  "target": TARGET, "met": results[name]["median_s"] / floor <= TARGET}
                 for name in ("version", "help")]
    doc = {
        "bench": "cli_start", "runs": args.runs, "results": list(results.values()), "vs_python": vs_python,
        "ratio": round(ratio, 2), "target": TARGET, "help_met": ratio <= TARGET and not heavy,
        "met": ratio <= TARGET and not heavy and all(q["met"] for q in vs_python),
        "help_heavy_imports": heavy, "help_modules": n_modules,
        "ok": all(r["ok"] and not r["check_errors"] for r in results.values()),
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_table(doc)
    return 0 if doc["ok"] else 1


def _print_table(doc: dict) -> None:
    print(f"ckpt start, whole processes, median (best) of {doc['runs']}:")
    for r in doc["results"]:
        status = "ok" if r["ok"] and not r["check_errors"] else f"FAILED: {r['error'] or '; '.join(r['check_errors'])}"
        median = r.get("median_s") or r["best_s"]
        print(f"  {r['command']:<16} {median:.3f} s ({r['best_s']:.3f} s)  {_fmt_mib(r['peak_rss_kib']):>9}  {status}")
    for q in doc.get("vs_python", []):
        verdict = "met" if q["met"] else "MISSED"
        print(f"  {q['command']} / python -c pass = {q['ratio']:.2f}x (target <= {q['target']:g}x): {verdict}")
    heavy = ", ".join(doc["help_heavy_imports"]) or "none"
    print(f"  --help / --version = {doc['ratio']:.2f}x (target <= {doc['target']:g}x); "
          f"--help imports {doc['help_modules']} modules, heavy ones: {heavy}")
    print("  TARGET MET" if doc["met"] else "  TARGET MISSED")


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table: --version and --help against `python -c pass`
    (by medians), then --help against --version."""
    by = {r["name"]: r for r in doc.get("results", [])}
    h, v, p = by.get("help", {}), by.get("version", {}), by.get("python", {})
    rss = h.get("peak_rss_kib")
    heavy = doc.get("help_heavy_imports") or []
    rows = []
    for q in doc.get("vs_python", []):
        r = by.get(q["name"], {})
        rows.append({
            "bench": "cli_start", "case": q["command"] + " (console script)", "ckpt_s": r.get("median_s"),
            "baseline": "python -c pass", "baseline_s": p.get("median_s"), "ratio": q["ratio"],
            "target": f"ckpt/baseline <= {q['target']:g}x", "met": q["met"],
            "rss_mib": round(r["peak_rss_kib"] / 1024) if r.get("peak_rss_kib") else None,
            "error": r.get("error") or p.get("error") or "; ".join(r.get("check_errors", [])),
        })
    return rows + [{
        "bench": "cli_start", "case": "ckpt --help" + (f" (imports {', '.join(heavy)})" if heavy else ""),
        "ckpt_s": h.get("median_s") or h.get("best_s"), "baseline": "ckpt --version",
        "baseline_s": v.get("median_s") or v.get("best_s"), "ratio": doc.get("ratio"),
        "target": f"ckpt/baseline <= {doc.get('target', TARGET):g}x", "met": doc.get("help_met", doc.get("met")),
        "rss_mib": round(rss / 1024) if rss else None,
        "error": h.get("error") or v.get("error") or "; ".join(h.get("check_errors", []) + v.get("check_errors", [])),
    }]


if __name__ == "__main__":
    sys.exit(main())
