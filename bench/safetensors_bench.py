#!/usr/bin/env python3
"""Benchmark `ckpt convert --to safetensors` (2 GiB) against the libraries' own ways and `cp -r`.

    python bench/safetensors_bench.py [--runs N] [--settle S] [--json] [--regen]

Inputs: validate_bench's 2 GiB checkpoints (bench/out/orbax_2gib, bench/out/dcp_2gib:
64 float32 arrays of (4096, 2048)), built by its generator when missing.

  orbax -> safetensors  ckpt convert SRC DST --to safetensors --json (default --workers)
                        baseline: orbax restore as numpy (PyTreeCheckpointer,
                          RestoreArgs(restore_type=np.ndarray)) + safetensors.numpy.save_file
                        cp -r SRC DST
  dcp -> safetensors    ckpt convert SRC DST --to safetensors --json
                        baseline: dcp_to_torch_save(SRC, file.pt) + torch.load +
                          safetensors.torch.save_file
                        cp -r SRC DST

The protocol is convert_bench's (whose runner this reuses): whole processes,
SRC in the page cache, one checked warm-up (ckpt's JSON counts 64 arrays and
2 GiB; `ckpt diff SRC DST --values` finds no difference; the baselines report
64 tensors and the bytes; cp copies every byte), then N timed runs each after
a sync and a --settle pause; the best wall time counts, peak RSS is the
largest of the timed runs. ckpt's output is one 2 GiB model.safetensors (the
5GB default --max-shard-size), as the baselines write.

Targets, per direction: baseline wall / ckpt wall >= 3x; ckpt wall / cp -r
wall <= 3x; ckpt peak RSS <= 512 MiB. `accelerate merge-weights` is not run
(accelerate is not installed in this venv).

Exit status: 0 when every command ran and checked out (targets met or not).
"""
from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import convert_bench as cb  # noqa: E402  (runner, checks, settle protocol, printing)
import inspect_bench as ib  # noqa: E402
import validate_bench as vb  # noqa: E402

REPO = ib.REPO

# prints: <arrays> <bytes saved>
ORBAX_TO_SAFETENSORS = r"""
import os, sys
import numpy as np
import jax
import orbax.checkpoint as ocp
from safetensors.numpy import save_file
src, dst = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
tree = ocp.StandardCheckpointer().metadata(src).item_metadata.tree
args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
restored = ocp.PyTreeCheckpointer().restore(src, restore_args=args)
flat = {".".join(str(getattr(k, "key", k)) for k in path): v
        for path, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
os.makedirs(dst)
save_file(flat, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
print(len(flat), sum(x.nbytes for x in flat.values()))
"""

# prints: <arrays> <bytes saved>
DCP_TO_SAFETENSORS = r"""
import os, sys, warnings
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, pt, dst = (os.path.abspath(p) for p in sys.argv[1:4])
dcp_to_torch_save(src, pt)
sd = torch.load(pt, weights_only=True)
flat = {}
def walk(prefix, node):
    if isinstance(node, dict):
        for k, v in node.items():
            walk(f"{prefix}.{k}" if prefix else str(k), v)
    else:
        flat[prefix] = node
walk("", sd)
os.makedirs(dst)
save_file(flat, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
print(len(flat), sum(t.numel() * t.element_size() for t in flat.values()))
"""


