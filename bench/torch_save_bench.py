#!/usr/bin/env python3
"""Benchmark `ckpt convert --to safetensors` of a 2 GiB sharded `.bin` set against the way people convert it.

    python bench/torch_save_bench.py [--runs N] [--settle S] [--json] [--regen]

Input (built once into bench/out/torch_bin_2gib, by torch): validate_bench's 64 float32 arrays of
(4096, 2048), named `model.layers.{i}.weight`, saved as a Hugging Face sharded set: four
`pytorch_model-0000K-of-00004.bin` files of 512 MiB (torch.save of 16 tensors each) and
`pytorch_model.bin.index.json`, as transformers 4.x's save_pretrained(safe_serialization=False)
lays them out.

  ckpt      ckpt convert SRC DST --to safetensors --memory 512MiB --json
  baseline  per file: torch.load(weights_only=True) + safetensors.torch.save_file (what
            safetensors' convert script and most conversion scripts do; each file whole in memory)
  cp        cp -r SRC DST

The protocol is convert_bench's (whose runner this reuses): whole processes, SRC in the page cache,
one checked warm-up (ckpt's JSON: 64 arrays, 2 GiB; `ckpt diff SRC DST --values` same; the baseline
reports 64 tensors and the bytes), then N timed runs after a sync and a --settle pause; the best
wall time counts, peak RSS is the largest of the timed runs.

Targets (issue 20): baseline wall / ckpt wall >= 3x; ckpt peak RSS <= 640 MiB (--memory 512MiB + 128 MiB);
and, as for the other conversions, ckpt wall / cp -r wall <= 3x. Exit 0 when every command ran and checked out.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import convert_bench as cb  # noqa: E402  (runner, checks, settle protocol, printing)
import inspect_bench as ib  # noqa: E402
import validate_bench as vb  # noqa: E402

REPO = ib.REPO
CACHE_VERSION = 1
FILES = 4
MEMORY = "512MiB"
RSS_TARGET_MIB = 640
DIRECTION = "torch->safetensors"

# prints: <arrays> <bytes saved>
BASELINE = r"""
import json, os, sys
import torch
from safetensors.torch import save_file
src, dst = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
index = json.load(open(os.path.join(src, "pytorch_model.bin.index.json")))
os.makedirs(dst)
n = nbytes = 0
weight_map = {}
for k, name in enumerate(sorted(set(index["weight_map"].values())), 1):
    sd = torch.load(os.path.join(src, name), weights_only=True, map_location="cpu")
    out = f"model-{k:05d}-of-{len(set(index['weight_map'].values())):05d}.safetensors"
    save_file({key: t.contiguous() for key, t in sd.items()}, os.path.join(dst, out), metadata={"format": "pt"})
    weight_map.update({key: out for key in sd})
    n += len(sd)
    nbytes += sum(t.numel() * t.element_size() for t in sd.values())
    del sd
json.dump({"metadata": {"total_size": nbytes}, "weight_map": weight_map},
          open(os.path.join(dst, "model.safetensors.index.json"), "w"))
