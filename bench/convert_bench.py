#!/usr/bin/env python3
"""Benchmark `ckpt convert` (Orbax <-> DCP, 2 GiB) against the libraries' own conversions and `cp -r`.

    python bench/convert_bench.py [--runs N] [--settle S] [--json] [--regen] [--no-extra] [--profile | --profile-only]

Inputs: validate_bench's 2 GiB checkpoints, built by its own generator when
missing (cached in bench/out/, rebuilt with --regen):

  * bench/out/orbax_2gib: 64 float32 arrays of (4096, 2048), StandardCheckpointer
    (OCDBT + zarr v2, zstd), 512 chunks of 4 MiB;
  * bench/out/dcp_2gib: the same tensors, dcp.save() from one process, one
    2 GiB __0_0.distcp (one 32 MiB chunk per tensor).

It times WHOLE PROCESSES, each a freshly started interpreter (so imports
count, as they do for a user), with the source in the page cache (read once
before every run). Every output goes to bench/out/tmp_convert/ and is deleted
after each run, outside the timed region (ckpt's DST must not exist).

  orbax -> dcp   ckpt convert SRC DST --to dcp --workers W --json, for W = the
                   default, min(4, 2 x cores), and 4 (or 2 where the default is 4)
                 baseline: orbax restore as numpy (PyTreeCheckpointer,
                   RestoreArgs(restore_type=np.ndarray)), torch.from_numpy,
                   torch.distributed.checkpoint.save(checkpoint_id=DST)
                 cp -r SRC DST;  cp -r + fsync of every copied file (sync FILE...)
  dcp -> orbax   ckpt convert SRC DST --to orbax --workers W --json, the same two W
                 baseline: dcp_to_torch_save(SRC, DST.pt)   (the issue's baseline)
                 extra: dcp_to_torch_save + torch.load + StandardCheckpointer().save
                   of the numpy arrays (like for like; --no-extra skips it)
                 cp -r SRC DST;  cp -r + fsync
  both           the default ckpt convert and cp -r once more, back to back
                   (no sync, no pause: the protocol before --settle; no target)

Every timed run starts the same way, whatever the command: the previous
output deleted, SRC read once, a sync, then a pause of --settle seconds
(default 5). On this VM memory freed less than a second before is cheap to
fill and memory free for longer is not (the hypervisor takes it back):
`cp -r` of the 2 GiB DCP checkpoint took 0.66 s right after deleting its
previous copy and 2.8-4.1 s 1-8 s later. Back to back, cp is always timed in
the first state and ckpt never is (ckpt drops its own output from the page
cache while it writes, so deleting it frees nothing), so the pause is there
for every command, and the back-to-back pair is shown beside it.

Each command runs once as a warm-up whose output is checked (ckpt's JSON must
count 64 arrays and 2 GiB, and `ckpt diff SRC DST --values` (bit-exact, not
timed) must find no difference; the baselines must report 64 tensors / the
bytes; cp must copy every byte), then N times (default 2); the best wall time
counts, its CPU time is shown, and the peak RSS is the largest of the timed
runs (os.wait4 rusage of that one child, as in inspect_bench.py, whose
process runner this bench reuses).

Targets, per direction, on the default --workers (min(4, 2 x cores)):
  baseline wall / ckpt wall >= 3x   (orbax -> dcp: restore + dcp.save;
                                     dcp -> orbax: dcp_to_torch_save)
  ckpt wall / cp -r wall   <= 3x
  ckpt peak RSS            <= 512 MiB

--profile then profiles `ckpt convert` in-process for both directions, each
mode in a fresh subprocess (default --workers): "phases", a wall-clock
breakdown by phase with the RSS peak of each phase and the thread-seconds
spent in reading, writing and waiting; "read-only" (the writer drops every
chunk) and "write-only" (the source is not read: every chunk comes from one
cached array), which split the cost between the two sides; "cprofile", every
thread's profile merged (top functions by own time); "tracemalloc", the peak
of Python/numpy-visible memory and where it was allocated (the rest of the
RSS is native: tensorstore, allocator arenas). Reported, never a target.
--profile-only runs just that part.

Exit status: 0 when every command ran and ckpt's output checked out (targets
met or not); 1 when a command failed, a check failed, or `ckpt diff` found a
difference.
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

import inspect_bench as ib  # noqa: E402  (process runner, page-cache warmer, formatting)
import validate_bench as vb  # noqa: E402  (the 2 GiB checkpoints and their generator)

from ckpt_tool.base.parallel import default_workers  # noqa: E402

REPO = ib.REPO
OUT = ib.OUT
TMP = os.path.join(OUT, "tmp_convert")
BASELINE_TARGET = 3.0  # baseline wall / ckpt wall >= this
CP_TARGET = 3.0  # ckpt wall / cp -r wall <= this
RSS_TARGET_KIB = 512 * 1024  # ckpt peak RSS <= this
DEFAULT_WORKERS = default_workers()  # ckpt convert's default --workers: min(4, 2 x cores)
# the first is the default, which the targets use; the other is shown beside it
WORKER_VARIANTS = (DEFAULT_WORKERS, 4 if DEFAULT_WORKERS != 4 else 2)
N_ARRAYS = vb.BIG_ARRAYS
NBYTES = vb.BIG_NBYTES
MIN_FREE = 10 * 2**30  # outputs (up to ~4 GiB at once) plus slack
PROFILE_TIMEOUT_S = 600
# Before every timed run: sync, then this pause, for every command alike. On
# this VM (free-page reporting to the hypervisor) memory freed less than a
# second earlier is cheap to fill again and memory free for longer is not:
# `cp -r` of the 2 GiB DCP checkpoint took 0.66 s right after deleting the
# previous copy, 2.8 s one second later, 3.5-4.1 s after 3-8 s (the Orbax
# one: 2.0-2.5 s after 3 s, 2.8-3.1 s after 8 s). Run back to back, cp is
# timed in that first state and ckpt never is (ckpt drops its output from
# the page cache as it goes, so deleting it frees next to nothing).
DEFAULT_SETTLE_S = 5.0
PROFILE_MODES = ("phases", "read-only", "write-only", "cprofile", "tracemalloc")

# --------------------------------------------------------------------------
# the baselines (each prints what it did; checked on the warm-up)
# --------------------------------------------------------------------------

# prints: <arrays> <bytes restored>
ORBAX_TO_DCP = r"""
import os, sys, warnings
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
import numpy as np
import jax
import orbax.checkpoint as ocp
import torch
import torch.distributed.checkpoint as dcp
src, dst = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
tree = ocp.StandardCheckpointer().metadata(src).item_metadata.tree
args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
restored = ocp.PyTreeCheckpointer().restore(src, restore_args=args)
leaves = jax.tree.leaves(restored)
assert all(isinstance(x, np.ndarray) for x in leaves), {type(x) for x in leaves}
dcp.save(jax.tree.map(torch.from_numpy, restored), checkpoint_id=dst)
print(len(leaves), sum(x.nbytes for x in leaves))
"""

# prints: <bytes of the torch.save file>
DCP_TO_TORCH_SAVE = r"""
import os, sys, warnings
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
print(os.path.getsize(sys.argv[2]))
"""

# prints: <arrays> <bytes saved>
DCP_TO_ORBAX = r"""
import os, sys, warnings
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
import jax
import orbax.checkpoint as ocp
src, pt, dst = (os.path.abspath(p) for p in sys.argv[1:4])
dcp_to_torch_save(src, pt)
tree = jax.tree.map(lambda t: t.numpy(), torch.load(pt, weights_only=True))
ck = ocp.StandardCheckpointer()
ck.save(dst, tree)
ck.wait_until_finished()
ck.close()
leaves = jax.tree.leaves(tree)
print(len(leaves), sum(x.nbytes for x in leaves))
"""

CP_FSYNC = 'cp -r -- "$1" "$2" && find "$2" -type f -exec sync -- {} +'


def _dst(name: str, suffix: str = "") -> str:
    return os.path.join(TMP, name + suffix)


def commands(big: dict, extra: bool) -> list[dict]:
    """The timed commands, in run order; `outputs` are deleted after every run."""
    py = sys.executable
    cmds: list[dict] = []
    for direction, src_fmt, to in (("orbax->dcp", "orbax", "dcp"), ("dcp->orbax", "dcp", "orbax")):
        src = big[src_fmt]
        for w in WORKER_VARIANTS:
            name = f"ckpt-to-{to}-w{w}"
            dst = _dst(name)
            default = " (default)" if w == DEFAULT_WORKERS else ""
            cmds.append({
                "name": name, "direction": direction, "role": "ckpt", "workers": w, "src": src, "outputs": [dst],
                "argv": [py, "-m", "ckpt_tool", "convert", src, dst, "--to", to, "--workers", str(w), "--json"],
                "label": f"ckpt convert --to {to} --workers {w}{default}",
            })
        if direction == "orbax->dcp":
            dst = _dst("orbax-restore-dcp-save")
            cmds.append({
                "name": "orbax-restore-dcp-save", "direction": direction, "role": "baseline", "src": src,
                "outputs": [dst], "argv": [py, "-c", ORBAX_TO_DCP, src, dst],
                "label": "orbax restore (numpy) + torch.from_numpy + dcp.save",
            })
        else:
            pt = _dst("dcp-to-torch-save", ".pt")
            cmds.append({
                "name": "dcp-to-torch-save", "direction": direction, "role": "baseline", "src": src,
                "outputs": [pt], "argv": [py, "-c", DCP_TO_TORCH_SAVE, src, pt],
                "label": "dcp_to_torch_save(SRC, file.pt)",
            })
            if extra:
                pt, dst = _dst("dcp-torch-orbax-save", ".pt"), _dst("dcp-torch-orbax-save")
                cmds.append({
                    "name": "dcp-torch-orbax-save", "direction": direction, "role": "extra", "src": src,
                    "outputs": [pt, dst], "argv": [py, "-c", DCP_TO_ORBAX, src, pt, dst],
                    "label": "dcp_to_torch_save + torch.load + StandardCheckpointer.save",
                })
        dst = _dst(f"cp-{src_fmt}")
        cmds.append({
            "name": f"cp-{src_fmt}", "direction": direction, "role": "cp", "src": src, "outputs": [dst],
            "argv": ["cp", "-r", "--", src, dst], "label": "cp -r SRC DST",
        })
        # the old protocol, for comparison: no sync and no pause before each run
        name = f"ckpt-to-{to}-b2b"
        dst = _dst(name)
        cmds.append({
            "name": name, "direction": direction, "role": "ckpt-b2b", "workers": DEFAULT_WORKERS, "src": src,
            "outputs": [dst], "settle": False,
            "argv": [py, "-m", "ckpt_tool", "convert", src, dst, "--to", to, "--json"],
            "label": "ckpt convert (default), back to back",
        })
        dst = _dst(f"cp-b2b-{src_fmt}")
        cmds.append({
            "name": f"cp-b2b-{src_fmt}", "direction": direction, "role": "cp-b2b", "src": src, "outputs": [dst],
            "settle": False, "argv": ["cp", "-r", "--", src, dst], "label": "cp -r SRC DST, back to back",
        })
        dst = _dst(f"cp-fsync-{src_fmt}")
        cmds.append({
            "name": f"cp-fsync-{src_fmt}", "direction": direction, "role": "cp-fsync", "src": src, "outputs": [dst],
            "argv": ["sh", "-c", CP_FSYNC, "sh", src, dst], "label": "cp -r + sync FILE... (fsync each copy)",
        })
    return cmds


# --------------------------------------------------------------------------
# checking the output
# --------------------------------------------------------------------------


def clean_dir(path: str) -> None:
    """Empty `path` (a bench's output directory), creating it if needed."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)


def _clean_tmp() -> None:
    clean_dir(TMP)


def _tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return ib._dir_stats(path)[1] if os.path.isdir(path) else -1


def check_ckpt_json(cmd: dict, text: str) -> list[str]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return [f"output is not JSON: {exc}"]
    src_fmt, to = cmd["direction"].split("->")
    want = {"source_format": src_fmt, "target_format": to, "arrays": N_ARRAYS, "values": 0, "bytes": NBYTES,
            "skipped": [], "cast": [], "process_count": 1}
    errors = [f"{k} is {doc.get(k)!r}, expected {v!r}" for k, v in want.items() if doc.get(k) != v]
    if not os.path.isdir(cmd["outputs"][0]):
        errors.append("DST was not created")
    return errors


def check_baseline_output(cmd: dict, text: str) -> list[str]:
    try:
        nums = [int(w) for w in text.split()]
    except ValueError:
        return [f"unexpected output {text.strip()[:200]!r}"]
    if cmd["name"] == "dcp-to-torch-save":
        ok = len(nums) == 1 and nums[0] >= NBYTES
    else:
        ok = nums == [N_ARRAYS, NBYTES]
    errors = [] if ok else [f"the baseline reported {text.strip() or 'nothing'!r}"]
    for out in cmd["outputs"]:
        if _tree_bytes(out) < NBYTES * 0.85:  # orbax output is zstd-compressed (about 1.85 GiB)
            errors.append(f"{os.path.relpath(out, REPO)} holds {_tree_bytes(out)} bytes")
    return errors


def check_cp(cmd: dict) -> list[str]:
    want, got = ib._dir_stats(cmd["src"]), ib._dir_stats(cmd["outputs"][0])
    return [] if want == got else [f"copied (files, bytes) {got}, source has {want}"]


def run_diff(cmd: dict, log) -> tuple[list[str], dict]:
    """`ckpt diff SRC DST --values --json` on the warm-up's output (not timed)."""
    argv = [sys.executable, "-m", "ckpt_tool", "diff", cmd["src"], cmd["outputs"][0], "--values", "--json"]
    log(f"  checking {cmd['name']}'s output: ckpt diff --values ...")
    r = ib.run_once(argv, capture=True)
    info = {"rc": r["rc"], "wall_s": round(r["wall"], 3), "peak_rss_kib": r["rss_kib"]}
    try:
        doc = json.loads(r["stdout"])
    except ValueError:
        tail = (r["stderr"].strip().splitlines() or ["(no stderr)"])[-1]
        return [f"ckpt diff exit {r['rc']}, no JSON: {tail}"], info
    info.update(same=doc.get("same"), compared=doc.get("compared"), differences=len(doc.get("differences") or []))
    errors = []
    if r["rc"] != 0 or doc.get("same") is not True or doc.get("values") is not True:
        errors.append(f"ckpt diff --values: the output differs from the source (exit {r['rc']})")
        for d in (doc.get("differences") or [])[:5]:
            errors.append(f"  {d.get('kind')} {d.get('path')}: {d.get('message')}")
    if doc.get("compared") != N_ARRAYS:
        errors.append(f"ckpt diff compared {doc.get('compared')} leaves, expected {N_ARRAYS}")
    return errors, info


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------


def _tail(r: dict) -> str:
    return (r["stderr"].strip().splitlines() or ["(no stderr)"])[-1]


def run_command(cmd: dict, runs: int, log, settle_s: float = DEFAULT_SETTLE_S) -> dict:
    res = dict(name=cmd["name"], direction=cmd["direction"], role=cmd["role"], workers=cmd.get("workers"),
               command=cmd["label"], ok=True, error=None, warmup_s=None, best_s=None, runs_s=[], best_cpu_s=None,
               cpu_s=[], peak_rss_kib=None, rss_kib=[], loadavg_1min_before=round(os.getloadavg()[0], 2),
               output=None, diff=None, check_errors=[])
    warm = warm_up(cmd, res, runs, log, _clean_tmp)
    if warm is None:
        return res
    if cmd["role"] == "ckpt":
        res["check_errors"] = check_ckpt_json(cmd, warm["stdout"])
        if not res["check_errors"]:
            errors, res["diff"] = run_diff(cmd, log)
            res["check_errors"] += errors
    elif cmd["role"] == "ckpt-b2b":  # the same command as a checked one, timed differently
        res["check_errors"] = check_ckpt_json(cmd, warm["stdout"])
    elif cmd["role"] in ("baseline", "extra"):
        res["output"] = warm["stdout"].strip()
        res["check_errors"] = check_baseline_output(cmd, warm["stdout"])
    else:
        res["check_errors"] = check_cp(cmd)
    if res["check_errors"]:
        res["ok"] = False
    res["settle_s"] = settle_s if cmd.get("settle", True) else 0.0
    timed_runs(cmd, res, runs, _clean_tmp, res["settle_s"])
    return res


def warm_up(cmd: dict, res: dict, runs: int, log, clean) -> dict | None:
    """The warm-up run (output captured for the checks); None, with the error in `res`, if it failed."""
    log(f"running {cmd['name']}: 1 warm-up + {runs} runs ...")
    clean()
    ib.warm_page_cache(cmd["src"])
    warm = ib.run_once(cmd["argv"], capture=True)
    res["warmup_s"] = round(warm["wall"], 3)
    if warm["rc"] != 0:
        res.update(ok=False, error=f"exit {warm['rc']}: {_tail(warm)}")
        clean()
        return None
    return warm


def timed_runs(cmd: dict, res: dict, runs: int, clean, settle_s: float = 0.0) -> None:
    """The timed runs into `res`: wall, CPU and RSS of each, then the best run and the peak RSS.

    With `settle_s`, each run starts after a sync and that pause (see DEFAULT_SETTLE_S).
    """
    for _ in range(runs):
        clean()  # outside the timed region: DST must not exist
        ib.warm_page_cache(cmd["src"])
        if settle_s > 0:
            os.sync()
            time.sleep(settle_s)
        r = ib.run_once(cmd["argv"], capture=False)
        if r["rc"] != 0 or not all(os.path.exists(p) for p in cmd["outputs"]):
            res.update(ok=False, error=f"exit {r['rc']}: {_tail(r)}" if r["rc"] else "no output written")
            break
        res["runs_s"].append(round(r["wall"], 4))
        res["cpu_s"].append(round(r["cpu"], 4))
        res["rss_kib"].append(r["rss_kib"])
    clean()
    if res["runs_s"]:
        best = res["runs_s"].index(min(res["runs_s"]))
        res["best_s"] = res["runs_s"][best]
        res["best_cpu_s"] = res["cpu_s"][best]
        res["peak_rss_kib"] = max(res["rss_kib"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def conversion_targets(by: dict[str, dict], direction: str, ckpt: str, baseline: str, cp: str, *,
                       baseline_target: float = BASELINE_TARGET, rss_target_mib: float = RSS_TARGET_KIB / 1024,
                       ) -> list[dict]:
    """One conversion's three target rows (the form every conversion bench reports): baseline wall /
    ckpt wall >= baseline_target, ckpt wall / cp -r wall <= CP_TARGET, ckpt peak RSS <= rss_target_mib;
    a value is None (not measured) when a command failed or its output was wrong."""
    ck, base, cpr = by.get(ckpt), by.get(baseline), by.get(cp)
    t = ck["best_s"] if ck and ck["ok"] else None
    rss = ck["peak_rss_kib"] if ck and ck["ok"] else None
    rows = [
        ("baseline/ckpt", baseline, _ratio(base["best_s"] if base and base["ok"] else None, t), baseline_target, ">="),
        ("ckpt/cp", cp, _ratio(t, cpr["best_s"] if cpr and cpr["ok"] else None), CP_TARGET, "<="),
        ("ckpt_rss_mib", None, round(rss / 1024) if rss else None, rss_target_mib, "<="),
    ]
    return [target_row(direction, ckpt, what, other, value, target, op) for what, other, value, target, op in rows]


def target_row(direction: str, ckpt: str, what: str, other: str | None, value: float | None, target: float,
               op: str) -> dict:
    met = None if value is None else (value >= target if op == ">=" else value <= target)
    return {"direction": direction, "ckpt": ckpt, "workers": DEFAULT_WORKERS, "what": what, "other": other,
            "value": value, "target": target, "op": op, "met": met}


def bench_parser(doc: str, regen: str, *, settle_default: float | None = DEFAULT_SETTLE_S,
                 settle_help: str | None = None, generate: bool = True) -> argparse.ArgumentParser:
    """The options every conversion bench takes (--runs, --json, --regen, --settle; its hidden --generate),
    and the other benches' options run_all passes on to every bench, accepted and ignored."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--runs", type=int, default=2, help="timed runs per command after one warm-up (default 2)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--regen", action="store_true", help=regen)
    ap.add_argument("--settle", type=float, default=settle_default, metavar="S",
                    help=settle_help or f"sync, then pause S seconds before every timed run (default {DEFAULT_SETTLE_S:g})")
    if generate:
        ap.add_argument("--generate", metavar="PATH", help=argparse.SUPPRESS)
    # run_all passes every bench's options on; these belong to the others
    ap.add_argument("--layers", type=int, default=1000, help=argparse.SUPPRESS)
    ap.add_argument("--no-extra", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    return ap


def compute_targets(results: list[dict]) -> tuple[list[dict], list[dict]]:
    """(targets, info): the three targets per direction on the default --workers; other ratios as info."""
    by = {r["name"]: r for r in results}
    targets, info = [], []
    for direction, to, base in (("orbax->dcp", "dcp", "orbax-restore-dcp-save"), ("dcp->orbax", "orbax", "dcp-to-torch-save")):
        src_fmt = direction.split("->")[0]
        cp, cpf = by.get(f"cp-{src_fmt}"), by.get(f"cp-fsync-{src_fmt}")
        b, x = by.get(base), by.get("dcp-torch-orbax-save") if direction == "dcp->orbax" else None
        for w in WORKER_VARIANTS:
            ck = by.get(f"ckpt-to-{to}-w{w}")
            good = ck is not None and ck["ok"] and ck["best_s"]
            t = ck["best_s"] if good else None
            rss = ck["peak_rss_kib"] if good else None
            rows = [
                ("baseline/ckpt", base, _ratio(b["best_s"] if b and b["ok"] else None, t), BASELINE_TARGET, ">="),
                ("ckpt/cp", f"cp-{src_fmt}", _ratio(t, cp["best_s"] if cp and cp["ok"] else None), CP_TARGET, "<="),
                ("ckpt_rss_mib", None, round(rss / 1024) if rss else None, RSS_TARGET_KIB / 1024, "<="),
            ]
            for what, other, value, target, op in rows:
                met = None if value is None else (value >= target if op == ">=" else value <= target)
                q = {"direction": direction, "ckpt": f"ckpt-to-{to}-w{w}", "workers": w, "what": what,
                     "other": other, "value": value, "target": target, "op": op, "met": met}
                (targets if w == DEFAULT_WORKERS else info).append(q)
            if w == DEFAULT_WORKERS:  # no target: the old protocol, both back to back
                kb, cb = by.get(f"ckpt-to-{to}-b2b"), by.get(f"cp-b2b-{src_fmt}")
                info.append({"direction": direction, "ckpt": f"ckpt-to-{to}-b2b", "workers": w,
                             "what": "ckpt/cp-b2b", "other": f"cp-b2b-{src_fmt}",
                             "value": _ratio(kb["best_s"] if kb and kb["ok"] else None,
                                             cb["best_s"] if cb and cb["ok"] else None)})
            # no target: ckpt against cp with fsync, and against the like-for-like extra baseline
            info.append({"direction": direction, "ckpt": f"ckpt-to-{to}-w{w}", "workers": w, "what": "ckpt/cp-fsync",
                         "other": f"cp-fsync-{src_fmt}",
                         "value": _ratio(t, cpf["best_s"] if cpf and cpf["ok"] else None)})
            if x is not None:
                info.append({"direction": direction, "ckpt": f"ckpt-to-{to}-w{w}", "workers": w,
                             "what": "extra/ckpt", "other": x["name"],
                             "value": _ratio(x["best_s"] if x["ok"] else None, t)})
    return targets, info


# --------------------------------------------------------------------------
# --profile: ckpt convert in-process, in a fresh subprocess per direction and mode
# --------------------------------------------------------------------------

# Functions timed in the "phases" mode (thread-seconds summed over threads and calls).
# Missing attributes are skipped, so the bench survives refactors of ckpt_tool.
TIMED = [
    ("ckpt_tool.core.model", "ArrayLeaf.read", "source read (ArrayLeaf.read, total)"),
    ("ckpt_tool.formats.orbax.reader", "_ZarrRegionReader.read", "  orbax: tensorstore zarr read + decode"),
    ("ckpt_tool.formats.dcp.reader", "_TensorReader._locate", "  dcp: locate chunk (zip headers)"),
    ("ckpt_tool.machinery.torch_save.payload", "read_region", "  dcp: read_region (fetch + CRC + copy)"),
    ("ckpt_tool.storage", "Storage._read", "    Storage._read (kvstore read + bytes())"),
    ("ckpt_tool.formats.dcp.write", "DcpWriter.write_array", "writer.write_array (DCP, total)"),
    ("ckpt_tool.formats.dcp.write", "tensor_archive", "  tensor_archive (pickle + CRC-32)"),
    ("ckpt_tool.formats.dcp.write", "DcpWriter._append", "  _append (pwritev at its offset; closes full files)"),
    ("ckpt_tool.formats.dcp.write", "DcpWriter._flush", "    _flush (fsync of a full 64 MiB local file)"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter.write_array", "writer.write_array (Orbax, total)"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter._submit", "  _submit (tensorstore write: copy + backpressure)"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter._drain", "    _drain (waiting for OCDBT commits)"),
]
# Sequential phases of engine.convert, in the main thread.
PHASES = [
    ("ckpt_tool.formats", "open_checkpoint", "open source (read metadata)"),
    ("ckpt_tool.ops.engine", "plan_conversion", "plan"),
    ("ckpt_tool.ops.engine", "prepare_output", "prepare output dir"),
    ("ckpt_tool.ops.engine", "make_writer", "make writer"),
    ("ckpt_tool.formats.dcp.write", "DcpWriter.begin", "writer.begin"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter.begin", "writer.begin"),
    ("ckpt_tool.ops.engine", "stream", "stream (copy every chunk)"),
    ("ckpt_tool.formats.dcp.write", "DcpWriter.finish_process", "writer.finish_process"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter.finish_process", "writer.finish_process"),
    ("ckpt_tool.formats.dcp.write", "DcpWriter.commit", "writer.commit"),
    ("ckpt_tool.formats.orbax.write", "OrbaxWriter.commit", "writer.commit"),
    ("ckpt_tool.ops.engine", "finalize_output", "rename into place"),
]


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _patch(module_name: str, attr: str, wrap) -> bool:
    import importlib

    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return False
    owner, _, name = attr.rpartition(".")
    obj = getattr(mod, owner) if owner else mod
    fn = getattr(obj, name, None)
    if fn is None:
        return False
    setattr(obj, name, wrap(fn))
    return True


def profile_all_threads(call):
    """Run call() under cProfile in this thread and in every thread it starts
    (the copies run in pool threads); return (result, seconds, merged
    pstats.Stats, threads profiled)."""
    import cProfile
    import pstats
    import threading

    profiles = []
    orig_run = threading.Thread.run

    def run(self):
        p = cProfile.Profile()
        profiles.append(p)
        p.enable()
        try:
            orig_run(self)
        finally:
            p.disable()

    threading.Thread.run = run
    main = cProfile.Profile()
    s = time.perf_counter()
    main.enable()
    try:
        result = call()
    finally:
        main.disable()
        threading.Thread.run = orig_run
    seconds = round(time.perf_counter() - s, 3)
    stats = pstats.Stats(main)
    for p in profiles:
        stats.add(p)
    return result, seconds, stats, len(profiles) + 1


def top_functions(stats, key: str, top: int) -> str:
    """pstats' table of the `top` functions by `key`, with repository and stdlib paths shortened."""
    import io

    buf = io.StringIO()
    stats.stream = buf
    stats.sort_stats(key).print_stats(top)
    text = buf.getvalue()
    text = text[text.find("   ncalls"):] if "   ncalls" in text else text
    return text.replace(REPO + "/", "").replace(os.path.dirname(os.__file__) + "/", "")


def _profile_child(direction: str, mode: str, src: str, dst: str, workers: int, top: int) -> dict:
    """Runs in a fresh process: one `ckpt convert` in-process, instrumented per `mode`."""
    import threading

    out: dict = {"direction": direction, "mode": mode, "workers": workers}
    t0 = time.perf_counter()
    import ckpt_tool.cli.main  # noqa: F401  (what `python -m ckpt_tool` imports)
    from ckpt_tool.ops import engine

    out["import_s"] = round(time.perf_counter() - t0, 3)
    out["rss_after_import_kib"] = _rss_kib()
    to = direction.split("->")[1]
    opts = engine.ConvertOptions(to=to, workers=workers)
    # jax-free: make sure nothing heavy sneaks in
    out["heavy_modules_imported"] = sorted(m for m in ("jax", "torch", "orbax") if m in sys.modules)

    if mode == "phases":
        lock = threading.Lock()
        timed: dict[str, list] = {}
        phases: list[dict] = []
        current = {"label": "before convert"}
        samples: list[tuple[float, int, str]] = []
        stop = threading.Event()

        def sampler() -> None:
            while not stop.is_set():
                samples.append((time.perf_counter(), _rss_kib(), current["label"]))
                stop.wait(0.005)

        def timer(label):
            def wrap(fn):
                def inner(*a, **k):
                    s = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        d = time.perf_counter() - s
                        with lock:
                            e = timed.setdefault(label, [0.0, 0])
                            e[0] += d
                            e[1] += 1
                return inner
            return wrap

        def phase(label):
            def wrap(fn):
                def inner(*a, **k):
                    prev = current["label"]
                    current["label"] = label
                    s = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        phases.append({"phase": label, "s": time.perf_counter() - s})
                        current["label"] = prev
                return inner
            return wrap

        for mod, attr, label in TIMED:
            if _patch(mod, attr, timer(label)):
                timed.setdefault(label, [0.0, 0])
        for mod, attr, label in PHASES:
            _patch(mod, attr, phase(label))
        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        s = time.perf_counter()
        result = engine.convert(src, dst, opts)
        out["convert_s"] = round(time.perf_counter() - s, 3)
        stop.set()
        th.join()
        out["result"] = result.to_json()
        merged: dict[str, float] = {}
        for p in phases:
            merged[p["phase"]] = merged.get(p["phase"], 0.0) + p["s"]
        out["phases"] = [{"phase": k, "s": round(v, 3)} for k, v in merged.items()]
        out["other_s"] = round(out["convert_s"] - sum(merged.values()), 3)
        out["timed"] = [{"what": label, "thread_s": round(v[0], 3), "calls": v[1]}
                        for label, v in timed.items() if v[1]]
        peak: dict[str, int] = {}
        for _, rss, label in samples:
            peak[label] = max(peak.get(label, 0), rss)
        out["rss_peak_by_phase_kib"] = peak
        out["rss_timeline_kib"] = [(round(t - s, 2), rss) for t, rss, _ in samples[:: max(1, len(samples) // 60)]]
    elif mode == "cprofile":
        result, out["convert_s"], stats, out["threads_profiled"] = profile_all_threads(
            lambda: engine.convert(src, dst, opts)
        )
        out["result"] = result.to_json()
        for key in ("tottime", "cumulative"):
            out[f"top_{key}"] = top_functions(stats, key, top)
    elif mode == "tracemalloc":
        import tracemalloc

        tracemalloc.start(1)
        best = {"kib": 0, "snap": None}
        stop = threading.Event()

        def watcher() -> None:  # snapshot at each new high-water mark of traced memory
            while not stop.is_set():
                cur = tracemalloc.get_traced_memory()[0] // 1024
                if cur > best["kib"] * 1.05 + 1024:
                    best["kib"] = cur
                    best["snap"] = tracemalloc.take_snapshot()
                    best["rss"] = _rss_kib()
                stop.wait(0.01)

        th = threading.Thread(target=watcher, daemon=True)
        th.start()
        s = time.perf_counter()
        result = engine.convert(src, dst, opts)
        out["convert_s"] = round(time.perf_counter() - s, 3)  # slowed down by tracemalloc
        stop.set()
        th.join()
        out["result"] = result.to_json()
        out["traced_peak_kib"] = tracemalloc.get_traced_memory()[1] // 1024
        out["rss_at_snapshot_kib"] = best.get("rss")
        if best["snap"] is not None:
            out["snapshot_traced_kib"] = best["kib"]
            out["top_sites"] = [
                {"site": str(st.traceback[0]).replace(REPO + "/", ""), "kib": st.size // 1024, "blocks": st.count}
                for st in best["snap"].statistics("lineno")[:top]
            ]
        tracemalloc.stop()
    elif mode in ("read-only", "write-only"):
        import numpy as np

        from ckpt_tool.base import dtypes

        if mode == "read-only":  # the writer drops every chunk (and skips its commit checks)
            for mod, attr in (("ckpt_tool.formats.dcp.write", "DcpWriter"), ("ckpt_tool.formats.orbax.write", "OrbaxWriter")):
                _patch(mod, attr + ".write_array", lambda fn: (lambda self, *a, **k: None))
            _patch("ckpt_tool.formats.orbax.write", "OrbaxWriter._merge", lambda fn: (lambda self: None))
            _patch("ckpt_tool.formats.dcp.write", "DcpWriter.commit", lambda fn: (lambda self: None))
        else:  # the source is not read: every region comes from one cached array per shape
            cache: dict = {}
            lock = threading.Lock()

            def fake_read(self, region=None):
                shape = tuple(r.stop - r.start for r in region)
                with lock:
                    a = cache.get((shape, self.dtype))
                    if a is None:
                        rng = np.random.default_rng(0)
                        a = rng.standard_normal(shape).astype(dtypes.numpy_dtype(self.dtype))
                        cache[(shape, self.dtype)] = a
                return a

            _patch("ckpt_tool.core.model", "ArrayLeaf.read", lambda fn: fake_read)
        s = time.perf_counter()
        result = engine.convert(src, dst, opts)
        out["convert_s"] = round(time.perf_counter() - s, 3)
        out["result"] = result.to_json()
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_user_s"], out["cpu_sys_s"], out["minor_faults"] = round(ru.ru_utime, 2), round(ru.ru_stime, 2), ru.ru_minflt
    out["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


def run_profiles(big: dict, log) -> list[dict]:
    report = []
    for direction, src_fmt, to in (("orbax->dcp", "orbax", "dcp"), ("dcp->orbax", "dcp", "orbax")):
        for mode in PROFILE_MODES:
            log(f"profiling ckpt convert {direction} ({mode}) in-process ...")
            _clean_tmp()
            ib.warm_page_cache(big[src_fmt])
            dst = _dst(f"profile-{to}")
            argv = [sys.executable, os.path.abspath(__file__), "--profile-child", direction, "--mode", mode,
                    "--path", big[src_fmt], "--dst", dst]
            proc = subprocess.run(argv, env=ib._run_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, timeout=PROFILE_TIMEOUT_S)
            _clean_tmp()
            if proc.returncode != 0:
                report.append({"direction": direction, "mode": mode, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
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
    ap.add_argument("--no-extra", action="store_true",
                    help="skip the slow like-for-like dcp -> torch.save -> orbax save baseline (no target)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile ckpt convert in-process (phases, cProfile, tracemalloc) for both directions")
    ap.add_argument("--profile-only", action="store_true", help="only the --profile part (no timed commands, no targets)")
    ap.add_argument("--settle", type=float, default=DEFAULT_SETTLE_S, metavar="S",
                    help=f"sync, then pause S seconds before every timed run (default {DEFAULT_SETTLE_S:g}; "
                         "0 = back to back)")
    ap.add_argument("--layers", type=int, default=1000, help=argparse.SUPPRESS)  # run_all passes it on; unused here
    ap.add_argument("--profile-child", choices=("orbax->dcp", "dcp->orbax"), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=PROFILE_MODES, default="phases", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help=argparse.SUPPRESS)
    ap.add_argument("--top", type=int, default=25, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.settle < 0:
        ap.error("--settle must not be negative")

    if args.profile_child:  # internal: one instrumented in-process convert
        print(json.dumps(_profile_child(args.profile_child, args.mode, args.path, args.dst, args.workers, args.top)))
        return 0

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    load_at_start = os.getloadavg()[0]  # other work on a 2-core box skews wall times
    big = vb.ensure_big_checkpoints(args.regen, log)
    _clean_tmp()
    free = shutil.disk_usage(TMP).free
    if free < MIN_FREE:
        raise SystemExit(f"not enough disk for the outputs: {free / 2**30:.1f} GiB free in {TMP}, "
                         f"need {MIN_FREE / 2**30:.0f} GiB")

    results = []
    loads = {}
    for cmd in [] if args.profile_only else commands(big, extra=not args.no_extra):
        if cmd["direction"] not in loads:
            loads[cmd["direction"]] = round(os.getloadavg()[0], 2)
        results.append(run_command(cmd, args.runs, log, args.settle))
    failed = any(not r["ok"] for r in results)
    targets, info = compute_targets(results)
    profiles = run_profiles(big, log) if args.profile or args.profile_only else None
    if os.path.isdir(TMP):
        shutil.rmtree(TMP)

    report = {
        **ib.report_header("convert", load_at_start, loads),
        "bytes": NBYTES,
        "arrays": N_ARRAYS,
        "runs": args.runs,
        "settle_s": args.settle,
        "checkpoints": {fmt: os.path.relpath(p, REPO) for fmt, p in big.items()},
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


def _gibps(r: dict) -> str:
    return f"{NBYTES / 2**30 / r['best_s']:.2f}" if r.get("best_s") else "-"


def _fmt_value(q: dict) -> str:
    if q["value"] is None:
        return "n/a"
    return f"{q['value']:.0f} MiB" if q["what"] == "ckpt_rss_mib" else f"{q['value']:.2f}x"


_WHAT = {
    "baseline/ckpt": "{other} / ckpt",
    "ckpt/cp": "ckpt / cp -r",
    "ckpt_rss_mib": "ckpt peak RSS",
    "ckpt/cp-fsync": "ckpt / (cp -r + fsync)",
    "extra/ckpt": "{other} / ckpt",
    "ckpt/cp-b2b": "ckpt / cp -r, both back to back",
}


def print_load(report: dict) -> None:
    load = report["machine"]["loadavg_1min"]
    parts = [f"{k.replace('before_', 'before ')} {v:.2f}" for k, v in load.items()]
    print(f"1-min load average: {', '.join(parts)} (other work on the machine inflates wall times)")


def print_rows(rows: list[dict], note_if_ok=lambda r: "") -> None:
    """The results table: one line per command, its check errors below it."""
    w = max(len(r["command"]) for r in rows)
    print(f"  {'command':<{w}}  {'best wall':>10}  {'cpu':>8}  {'peak RSS':>9}  {'GiB/s':>6}  {'load':>5}  status")
    for r in rows:
        status = ("ok" + note_if_ok(r)) if r["ok"] else ("FAILED: " + (r["error"] or r["check_errors"][0]))
        print(f"  {r['command']:<{w}}  {ib._fmt_s(r['best_s']):>10}  {ib._fmt_s(r.get('best_cpu_s')):>8}  "
              f"{ib._fmt_mib(r['peak_rss_kib']):>9}  {_gibps(r):>6}  {r['loadavg_1min_before']:>5.2f}  {status}")
        for line in (r["check_errors"][1:] if not r["error"] else r["check_errors"]):
            print(f"  {'':<{w}}  {line}")


def print_target(head: str, q: dict) -> None:
    """One target line: the value, the target and whether it was met."""
    if q["value"] is None:
        print(f"{head}: n/a (a command failed or its output was wrong)   TARGET NOT MEASURED")
        return
    unit = " MiB" if q["what"] == "ckpt_rss_mib" else "x"
    verdict = "TARGET MET" if q["met"] else "TARGET MISSED"
    print(f"{head} = {_fmt_value(q)} (target {q['op']} {q['target']:.0f}{unit})   {verdict}")


def _print_report(report: dict) -> None:
    print()
    timed = f"best of {report['runs']} runs after 1 warm-up" if report["results"] else "profile only"
    settle = (f"sync + {report['settle_s']:g} s pause before each timed run (back to back where marked)"
              if report.get("settle_s") else "back to back")
    print(f"convert bench: {report['arrays']} float32 arrays, {report['bytes'] / 2**30:.0f} GiB, each direction; "
          f"{timed}, {report['machine']['cpus']} cpus, warm page cache for SRC; {settle}")
    print_load(report)
    for direction in ("orbax->dcp", "dcp->orbax"):
        rows = [r for r in report["results"] if r["direction"] == direction]
        if not rows:
            continue
        src = report["checkpoints"][direction.split("->")[0]]
        print()
        print(f"{direction.replace('->', ' -> ')}  (SRC {src})")
        print_rows(rows, lambda r: f" (diff --values: same, {r['diff']['wall_s']:.1f}s)" if r.get("diff") else "")
        print()
        for q in report["targets"]:
            if q["direction"] == direction:
                what = _WHAT[q["what"]].format(other=q["other"])
                print_target(f"  {what} (--workers {q['workers']})", q)
        for w in WORKER_VARIANTS:
            extras = [q for q in report["info"] if q["direction"] == direction and q["workers"] == w]
            if extras:
                print(f"  no target, --workers {w}: " + "; ".join(
                    f"{_WHAT[q['what']].format(other=q['other'])} {_fmt_value(q)}" for q in extras))
    if report.get("profiles"):
        _print_profiles(report["profiles"])
    print()


def _print_profiles(profiles: list[dict]) -> None:
    for p in profiles:
        print()
        head = f"profile: ckpt convert {p['direction']} in-process, --workers {p.get('workers')}, {p['mode']}"
        if p.get("error"):
            print(f"{head}: FAILED: {p['error']}")
            continue
        print(f"{head}: import {p['import_s']:.2f}s, convert {ib._fmt_s(p.get('convert_s'))}, "
              f"process cpu user {p['cpu_user_s']:.2f}s sys {p['cpu_sys_s']:.2f}s, {p['minor_faults']} minor faults, "
              f"ru_maxrss {ib._fmt_mib(p['ru_maxrss_kib'])} (after import {ib._fmt_mib(p['rss_after_import_kib'])})")
        if p["mode"] == "phases":
            for ph in p["phases"]:
                rss = p["rss_peak_by_phase_kib"].get(ph["phase"])
                print(f"    {ph['phase']:<34} {ph['s']:7.3f}s   peak RSS {ib._fmt_mib(rss)}")
            print(f"    {'(rest of convert)':<34} {p['other_s']:7.3f}s")
            print("    thread-seconds (summed over the copy threads; can exceed the wall time):")
            for t in p["timed"]:
                print(f"      {t['what']:<52} {t['thread_s']:8.3f}s  {t['calls']:5d} calls")
        elif p["mode"] in ("read-only", "write-only"):
            print("    " + ("the writer dropped every chunk: the cost of reading and decoding the source"
                            if p["mode"] == "read-only" else
                            "every chunk came from one cached array: the cost of encoding and writing the output"))
        elif p["mode"] == "cprofile":
            print(f"    (all {p['threads_profiled']} threads merged; times summed over threads)")
            for line in p["top_tottime"].rstrip().splitlines():
                print("    " + line)
        else:
            print(f"    tracemalloc peak (Python + numpy buffers) {ib._fmt_mib(p['traced_peak_kib'])}; at the "
                  f"largest snapshot {ib._fmt_mib(p.get('snapshot_traced_kib'))} traced, RSS {ib._fmt_mib(p.get('rss_at_snapshot_kib'))}")
            for s in p.get("top_sites", [])[:10]:
                print(f"      {ib._fmt_mib(s['kib']):>9} in {s['blocks']:6d} blocks  {s['site']}")


if __name__ == "__main__":
    sys.exit(main())


def summary_rows(doc: dict, bench: str = "convert") -> list[dict]:
    """This bench's rows for run_all's overall table: per direction, on the default --workers, one row
    against the restore-then-save baseline and one against `cp -r`; the RSS target goes with both.

    The no-target figures ("info": other --workers, back to back, cp + fsync) stay in the bench's own table.
    safetensors_bench, whose JSON has the same form, uses this too.
    """
    by = {r["name"]: r for r in doc.get("results", [])}
    rss_q = {q["ckpt"]: q for q in doc.get("targets", []) if q["what"] == "ckpt_rss_mib"}
    rows = []
    for q in doc.get("targets", []):
        if q["what"] == "ckpt_rss_mib":
            continue
        a, b = by.get(q["ckpt"], {}), by.get(q["other"], {})
        r = rss_q.get(q["ckpt"], {})
        against = "baseline/ckpt" if q["what"] == "baseline/ckpt" else "ckpt/cp"
        rows.append({
            "bench": bench, "case": f"{q['direction'].replace('->', ' -> ')}, {doc.get('bytes', 0) / 2**30:.0f} GiB",
            "ckpt_s": a.get("best_s"), "baseline": b.get("command", q["other"]), "baseline_s": b.get("best_s"),
            "ratio": q["value"], "target": f"{against} {q['op']} {q['target']:g}x", "met": q["met"],
            "rss_mib": r.get("value"),
            "rss_target": f"<= {r['target']:g} MiB" if r.get("target") else None, "rss_met": r.get("met"),
            "error": a.get("error") or b.get("error") or "; ".join(a.get("check_errors", []) + b.get("check_errors", [])),
        })
    return rows
