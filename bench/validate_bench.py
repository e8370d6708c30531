#!/usr/bin/env python3
"""Benchmark `ckpt validate` (shallow and --deep) against bare tensorstore listings and reads.

    python bench/validate_bench.py [--runs N] [--json] [--regen] [--layers N] [--no-deep]

Inputs (built once, cached in bench/out/, rebuilt with --regen):

  * inspect_bench's 3,000-leaf Orbax and DCP checkpoints (bench/out/orbax_3000,
    bench/out/dcp_3000), built by inspect_bench's own generator;
  * a 2 GiB Orbax checkpoint (bench/out/orbax_2gib): 64 float32 arrays of
    (4096, 2048) = 32 MiB each, NamedSharding P('data', 'model') on a 4x2 mesh
    of 8 CPU devices, so 8 chunks of (1024, 1024) = 4 MiB per array, saved by
    ocp.StandardCheckpointer (OCDBT + zarr v2, the defaults);
  * its DCP twin (bench/out/dcp_2gib): the same tensors, dcp.save() from one
    process (one chunk of 32 MiB per tensor).

It then times WHOLE PROCESSES, each cold-started (a fresh interpreter) with a
warm page cache, in pairs:

  shallow  ckpt validate --json <3,000-leaf ckpt>
           vs a tensorstore key listing of the same checkpoint
           (Orbax: the OCDBT database's keys plus the directory's files;
           DCP: the directory's files)                  target ckpt/listing <= 2x
  deep     ckpt validate --deep --json <2 GiB ckpt>
           vs reading the same bytes with tensorstore alone, 4 threads
           (Orbax: every zarr array through the OCDBT kvstore, read whole;
           DCP: every .distcp file in 32 MiB byte ranges)  no target: the
           ratio and ckpt's peak RSS are reported (a note when RSS > 512 MiB)

Each command runs once as a warm-up whose output is checked (ckpt must report
ok: true, no finding at all, and the counts it checked; the baselines must see
the keys / bytes), then N times (default 3) with stdout to /dev/null; the best
wall time counts. Peak RSS comes from the kernel's rusage for that one child
(os.wait4), as in inspect_bench.py, whose process runner this bench reuses.

Exit status: 0 when every command ran and ckpt's output checked out (targets
met or not); 1 when a command failed, or ckpt reported a finding (or wrong
counts) on these good checkpoints.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import inspect_bench as ib  # noqa: E402  (3,000-leaf generator, process runner, page-cache warmer)

REPO = ib.REPO
OUT = ib.OUT
SHALLOW_TARGET = 2.0  # ckpt validate / listing
RSS_NOTE_KIB = 512 * 1024  # --deep must stay bounded: note a peak above this
BIG_CACHE_VERSION = 1  # bump when the 2 GiB checkpoints change
BIG_ARRAYS = 64
BIG_SHAPE = (4096, 2048)  # float32: 32 MiB per array, 2 GiB in all
BIG_ITEMSIZE = 4
BIG_NBYTES = BIG_ARRAYS * BIG_SHAPE[0] * BIG_SHAPE[1] * BIG_ITEMSIZE
BASELINE_THREADS = 4  # = ckpt validate's default --workers
DCP_BLOCK = 32 << 20  # byte range per read in the DCP read baseline
BIG_GEN_TIMEOUT_S = 1800


# --------------------------------------------------------------------------
# the 2 GiB checkpoints (generated in a subprocess: --generate-big orbax|dcp)
# --------------------------------------------------------------------------


def _big_name(i: int) -> str:
    return f"w{i:02d}"


def _big_value(i: int):
    """Array i of the 2 GiB checkpoints: standard normal float32 (finite), seeded per array."""
    import numpy as np

    return np.random.default_rng(20261130 + i).standard_normal(BIG_SHAPE, dtype=np.float32)


def _generate_big_orbax(path: str) -> None:
    import logging

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    logging.getLogger("absl").setLevel(logging.ERROR)
    import orbax.checkpoint as ocp

    assert jax.device_count() == ib.DEVICE_COUNT, jax.devices()
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    params = {}
    for i in range(BIG_ARRAYS):
        params[_big_name(i)] = jax.device_put(_big_value(i), sharding)
    ck = ocp.StandardCheckpointer()
    ck.save(path, {"params": params})
    ck.wait_until_finished()
    ck.close()


def _generate_big_dcp(path: str) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = {"params": {_big_name(i): torch.from_numpy(_big_value(i)) for i in range(BIG_ARRAYS)}}
    dcp.save(state, checkpoint_id=path)


def ensure_big_checkpoints(regen: bool, log) -> dict:
    """Build the two 2 GiB checkpoints unless cached; return {fmt: path}."""
    os.makedirs(OUT, exist_ok=True)
    paths = {}
    for fmt in ("orbax", "dcp"):
        path = os.path.join(OUT, f"{fmt}_2gib")
        stamp = path + ".done.json"
        paths[fmt] = path
        if not regen and ib.is_cached(path, BIG_CACHE_VERSION):
            continue
        ib.clear_cached(path)
        free = shutil.disk_usage(OUT).free
        if free < 3 * BIG_NBYTES:
            raise SystemExit(f"not enough disk for the {fmt} 2 GiB checkpoint: {free / 2**30:.1f} GiB free in {OUT}")
        log(f"generating the 2 GiB {fmt} checkpoint -> {os.path.relpath(path, REPO)} ...")
        tmp = path + ".tmp"
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--generate-big", fmt, "--path", tmp],
            env=ib._gen_env(), cwd=OUT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=BIG_GEN_TIMEOUT_S,
        )
        if proc.returncode != 0 or not os.path.isdir(tmp):
            sys.stderr.write(proc.stdout[-6000:])
            raise SystemExit(f"generating the 2 GiB {fmt} checkpoint failed (exit {proc.returncode})")
        os.rename(tmp, path)
        files, size = ib._dir_stats(path)
        with open(stamp, "w") as f:
            json.dump(
                {"cache_version": BIG_CACHE_VERSION, "arrays": BIG_ARRAYS, "shape": list(BIG_SHAPE),
                 "dtype": "float32", "array_bytes": BIG_NBYTES, "files": files, "bytes": size,
                 "seconds": round(time.monotonic() - t0, 1)},
                f,
            )
        log(f"  done in {time.monotonic() - t0:.1f}s ({files} files, {size / 2**20:.0f} MiB)")
    return paths


def _distcp_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


# --------------------------------------------------------------------------
# the baselines: tensorstore alone, each printing what it saw (checked on the warm-up)
# --------------------------------------------------------------------------

# prints: <OCDBT keys> <files>
LIST_ORBAX = r"""
import os, sys
import tensorstore as ts
d = os.path.abspath(sys.argv[1]) + "/"
keys = ts.KvStore.open({"driver": "ocdbt", "base": "file://" + d}).result().list().result()
files = ts.KvStore.open({"driver": "file", "path": d}).result().list().result()
print(len(keys), len(files))
"""

# prints: <files>
LIST_DCP = r"""
import os, sys
import tensorstore as ts
d = os.path.abspath(sys.argv[1]) + "/"
files = ts.KvStore.open({"driver": "file", "path": d}).result().list().result()
print(len(files))
"""

# prints: <arrays> <bytes decoded>
READ_ORBAX = r"""
import os, sys
from concurrent.futures import ThreadPoolExecutor
import tensorstore as ts
d, threads = os.path.abspath(sys.argv[1]) + "/", int(sys.argv[2])
base = "file://" + d
ctx = ts.Context()
keys = ts.KvStore.open({"driver": "ocdbt", "base": base}, context=ctx).result().list().result()
names = sorted(k.decode()[: -len("/.zarray")] for k in keys if k.endswith(b"/.zarray"))
def read(name):
    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": base, "path": name + "/"}}
    arr = ts.open(spec, open=True, read=True, context=ctx).result()
    return arr.read().result().nbytes