print(n, nbytes)
"""


def _generate(path: str) -> None:
    import torch

    os.makedirs(path)
    per = vb.BIG_ARRAYS // FILES
    weight_map = {}
    for k in range(FILES):
        name = f"pytorch_model-{k + 1:05d}-of-{FILES:05d}.bin"
        sd = {f"model.layers.{i}.weight": torch.from_numpy(vb._big_value(i)) for i in range(k * per, (k + 1) * per)}
        torch.save(sd, os.path.join(path, name))
        weight_map.update({key: name for key in sd})
        del sd
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": vb.BIG_NBYTES}, "weight_map": weight_map}, f, indent=2)


def ensure_checkpoint(regen: bool, log) -> str:
    path = os.path.join(ib.OUT, "torch_bin_2gib")
    if not regen and ib.is_cached(path, CACHE_VERSION):
        return path
    ib.clear_cached(path)
    free = shutil.disk_usage(ib.OUT).free
    if free < 3 * vb.BIG_NBYTES:
        raise SystemExit(f"not enough disk for the 2 GiB .bin set: {free / 2**30:.1f} GiB free in {ib.OUT}")
    log(f"generating the 2 GiB .bin set -> {os.path.relpath(path, REPO)} ...")
    t0 = time.monotonic()
    tmp = path + ".tmp"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--generate", tmp], cwd=ib.OUT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    if proc.returncode != 0 or not os.path.isdir(tmp):
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(f"generating the .bin set failed (exit {proc.returncode})")
    os.rename(tmp, path)
    files, size = ib._dir_stats(path)
    with open(path + ".done.json", "w") as f:
        json.dump({"cache_version": CACHE_VERSION, "arrays": vb.BIG_ARRAYS, "files": files, "bytes": size,
                   "seconds": round(time.monotonic() - t0, 1)}, f)
    return path


def commands(src: str) -> list[dict]:
    py = sys.executable
    dst = cb._dst("ckpt-torch-to-safetensors")
    return [
        {"name": "ckpt-torch-to-safetensors", "direction": DIRECTION, "role": "ckpt", "workers": cb.DEFAULT_WORKERS,
         "src": src, "outputs": [dst],
         "argv": [py, "-m", "ckpt_tool", "convert", src, dst, "--to", "safetensors", "--memory", MEMORY, "--json"],
         "label": f"ckpt convert --to safetensors --memory {MEMORY}"},
        {"name": "torch-baseline", "direction": DIRECTION, "role": "baseline", "src": src,
         "outputs": [cb._dst("torch-baseline")], "argv": [py, "-c", BASELINE, src, cb._dst("torch-baseline")],
         "label": "per file: torch.load + safetensors.torch.save_file"},
        {"name": "cp-torch", "direction": DIRECTION, "role": "cp", "src": src, "outputs": [cb._dst("cp-torch")],
         "argv": ["cp", "-r", "--", src, cb._dst("cp-torch")], "label": "cp -r SRC DST"},
    ]


def compute_targets(results: list[dict]) -> list[dict]:
    return cb.conversion_targets({r["name"]: r for r in results}, DIRECTION, "ckpt-torch-to-safetensors",
                                 "torch-baseline", "cp-torch", baseline_target=3.0, rss_target_mib=RSS_TARGET_MIB)


def main(argv: list[str] | None = None) -> int:
    ap = cb.bench_parser(__doc__, "rebuild the cached .bin set in bench/out/")
    args = ap.parse_args(argv)
    if args.generate:
        _generate(args.generate)
        return 0
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    load_at_start = os.getloadavg()[0]
    src = ensure_checkpoint(args.regen, log)
    cb._clean_tmp()
    results, loads = [], {DIRECTION: round(os.getloadavg()[0], 2)}
    for cmd in commands(src):
        results.append(cb.run_command(cmd, args.runs, log, args.settle))
    failed = any(not r["ok"] for r in results)
    targets = compute_targets(results)
    if os.path.isdir(cb.TMP):
        shutil.rmtree(cb.TMP)
    report = {
        **ib.report_header("torch_save", load_at_start, loads),
        "bytes": cb.NBYTES, "arrays": cb.N_ARRAYS, "files": FILES, "memory": MEMORY, "runs": args.runs,
        "settle_s": args.settle, "checkpoints": {"torch": os.path.relpath(src, REPO)},
        "results": results, "targets": targets, "ok": not failed,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 1 if failed else 0


def _print_report(report: dict) -> None:
    print()
    print(f"torch.save bench: {report['arrays']} float32 arrays in {report['files']} .bin files, "
          f"{report['bytes'] / 2**30:.0f} GiB; best of {report['runs']} runs after 1 warm-up, sync + "
          f"{report['settle_s']:g} s pause before each, {report['machine']['cpus']} cpus, warm page cache for SRC")
    cb.print_load(report)
    print()
    print(f"torch -> safetensors  (SRC {report['checkpoints']['torch']})")
    cb.print_rows(report["results"], lambda r: f" (diff --values: same, {r['diff']['wall_s']:.1f}s)" if r.get("diff") else "")
    print()
    for q in report["targets"]:
        what = {"baseline/ckpt": "torch-baseline / ckpt", "ckpt/cp": "ckpt / cp -r", "ckpt_rss_mib": "ckpt peak RSS"}
        cb.print_target(f"  {what[q['what']]}", q)
    print()


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table (the same form as convert_bench's)."""
    return cb.summary_rows(doc, bench="torch_save")


if __name__ == "__main__":
    sys.exit(main())
