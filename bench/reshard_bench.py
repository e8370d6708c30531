#!/usr/bin/env python3
"""Benchmark `ckpt reshard` (2 GiB, 4x2 -> 2x4 mesh) against orbax's restore onto the new mesh + save.

    python bench/reshard_bench.py [--runs N] [--json] [--regen] [--no-other] [--profile | --profile-only]

Input: validate_bench's bench/out/orbax_2gib (64 float32 arrays of (4096, 2048),
P('data', 'model') on a 4x2 ('data', 'model') mesh of 8 CPU devices, so 512
zstd chunks of (1024, 1024) = 4 MiB), built by its own generator when missing
(cached in bench/out/, rebuilt with --regen).

It times WHOLE PROCESSES, each a freshly started interpreter (imports count),
with the source in the page cache (read once before every run). Every output
goes to bench/out/tmp_reshard/ and is deleted after each run, outside the
timed region (ckpt's DST must not exist). Two cases:

  2x4     ckpt reshard SRC DST --mesh data=2,model=4 --devices 8 --json
          (the recorded spec P('data','model') fits: per-device shard and
          chunk (2048, 512); each output chunk spans 2 source chunks)
          baseline (the issue's): a python process with 8 CPU devices
          (XLA_FLAGS=--xla_force_host_platform_device_count=8) that builds
          Mesh(devices.reshape(2, 4), ('data', 'model')), reads the tree from
          StandardCheckpointer().metadata(SRC), restores it with
          StandardCheckpointer().restore(SRC, target), target a tree of
          jax.ShapeDtypeStruct with NamedSharding(mesh, P('data','model')),
          then StandardCheckpointer().save(DST, restored) + wait_until_finished()
  model8  the same with --mesh model=8 (ckpt keeps 'model' and replicates
          dimension 0: P(None, 'model'), chunk (4096, 256), so every output
          chunk spans 4 source chunks, the chunk grid changing the other way)
          and its baseline onto Mesh(devices.reshape(8), ('model',)) with
          P(None, 'model'); reported without a target (--no-other skips it)

Each command runs once as a warm-up whose output is checked, then N times
(default 2): best wall time, that run's CPU time, peak RSS over the timed runs
(os.wait4 rusage of that one child; inspect_bench.py's process runner).

Checks on ckpt's warm-up output (not timed): its JSON (orbax -> orbax, 64
arrays, 2 GiB, 512 chunks, the new mesh, nothing skipped); `ckpt validate
DST --deep --json` ok with no finding; `ckpt diff SRC DST --values --json`
same for 64 leaves; `ckpt inspect --json DST`: every leaf recorded on the new
mesh with the new spec, its chunk shape the per-device shard or a
replica-split of it, and the same chunk shape orbax's own save wrote (the
baseline's output, inspected on its warm-up). The baseline must report 64
arrays, 2 GiB, every array on the target sharding and the expected shard.
`ckpt reshard --dry-run --json` (not timed) gives the bytes the plan reads:
decoded source chunks per output chunk (a source chunk read for several
output chunks counts each time).

Targets, on the 2x4 case:
  baseline wall / ckpt wall >= 2x
  ckpt peak RSS             <= 512 MiB

--profile then runs `ckpt reshard` in-process under cProfile (every thread's
profile merged), each case in a fresh subprocess: the top functions by own
time and the cumulative time of the plan, the stream, the source reads and
the writer. Reported, never a target. --profile-only runs just that part.

Exit status: 0 when every command ran and ckpt's output checked out (targets
met or not); 1 when a command failed or a check failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import convert_bench as cb  # noqa: E402  (ckpt diff check, ratio)
import inspect_bench as ib  # noqa: E402  (process runner, page-cache warmer, formatting)
import validate_bench as vb  # noqa: E402  (the 2 GiB checkpoint and its generator, validate's JSON check)

REPO = ib.REPO
OUT = ib.OUT
TMP = os.path.join(OUT, "tmp_reshard")
BASELINE_TARGET = 2.0  # baseline wall / ckpt wall >= this
RSS_TARGET_KIB = 512 * 1024  # ckpt peak RSS <= this
N_ARRAYS = vb.BIG_ARRAYS
NBYTES = vb.BIG_NBYTES
SHAPE = vb.BIG_SHAPE
DEVICES = ib.DEVICE_COUNT  # 8
MIN_FREE = 6 * 2**30  # one ~1.9 GiB output at a time, plus slack
PROFILE_TIMEOUT_S = 300

# case -> the new mesh, the spec both ckpt and the baseline use, the expected per-device shard
CASES = {
    "2x4": {"mesh": "data=2,model=4", "spec": ["data", "model"], "shard": (2048, 512), "target": True,
            "label": "data=2,model=4, P('data','model')"},
    "model8": {"mesh": "model=8", "spec": [None, "model"], "shard": (4096, 256), "target": False,
               "label": "model=8, P(None,'model')"},
}

# prints: <arrays> <bytes restored> <arrays not on the target sharding> <JSON list of shard shapes>
BASELINE = r"""
import json, logging, os, sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
logging.getLogger("absl").setLevel(logging.ERROR)
import orbax.checkpoint as ocp
src, dst = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
axes = [(a, int(n)) for a, n in (x.split("=") for x in sys.argv[3].split(","))]
mesh = Mesh(np.array(jax.devices()).reshape([n for _, n in axes]), tuple(a for a, _ in axes))
sharding = NamedSharding(mesh, P(*json.loads(sys.argv[4])))
ck = ocp.StandardCheckpointer()
tree = ck.metadata(src).item_metadata.tree
target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding), tree)
restored = ck.restore(src, target)
ck.save(dst, restored)
ck.wait_until_finished()
ck.close()
leaves = jax.tree.leaves(restored)
bad = sum(1 for x in leaves if x.sharding != sharding)
shards = sorted({tuple(s.data.shape) for x in leaves for s in x.addressable_shards})
print(len(leaves), sum(x.nbytes for x in leaves), bad, json.dumps(shards))
"""


def _dst(name: str) -> str:
    return os.path.join(TMP, name)


def commands(src: str, cases: list[str]) -> list[dict]:
    py = sys.executable
    cmds = []
    for case in cases:
        c = CASES[case]
        dst = _dst(f"ckpt-{case}")
        cmds.append({
            "name": f"ckpt-reshard-{case}", "case": case, "role": "ckpt", "src": src, "outputs": [dst],
            "argv": [py, "-m", "ckpt_tool", "reshard", src, dst, "--mesh", c["mesh"], "--devices", str(DEVICES),
                     "--json"],
            "label": f"ckpt reshard --mesh {c['mesh']} --devices {DEVICES} --json",
        })
        dst = _dst(f"orbax-{case}")
        cmds.append({
            "name": f"orbax-restore-save-{case}", "case": case, "role": "baseline", "src": src, "outputs": [dst],
            "argv": [py, "-c", BASELINE, src, dst, c["mesh"], json.dumps(c["spec"])],
            "label": "orbax restore onto the new mesh + save",
        })
    return cmds


# --------------------------------------------------------------------------
# checking the output (not timed)
# --------------------------------------------------------------------------


def _clean_tmp() -> None:
    cb.clean_dir(TMP)


def _mesh_axes(case: str) -> list[tuple[str, int]]:
    return [(a, int(n)) for a, n in (x.split("=") for x in CASES[case]["mesh"].split(","))]


def allowed_chunks(case: str) -> set[tuple[int, ...]]:
    """The per-device shard, or (held by R > 1 devices) its replica split along the first dimension divisible by R."""
    c = CASES[case]
    sizes = dict(_mesh_axes(case))
    used = math.prod(sizes[a] for a in c["spec"] if a is not None)
    replicas = DEVICES // used
    shard = tuple(c["shard"])
    out = {shard}
    if replicas > 1:
        d = next((d for d, s in enumerate(shard) if s % replicas == 0), None)
        if d is not None:
            out.add(tuple(s // replicas if i == d else s for i, s in enumerate(shard)))
    return out


def check_ckpt_json(cmd: dict, text: str) -> list[str]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return [f"output is not JSON: {exc}"]
    axes = _mesh_axes(cmd["case"])
    want = {"source_format": "orbax", "target_format": "orbax", "arrays": N_ARRAYS, "values": 0, "bytes": NBYTES,
            "chunks": N_ARRAYS * DEVICES, "skipped": [], "process_count": 1}
    errors = [f"{k} is {doc.get(k)!r}, expected {v!r}" for k, v in want.items() if doc.get(k) != v]
    mesh = doc.get("mesh") or {}
    if mesh.get("shape") != [n for _, n in axes] or mesh.get("axis_names") != [a for a, _ in axes]:
        errors.append(f"mesh is {mesh.get('axis_names')} {mesh.get('shape')}, expected {CASES[cmd['case']]['mesh']}")
    if not os.path.isdir(cmd["outputs"][0]):
        errors.append("DST was not created")
    return errors


def _inspect_chunks(path: str) -> tuple[dict | None, str | None]:
    """`ckpt inspect --json PATH` -> {leaf name: leaf}, or an error."""
    r = ib.run_once([sys.executable, "-m", "ckpt_tool", "inspect", "--json", path], capture=True)
    try:
        doc = json.loads(r["stdout"])
    except ValueError:
        return None, f"ckpt inspect exit {r['rc']}, no JSON: {cb._tail(r)}"
    return {leaf.get("name"): leaf for leaf in doc.get("leaves", []) if leaf.get("kind") == "array"}, None


def check_layout(case: str, leaves: dict) -> tuple[list[str], list[list[int]]]:
    """Every leaf on the new mesh with the new spec and an allowed chunk shape; returns (errors, chunk shapes seen)."""
    axes = _mesh_axes(case)
    spec = CASES[case]["spec"]
    allowed = allowed_chunks(case)
    errors = []
    if len(leaves) != N_ARRAYS:
        errors.append(f"ckpt inspect lists {len(leaves)} arrays, expected {N_ARRAYS}")
    seen = set()
    bad_chunk = bad_sharding = 0
    for name, leaf in leaves.items():
        cs = tuple(leaf.get("chunk_shape") or ())
        seen.add(cs)
        if cs not in allowed:
            bad_chunk += 1
            if bad_chunk == 1:
                errors.append(f"{name}: chunk shape {list(cs)}, expected one of {sorted(map(list, allowed))}")
        sh = leaf.get("sharding") or {}
        if (sh.get("kind") != "named" or sh.get("mesh_shape") != [n for _, n in axes]
                or sh.get("axis_names") != [a for a, _ in axes] or sh.get("partition_spec") != spec):
            bad_sharding += 1
            if bad_sharding == 1:
                errors.append(f"{name}: sharding {sh}, expected mesh {CASES[case]['mesh']} spec {spec}")
    if bad_chunk > 1:
        errors.append(f"  ({bad_chunk} leaves with a wrong chunk shape)")
    if bad_sharding > 1:
        errors.append(f"  ({bad_sharding} leaves with a wrong sharding)")
    return errors, sorted(list(s) for s in seen)


def verify_ckpt_output(cmd: dict, log) -> tuple[list[str], dict]:
    """validate --deep, diff --values, inspect's chunk shapes, and the plan's read bytes; all untimed."""
    dst, src, case = cmd["outputs"][0], cmd["src"], cmd["case"]
    info: dict = {}
    errors: list[str] = []
    log(f"  checking {cmd['name']}'s output: ckpt validate --deep ...")
    argv = [sys.executable, "-m", "ckpt_tool", "validate", "--deep", "--json", dst]
    r = ib.run_once(argv, capture=True)
    info["validate"] = {"rc": r["rc"], "wall_s": round(r["wall"], 3), "peak_rss_kib": r["rss_kib"]}
    vcmd = {"format": "orbax", "mode": "deep", "expect": {"arrays": N_ARRAYS, "bytes_read": NBYTES}}
    verrs = vb.check_validate_json(vcmd, r["stdout"])
    if r["rc"] != 0 and not verrs:
        verrs = [f"exit {r['rc']}: {cb._tail(r)}"]
    info["validate"]["ok"] = not verrs
    errors += [f"ckpt validate --deep: {e}" for e in verrs]
    errs, info["diff"] = cb.run_diff(cmd, log)  # ckpt diff SRC DST --values --json: same, 64 compared
    errors += errs
    log(f"  checking {cmd['name']}'s output: ckpt inspect (chunk shapes) ...")
    leaves, err = _inspect_chunks(dst)
    if err:
        errors.append(err)
    else:
        errs, info["chunk_shapes"] = check_layout(case, leaves)
        errors += errs
    # what the plan reads (not timed): decoded source chunks per output chunk
    plan_dst = _dst(f"plan-{case}")
    r = ib.run_once([sys.executable, "-m", "ckpt_tool", "reshard", src, plan_dst, "--mesh", CASES[case]["mesh"],
                     "--devices", str(DEVICES), "--dry-run", "--json"], capture=True)
    try:
        plan = json.loads(r["stdout"])
        procs = plan.get("processes") or []
        info["plan"] = {"bytes_read": sum(p.get("bytes_read", 0) for p in procs),
                        "bytes_written": sum(p.get("bytes_written", 0) for p in procs),
                        "chunks": sum(p.get("chunks", 0) for p in procs)}
        if os.path.exists(plan_dst):
            errors.append("ckpt reshard --dry-run created DST")
    except ValueError:
        info["plan"] = None
    return errors, info


def check_baseline_output(cmd: dict, text: str) -> list[str]:
    try:
        head = text.split(None, 3)
        nums, shards = [int(w) for w in head[:3]], json.loads(head[3])
    except (ValueError, IndexError):
        return [f"unexpected output {text.strip()[:200]!r}"]
    want_shard = [list(CASES[cmd["case"]]["shard"])]
    errors = []
    if nums != [N_ARRAYS, NBYTES, 0] or shards != want_shard:
        errors.append(f"the baseline reported {text.strip()!r}, expected {N_ARRAYS} {NBYTES} 0 {want_shard}")
    size = ib._dir_stats(cmd["outputs"][0])[1] if os.path.isdir(cmd["outputs"][0]) else -1
    if size < NBYTES * 0.85:  # orbax output is zstd-compressed (about 1.85 GiB)
        errors.append(f"{os.path.relpath(cmd['outputs'][0], REPO)} holds {size} bytes")
    return errors


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------


def run_command(cmd: dict, runs: int, log) -> dict:
    res = dict(name=cmd["name"], case=cmd["case"], role=cmd["role"], command=cmd["label"], ok=True, error=None,
               warmup_s=None, best_s=None, runs_s=[], best_cpu_s=None, cpu_s=[], peak_rss_kib=None, rss_kib=[],
               loadavg_1min_before=round(os.getloadavg()[0], 2), output=None, checks=None, chunk_shapes=None,
               check_errors=[])
    warm = cb.warm_up(cmd, res, runs, log, _clean_tmp)
    if warm is None:
        return res
    if cmd["role"] == "ckpt":
        res["check_errors"] = check_ckpt_json(cmd, warm["stdout"])
        if not res["check_errors"]:
            errors, res["checks"] = verify_ckpt_output(cmd, log)
            res["check_errors"] += errors
            res["chunk_shapes"] = res["checks"].get("chunk_shapes")
    else:
        res["output"] = warm["stdout"].strip()
        res["check_errors"] = check_baseline_output(cmd, warm["stdout"])
        leaves, err = _inspect_chunks(cmd["outputs"][0])  # what orbax itself wrote: ckpt must match it
        if leaves:
            res["chunk_shapes"] = sorted({tuple(leaf.get("chunk_shape") or ()) for leaf in leaves.values()})
            res["chunk_shapes"] = [list(s) for s in res["chunk_shapes"]]
    if res["check_errors"]:
        res["ok"] = False
    cb.timed_runs(cmd, res, runs, _clean_tmp)
    return res


def cross_check(results: list[dict]) -> None:
    """ckpt's chunk shapes must be the ones orbax's own save wrote for the same mesh and spec."""
    by = {r["name"]: r for r in results}
    for case in CASES:
        ck, base = by.get(f"ckpt-reshard-{case}"), by.get(f"orbax-restore-save-{case}")
        if not ck or not base or not ck["chunk_shapes"] or not base["chunk_shapes"]:
            continue
        if ck["chunk_shapes"] != base["chunk_shapes"]:
            ck["ok"] = False
            ck["check_errors"].append(f"chunk shapes {ck['chunk_shapes']}, orbax's own save wrote "
                                      f"{base['chunk_shapes']}")
        elif ck["checks"] is not None:
            ck["checks"]["chunks_match_orbax"] = True


def compute_targets(results: list[dict]) -> tuple[list[dict], list[dict]]:
    """(targets, info): the two targets on the 2x4 case; the model=8 ratios as info."""
    by = {r["name"]: r for r in results}
    targets, info = [], []
    for case, c in CASES.items():
        a, b = by.get(f"ckpt-reshard-{case}"), by.get(f"orbax-restore-save-{case}")
        if a is None:
            continue
        t = a["best_s"] if a["ok"] else None
        rss = a["peak_rss_kib"] if a["ok"] else None
        rows = [
            ("baseline/ckpt", cb._ratio(b["best_s"] if b and b["ok"] else None, t), BASELINE_TARGET, ">="),
            ("ckpt_rss_mib", round(rss / 1024) if rss else None, RSS_TARGET_KIB / 1024, "<="),
        ]
        for what, value, target, op in rows:
            q = {"case": case, "mesh": c["mesh"], "what": what, "value": value}
            if c["target"]:
                q.update(target=target, op=op, met=None if value is None else (value >= target if op == ">=" else value <= target))
                targets.append(q)
            else:
                info.append(q)
    return targets, info


# --------------------------------------------------------------------------
# --profile: ckpt reshard in-process under cProfile, in a fresh subprocess per case
# --------------------------------------------------------------------------

# cumulative time of these (summed over threads); a missing one is skipped
CUMULATIVE = [
    ("ckpt_tool.ops.reshard", "plan_reshard", "plan_reshard (metadata, specs, chunk grid)"),
    ("ckpt_tool.ops.engine", "stream", "engine.stream (every chunk, main thread)"),
    ("ckpt_tool.core.model", "ArrayLeaf.read", "source read, thread-s (ArrayLeaf.read)"),
    ("ckpt_tool.formats.orbax.reader", "_ZarrRegionReader.read", "  tensorstore zarr read + zstd decode"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter.write_array", "writer.write_array, thread-s"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter._submit", "  _submit (tensorstore write + backpressure)"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter._drain", "  _drain (waiting for OCDBT commits)"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter.finish_process", "writer.finish_process"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter.commit", "writer.commit (merge, metadata)"),
    ("ckpt_tool.ops.engine", "finalize_output", "rename into place"),
]


def _code_key(module_name: str, attr: str):
    import importlib

    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        code = obj.__code__
    except (ImportError, AttributeError):
        return None
    return (code.co_filename, code.co_firstlineno, code.co_name)


def _profile_child(case: str, src: str, dst: str, top: int) -> dict:
    """Runs in a fresh process: one `ckpt reshard` in-process, every thread under cProfile."""
    import resource

    out: dict = {"case": case, "mesh": CASES[case]["mesh"]}
    t0 = time.perf_counter()
    import ckpt_tool.cli.main  # noqa: F401  (what `python -m ckpt_tool` imports)
    from ckpt_tool.ops.reshard import ReshardOptions, reshard

    out["import_s"] = round(time.perf_counter() - t0, 3)
    try:  # as `ckpt reshard` does for itself (cli/main.py): one malloc arena
        from ckpt_tool.base.parallel import limit_allocator_growth

        limit_allocator_growth()
    except ImportError:
        pass
    opts = ReshardOptions(mesh=CASES[case]["mesh"], devices=DEVICES)
    out["workers"] = opts.workers
    result, out["reshard_s"], stats, out["threads_profiled"] = cb.profile_all_threads(lambda: reshard(src, dst, opts))
    out["chunks"], out["bytes"] = result.chunks, result.bytes
    out["heavy_modules_imported"] = sorted(m for m in ("jax", "torch", "orbax") if m in sys.modules)
    cum = []
    for mod, attr, label in CUMULATIVE:
        key = _code_key(mod, attr)
        if key is None or key not in stats.stats:
            continue
        _cc, nc, tt, ct, _callers = stats.stats[key]
        cum.append({"what": label, "calls": nc, "own_s": round(tt, 3), "cumulative_s": round(ct, 3)})
    out["cumulative"] = cum
    out["top_tottime"] = cb.top_functions(stats, "tottime", top)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_user_s"], out["cpu_sys_s"], out["minor_faults"] = round(ru.ru_utime, 2), round(ru.ru_stime, 2), ru.ru_minflt
    out["ru_maxrss_kib"] = ru.ru_maxrss
    return out


def run_profiles(src: str, cases: list[str], log) -> list[dict]:
    report = []
    for case in cases:
        log(f"profiling ckpt reshard --mesh {CASES[case]['mesh']} in-process (cProfile) ...")
        _clean_tmp()
        ib.warm_page_cache(src)
        argv = [sys.executable, os.path.abspath(__file__), "--profile-child", case, "--path", src,
                "--dst", _dst(f"profile-{case}")]
        proc = subprocess.run(argv, env=ib._run_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=PROFILE_TIMEOUT_S)
        _clean_tmp()
        if proc.returncode != 0:
            report.append({"case": case, "mesh": CASES[case]["mesh"],
                           "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        report.append(json.loads(proc.stdout))
    return report


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--runs", type=int, default=2, help="timed runs per command after one warm-up (default 2)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--regen", action="store_true", help="rebuild the cached 2 GiB checkpoints in bench/out/")
    ap.add_argument("--no-other", action="store_true", help="skip the model=8 case (no target)")
    ap.add_argument("--profile", action="store_true", help="also profile ckpt reshard in-process (cProfile)")
    ap.add_argument("--profile-only", action="store_true", help="only the --profile part (no timed commands, no targets)")
    ap.add_argument("--layers", type=int, default=1000, help=argparse.SUPPRESS)  # run_all passes it on; unused here
    ap.add_argument("--profile-child", choices=tuple(CASES), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--top", type=int, default=20, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")

    if args.profile_child:  # internal: one profiled in-process reshard
        print(json.dumps(_profile_child(args.profile_child, args.path, args.dst, args.top)))
        return 0

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    load_at_start = os.getloadavg()[0]  # other work on a 2-core box skews wall times
    src = vb.ensure_big_checkpoints(args.regen, log)["orbax"]
    _clean_tmp()
    free = shutil.disk_usage(TMP).free
    if free < MIN_FREE:
        raise SystemExit(f"not enough disk for the outputs: {free / 2**30:.1f} GiB free in {TMP}, "
                         f"need {MIN_FREE / 2**30:.0f} GiB")
    cases = [c for c in CASES if not (args.no_other and not CASES[c]["target"])]

    results = []
    loads = {}
    for cmd in [] if args.profile_only else commands(src, cases):
        if cmd["case"] not in loads:
            loads[cmd["case"]] = round(os.getloadavg()[0], 2)
        results.append(run_command(cmd, args.runs, log))
    cross_check(results)
    failed = any(not r["ok"] for r in results)
    targets, info = compute_targets(results)
    profiles = run_profiles(src, cases, log) if args.profile or args.profile_only else None
    if os.path.isdir(TMP):
        shutil.rmtree(TMP)

    report = {
        **ib.report_header("reshard", load_at_start, loads),
        "bytes": NBYTES,
        "arrays": N_ARRAYS,
        "runs": args.runs,
        "checkpoint": os.path.relpath(src, REPO),
        "cases": {c: {"mesh": CASES[c]["mesh"], "spec": CASES[c]["spec"], "shard": list(CASES[c]["shard"])}
                  for c in cases},
        "results": results,
        "targets": targets,
        "info": info,
        "profiles": profiles,
        "ok": not failed,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 1 if failed else 0


# same data size and quantities as the convert bench
_fmt_value = cb._fmt_value


_WHAT = {"baseline/ckpt": "orbax restore + save / ckpt reshard", "ckpt_rss_mib": "ckpt reshard peak RSS"}


def _print_report(report: dict) -> None:
    print()
    timed = f"best of {report['runs']} runs after 1 warm-up" if report["results"] else "profile only"
    print(f"reshard bench: {report['checkpoint']} ({report['arrays']} float32 arrays, "
          f"{report['bytes'] / 2**30:.0f} GiB, 4x2 mesh P('data','model')); {timed}, "
          f"{report['machine']['cpus']} cpus, warm page cache for SRC")
    cb.print_load(report)
    for case in report["cases"]:
        rows = [r for r in report["results"] if r["case"] == case]
        if not rows:
            continue
        c = CASES[case]
        print()
        print(f"{case}: --mesh {c['mesh']} -> {c['label']}, per-device shard {list(c['shard'])}"
              + ("" if c["target"] else "  (no target)"))
        cb.print_rows(rows)
        ck = next((r for r in rows if r["role"] == "ckpt"), None)
        if ck and ck.get("checks"):
            k = ck["checks"]
            parts = []
            if k.get("validate"):
                parts.append(f"validate --deep {'ok' if k['validate'].get('ok') else 'NOT ok'} ({k['validate']['wall_s']:.1f}s)")
            if k.get("diff"):
                parts.append(f"diff --values {'same' if k['diff'].get('same') else 'DIFFERENT'} ({k['diff']['wall_s']:.1f}s)")
            if k.get("chunk_shapes"):
                same = ", = orbax's own save" if k.get("chunks_match_orbax") else ""
                parts.append(f"chunk shape {' '.join(map(str, k['chunk_shapes']))}{same}")
            print("  ckpt output (checked once, not timed): " + "; ".join(parts))
            p = k.get("plan")
            if p and p.get("bytes_written"):
                print(f"  plan (--dry-run): {p['chunks']} chunks, reads {p['bytes_read'] / 2**30:.1f} GiB of decoded source "
                      f"chunks for {p['bytes_written'] / 2**30:.1f} GiB written "
                      f"({p['bytes_read'] / p['bytes_written']:.1f}x)")
        print()
        for q in report["targets"]:
            if q["case"] == case:
                cb.print_target(f"  {_WHAT[q['what']]}", q)
        extras = [q for q in report["info"] if q["case"] == case]
        if extras:
            print("  no target: " + "; ".join(f"{_WHAT[q['what']]} {_fmt_value(q)}" for q in extras))
    for p in report.get("profiles") or []:
        print()
        head = f"profile: ckpt reshard --mesh {p['mesh']} in-process, cProfile"
        if p.get("error"):
            print(f"{head}: FAILED: {p['error']}")
            continue
        print(f"{head}, --workers {p['workers']}: import {p['import_s']:.2f}s, reshard {p['reshard_s']:.2f}s (under "
              f"cProfile), process cpu user {p['cpu_user_s']:.2f}s sys {p['cpu_sys_s']:.2f}s, {p['minor_faults']} "
              f"minor faults, ru_maxrss {ib._fmt_mib(p['ru_maxrss_kib'])}, heavy modules imported: "
              f"{', '.join(p['heavy_modules_imported']) or 'none'}")
        print(f"    cumulative (all {p['threads_profiled']} threads; thread-s can exceed the wall time):")
        for c in p["cumulative"]:
            print(f"      {c['what']:<48} {c['cumulative_s']:8.3f}s  own {c['own_s']:7.3f}s  {c['calls']:5d} calls")
        print("    top functions by own time (all threads merged):")
        for line in p["top_tottime"].rstrip().splitlines():
            print("    " + line)
    print()


if __name__ == "__main__":
    sys.exit(main())


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table: one per case against orbax restore on the new mesh
    + save, with the RSS target (cases without a target, e.g. model=8, show none)."""
    by = {r["name"]: r for r in doc.get("results", [])}
    rows = []
    for case, c in doc.get("cases", {}).items():
        qs = {q["what"]: q for q in doc.get("targets", []) + doc.get("info", []) if q["case"] == case}
        a, b = by.get(f"ckpt-reshard-{case}"), by.get(f"orbax-restore-save-{case}")
        if a is None:
            continue
        b = b or {}
        t, r = qs.get("baseline/ckpt", {}), qs.get("ckpt_rss_mib", {})
        rows.append({
            "bench": "reshard", "case": f"--mesh {c['mesh']}, {doc.get('bytes', 0) / 2**30:.0f} GiB",
            "ckpt_s": a.get("best_s"), "baseline": b.get("command", "orbax restore + save"), "baseline_s": b.get("best_s"),
            "ratio": t.get("value"), "target": f"baseline/ckpt {t['op']} {t['target']:g}x" if "target" in t else None,
            "met": t.get("met"), "rss_mib": r.get("value"),
            "rss_target": f"<= {r['target']:g} MiB" if "target" in r else None, "rss_met": r.get("met"),
            "error": a.get("error") or b.get("error") or "; ".join(a.get("check_errors", []) + b.get("check_errors", [])),
        })
    return rows
