"""`ckpt reshard`: outputs restored by orbax itself on the new mesh, compared bit for bit.

The reshards run in this process with `--devices N` (no devices needed);
every orbax restore runs in a subprocess that sets its own device count
(other test modules may already have started jax here). The subprocess
restores each output without target arguments (from `_sharding`) and with
target shardings, checks every addressable shard's shape, placement and
bytes against the source, and saves the restored tree again with orbax to
check that our chunk grid is the one orbax writes for that layout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import cli
from ckpt_tool.base.errors import CkptError
from ckpt_tool.ops.reshard import ReshardOptions, parse_mesh, parse_rules, plan_reshard, subchunk_shape
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import ROOT, fixture_path, free_port, run_ckpt, run_two_processes

runner = CliRunner()

# Runs in a subprocess: {"devices": per-process device count, "process_count", "process_id",
# "coordinator", "cases": [{"dst", "src", "modes": ["plain", "target"], "orbax_chunks": bool}]}
RESTORE = r'''
import json, os, sys, tempfile
job = json.loads(sys.argv[1])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=%d" % job["devices"]
import warnings
warnings.filterwarnings("ignore")
import jax
jax.config.update("jax_enable_x64", True)
if job.get("process_count", 1) > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(job["coordinator"], job["process_count"], job["process_id"])
import numpy as np
import orbax.checkpoint as ocp
import ckpt_tool

P = jax.sharding.PartitionSpec

def keypath(path):
    out = []
    for k in path:
        out.append(str(k.key) if isinstance(k, jax.tree_util.DictKey) else str(k.idx))
    return "/".join(out)

def spec_of(sharding):
    return P(*[tuple(e) if isinstance(e, list) else e for e in sharding.partition_spec])

def check(case, mode):
    dst = os.path.abspath(case["dst"])
    src = ckpt_tool.open(case["src"])
    out = ckpt_tool.open(dst)
    ck = ocp.PyTreeCheckpointer()
    if mode == "plain":
        restored = ck.restore(dst)
    else:
        meta = ck.metadata(dst)
        meta = getattr(meta, "item_metadata", meta)
        meta = getattr(meta, "tree", meta)
        def restore_args(path, m):
            leaf = out[keypath(path)]
            if leaf.kind != "array":
                return ocp.RestoreArgs()
            sh = leaf.sharding
            if sh is None:
                return ocp.RestoreArgs(restore_type=np.ndarray)
            devices = jax.devices()[:int(np.prod(sh.mesh_shape))]
            mesh = jax.sharding.Mesh(np.array(devices).reshape(sh.mesh_shape), sh.axis_names)
            return ocp.ArrayRestoreArgs(sharding=jax.sharding.NamedSharding(mesh, spec_of(sh)),
                                        global_shape=m.shape, dtype=m.dtype)
        args = jax.tree_util.tree_map_with_path(restore_args, meta)
        restored = ck.restore(dst, args=ocp.args.PyTreeRestore(restore_args=args))
    flat = {keypath(p): v for p, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
    # every source array is there; values are convert's business (DCP lists become one leaf per item)
    assert set(flat) == {l.path for l in out.leaves}, sorted(set(flat) ^ {l.path for l in out.leaves})
    assert {l.path for l in out.arrays()} == {l.path for l in src.arrays()}
    shards = 0
    for path, value in flat.items():
        if out[path].kind != "array":
            want = src[path].load() if src.format == "orbax" else out[path].load()
            assert np.asarray(value).tolist() == np.asarray(want).tolist(), (path, value)
            continue
        want = src[path]
        sh = out[path].sharding
        if sh is None:  # a host numpy leaf stays one
            assert isinstance(value, np.ndarray), (path, type(value))
            assert value.tobytes() == want.read().tobytes() and value.dtype == want.read().dtype, path
            continue
        assert isinstance(value, jax.Array), (path, type(value))
        assert value.sharding.spec == spec_of(sh), (path, value.sharding.spec, sh.partition_spec)
        if mode == "plain":
            assert [d.id for d in value.sharding.mesh.devices.flat] == list(sh.device_ids), path
        n = {a: s for a, s in zip(sh.axis_names, sh.mesh_shape)}
        entries = list(sh.partition_spec) + [None] * (len(want.shape) - len(sh.partition_spec))
        shard_shape = tuple(
            d // int(np.prod([n[a] for a in ([] if e is None else [e] if isinstance(e, str) else e)]))
            for d, e in zip(want.shape, entries)
        )
        for shard in value.addressable_shards:
            data = np.asarray(shard.data)
            expect = want.read(tuple(shard.index) if want.shape else None)
            assert data.shape == shard_shape, (path, data.shape, shard_shape)
            assert data.dtype == expect.dtype and data.tobytes() == expect.tobytes(), (path, shard.index)
            shards += 1
    if case.get("orbax_chunks") and mode == "target":
        # orbax writes the restored (new-mesh) arrays with the chunk grid we wrote
        tmp = os.path.join(tempfile.mkdtemp(), "again")
        ck.save(tmp, restored)
        doc = json.load(open(os.path.join(tmp, "array_metadatas", "process_0")))
        theirs = {m["array_metadata"]["param_name"]: m["array_metadata"]["write_shape"] for m in doc["array_metadatas"]}
        ours = {l.name: list(l.chunk_shape) for l in out.arrays() if l.sharding is not None}
        assert theirs == ours, {k: (theirs.get(k), ours.get(k)) for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k)}
    return shards

for case in job["cases"]:
    for mode in case["modes"]:
        n = check(case, mode)
        print(json.dumps({"dst": case["dst"], "mode": mode, "shards": n}), flush=True)
'''


def _restore(cases: list[dict], devices: int = 8, timeout: float = 240) -> list[dict]:
    job = {"devices": devices, "cases": cases}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", RESTORE, json.dumps(job)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def reshard(*args: str) -> dict:
    result = runner.invoke(cli, ["reshard", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


RULES = [["dense/kernel$", [None, ["data", "model"]]], ["embed", ["model", "data"]], ["conv$", []]]

# name -> (source fixture, reshard args)
CASES: dict[str, tuple[str, list[str]]] = {
    "one_device": ("orbax_ocdbt_zarr2", ["--mesh", "data=1", "--devices", "1"]),
    "2x4": ("orbax_ocdbt_zarr2", ["--mesh", "data=2,model=4", "--devices", "8"]),
    "8": ("orbax_ocdbt_zarr2", ["--mesh", "data=8", "--devices", "8"]),
    "swapped": ("orbax_plain_zarr2", ["--mesh", "model=4,data=2", "--devices", "8"]),
    "rules_zarr3": ("orbax_ocdbt_zarr3", ["--mesh", "data=4,model=2", "--devices", "8", "--zarr3", "--rules", "RULES"]),
    "fsdp": ("orbax_two_process", ["--mesh", "fsdp=8", "--devices", "8", "--fsdp", "fsdp"]),
    "dcp": ("dcp_multirank", ["--mesh", "data=2,model=4", "--devices", "8", "--fsdp", "model", "--skip-unsupported"]),
}


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    base = tmp_path_factory.mktemp("reshard")
    rules = base / "rules.json"
    rules.write_text(json.dumps(RULES))
    out = {}
    for name, (src, args) in CASES.items():
        dst = base / name
        summary = reshard(str(fixture_path(src)), str(dst), *[str(rules) if a == "RULES" else a for a in args])
        out[name] = (dst, summary)
    return out


@pytest.fixture(scope="module")
def restored(resharded) -> list[dict]:
    """Every output restored in one 8-device orbax process, both ways."""
    cases = [
        {"dst": str(dst), "src": str(fixture_path(CASES[name][0])), "modes": ["plain", "target"],
         "orbax_chunks": True}
        for name, (dst, _) in resharded.items()
    ]
    return _restore(cases)


@pytest.mark.slow
def test_orbax_restores_every_output_bit_for_bit(resharded, restored):
    done = {(r["dst"], r["mode"]) for r in restored}
    assert done == {(str(dst), m) for dst, _ in resharded.values() for m in ("plain", "target")}
    assert all(r["shards"] > 0 for r in restored)
    for dst, _ in resharded.values():
        assert validate_checkpoint(str(dst)).ok(), dst


def _expected_shard(leaf) -> tuple[int, ...]:
    sizes = dict(zip(leaf.sharding.axis_names, leaf.sharding.mesh_shape))
    spec = list(leaf.sharding.partition_spec) + [None] * (len(leaf.shape) - len(leaf.sharding.partition_spec))
    out = []
    for dim, entry in zip(leaf.shape, spec):
        axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
        out.append(dim // int(np.prod([sizes[a] for a in axes])))
    return tuple(out)


@pytest.mark.parametrize("name", list(CASES))
def test_chunks_are_the_new_shards_and_sharding_names_the_mesh(resharded, name):
    dst, summary = resharded[name]
    args = CASES[name][1]
    mesh = parse_mesh(args[args.index("--mesh") + 1])
    out = ckpt_tool.open(str(dst))
    src = ckpt_tool.open(str(fixture_path(CASES[name][0])))
    n_devices = int(np.prod([s for _, s in mesh]))
    assert summary["mesh"]["device_ids"] == list(range(n_devices))
    on_mesh = [l for l in out.arrays() if l.sharding is not None]
    assert on_mesh
    for leaf in on_mesh:
        sh = leaf.sharding
        assert sh.kind == "named"
        assert sh.mesh_shape == tuple(s for _, s in mesh) and sh.axis_names == tuple(a for a, _ in mesh)
        assert sh.device_ids == tuple(range(n_devices))
        shard = _expected_shard(leaf)
        replicas = n_devices // int(np.prod([s // max(1, c) for s, c in zip(leaf.shape, shard)] or [1]))
        # the chunk is the shard, split over its replicas along the first divisible dimension (orbax)
        want = list(shard)
        if replicas > 1 and np.prod(shard) > 0:
            d = next((i for i, s in enumerate(shard) if s % replicas == 0), None)
            if d is not None:
                want[d] //= replicas
        assert leaf.chunk_shape == tuple(want), (leaf.path, leaf.chunk_shape, want)
    # host numpy leaves and values are copied as they are
    for leaf in src.leaves:
        if leaf.kind == "array" and leaf.extra.get("value_type") == "np.ndarray":
            assert out[leaf.path].sharding is None and out[leaf.path].chunk_shape == leaf.chunk_shape


def test_specs_per_case(resharded):
    def spec(name: str, path: str):
        return ckpt_tool.open(str(resharded[name][0]))[path].sharding.partition_spec

    assert spec("2x4", "params/dense/kernel") == ("data", "model")
    assert spec("swapped", "params/dense/kernel") == ("data", "model")  # names kept, mesh axes reordered
    assert spec("one_device", "params/dense/kernel") == ("data",)  # 'model' gone: replicated
    # 'data'=8 does not divide params/conv's 4 rows: that dimension is replicated, and the plan says so
    assert spec("8", "params/conv") == ()
    notes = {(n["leaf"], n["note"]) for n in resharded["8"][1]["notes"]}
    assert ("params/conv", "dimension 0 (size 4) is not divisible by axis 'data' (size 8): replicated") in notes
    assert ("params/dense/kernel", "dimension 1: axis 'model' is not in the new mesh: replicated") in notes
    # rules: first match wins; unmatched leaves keep their recorded spec
    assert spec("rules_zarr3", "params/dense/kernel") == (None, ("data", "model"))
    assert spec("rules_zarr3", "params/embed/table") == ("model", "data")
    assert spec("rules_zarr3", "params/conv") == ()
    assert spec("rules_zarr3", "counters/int32") == ("data", "model")
    assert ckpt_tool.open(str(resharded["rules_zarr3"][0])).layout["zarr"] == 3
    # --fsdp: the largest divisible dimension
    assert spec("fsdp", "params/embed/table") == ("fsdp",)  # 32x8: dim 0
    assert spec("fsdp", "params/proj") == (None, "fsdp")  # 8x16: dim 1
    assert spec("fsdp", "params/conv") == (None, None, "fsdp")  # 4x6x8: dim 2
    assert spec("fsdp", "zero_d") == ()
    # DCP: no recorded spec -> replicated, then --fsdp model
    assert spec("dcp", "model/w") == (None, "model")  # 6x4: only dim 1 divides by 4


def test_dry_run_text_and_json(tmp_path):
    dst = tmp_path / "never"
    src = str(fixture_path("orbax_ocdbt_zarr2"))
    r = runner.invoke(cli, ["reshard", src, str(dst), "--mesh", "data=8", "--devices", "8", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert not dst.exists()
    text = r.output
    assert "data=8: 8 devices (--devices, ids 0..7)" in text
    assert "params/conv float32[4,6,8]  P('data', None, 'model') -> P()" in text
    assert "dimension 0 (size 4) is not divisible by axis 'data' (size 8): replicated" in text
    assert "process 0: " in text and "per device after restore: " in text

    r = runner.invoke(cli, ["reshard", src, str(dst), "--mesh", "data=2,model=4", "--devices", "8",
                            "--num-processes", "2", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    assert not dst.exists()
    assert plan["ok"] and plan["process_count"] == 2 and plan["errors"] == []
    kernel = next(l for l in plan["leaves"] if l["leaf"] == "params/dense/kernel")
    assert kernel["old_spec"] == ["data", "model"] and kernel["new_spec"] == ["data", "model"]
    assert kernel["shard_shape"] == [8, 2] and kernel["chunk_shape"] == [8, 2] and kernel["chunks"] == 8
    table = next(l for l in plan["leaves"] if l["leaf"] == "params/embed/table")
    assert table["replicas"] == 4 and table["split_dim"] == 0 and table["chunk_shape"] == [4, 8]
    # devices 0-3 are process 0's, 4-7 process 1's: 'data' rows split the work in halves
    loads = plan["processes"]
    assert len(loads) == 2 and all(p["chunks"] > 0 for p in loads)
    total = sum(l["shard_bytes"] for l in plan["leaves"] if l["placement"] == "mesh")
    assert plan["device_bytes"] == total
    written = sum(p["bytes_written"] for p in loads)
    assert written == sum(int(np.prod(l["shape"])) * np.dtype(l["dtype"] if l["dtype"] != "bfloat16" else "float16").itemsize
                          for l in plan["leaves"])
    assert all(p["bytes_read"] >= p["bytes_written"] for p in loads)


@pytest.mark.parametrize("mesh, devices", [("data=2,model=4", "8"), ("data=16,model=16", "256")])
def test_one_process_plan_counts_what_the_processes_of_a_split_one_count(tmp_path, mesh, devices):
    """One process's load is taken for the whole leaf at once (no walk over its chunks); it must
    be what the chunk-by-chunk walk of a plan split over processes adds up to."""
    src = str(fixture_path("orbax_ocdbt_zarr2"))

    def plan(processes: int) -> dict:
        r = runner.invoke(cli, ["reshard", src, str(tmp_path / "never"), "--mesh", mesh, "--devices", devices,
                                "--fsdp", "data", "--num-processes", str(processes), "--dry-run", "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)

    one, split = plan(1), plan(2)
    (alone,) = one["processes"]
    for key in ("chunks", "bytes_written"):
        assert alone[key] == sum(p[key] for p in split["processes"]) > 0, key
    # a stored chunk two processes read counts once for each: the whole leaf reads each once
    assert 0 < alone["bytes_read"] <= sum(p["bytes_read"] for p in split["processes"])
    assert alone["source_chunks"] <= sum(p["source_chunks"] for p in split["processes"])
    for a, b in zip(one["leaves"], split["leaves"]):
        assert a["leaf"] == b["leaf"]
        for key in ("chunks", "source_chunks", "source_chunk_bytes", "streamed_chunks"):
            assert a[key] == b[key], (a["leaf"], key)
    assert alone["source_chunks"] == sum(l.get("source_chunks") or 0 for l in one["leaves"])


def test_impossible_rule_fails_before_dst_exists(tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([["kernel$", [None, "model"]], ["conv$", ["data"]], ["zzz", ["nope"]]]))
    work = tmp_path / "work"
    work.mkdir()
    dst = work / "out"
    src = str(fixture_path("orbax_ocdbt_zarr2"))
    r = run_ckpt("reshard", src, str(dst), "--mesh", "data=8", "--devices", "8", "--rules", str(rules))
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    # the leaf, the dimension and the axis (the first failing leaf; the dry run lists all)
    assert line == ("ckpt: error: params/conv: rule 1 'conv$' gives P('data'): dimension 0 (size 4) is not "
                    "divisible by axis 'data' (size 8) (and 1 more; --dry-run lists them)"), line
    assert not dst.exists() and not list(work.iterdir())

    # the dry run lists every failing rule and exits 1
    r = runner.invoke(cli, ["reshard", src, str(dst), "--mesh", "data=8", "--devices", "8",
                            "--rules", str(rules), "--dry-run", "--json"])
    assert r.exit_code == 1
    errors = {e["leaf"]: e["message"] for e in json.loads(r.output)["errors"]}
    assert errors["params/dense/kernel"] == ("rule 0 'kernel$' gives P(None, 'model'): "
                                             "dimension 1: axis 'model' is not in the mesh (data)")
    assert set(errors) == {"params/dense/kernel", "params/conv"}
    assert not dst.exists()


@pytest.mark.parametrize("rules,message", [
    ([["x", ["data", "data"]]], "dimension 1: axis 'data' is already used by dimension 0"),
    ([["x", [None, None, "data"]]], "dimension 2: the array has rank 2 but the spec has 3 entries"),
    ([["x", [["data", "model"]]]], "dimension 0 (size 8) is not divisible by axes ('data', 'model') (size 16)"),
])
def test_spec_checks(rules, message):
    rules = [[r"layers/0/w$", spec] for _, spec in rules]
    plan = plan_reshard(str(fixture_path("orbax_ocdbt_zarr2")), "unused",
                        ReshardOptions(mesh="data=4,model=4", devices=16, rules=rules))
    [bad] = plan.errors
    assert bad.path == "layers/0/w" and bad.error.endswith(message), bad.error


def test_toml_rules_and_bad_inputs(tmp_path):
    toml = tmp_path / "rules.toml"
    toml.write_text('rules = [["kernel$", ["", "model"]], [".*", []]]\n')
    plan = plan_reshard(str(fixture_path("orbax_ocdbt_zarr2")), "unused",
                        ReshardOptions(mesh="data=2,model=4", devices=8, rules=str(toml)))
    specs = {l.path: l.new_spec for l in plan.leaves if l.placement == "mesh"}
    assert specs["params/dense/kernel"] == ((), ("model",))
    assert specs["params/embed/table"] == ((), ())  # the catch-all
    for bad, text in [("data", "NAME=SIZE"), ("data=2,data=4", "named twice"), ("data=0", "at least 1")]:
        with pytest.raises(CkptError, match=text):
            parse_mesh(bad)
    with pytest.raises(CkptError, match="rule 0"):
        parse_rules([["(", []]])
    with pytest.raises(CkptError, match="--devices is 4"):
        plan_reshard(str(fixture_path("orbax_ocdbt_zarr2")), "x", ReshardOptions(mesh="data=8", devices=4))
    with pytest.raises(CkptError, match="--fsdp: axis 'fsdp' is not in the mesh"):
        plan_reshard(str(fixture_path("orbax_ocdbt_zarr2")), "x", ReshardOptions(mesh="data=8", devices=8, fsdp="fsdp"))


def test_subchunking_matches_orbax():
    pytest.importorskip("orbax.checkpoint")
    import ml_dtypes
    from orbax.checkpoint._src.arrays import subchunking

    rng = np.random.default_rng(3)
    for _ in range(200):
        rank = int(rng.integers(1, 4))
        write = tuple(int(x) for x in rng.integers(1, 97, rank))
        glob = tuple(w * int(rng.integers(1, 4)) for w in write)
        dtype = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.int8)][int(rng.integers(0, 3))]
        target = int(rng.integers(dtype.itemsize, np.prod(write) * dtype.itemsize + 1))
        theirs = tuple(subchunking.choose_chunk_shape(glob, write, dtype, target))
        assert subchunk_shape(glob, write, dtype.itemsize, target) == theirs, (glob, write, target)


@pytest.mark.slow
def test_this_machines_devices_or_a_clear_error(tmp_path):
    src = str(fixture_path("orbax_ocdbt_zarr2"))
    one = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    r = run_ckpt("reshard", src, str(tmp_path / "a"), "--mesh", "data=2,model=4", env=one)
    assert r.returncode == 2 and not (tmp_path / "a").exists()  # a usage error: --mesh does not fit this machine
    assert "needs 8 devices but jax sees 1 cpu device here; pass --devices 8" in r.stderr
    eight = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    r = run_ckpt("reshard", src, str(tmp_path / "b"), "--mesh", "data=4,model=2", "--json", env=eight)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["mesh"]["origin"] == "jax" and summary["mesh"]["device_ids"] == list(range(8))




@pytest.mark.slow
def test_two_process_reshard_restores_in_two_and_one_process_jobs(tmp_path):
    src = fixture_path("orbax_ocdbt_zarr2")
    dst = tmp_path / "out"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    outs = run_two_processes(
        [sys.executable, "-m", "ckpt_tool", "reshard", str(src), str(dst), "--mesh", "data=2,model=4", "--json"], env
    )
    summaries = [json.loads(out) for out, _ in outs]
    assert {s["process_index"] for s in summaries} == {0, 1}
    assert all(s["chunks"] > 0 for s in summaries)
    assert sum(s["chunks"] for s in summaries) == sum(l.chunk_count for l in ckpt_tool.open(str(dst)).arrays())
    # each process wrote the chunks of its own devices: the dry run's split for 2 processes
    dry = runner.invoke(cli, ["reshard", str(src), str(tmp_path / "x"), "--mesh", "data=2,model=4", "--devices", "8",
                              "--num-processes", "2", "--dry-run", "--json"])
    assert [p["chunks"] for p in json.loads(dry.output)["processes"]] == [s["chunks"] for s in summaries]
    # jax's own device ids: the second process's CPU devices start at 2048
    assert summaries[0]["mesh"]["device_ids"] == [0, 1, 2, 3, 2048, 2049, 2050, 2051]
    assert (dst / "ocdbt.process_0").is_dir() and (dst / "ocdbt.process_1").is_dir()
    assert validate_checkpoint(str(dst), deep=True).ok()

    # a two-process job restores it, without and with target shardings
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    case = {"dst": str(dst), "src": str(src), "modes": ["plain", "target"]}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RESTORE, json.dumps({
                "devices": 4, "process_count": 2, "process_id": i, "coordinator": f"127.0.0.1:{port}", "cases": [case]})],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    shards = [json.loads(line)["shards"] for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    assert len(shards) == 4 and all(n > 0 for n in shards)
    # and a one-process job with 8 devices (ids 0..7: the recorded 2048.. are not there, so target shardings)
    [res] = _restore([{**case, "modes": ["target"], "orbax_chunks": True}])
    assert res["shards"] > 0


def test_text_summary(tmp_path):
    """Without --json, one summary line: what went where, how much, how fast, per device."""
    src, dst = str(fixture_path("orbax_ocdbt_zarr2")), tmp_path / "out"
    r = runner.invoke(cli, ["reshard", src, str(dst), "--mesh", "data=2,model=4", "--devices", "8"])
    assert r.exit_code == 0, r.output
    summary = [line for line in r.output.splitlines() if line.startswith("resharded ")]
    assert len(summary) == 1, r.output
    assert f"-> {dst} for mesh data=2,model=4 (8 devices): 17 arrays, 2 values" in summary[0]
    # the fixture's two numpy leaves stay host arrays, counted apart (tests/ops/reshard/test_reshard_host_arrays.py)
    assert "/s); " in summary[0] and summary[0].endswith("per device after restore, 116 B in host arrays")
    assert "(process" not in summary[0]  # one process
