#!/usr/bin/env python3
"""Benchmark ckpt on the chunk shapes real checkpoints have, each against its baseline in the same run.

    python bench/shapes_bench.py [--shape NAME ...] [--json] [--regen] [--runs N]

Shapes (Orbax sources; built once into bench/out/, git-ignored, --regen rebuilds):

  wide          bench/out/orbax_3000 (inspect_bench's: 3,000 small leaves, 17 MiB)
  sharded       bench/out/orbax_2gib (validate_bench's: 64 x (4096, 2048) float32, 512 chunks of 4 MiB)
  big_chunks    four (16384, 12288) float32 arrays (768 MiB each, 3 GiB) saved by orbax on ONE device:
                one zstd-compressed zarr chunk each (orbax's default), larger than the default --memory
                (so decoded as a stream)
  big_chunks_raw  the same arrays saved by orbax without compression (use_compression=False)
  over_budget   one (32768, 16384) float32 array (2 GiB, one chunk) on one device, ckpt run with --memory 512MB
  replicated    eight (4096, 4096) float32 arrays (512 MiB) replicated on a 2x4 mesh (8 CPU devices)

Every Orbax shape is saved with orbax's defaults (zarr v2 chunks compressed with zstd) unless its
name says raw. Each has a twin written by torch.distributed.checkpoint.save from the arrays orbax
restores (<src>-torch-dcp: one item per tensor, as torch lays it out; one 768 MiB item per array for
big_chunks), built once beside it.

Per shape, each a fresh process, the source read once before (warm page cache):

  validate --deep      vs tensorstore reading every array once (validate_bench's READ_ORBAX, 4 threads)
  convert --to dcp     vs orbax restore as numpy + dcp.save (convert_bench's ORBAX_TO_DCP)
  diff --values        the source against its torch-written twin, vs orbax restore + dcp.load of both
                       and a numpy comparison (the libraries' own readers)
  ... --memory 256MiB  (big shapes) diff --values and convert again at the smallest budget, no baseline:
                       the peak RSS row (issue 23: the memory bound holds on every shape)
  reshard data=2,model=4 (--rules: every array P(None, 'model'), or P() for rank < 2)
                       vs orbax restore on the new mesh + save (reshard_bench's BASELINE)

A baseline that would need more memory than the machine has free (orbax restores hold several copies:
the issue measured 18.9 GB for 3 GiB; the factors are in bench_shape) is skipped and said so. Targets: deep <= 1.5x tensorstore;
diff <= 2x the readers; reshard >= 2x faster; convert >= 3x faster; ckpt peak RSS <= budget + 128 MiB
(its own row's budget: 512 MiB by default, 512 MB for over_budget, 256 MiB for the --memory 256MiB rows).
Exit 0 when every command ran (targets met or not).
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

import convert_bench as cb  # noqa: E402
import inspect_bench as ib  # noqa: E402
import reshard_bench as rb  # noqa: E402
import validate_bench as vb  # noqa: E402

OUT = ib.OUT
TMP = os.path.join(OUT, "tmp_shapes")
MIB = 2**20
DEFAULT_MEMORY = 512 * MIB
SETTLE_S = float(os.environ.get("SHAPES_SETTLE", "3"))

GEN = r"""
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import warnings; warnings.filterwarnings("ignore")
import numpy as np, jax, jax.numpy as jnp, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
shape, out = sys.argv[1], sys.argv[2]
key = jax.random.PRNGKey(13)
dev = jax.devices()[0]
if shape == "big_chunks":
    tree = {f"w{i}": jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (16384, 12288), jnp.float32), dev) for i in range(4)}
elif shape == "over_budget":
    tree = {"w": jax.device_put(jax.random.normal(key, (32768, 16384), jnp.float32), dev)}
elif shape == "big_chunks_raw":
    tree = {f"w{i}": jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (16384, 12288), jnp.float32), dev) for i in range(4)}
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)).save(out, tree)
    sys.exit(0)
elif shape == "replicated":
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rep = NamedSharding(mesh, P())
    tree = {f"w{i}": jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (4096, 4096), jnp.float32), rep) for i in range(8)}
ck = ocp.StandardCheckpointer(); ck.save(out, tree); ck.wait_until_finished()
"""

# the torch-written twin of an Orbax source: what orbax restores, saved by dcp.save (one item per tensor)
TORCH_TWIN = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np, jax, torch
import orbax.checkpoint as ocp
import torch.distributed.checkpoint as dcp
src, dst = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
tree = ocp.StandardCheckpointer().metadata(src).item_metadata.tree
args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
restored = ocp.PyTreeCheckpointer().restore(src, restore_args=args)
def to_torch(x):
    if not isinstance(x, np.ndarray):
        return x  # a scalar: saved as torch saves it
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))
dcp.save(jax.tree.map(to_torch, restored), checkpoint_id=dst)
"""

