#!/usr/bin/env python3
"""`ckpt inspect` of sharded DCP saves (FSDP/TP-like: several chunks a tensor), now against an older revision and torch.

    .venv/bin/python bench/sharded_dcp_bench.py [--tensors 3000 --tensors 30000] [--ranks 4] [--runs 5]
                                                [--against REV ...] [--regen] [--json]

Builds (once; cached in bench/out/sharded_dcp_<tensors>x<ranks>, rebuilt with --regen)
a DCP written by one `dcp.save` from --ranks gloo processes on 127.0.0.1, each holding
its shard of every tensor as a DTensor (DTensor.from_local on a 1-D CPU mesh: no
collective per tensor). Per layer, five tensors, as a sharded training save holds:

  model.layers.<i>.w            bf16 (10, 8)  Shard(0): uneven (3, 3, 3, 1 rows on 4 ranks)
  model.layers.<i>.b            f32  (8,)     Replicate: one chunk (DCP's dedup keeps one copy)
  optim.state.layers.<i>.w.exp_avg     f32 (10, 8) Shard(0)
  optim.state.layers.<i>.w.exp_avg_sq  f32 (10, 8) Shard(1): (2, 2, 2, 2 columns on 4 ranks)
  optim.state.layers.<i>.w.step        f32 ()     a plain tensor (every rank's copy deduplicated)

plus optim.param_groups (a bytes item). Then times, as WHOLE PROCESSES with a warm page
cache, in interleaved rounds (each round runs every command once, alternating the order):

  ckpt        ckpt inspect --json <dir>                 (this tree)
  ckpt@REV    the same with REV's ckpt_tool first on PYTHONPATH (a detached worktree
              under build/ab/, bench/ab_compare.py's; same venv)   [--against]
  LABEL       the same from another tree (--tree LABEL=PATH: e.g. one with a change undone)
  torch       FileSystemReader(dir).read_metadata(), then every tensor's size and dtype

Medians of wall and CPU (user+sys from the child's rusage) are printed, with the ratios.
Exit 0 when every run exited 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.path.join(HERE, "out")
CACHE_VERSION = 1  # bump when the generated trees change
PER_LAYER = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(path: str, layers: int, rank: int, world: int, port: int) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def sharded(full: torch.Tensor, dim: int) -> DTensor:
        # torch's own split of a dim over the mesh (ceil-sized pieces, the last ones short or empty)
        piece = full.chunk(world, dim=dim)
        local = piece[rank] if rank < len(piece) else full.narrow(dim, 0, 0)
        return DTensor.from_local(local.contiguous(), mesh, [Shard(dim)], run_check=False,
                                  shape=full.shape, stride=full.stride())

    model, state = {}, {}
    for i in range(layers):
        w = torch.full((10, 8), float(i), dtype=torch.bfloat16)
        model[f"layers.{i}.w"] = sharded(w, 0)
        model[f"layers.{i}.b"] = DTensor.from_local(torch.full((8,), float(i)), mesh, [Replicate()], run_check=False)
        state[f"layers.{i}.w"] = {
            "exp_avg": sharded(torch.full((10, 8), 0.5), 0),
            "exp_avg_sq": sharded(torch.full((10, 8), 0.25), 1),
            "step": torch.tensor(float(i)),
        }
    optim = {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": sorted(state)}]}
    dcp.save({"model": model, "optim": optim}, checkpoint_id=path)
    dist.barrier()
    dist.destroy_process_group()


def ensure(tensors: int, ranks: int, regen: bool) -> str:
    """The sharded DCP of about `tensors` tensors over `ranks` ranks (built unless cached); its path."""
    layers = max(1, tensors // PER_LAYER)
    path = os.path.join(OUT, f"sharded_dcp_{layers * PER_LAYER}x{ranks}")
    stamp = os.path.join(path, ".bench_version")
    if not regen and os.path.exists(stamp) and open(stamp).read() == str(CACHE_VERSION):
        return path
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(OUT, exist_ok=True)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--world", str(ranks), "--port", str(port),
                               "--layers", str(layers), "--path", path], env=env) for r in range(ranks)]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise SystemExit(f"a worker failed: exit codes {codes}")
    with open(stamp, "w") as f:
        f.write(str(CACHE_VERSION))
    print(f"built {path} in {time.time() - t0:.0f} s: .metadata {os.path.getsize(os.path.join(path, '.metadata'))} bytes",
          file=sys.stderr)
    return path


_TORCH = (
    "import sys\n"
    "from torch.distributed.checkpoint import FileSystemReader\n"
    "from torch.distributed.checkpoint.metadata import TensorStorageMetadata\n"
    "md = FileSystemReader(sys.argv[1]).read_metadata()\n"
    "n = sum(1 for v in md.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata) and (v.size, v.properties.dtype))\n"
    "print(n)\n"
)


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall s, CPU s, exit status) of one whole process, stdout to /dev/null."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.stderr.write(proc.stderr.read().decode(errors="replace") if proc.stderr else "")
    return wall, usage.ru_utime + usage.ru_stime, proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, action="append")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--against", action="append", default=[],
                    help="an older revision to time too (a detached worktree under build/ab/); repeatable")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="another ckpt tree to time (its ckpt_tool first on PYTHONPATH); repeatable")
    ap.add_argument("--no-torch", action="store_true", help="leave torch's reader out")
    ap.add_argument("--regen", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        _worker(args.path, args.layers, args.worker, args.world, args.port)
        return 0
    ckpt = os.path.join(os.path.dirname(sys.executable), "ckpt")
    base_env = dict(os.environ, OMP_NUM_THREADS="1")
    sides: list[tuple[str, dict[str, str]]] = [("ckpt", dict(base_env, PYTHONPATH=REPO))]
    if args.against:
        sys.path.insert(0, HERE)
        import ab_compare

        for rev in args.against:
            tree, commit = ab_compare.checkout(rev)
            sides.append((f"ckpt@{commit[:7]}", dict(base_env, PYTHONPATH=tree)))
    for spec in args.tree:
        label, _, tree = spec.partition("=")
        sides.append((label, dict(base_env, PYTHONPATH=os.path.abspath(tree))))
    results = []
    for tensors in args.tensors or [3000, 30000]:
        path = ensure(tensors, args.ranks, args.regen)
        cmds = [(name, [ckpt, "inspect", "--json", path], env) for name, env in sides]
        if not args.no_torch:
            cmds.append(("torch", [sys.executable, "-c", _TORCH, path], base_env))
        times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in cmds}
        for name, cmd, env in cmds:  # warm-up: the page cache, and a check that each runs
            if _run(cmd, env)[2]:
                print(f"{name} failed on {path}", file=sys.stderr)
                return 1
        for r in range(args.runs):
            order = cmds if r % 2 == 0 else cmds[::-1]
            for name, cmd, env in order:
                wall, cpu, code = _run(cmd, env)
                if code:
                    return 1
                times[name].append((wall, cpu))
        row = {"path": path, "metadata_bytes": os.path.getsize(os.path.join(path, ".metadata"))}
        for name, got in times.items():
            row[name] = {"wall": statistics.median(w for w, _ in got), "cpu": statistics.median(c for _, c in got)}
        results.append(row)
        if not args.json:
            print(f"{os.path.basename(path)} (.metadata {row['metadata_bytes'] / 1e6:.1f} MB), medians of {args.runs}:")
            for name in times:
                print(f"  {name:16s} wall {row[name]['wall']:.3f} s  cpu {row[name]['cpu']:.3f} s")
            for name in times:
                if name != "ckpt":
                    print(f"  {name}/ckpt: wall {row[name]['wall'] / row['ckpt']['wall']:.2f}x "
                          f"cpu {row[name]['cpu'] / row['ckpt']['cpu']:.2f}x")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
