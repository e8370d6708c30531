"""The TPU-host bench (issue 32): ckpt on a TPU VM, against the disk and orbax's own route.

Run through bench/tpu_host.sh, which installs ckpt for the host's python
first. Steps, each timed, into one table (OUT/table.txt, OUT/results.json):

- write a checkpoint from the chip with the host's orbax (a CheckpointManager
  save on a (data, model) mesh of TREE: `adam`, a MoE model's full Adam state,
  632 leaves, 1.5 GiB; or `lm`, a 158-leaf bf16/f32 model, 2.3 GiB; a few MiB
  with SIZE=small);
- ckpt inspect, validate --deep; reshard for this host (no --devices), a
  v5e-8 and a v5e-256 (--topology); convert to DCP and to safetensors;
- restore every output with orbax onto the chip and compare its bytes with
  the source's (safetensors: read with an independent 10-line parser; DCP:
  converted back to Orbax by ckpt, then restored by orbax). Any difference:
  exit 1;
- the floors: `cp -r && sync` of the source; reshard with 1, 2, 8, 13 and the
  default workers; orbax itself (restore onto the chip with the new
  shardings, then save and sync, timed after its process opened the chip);
  `python -c pass`; every timed step starts after a `sync` (untimed) and ends
  durable (ckpt fsyncs its output; cp and orbax's save are followed by
  `sync`);
- REPEAT (5) rounds, each timing a floor and the ckpt step it bounds back to
  back (cp, then convert to DCP; orbax's route, then reshard; the v5e-8, then
  the v5e-256 layout). The table ends with issue 32's three ratios and issue
  46's process overheads (a convert's or reshard's time less the work its own
  --json summary gives, less `python -c pass`), every round's and their
  median, beside their targets: `met` only when every round meets it;
- reshard without --devices while another process holds the chip, and its
  start-up time;
- where a ckpt process's start and end go on this host (startup_probe: a bare
  interpreter, each heavy import alone, a convert under -X importtime) into
  OUT/startup.txt (STARTUP=0 skips it).

Only child processes open the chip (one program at a time can hold it): the
driver never imports jax, so that the held-chip step can hand it to a holder.

TPU_HOST_BENCH_PLATFORM=cpu SIZE=small runs it all on 8 CPU devices (for
debugging before a TPU run, and tests/bench/test_tpu_host_bench.py).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from host_io_probe import disk_floor  # (this folder: scripts run from bench/)

PLATFORM = os.environ.get("TPU_HOST_BENCH_PLATFORM", "tpu")
SIZE = os.environ.get("SIZE", "full")
# the tree (TREE=...): "adam" (the default, issue 46) is a full Adam state as a MoE language model's
# training saves it: bf16 params (attention, MoE experts and router), f32 mu and nu for every param,
# the step count: 632 leaves, 1.5 GiB; "lm" (issue 32) is 12 layers of 13 leaves, an embedding and a
# final norm: 158 leaves, 2.3 GiB
TREE = os.environ.get("TREE", "adam")
LAYERS = {"lm": 12, "adam": 16}
DIMS = {"lm": {"full": dict(d=2048, f=5632, vocab=50304), "small": dict(d=256, f=512, vocab=1024)},
        "adam": {"full": dict(d=768, f=1024, vocab=32000, experts=4), "small": dict(d=64, f=64, vocab=256, experts=2)}}
HOLD_READY = "holding the chip"
# rounds of the steps the ratios compare (REPEAT=1: once). Five: on the TPU VM the same code's
# DCP convert moved by 1.3 s from one call to the next and the copy from 1.8 to 11.5 s: hence
# ratios within a round (floor and ckpt back to back), and every round's shown
REPEAT = max(1, int(os.environ.get("REPEAT", "5")))


# -- child processes: the only ones that open the chip ------------------------------------------


def _jax_env() -> None:
    if PLATFORM == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"


def _source_mesh():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    model = 4 if len(devices) % 4 == 0 else 1
    return Mesh(np.array(devices).reshape(len(devices) // model, model), ("data", "model"))


def _tree_specs() -> dict[str, tuple[tuple[int, ...], str, tuple]]:
    """leaf path -> (shape, dtype, partition spec), for TREE."""
    return _adam_specs() if TREE == "adam" else _lm_specs()


def _lm_specs() -> dict[str, tuple[tuple[int, ...], str, tuple]]:
    dims = DIMS["lm"][SIZE]
    d, f, vocab = dims["d"], dims["f"], dims["vocab"]
    specs: dict[str, tuple[tuple[int, ...], str, tuple]] = {
        "params/embed/embedding": ((vocab, d), "float32", ("model", None)),
        "params/final_norm/scale": ((d,), "float32", ()),
    }
    for i in range(LAYERS["lm"]):
        p = f"params/layer_{i}"
        for w in ("q", "k", "v"):
            specs[f"{p}/attn/{w}/kernel"] = ((d, d), "bfloat16", ("data", "model"))
            specs[f"{p}/attn/{w}/bias"] = ((d,), "float32", ("model",))
        specs[f"{p}/attn/o/kernel"] = ((d, d), "bfloat16", ("model", "data"))
        specs[f"{p}/attn/o/bias"] = ((d,), "float32", ())
        specs[f"{p}/mlp/wi_0/kernel"] = ((d, f), "float32", (None, "model"))
        specs[f"{p}/mlp/wi_1/kernel"] = ((d, f), "float32", (None, "model"))
        specs[f"{p}/mlp/wo/kernel"] = ((f, d), "float32", ("model", None))
        specs[f"{p}/ln_1/scale"] = ((d,), "float32", ())
        specs[f"{p}/ln_2/scale"] = ((d,), "float32", ())
    return specs


def _adam_specs() -> dict[str, tuple[tuple[int, ...], str, tuple]]:
    """params (bf16), then optax's Adam state for them as a train state holds it: mu and nu in f32,
    the same shapes and shardings, and the step count."""
    dims = DIMS["adam"][SIZE]
    d, f, vocab, experts = dims["d"], dims["f"], dims["vocab"], dims["experts"]
    params: dict[str, tuple[tuple[int, ...], tuple]] = {
        "embed/embedding": ((vocab, d), ("model", None)),
        "final_norm/scale": ((d,), ()),
    }
    for i in range(LAYERS["adam"]):
        p = f"layer_{i}"
        for w in ("q", "k", "v"):
            params[f"{p}/attn/{w}/kernel"] = ((d, d), ("data", "model"))
            params[f"{p}/attn/{w}/bias"] = ((d,), ("model",))
        params[f"{p}/attn/o/kernel"] = ((d, d), ("model", "data"))
        params[f"{p}/attn/o/bias"] = ((d,), ())
        params[f"{p}/ln_1/scale"] = ((d,), ())
        params[f"{p}/ln_2/scale"] = ((d,), ())
        params[f"{p}/moe/router/kernel"] = ((d, experts), (None, None))
        params[f"{p}/moe/experts/wi"] = ((experts, d, f), (None, "data", "model"))
        params[f"{p}/moe/experts/wo"] = ((experts, f, d), (None, "model", "data"))
    specs: dict[str, tuple[tuple[int, ...], str, tuple]] = {"step": ((), "int32", ())}
    specs.update((f"params/{k}", (shape, "bfloat16", spec)) for k, (shape, spec) in params.items())
    specs["opt_state/count"] = ((), "int32", ())
    for moment in ("mu", "nu"):
        specs.update((f"opt_state/{moment}/{k}", (shape, "float32", spec)) for k, (shape, spec) in params.items())
    return specs


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, last = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return tree


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    return {prefix[:-1]: tree}


def child_write(root: str) -> dict[str, Any]:
    """Save the source with a CheckpointManager, from the chip."""
    _jax_env()
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = _source_mesh()
    opened = time.perf_counter() - t0
    flat = {}
    makers: dict[tuple, Any] = {}  # one compiled generator per (shape, dtype, spec): 8 kinds, not 158 compiles
    for n, (path, (shape, dtype, spec)) in enumerate(_tree_specs().items()):
        make = makers.get((shape, dtype, spec))
        if make is None:
            make = makers[shape, dtype, spec] = jax.jit(
                lambda key, shape=shape, dtype=dtype: jax.random.normal(key, shape, jnp.float32).astype(dtype),
                out_shardings=NamedSharding(mesh, P(*spec)))
        flat[path] = make(jax.random.key(n))
    tree = _nest(flat)
    jax.block_until_ready(tree)
    t1 = time.perf_counter()
    with ocp.CheckpointManager(root) as manager:
        manager.save(0, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    nbytes = sum(int(a.nbytes) for a in flat.values())
    return {"seconds": time.perf_counter() - t1, "open_seconds": opened, "bytes": nbytes, "leaves": len(flat),
            "mesh": dict(mesh.shape), "devices": len(jax.devices()), "platform": jax.devices()[0].platform,
            "orbax": getattr(ocp, "__version__", "?"), "jax": jax.__version__}


def _restore_args(path: str, sharding):
    import jax
    import orbax.checkpoint as ocp

    meta = ocp.PyTreeCheckpointer().metadata(path)
    tree = getattr(meta, "item_metadata", None)
    tree = getattr(tree, "tree", tree) if tree is not None else meta
    tree = getattr(tree, "tree", tree)
    return jax.tree.map(lambda m: ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(m.shape), dtype=m.dtype), tree)


def _restore(path: str, sharding) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    args = ocp.args.PyTreeRestore(restore_args=_restore_args(path, sharding))
    return ocp.PyTreeCheckpointer().restore(path, args=args)


def _host_bytes(tree: Any) -> dict[str, bytes]:
    import jax
    import numpy as np

    return {k: np.asarray(jax.device_get(v)).tobytes() for k, v in _flatten(tree).items()}


def _safetensors(path: str) -> dict[str, bytes]:
    """name -> raw bytes, by the format's definition (8-byte header length, JSON header, data)."""
    out: dict[str, bytes] = {}
    files = sorted(Path(path).glob("*.safetensors")) if os.path.isdir(path) else [Path(path)]
    for file in files:
        data = file.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        for name, info in header.items():
            if name != "__metadata__":
                start, stop = info["data_offsets"]
                out[name] = data[8 + n + start:8 + n + stop]
    return out