def commands(big: dict) -> list[dict]:
    py = sys.executable
    cmds: list[dict] = []
    for src_fmt, script in (("orbax", ORBAX_TO_SAFETENSORS), ("dcp", DCP_TO_SAFETENSORS)):
        direction = f"{src_fmt}->safetensors"
        src = big[src_fmt]
        dst = cb._dst(f"ckpt-{src_fmt}-to-safetensors")
        cmds.append({
            "name": f"ckpt-{src_fmt}-to-safetensors", "direction": direction, "role": "ckpt",
            "workers": cb.DEFAULT_WORKERS, "src": src, "outputs": [dst],
            "argv": [py, "-m", "ckpt_tool", "convert", src, dst, "--to", "safetensors", "--json"],
            "label": f"ckpt convert --to safetensors (default --workers {cb.DEFAULT_WORKERS})",
        })
        name = f"{src_fmt}-baseline"
        if src_fmt == "orbax":
            dst = cb._dst(name)
            outputs, argv = [dst], [py, "-c", script, src, dst]
            label = "orbax restore (numpy) + safetensors.numpy.save_file"
        else:
            pt, dst = cb._dst(name, ".pt"), cb._dst(name)
            outputs, argv = [pt, dst], [py, "-c", script, src, pt, dst]
            label = "dcp_to_torch_save + torch.load + safetensors.torch.save_file"
        cmds.append({"name": name, "direction": direction, "role": "baseline", "src": src, "outputs": outputs,
                     "argv": argv, "label": label})
        dst = cb._dst(f"cp-{src_fmt}")
        cmds.append({"name": f"cp-{src_fmt}", "direction": direction, "role": "cp", "src": src, "outputs": [dst],
                     "argv": ["cp", "-r", "--", src, dst], "label": "cp -r SRC DST"})
    return cmds


def compute_targets(results: list[dict]) -> list[dict]:
    by = {r["name"]: r for r in results}
    return [row for src_fmt in ("orbax", "dcp") for row in cb.conversion_targets(
        by, f"{src_fmt}->safetensors", f"ckpt-{src_fmt}-to-safetensors", f"{src_fmt}-baseline", f"cp-{src_fmt}")]


def main(argv: list[str] | None = None) -> int:
    ap = cb.bench_parser(__doc__, "rebuild the cached 2 GiB checkpoints in bench/out/", generate=False)
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    load_at_start = os.getloadavg()[0]
    big = vb.ensure_big_checkpoints(args.regen, log)
    cb._clean_tmp()
    free = shutil.disk_usage(cb.TMP).free
    if free < cb.MIN_FREE:
        raise SystemExit(f"not enough disk for the outputs: {free / 2**30:.1f} GiB free in {cb.TMP}")

    # convert_bench's runner checks each warm-up: ckpt's JSON (direction "src->dst",
    # 64 arrays, 2 GiB) and `ckpt diff SRC DST --values`; the baselines' counts; cp's bytes
    results, loads = [], {}
    for cmd in commands(big):
        if cmd["direction"] not in loads:
            loads[cmd["direction"]] = round(os.getloadavg()[0], 2)
        results.append(cb.run_command(cmd, args.runs, log, args.settle))
    failed = any(not r["ok"] for r in results)
    targets = compute_targets(results)
    if os.path.isdir(cb.TMP):
        shutil.rmtree(cb.TMP)
    report = {
        **ib.report_header("safetensors", load_at_start, loads),
        "bytes": cb.NBYTES, "arrays": cb.N_ARRAYS, "runs": args.runs, "settle_s": args.settle,
        "checkpoints": {fmt: os.path.relpath(p, REPO) for fmt, p in big.items()},
        "results": results, "targets": targets, "ok": not failed,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 1 if failed else 0


def _print_report(report: dict) -> None:
    print()
    print(f"safetensors bench: {report['arrays']} float32 arrays, {report['bytes'] / 2**30:.0f} GiB per direction; "
          f"best of {report['runs']} runs after 1 warm-up, sync + {report['settle_s']:g} s pause before each, "
          f"{report['machine']['cpus']} cpus, warm page cache for SRC")
    cb.print_load(report)
    for direction in ("orbax->safetensors", "dcp->safetensors"):
        rows = [r for r in report["results"] if r["direction"] == direction]
        if not rows:
            continue
        print()
        print(f"{direction.replace('->', ' -> ')}  (SRC {report['checkpoints'][direction.split('->')[0]]})")
        cb.print_rows(rows, lambda r: f" (diff --values: same, {r['diff']['wall_s']:.1f}s)" if r.get("diff") else "")
        print()
        for q in report["targets"]:
            if q["direction"] == direction:
                what = {"baseline/ckpt": f"{q['other']} / ckpt", "ckpt/cp": "ckpt / cp -r",
                        "ckpt_rss_mib": "ckpt peak RSS"}[q["what"]]
                cb.print_target(f"  {what}", q)
    print()


if __name__ == "__main__":
    sys.exit(main())


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table (the same form as convert_bench's)."""
    return cb.summary_rows(doc, bench="safetensors")