with ThreadPoolExecutor(threads) as pool:
    total = sum(pool.map(read, names))
print(len(names), total)
"""

# prints: <files> <bytes read>
READ_DCP = r"""
import os, sys
from concurrent.futures import ThreadPoolExecutor
import tensorstore as ts
d, threads, block = os.path.abspath(sys.argv[1]) + "/", int(sys.argv[2]), int(sys.argv[3])
kv = ts.KvStore.open({"driver": "file", "path": d}).result()
files = sorted(f for f in os.listdir(d) if f.endswith(".distcp"))
ranges = [(f, s, min(s + block, n)) for f in files for n in [os.path.getsize(d + f)] for s in range(0, n, block)]
def read(r):
    f, s, e = r
    return len(kv.read(f, byte_range=slice(s, e)).result().value)
with ThreadPoolExecutor(threads) as pool:
    total = sum(pool.map(read, ranges))
print(len(files), total)
"""


def commands(small: dict, big: dict | None, n_leaves: int) -> list[dict]:
    py = sys.executable
    # the console script users run (python -m adds runpy's imports)
    script = os.path.join(os.path.dirname(py), "ckpt")
    validate = ([script] if os.path.exists(script) else [py, "-m", "ckpt_tool"]) + ["validate", "--json"]
    cmds = [
        {"name": "ckpt-orbax-shallow", "format": "orbax", "mode": "shallow", "role": "ckpt",
         "argv": validate + [small["orbax"]], "label": "ckpt validate --json <orbax_3000>"},
        {"name": "list-orbax", "format": "orbax", "mode": "shallow", "role": "baseline",
         "argv": [py, "-c", LIST_ORBAX, small["orbax"]], "label": "ts ocdbt list + file list <orbax_3000>"},
        {"name": "ckpt-dcp-shallow", "format": "dcp", "mode": "shallow", "role": "ckpt",
         "argv": validate + [small["dcp"]], "label": "ckpt validate --json <dcp_3000>"},
        {"name": "list-dcp", "format": "dcp", "mode": "shallow", "role": "baseline",
         "argv": [py, "-c", LIST_DCP, small["dcp"]], "label": "ts file list <dcp_3000>"},
    ]
    if big:
        cmds += [
            {"name": "ckpt-orbax-deep", "format": "orbax", "mode": "deep", "role": "ckpt",
             "argv": validate + ["--deep", big["orbax"]], "label": "ckpt validate --deep --json <orbax_2gib>"},
            {"name": "read-orbax", "format": "orbax", "mode": "deep", "role": "baseline",
             "argv": [py, "-c", READ_ORBAX, big["orbax"], str(BASELINE_THREADS)],
             "label": f"ts zarr/ocdbt read, {BASELINE_THREADS} threads <orbax_2gib>"},
            {"name": "ckpt-dcp-deep", "format": "dcp", "mode": "deep", "role": "ckpt",
             "argv": validate + ["--deep", big["dcp"]], "label": "ckpt validate --deep --json <dcp_2gib>"},
            {"name": "read-dcp", "format": "dcp", "mode": "deep", "role": "baseline",
             "argv": [py, "-c", READ_DCP, big["dcp"], str(BASELINE_THREADS), str(DCP_BLOCK)],
             "label": f"ts file read, {DCP_BLOCK >> 20} MiB ranges, {BASELINE_THREADS} threads <dcp_2gib>"},
        ]
    for c in cmds:
        if c["mode"] == "shallow":
            c["expect"] = {"arrays" if c["format"] == "orbax" else "tensors": n_leaves}
        else:
            c["expect"] = {"arrays" if c["format"] == "orbax" else "tensors": BIG_ARRAYS, "bytes_read": BIG_NBYTES}
    return cmds


# --------------------------------------------------------------------------
# checking the output
# --------------------------------------------------------------------------


def check_validate_json(cmd: dict, text: str) -> list[str]:
    """ckpt validate on a good checkpoint: ok, no finding, the expected counts."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return [f"output is not JSON: {exc}"]
    errors = []
    if doc.get("format") != cmd["format"]:
        errors.append(f"format is {doc.get('format')!r}, expected {cmd['format']!r}")
    if doc.get("deep") is not (cmd["mode"] == "deep"):
        errors.append(f"deep is {doc.get('deep')!r}")
    if doc.get("ok") is not True:
        errors.append(f"ok is {doc.get('ok')!r} on a good checkpoint")
    findings = doc.get("findings") or []
    if findings:
        errors.append(f"{len(findings)} finding(s) on a good checkpoint (a bug):")
        for f in findings[:10]:
            where = " ".join(x for x in (f.get("leaf"), f.get("file")) if x)
            errors.append(f"  {f.get('severity')} {f.get('code')}: {f.get('message')}" + (f" [{where}]" if where else ""))
        if len(findings) > 10:
            errors.append(f"  ... and {len(findings) - 10} more")
    checked = doc.get("checked") or {}
    for key, want in cmd["expect"].items():
        if checked.get(key) != want:
            errors.append(f"checked.{key} is {checked.get(key)!r}, expected {want}")
    return errors