def child_verify(plan: dict[str, Any]) -> dict[str, Any]:
    """Restore every output onto this host's devices with orbax (orbax's own route's included) and compare bytes."""
    _jax_env()
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    t0 = time.perf_counter()
    devices = jax.devices()
    one = NamedSharding(Mesh(devices[:1], ("x",)), P())  # each leaf whole on the first device: any layout restores
    source = _host_bytes(_restore(plan["source"], one))
    results: dict[str, Any] = {"source_restore_seconds": time.perf_counter() - t0, "compared": {}}
    for name, path in plan["orbax_outputs"].items():
        t = time.perf_counter()
        got = _host_bytes(_restore(path, one))
        results["compared"][name] = _compare(source, got, time.perf_counter() - t)
    for name, path in plan["safetensors_outputs"].items():
        t = time.perf_counter()
        raw = _safetensors(path)
        got = {k: raw.get(k, raw.get(k.replace("/", "."))) for k in source}
        results["compared"][name] = _compare(source, got, time.perf_counter() - t)

    if os.path.exists(plan["orbax_route_out"]):  # the last round's output of orbax's own route
        t = time.perf_counter()
        got = _host_bytes(_restore(plan["orbax_route_out"], one))
        results["compared"]["orbax route (restore+save)"] = _compare(source, got, time.perf_counter() - t)
    return results


