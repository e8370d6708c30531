#!/usr/bin/env python3
"""How ckpt's time and memory grow with each axis of a checkpoint's size (issue 23), measured.

    python bench/scale_bench.py [--full] [--axis leaves|files|bytes|processes ...] [--json] [--regen] [--runs N]

Each axis on its own, its checkpoints generated once into bench/out/scale/ (git-ignored) and reused:

  leaves     N small leaves (float32[64] each, 100 per group): Orbax written by orbax's StandardCheckpointer
             and a DCP twin by dcp.save (same values); inspect, validate, validate --deep, convert --to
             safetensors, diff ORBAX DCP --values. Quick: 1k, 3k, 10k; --full: 1k, 10k, 100k.
  files      a DCP of 512 MiB (16 float32 (4096, 2048) tensors, row-sharded) laid out as N ranks write it:
             torch's DefaultSavePlanner and FileSystemWriter driven rank by rank in one process (each rank
             presents its rows as a DTensor shard does: DCP's __create_write_items__ protocol), so every
             rank writes its own __R_0.distcp and the coordinator the one .metadata, as in a real N-rank
             save; inspect, validate, validate --deep, convert --to safetensors. Quick: 8, 32, 64; --full:
             8, 64, 512. And the same commands on an Orbax save of that DCP by N processes (N OCDBT
             process databases merged under the root), written by ckpt's multi-process writer as N live
             processes over gloo. Quick: 2, 4, 8; --full: 8, 32 (each writer process peaks at ~350 MiB
             with torch loaded: 64 of them would need 22 GiB, more than this machine has free).
  bytes      G GiB in (8192, 8192) float32 arrays: written as 1 GiB safetensors shards by the safetensors
             library, then made an Orbax checkpoint by `ckpt convert --to orbax` (ckpt's own writer: orbax
             itself must hold the whole tree in memory, which the largest size does not fit); convert --to
             dcp, validate --deep and reshard --mesh data=2,model=4, all at --memory 512MiB, against
             `cp -r` + sync of the same bytes. The page cache is dropped before every timed run where the
             OS allows (root: /proc/sys/vm/drop_caches; the table says which). Quick: 0.5, 1, 2 GiB;
             --full: 2, 8, 25 GiB (25 GiB, 26.8 GB, is larger than this machine's 24.7 GB of memory; 32 GiB
             and its output do not fit its disk).
  processes  convert --to dcp and reshard of the bytes axis' 1 GiB checkpoint by 1, 2 and 4 local
             processes (--coordinator / --num-processes / --process-id), on local disk; and convert of
             the same save read from the S3 test server (moto on 127.0.0.1, one Python process: its
             own speed bounds what more processes can gain).

For each command and size: wall time (best of --runs), peak RSS of the process (of the largest one for
several), CPU time, and the bytes it read and wrote (/proc/PID/io: rchar/wchar, page cache included).
Per axis and command, the fitted growth (of CPU time on the leaves and files axes, which a shared
machine's other processes do not inflate; of wall time on bytes and processes): the least-squares time and RSS per unit (leaf / file / GiB /
process) and `growth`: (t_largest / t_smallest) / (size_largest / size_smallest), the time's growth
against proportional (<= 1.5 is "linear within 1.5x"; below 1 where a fixed start-up cost dominates the
small sizes), plus the marginal growth: the last step's time per unit over the first step's (a
superlinear cost shows there even when start-up hides it in `growth`). Targets (issue 23):

  time linear within 1.5x of proportional (marginal growth <= 1.5) on every axis;
  inspect of the largest leaves size <= 2 s (100k at --full) and <= 300 MiB;
  memory at most ~2 KiB per leaf; peak within --memory + 128 MiB at every bytes size;
  convert within 1.5x of cp -r + sync at every bytes size;
  2 processes >= 1.6x one (where the machine has the cores: this one has 2).

A PNG per axis (time and peak RSS against size, log-log) is written to bench/out/scale/<axis>.png with
matplotlib when it is installed (`make bench` installs it). Exit 0 when every command ran.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import inspect_bench as ib  # noqa: E402

REPO = ib.REPO
OUT = os.path.join(ib.OUT, "scale")
TMP = os.path.join(OUT, "tmp")
MIB = 2**20
GIB = 2**30
MEMORY = "512MiB"
RSS_BOUND_MIB = 512 + 128
CACHE_VERSION = 1
RUN_TIMEOUT_S = 3600
GEN_TIMEOUT_S = 7200

SIZES = {
    "leaves": {"quick": [1_000, 3_000, 10_000], "full": [1_000, 10_000, 100_000]},
    "files": {"quick": [8, 32, 64], "full": [8, 64, 512]},
    "bytes": {"quick": [0.5, 1, 2], "full": [2, 8, 25]},
    "processes": {"quick": [1, 2, 4], "full": [1, 2, 4]},
}
UNIT = {"leaves": "leaf", "files": "file", "bytes": "GiB", "processes": "process"}
# the files axis' Orbax saves: n process databases, each written by one of n live processes
ORBAX_PROCESS_DBS = {"quick": [2, 4, 8], "full": [8, 32]}

# ---------------------------------------------------------------------------------------------
# generators (children of the test venv's python: they import orbax, torch, safetensors)
# ---------------------------------------------------------------------------------------------

# argv: fmt n out. Leaf j of group g is float32[64] drawn from seed (g, j): both formats get the same values
GEN_LEAVES = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np
fmt, n, out = sys.argv[1], int(sys.argv[2]), os.path.abspath(sys.argv[3])
tree = {}
for i in range(n):
    tree.setdefault(f"g{i // 100}", {})[f"p{i % 100}"] = np.random.default_rng(i).standard_normal(64).astype(np.float32)
if fmt == "orbax":
    import orbax.checkpoint as ocp
    ck = ocp.StandardCheckpointer(); ck.save(out, tree); ck.wait_until_finished(); ck.close()
else:
    import torch, torch.distributed.checkpoint as dcp
    dcp.save({g: {k: torch.from_numpy(v) for k, v in d.items()} for g, d in tree.items()}, checkpoint_id=out)
"""