def check_baseline_output(cmd: dict, text: str, big: dict | None) -> list[str]:
    words = text.split()
    try:
        nums = [int(w) for w in words]
    except ValueError:
        return [f"unexpected output {text.strip()[:200]!r}"]
    if cmd["name"] == "list-orbax":
        ok = len(nums) == 2 and nums[0] > cmd["expect"]["arrays"] and nums[1] > 0
    elif cmd["name"] == "list-dcp":
        ok = len(nums) == 1 and nums[0] > 0
    elif cmd["name"] == "read-orbax":
        ok = nums == [BIG_ARRAYS, BIG_NBYTES]
    else:  # read-dcp: every byte of every .distcp file
        ok = len(nums) == 2 and nums[0] > 0 and big is not None and nums[1] == _distcp_bytes(big["dcp"])
    return [] if ok else [f"the baseline saw {text.strip() or 'nothing'!r}"]


def _checked_of(text: str) -> dict:
    try:
        return json.loads(text).get("checked") or {}
    except (ValueError, AttributeError):
        return {}


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def _tail(r: dict) -> str:
    return (r["stderr"].strip().splitlines() or ["(no stderr)"])[-1]


def run_command(cmd: dict, runs: int, big: dict | None, log) -> dict:
    res = dict(name=cmd["name"], format=cmd["format"], mode=cmd["mode"], role=cmd["role"], command=cmd["label"],
               ok=True, error=None, best_s=None, runs_s=[], best_cpu_s=None, cpu_s=[], peak_rss_kib=None,
               checked=None, output=None, check_errors=[], notes=[])
    log(f"running {cmd['name']}: 1 warm-up + {runs} runs ...")
    warm = ib.run_once(cmd["argv"], capture=True)
    # ckpt validate exits 1 when it has an error finding, and still prints its JSON
    ran = warm["rc"] == 0 or (cmd["role"] == "ckpt" and warm["rc"] == 1 and warm["stdout"].lstrip().startswith("{"))
    if not ran:
        res.update(ok=False, error=f"exit {warm['rc']}: {_tail(warm)}")
        return res
    if cmd["role"] == "ckpt":
        res["checked"] = _checked_of(warm["stdout"])
        res["check_errors"] = check_validate_json(cmd, warm["stdout"])
    else:
        res["output"] = warm["stdout"].strip()
        res["check_errors"] = check_baseline_output(cmd, warm["stdout"], big)
    if res["check_errors"]:
        res["ok"] = False
    rss = []
    for _ in range(runs):
        r = ib.run_once(cmd["argv"], capture=False)
        if r["rc"] != warm["rc"]:
            res.update(ok=False, error=f"exit {r['rc']}: {_tail(r)}")
            break
        res["runs_s"].append(round(r["wall"], 4))
        res["cpu_s"].append(round(r["cpu"], 4))
        rss.append(r["rss_kib"])
    if res["runs_s"]:
        res["best_s"] = min(res["runs_s"])
        res["best_cpu_s"] = res["cpu_s"][res["runs_s"].index(res["best_s"])]
        res["peak_rss_kib"] = max(rss)
    if cmd["role"] == "ckpt" and cmd["mode"] == "deep" and res["peak_rss_kib"] and res["peak_rss_kib"] > RSS_NOTE_KIB:
        res["notes"].append(f"peak RSS {res['peak_rss_kib'] / 1024:.0f} MiB is above {RSS_NOTE_KIB >> 10} MiB")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per command after one warm-up (default 3)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--regen", action="store_true", help="rebuild the cached checkpoints in bench/out/")
    ap.add_argument("--layers", type=int, default=1000,
                    help="layers of inspect_bench's tree for the shallow part, 3 leaves each (default 1000)")
    ap.add_argument("--no-deep", action="store_true", help="skip the 2 GiB --deep part")
    ap.add_argument("--generate-big", choices=("orbax", "dcp"), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runs < 1 or args.layers < 1:
        ap.error("--runs and --layers must be at least 1")

    if args.generate_big:  # internal: build one 2 GiB checkpoint in this (fresh) process
        (_generate_big_orbax if args.generate_big == "orbax" else _generate_big_dcp)(args.path)
        return 0

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    load_at_start = os.getloadavg()[0]  # other work on a 2-core box skews wall times
    small = ib.ensure_checkpoints(args.layers, args.regen, log)
    big = None if args.no_deep else ensure_big_checkpoints(args.regen, log)
    n_leaves = args.layers * len(ib.LEAVES)

    results = []
    loads = {}
    for mode in ("shallow", "deep"):
        cmds = [c for c in commands(small, big, n_leaves) if c["mode"] == mode]
        if not cmds:
            continue
        for p in (small if mode == "shallow" else big).values():
            ib.warm_page_cache(p)
        loads[mode] = round(os.getloadavg()[0], 2)
        for cmd in cmds:
            results.append(run_command(cmd, args.runs, big, log))
    failed = any(not r["ok"] for r in results)

    by_name = {r["name"]: r for r in results}
    ratios = []
    pairs = [("orbax", "shallow", "ckpt-orbax-shallow", "list-orbax"), ("dcp", "shallow", "ckpt-dcp-shallow", "list-dcp")]
    if big:
        pairs += [("orbax", "deep", "ckpt-orbax-deep", "read-orbax"), ("dcp", "deep", "ckpt-dcp-deep", "read-dcp")]
    for fmt, mode, ck, base in pairs:
        a, b = by_name[ck], by_name[base]
        measured = a["ok"] and b["ok"] and a["best_s"] and b["best_s"]
        ratio = a["best_s"] / b["best_s"] if measured else None
        target = SHALLOW_TARGET if mode == "shallow" else None
        q = {
            "format": fmt, "mode": mode, "ckpt": ck, "baseline": base,
            "ratio": round(ratio, 2) if ratio is not None else None,
            "target": target,
            "met": None if ratio is None or target is None else ratio <= target,
            "ckpt_peak_rss_kib": a["peak_rss_kib"],
        }
        if mode == "deep" and measured:
            q["ckpt_gib_per_s"] = round(BIG_NBYTES / 2**30 / a["best_s"], 3)
            q["baseline_gib_per_s"] = round(BIG_NBYTES / 2**30 / b["best_s"], 3)
        ratios.append(q)

    report = {
        **ib.report_header("validate", load_at_start, loads),
        "leaves": n_leaves,
        "deep_bytes": BIG_NBYTES if big else None,
        "runs": args.runs,
        "checkpoints": {
            **{f"{fmt}_shallow": os.path.relpath(p, REPO) for fmt, p in small.items()},
            **({f"{fmt}_deep": os.path.relpath(p, REPO) for fmt, p in big.items()} if big else {}),
        },
        "results": results,
        "ratios": ratios,
        "ok": not failed,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 1 if failed else 0


def _print_table(report: dict) -> None:
    print()
    deep = f", --deep on {report['deep_bytes'] / 2**30:.0f} GiB" if report["deep_bytes"] else ""
    print(f"validate bench: shallow on {report['leaves']} leaves{deep}; best of {report['runs']} runs after "
          f"1 warm-up, {report['machine']['cpus']} cpus, warm page cache")
    load = report["machine"]["loadavg_1min"]
    parts = [f"{k.replace('before_', 'before ')} {v:.2f}" for k, v in load.items()]
    print(f"1-min load average: {', '.join(parts)} (other work on the machine inflates wall times)")
    print()
    w = max(len(r["command"]) for r in report["results"])
    print(f"  {'command':<{w}}  {'best wall':>10}  {'cpu':>8}  {'peak RSS':>9}  status")
    for r in report["results"]:
        status = "ok" if r["ok"] else ("FAILED: " + (r["error"] or r["check_errors"][0]))
        print(f"  {r['command']:<{w}}  {ib._fmt_s(r['best_s']):>10}  {ib._fmt_s(r.get('best_cpu_s')):>8}  "
              f"{ib._fmt_mib(r['peak_rss_kib']):>9}  {status}")
        for line in (r["check_errors"][1:] if not r["error"] else r["check_errors"]):
            print(f"  {'':<{w}}  {line}")
        for note in r["notes"]:
            print(f"  {'':<{w}}  NOTE: {note}")
    print()
    for q in report["ratios"]:
        head = f"  {q['format']:<5}  {q['mode']:<7}  {q['ckpt']} / {q['baseline']}"
        if q["ratio"] is None:
            print(f"{head}: n/a (a command failed or its output was wrong)   TARGET NOT MEASURED")
        elif q["target"] is not None:
            verdict = "TARGET MET" if q["met"] else "TARGET MISSED"
            print(f"{head} = {q['ratio']:.2f}x (target <= {q['target']:.0f}x)   {verdict}")
        else:
            rss = q["ckpt_peak_rss_kib"]
            note = "  NOTE: above 512 MiB" if rss and rss > RSS_NOTE_KIB else ""
            print(f"{head} = {q['ratio']:.2f}x (no target; ckpt {q['ckpt_gib_per_s']:.2f} GiB/s, "
                  f"tensorstore {q['baseline_gib_per_s']:.2f} GiB/s, ckpt peak RSS {ib._fmt_mib(rss)}){note}")
    print()


if __name__ == "__main__":
    sys.exit(main())


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table: one per ratio (shallow: vs a key listing, --deep: vs a read)."""
    by = {r["name"]: r for r in doc.get("results", [])}
    rows = []
    for q in doc.get("ratios", []):
        a, b = by.get(q["ckpt"], {}), by.get(q["baseline"], {})
        rss = q.get("ckpt_peak_rss_kib")
        if q["mode"] == "shallow":
            case = f"shallow, {doc.get('leaves', '?'):,} leaves, {q['format']}"
        else:
            case = f"--deep, {(doc.get('deep_bytes') or 0) / 2**30:.0f} GiB, {q['format']}"
        rows.append({
            "bench": "validate", "case": case,
            "ckpt_s": a.get("best_s"), "baseline": b.get("command", q["baseline"]), "baseline_s": b.get("best_s"),
            "ratio": q["ratio"], "target": None if q["target"] is None else f"ckpt/baseline <= {q['target']:g}x",
            "met": q["met"], "rss_mib": round(rss / 1024) if rss else None,
            "error": a.get("error") or b.get("error") or "; ".join(a.get("check_errors", []) + b.get("check_errors", [])),
        })
    return rows
