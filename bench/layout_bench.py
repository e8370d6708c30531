#!/usr/bin/env python3
"""Issue 32's ratios on this machine: many chunks, all the cores, the margin over orbax.

    python bench/layout_bench.py [--runs N] [--json] [--regen] [--workers W ...]

Input: a transformer-like Orbax checkpoint (bench/out/layout_tf, built once by real orbax with 8 CPU
devices on a 2x4 ('data', 'model') mesh; --regen rebuilds it): 147 leaves, 800 MiB, bfloat16 attention
matrices, float32 embeddings, MLP matrices and vectors, as the issue's (158 leaves, 2.3 GiB) was. And
the same tree saved from ONE device (bench/out/layout_tf_1dev), as the issue's TPU host saved it from
its one chip: every array one chunk, the 128 MiB embedding over what --memory lets an output chunk
assemble (reshard copies it as it is stored).

Every command is a WHOLE PROCESS (imports count), the source in the page cache (read before each run),
the output deleted after each run (not timed). The commands run in rounds, each round every command
once in the same order, so the ratios compare runs made under the same load; each time is the MEDIAN
of --runs rounds (default 3) after one warm-up round.

  reshard 8     ckpt reshard SRC DST --mesh data=2,model=4 --devices 8 --json
  reshard 256   ckpt reshard SRC DST --mesh data=16,model=16 --devices 256 --fsdp data --json
  convert       ckpt convert SRC DST --to dcp --json (the default --workers), and with each --workers W
  cp + sync     cp -r SRC DST && sync (a durable copy: what ckpt's fsyncs give)
  orbax route   a python process with 8 CPU devices: StandardCheckpointer().restore(SRC, target) onto
                Mesh(2x4, ('data', 'model')) with each leaf's recorded partition spec (SRC's _sharding),
                then .save(DST) + wait_until_finished()
  host: ...     the one-device source: reshard --mesh data=1,model=1 --devices 1 (this host's layout),
                convert --to dcp, cp + sync, and orbax's route onto a 1x1 mesh

Ratios and their targets (the issue's, here on this machine's cores):

  reshard 256 / reshard 8        <= 1.5x
  convert / (cp -r && sync)      <= 1.5x
  orbax route / reshard 8        >= 3x
  host: convert / (cp && sync)   <= 1.5x
  host: orbax route / reshard    >= 3x

The reshard outputs are checked once (not timed): JSON counts, and `ckpt diff SRC DST --values`
finds no difference. Exit 0 when every command ran and checked out, targets met or not.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import convert_bench as cb  # noqa: E402  (ckpt diff check, table printing)
import inspect_bench as ib  # noqa: E402  (process runner, page-cache warmer, report header)

REPO = ib.REPO
OUT = ib.OUT
SRC = os.path.join(OUT, "layout_tf")
SRC_1DEV = os.path.join(OUT, "layout_tf_1dev")  # the same tree saved from one device
TMP = os.path.join(OUT, "tmp_layout")
CACHE_VERSION = 1
GEN_TIMEOUT_S = 900
LEAVES = 147
NBYTES = 839_364_608
TARGETS = {  # what -> (target, op)
    "reshard_256_over_8": (1.5, "<="),
    "convert_over_cp_sync": (1.5, "<="),
    "orbax_over_reshard": (3.0, ">="),
    "host_convert_over_cp_sync": (1.5, "<="),
    "host_orbax_over_reshard": (3.0, ">="),
    "host_reshard_256_over_8": (1.5, "<="),
}

GEN = r"""
import os, sys, logging, warnings
warnings.filterwarnings("ignore")
import numpy as np, jax, jax.numpy as jnp, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
logging.getLogger("absl").setLevel(logging.ERROR)
D, F, L, V = 1024, 4096, 12, 32768
rows, cols = (int(n) for n in sys.argv[2].split("x"))
mesh = Mesh(np.array(jax.devices()[: rows * cols]).reshape(rows, cols), ("data", "model"))
key = jax.random.PRNGKey(32)
n = [0]
def arr(shape, dtype, spec):
    n[0] += 1
    x = jax.random.normal(jax.random.fold_in(key, n[0]), shape, jnp.float32).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, spec))