# argv: ranks out. One process lays a DCP save out as `ranks` ranks do (see the module docstring)
GEN_RANKS = r"""
import sys, warnings
warnings.filterwarnings("ignore")
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

class RankShard:
    # this rank's rows of a tensor, presented to DCP's planner as a DTensor shard presents itself
    def __init__(self, local, offsets, size):
        self.local, self.offsets, self.size = local, torch.Size(offsets), torch.Size(size)
    def __create_write_items__(self, fqn, obj):
        chunk = ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.size())
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.size))]
    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.size())]

class RankPlanner(DefaultSavePlanner):
    # DCP's default planner; a shard is looked up as this rank's own rows (a RankShard is no torch.Tensor)
    def lookup_object(self, index):
        return self.state_dict[index.fqn].local

ranks, out = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(7)
full = {f"layers.{i}.weight": torch.randn(4096, 2048, generator=g) for i in range(16)}
per = 4096 // ranks
plans, planners, writers = [], [], []
for r in range(ranks):  # dcp.save's local step, on every rank
    sd = {k: RankShard(v[r * per:(r + 1) * per], (r * per, 0), v.shape) for k, v in full.items()}
    planner, writer = RankPlanner(), FileSystemWriter(out, thread_count=1)
    planner.set_up_planner(state_dict=sd, storage_meta=writer.storage_meta(), is_coordinator=r == 0)
    writer.set_up_storage_writer(r == 0, rank=r)
    plans.append(writer.prepare_local_plan(planner.create_local_plan()))
    planners.append(planner)
    writers.append(writer)
plans, metadata = planners[0].create_global_plan(plans)  # the coordinator's global step
plans = writers[0].prepare_global_plan(plans)
results = []
for r in range(ranks):  # every rank writes its own file
    fut = writers[r].write_data(planners[r].finish_plan(plans[r]), planners[r])
    fut.wait()
    results.append(fut.value())
writers[0].finish(metadata=metadata, results=results)  # the coordinator writes .metadata last
"""

