#!/usr/bin/env python3
"""Benchmark ckpt on a 2 GiB DeepSpeed ZeRO-3 checkpoint of 4 ranks against DeepSpeed's own tools.

    python bench/deepspeed_bench.py [--runs N] [--settle S] [--json] [--regen]

Input (built once into bench/out/deepspeed_z3_2gib, by torch in ckpt's venv): a ZeRO-3
checkpoint of 4 data-parallel ranks laid out as DeepSpeed 0.19's engine.save_checkpoint writes
it (tests/formats/deepspeed/test_deepspeed.py's `imitate`, which test_the_imitation_lays_partitions_out_as_deepspeed
checks against checkpoints real DeepSpeed wrote; DeepSpeed itself would need ~16 GB to train a
2 GiB model on 4 CPU ranks here): 2 GiB of fp32 master weights (validate_bench's 64 float32
arrays of (4096, 2048), `layers.{i}.weight`, one optimizer group) and 64 biases of 2049 elements
(a second group: odd sizes, so every rank's partitions end in padding), each rank's
`zero_pp_rank_R_mp_rank_00_optim_states.pt` holding its flat fp32 partitions and Adam moments
(1.5 GiB a rank, 6 GiB in all) and its model-states file.

  to safetensors
    ckpt             ckpt convert SRC DST --to safetensors --memory 512MiB --exclude 'optimizer/**'
                     --exclude 'engine/**' --json                  (zero_to_fp32's output: the weights)
    zero_to_fp32     python -m deepspeed.utils.zero_to_fp32 SRC DST --safe_serialization
                     (DeepSpeed 0.19 in build/venv-deepspeed-0.19: every rank's partitions in memory)
  to universal
    ckpt             ckpt convert SRC DST --to deepspeed-universal --memory 512MiB --json
    ds_to_universal  python -m deepspeed.checkpoint.ds_to_universal --input_folder SRC/global_step1
                     --output_folder DST/global_step1_universal --inject_missing_state
                     (its defaults: 4 extracting, 2 merging processes; fragments in DST/.../tmp/)

The protocol is convert_bench's (its runner and checks' style): whole processes, SRC in the page
cache, one checked warm-up per command, then N timed runs after a sync and a --settle pause; the
best wall time counts, the peak RSS is the largest of the timed runs (os.wait4's ru_maxrss of the
command's process: ds_to_universal's worker processes are not in it). The warm-ups are checked
against each other, untimed: ckpt's safetensors output and zero_to_fp32's say `same` to
`ckpt diff --values`; ckpt's universal output has exactly ds_to_universal's files, each the same
size with the same first and last 64 KiB (its data.pkl, and its zip directory, which holds the
CRC-32 of every record) and no other file or directory (no fragments); ds_to_universal's warm-up
runs with --keep_temp_folder, and the fragment directory it left is measured.

Targets (issue 21): zero_to_fp32 wall / ckpt wall >= 3x and ckpt peak RSS <= 640 MiB (--memory
512MiB + 128 MiB), zero_to_fp32's peak beside it; ds_to_universal wall / ckpt wall >= 3x, with no
temporary directory. Exit 0 when every command ran and checked out.
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

import convert_bench as cb  # noqa: E402  (runner, settle protocol, printing)
import inspect_bench as ib  # noqa: E402
import validate_bench as vb  # noqa: E402

REPO = ib.REPO
CACHE_VERSION = 1
RANKS = 4
TAG = "global_step1"
MEMORY = "512MiB"
RSS_TARGET_MIB = 640
RATIO_TARGET = 3.0
BIAS = 2049  # elements per bias: odd, so the ranks' partitions end in padding
DS_PYTHON = os.path.join(REPO, "build", "venv-deepspeed-0.19", "bin", "python")
TO_ST, TO_UC = "zero3->safetensors", "zero3->universal"
EDGE = 64 << 10  # bytes compared at each end of every universal file
# its own output directory (convert_bench's tmp_convert is emptied by the benches that share it)
TMP = os.path.join(ib.OUT, "tmp_deepspeed")
ib.RUN_TIMEOUT_S = max(ib.RUN_TIMEOUT_S, 1800)  # ds_to_universal of 2 GiB x 3 takes minutes here


def _generate(path: str) -> None:
    from collections import OrderedDict
    from pathlib import Path

    import torch

    sys.path.insert(0, os.path.join(REPO, "tests"))
    import conftest  # noqa: F401 - puts every test folder on sys.path (test_deepspeed is in one)
    from test_deepspeed import imitate

    weights = OrderedDict((f"layers.{i}.weight", torch.from_numpy(vb._big_value(i))) for i in range(vb.BIG_ARRAYS))
    gen = torch.Generator().manual_seed(7)
    biases = OrderedDict((f"layers.{i}.bias", torch.randn(BIAS, generator=gen)) for i in range(vb.BIG_ARRAYS))
    imitate(Path(path), 3, [weights, biases], world=RANKS, tag=TAG)


def ensure_checkpoint(regen: bool, log) -> str:  # noqa: ANN001
    path = os.path.join(ib.OUT, "deepspeed_z3_2gib")
    if not regen and ib.is_cached(path, CACHE_VERSION):
        return path
    ib.clear_cached(path)
    os.makedirs(ib.OUT, exist_ok=True)
    free = shutil.disk_usage(ib.OUT).free
    if free < 12 * vb.BIG_NBYTES:
        raise SystemExit(f"not enough disk for the ZeRO-3 checkpoint and the outputs: {free / 2**30:.1f} GiB free in {ib.OUT}")
    log(f"generating the 2 GiB ZeRO-3 checkpoint of {RANKS} ranks -> {os.path.relpath(path, REPO)} ...")
    t0 = time.monotonic()
    tmp = path + ".tmp"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--generate", tmp], cwd=ib.OUT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    if proc.returncode != 0 or not os.path.isdir(tmp):
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(f"generating the ZeRO-3 checkpoint failed (exit {proc.returncode})")
    os.rename(tmp, path)
    files, size = ib._dir_stats(path)
    with open(path + ".done.json", "w") as f:
        json.dump({"cache_version": CACHE_VERSION, "ranks": RANKS, "weights_bytes": vb.BIG_NBYTES,
                   "files": files, "bytes": size, "seconds": round(time.monotonic() - t0, 1)}, f)
    return path


def _dst(name: str) -> str:
    return os.path.join(TMP, name)


def _clean_tmp() -> None:
    cb.clean_dir(TMP)


def _ds(*argv: str) -> list[str]:
    # `env` execs the venv's python in its place: the runner's wait4 sees that process
    return ["env", "DS_ACCELERATOR=cpu", DS_PYTHON, *argv]


def commands(src: str) -> list[dict]:
    py = sys.executable
    st, z2f = _dst("ckpt-zero3-to-safetensors"), _dst("zero_to_fp32")
    uc, d2u = _dst("ckpt-zero3-to-universal"), _dst("ds_to_universal")
    return [
        {"name": "ckpt-zero3-to-safetensors", "direction": TO_ST, "role": "ckpt", "workers": cb.DEFAULT_WORKERS,
         "src": src, "outputs": [st],
         "argv": [py, "-m", "ckpt_tool", "convert", src, st, "--to", "safetensors", "--memory", MEMORY,
                  "--exclude", "optimizer/**", "--exclude", "engine/**", "--json"],
         "label": f"ckpt convert --to safetensors --memory {MEMORY} (weights)"},
        {"name": "zero_to_fp32", "direction": TO_ST, "role": "baseline", "src": src, "outputs": [z2f],
         "argv": _ds("-m", "deepspeed.utils.zero_to_fp32", src, z2f, "--safe_serialization"),
         "label": "zero_to_fp32 SRC DST --safe_serialization (DeepSpeed 0.19)"},
        {"name": "ckpt-zero3-to-universal", "direction": TO_UC, "role": "ckpt", "workers": cb.DEFAULT_WORKERS,
         "src": src, "outputs": [uc],
         "argv": [py, "-m", "ckpt_tool", "convert", src, uc, "--to", "deepspeed-universal", "--memory", MEMORY,
                  "--json"],
         "label": f"ckpt convert --to deepspeed-universal --memory {MEMORY}"},
        {"name": "ds_to_universal", "direction": TO_UC, "role": "baseline", "src": src, "outputs": [d2u],
         "argv": _ds("-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(src, TAG),
                     "--output_folder", os.path.join(d2u, TAG + "_universal"), "--inject_missing_state"),
         "label": "ds_to_universal --inject_missing_state (DeepSpeed 0.19; 4 + 2 workers)"},
    ]


# --------------------------------------------------------------------------
# checking the warm-ups' outputs against each other (untimed)
# --------------------------------------------------------------------------


def _files(root: str) -> dict[str, int]:
    out = {}
    for d, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.path.getsize(p)
    return out


def _dirs(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, x), root) for d, dirs, _ in os.walk(root) for x in dirs}


def _edges(path: str, size: int) -> bytes:
    with open(path, "rb") as f:
        head = f.read(min(EDGE, size))
        if size > 2 * EDGE:
            f.seek(size - EDGE)
        return head + f.read()


def check_universal(ours: str, theirs: str) -> tuple[list[str], dict]:
    """ckpt's output against ds_to_universal's (its warm-up, run with --keep_temp_folder)."""
    step = os.path.join(theirs, TAG + "_universal")
    tmp = os.path.join(step, "tmp")
    fragments = _files(tmp) if os.path.isdir(tmp) else {}
    info = {"ds_to_universal_fragments": len(fragments), "ds_to_universal_fragment_bytes": sum(fragments.values())}
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    errors = []
    a, b = _files(ours), _files(theirs)
    if sorted(a) != sorted(b):
        errors.append(f"the files differ: only ckpt's {sorted(set(a) - set(b))[:3]}, only ds_to_universal's "
                      f"{sorted(set(b) - set(a))[:3]}")
    differ = [k for k in sorted(set(a) & set(b)) if a[k] != b[k]
              or _edges(os.path.join(ours, k), a[k]) != _edges(os.path.join(theirs, k), b[k])]
    if differ:
        errors.append(f"{len(differ)} files differ from ds_to_universal's ({differ[0]}, ...)")
    extra = sorted(_dirs(ours) - _dirs(theirs))
    if extra:
        errors.append(f"ckpt's output holds directories ds_to_universal's does not: {extra[:3]}")
    info.update(files=len(a), bytes=sum(a.values()), identical=not errors)
    return errors, info


def check_safetensors(ours: str, theirs: str, log) -> tuple[list[str], dict]:  # noqa: ANN001
    argv = [sys.executable, "-m", "ckpt_tool", "diff", ours, theirs, "--values", "--json"]
    log("  checking: ckpt diff --values (ckpt's safetensors, zero_to_fp32's) ...")
    r = ib.run_once(argv, capture=True)
    info = {"rc": r["rc"], "wall_s": round(r["wall"], 3)}
    try:
        doc = json.loads(r["stdout"])
    except ValueError:
        return [f"ckpt diff exit {r['rc']}, no JSON: {cb._tail(r)}"], info
    info.update(same=doc.get("same"), compared=doc.get("compared"))
    errors = []
    if r["rc"] != 0 or doc.get("same") is not True or doc.get("values") is not True:
        errors.append(f"ckpt diff --values: ckpt's safetensors differ from zero_to_fp32's (exit {r['rc']})")
    if doc.get("compared") != 2 * vb.BIG_ARRAYS:
        errors.append(f"ckpt diff compared {doc.get('compared')} tensors, expected {2 * vb.BIG_ARRAYS}")
    return errors, info


def check_ckpt_json(cmd: dict, text: str) -> list[str]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return [f"output is not JSON: {exc}"]
    to = "safetensors" if cmd["direction"] == TO_ST else "deepspeed-universal"
    want = {"source_format": "deepspeed", "target_format": to, "skipped": [], "cast": [], "process_count": 1}
    errors = [f"{k} is {doc.get(k)!r}, expected {v!r}" for k, v in want.items() if doc.get(k) != v]
    return errors


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------


def _warm(cmd: dict, res: dict, runs: int, log) -> dict | None:  # noqa: ANN001
    """The warm-up, its output kept (in bench/out/tmp_deepspeed/) for the checks against the other tool's."""
    argv = cmd["argv"]
    if cmd["name"] == "ds_to_universal":
        argv = [*argv, "--keep_temp_folder"]  # the fragment directory, measured
    log(f"running {cmd['name']}: 1 warm-up + {runs} runs ...")
    for out in cmd["outputs"]:
        if os.path.exists(out):
            shutil.rmtree(out)
    ib.warm_page_cache(cmd["src"])
    warm = ib.run_once(argv, capture=True)
    res["warmup_s"] = round(warm["wall"], 3)
    if warm["rc"] != 0:
        res.update(ok=False, error=f"exit {warm['rc']}: {cb._tail(warm)}")
        return None
    return warm