def child_route(plan: dict[str, Any]) -> dict[str, Any]:
    """orbax's own route for this host's layout, in a process of its own: open the chip (untimed, as a
    training process already holds it), restore with the new shardings, save, sync."""
    _jax_env()
    t = time.perf_counter()
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = _host_mesh(plan["host_mesh"])
    jax.block_until_ready(jax.numpy.zeros(()))
    opened = time.perf_counter() - t
    shardings = plan["host_specs"]
    out = plan["orbax_route_out"]
    if os.path.exists(out):
        shutil.rmtree(out)
    os.sync()  # (untimed) nothing earlier left for the sync below
    t = time.perf_counter()
    restore_args = _restore_args(plan["source"], None)
    flat_args = _flatten(restore_args)
    for key, a in flat_args.items():
        a.sharding = NamedSharding(mesh, P(*[tuple(e) if isinstance(e, list) else e for e in shardings.get(key, [])]))
    tree = ocp.PyTreeCheckpointer().restore(plan["source"], args=ocp.args.PyTreeRestore(restore_args=_nest(flat_args)))
    jax.block_until_ready(tree)
    restored = time.perf_counter() - t
    t = time.perf_counter()
    ocp.PyTreeCheckpointer().save(out, args=ocp.args.PyTreeSave(tree))
    os.sync()  # durable, as ckpt's outputs (fsynced before commit) and the cp -r && sync floor are
    saved = time.perf_counter() - t
    return {"open_seconds": opened, "restore_seconds": restored, "save_seconds": saved, "seconds": restored + saved}


def _host_mesh(mesh: dict[str, int]):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    n = int(np.prod(list(mesh.values())))
    return Mesh(np.array(jax.devices()[:n]).reshape(tuple(mesh.values())), tuple(mesh))


def _compare(source: dict[str, bytes], got: dict[str, bytes | None], seconds: float) -> dict[str, Any]:
    bad = [k for k in source if got.get(k) != source[k]]
    return {"ok": not bad, "leaves": len(source), "differ": bad[:5], "differ_count": len(bad), "seconds": seconds}


def child_hold() -> None:
    """Open the chip and keep it until stdin closes (the held-chip step)."""
    _jax_env()
    import jax

    x = jax.numpy.ones((1024, 1024))
    x.block_until_ready()
    print(HOLD_READY, jax.devices()[0].platform, flush=True)
    sys.stdin.read()


# -- the driver (no jax) ---------------------------------------------------------------------------