# argv: gib out. 1 GiB safetensors shards of four (8192, 8192) float32 arrays + the HF index
GEN_BYTES = r"""
import json, os, sys
import numpy as np
from safetensors.numpy import save_file
gib, out = float(sys.argv[1]), sys.argv[2]
os.makedirs(out)
n_arrays = round(gib * 4)
shards = [list(range(s, min(n_arrays, s + 4))) for s in range(0, n_arrays, 4)]
weight_map, total = {}, 0
for k, ids in enumerate(shards):
    name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    tensors = {f"layers.{i}.weight": np.random.default_rng(i).standard_normal((8192, 8192), dtype=np.float32) for i in ids}
    save_file(tensors, os.path.join(out, name))
    for key, v in tensors.items():
        weight_map[key] = name
        total += v.nbytes
    del tensors
with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
"""


def _py() -> str:
    return sys.executable


def _ckpt(*args: str) -> list[str]:
    return [_py(), "-m", "ckpt_tool", *args]


def _stamp_ok(path: str, key: str) -> bool:
    try:
        with open(os.path.join(path, ".scale-stamp")) as f:
            return f.read() == f"{CACHE_VERSION}:{key}"
    except OSError:
        return False


def _stamp(path: str, key: str) -> None:
    # beside the checkpoint's files: ckpt's validate sees it as a stray file, so it lives one level up
    with open(os.path.join(path, ".scale-stamp"), "w") as f:
        f.write(f"{CACHE_VERSION}:{key}")


def _generated(name: str, key: str, build, regen: bool, log) -> str:
    """bench/out/scale/<name>/ckpt, built by build(path) unless a stamp says it is current."""
    home = os.path.join(OUT, name)
    path = os.path.join(home, "ckpt")
    if not regen and _stamp_ok(home, key) and os.path.exists(path):
        return path
    shutil.rmtree(home, ignore_errors=True)
    os.makedirs(home)
    log(f"generating {name} ...")
    t0 = time.perf_counter()
    build(path)
    log(f"  {name}: {time.perf_counter() - t0:.1f} s")
    _stamp(home, key)
    return path