def _result(cmd: dict) -> dict:
    return dict(name=cmd["name"], direction=cmd["direction"], role=cmd["role"], workers=cmd.get("workers"),
                command=cmd["label"], ok=True, error=None, warmup_s=None, best_s=None, runs_s=[], best_cpu_s=None,
                cpu_s=[], peak_rss_kib=None, rss_kib=[], loadavg_1min_before=round(os.getloadavg()[0], 2),
                output=None, diff=None, check_errors=[])


def run_pair(ckpt: dict, base: dict, runs: int, settle: float, log) -> tuple[list[dict], dict]:  # noqa: ANN001
    """Warm both, check ckpt's output against the baseline's, then time each."""
    results = [_result(ckpt), _result(base)]
    warms = [_warm(c, r, runs, log) for c, r in zip((ckpt, base), results)]
    info: dict = {}
    if all(w is not None for w in warms):
        results[0]["check_errors"] = check_ckpt_json(ckpt, warms[0]["stdout"])
        if ckpt["direction"] == TO_ST:
            errors, info = check_safetensors(ckpt["outputs"][0], base["outputs"][0], log)
        else:
            errors, info = check_universal(ckpt["outputs"][0], base["outputs"][0])
        results[0]["check_errors"] += errors
        results[0]["diff"] = info
        results[0]["ok"] = not results[0]["check_errors"]
    for c, r in zip((ckpt, base), results):
        for out in c["outputs"]:
            if os.path.exists(out):
                shutil.rmtree(out)
        if r["error"] is None:
            r["settle_s"] = settle
            cb.timed_runs(c, r, runs, _clean_tmp, settle)
    return results, info