DIFF_BASELINE = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np, jax, torch
import orbax.checkpoint as ocp
import torch.distributed.checkpoint as dcp
src, twin = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
tree = ocp.StandardCheckpointer().metadata(src).item_metadata.tree
args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
a = ocp.PyTreeCheckpointer().restore(src, restore_args=args)
flat = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(a)[0]}
state = {}
for path, v in flat.items():
    node = state
    keys = path.split("/")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = torch.empty(v.shape, dtype=getattr(torch, str(v.dtype)))
dcp.load(state, checkpoint_id=twin)
same = 0
for path, v in flat.items():
    node = state
    for k in path.split("/"):
        node = node[k]
    if node.dtype == torch.bfloat16:  # numpy has no bfloat16: compare the bits
        same += int(np.array_equal(node.view(torch.int16).numpy(), v.view(np.int16)))
    else:
        same += int(np.array_equal(node.numpy(), v))
print(len(flat), same)
"""

# convert_bench's ORBAX_TO_DCP, with bfloat16 arrays handed to torch by their bits
ORBAX_TO_DCP = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np, jax, torch
import orbax.checkpoint as ocp
import torch.distributed.checkpoint as dcp
src, dst = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
tree = ocp.StandardCheckpointer().metadata(src).item_metadata.tree
args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
restored = ocp.PyTreeCheckpointer().restore(src, restore_args=args)
def to_torch(x):
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)
leaves = jax.tree.leaves(restored)
dcp.save(jax.tree.map(to_torch, restored), checkpoint_id=dst)
print(len(leaves), sum(x.nbytes for x in leaves))
"""

SHAPES = {
    "wide": {"src": os.path.join(OUT, "orbax_3000"), "nbytes": 17 * MIB, "memory": None},
    "sharded": {"src": os.path.join(OUT, "orbax_2gib"), "nbytes": 2 * 2**30, "memory": None},
    "big_chunks": {"src": os.path.join(OUT, "shape_big_chunks"), "nbytes": 3 * 2**30, "memory": None, "small": True},
    "big_chunks_raw": {"src": os.path.join(OUT, "shape_big_chunks_raw"), "nbytes": 3 * 2**30, "memory": None,
                       "small": True},
    "over_budget": {"src": os.path.join(OUT, "shape_over_budget"), "nbytes": 2 * 2**30, "memory": "512MB",
                    "small": True},
    "replicated": {"src": os.path.join(OUT, "shape_replicated"), "nbytes": 512 * MIB, "memory": None},
}


def twin_of(shape: str) -> str:
    """Where the torch-written DCP twin of a shape's source lives."""
    return SHAPES[shape]["src"] + "-torch-dcp"


def ensure(shape: str, regen: bool, log) -> None:
    src = SHAPES[shape]["src"]
    done = src + ".done.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if shape == "wide":
        ib.ensure_checkpoints(1000, regen, log)
    elif shape == "sharded":
        vb.ensure_big_checkpoints(regen, log)
    elif regen or not os.path.exists(done):
        shutil.rmtree(src, ignore_errors=True)
        log(f"building {src} ...")
        t0 = time.time()
        subprocess.run([sys.executable, "-c", GEN, shape, src], check=True, env=env, cwd=ib.REPO)
        with open(done, "w") as f:
            json.dump({"built_s": round(time.time() - t0, 1)}, f)
        regen = True  # its twin too
    twin = twin_of(shape)
    if regen or not os.path.exists(twin + ".done.json"):
        shutil.rmtree(twin, ignore_errors=True)
        log(f"building {twin} (torch dcp.save of what orbax restores) ...")
        t0 = time.time()
        subprocess.run([sys.executable, "-c", TORCH_TWIN, src, twin], check=True, env=env, cwd=ib.REPO)
        with open(twin + ".done.json", "w") as f:
            json.dump({"built_s": round(time.time() - t0, 1)}, f)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _run(argv: list[str], src: str, outputs: list[str], capture: bool = True) -> dict:
    for o in outputs:
        shutil.rmtree(o, ignore_errors=True)
    ib.warm_page_cache(src)
    # as convert_bench: the previous command's writeback and freed memory settle first,
    # so neither side pays for the other's
    os.sync()
    time.sleep(SETTLE_S)
    r = ib.run_once(argv, capture=capture)
    for o in outputs:
        shutil.rmtree(o, ignore_errors=True)
    return r