def _run_gen(argv: list[str]) -> None:
    proc = subprocess.run(argv, env=ib._gen_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=GEN_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def gen_leaves(n: int, regen: bool, log) -> dict[str, str]:
    return {fmt: _generated(f"leaves_{fmt}_{n}", f"{fmt}:{n}",
                            lambda p, fmt=fmt: _run_gen([_py(), "-c", GEN_LEAVES, fmt, str(n), p]), regen, log)
            for fmt in ("orbax", "dcp")}


def gen_ranks(n: int, regen: bool, log) -> str:
    return _generated(f"files_dcp_{n}", f"dcp:{n}", lambda p: _run_gen([_py(), "-c", GEN_RANKS, str(n), p]),
                      regen, log)


def gen_orbax_processes(n: int, regen: bool, log) -> str:
    """An Orbax save by n processes (n OCDBT process databases merged under the root, as orbax's
    multi-process save leaves them), written by ckpt's own multi-process writer from the n-rank DCP:
    n real processes coordinated over torch's gloo (jax would need n * ~300 MB of memory)."""
    def build(path: str) -> None:
        src = gen_ranks(n, regen, log)
        port = ib.free_port()
        argvs = [_ckpt("convert", src, path, "--to", "orbax", "--coordinator", f"127.0.0.1:{port}",
                       "--num-processes", str(n), "--process-id", str(i)) for i in range(n)]
        r = run_group(argvs, {**ib._run_env(), "CKPT_DISTRIBUTED": "torch"})
        if any(r["rcs"]):
            raise RuntimeError(f"{n}-process convert --to orbax failed: {r['tail']}")
    return _generated(f"files_orbax_{n}", f"orbax-processes:{n}", build, regen, log)


def gen_bytes(gib: float, regen: bool, log) -> str:
    def build(path: str) -> None:
        st = path + ".safetensors-src"
        _run_gen([_py(), "-c", GEN_BYTES, str(gib), st])
        _run_gen(_ckpt("convert", st, path, "--to", "orbax", "--memory", MEMORY))
        shutil.rmtree(st)  # the disk holds the Orbax copy only: the largest size is 25 GiB
    return _generated(f"bytes_{gib:g}gib", f"bytes:{gib}", build, regen, log)


# ---------------------------------------------------------------------------------------------
# running and measuring
# ---------------------------------------------------------------------------------------------

def _proc_io(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}
    except (OSError, ValueError):
        return {}


def run_group(argvs: list[list[str]], env: dict | None = None) -> dict:
    """Run the argvs at once (one per process of a multi-process run; usually one): wall time until the
    last exits, the largest peak RSS, the summed CPU time and bytes read / written, every exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        procs, errs = [], []
        for i, argv in enumerate(argvs):
            err = open(os.path.join(tmp, f"err{i}"), "w+b")
            errs.append(err)
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                          env=env or ib._run_env(), cwd=REPO))
        timers = [threading.Timer(RUN_TIMEOUT_S, p.kill) for p in procs]
        for t in timers:
            t.start()
        rss = cpu = rchar = wchar = 0
        rcs = []
        try:
            for p in procs:
                # wait without reaping, read the exited process's I/O counters, then reap it for its rusage
                os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
                io = _proc_io(p.pid)
                _, status, usage = os.wait4(p.pid, 0)
                p.returncode = os.waitstatus_to_exitcode(status)
                rcs.append(p.returncode)
                rss = max(rss, usage.ru_maxrss)
                cpu += usage.ru_utime + usage.ru_stime
                rchar += io.get("rchar", 0)
                wchar += io.get("wchar", 0)
        finally:
            for t in timers:
                t.cancel()
        wall = time.perf_counter() - t0
        tail = ""
        for err, rc in zip(errs, rcs):
            if rc != 0:
                err.seek(0)
                tail = (err.read().decode("utf-8", "replace").strip().splitlines() or ["(no stderr)"])[-1]
            err.close()
    return {"wall": wall, "rss_kib": rss, "cpu": cpu, "read": rchar, "written": wchar, "rcs": rcs, "tail": tail}


def drop_page_cache() -> bool:
    """Drop the page cache (clean pages only, after a sync); False where the OS does not allow it."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def measure(axis: str, command: str, size: float, argvs: list[list[str]], runs: int, *, cold: bool = False,
            outputs: tuple[str, ...] = (), warm: tuple[str, ...] = (), env: dict | None = None) -> dict:
    """One command at one size: a warm-up run (not for a cold run: the cache is dropped before each, so
    a warm-up would only double the largest sizes' minutes), then `runs` timed runs; the best wall
    time, the peak RSS."""
    row = {"axis": axis, "command": command, "size": size, "ok": True, "error": None, "runs_s": [],
           "best_s": None, "rss_mib": None, "cpu_s": None, "read_mib": None, "written_mib": None,
           "cache": "cold" if cold else "warm", "loadavg_before": round(os.getloadavg()[0], 2)}
    warmup = 0 if cold else 1
    for i in range(max(1, runs + warmup)):
        for out in outputs:
            shutil.rmtree(out, ignore_errors=True)
        if cold:
            if not drop_page_cache():
                row["cache"] = "warm (the page cache could not be dropped)"
        else:
            for path in warm:
                ib.warm_page_cache(path)
        r = run_group(argvs, env)
        failed = [rc for rc in r["rcs"] if rc != 0]
        if failed and not (command.startswith("diff") and all(rc == 1 for rc in failed)):
            row.update(ok=False, error=f"exit {failed[0]}: {r['tail']}")
            break
        if i < warmup and runs > 0:
            continue  # the warm-up: imports compiled, the file system's metadata cached
        row["runs_s"].append(round(r["wall"], 3))
        if row["best_s"] is None or r["wall"] < row["best_s"]:
            row.update(best_s=round(r["wall"], 3), cpu_s=round(r["cpu"], 2), read_mib=round(r["read"] / MIB, 1),
                       written_mib=round(r["written"] / MIB, 1))
        row["rss_mib"] = max(row["rss_mib"] or 0, round(r["rss_kib"] / 1024, 1))
    for out in outputs:
        shutil.rmtree(out, ignore_errors=True)
    return row