tree = {"embed": arr((V, D), jnp.float32, P("model", "data")), "final_norm": arr((D,), jnp.float32, P()),
        "lm_bias": arr((V,), jnp.float32, P("model")), "layers": []}
for i in range(L):
    tree["layers"].append({
        "attn": {k: arr((D, D), jnp.bfloat16, P("data", "model")) for k in ("q", "k", "v", "o")},
        "mlp": {"wi_0": arr((D, F), jnp.float32, P("data", "model")), "wi_1": arr((D, F), jnp.float32, P("data", "model")),
                "wo": arr((F, D), jnp.float32, P("model", "data")), "bi": arr((F,), jnp.float32, P("model")),
                "bo": arr((D,), jnp.float32, P())},
        "ln1": arr((D,), jnp.float32, P()), "ln2": arr((D,), jnp.float32, P()),
        "attn_bias": arr((D,), jnp.bfloat16, P("model"))})
ck = ocp.StandardCheckpointer(); ck.save(sys.argv[1], tree); ck.wait_until_finished(); ck.close()
"""

# orbax's own route to the 2x4 layout: restore onto the mesh with each leaf's recorded spec, then save
ORBAX_ROUTE = r"""
import base64, json, logging, os, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
logging.getLogger("absl").setLevel(logging.ERROR)
import orbax.checkpoint as ocp
src, dst = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
rows, cols = (int(n) for n in sys.argv[3].split("x"))
mesh = Mesh(np.array(jax.devices()[: rows * cols]).reshape(rows, cols), ("data", "model"))
with open(os.path.join(src, "_sharding")) as f:
    specs = {base64.urlsafe_b64decode(k).decode(): json.loads(v)["partition_spec"] for k, v in json.load(f).items()}
ck = ocp.StandardCheckpointer()
tree = ck.metadata(src).item_metadata.tree
def target(path, m):
    name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    spec = [tuple(e) if isinstance(e, list) else e for e in specs[name]]
    return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=NamedSharding(mesh, P(*spec)))