def bench_shape(shape: str, log) -> list[dict]:
    s = SHAPES[shape]
    src = s["src"]
    py = sys.executable
    mem = ["--memory", s["memory"]] if s["memory"] else []
    budget = 512 * 10**6 if s["memory"] == "512MB" else DEFAULT_MEMORY
    os.makedirs(TMP, exist_ok=True)
    rules = os.path.join(TMP, "rules.json")
    with open(rules, "w") as f:
        json.dump([[".*", [None, "model"]]], f)
    rows = []
    # a baseline holding the whole checkpoint several times needs that much free memory:
    # peaks measured on big_chunks (3 GiB): restore + dcp.save 6.7 GB, restore + dcp.load
    # of both sides ~10 GB, restore on the new mesh + save 18.9 GB (the figure)
    free = _mem_available()
    need = {"convert": 2.5, "diff": 3.5, "reshard": 6.2}

    def heavy_fits(what: str) -> bool:
        factor = next(v for k, v in need.items() if what.startswith(k))
        return free > factor * s["nbytes"] + 2**30

    def row(what, ckpt_argv, base_argv, outputs_ckpt, outputs_base, target, op, heavy=False, budget=budget):
        log(f"{shape}: {what}")
        rc = _run(ckpt_argv, src, outputs_ckpt)
        if base_argv is None:  # a peak-RSS row: no baseline
            rb_ = {"wall": None, "rss_kib": None, "rc": None, "stderr": "no baseline (the peak RSS row)"}
        elif heavy and not heavy_fits(what):
            rb_ = {"wall": None, "rss_kib": None, "rc": None, "stderr": "skipped: not enough free memory for the baseline"}
        else:
            rb_ = _run(base_argv, src, outputs_base)
        ratio = None
        if rc["rc"] == 0 and rb_.get("rc") == 0:
            ratio = rb_["wall"] / rc["wall"] if op == ">=" else rc["wall"] / rb_["wall"]
        met = None if ratio is None else (ratio >= target if op == ">=" else ratio <= target)
        rss_ok = rc["rss_kib"] * 1024 <= budget + 128 * MIB if rc["rc"] == 0 else None
        rows.append(entry := {
            "shape": shape, "what": what, "ckpt_s": rc["wall"], "ckpt_rc": rc["rc"], "ckpt_rss_kib": rc["rss_kib"],
            "baseline_s": rb_.get("wall"), "baseline_rc": rb_.get("rc"), "baseline_rss_kib": rb_.get("rss_kib"),
            "ratio": ratio, "target": f"{op} {target}x" if target else None, "met": met, "rss_met": rss_ok,
            "budget": budget,
            "error": (rc["stderr"][-300:] if rc["rc"] else "") or (rb_.get("stderr", "")[-300:] if rb_.get("rc") else ""),
            "note": rb_.get("stderr") if rb_.get("rc") is None else "",
        })
        # each row as it comes (a long run cut short keeps what it measured)
        with open(os.path.join(TMP, "rows.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")

    only = os.environ.get("SHAPES_ONLY")  # e.g. "convert,diff": just those commands
    if only:
        keep = only.split(",")
        inner = row

        def row(what, *a, **k):  # noqa: F811
            if any(what.startswith(w) for w in keep):
                inner(what, *a, **k)

    row("validate --deep", [py, "-m", "ckpt_tool", "validate", src, "--deep", "--json", *mem],
        [py, "-c", vb.READ_ORBAX, src, "4"], [], [], 1.5, "<=")
    out_c = os.path.join(TMP, "ckpt-dcp")
    row("convert --to dcp", [py, "-m", "ckpt_tool", "convert", src, out_c, "--to", "dcp", "--json", *mem],
        [py, "-c", ORBAX_TO_DCP, src, os.path.join(TMP, "base-dcp")], [out_c], [os.path.join(TMP, "base-dcp")],
        3.0, ">=", heavy=True)
    # against the twin torch wrote (its items as torch lays them out: one 768 MiB item per
    # big_chunks array), not ckpt's own output (chunks of at most budget/8), which hid issue 23's break
    twin = twin_of(shape)
    row("diff --values", [py, "-m", "ckpt_tool", "diff", src, twin, "--values", "--json", *mem],
        [py, "-c", DIFF_BASELINE, src, twin], [], [], 2.0, "<=", heavy=True)
    if s.get("small"):
        small = ["--memory", "256MiB"]
        row("diff --values --memory 256MiB", [py, "-m", "ckpt_tool", "diff", src, twin, "--values", "--json", *small],
            None, [], [], None, "<=", budget=256 * MIB)
        row("convert --to dcp --memory 256MiB",
            [py, "-m", "ckpt_tool", "convert", src, out_c, "--to", "dcp", "--json", *small],
            None, [out_c], [], None, ">=", budget=256 * MIB)
    out_r = os.path.join(TMP, "ckpt-reshard")
    out_b = os.path.join(TMP, "base-reshard")
    spec = json.dumps([None, "model"]) if shape != "wide" else json.dumps([])
    rules_args = ["--rules", rules] if shape != "wide" else []
    row("reshard data=2,model=4",
        [py, "-m", "ckpt_tool", "reshard", src, out_r, "--mesh", "data=2,model=4", "--devices", "8", "--json",
         *rules_args, *mem],
        [py, "-c", rb.BASELINE, src, out_b, "data=2,model=4", spec], [out_r], [out_b], 2.0, ">=", heavy=True)
    return rows


def _fmt(x, unit="s"):
    if x is None:
        return "-"
    return f"{x:.2f} {unit}" if unit == "s" else f"{x / 1024:.0f} MiB"


def print_table(rows: list[dict]) -> None:
    print("| shape | command | ckpt | baseline | ratio | target | ckpt peak RSS (budget + 128 MiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        met = "" if r["met"] is None else (" met" if r["met"] else " MISSED")
        rss = _fmt(r["ckpt_rss_kib"], "kib") + ("" if r["rss_met"] is None else (" ok" if r["rss_met"] else " OVER"))
        base = _fmt(r["baseline_s"]) if r["baseline_rc"] == 0 else (r["note"] or f"failed: {r['error'][-120:]}")
        ck = _fmt(r["ckpt_s"]) if r["ckpt_rc"] == 0 else f"FAILED: {r['error'][-120:]}"
        print(f"| {r['shape']} | {r['what']} | {ck} | {base} | {ratio} | {r['target'] or '-'}{met} | {rss} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=list(SHAPES))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--regen", action="store_true")
    ap.add_argument("--runs", type=int, default=1, help="(accepted for run_all; one timed run per command)")
    args, _ = ap.parse_known_args(argv)
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    rows: list[dict] = []
    failed = False
    for shape in args.shape or list(SHAPES):
        try:
            ensure(shape, args.regen, log)
            rows.extend(bench_shape(shape, log))
        except Exception as exc:  # noqa: BLE001 - one shape failing does not stop the others
            log(f"{shape}: {exc}")
            failed = True
    if any(r["ckpt_rc"] != 0 for r in rows):
        failed = True
    if args.json:
        print(json.dumps({"results": rows, "load": os.getloadavg()[0]}, indent=1))
    else:
        print_table(rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())


# what each command is measured against (see the docstring), for run_all's overall table
_BASELINES = {
    "validate": "tensorstore reading every array once",
    "convert": "orbax restore + dcp.save",
    "diff": "orbax restore + dcp.load, numpy compare",
    "reshard": "orbax restore on the new mesh + save",
}


def _target(t: str | None) -> str | None:
    """"<= 1.5x" -> "ckpt/baseline <= 1.5x" (what the ratio is, as bench_shape computes it)."""
    if not t:
        return None
    return ("baseline/ckpt " if t.startswith(">=") else "ckpt/baseline ") + t


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table: one per shape and command, as print_table shows them."""
    rows = []
    for r in doc.get("results", []):
        ok, base_ok = r.get("ckpt_rc") == 0, r.get("baseline_rc") == 0
        budget = r.get("budget")
        rss = r.get("ckpt_rss_kib")
        rows.append({
            "bench": "shapes", "case": f"{r['shape']}: {r['what']}",
            "ckpt_s": r.get("ckpt_s") if ok else None,
            "baseline": next((v for k, v in _BASELINES.items() if r["what"].startswith(k)), "baseline"),
            "baseline_s": r.get("baseline_s") if base_ok else None,
            "ratio": r.get("ratio"), "target": _target(r.get("target")), "met": r.get("met"),
            "rss_mib": round(rss / 1024) if rss and ok else None,
            "rss_target": f"<= {(budget + 128 * MIB) / MIB:g} MiB" if budget else None, "rss_met": r.get("rss_met"),
            "error": (r.get("error") or "") if not (ok and base_ok) else "", "note": r.get("note") or "",
        })
    return rows