def _tmp(name: str) -> str:
    os.makedirs(TMP, exist_ok=True)
    return os.path.join(TMP, name)


def _read_rows(axis: str, fmt: str, n: int, path: str, out: str, runs: int, log) -> list[dict]:
    """inspect, validate, validate --deep and convert --to safetensors of one checkpoint, warm."""
    rows = []
    for command, argv, outputs in (
        ("inspect", _ckpt("inspect", path, "--json"), ()),
        ("validate", _ckpt("validate", path, "--json"), ()),
        ("validate --deep", _ckpt("validate", "--deep", path, "--json"), ()),
        ("convert --to safetensors", _ckpt("convert", path, out, "--to", "safetensors", "--json"), (out,)),
    ):
        log(f"{axis} {n}: {fmt} {command}")
        rows.append(measure(axis, f"{fmt} {command}", n, [argv], runs, outputs=outputs, warm=(path,)))
    return rows


def bench_leaves(sizes: list[int], runs: int, regen: bool, log) -> list[dict]:
    rows = []
    for n in sizes:
        src = gen_leaves(n, regen, log)
        for fmt, path in src.items():
            rows += _read_rows("leaves", fmt, n, path, _tmp(f"leaves-{fmt}-st"), runs, log)
        log(f"leaves {n}: diff orbax dcp --values")
        rows.append(measure("leaves", "diff --values (orbax vs dcp)", n,
                            [_ckpt("diff", src["orbax"], src["dcp"], "--values", "--json")], runs,
                            warm=tuple(src.values())))
    return rows


def bench_files(sizes: list[int], runs: int, regen: bool, log) -> list[dict]:
    rows = []
    for n in sizes:
        rows += _read_rows("files", "dcp", n, gen_ranks(n, regen, log), _tmp("files-st"), runs, log)
    full = sizes == SIZES["files"]["full"]
    for n in ORBAX_PROCESS_DBS["full" if full else "quick"]:
        rows += _read_rows("files", "orbax", n, gen_orbax_processes(n, regen, log), _tmp("files-orbax-st"), runs, log)
    return rows


def bench_bytes(sizes: list[float], runs: int, regen: bool, log) -> list[dict]:
    rows = []
    for gib in sizes:
        path = gen_bytes(gib, regen, log)
        out = _tmp("bytes-out")
        for command, argv in (
            ("convert --to dcp", _ckpt("convert", path, out, "--to", "dcp", "--memory", MEMORY, "--json")),
            ("cp -r + sync", ["bash", "-c", 'cp -r -- "$1" "$2" && find "$2" -type f -exec sync -- {} +', "cp",
                              path, out]),
            ("validate --deep", _ckpt("validate", "--deep", path, "--memory", MEMORY, "--json")),
            ("reshard --mesh data=2,model=4", _ckpt("reshard", path, out, "--mesh", "data=2,model=4", "--devices",
                                                     "8", "--memory", MEMORY, "--json")),
        ):
            log(f"bytes {gib:g} GiB: {command} (cold cache)")
            rows.append(measure("bytes", command, gib, [argv], runs, cold=True, outputs=(out,)))
    return rows


def bench_processes(sizes: list[int], runs: int, regen: bool, log) -> list[dict]:
    rows = []
    path = gen_bytes(1, regen, log)
    out = _tmp("procs-out")
    for n in sizes:
        for command, args in (
            ("convert --to dcp", ["convert", path, out, "--to", "dcp", "--memory", MEMORY]),
            ("reshard --mesh data=2,model=4", ["reshard", path, out, "--mesh", "data=2,model=4", "--devices", "8",
                                               "--memory", MEMORY]),
        ):
            port = ib.free_port()
            argvs = [_ckpt(*args) if n == 1 else
                     _ckpt(*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                           "--process-id", str(i)) for i in range(n)]
            log(f"processes {n}: {command}")
            rows.append(measure("processes", command, n, argvs, runs, outputs=(out,), warm=(path,)))
    rows += _processes_from_s3(path, sizes, runs, log)
    return rows