class Bench:
    def __init__(self, out: Path, work: Path, python: list[str]) -> None:
        self.out, self.work, self.python = out, work, python
        self.rows: list[dict[str, Any]] = []
        self.failed: list[str] = []

    def child(self, what: str, *args: str) -> dict[str, Any]:
        r = subprocess.run([*self.python, __file__, what, *args], capture_output=True, text=True, cwd=self.work)
        if r.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{r.stderr[-4000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def ckpt(self, step: str, *args: str, nbytes: int | None = None, env: dict[str, str] | None = None,
             expect: int = 0) -> dict[str, Any]:
        os.sync()  # (untimed) the steps before leave no dirty pages for this one to flush
        t = time.perf_counter()
        # from the scratch folder: `-m` puts the working folder first on sys.path, and a checkout there would
        # shadow the ckpt tpu_host.sh installed
        r = subprocess.run([*self.python, "-m", "ckpt_tool", *args], capture_output=True, text=True,
                           env={**os.environ, **(env or {})}, cwd=self.work)
        seconds = time.perf_counter() - t
        row = self.row(step, seconds, nbytes, ok=r.returncode == expect,
                       note="" if r.returncode == expect else f"exit {r.returncode}: {r.stderr.strip()[-300:]}")
        row["stdout"] = r.stdout
        return row

    def row(self, step: str, seconds: float, nbytes: int | None = None, ok: bool = True, note: str = "") -> dict[str, Any]:
        row = {"step": step, "seconds": round(seconds, 3), "bytes": nbytes, "ok": ok, "note": note}
        if nbytes and seconds > 0:
            row["GiB/s"] = round(nbytes / seconds / 2**30, 3)
        self.rows.append(row)
        if not ok:
            self.failed.append(step)
        print(f"{step:<72} {seconds:8.2f} s  {'ok' if ok else 'FAILED'}  {note}", file=sys.stderr, flush=True)
        return row

    def table(self) -> str:
        lines = [f"{'step':<72} {'seconds':>9} {'GiB':>7} {'GiB/s':>7}  result"]
        for r in self.rows:
            gib = f"{r['bytes'] / 2**30:.2f}" if r["bytes"] else "-"
            rate = f"{r['GiB/s']:.2f}" if "GiB/s" in r else "-"
            lines.append(f"{r['step']:<72} {r['seconds']:>9.2f} {gib:>7} {rate:>7}  "
                         f"{'ok' if r['ok'] else 'FAILED'}{'  ' + r['note'] if r['note'] else ''}")
        return "\n".join(lines)


def _work_row(row: dict[str, Any]) -> None:
    """Note on a ckpt row (run with --json) the work its own summary gives: the process's time less
    this is its start and end."""
    try:
        row["work_seconds"] = float(json.loads(row["stdout"])["seconds"])
    except (ValueError, KeyError, TypeError):
        return
    row["note"] = (row["note"] + f" work {row['work_seconds']:.2f} s of it").strip()


def bare_python(work: Path, runs: int = 5) -> float:
    """The median wall time of `python -c pass` on this host: what any process costs before ckpt's own code."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True, cwd=work)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# a ratio of two steps, taken within each round: (name, numerator step, denominator step, target, at most?)
RATIOS = [
    ("v5e-256 layout / v5e-8 layout (time)", "reshard v5e-256", "reshard v5e-8", 1.5, True),
    ("convert orbax -> DCP / cp -r && sync (time)", "convert orbax -> DCP", "disk floor", 1.5, True),
    ("orbax route / ckpt reshard this host (time)", "orbax route: ", "reshard this host: ", 3.0, False),
]
OVERHEAD_TARGET = 0.4  # seconds beyond a bare `python -c pass`, issue 46
# an untimed pause after a process that opened the chip (orbax's route), before the next timed step
SETTLE_SECONDS = float(os.environ.get("SETTLE_SECONDS", "2"))


def ratios(rows: list[dict[str, Any]]) -> str:
    """Issue 32's three ratios and issue 46's process overheads, each round's and their median,
    beside their targets: `met` only when every round meets it."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    bare = next((r["seconds"] for r in rows if r["step"].startswith("python -c pass") and r["ok"]), None)
    for r in rows:
        if r["ok"] and r["step"].endswith(")") and " (round " in r["step"]:
            step, _, k = r["step"][:-1].rpartition(" (round ")
            by_round.setdefault(int(k), {})[step] = r

    def pick(k: int, prefix: str) -> dict[str, Any] | None:
        return next((r for step, r in by_round[k].items() if step.startswith(prefix)), None)

    lines = [f"{'ratio (each round, then their median)':<62} {'rounds':<24} {'median':>8}  {'':6}  target"]

    def line(name: str, values: list[float], target: float, at_most: bool, unit: str) -> None:
        if not values:
            return
        met = all(v <= target if at_most else v >= target for v in values)
        rounds = " ".join(f"{v:.2f}" for v in values)
        sign = ("<=" if at_most else ">=") if unit == "x" else "<"
        lines.append(f"{name:<62} {rounds:<24} {statistics.median(values):7.2f}{unit}  "
                     f"{'met' if met else 'MISSED':6}  {sign}{target:g}{unit}")

    for name, num, den, target, at_most in RATIOS:
        values = []
        for k in sorted(by_round):
            a, b = pick(k, num), pick(k, den)
            if a and b and b["seconds"] > 0:
                values.append(a["seconds"] / b["seconds"])
        line(name, values, target, at_most, "x")
    if bare is not None:
        for name, prefix in (("convert", "convert orbax -> DCP"), ("reshard", "reshard this host: ")):
            values = [r["seconds"] - r["work_seconds"] - bare for k in sorted(by_round)
                      if (r := pick(k, prefix)) and "work_seconds" in r]
            line(f"process overhead of {name} beyond python -c pass (s)", values, OVERHEAD_TARGET, True, "s")
    return "\n".join(lines)


def held_chip_reshard(bench: Bench, src: str, dst: str, mesh: str) -> None:
    """`ckpt reshard` without --devices while another process holds the chip."""
    holder = subprocess.Popen([*bench.python, __file__, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=bench.work)
    try:
        line = holder.stdout.readline()
        if HOLD_READY not in line:
            bench.row("reshard while another process holds the chip", 0.0, ok=False,
                      note=f"the holder did not start: {holder.stderr.read()[-300:]}")
            return
        t = time.perf_counter()
        probe = ("import sys, time, runpy; sys.argv = ['ckpt'] + sys.argv[1:]; t = time.perf_counter(); "
                 "from ckpt_tool.ops.reshard import ReshardOptions, resolve_mesh; "
                 "m = resolve_mesh(ReshardOptions(mesh=sys.argv[-1]), 1); "
                 "print(round(time.perf_counter() - t, 3), m.source, flush=True)")
        r = subprocess.run([*bench.python, "-c", probe, mesh], capture_output=True, text=True, cwd=bench.work)
        start = r.stdout.strip()
        row = bench.ckpt("reshard while another process holds the chip", "reshard", src, dst, "--mesh", mesh)
        row["note"] = (row["note"] + f" devices learned in {start.split(' ', 1)[0]} s "
                       f"(process start {time.perf_counter() - t - row['seconds']:.2f} s): {start.partition(' ')[2]}").strip()
        row["devices_seconds"] = float(start.split(" ", 1)[0]) if r.returncode == 0 else None
        if r.returncode != 0 or row["devices_seconds"] > 3.0:
            row["ok"] = False
            bench.failed.append("held-chip start")
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    _jax_env()  # for the children, ckpt's included (the driver itself never imports jax)
    work = Path(os.environ.get("WORK") or out / "work")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    python = [sys.executable]
    bench = Bench(out, work, python)
    root = work / "manager"
    try:
        written = bench.child("write", str(root))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    nbytes = written["bytes"]
    bench.row(f"orbax CheckpointManager save ({written['leaves']} leaves, {written['platform']})", written["seconds"], nbytes,
              note=f"mesh {written['mesh']}; jax {written['jax']}, orbax {written['orbax']}; devices opened in "
                   f"{written['open_seconds']:.1f} s")
    src = str(root / "0" / "default")
    host = {"data": 1, "model": 1} if written["devices"] == 1 else {"data": 2, "model": written["devices"] // 2}
    host_mesh = ",".join(f"{k}={v}" for k, v in host.items())

    bench.ckpt("ckpt inspect", "inspect", src, "--json")
    bench.ckpt("ckpt validate --deep", "validate", src, "--deep", nbytes=nbytes)
    layouts = {
        f"this host: --mesh {host_mesh} (no --devices)": ["--mesh", host_mesh],
        "v5e-8: --mesh data=2,model=4 --topology v5e:2x4": ["--mesh", "data=2,model=4", "--topology", "v5e:2x4"],
        "v5e-256: --mesh data=16,model=16 --fsdp data --topology v5e:16x16":
            ["--mesh", "data=16,model=16", "--fsdp", "data", "--topology", "v5e:16x16"],
    }
    orbax_outputs: dict[str, str] = {}
    for i, (name, args) in enumerate(layouts.items()):
        dst = str(work / f"reshard_{i}")
        row = bench.ckpt(f"reshard {name}", "reshard", src, dst, *args, "--json", nbytes=nbytes)
        if row["ok"]:
            row["note"] = json.loads(row["stdout"])["mesh"].get("source") or "jax's devices"
            orbax_outputs[f"reshard {name}"] = dst

    dcp = str(work / "dcp")
    if bench.ckpt("convert orbax -> DCP", "convert", src, dcp, "--to", "dcp", nbytes=nbytes)["ok"]:
        back = str(work / "dcp_back")
        if bench.ckpt("convert DCP -> orbax (to restore with orbax)", "convert", dcp, back, "--to", "orbax",
                      nbytes=nbytes)["ok"]:
            orbax_outputs["convert orbax -> DCP (-> orbax)"] = back
    st = str(work / "safetensors")
    st_ok = bench.ckpt("convert orbax -> safetensors", "convert", src, st, "--to", "safetensors", nbytes=nbytes)["ok"]

    bench.row("disk floor: cp -r && sync", disk_floor(src, str(work / "copy")), nbytes)
    shutil.rmtree(work / "copy")
    for workers in (1, 2, 8, 13, None):
        dst = str(work / f"workers_{workers}")
        extra = ["--workers", str(workers)] if workers else []
        bench.ckpt(f"reshard this host, --workers {workers or 'default'}", "reshard", src, dst, "--mesh", host_mesh,
                   *extra, nbytes=nbytes)
        shutil.rmtree(dst, ignore_errors=True)

    held_chip_reshard(bench, src, str(work / "held"), host_mesh)

    # the ratios' steps in REPEAT rounds, each pair back to back (the floor, then ckpt): the disk floor
    # of one run varied from 2.1 to 9.7 s on the same host, so a ratio is taken within each round, and
    # every round must meet its target, not only the median
    host_specs = _host_specs(bench, src, host_mesh)
    route_out = str(work / "orbax_route")
    bench.row("python -c pass (the bare interpreter)", bare_python(work), None)
    for k in range(1, REPEAT + 1):
        bench.row(f"disk floor: cp -r && sync (round {k})", disk_floor(src, str(work / "copy")), nbytes)
        shutil.rmtree(work / "copy")
        _work_row(bench.ckpt(f"convert orbax -> DCP (round {k})", "convert", src, str(work / f"dcp_{k}"), "--to", "dcp",
                             "--json", nbytes=nbytes))
        shutil.rmtree(work / f"dcp_{k}", ignore_errors=True)
        try:
            o = bench.child("route", json.dumps({"source": src, "host_mesh": host, "host_specs": host_specs,
                                                 "orbax_route_out": route_out}))
            bench.row(f"orbax route: restore with new shardings + save (round {k})", o["seconds"], nbytes,
                      note=f"restore {o['restore_seconds']:.2f} s, save {o['save_seconds']:.2f} s (chip already open)")
        except RuntimeError as exc:
            bench.row(f"orbax route: restore with new shardings + save (round {k})", 0.0, ok=False, note=str(exc)[-300:])
        # the route's process has opened the chip and exited; a process started at once took 0.05 s
        # longer to reach its work on the TPU VM, half of that 2 s later (phase_table, "after the
        # chip's opener"): the host's, not ckpt's, so the reshard starts after a pause
        time.sleep(SETTLE_SECONDS)
        _work_row(bench.ckpt(f"reshard this host: --mesh {host_mesh} (round {k})", "reshard", src,
                             str(work / f"host_{k}"), "--mesh", host_mesh, "--json", nbytes=nbytes))
        shutil.rmtree(work / f"host_{k}", ignore_errors=True)
        # the two layouts too: one run each moved their ratio from 0.90x to 1.62x between two calls
        # (the v5e-8 layout's own time from 5.75 to 3.56 s)
        for name, args in layouts.items():
            if name.startswith(("v5e-8", "v5e-256")):
                bench.ckpt(f"reshard {name} (round {k})", "reshard", src, str(work / f"layout_{k}"), *args, nbytes=nbytes)
                shutil.rmtree(work / f"layout_{k}", ignore_errors=True)

    plan = {"source": src, "orbax_outputs": orbax_outputs, "safetensors_outputs": {"convert orbax -> safetensors": st} if st_ok else {},
            "orbax_route_out": route_out}
    try:
        verified = bench.child("verify", json.dumps(plan))
    except RuntimeError as exc:
        bench.row("restore with orbax and compare", 0.0, ok=False, note=str(exc)[-300:])
        verified = {"compared": {}}
    for name, c in verified["compared"].items():
        bench.row(f"bytes equal: {name}", c["seconds"], ok=c["ok"],
                  note=f"{c['leaves']} leaves" + (f"; {c['differ_count']} differ: {c['differ']}" if not c["ok"] else ""))
    text = bench.table() + "\n\n" + ratios(bench.rows)
    (out / "table.txt").write_text(text + "\n")
    if os.environ.get("STARTUP", "1") == "1":  # where a process's start and end go on this host
        (out / "startup.txt").write_text(startup_probe(src, work, host_mesh))
    for r in bench.rows:
        r.pop("stdout", None)
    (out / "results.json").write_text(json.dumps({"written": written, "rows": bench.rows, "verify": verified,
                                                  "failed": bench.failed}, indent=1) + "\n")
    print(text)
    if bench.failed:
        print(f"FAILED: {', '.join(bench.failed)}", file=sys.stderr)
        return 1
    if os.environ.get("KEEP_WORK") != "1":
        shutil.rmtree(work, ignore_errors=True)
    return 0


def profile(out: Path) -> int:
    """MODE=profile: where the time of the slow steps goes on this host, instead of the table.

    Writes the source as main() does, then runs bench/host_io_probe.py (the file
    system's primitives), startup_probe (what a process's start costs) and each of reshard (this host, v5e-256), convert to DCP
    and to safetensors and validate --deep under bench/sampler.py, with ckpt's
    page-cache hints on and off (CKPT_PAGECACHE). Reports land in OUT/profile/.
    """
    out.mkdir(parents=True, exist_ok=True)
    _jax_env()
    work = Path(os.environ.get("WORK") or out / "work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    prof = out / "profile"
    prof.mkdir(exist_ok=True)
    bench = Bench(out, work, [sys.executable])
    written = bench.child("write", str(work / "manager"))
    nbytes = written["bytes"]
    src = str(work / "manager" / "0" / "default")
    here = Path(__file__).resolve().parent
    r = subprocess.run([sys.executable, str(here / "host_io_probe.py"), str(work / "probe"), "--gib", "1"],
                       capture_output=True, text=True)
    (prof / "host_io_probe.json").write_text(r.stdout + r.stderr)
    print(r.stdout + r.stderr[-2000:], file=sys.stderr, flush=True)
    os.sync()
    r = subprocess.run([sys.executable, str(here / "read_probe.py"), src, str(work / "probe")], capture_output=True, text=True)
    (prof / "read_probe.json").write_text(r.stdout + r.stderr[-3000:])
    shutil.rmtree(work / "probe", ignore_errors=True)
    host = "data=1,model=1" if written["devices"] == 1 else f"data=2,model={written['devices'] // 2}"
    if os.environ.get("STARTUP", "1") == "1":
        (prof / "startup.txt").write_text(startup_probe(src, work, host))
    steps = {
        "reshard_host": ["reshard", src, "{dst}", "--mesh", host],
        "convert_dcp": ["convert", src, "{dst}", "--to", "dcp"],
        "convert_safetensors": ["convert", src, "{dst}", "--to", "safetensors"],
        "reshard_v5e256": ["reshard", src, "{dst}", "--mesh", "data=16,model=16", "--fsdp", "data", "--topology", "v5e:16x16"],
        "validate_deep": ["validate", src, "--deep"],
    }
    variants = [v for v in os.environ.get("VARIANTS", "pc1:CKPT_PAGECACHE=1,pc0:CKPT_PAGECACHE=0").split(",") if v]
    only = [s for s in os.environ.get("STEPS", "").split(",") if s]
    steps = {k: v for k, v in steps.items() if not only or k in only}
    for name, args in steps.items():
        for variant in variants:
            tag, _, assign = variant.partition(":")
            env = dict(a.split("=", 1) for a in assign.split("+") if a)
            dst = work / f"{name}_{tag}"
            report = prof / f"{name}_{tag}.txt"
            argv = [a.replace("{dst}", str(dst)) for a in args]
            os.sync()
            t = time.perf_counter()
            r = subprocess.run([sys.executable, str(here / "sampler.py"), "--out", str(report), "-m", "ckpt_tool", *argv],
                               capture_output=True, text=True, env={**os.environ, **env}, cwd=work)
            bench.row(f"{name} [{tag}]", time.perf_counter() - t, nbytes, ok=r.returncode == 0,
                      note="" if r.returncode == 0 else r.stderr.strip()[-300:])
            shutil.rmtree(dst, ignore_errors=True)
            if name == "validate_deep":
                break
    bench.row("disk floor: cp -r && sync", disk_floor(src, str(work / "copy")), nbytes)
    text = bench.table()
    (out / "table.txt").write_text(text + "\n")
    subprocess.run(["tar", "czf", str(out / "profile.tgz"), "-C", str(out), "profile", "table.txt"], check=False)
    print(text)
    shutil.rmtree(work, ignore_errors=True)
    return 0


# what a ckpt process imports before its first chunk, piece by piece: each line a fresh interpreter
STARTUP_IMPORTS = ["pass", "import numpy", "import numpy, ml_dtypes", "import asyncio", "import tensorstore",
                   "import click", "import rich.markup, rich.text", "import ckpt_tool.cli.main",
                   "import ckpt_tool.cli.main, ckpt_tool.ops.runs, ckpt_tool.ops.engine",
                   "import click, ckpt_tool.cli.app, ckpt_tool.ops.runs, ckpt_tool.ops.engine, ckpt_tool.ops.reshard",
                   # the same, numpy imported on a second thread meanwhile: whether imports overlap
                   # where each costs file-system round trips (9p under gVisor)
                   "import threading; t = threading.Thread(target=__import__, args=('numpy',)); t.start(); "
                   "import click, ckpt_tool.cli.app, ckpt_tool.ops.runs; t.join(); import ckpt_tool.ops.engine, ckpt_tool.ops.reshard"]


def startup_probe(src: str, work: Path, host_mesh: str, runs: int = 3) -> str:
    """Where a ckpt process's start and end go on this host: the wall time of a fresh interpreter
    doing each of STARTUP_IMPORTS (the fastest of `runs`), the time from a convert's and a reshard's
    (for `host_mesh`) last line to the process's exit, then `python -X importtime` of a whole convert
    to DCP (its slowest imports, cumulative, and the count of modules)."""
    lines = [f"{'statement':64s} fastest of {runs} (s)"]
    for stmt in STARTUP_IMPORTS:
        best = float("inf")
        for _ in range(runs):
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", stmt], capture_output=True, text=True, cwd=work)
            best = min(best, time.perf_counter() - t)
        lines.append(f"{stmt:64s} {best:6.3f}" + ("" if r.returncode == 0 else f"  failed: {r.stderr.strip()[-200:]}"))
    # the end: from the summary line (the command's last act) to the process's exit
    for name, argv in (("convert", ["convert", src, "{dst}", "--to", "dcp"]),
                       ("reshard", ["reshard", src, "{dst}", "--mesh", host_mesh])):
        dst = work / "startup_end"
        t = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *[a.replace("{dst}", str(dst)) for a in argv]],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=work,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert p.stdout is not None
        last, t_line = "", t  # (no line at all: a failed run, its rc says so)
        for raw in p.stdout:
            last, t_line = raw.decode(errors="replace").strip(), time.perf_counter()
        p.wait()
        t_exit = time.perf_counter()
        lines.append(f"{name}: {t_exit - t:.3f} s in all, its last line at {t_line - t:.3f} s, exit {t_exit - t_line:.3f} s"
                     f" later (rc {p.returncode}: {last[:60]})")
        shutil.rmtree(dst, ignore_errors=True)
    imported = {name: _importtime(work, argv) for name, argv in
                (("convert", ["convert", src, "{dst}", "--to", "dcp"]), ("reshard", ["reshard", src, "{dst}", "--mesh", host_mesh]))}
    for name, rows in imported.items():
        lines.append(f"{name} under -X importtime: {len(rows)} modules, {sum(s for s, _ in rows.values()) / 1e6:.3f} s of "
                     "their own time in all")
    # what a reshard imports that a convert does not (the difference in their overheads)
    only = sorted(((own, name) for name, (own, _) in imported["reshard"].items() if name not in imported["convert"]), reverse=True)
    lines.append(f"\nonly reshard imports {len(only)} modules, {sum(us for us, _ in only) / 1e6:.3f} s of their own time "
                 "(own us):")
    lines += [f"{us:10d} {name}" for us, name in only[:25]]
    lines.append("\n" + phase_table(src, work, host_mesh, runs))
    rows = imported["convert"]
    lines.append("\nconvert's slowest imports (cumulative us):")
    lines += [f"{cum:10d} {name}" for cum, name in sorted(((c, n) for n, (_, c) in rows.items()), reverse=True)[:60]]
    return "\n".join(lines) + "\n"


PHASES = [("interpreter and site", "start", "script"), ("ckpt's CLI imported", "script", "cli imported"),
          ("imports and CLI, to the work", "cli imported", "work in"), ("the work", "work in", "work out"),
          ("after the work", "work out", "exit"), ("the exit", "exit", "end")]


def _phases(argv: list[str], work: Path, *, after: list[str] | None = None, pause: float = 0.0) -> dict[str, float]:
    """One run of bench/phase_probe.py: each phase's seconds (PHASES), and the work its summary gives.
    `after`: a command run just before (untimed), e.g. a process that opens the chip and exits;
    `pause`: seconds between the two."""
    dst = work / "phase_out"
    shutil.rmtree(dst, ignore_errors=True)
    if after:
        subprocess.run(after, input="", capture_output=True, text=True, cwd=work)
    os.sync()
    time.sleep(pause)
    start = time.time()
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("phase_probe.py")),
                        *[a.replace("{dst}", str(dst)) for a in argv]], capture_output=True, text=True, cwd=work)
    marks = {"start": start, "end": time.time()}
    shutil.rmtree(dst, ignore_errors=True)
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("phases ")), None)
    if r.returncode != 0 or line is None:
        return {}
    marks.update(json.loads(line[len("phases "):]))
    got = {name: marks[b] - marks[a] for name, a, b in PHASES if a in marks and b in marks}
    try:
        got["summary's work"] = float(json.loads(r.stdout)["seconds"])
    except (ValueError, KeyError, TypeError):
        pass
    return got