restored = ck.restore(src, jax.tree_util.tree_map_with_path(target, tree))
ck.save(dst, restored)
ck.wait_until_finished()
ck.close()
leaves = jax.tree.leaves(restored)
print(len(leaves), sum(x.nbytes for x in leaves))
"""


def ensure_source(regen: bool, log, src: str = SRC, mesh: str = "2x4") -> str:
    """The cached checkpoint `src`, saved by orbax from a `mesh` ('2x4', or '1x1': one device)."""
    os.makedirs(OUT, exist_ok=True)
    if not regen and ib.is_cached(src, CACHE_VERSION):
        return src
    ib.clear_cached(src)
    log(f"generating the transformer-like checkpoint ({mesh} mesh) -> {os.path.relpath(src, REPO)} ...")
    tmp = src + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", GEN, tmp, mesh], env=ib._gen_env(), cwd=OUT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=GEN_TIMEOUT_S)
    if proc.returncode != 0 or not os.path.isdir(tmp):
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(f"generating the checkpoint failed (exit {proc.returncode})")
    os.rename(tmp, src)
    files, size = ib._dir_stats(src)
    with open(src + ".done.json", "w") as f:
        json.dump({"cache_version": CACHE_VERSION, "leaves": LEAVES, "array_bytes": NBYTES, "files": files,
                   "bytes": size, "seconds": round(time.monotonic() - t0, 1)}, f)
    log(f"  done in {time.monotonic() - t0:.1f}s ({files} files, {size / 2**20:.0f} MiB)")
    return src


def commands(workers: list[int]) -> list[dict]:
    py = sys.executable
    ckpt = [py, "-m", "ckpt_tool"]

    def dst(name: str) -> str:
        return os.path.join(TMP, name)

    cmds = [
        {"name": "reshard-8", "role": "ckpt", "dst": dst("r8"), "label": "ckpt reshard --mesh data=2,model=4 --devices 8",
         "argv": ckpt + ["reshard", SRC, dst("r8"), "--mesh", "data=2,model=4", "--devices", "8", "--json"]},
        {"name": "reshard-256", "role": "ckpt", "dst": dst("r256"),
         "label": "ckpt reshard --mesh data=16,model=16 --devices 256 --fsdp data",
         "argv": ckpt + ["reshard", SRC, dst("r256"), "--mesh", "data=16,model=16", "--devices", "256", "--fsdp",
                         "data", "--json"]},
        {"name": "convert", "role": "ckpt", "dst": dst("dcp"), "label": "ckpt convert --to dcp (default --workers)",
         "argv": ckpt + ["convert", SRC, dst("dcp"), "--to", "dcp", "--json"]},
    ]
    for w in workers:
        cmds.append({"name": f"convert-w{w}", "role": "ckpt", "dst": dst(f"dcp{w}"),
                     "label": f"ckpt convert --to dcp --workers {w}",
                     "argv": ckpt + ["convert", SRC, dst(f"dcp{w}"), "--to", "dcp", "--workers", str(w), "--json"]})
    cmds += [
        {"name": "cp-sync", "role": "baseline", "dst": dst("cp"), "label": "cp -r SRC DST && sync",
         "argv": ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", SRC, dst("cp")]},
        {"name": "orbax-route", "role": "baseline", "dst": dst("orbax"),
         "label": "orbax restore onto the 2x4 mesh + save",
         "argv": [py, "-c", ORBAX_ROUTE, SRC, dst("orbax"), "2x4"]},
        # the one-device source, as a TPU host with one chip saved it
        {"name": "host-reshard", "role": "ckpt", "dst": dst("h1"), "src": SRC_1DEV,
         "label": "host: ckpt reshard --mesh data=1,model=1 --devices 1",
         "argv": ckpt + ["reshard", SRC_1DEV, dst("h1"), "--mesh", "data=1,model=1", "--devices", "1", "--json"]},
        # the issue's layout ratio as the TPU host bench takes it: both layouts from the one-device
        # source, so each re-encodes every chunk (from SRC, the 8-device layout copies them as stored)
        {"name": "host-reshard-8", "role": "ckpt", "dst": dst("h8"), "src": SRC_1DEV,
         "label": "host: ckpt reshard --mesh data=2,model=4 --devices 8",
         "argv": ckpt + ["reshard", SRC_1DEV, dst("h8"), "--mesh", "data=2,model=4", "--devices", "8", "--json"]},
        {"name": "host-reshard-256", "role": "ckpt", "dst": dst("h256"), "src": SRC_1DEV,
         "label": "host: ckpt reshard --mesh data=16,model=16 --devices 256 --fsdp data",
         "argv": ckpt + ["reshard", SRC_1DEV, dst("h256"), "--mesh", "data=16,model=16", "--devices", "256",
                         "--fsdp", "data", "--json"]},
        {"name": "host-convert", "role": "ckpt", "dst": dst("hdcp"), "src": SRC_1DEV,
         "label": "host: ckpt convert --to dcp",
         "argv": ckpt + ["convert", SRC_1DEV, dst("hdcp"), "--to", "dcp", "--json"]},
        {"name": "host-cp-sync", "role": "baseline", "dst": dst("hcp"), "src": SRC_1DEV,
         "label": "host: cp -r SRC DST && sync",
         "argv": ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", SRC_1DEV, dst("hcp")]},
        {"name": "host-orbax-route", "role": "baseline", "dst": dst("horbax"), "src": SRC_1DEV,
         "label": "host: orbax restore onto a 1x1 mesh + save",
         "argv": [py, "-c", ORBAX_ROUTE, SRC_1DEV, dst("horbax"), "1x1"]},
    ]
    return cmds


def check(cmd: dict, r: dict, log) -> list[str]:
    """The warm-up run's output: it ran, it wrote what it says; a reshard's values are the source's."""
    if r["rc"] != 0:
        return [f"exit {r['rc']}: {cb._tail(r)}"]
    if not os.path.isdir(cmd["dst"]):
        return ["DST was not created"]
    if cmd["name"].endswith("orbax-route"):
        return [] if r["stdout"].split() == [str(LEAVES), str(NBYTES)] else [f"orbax route printed {r['stdout']!r}"]
    if cmd["role"] != "ckpt":
        return []
    try:
        doc = json.loads(r["stdout"])
    except ValueError as exc:
        return [f"output is not JSON: {exc}"]
    errors = [f"{k} is {doc.get(k)!r}, expected {v!r}" for k, v in (("arrays", LEAVES), ("bytes", NBYTES))
              if doc.get(k) != v]
    if "reshard" in cmd["name"] and not errors:
        log(f"  checking {cmd['name']}'s output: ckpt diff --values ...")
        d = ib.run_once([sys.executable, "-m", "ckpt_tool", "diff", cmd.get("src", SRC), cmd["dst"], "--values", "--json"],
                        capture=True)
        try:
            same = json.loads(d["stdout"])
        except ValueError:
            same = {}
        if d["rc"] != 0 or same.get("same") is not True or same.get("compared") != LEAVES:
            errors.append(f"ckpt diff --values: the output differs from the source (exit {d['rc']}, "
                          f"{same.get('compared')} compared)")
    return errors