S3_BUCKET = "scale-bench"


def _processes_from_s3(path: str, sizes: list[int], runs: int, log) -> list[dict]:
    """convert --to dcp of the same save read from the S3 test server (moto on 127.0.0.1, as the tests
    start it) by 1, 2, 4 processes: does the read throughput grow with processes?"""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from conftest import moto_s3_serving, s3_client

    rows = []
    out = _tmp("procs-s3-out")
    with moto_s3_serving(S3_BUCKET, []) as s3_env:
        s3 = s3_client(s3_env["AWS_ENDPOINT_URL"])
        files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        log(f"processes: uploading {len(files)} files to the S3 test server ...")
        for f in files:
            s3.upload_file(f, S3_BUCKET, "procs/" + os.path.relpath(f, path))
        env = {**ib._run_env(), **s3_env}
        url = f"s3://{S3_BUCKET}/procs"
        for n in sizes:
            args = ["convert", url, out, "--to", "dcp", "--memory", MEMORY]
            port = ib.free_port()
            argvs = [_ckpt(*args) if n == 1 else
                     _ckpt(*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                           "--process-id", str(i)) for i in range(n)]
            log(f"processes {n}: convert --to dcp from S3")
            rows.append(measure("processes", "convert --to dcp from S3 (moto)", n, argvs, runs, outputs=(out,),
                                env=env))
    return rows


# ---------------------------------------------------------------------------------------------
# fitting, targets, plots
# ---------------------------------------------------------------------------------------------