def compute_targets(results: list[dict]) -> list[dict]:
    by = {r["name"]: r for r in results}
    rows = []
    for direction, ck, base in ((TO_ST, "ckpt-zero3-to-safetensors", "zero_to_fp32"),
                                (TO_UC, "ckpt-zero3-to-universal", "ds_to_universal")):
        a, b = by.get(ck), by.get(base)
        t = a["best_s"] if a and a["ok"] else None
        rows.append(("baseline/ckpt", direction, ck, base, cb._ratio(b["best_s"] if b and b["ok"] else None, t),
                     RATIO_TARGET, ">="))
        if direction == TO_ST:
            rss = a["peak_rss_kib"] if a and a["ok"] else None
            rows.append(("ckpt_rss_mib", direction, ck, None, round(rss / 1024) if rss else None, RSS_TARGET_MIB, "<="))
    return [cb.target_row(direction, ck, what, other, value, target, op)
            for what, direction, ck, other, value, target, op in rows]


def main(argv: list[str] | None = None) -> int:
    ap = cb.bench_parser(__doc__, "rebuild the cached ZeRO-3 checkpoint in bench/out/")
    args = ap.parse_args(argv)
    if args.generate:
        _generate(args.generate)
        return 0
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    if not os.path.exists(DS_PYTHON):
        raise SystemExit(f"no {os.path.relpath(DS_PYTHON, REPO)}: `make fixtures` builds DeepSpeed's venv")
    load_at_start = os.getloadavg()[0]
    src = ensure_checkpoint(args.regen, log)
    _clean_tmp()
    cmds = commands(src)
    results, loads, checks = [], {}, {}
    for pair in ((cmds[0], cmds[1]), (cmds[2], cmds[3])):
        loads[pair[0]["direction"]] = round(os.getloadavg()[0], 2)
        rows, info = run_pair(*pair, args.runs, args.settle, log)
        results += rows
        checks[pair[0]["direction"]] = info
    failed = any(not r["ok"] for r in results)
    targets = compute_targets(results)
    if os.path.isdir(TMP):
        shutil.rmtree(TMP)
    src_files, src_bytes = ib._dir_stats(src)
    report = {
        **ib.report_header("deepspeed", load_at_start, loads),
        "bytes": vb.BIG_NBYTES, "arrays": 2 * vb.BIG_ARRAYS, "ranks": RANKS, "memory": MEMORY, "runs": args.runs,
        "settle_s": args.settle, "checkpoints": {"zero3": os.path.relpath(src, REPO)},
        "source": {"files": src_files, "bytes": src_bytes}, "checks": checks,
        "results": results, "targets": targets, "ok": not failed,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 1 if failed else 0


def _print_report(report: dict) -> None:
    print()
    print(f"deepspeed bench: a ZeRO-3 checkpoint of {report['ranks']} ranks, {report['bytes'] / 2**30:.0f} GiB of fp32 "
          f"master weights ({report['source']['bytes'] / 2**30:.1f} GiB of files with the Adam moments); best of "
          f"{report['runs']} runs after 1 warm-up, sync + {report['settle_s']:g} s pause before each, "
          f"{report['machine']['cpus']} cpus, warm page cache for SRC")
    cb.print_load(report)
    for direction in (TO_ST, TO_UC):
        rows = [r for r in report["results"] if r["direction"] == direction]
        print()
        print(f"{direction.replace('->', ' -> ')}  (SRC {report['checkpoints']['zero3']})")
        cb.print_rows(rows)
        info = report["checks"].get(direction) or {}
        if direction == TO_ST and info:
            print(f"  check: ckpt diff --values against zero_to_fp32's output: same={info.get('same')}, "
                  f"{info.get('compared')} tensors")
        if direction == TO_UC and info:
            print(f"  check: {info.get('files')} files, {info.get('bytes', 0) / 2**30:.2f} GiB, the same as "
                  f"ds_to_universal's: {info.get('identical')}; ckpt wrote no temporary directory; ds_to_universal's "
                  f"fragments: {info.get('ds_to_universal_fragments')} files, "
                  f"{info.get('ds_to_universal_fragment_bytes', 0) / 2**30:.2f} GiB")
        print()
        for q in report["targets"]:
            if q["direction"] == direction:
                head = "ckpt peak RSS" if q["what"] == "ckpt_rss_mib" else f"{q['other']} / ckpt"
                cb.print_target(f"  {head}", q)
    print()


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table (the same form as convert_bench's)."""
    return cb.summary_rows(doc, bench="deepspeed")


if __name__ == "__main__":
    sys.exit(main())