def run_rounds(cmds: list[dict], runs: int, log) -> list[dict]:
    res = {c["name"]: {"name": c["name"], "role": c["role"], "command": c["label"], "ok": True, "error": None,
                       "runs_s": [], "cpu_s": [], "rss_kib": [], "check_errors": []} for c in cmds}
    for rnd in range(runs + 1):  # round 0: the warm-up, checked
        log(f"round {rnd}/{runs}{' (warm-up, checked)' if rnd == 0 else ''} ...")
        for c in cmds:
            r = res[c["name"]]
            if not r["ok"]:
                continue
            cb.clean_dir(TMP)
            ib.warm_page_cache(c.get("src", SRC))
            out = ib.run_once(c["argv"], capture=rnd == 0)
            if rnd == 0:
                r["chunks"] = _chunks(out["stdout"])
                r["check_errors"] = check(c, out, log)
                if r["check_errors"]:
                    r["ok"], r["error"] = False, r["check_errors"][0]
                continue
            if out["rc"] != 0:
                r["ok"], r["error"] = False, f"exit {out['rc']} in round {rnd}"
                continue
            r["runs_s"].append(round(out["wall"], 3))
            r["cpu_s"].append(round(out["cpu"], 2))
            r["rss_kib"].append(out["rss_kib"])
    cb.clean_dir(TMP)
    for r in res.values():
        r["median_s"] = round(statistics.median(r["runs_s"]), 3) if r["ok"] and r["runs_s"] else None
        r["peak_rss_kib"] = max(r["rss_kib"]) if r["rss_kib"] else None
    return list(res.values())


def _chunks(stdout: str) -> int | None:
    try:
        return json.loads(stdout).get("chunks")
    except (ValueError, AttributeError):
        return None


