#!/usr/bin/env python3
"""Benchmark the `ckpt` command's start: `ckpt --help` against `ckpt --version`.

    python bench/cli_start_bench.py [--runs N] [--json]

Both are WHOLE PROCESSES, the .venv console script as a user runs it, each a
fresh interpreter: `--version` imports click and ckpt_tool's package only, so
it is the floor of any `ckpt` command; `--help` must stay close to it (issue
18: it took 0.39 s against 0.11 s when listing the commands imported numpy and
tensorstore through every command's module). Each runs once as a warm-up
(output checked: the help lists every command and format, the version line
is right), then N times (default 10) in N rounds that run both in turn, so a
slow stretch of a shared machine hits both alike; the best wall time counts.
Peak RSS is the child's own (os.wait4).

Target: --help <= 1.5x --version. Also reported: the modules `--help` imports
(`python -X importtime`), which must include neither numpy nor tensorstore.
Exit 0 when both commands ran and their output checked out (target met or
not); 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from inspect_bench import _fmt_mib, run_once  # noqa: E402 - one way to time a child, shared by the benches

TARGET = 1.5  # --help / --version
HEAVY = ("numpy", "tensorstore", "rich", "ml_dtypes")
COMMANDS = ("inspect", "validate", "diff", "convert", "reshard")
FORMATS = ("Orbax", "DCP", "safetensors", "Flax", "T5X")


def ckpt_exe() -> list[str]:
    """The console script next to this interpreter (the .venv's), else `python -m ckpt_tool`."""
    exe = os.path.join(os.path.dirname(sys.executable), "ckpt")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "ckpt_tool"]


def check(name: str, out: str) -> list[str]:
    """What is wrong with a warm-up's output (nothing: [])."""
    if name == "version":
        return [] if out.startswith("ckpt, version ") else [f"--version printed {out[:80]!r}"]
    errors = [f"--help does not list {c}" for c in COMMANDS if f"\n  {c} " not in out]
    errors += [f"--help does not name {f}" for f in FORMATS if f not in out]
    return errors


def heavy_imports() -> tuple[list[str], int]:
    """(heavy modules `ckpt --help` imports, how many modules it imports at all)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_tool", "--help"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    modules = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    return sorted({m for m in modules if m.split(".")[0] in HEAVY}), len(modules)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--runs", type=int, default=10, help="timed runs per command after one warm-up (default 10)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args, _unknown = ap.parse_known_args(argv)  # run_all passes every bench its own arguments (--regen, ...)

    exe = ckpt_exe()
    commands = {"version": exe + ["--version"], "help": exe + ["--help"]}
    results = {name: {"name": name, "command": "ckpt --" + name, "ok": True, "error": None, "runs_s": [],
                      "best_s": None, "peak_rss_kib": None, "check_errors": []} for name in commands}
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
        print(f"round {i + 1}/{args.runs}: --version {results['version']['runs_s'][-1]:.3f} s, "
              f"--help {results['help']['runs_s'][-1]:.3f} s", file=sys.stderr, flush=True)
    for res in results.values():
        res["best_s"] = min(res["runs_s"])
    heavy, n_modules = heavy_imports()
    ratio = results["help"]["best_s"] / results["version"]["best_s"]
    doc = {
        "bench": "cli_start", "runs": args.runs, "results": list(results.values()),
        "ratio": round(ratio, 2), "target": TARGET, "met": ratio <= TARGET and not heavy,
        "help_heavy_imports": heavy, "help_modules": n_modules,
        "ok": all(r["ok"] and not r["check_errors"] for r in results.values()),
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_table(doc)
    return 0 if doc["ok"] else 1


def _print_table(doc: dict) -> None:
    print(f"ckpt start, whole processes, best of {doc['runs']}:")
    for r in doc["results"]:
        status = "ok" if r["ok"] and not r["check_errors"] else f"FAILED: {r['error'] or '; '.join(r['check_errors'])}"
        print(f"  {r['command']:<16} {r['best_s']:.3f} s  {_fmt_mib(r['peak_rss_kib']):>9}  {status}")
    heavy = ", ".join(doc["help_heavy_imports"]) or "none"
    print(f"  --help / --version = {doc['ratio']:.2f}x (target <= {doc['target']:g}x); "
          f"--help imports {doc['help_modules']} modules, heavy ones: {heavy}")
    print("  TARGET MET" if doc["met"] else "  TARGET MISSED")


def summary_rows(doc: dict) -> list[dict]:
    """This bench's row for run_all's overall table: --help against the --version floor."""
    by = {r["name"]: r for r in doc.get("results", [])}
    h, v = by.get("help", {}), by.get("version", {})
    rss = h.get("peak_rss_kib")
    heavy = doc.get("help_heavy_imports") or []
    return [{
        "bench": "cli_start", "case": "ckpt --help" + (f" (imports {', '.join(heavy)})" if heavy else ""),
        "ckpt_s": h.get("best_s"), "baseline": "ckpt --version", "baseline_s": v.get("best_s"),
        "ratio": doc.get("ratio"), "target": f"ckpt/baseline <= {doc.get('target', TARGET):g}x", "met": doc.get("met"),
        "rss_mib": round(rss / 1024) if rss else None,
        "error": h.get("error") or v.get("error") or "; ".join(h.get("check_errors", []) + v.get("check_errors", [])),
    }]


if __name__ == "__main__":
    sys.exit(main())