def phase_table(src: str, work: Path, host_mesh: str, runs: int = 3) -> str:
    """Where a convert's and a reshard's process time goes on this host (bench/phase_probe.py), the
    median of `runs` each, alternated; and a reshard just after a process that opened the chip and
    exited (as orbax's route does before the rounds' reshard), at once and after SETTLE_SECONDS."""
    argvs = {"convert": ["convert", src, "{dst}", "--to", "dcp", "--json"],
             "reshard": ["reshard", src, "{dst}", "--mesh", host_mesh, "--json"]}
    seen: dict[str, list[dict[str, float]]] = {name: [] for name in argvs}
    for _ in range(runs):
        for name, argv in argvs.items():
            seen[name].append(_phases(argv, work))
    opener = [sys.executable, __file__, "hold"]
    seen["reshard after the chip's opener"] = [_phases(argvs["reshard"], work, after=opener) for _ in range(2)]
    seen[f"... and {SETTLE_SECONDS:g} s"] = [_phases(argvs["reshard"], work, after=opener, pause=SETTLE_SECONDS)
                                              for _ in range(2)]
    names = [name for name, _, _ in PHASES] + ["summary's work"]
    lines = [f"{'phase (s, median)':28s}" + "".join(f"{k[:24]:>26s}" for k in seen)]
    for phase in names:
        cells = []
        for runs_ in seen.values():
            values = [r[phase] for r in runs_ if phase in r]
            cells.append(f"{statistics.median(values):26.3f}" if values else f"{'-':>26s}")
        lines.append(f"{phase:28s}" + "".join(cells))
    return "\n".join(lines)