def ratios(results: list[dict]) -> list[dict]:
    t = {r["name"]: r["median_s"] for r in results}
    pairs = {
        "reshard_256_over_8": ("reshard-256", "reshard-8"),
        "convert_over_cp_sync": ("convert", "cp-sync"),
        "orbax_over_reshard": ("orbax-route", "reshard-8"),
        "host_convert_over_cp_sync": ("host-convert", "host-cp-sync"),
        "host_orbax_over_reshard": ("host-orbax-route", "host-reshard"),
        "host_reshard_256_over_8": ("host-reshard-256", "host-reshard-8"),
    }
    out = []
    for what, (a, b) in pairs.items():
        value = cb._ratio(t.get(a), t.get(b))
        target, op = TARGETS[what]
        met = None if value is None else (value <= target if op == "<=" else value >= target)
        out.append({"what": what, "of": a, "over": b, "value": value, "target": target, "op": op, "met": met})
    for r in results:  # each --workers W against the durable copy, no target
        if r["name"].startswith("convert-w"):
            out.append({"what": f"{r['name']}_over_cp_sync", "of": r["name"], "over": "cp-sync",
                        "value": cb._ratio(r["median_s"], t.get("cp-sync"))})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--runs", type=int, default=3, help="timed rounds after one warm-up round (default 3)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--regen", action="store_true", help="rebuild the cached checkpoint in bench/out/")
    ap.add_argument("--workers", type=int, action="append", default=[],
                    help="also time convert with --workers W (repeatable)")
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)  # run_all passes it on; unused here
    args, _unknown = ap.parse_known_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    load_at_start = os.getloadavg()[0]
    ensure_source(args.regen, log)
    ensure_source(args.regen, log, SRC_1DEV, "1x1")
    results = run_rounds(commands(sorted(set(args.workers))), args.runs, log)
    if os.path.isdir(TMP):
        shutil.rmtree(TMP)
    report = {**ib.report_header("layout", load_at_start), "checkpoint": os.path.relpath(SRC, REPO),
              "leaves": LEAVES, "bytes": NBYTES, "runs": args.runs, "results": results, "ratios": ratios(results),
              "ok": all(r["ok"] for r in results)}
    from ckpt_tool.base.parallel import default_workers

    report["default_workers"] = default_workers()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0 if report["ok"] else 1


def _print_report(report: dict) -> None:
    print()
    print(f"layout bench: {report['checkpoint']} ({report['leaves']} leaves, {report['bytes'] / 2**20:.0f} MiB), "
          f"median of {report['runs']} rounds, {report['machine']['cpus']} cpus, default --workers "
          f"{report.get('default_workers')}")
    for r in report["results"]:
        t = "FAILED: " + str(r["error"]) if not r["ok"] else f"{r['median_s']:.2f} s (runs {r['runs_s']})"
        chunks = f", {r['chunks']} chunks" if r.get("chunks") else ""
        rss = f", peak RSS {ib._fmt_mib(r['peak_rss_kib'])}" if r.get("peak_rss_kib") else ""
        print(f"  {r['command']:<62} {t}{chunks}{rss}")
    print()
    for q in report["ratios"]:
        v = "-" if q["value"] is None else f"{q['value']:.2f}x"
        if "target" in q:
            met = "met" if q["met"] else ("MISSED" if q["met"] is False else "-")
            print(f"  {q['of']} / {q['over']}: {v}  (target {q['op']} {q['target']:g}x: {met})")
        else:
            print(f"  {q['of']} / {q['over']}: {v}  (no target)")
    print()


def summary_rows(doc: dict) -> list[dict]:
    """Rows for run_all's overall table: the ratios with their targets."""
    by = {r["name"]: r for r in doc.get("results", [])}
    rows = []
    for q in doc.get("ratios", []):
        if "target" not in q:
            continue
        a, b = by.get(q["of"], {}), by.get(q["over"], {})
        if q["op"] == ">=":  # baseline time / ckpt time: ckpt is the denominator
            a, b = b, a
        rss = a.get("peak_rss_kib")
        rows.append({
            "bench": "layout", "case": f"{a.get('command', q['of'])}, {doc.get('bytes', 0) / 2**20:.0f} MiB",
            "ckpt_s": a.get("median_s"), "baseline": b.get("command", q["over"]), "baseline_s": b.get("median_s"),
            "ratio": q["value"], "target": f"{q['of']}/{q['over']} {q['op']} {q['target']:g}x", "met": q["met"],
            "rss_mib": round(rss / 1024) if rss else None, "error": a.get("error") or b.get("error"),
        })
    return rows


if __name__ == "__main__":
    sys.exit(main())