def _lsq(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def fit(rows: list[dict]) -> list[dict]:
    """Per (axis, command): time and RSS per unit, growth against proportional, the marginal growth."""
    fits = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["ok"] and r["best_s"] is not None:
            groups.setdefault((r["axis"], r["command"]), []).append(r)
    for (axis, command), rs in groups.items():
        rs.sort(key=lambda r: r["size"])
        if len(rs) < 2:
            continue
        # leaves and files: the growth of CPU time, which the other processes of a shared machine do not
        # inflate (these commands are CPU-bound on a warm cache); bytes and processes: wall time (I/O, cores)
        metric = "cpu_s" if axis in ("leaves", "files") else "best_s"
        xs, ts, ms = [r["size"] for r in rs], [r[metric] for r in rs], [r["rss_mib"] for r in rs]
        t_slope, t_icpt = _lsq(xs, ts)
        m_slope, _ = _lsq(xs, ms)
        growth = (ts[-1] / ts[0]) / (xs[-1] / xs[0])
        first = (ts[1] - ts[0]) / (xs[1] - xs[0])
        last = (ts[-1] - ts[-2]) / (xs[-1] - xs[-2])
        # the marginal growth needs a first step that costs something: with a flat or falling start (the
        # fixed cost dominating, or noise) the ratio says nothing
        marginal = last / first if len(rs) >= 3 and first > 0.02 * ts[0] / xs[0] else None
        fits.append({"axis": axis, "command": command, "metric": metric, "sizes": xs, "times_s": ts, "rss_mib": ms,
                     "time_per_unit_s": t_slope, "time_fixed_s": t_icpt, "rss_per_unit_mib": m_slope,
                     "growth": round(growth, 3), "marginal_growth": None if marginal is None else round(marginal, 3)})
    return fits


def targets(rows: list[dict], fits: list[dict], full: bool) -> list[dict]:
    out = []

    def add(case: str, value: float | None, target: float, op: str, unit: str = "", rss: float | None = None,
            ckpt_s: float | None = None) -> None:
        met = None if value is None else (value >= target if op == ">=" else value <= target)
        out.append({"case": case, "value": value, "target": target, "op": op, "unit": unit, "met": met,
                    "rss_mib": rss, "ckpt_s": ckpt_s})

    for f in fits:
        if f["axis"] == "processes" or f["command"].startswith("cp "):
            continue
        if f["marginal_growth"] is not None:
            add(f"{f['axis']}: {f['command']}: marginal time growth, {f['sizes'][0]:g}->{f['sizes'][-1]:g}",
                f["marginal_growth"], 1.5, "<=", "x")
        if f["axis"] == "leaves":
            add(f"leaves: {f['command']}: RSS per leaf", round(f["rss_per_unit_mib"] * 1024, 3), 2.0, "<=", " KiB")
    by = {(r["axis"], r["command"], r["size"]): r for r in rows}
    largest = max((r["size"] for r in rows if r["axis"] == "leaves"), default=None)
    for fmt in ("orbax", "dcp"):
        r = by.get(("leaves", f"{fmt} inspect", largest))
        if r:
            add(f"leaves: {fmt} inspect of {largest:,} leaves: wall", r["best_s"] if r["ok"] else None, 2.0, "<=",
                " s", r["rss_mib"], r["best_s"])
            add(f"leaves: {fmt} inspect of {largest:,} leaves: peak RSS", r["rss_mib"] if r["ok"] else None, 300,
                "<=", " MiB")
    for r in rows:
        if r["axis"] == "bytes" and not r["command"].startswith("cp "):
            add(f"bytes {r['size']:g} GiB: {r['command']}: peak RSS", r["rss_mib"] if r["ok"] else None,
                RSS_BOUND_MIB, "<=", " MiB")
        if r["axis"] == "bytes" and r["command"] == "convert --to dcp":
            cp = by.get(("bytes", "cp -r + sync", r["size"]))
            ratio = round(r["best_s"] / cp["best_s"], 2) if r["ok"] and cp and cp["ok"] and cp["best_s"] else None
            add(f"bytes {r['size']:g} GiB: convert / (cp -r + sync)", ratio, 1.5, "<=", "x", r["rss_mib"],
                r["best_s"])
    # local disk: 1.6x with 2 processes where the cores are there; S3: throughput that grows at all
    for command, target in (("convert --to dcp", 1.6), ("reshard --mesh data=2,model=4", 1.6),
                            ("convert --to dcp from S3 (moto)", 1.0)):
        one, two = by.get(("processes", command, 1)), by.get(("processes", command, 2))
        if one and two:
            ratio = round(one["best_s"] / two["best_s"], 2) if one["ok"] and two["ok"] else None
            add(f"processes: {command}: 1 process / 2 processes", ratio, target, ">=", "x", two["rss_mib"],
                two["best_s"])
    return out


def plot(rows: list[dict], log) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (make bench installs it)")
        return []
    written = []
    for axis in SIZES:
        rs = [r for r in rows if r["axis"] == axis and r["ok"] and r["best_s"] is not None]
        if not rs:
            continue
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
        for command in sorted({r["command"] for r in rs}):
            pts = sorted((r["size"], r["best_s"], r["rss_mib"]) for r in rs if r["command"] == command)
            xs = [p[0] for p in pts]
            ax_t.plot(xs, [p[1] for p in pts], marker="o", label=command)
            ax_m.plot(xs, [p[2] for p in pts], marker="o", label=command)
        for ax, what in ((ax_t, "wall time (s)"), (ax_m, "peak RSS (MiB)")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel({"leaves": "leaves", "files": "files (ranks)", "bytes": "GiB", "processes": "processes"}[axis])
            ax.set_ylabel(what)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=7)
        fig.suptitle(f"ckpt scale: {axis} ({os.cpu_count()} cores, "
                     f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB)")
        fig.tight_layout()
        path = os.path.join(OUT, f"{axis}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------

def _size(axis: str, size: float) -> str:
    return f"{size:g} GiB" if axis == "bytes" else f"{size:,.0f}"


def _print_report(doc: dict) -> None:
    print(f"scale bench ({doc['mode']}; {doc['machine']}); page cache: {doc['cache_note']}")
    print()
    print("| axis | size | command | wall | peak RSS | CPU | read | written | cache |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in doc["results"]:
        wall = f"{r['best_s']:.2f} s" if r["best_s"] is not None else f"FAILED: {r['error']}"
        rss = f"{r['rss_mib']:.0f} MiB" if r["rss_mib"] else "-"
        cpu = f"{r['cpu_s']:.2f} s" if r["cpu_s"] is not None else "-"
        rd = f"{r['read_mib']:,.0f} MiB" if r["read_mib"] is not None else "-"
        wr = f"{r['written_mib']:,.0f} MiB" if r["written_mib"] is not None else "-"
        print(f"| {r['axis']} | {_size(r['axis'], r['size'])} | {r['command']} | {wall} | {rss} | {cpu} | {rd} | "
              f"{wr} | {r['cache']} |")
    print()
    print("| axis | command | time | time per unit | fixed | RSS per unit | growth | marginal growth |")
    print("|---|---|---|---|---|---|---|---|")
    for f in doc["fits"]:
        unit = UNIT[f["axis"]]
        marginal = "-" if f["marginal_growth"] is None else f"{f['marginal_growth']:.2f}"
        what = "CPU" if f["metric"] == "cpu_s" else "wall"
        print(f"| {f['axis']} | {f['command']} | {what} | {f['time_per_unit_s'] * 1e3:.4g} ms/{unit} | "
              f"{f['time_fixed_s']:.2f} s | {f['rss_per_unit_mib'] * 1024:.4g} KiB/{unit} | {f['growth']:.2f} | "
              f"{marginal} |")
    print()
    print("| target | value | met |")
    print("|---|---|---|")
    for q in doc["targets"]:
        value = "-" if q["value"] is None else f"{q['value']:g}{q['unit']}"
        met = {True: "met", False: "MISSED", None: "not measured"}[q["met"]]
        print(f"| {q['case']} {q['op']} {q['target']:g}{q['unit']} | {value} | {met} |")
    if doc.get("plots"):
        print()
        print("plots: " + ", ".join(os.path.relpath(p, REPO) for p in doc["plots"]))


def summary_rows(doc: dict) -> list[dict]:
    rows = []
    for q in doc.get("targets", []):
        rows.append({"bench": "scale", "case": q["case"], "ckpt_s": q.get("ckpt_s"), "baseline": None,
                     "baseline_s": None, "ratio": q["value"] if q["unit"] == "x" else None,
                     "target": f"{q['op']} {q['target']:g}{q['unit']}", "met": q["met"], "rss_mib": q.get("rss_mib"),
                     "note": None if q["unit"] == "x" else f"{q['value']}{q['unit']}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--full", action="store_true", help="the full sizes (100k leaves, 512 ranks, up to 25 GiB)")
    ap.add_argument("--axis", action="append", choices=list(SIZES), help="only this axis (repeatable)")
    ap.add_argument("--runs", type=int, default=1, help="timed runs per command after one warm-up (default 1)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--regen", action="store_true", help="rebuild the generated checkpoints")
    # run_all passes every bench's options on; these belong to the others
    for other in ("--layers", "--settle"):
        ap.add_argument(other, help=argparse.SUPPRESS)
    for flag in ("--no-extra", "--profile"):
        ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    mode = "full" if args.full else "quick"
    os.makedirs(OUT, exist_ok=True)
    runners = {"leaves": bench_leaves, "files": bench_files, "bytes": bench_bytes, "processes": bench_processes}
    rows: list[dict] = []
    for axis in args.axis or list(SIZES):
        try:
            rows += runners[axis](SIZES[axis][mode], args.runs, args.regen, log)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            log(f"{axis}: FAILED: {exc}")
            rows.append({"axis": axis, "command": "(generation)", "size": 0, "ok": False, "error": str(exc),
                         "best_s": None, "rss_mib": None, "cpu_s": None, "read_mib": None, "written_mib": None,
                         "cache": "-", "runs_s": []})
    shutil.rmtree(TMP, ignore_errors=True)
    fits = fit(rows)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    doc = {"mode": mode, "machine": f"{os.cpu_count()} cores, {mem / GIB:.0f} GiB memory",
           "cache_note": "leaves/files/processes warm (read once before each run); bytes cold (dropped before "
                         "each run) where the cache column says so",
           "results": rows, "fits": fits, "targets": targets(rows, fits, args.full), "plots": plot(rows, log)}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_report(doc)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