def _importtime(work: Path, argv: list[str]) -> dict[str, tuple[int, int]]:
    """Each module a whole ckpt run imports, with its own and cumulative microseconds (-X importtime)."""
    dst = work / "startup_importtime"
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_tool", *[a.replace("{dst}", str(dst)) for a in argv]],
                       capture_output=True, text=True, cwd=work)
    shutil.rmtree(dst, ignore_errors=True)
    rows: dict[str, tuple[int, int]] = {}
    for line in r.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            rows[parts[2].strip()] = (int(parts[0].split(":")[1]), int(parts[1]))
    return rows


AB_STEPS = ("convert_dcp", "reshard_host", "reshard_v5e8", "reshard_v5e256")  # what MODE=ab's STEPS may name


def ab(out: Path) -> int:
    """MODE=ab AB_TREE=DIR: this checkout's ckpt against the ckpt_tool package under DIR (an older
    checkout), on this host, interleaved: the same source, each round's order alternated, each
    step a whole process after a sync, and `cp -r && sync` each round. The table gives each run
    and the medians. SRC=DIR uses an existing checkpoint item instead of writing one.

    STEPS=convert_dcp,reshard_host (the default), reshard_v5e8, reshard_v5e256: which steps.

    SIDES=NAME=DIR[:ARGS],... instead compares any number of sides, each a folder holding a
    ckpt_tool package and options added to both steps (`new=.,old=/tmp/old,big=.:--memory 2GiB`:
    `.` is this checkout); each round runs them in turn, starting from a different one."""
    sides_spec = os.environ.get("SIDES", "")
    if sides_spec:
        found = [_side(spec) for spec in sides_spec.split(",") if spec]
        parsed = [side for side in found if side is not None]
        if not parsed or len(parsed) != len(found):
            print("SIDES: each side is NAME=DIR[:ARGS], DIR holding a ckpt_tool package", file=sys.stderr)
            return 2
    else:
        tree = os.environ.get("AB_TREE", "")
        if not tree or not (Path(tree) / "ckpt_tool").is_dir():
            print("MODE=ab needs AB_TREE=DIR, a folder holding the other ckpt_tool package", file=sys.stderr)
            return 2
        parsed = [("new", Path(__file__).resolve().parent.parent, []), ("old", Path(tree), [])]
    only = [s for s in os.environ.get("STEPS", "convert_dcp,reshard_host").split(",") if s]
    if not only or not set(only) <= set(AB_STEPS):
        print(f"STEPS: some of {', '.join(AB_STEPS)}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    _jax_env()
    work = Path(os.environ.get("WORK") or out / "work_ab")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    bench = Bench(out, work, [sys.executable])
    src = os.environ.get("SRC")
    if not src:
        bench.child("write", str(work / "manager"))
        src = str(work / "manager" / "0" / "default")
    nbytes = sum(f.stat().st_size for f in Path(src).rglob("*") if f.is_file())
    host = os.environ.get("HOST_MESH", "data=1,model=1")
    steps = {"convert_dcp": ["convert", src, "{dst}", "--to", "dcp"],
             "reshard_host": ["reshard", src, "{dst}", "--mesh", host],
             "reshard_v5e8": ["reshard", src, "{dst}", "--mesh", "data=2,model=4", "--topology", "v5e:2x4"],
             "reshard_v5e256": ["reshard", src, "{dst}", "--mesh", "data=16,model=16", "--fsdp", "data",
                                "--topology", "v5e:16x16"]}
    steps = {k: v for k, v in steps.items() if k in only}
    # both sides from a folder put first on PYTHONPATH, this checkout's included: with only the old
    # side there, every import looked in one folder more, and on the TPU VM (9p under gVisor) those
    # lookups cost the old side 0.35-0.5 s a run, as much as the change being measured (the reshard,
    # which that change did not touch, showed it)
    def first(folder: Path) -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder.resolve()), os.environ.get("PYTHONPATH", "")) if p)}

    sides = {name: first(folder) for name, folder, _ in parsed}
    extra = {name: args for name, _, args in parsed}
    times: dict[str, list[float]] = {}
    for k in range(max(1, int(os.environ.get("ROUNDS", "3")))):
        floor = disk_floor(src, str(work / "copy"))
        shutil.rmtree(work / "copy")
        bench.row(f"disk floor: cp -r && sync (round {k + 1})", floor, nbytes)
        times.setdefault("cp", []).append(floor)
        # rotated, so that each side goes first in turn (two sides: alternated)
        names = list(sides)
        order = names[k % len(names):] + names[:k % len(names)]
        for name, args in steps.items():
            for side in order:
                dst = work / f"{name}_{side}"
                argv = [a.replace("{dst}", str(dst)) for a in args] + extra[side]
                row = bench.ckpt(f"{name} [{side}] (round {k + 1})", *argv, nbytes=nbytes, env=sides[side])
                times.setdefault(f"{name} [{side}]", []).append(row["seconds"])
                shutil.rmtree(dst, ignore_errors=True)
    lines = [bench.table(), "", f"{'medians':40s} seconds  / cp"]
    cp = statistics.median(times["cp"])
    for key, ts_ in times.items():
        lines.append(f"{key:40s} {statistics.median(ts_):7.2f}  {statistics.median(ts_) / cp:5.2f}x")
    text = "\n".join(lines)
    (out / "ab.txt").write_text(text + "\n")
    print(text)
    if os.environ.get("KEEP_WORK") != "1":
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bench.failed else 0


