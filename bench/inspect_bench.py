#!/usr/bin/env python3
"""Benchmark `ckpt inspect` against the libraries' own metadata readers.

    python bench/inspect_bench.py [--runs N] [--json] [--regen] [--layers N] [--big-dcp-layers N] [--formats dcp]

Builds (once; cached in bench/out/, rebuilt with --regen) a 3,000-leaf Orbax
checkpoint written by ``ocp.StandardCheckpointer`` (OCDBT + zarr v2, the
defaults) and its torch.distributed.checkpoint twin holding the same tensors,
then times four WHOLE PROCESSES, each cold-started (a fresh interpreter) with
a warm page cache:

  ckpt-orbax      ckpt inspect --json <orbax dir>   (the .venv console script)
  orbax           import orbax.checkpoint; StandardCheckpointer().metadata(dir),
                  then flatten the tree and read every leaf's shape and dtype
  ckpt-dcp        ckpt inspect --json <dcp dir>
  torch-dcp       FileSystemReader(dir).read_metadata(), then read every
                  tensor's size and dtype

plus a DCP of 30,000 small tensors (one dcp.save; --big-dcp-layers, 0 to
skip), timed the same way against torch's reader (ckpt-dcp-big, torch-dcp-big):
its 6 MB .metadata makes the time grow with the pickle, not with start-up.
`--formats dcp` (or orbax) builds and times one format's commands only.

Each command runs once as a warm-up (its output is captured and checked: ckpt
must report exactly the leaves that were saved, and the baselines must see
them too), then N times (default 3) with stdout to /dev/null, in N rounds
that each run all four commands in turn (so a slow stretch of a shared machine
hits ckpt and its baseline alike); the median wall time counts (the best is
reported too). Peak RSS comes from the kernel's rusage for that one child
(os.wait4). The targets (issue 46) are baseline / ckpt >= 10x for both formats
at 3,000 leaves and >= 6x for the 30,000-leaf DCP; the bench prints TARGET MET /
TARGET MISSED but does not fail on a miss.

Exit status: 0 when every command ran and ckpt's output checked out (target
met or not); 1 when a command failed, or ckpt's output was wrong.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.path.join(HERE, "out")
TARGET_RATIO = 10.0
TARGET_RATIO_BIG = 6.0  # the 30,000-leaf DCP, whose time grows with the .metadata pickle (issue 46)
DEVICE_COUNT = 8
GEN_TIMEOUT_S = 900
RUN_TIMEOUT_S = 300
CACHE_VERSION = 1  # bump when the generated trees change

# Leaf recipe per layer: name -> (shape, dtype). 3 leaves per layer.
LEAVES = {"w": ((64, 64), "float32"), "b": ((64,), "float32"), "s": ((64,), "bfloat16")}


def _layer_kind(i: int) -> str:
    """How layer i's arrays are placed in the Orbax tree (the DCP twin is plain tensors).

    named  : jax.Array with a NamedSharding on the 4x2 ('data','model') mesh
    single : jax.Array on one device (SingleDeviceSharding)
    numpy  : a host numpy array (orbax records no sharding)
    """
    return ("named", "named", "single", "numpy")[i % 4]


# partition spec per leaf for "named" layers
NAMED_SPECS = {"w": ("data", "model"), "b": ("model",), "s": (None,)}


# --------------------------------------------------------------------------
# checkpoint generation (runs in a subprocess: --generate orbax|dcp)
# --------------------------------------------------------------------------


def _values(layers: int):
    """Deterministic numpy values shared by both formats: {i: {name: float32 array}}."""
    import numpy as np

    rng = np.random.default_rng(1234)
    return {
        i: {name: rng.standard_normal(shape, dtype=np.float32) for name, (shape, _) in LEAVES.items()}
        for i in range(layers)
    }


def _generate_orbax(path: str, layers: int) -> None:
    import logging

    import jax
    import ml_dtypes
    import numpy as np
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    logging.getLogger("absl").setLevel(logging.ERROR)
    import orbax.checkpoint as ocp

    assert jax.device_count() == DEVICE_COUNT, jax.devices()
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    single = SingleDeviceSharding(jax.devices()[0])
    tree: dict = {"layers": {}}
    for i, leaves in _values(layers).items():
        kind = _layer_kind(i)
        layer = {}
        for name, x in leaves.items():
            if LEAVES[name][1] == "bfloat16":
                x = x.astype(ml_dtypes.bfloat16)
            if kind == "named":
                layer[name] = jax.device_put(x, NamedSharding(mesh, P(*NAMED_SPECS[name])))
            elif kind == "single":
                layer[name] = jax.device_put(x, single)
            else:
                layer[name] = x
        tree["layers"][str(i)] = layer
    ck = ocp.StandardCheckpointer()
    ck.save(path, tree)
    ck.wait_until_finished()
    ck.close()


def _generate_dcp(path: str, layers: int) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state: dict = {"layers": {}}
    for i, leaves in _values(layers).items():
        layer = {}
        for name, x in leaves.items():
            t = torch.from_numpy(x)
            if LEAVES[name][1] == "bfloat16":
                t = t.to(torch.bfloat16)
            layer[name] = t
        state["layers"][str(i)] = layer
    dcp.save(state, checkpoint_id=path)


def _gen_env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICE_COUNT}"
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _dir_stats(path: str) -> tuple[int, int]:
    n = size = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            n += 1
            size += os.path.getsize(os.path.join(root, f))
    return n, size


def is_cached(path: str, version: int) -> bool:
    """A generated checkpoint is reused when its stamp file names the current cache version."""
    stamp = path + ".done.json"
    if not (os.path.isdir(path) and os.path.isfile(stamp)):
        return False
    try:
        with open(stamp) as f:
            return json.load(f).get("cache_version") == version
    except (OSError, ValueError):
        return False


def clear_cached(path: str) -> None:
    """Remove a checkpoint, its stamp and any half-written .tmp before regenerating."""
    for p in (path, path + ".done.json", path + ".tmp"):
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)


def ensure_checkpoints(layers: int, regen: bool, log, big_dcp_layers: int = 0,
                       formats: tuple[str, ...] = ("orbax", "dcp")) -> dict:
    """Build the checkpoints unless cached; return {name: path} ("orbax", "dcp" and, given big_dcp_layers, "dcp_big"),
    of `formats` only."""
    os.makedirs(OUT, exist_ok=True)
    paths = {}
    wanted = [("orbax", "orbax", layers), ("dcp", "dcp", layers)]
    if big_dcp_layers:
        wanted.append(("dcp_big", "dcp", big_dcp_layers))
    wanted = [w for w in wanted if w[1] in formats]
    for key, fmt, layers in wanted:
        path = os.path.join(OUT, f"{fmt}_{layers * len(LEAVES)}")
        stamp = path + ".done.json"
        paths[key] = path
        if not regen and is_cached(path, CACHE_VERSION):
            continue
        clear_cached(path)
        log(f"generating {fmt} checkpoint ({layers * len(LEAVES)} leaves) -> {os.path.relpath(path, REPO)} ...")
        tmp = path + ".tmp"
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--generate", fmt, "--path", tmp, "--layers", str(layers)],
            env=_gen_env(),
            cwd=OUT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=GEN_TIMEOUT_S,
        )
        if proc.returncode != 0 or not os.path.isdir(tmp):
            sys.stderr.write(proc.stdout[-6000:])
            raise SystemExit(f"generating the {fmt} checkpoint failed (exit {proc.returncode})")
        os.rename(tmp, path)
        files, size = _dir_stats(path)
        with open(stamp, "w") as f:
            json.dump(
                {"cache_version": CACHE_VERSION, "layers": layers, "leaves": layers * len(LEAVES),
                 "files": files, "bytes": size, "seconds": round(time.monotonic() - t0, 1)},
                f,
            )
        log(f"  done in {time.monotonic() - t0:.1f}s ({files} files, {size / 2**20:.1f} MiB)")
    return paths


# --------------------------------------------------------------------------
# the timed commands
# --------------------------------------------------------------------------

# Baselines print the number of array leaves they saw (checked on the warm-up run).
ORBAX_BASELINE = r"""
import sys
import orbax.checkpoint as ocp
import jax
md = ocp.StandardCheckpointer().metadata(sys.argv[1])
tree = md.item_metadata.tree
n = 0
for leaf in jax.tree_util.tree_leaves(tree):
    shape, dtype = tuple(leaf.shape), str(leaf.dtype)
    n += 1
