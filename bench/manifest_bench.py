#!/usr/bin/env python3
"""Benchmark `ckpt manifest write` and `ckpt manifest verify` against sha256sum run in parallel.

    python bench/manifest_bench.py [--runs N] [--json] [--regen] [--memory SIZE] [--formats orbax,dcp]

Inputs: validate_bench's 2 GiB checkpoints (bench/out/orbax_2gib: 64 float32 arrays of 32 MiB,
OCDBT + zarr v2 as ocp.StandardCheckpointer saves them on a 4x2 mesh; bench/out/dcp_2gib: the
same tensors, dcp.save from one process), built by validate_bench's own generator when absent.
The manifest is written beside them (bench/out/manifest_<fmt>.json, --manifest), so the cached
checkpoints stay as the other benches expect them.

For each checkpoint, with a WARM page cache (every file read once just before; the default) or a
COLD one (--cache cold: each file's cached pages dropped with posix_fadvise(DONTNEED) before every
command, so each reads the disk; only these files' pages, nothing else on the machine), whole
processes, each timed once per run:

  sha256sum   cd CKPT && find . -type f -print0 | xargs -0 -P 2 -n 1 sha256sum
              (-P 2: this machine's 2 cores; -n 1: one file per process, so the two processes
              share the files whatever their number; its digests are checked against ckpt's)
  write       ckpt manifest write CKPT --manifest M --memory SIZE --json
  verify      ckpt manifest verify CKPT --manifest M --memory SIZE --json

Targets: ckpt's speed >= 0.8x sha256sum's (sha256sum's wall / ckpt's wall >= 0.8) for write
and for verify; ckpt's peak RSS (the child's rusage, os.wait4) within --memory.

Exit status: 0 when every command ran and its output checked out (targets met or not); 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import inspect_bench as ib  # noqa: E402  (process runner with peak RSS, page-cache warmer, report header)
import validate_bench as vb  # noqa: E402  (the 2 GiB checkpoints and their generator)

REPO = ib.REPO
OUT = ib.OUT
SPEED_TARGET = 0.8  # ckpt's speed / sha256sum's
PARALLEL = 2  # xargs -P: the cores of this machine


def _parse_size(text: str) -> int:
    sys.path.insert(0, REPO)
    from ckpt_tool.scheduler import parse_memory

    return parse_memory(text)


def commands(fmt: str, path: str, manifest: str, memory: str) -> list[dict]:
    ckpt = [sys.executable, "-m", "ckpt_tool", "manifest"]
    sha = (f"cd {shlex.quote(path)} && find . -type f -print0 | xargs -0 -P {PARALLEL} -n 1 sha256sum")
    return [
        {"name": f"sha256sum-{fmt}", "format": fmt, "role": "baseline", "label": f"sha256sum x{PARALLEL} ({fmt})",
         "argv": ["bash", "-c", sha]},
        {"name": f"write-{fmt}", "format": fmt, "role": "write", "label": f"ckpt manifest write ({fmt})",
         "argv": [*ckpt, "write", path, "--manifest", manifest, "--memory", memory, "--json"]},
        {"name": f"verify-{fmt}", "format": fmt, "role": "verify", "label": f"ckpt manifest verify ({fmt})",
         "argv": [*ckpt, "verify", path, "--manifest", manifest, "--memory", memory, "--json"]},
    ]


def check_output(cmd: dict, text: str, files: int, res: dict) -> list[str]:
    """What each command must have said on a good checkpoint (sha256sum's digests kept in `res`)."""
    if cmd["role"] == "baseline":
        sums = dict((line.split("  ", 1)[1].removeprefix("./"), line.split("  ", 1)[0])
                    for line in text.splitlines() if "  " in line)
        if len(sums) != files:
            return [f"sha256sum hashed {len(sums)} files, the checkpoint has {files}"]
        res["digests"] = sums
        return []
    try:
        doc = json.loads(text)
    except ValueError:
        return ["no JSON on stdout"]
    if cmd["role"] == "write":
        return [] if doc.get("ok") and doc.get("files") == files else [f"manifest write said {text[:200]}"]
    checked = doc.get("checked", {})
    if not doc.get("ok") or checked.get("sha256_verified") != files or doc.get("findings"):
        return [f"manifest verify said {text[:300]}"]
    return []


def drop_page_cache(path: str) -> None:
    """Drop the cached pages of every file under `path` (clean pages; these files only)."""
    for root, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_command(cmd: dict, runs: int, files: int, log, before=lambda: None) -> dict:
    res = dict(name=cmd["name"], format=cmd["format"], role=cmd["role"], command=cmd["label"], ok=True, error=None,
               best_s=None, runs_s=[], best_cpu_s=None, cpu_s=[], peak_rss_kib=None, check_errors=[],
               loadavg_1min_before=round(os.getloadavg()[0], 2))
    log(f"running {cmd['name']} ({runs} run{'s' if runs > 1 else ''}) ...")
    rss = []
    for i in range(runs):
        before()
        r = ib.run_once(cmd["argv"], capture=i == 0)
        if r["rc"] != 0:
            res.update(ok=False, error=f"exit {r['rc']}: {(r['stderr'] or r['stdout']).strip()[-300:]}")
            return res
        if i == 0:
            res["check_errors"] = check_output(cmd, r["stdout"], files, res)
            res["ok"] = not res["check_errors"]
        res["runs_s"].append(round(r["wall"], 4))
        res["cpu_s"].append(round(r["cpu"], 4))
        rss.append(r["rss_kib"])
    res["best_s"] = min(res["runs_s"])
    res["best_cpu_s"] = res["cpu_s"][res["runs_s"].index(res["best_s"])]
    res["peak_rss_kib"] = max(rss)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--runs", type=int, default=1, help="timed runs per command (default 1: the machine is shared)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--regen", action="store_true", help="rebuild the cached 2 GiB checkpoints in bench/out/")
    ap.add_argument("--memory", default="512MiB", help="ckpt's --memory (default 512MiB); the RSS target")
    ap.add_argument("--formats", default="orbax,dcp", help="which 2 GiB checkpoints (default orbax,dcp)")
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm",
                    help="page cache before each command: warm (read once before) or cold (dropped)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    formats = [f for f in args.formats.split(",") if f]
    if not set(formats) <= {"orbax", "dcp"}:
        ap.error("--formats: orbax and/or dcp")
    memory_bytes = _parse_size(args.memory)

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    load_at_start = os.getloadavg()[0]
    big = vb.ensure_big_checkpoints(args.regen, log)
    results, ratios, loads, sizes = [], [], {}, {}
    for fmt in formats:
        path = big[fmt]
        manifest = os.path.join(OUT, f"manifest_{fmt}.json")
        if os.path.exists(manifest):
            os.remove(manifest)  # a previous run's: write must not find it (it would replace it, but say so)
        files, nbytes = ib._dir_stats(path)
        sizes[fmt] = {"files": files, "bytes": nbytes}
        if args.cache == "warm":
            ib.warm_page_cache(path)
        loads[fmt] = round(os.getloadavg()[0], 2)
        by = {}
        for cmd in commands(fmt, path, manifest, args.memory):
            res = run_command(cmd, args.runs, files, log,
                              (lambda p=path: drop_page_cache(p)) if args.cache == "cold" else (lambda: None))
            by[cmd["role"]] = res
            results.append(res)
        # the manifest's digests are sha256sum's
        sums = by["baseline"].pop("digests", None)
        if sums is not None and by["write"]["ok"]:
            with open(manifest) as f:
                if json.load(f)["files"] != sums:
                    by["write"].update(ok=False, check_errors=["the manifest's digests differ from sha256sum's"])
        for role in ("write", "verify"):
            a, b = by[role], by["baseline"]
            measured = a["ok"] and b["ok"] and a["best_s"] and b["best_s"]
            speed = b["best_s"] / a["best_s"] if measured else None
            rss = a["peak_rss_kib"]
            ratios.append({
                "format": fmt, "role": role, "ckpt": a["name"], "baseline": b["name"],
                "speed_vs_sha256sum": round(speed, 2) if speed is not None else None,
                "target": SPEED_TARGET, "met": None if speed is None else speed >= SPEED_TARGET,
                "ckpt_gib_per_s": round(nbytes / 2**30 / a["best_s"], 3) if measured else None,
                "sha256sum_gib_per_s": round(nbytes / 2**30 / b["best_s"], 3) if measured else None,
                "ckpt_peak_rss_kib": rss, "memory_bytes": memory_bytes,
                "rss_within_memory": None if rss is None else rss * 1024 <= memory_bytes,
            })
    failed = any(not r["ok"] for r in results)
    report = {
        **ib.report_header("manifest", load_at_start, loads),
        "page_cache": ("warm (every file read once before the commands)" if args.cache == "warm" else
                       "cold (every file's pages dropped with posix_fadvise before each command)"),
        "runs": args.runs, "memory": args.memory, "parallel": PARALLEL,
        "checkpoints": {fmt: {"path": os.path.relpath(big[fmt], REPO), **sizes[fmt]} for fmt in formats},
        "results": results, "ratios": ratios, "ok": not failed,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 1 if failed else 0


def _print_table(report: dict) -> None:
    print()
    sizes = ", ".join(f"{fmt} {c['bytes'] / 2**30:.2f} GiB in {c['files']} files"
                      for fmt, c in report["checkpoints"].items())
    print(f"manifest bench: {sizes}; {report['runs']} run(s) each, {report['machine']['cpus']} cpus, "
          f"page cache {report['page_cache']}, --memory {report['memory']}")
    load = report["machine"]["loadavg_1min"]
    print("1-min load average: " + ", ".join(f"{k.replace('before_', 'before ')} {v:.2f}" for k, v in load.items())
          + " (other work on the machine inflates wall times)")
    print()
    w = max(len(r["command"]) for r in report["results"])
    print(f"  {'command':<{w}}  {'wall':>8}  {'cpu':>8}  {'peak RSS':>9}  {'load':>5}  status")
    for r in report["results"]:
        status = "ok" if r["ok"] else ("FAILED: " + (r["error"] or r["check_errors"][0]))
        print(f"  {r['command']:<{w}}  {ib._fmt_s(r['best_s']):>8}  {ib._fmt_s(r.get('best_cpu_s')):>8}  "
              f"{ib._fmt_mib(r['peak_rss_kib']):>9}  {r['loadavg_1min_before']:>5.2f}  {status}")
    print()
    for q in report["ratios"]:
        head = f"  {q['format']:<5}  {q['role']:<6}"
        if q["speed_vs_sha256sum"] is None:
            print(f"{head}: n/a (a command failed or its output was wrong)   TARGET NOT MEASURED")
            continue
        verdict = "TARGET MET" if q["met"] and q["rss_within_memory"] else "TARGET MISSED"
        print(f"{head}: {q['speed_vs_sha256sum']:.2f}x sha256sum's speed (target >= {q['target']}x; ckpt "
              f"{q['ckpt_gib_per_s']:.2f} GiB/s, sha256sum x{report['parallel']} {q['sha256sum_gib_per_s']:.2f} GiB/s), "
              f"peak RSS {ib._fmt_mib(q['ckpt_peak_rss_kib'])} (within --memory {report['memory']}: "
              f"{'yes' if q['rss_within_memory'] else 'NO'})   {verdict}")
    print()


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table: write and verify per checkpoint, against sha256sum."""
    by = {r["name"]: r for r in doc.get("results", [])}
    rows = []
    for q in doc.get("ratios", []):
        a, b = by.get(q["ckpt"], {}), by.get(q["baseline"], {})
        gib = doc.get("checkpoints", {}).get(q["format"], {}).get("bytes", 0) / 2**30
        speed = q["speed_vs_sha256sum"]
        rss = q.get("ckpt_peak_rss_kib")
        rows.append({
            "bench": "manifest", "case": f"{q['role']}, {gib:.0f} GiB {q['format']}, "
                                         f"{str(doc.get('page_cache', 'warm')).split()[0]} cache",
            "ckpt_s": a.get("best_s"), "baseline": b.get("command", q["baseline"]), "baseline_s": b.get("best_s"),
            # the overall table's ratio is ckpt/baseline time, lower is better
            "ratio": None if not speed else round(1 / speed, 2),
            "target": f"ckpt/sha256sum <= {1 / SPEED_TARGET:.2f}x, RSS <= {doc.get('memory')}",
            "met": None if q["met"] is None else bool(q["met"] and q["rss_within_memory"]),
            "rss_mib": round(rss / 1024) if rss else None,
            "error": a.get("error") or b.get("error") or "; ".join(a.get("check_errors", []) + b.get("check_errors", [])),
        })
    return rows


if __name__ == "__main__":
    sys.exit(main())