def _side(spec: str) -> tuple[str, Path, list[str]] | None:
    """One SIDES entry, NAME=DIR[:ARGS]: its name, its folder (holding ckpt_tool) and its options."""
    name, _, rest = spec.partition("=")
    folder, _, args = rest.partition(":")
    path = Path(__file__).resolve().parent.parent if folder in ("", ".") else Path(folder)
    if not name or not (path / "ckpt_tool").is_dir():
        return None
    return name.strip(), path, args.split()


def _host_specs(bench: Bench, src: str, host_mesh: str) -> dict[str, list]:
    """The specs ckpt's plan gives each leaf for this host's mesh (orbax's route uses the same)."""
    r = subprocess.run([*bench.python, "-m", "ckpt_tool", "reshard", src, str(bench.work / "unused"), "--mesh", host_mesh,
                        "--dry-run", "--json"], capture_output=True, text=True, cwd=bench.work)
    if r.returncode != 0:
        return {}
    return {lp["leaf"]: lp["new_spec"] or [] for lp in json.loads(r.stdout)["leaves"]}


def missing(names: list[str]) -> list[str]:
    """The requirements of `names` (and theirs, recursively) that no distribution on sys.path provides.

    Any installed version counts: the host's jax, numpy, ... are what the bench measures,
    and pip's resolver would replace them in the --target folder."""
    from importlib import metadata

    from pip._vendor.packaging.requirements import Requirement  # (pip is how tpu_host.sh installs anyway)
    from pip._vendor.packaging.utils import canonicalize_name

    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions() if d.metadata["Name"]}
    wanted: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(n) for n in names]
    while todo:
        req = todo.pop()
        key, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        dist = installed.get(key)
        if dist is None:
            wanted.setdefault(key, req.name + (f"[{','.join(sorted(extras))}]" if extras else "") + str(req.specifier))
            continue
        for text in dist.requires or []:
            dep = Requirement(text)
            # a dependency counts if unconditional, or gated by an extra that was asked for
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append(dep)
    return sorted(wanted.values())


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "missing":
        print(" ".join(missing(sys.argv[2:])))
    elif len(sys.argv) > 1 and sys.argv[1] == "write":
        print(json.dumps(child_write(sys.argv[2])))
    elif len(sys.argv) > 1 and sys.argv[1] == "route":
        print(json.dumps(child_route(json.loads(sys.argv[2]))))
    elif len(sys.argv) > 1 and sys.argv[1] == "verify":
        print(json.dumps(child_verify(json.loads(sys.argv[2]))))
    elif len(sys.argv) > 1 and sys.argv[1] == "hold":
        child_hold()
    elif os.environ.get("MODE") == "ab":
        sys.exit(ab(Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "tpu_host_bench"))))
    elif os.environ.get("MODE") == "profile":
        sys.exit(profile(Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "tpu_host_bench"))))
    else:
        sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "tpu_host_bench"))))