print(n)
"""

DCP_BASELINE = r"""
import sys
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
md = FileSystemReader(sys.argv[1]).read_metadata()
n = 0
for fqn, m in md.state_dict_metadata.items():
    if isinstance(m, TensorStorageMetadata):
        shape, dtype = tuple(m.size), str(m.properties.dtype)
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks]
        n += 1
print(n)
"""


def commands(paths: dict) -> list[dict]:
    py = sys.executable
    # the console script users run (python -m adds runpy's imports)
    script = os.path.join(os.path.dirname(py), "ckpt")
    ckpt = ([script] if os.path.exists(script) else [py, "-m", "ckpt_tool"]) + ["inspect", "--json"]
    big = [
        {"name": "ckpt-dcp-big", "format": "dcp", "role": "ckpt", "argv": ckpt + [paths["dcp_big"]],
         "label": "ckpt inspect --json <big dcp>", "big": True},
        {"name": "torch-dcp-big", "format": "dcp", "role": "baseline", "argv": [py, "-c", DCP_BASELINE, paths["dcp_big"]],
         "label": "FileSystemReader().read_metadata() <big>", "big": True},
    ] if "dcp_big" in paths else []
    orbax = [
        {"name": "ckpt-orbax", "format": "orbax", "role": "ckpt", "argv": ckpt + [paths["orbax"]],
         "label": "ckpt inspect --json <orbax>"},
        {"name": "orbax", "format": "orbax", "role": "baseline", "argv": [py, "-c", ORBAX_BASELINE, paths["orbax"]],
         "label": "ocp.StandardCheckpointer().metadata()"},
    ] if "orbax" in paths else []
    dcp = [
        {"name": "ckpt-dcp", "format": "dcp", "role": "ckpt", "argv": ckpt + [paths["dcp"]],
         "label": "ckpt inspect --json <dcp>"},
        {"name": "torch-dcp", "format": "dcp", "role": "baseline", "argv": [py, "-c", DCP_BASELINE, paths["dcp"]],
         "label": "FileSystemReader().read_metadata()"},
    ] if "dcp" in paths else []
    return big + orbax + dcp


def _run_env() -> dict:
    env = _gen_env()  # 8 CPU devices, in case orbax wants the saving topology
    env.pop("CKPT_DEBUG", None)
    # the warm-up run writes the bytecode an installed package has: with PYTHONDONTWRITEBYTECODE
    # set (a development shell), every run would compile each source edited since its .pyc was
    # written (~35 ms of a 0.17 s DCP inspect from a clean clone) and time that, not ckpt
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a coordinator's, for multi-process runs)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(argv: list[str], capture: bool) -> dict:
    """Run argv as a child: wall time, peak RSS (KiB) of that child, exit code, output.

    stdout goes to /dev/null unless `capture` (then to a temporary file);
    stderr always to a temporary file, so no pipe can stall the child.
    """
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out_f if capture else subprocess.DEVNULL,
            stderr=err_f, env=_run_env(), cwd=REPO,
        )
        timer = threading.Timer(RUN_TIMEOUT_S, proc.kill)  # a hung child fails the run, not the bench
        timer.start()
        try:
            # os.wait4 reaps this one child and returns its own rusage (ru_maxrss: KiB on Linux)
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        return {
            "wall": wall,
            "rss_kib": usage.ru_maxrss,
            "cpu": usage.ru_utime + usage.ru_stime,
            "rc": proc.returncode,
            "stdout": out_f.read().decode("utf-8", "replace"),
            "stderr": err_f.read().decode("utf-8", "replace"),
        }


def warm_page_cache(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(1 << 20):
                    pass


# --------------------------------------------------------------------------
# checking the output
# --------------------------------------------------------------------------


def expected_leaves(layers: int) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    return {
        ("layers", str(i), name): (shape, dtype)
        for i in range(layers)
        for name, (shape, dtype) in LEAVES.items()
    }


def _expected_sharding(fmt: str, keys: tuple[str, ...]) -> str | None:
    if fmt != "orbax":
        return None
    return {"named": "named", "single": "single_device", "numpy": None}[_layer_kind(int(keys[1]))]


def check_ckpt_json(fmt: str, text: str, layers: int) -> tuple[list[str], list[str]]:
    """(errors, notes): errors make the bench fail; notes are printed."""
    errors: list[str] = []
    notes: list[str] = []
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return [f"output is not JSON: {exc}"], notes
    want = expected_leaves(layers)
    if doc.get("format") != fmt:
        errors.append(f"format is {doc.get('format')!r}, expected {fmt!r}")
    arrays = [leaf for leaf in doc.get("leaves", []) if leaf.get("kind") == "array"]
    n_summary = doc.get("summary", {}).get("arrays")
    if len(arrays) != len(want):
        errors.append(f"{len(arrays)} array leaves in 'leaves', expected {len(want)}")
    if n_summary != len(want):
        errors.append(f"summary.arrays is {n_summary}, expected {len(want)}")
    others = len(doc.get("leaves", [])) - len(arrays)
    if others:
        errors.append(f"{others} non-array leaves, expected none")
    got = {}
    for leaf in arrays:
        got[tuple(str(k) for k in leaf.get("keys", []))] = (tuple(leaf.get("shape", [])), leaf.get("dtype"))
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if missing:
        errors.append(f"{len(missing)} leaves missing, e.g. {'/'.join(missing[0])}")
    if extra:
        errors.append(f"{len(extra)} unexpected leaves, e.g. {'/'.join(extra[0])}")
    if wrong:
        k = wrong[0]
        errors.append(f"{len(wrong)} leaves with wrong shape/dtype, e.g. {'/'.join(k)}: {got[k]} != {want[k]}")
    # sharding recorded at save time (orbax only): reported, not fatal
    if fmt == "orbax":
        bad = 0
        for leaf in arrays:
            keys = tuple(str(k) for k in leaf.get("keys", []))
            if keys not in want:
                continue
            kind = (leaf.get("sharding") or {}).get("kind")
            if kind != _expected_sharding(fmt, keys):
                bad += 1
        if bad:
            notes.append(f"{bad} orbax leaves report a sharding kind other than the one saved")
    return errors, notes


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def _fmt_mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.0f} MiB"


def _library_versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("ckpt-tool", "jax", "orbax-checkpoint", "torch", "tensorstore", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per command after one warm-up (default 3)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--regen", action="store_true", help="rebuild the cached checkpoints in bench/out/")
    ap.add_argument("--layers", type=int, default=1000, help="layers in the tree, 3 leaves each (default 1000)")
    ap.add_argument("--big-dcp-layers", type=int, default=10000,
                    help="layers of the big DCP (default 10000: 30,000 tensors); 0 skips it")
    ap.add_argument("--formats", choices=("orbax", "dcp"), action="append",
                    help="time this format's commands only (repeatable; default both)")
    ap.add_argument("--generate", choices=("orbax", "dcp"), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runs < 1 or args.layers < 1 or args.big_dcp_layers < 0:
        ap.error("--runs and --layers must be at least 1")

    if args.generate:  # internal: build one checkpoint in this (fresh) process
        (_generate_orbax if args.generate == "orbax" else _generate_dcp)(args.path, args.layers)
        return 0

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    load_at_start = os.getloadavg()[0]  # other work on a 2-core box skews wall times
    formats = tuple(args.formats or ("orbax", "dcp"))
    paths = ensure_checkpoints(args.layers, args.regen, log, args.big_dcp_layers if "dcp" in formats else 0, formats)
    for p in paths.values():
        warm_page_cache(p)
    n_leaves = args.layers * len(LEAVES)
    big_leaves = args.big_dcp_layers * len(LEAVES) if "dcp" in formats else 0

    results = []
    failed = False
    cmds = commands(paths)
    # warm-up and output check, once per command
    for cmd in cmds:
        log(f"checking {cmd['name']} (warm-up run) ...")
        res = dict(name=cmd["name"], format=cmd["format"], role=cmd["role"], command=cmd["label"],
                   ok=True, error=None, best_s=None, median_s=None, runs_s=[], best_cpu_s=None, cpu_s=[], peak_rss_kib=None,
                   check_errors=[], notes=[])
        results.append(res)
        warm = run_once(cmd["argv"], capture=True)
        if warm["rc"] != 0:
            tail = (warm["stderr"].strip().splitlines() or ["(no stderr)"])[-1]
            res.update(ok=False, error=f"exit {warm['rc']}: {tail}")
            failed = True
            continue
        layers, leaves = (args.big_dcp_layers, big_leaves) if cmd.get("big") else (args.layers, n_leaves)
        if cmd["role"] == "ckpt":
            errs, notes = check_ckpt_json(cmd["format"], warm["stdout"], layers)
            res.update(check_errors=errs, notes=notes)
        else:
            seen = warm["stdout"].strip()
            errs = [] if seen == str(leaves) else [f"the baseline saw {seen or 'nothing'} leaves, expected {leaves}"]
            res.update(check_errors=errs)
        if res["check_errors"]:
            res["ok"] = False
            failed = True
    # Timed runs in rounds, each round running every command once: on a
    # shared 2-core VM the speed drifts over tens of seconds, and interleaving
    # lets a slow stretch hit ckpt and its baseline alike.
    rss: dict[str, list] = {r["name"]: [] for r in results}
    for round_no in range(args.runs):
        log(f"round {round_no + 1}/{args.runs} ...")
        for cmd, res in zip(cmds, results):
            if res["error"]:
                continue
            r = run_once(cmd["argv"], capture=False)
            if r["rc"] != 0:
                tail = (r["stderr"].strip().splitlines() or ["(no stderr)"])[-1]
                res.update(ok=False, error=f"exit {r['rc']}: {tail}")
                failed = True
                continue
            res["runs_s"].append(round(r["wall"], 4))
            res["cpu_s"].append(round(r["cpu"], 4))
            rss[res["name"]].append(r["rss_kib"])
    for res in results:
        if res["runs_s"]:
            res["best_s"] = min(res["runs_s"])
            res["median_s"] = round(statistics.median(res["runs_s"]), 4)
            res["best_cpu_s"] = res["cpu_s"][res["runs_s"].index(res["best_s"])]  # of the best run
            seen_rss = [x for x in rss[res["name"]] if x is not None]
            res["peak_rss_kib"] = max(seen_rss) if seen_rss else None

    by_name = {r["name"]: r for r in results}
    ratios = []
    pairs = [pair for pair in (("orbax", "ckpt-orbax", "orbax", n_leaves, TARGET_RATIO),
                               ("dcp", "ckpt-dcp", "torch-dcp", n_leaves, TARGET_RATIO)) if pair[0] in formats]
    if big_leaves:
        pairs.append(("dcp", "ckpt-dcp-big", "torch-dcp-big", big_leaves, TARGET_RATIO_BIG))
    for fmt, ck, base, leaves, target in pairs:
        a, b = by_name[ck], by_name[base]
        # medians of whole processes (issue 46's measure); the best runs' ratio is kept beside
        measured = a["ok"] and b["ok"] and a["median_s"] and b["median_s"]
        ratio = b["median_s"] / a["median_s"] if measured else None
        best = b["best_s"] / a["best_s"] if measured else None
        ratios.append({
            "format": fmt, "baseline": base, "ckpt": ck, "leaves": leaves,
            "ratio": round(ratio, 2) if ratio is not None else None,
            "ratio_of_best": round(best, 2) if best is not None else None,
            "target": target,
            "met": None if ratio is None else ratio >= target,
        })

    report = {
        **report_header("inspect", load_at_start),
        "leaves": n_leaves,
        "runs": args.runs,
        "checkpoints": {fmt: os.path.relpath(p, REPO) for fmt, p in paths.items()},
        "results": results,
        "ratios": ratios,
        "ok": not failed,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 1 if failed else 0


def report_header(bench: str, load_at_start: float, loads: dict[str, float] | None = None) -> dict:
    """The fields every bench's JSON report starts with: what ran, when, on what.

    `loads`: the 1-minute load average before each part of the bench, by name.
    """
    loadavg = {"start": round(load_at_start, 2), **{f"before_{k}": v for k, v in (loads or {}).items()},
               "end": round(os.getloadavg()[0], 2)}
    return {
        "bench": bench,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_1min": loadavg,
        },
        "libraries": _library_versions(),
    }


def _print_table(report: dict) -> None:
    print()
    print(f"inspect bench: {report['leaves']} leaves, median (and best) of {report['runs']} runs after 1 warm-up, "
          f"{report['machine']['cpus']} cpus, warm page cache")
    load = report["machine"]["loadavg_1min"]
    print(f"1-min load average {load['start']:.2f} before the runs (other work on the machine inflates wall times)")
    print()
    w = max(len(r["command"]) for r in report["results"])
    print(f"  {'command':<{w}}  {'median':>8}  {'best wall':>10}  {'cpu':>8}  {'peak RSS':>9}  status")
    for r in report["results"]:
        status = "ok" if r["ok"] else ("FAILED: " + (r["error"] or "; ".join(r["check_errors"])))
        print(f"  {r['command']:<{w}}  {_fmt_s(r.get('median_s')):>8}  {_fmt_s(r['best_s']):>10}  {_fmt_s(r.get('best_cpu_s')):>8}  "
              f"{_fmt_mib(r['peak_rss_kib']):>9}  {status}")
        for note in r["notes"]:
            print(f"  {'':<{w}}  note: {note}")
    print()
    for q in report["ratios"]:
        if q["ratio"] is None:
            print(f"  {q['format']:<5}  {q['baseline']} / {q['ckpt']}: n/a (a command failed or its output was wrong)   TARGET NOT MEASURED")
        else:
            verdict = "TARGET MET" if q["met"] else "TARGET MISSED"
            best = f", best runs {q['ratio_of_best']:.1f}x" if q.get("ratio_of_best") is not None else ""
            print(f"  {q['format']:<5}  {q.get('leaves', report['leaves']):>6,} leaves  {q['baseline']} / {q['ckpt']} = {q['ratio']:.1f}x "
                  f"median{best} (target >= {q['target']:.0f}x)   {verdict}")
    print()


if __name__ == "__main__":
    sys.exit(main())


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table: one per ratio (ckpt vs its library's metadata read)."""
    by = {r["name"]: r for r in doc.get("results", [])}
    rows = []
    for q in doc.get("ratios", []):
        a, b = by.get(q["ckpt"], {}), by.get(q["baseline"], {})
        rss = a.get("peak_rss_kib")
        rows.append({
            "bench": "inspect", "case": f"{q.get('leaves', doc.get('leaves', '?')):,} leaves, {q['format']}",
            # the medians the ratio is of (a document from before they were kept: the best runs)
            "ckpt_s": a.get("median_s") or a.get("best_s"), "baseline": b.get("command", q["baseline"]),
            "baseline_s": b.get("median_s") or b.get("best_s"),
            "ratio": q["ratio"], "target": f"baseline/ckpt >= {q['target']:g}x", "met": q["met"],
            "rss_mib": round(rss / 1024) if rss else None,
            "error": a.get("error") or b.get("error") or "; ".join(a.get("check_errors", []) + b.get("check_errors", [])),
        })
    return rows
