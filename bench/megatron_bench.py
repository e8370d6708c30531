#!/usr/bin/env python3
"""Benchmark `ckpt convert --to safetensors` of a 2 GiB Megatron-Core torch_dist save against Megatron's own route.

    python bench/megatron_bench.py [--runs N] [--settle S] [--json] [--regen]

Input (built once into bench/out/megatron_2gib, stamped by megatron_2gib.done.json, --regen rebuilds it):
a Megatron-Core 0.16.1 `torch_dist` checkpoint written by megatron-core's own `dist_checkpointing.save`
from 4 gloo processes (TP 2 x DP 2) on CPU, the way fixtures/gen_megatron.py writes its
megatron_torch_dist_tp2_dp2 fixture (same venv, build/venv-megatron-0.16, and the same CUDA shims):
a real GPTModel (local layer spec, 6 layers, hidden 1024, 16 heads, FFN 4096, vocab 51200, 2048
positions, untied output layer; 182M parameters) in bf16 (Float16Module), wrapped in megatron's
DistributedDataParallel with the distributed optimizer, `get_megatron_optimizer` (Adam) after one step
on seeded gradients, saved as `{'model', 'optimizer'}` with Megatron-LM 0.16's default metadata
(`distrib_optim_sharding_type='dp_reshardable'`). So the checkpoint holds the bf16 model tensors
(stacked layers, TP chunks) and, per TP rank, the optimizer's fp32 `param` / `exp_avg` /
`exp_avg_sq` as flat 1-D bucket buffers (one bucket per buffer: megatron's DDP default without
--overlap-grad-reduce) with DP-rank and padding chunks; about 2.4 GiB in 8 .distcp files. Values are
seeded normals per (key, offset), so replicas agree; megatron's own initialisation is skipped
(perform_initialization=False) because every value is overwritten anyway.

  ckpt      ckpt convert SRC DST --to safetensors --memory 512MiB --skip-unsupported --json
            (--skip-unsupported: the ShardedObjects, `_extra_state` None values, the optimizer's param
            groups and per-bucket sizes, and common.pt's strings are not tensors; safetensors holds
            tensors only. The optimizer buckets are converted as the 1-D tensors they are stored as.)
  baseline  in the megatron venv, one process (gloo group of 1): megatron-core's
            `dist_checkpointing.load_plain_tensors(SRC)` (load_tensors_metadata + `load` of every
            tensor at its full shape: megatron's own full load, the first step of every Megatron ->
            HF export) + `safetensors.torch.save_file` of all the tensors it returns
  cp        cp -r SRC DST

The protocol is convert_bench's (whose runner this reuses): whole processes, SRC in the page cache,
one checked warm-up (ckpt's JSON: the tensor count and bytes megatron's load_tensors_metadata gives,
skipped leaves all non-tensors; `ckpt diff SRC DST --values` finds no difference but those skipped
leaves, every tensor bit-identical; the baseline reports the same count and bytes, and `ckpt diff`
of its output with SRC finds its every tensor the same, so ckpt's output equals megatron's own load
tensor for tensor; the diffs run with --memory 1GiB, see DIFF_MEMORY), then N timed runs after a sync
and a --settle pause; the best wall time counts, peak RSS is the largest of the timed runs (the
baseline's is reported beside ckpt's).

Targets (issue 20): baseline wall / ckpt wall >= 3x; ckpt peak RSS <= 640 MiB (--memory 512MiB + 128 MiB);
and, as for the other conversions, ckpt wall / cp -r wall <= 3x. Exit 0 when every command ran and checked out.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(HERE)
# The generator's processes run this file inside the megatron venv, which has neither ckpt's
# dependencies nor the other benches' (jax, orbax); they set this and import only what they use.
_GENERATOR_ENV = "CKPT_MEGATRON_BENCH_GENERATOR"
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.environ.get(_GENERATOR_ENV) != "1":
    import convert_bench as cb  # noqa: E402  (runner, checks, settle protocol, printing)
    import inspect_bench as ib  # noqa: E402

CACHE_VERSION = 1
MEMORY = "512MiB"
RSS_TARGET_MIB = 640
DIRECTION = "megatron->safetensors"
MEGATRON_FAMILY = "0.16"  # fixtures/gen_megatron.py's venv: megatron-core 0.16.1, torch 2.13.0
SAFETENSORS_PIN = "safetensors==0.8.0"  # the baseline's writer, the version ckpt's own venv has
TP, DP = 2, 2
# GPTModel config: 6 x 12.6M layer params + 2 x 52.4M (embedding, output layer) + 2.1M positions = 182M;
# 2 bytes (bf16 model) + 12 bytes (fp32 main param, exp_avg, exp_avg_sq) per param = 2.4 GiB.
LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 6, 1024, 16, 51200, 2048
GEN_TIMEOUT_S = 1800
# Outputs go to a folder of this bench's own (not convert_bench's tmp_convert, which other benches
# empty when they start), deleted after every run outside the timed region.
TMP = os.path.join(REPO_DIR, "bench", "out", "tmp_megatron")

# Megatron's own full load + safetensors save. prints: <tensors> <bytes saved>
BASELINE = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.serialization import load_plain_tensors
from safetensors.torch import save_file
src, dst = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
# megatron's load asks torch.distributed for its rank: one process, a group of one
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
state = load_plain_tensors(src)  # every ShardedTensor at its full shape (load() also merges common.pt in)
tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
os.makedirs(dst)
save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
print(len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()))
dist.destroy_process_group()
"""


# --------------------------------------------------------------------------
# the checkpoint: megatron-core's own save from 4 gloo processes (megatron venv)
# --------------------------------------------------------------------------


def _gen_megatron():
    """fixtures/gen_megatron.py as a module: its venv builder, CUDA shims and unwrap helper."""
    fixtures = os.path.join(REPO_DIR, "fixtures")
    if fixtures not in sys.path:
        sys.path.insert(0, fixtures)
    import gen_megatron

    return gen_megatron


def _seeded(sharded_sd: dict, salt: str, scale: float) -> dict:
    """{data_ptr: (ShardedTensor, this rank's values)} for every model ShardedTensor.

    Unlike gen_megatron's _seeded_values (which draws each key's whole logical tensor on every
    rank and slices it), each rank draws only its own piece, seeded by (salt, key, global offset):
    replicas (DP ranks, TP-replicated layer norms) still agree, at 1/4 of the work and memory.
    """
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    out = {}
    for sh in nested_values(sharded_sd):
        if not isinstance(sh, ShardedTensor) or sh.data is None:
            continue
        tag = f"{salt}:{sh.key}:{tuple(sh.global_offset)}".encode()
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(tag).digest()[:8], "little") >> 1)
        out[sh.data.data_ptr()] = (sh, torch.randn(tuple(sh.data.shape), generator=gen) * scale)
    return out


def _gen_write(rank: int, out: str, gm) -> None:
    """One rank: the model, DDP + distributed optimizer after one Adam step, dist_checkpointing.save."""
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        perform_initialization=False, tensor_model_parallel_size=TP, params_dtype=torch.bfloat16, bf16=True,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    model = Float16Module(config, model)  # what Megatron-LM's get_model does for --bf16
    # From here on as gen_megatron's _ddp_and_distributed_optimizer (megatron_torch_dist_tp2_dp2).
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    with torch.no_grad():  # values first: the optimizer copies them into its fp32 main params
        for sh, value in _seeded(gm._unwrap(ddp).sharded_state_dict(), "value", 0.02).values():
            sh.data.copy_(value.to(sh.data.dtype))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True, clip_grad=0.0), [ddp]
    )
    by_ptr = {p.data_ptr(): p for p in ddp.module.parameters()}
    for ptr, (_, g) in _seeded(gm._unwrap(ddp).sharded_state_dict(), "grad", 0.001).items():
        by_ptr[ptr].main_grad.copy_(g.reshape(by_ptr[ptr].shape))
    # ChainedOptimizer.step's grad norm needs CUDA kernels; with clip_grad=0 it only reports
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt.prepare_grads()
        opt.step_with_ready_grads()
    # Megatron-LM 0.16's default metadata (checkpointing.py::_build_sharded_state_dict_metadata)
    metadata = {
        "distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    state_dict = {"model": gm._unwrap(ddp).sharded_state_dict(metadata=metadata)}
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata)
    t0 = time.monotonic()
    dist_checkpointing.save(state_dict, out, content_metadata={k: v for k, v in metadata.items() if k != "dp_cp_group"})
    if rank == 0:
        print(f"[megatron_bench] dist_checkpointing.save took {time.monotonic() - t0:.1f} s", flush=True)


def _gen_worker(rank: int, world: int, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    gm = _gen_megatron()
    gm._cpu_shims()  # megatron's CUDA calls that change no written byte, patched to CPU
    # No barrier on failure: the other ranks may be waiting in a collective, and mp.spawn ends them
    # when this one raises.
    _gen_write(rank, out, gm)
    dist.barrier()
    dist.destroy_process_group()


def _generate(path: str) -> None:
    """Inside the megatron venv: the 4-process save, then megatron's own tally of its tensors (one JSON line)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    t0 = time.monotonic()
    os.makedirs(path)  # dist_checkpointing.save writes into an existing directory
    mp.spawn(_gen_worker, args=(TP * DP, path), nprocs=TP * DP, join=True)
    saved_s = time.monotonic() - t0
    from megatron.core.dist_checkpointing.serialization import load_tensors_metadata

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    meta = load_tensors_metadata(path)
    dist.destroy_process_group()
    sizes = {k: (sh.global_shape, sh.dtype.itemsize) for k, sh in meta.items()}
    nbytes = {k: _numel(shape) * item for k, (shape, item) in sizes.items()}
    model = [k for k in nbytes if not k.startswith("optimizer.")]
    print(json.dumps({
        "arrays": len(nbytes), "bytes": sum(nbytes.values()),
        "model_arrays": len(model), "model_bytes": sum(nbytes[k] for k in model),
        "largest": max(nbytes.values()), "save_s": round(saved_s, 1),
    }))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def megatron_python() -> str:
    """The megatron-core 0.16 venv's python (gen_megatron builds it if missing), with safetensors in it."""
    python = str(_gen_megatron().ensure_venv(MEGATRON_FAMILY))
    probe = subprocess.run([python, "-c", "import safetensors"], capture_output=True)
    if probe.returncode != 0:
        proc = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", SAFETENSORS_PIN],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise SystemExit(f"could not install {SAFETENSORS_PIN} in the megatron venv: {' / '.join(tail)}")
    return python


def ensure_checkpoint(regen: bool, log) -> tuple[str, dict]:
    """(path, stamp): the cached checkpoint, generated first when missing or --regen."""
    path = os.path.join(ib.OUT, "megatron_2gib")
    if not regen and ib.is_cached(path, CACHE_VERSION):
        with open(path + ".done.json") as f:
            return path, json.load(f)
    ib.clear_cached(path)
    os.makedirs(ib.OUT, exist_ok=True)
    free = shutil.disk_usage(ib.OUT).free
    if free < 8 * 2**30:
        raise SystemExit(f"not enough disk for the 2.4 GiB Megatron save and its copies: {free / 2**30:.1f} GiB "
                         f"free in {ib.OUT}")
    python = megatron_python()
    log(f"generating the Megatron torch_dist save (4 gloo processes, megatron-core {MEGATRON_FAMILY}) -> "
        f"{os.path.relpath(path, ib.REPO)} ...")
    t0 = time.monotonic()
    tmp = path + ".tmp"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({_GENERATOR_ENV: "1", "PYTHONNOUSERSITE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(ib.free_port()), "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1"})
    proc = subprocess.run([python, os.path.abspath(__file__), "--generate", tmp], cwd=ib.OUT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=GEN_TIMEOUT_S)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not os.path.isfile(os.path.join(tmp, "metadata.json")) or not lines:
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(f"generating the Megatron save failed (exit {proc.returncode})")
    tally = json.loads(lines[-1])
    os.rename(tmp, path)
    files, size = ib._dir_stats(path)
    stamp = {"cache_version": CACHE_VERSION, "writer": f"megatron-core {MEGATRON_FAMILY} dist_checkpointing.save",
             "processes": TP * DP, "tp": TP, "dp": DP,
             "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB, "seq": SEQ},
             **tally, "files": files, "size": size, "seconds": round(time.monotonic() - t0, 1)}
    with open(path + ".done.json", "w") as f:
        json.dump(stamp, f)
    log(f"  {tally['arrays']} tensors, {tally['bytes'] / 2**30:.2f} GiB ({size / 2**30:.2f} GiB on disk, "
        f"{files} files) in {stamp['seconds']:.0f} s")
    return path, stamp


# --------------------------------------------------------------------------
# commands and checks
# --------------------------------------------------------------------------


def _dst(name: str) -> str:
    return os.path.join(TMP, name)


def _clean_tmp() -> None:
    cb.clean_dir(TMP)


def commands(src: str, python: str) -> list[dict]:
    py = sys.executable
    dst = _dst("ckpt-megatron-to-safetensors")
    return [
        {"name": "ckpt-megatron-to-safetensors", "direction": DIRECTION, "role": "ckpt", "workers": cb.DEFAULT_WORKERS,
         "src": src, "outputs": [dst],
         "argv": [py, "-m", "ckpt_tool", "convert", src, dst, "--to", "safetensors", "--memory", MEMORY,
                  "--skip-unsupported", "--json"],
         "label": f"ckpt convert --to safetensors --memory {MEMORY}"},
        {"name": "megatron-baseline", "direction": DIRECTION, "role": "baseline", "src": src,
         "outputs": [_dst("megatron-baseline")], "argv": [python, "-c", BASELINE, src, _dst("megatron-baseline")],
         "label": "megatron load_plain_tensors + safetensors save_file"},
        {"name": "cp-megatron", "direction": DIRECTION, "role": "cp", "src": src, "outputs": [_dst("cp-megatron")],
         "argv": ["cp", "-r", "--", src, _dst("cp-megatron")], "label": "cp -r SRC DST"},
    ]


def check_ckpt_json(cmd: dict, text: str, stamp: dict) -> tuple[list[str], list[str]]:
    """(errors, skipped leaf paths) of ckpt's --json answer."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return [f"output is not JSON: {exc}"], []
    want = {"source_format": "megatron", "target_format": "safetensors", "arrays": stamp["arrays"],
            "bytes": stamp["bytes"], "cast": [], "process_count": 1}
    errors = [f"{k} is {doc.get(k)!r}, expected {v!r}" for k, v in want.items() if doc.get(k) != v]
    skipped = doc.get("skipped") or []
    # only what safetensors cannot hold may be left out: never a tensor
    errors += [f"skipped {s.get('leaf')}: {s.get('reason')}" for s in skipped
               if "holds tensors and numbers only" not in str(s.get("reason"))]
    if not os.path.isdir(cmd["outputs"][0]):
        errors.append("DST was not created")
    return errors, [s.get("leaf") for s in skipped]


# ckpt diff holds a chunk of each side at once: the optimizer buckets are one 352 MiB tensor each in a
# safetensors file, one stored chunk with no streaming read, so diff needs 2 x 352 MiB (it says so under
# its default budget). Not timed, not a target: only the check.
DIFF_MEMORY = "1GiB"
# ckpt reads a plain safetensors file's names split at every dot, megatron's keys keep the dots inside
# their "dtype_(torch.bfloat16, torch.float32)" part: the baseline's output is matched after this rename.
DTYPE_RENAME = r"torch/(bfloat16|float32)=torch.\1"


def _ckpt_diff(a: str, b: str, log, rename: str | None = None) -> tuple[dict | None, dict, str | None]:
    """(doc, info, error) of `ckpt diff A B --values --json` (not timed)."""
    argv = [sys.executable, "-m", "ckpt_tool", "diff", a, b, "--values", "--memory", DIFF_MEMORY, "--json"]
    if rename:
        argv += ["--rename", rename]
    log(f"  checking: ckpt diff --values {os.path.relpath(a, ib.REPO)} {os.path.relpath(b, ib.REPO)} ...")
    r = ib.run_once(argv, capture=True)
    info = {"rc": r["rc"], "wall_s": round(r["wall"], 3), "peak_rss_kib": r["rss_kib"]}
    try:
        doc = json.loads(r["stdout"])
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or "differences" not in doc:
        tail = (r["stderr"].strip().splitlines() or ["(no stderr)"])[-1]
        return None, info, f"ckpt diff exit {r['rc']}: {tail}"
    info.update(compared=doc.get("compared"), differences=len(doc["differences"]))
    return doc, info, None


def run_diff(cmd: dict, stamp: dict, skipped: list[str], log) -> tuple[list[str], dict]:
    """ckpt's output against SRC: every tensor bit-identical, and the only differences the non-tensor
    leaves convert reported as skipped."""
    doc, info, error = _ckpt_diff(cmd["src"], cmd["outputs"][0], log)
    if error:
        return [error], info
    diffs = doc["differences"]
    errors = [f"ckpt diff --values: {d.get('kind')} {d.get('path')}: {d.get('message')}"
              for d in diffs if d.get("kind") != "only_a" or d.get("path") not in skipped][:5]
    if {d.get("path") for d in diffs} != set(skipped):
        errors.append(f"ckpt diff found {len(diffs)} leaves only in SRC, convert skipped {len(skipped)}")
    if doc.get("values") is not True or (doc.get("compared") or 0) < stamp["arrays"]:
        errors.append(f"ckpt diff compared {doc.get('compared')} leaves by value, expected >= {stamp['arrays']}")
    return errors, info


def run_baseline_diff(cmd: dict, stamp: dict, log) -> tuple[list[str], dict]:
    """The baseline's output (megatron's own full load) against SRC as ckpt reads it: every tensor
    bit-identical. With run_diff this makes ckpt's output equal to megatron's load, tensor for tensor."""
    doc, info, error = _ckpt_diff(cmd["outputs"][0], cmd["src"], log, rename=DTYPE_RENAME)
    if error:
        return [error], info
    errors = [f"ckpt diff --values: {d.get('kind')} {d.get('path')}: {d.get('message')}"
              for d in doc["differences"] if d.get("kind") != "only_b"][:5]
    if doc.get("values") is not True or doc.get("compared") != stamp["arrays"]:
        errors.append(f"ckpt diff compared {doc.get('compared')} tensors by value, expected {stamp['arrays']}")
    return errors, info


def check_baseline_output(cmd: dict, text: str, stamp: dict) -> list[str]:
    try:
        nums = [int(w) for w in text.split()]
    except ValueError:
        return [f"unexpected output {text.strip()[:200]!r}"]
    errors = [] if nums == [stamp["arrays"], stamp["bytes"]] else [f"the baseline reported {text.strip() or 'nothing'!r}"]
    got = cb._tree_bytes(cmd["outputs"][0])
    if got < stamp["bytes"]:
        errors.append(f"{os.path.relpath(cmd['outputs'][0], ib.REPO)} holds {got} bytes")
    return errors


def run_command(cmd: dict, runs: int, log, settle_s: float, stamp: dict) -> dict:
    res = dict(name=cmd["name"], direction=cmd["direction"], role=cmd["role"], workers=cmd.get("workers"),
               command=cmd["label"], ok=True, error=None, warmup_s=None, best_s=None, runs_s=[], best_cpu_s=None,
               cpu_s=[], peak_rss_kib=None, rss_kib=[], loadavg_1min_before=round(os.getloadavg()[0], 2),
               output=None, diff=None, skipped=None, check_errors=[])
    warm = cb.warm_up(cmd, res, runs, log, _clean_tmp)
    if warm is None:
        return res
    if cmd["role"] == "ckpt":
        res["check_errors"], skipped = check_ckpt_json(cmd, warm["stdout"], stamp)
        res["skipped"] = len(skipped)
        if not res["check_errors"]:
            errors, res["diff"] = run_diff(cmd, stamp, skipped, log)
            res["check_errors"] += errors
    elif cmd["role"] == "baseline":
        res["output"] = warm["stdout"].strip()
        res["check_errors"] = check_baseline_output(cmd, warm["stdout"], stamp)
        if not res["check_errors"]:
            errors, res["diff"] = run_baseline_diff(cmd, stamp, log)
            res["check_errors"] += errors
    else:
        res["check_errors"] = cb.check_cp(cmd)
    if res["check_errors"]:
        res["ok"] = False
    res["settle_s"] = settle_s
    cb.timed_runs(cmd, res, runs, _clean_tmp, settle_s)
    return res


def compute_targets(results: list[dict]) -> list[dict]:
    return cb.conversion_targets({r["name"]: r for r in results}, DIRECTION, "ckpt-megatron-to-safetensors",
                                 "megatron-baseline", "cp-megatron", baseline_target=3.0,
                                 rss_target_mib=RSS_TARGET_MIB)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(_GENERATOR_ENV) == "1" and len(argv) == 2 and argv[0] == "--generate":
        # internal, in the megatron venv: convert_bench (and its parser) is not imported there
        _generate(argv[1])
        return 0
    ap = cb.bench_parser(__doc__, "rebuild the cached Megatron save in bench/out/", settle_default=None,
                         settle_help="sync, then pause S seconds before every timed run (default: convert_bench's)")
    args = ap.parse_args(argv)
    if args.generate:  # internal, in the megatron venv
        _generate(args.generate)
        return 0
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    settle = cb.DEFAULT_SETTLE_S if args.settle is None else args.settle
    if settle < 0:
        ap.error("--settle must not be negative")
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    load_at_start = os.getloadavg()[0]
    src, stamp = ensure_checkpoint(args.regen, log)
    python = megatron_python()
    _clean_tmp()
    results, loads = [], {DIRECTION: round(os.getloadavg()[0], 2)}
    for cmd in commands(src, python):
        results.append(run_command(cmd, args.runs, log, settle, stamp))
    failed = any(not r["ok"] for r in results)
    targets = compute_targets(results)
    if os.path.isdir(TMP):
        shutil.rmtree(TMP)
    report = {
        **ib.report_header("megatron", load_at_start, loads),
        "bytes": stamp["bytes"], "arrays": stamp["arrays"], "model_arrays": stamp["model_arrays"],
        "model_bytes": stamp["model_bytes"], "files": stamp["files"], "size_on_disk": stamp["size"],
        "checkpoint": {k: stamp[k] for k in ("writer", "processes", "tp", "dp", "model")},
        "memory": MEMORY, "runs": args.runs, "settle_s": settle,
        "checkpoints": {"megatron": os.path.relpath(src, ib.REPO)},
        "results": results, "targets": targets, "ok": not failed,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 1 if failed else 0


def _print_report(report: dict) -> None:
    print()
    c = report["checkpoint"]
    m = c["model"]
    print(f"megatron bench: {c['writer']} from {c['processes']} processes (TP {c['tp']} x DP {c['dp']}), GPTModel "
          f"{m['layers']} layers, hidden {m['hidden']}, vocab {m['vocab']}, bf16 + distributed optimizer "
          f"(dp_reshardable); {report['arrays']} tensors, {report['bytes'] / 2**30:.2f} GiB (model "
          f"{report['model_arrays']} tensors, {report['model_bytes'] / 2**30:.2f} GiB; the rest the optimizer's "
          f"1-D bucket buffers, converted as they are)")
    print(f"best of {report['runs']} runs after 1 warm-up, sync + {report['settle_s']:g} s pause before each, "
          f"{report['machine']['cpus']} cpus, warm page cache for SRC")
    cb.print_load(report)
    print()
    print(f"megatron -> safetensors  (SRC {report['checkpoints']['megatron']})")
    cb.print_rows(report["results"], _note)
    print()
    for q in report["targets"]:
        what = {"baseline/ckpt": "megatron-baseline / ckpt", "ckpt/cp": "ckpt / cp -r", "ckpt_rss_mib": "ckpt peak RSS"}
        cb.print_target(f"  {what[q['what']]}", q)
    print()


def _note(r: dict) -> str:
    if not r.get("diff"):
        return ""
    if r["role"] == "ckpt":
        return f" (diff --values with SRC: same but the {r['skipped']} skipped non-tensors, {r['diff']['wall_s']:.1f}s)"
    return f" (diff --values with SRC: its {r['diff']['compared']} tensors the same, {r['diff']['wall_s']:.1f}s)"


def summary_rows(doc: dict) -> list[dict]:
    """This bench's rows for run_all's overall table (the same form as convert_bench's)."""
    return cb.summary_rows(doc, bench="megatron")


if __name__ == "__main__":
    sys.exit(main())
