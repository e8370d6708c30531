"""`ckpt reshard` of host arrays (issue 45 item 9): leaves orbax saved as numpy arrays, with no sharding.

The source is what a user writes with `ocp.StandardCheckpointer().save(path, {"w": np.ones(...)})`
(saved by orbax in a subprocess: numpy leaves, `value_type` np.ndarray, no `_sharding`). By default
a reshard copies them as they are and now says so, where it said only `0 B per device after
restore`. `--host-arrays-to-mesh` lays them out on the mesh as jax arrays by the rules recorded
arrays follow (`--rules`, then `--fsdp`, else replicated): orbax then restores each as a
`jax.Array` with the recorded sharding, on 8 CPU devices in a subprocess (XLA_FLAGS), as
tests/ops/reshard/test_reshard.py restores its outputs.
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

from conftest import ROOT, fixture_path, run_ckpt
from test_reshard import _restore

runner = CliRunner()

# orbax's own save of numpy leaves (what the user wrote)
SAVE = r'''
import sys, warnings
warnings.filterwarnings("ignore")
import numpy as np
import orbax.checkpoint as ocp
c = ocp.StandardCheckpointer()
c.save(sys.argv[1], {
    "w": np.arange(32, dtype=np.float32).reshape(8, 4),
    "e": (np.arange(128) % 7).astype(np.float16).reshape(16, 8),
    "b": np.arange(6, dtype=np.int64),
    "s": np.float32(3.5),
})
c.wait_until_finished()
'''

# orbax's restore with no target (the shardings from `_sharding`) on 8 CPU devices: per leaf its
# type, partition spec, device ids and values
RESTORE = r'''
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import warnings
warnings.filterwarnings("ignore")
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np
import orbax.checkpoint as ocp
out = {}
for dst in sys.argv[1:]:
    restored = ocp.StandardCheckpointer().restore(os.path.abspath(dst))
    leaves = {}
    for name, v in restored.items():
        entry = {"type": type(v).__name__, "jax": isinstance(v, jax.Array), "values": np.asarray(v).tolist(),
                 "dtype": str(np.asarray(v).dtype)}
        if isinstance(v, jax.Array):
            sh = v.sharding
            entry["spec"] = [list(e) if isinstance(e, tuple) else e for e in sh.spec]
            entry["devices"] = [d.id for d in sh.mesh.devices.flat]
            entry["axis_names"] = list(sh.mesh.axis_names)
            entry["shards"] = sorted({tuple(np.asarray(s.data).shape) for s in v.addressable_shards})
        leaves[name] = entry
    out[dst] = leaves
print(json.dumps(out))
'''

SOURCE = {
    "w": np.arange(32, dtype=np.float32).reshape(8, 4),
    "e": (np.arange(128) % 7).astype(np.float16).reshape(16, 8),
    "b": np.arange(6, dtype=np.int64),
    "s": np.float32(3.5),
}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("host") / "src"
    r = subprocess.run([sys.executable, "-c", SAVE, str(src)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    # what orbax wrote: numpy leaves, with no sharding (the premise, checked)
    meta = json.loads((src / "_METADATA").read_text())["tree_metadata"]
    assert {v["value_metadata"]["value_type"] for v in meta.values()} == {"np.ndarray"}
    assert all(leaf.sharding is None for leaf in ckpt_tool.open(str(src)).arrays())
    return src


def _restored(*dsts: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", RESTORE, *map(str, dsts)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _reshard(*args: str) -> tuple[int, str]:
    r = runner.invoke(cli, ["reshard", *args])
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def outputs(saved, tmp_path_factory) -> dict[str, tuple[Path, str, dict]]:
    """Each --host-arrays-to-mesh case's DST, its text summary and the --json summary of the same
    reshard to a second DST."""
    base = tmp_path_factory.mktemp("outs")
    rules = base / "rules.json"
    rules.write_text(json.dumps([["^w$", ["data", "model"]]]))
    cases = {
        "replicated": ["--host-arrays-to-mesh"],
        "rules_fsdp": ["--host-arrays-to-mesh", "--rules", str(rules), "--fsdp", "model"],
    }
    out = {}
    for name, extra in cases.items():
        args = [str(saved), "--mesh", "data=2,model=4", "--devices", "8", *extra]
        code, text = _reshard(args[0], str(base / name), *args[1:])
        assert code == 0, text
        code, doc = _reshard(args[0], str(base / f"{name}.json"), *args[1:], "--json")
        assert code == 0, doc
        out[name] = (base / name, text, json.loads(doc))
    return out


@pytest.fixture(scope="module")
def restored(outputs) -> dict:
    dsts = [dst for dst, _, _ in outputs.values()]
    got = _restored(*dsts)
    return {name: got[str(dst)] for name, (dst, _, _) in outputs.items()}


def _check_values(leaves: dict) -> None:
    for name, want in SOURCE.items():
        assert leaves[name]["values"] == np.asarray(want).tolist(), name
        assert leaves[name]["dtype"] == str(np.asarray(want).dtype), name


def test_host_arrays_are_said_to_stay_host_arrays(saved, tmp_path):
    """Without the flag: the summary names the host arrays, says they stay so and names the flag,
    where it said only `0 B per device after restore`; --json lists them; orbax restores numpy."""
    dst = tmp_path / "kept"
    args = ["--mesh", "data=2,model=4", "--devices", "8"]
    code, text = _reshard(str(saved), str(dst), *args)
    assert code == 0, text
    code, out = _reshard(str(saved), str(tmp_path / "kept.json"), *args, "--json")
    assert code == 0, out
    doc = json.loads(out)
    lines = text.strip().splitlines()
    assert lines[0] == ("4 host arrays (b, e, s and 1 more), saved as numpy with no sharding, stay so: orbax "
                        "restores them on no device (--host-arrays-to-mesh lays them out on the mesh)"), text
    assert lines[-1].endswith("; 0 B per device after restore, 436 B in host arrays"), text
    assert doc["host_arrays"] == ["b", "e", "s", "w"] and doc["host_bytes"] == 436 and doc["device_bytes"] == 0
    meta = json.loads((dst / "_METADATA").read_text())["tree_metadata"]
    assert {v["value_metadata"]["value_type"] for v in meta.values()} == {"np.ndarray"}
    assert all(leaf.sharding is None for leaf in ckpt_tool.open(str(dst)).arrays())
    restored = _restored(dst)[str(dst)]
    assert all(not leaf["jax"] and leaf["type"] == "ndarray" for leaf in restored.values())
    _check_values(restored)


def test_host_arrays_laid_out_on_the_mesh_restore_as_jax_arrays_with_the_recorded_shardings(outputs, restored):
    """--host-arrays-to-mesh: `--rules` first (w), then `--fsdp` (e: 16x8, dim 0 over 'model'; b: 6
    is not divisible by 4), else replicated (s, a 0-d array); orbax restores every leaf as a
    jax.Array with the spec and device ids `_sharding` records, each shard the new shard shape."""
    want = {
        "replicated": {"w": [], "e": [], "b": [], "s": []},
        "rules_fsdp": {"w": ["data", "model"], "e": ["model"], "b": [], "s": []},
    }
    shards = {"w": [(4, 1)], "e": [(4, 8)]}
    for case, specs in want.items():
        dst, text, doc = outputs[case]
        assert doc["host_arrays"] == [] and doc["host_bytes"] == 0
        assert "host arrays" not in text.strip().splitlines()[-1], text
        recorded = {leaf.path: leaf.sharding for leaf in ckpt_tool.open(str(dst)).arrays()}
        leaves = restored[case]
        _check_values(leaves)
        for name, spec in specs.items():
            sh = recorded[name]
            assert sh is not None and sh.kind == "named", (case, name)
            assert sh.mesh_shape == (2, 4) and sh.axis_names == ("data", "model") and sh.device_ids == tuple(range(8))
            assert [e for e in sh.partition_spec if e is not None] == spec, (case, name, sh.partition_spec)
            got = leaves[name]
            assert got["jax"], (case, name, got["type"])
            assert [e for e in got["spec"] if e is not None] == spec, (case, name, got["spec"])
            assert got["devices"] == list(range(8)) and got["axis_names"] == ["data", "model"]
            shape = np.asarray(SOURCE[name]).shape
            expect = shards.get(name, [shape]) if case == "rules_fsdp" else [shape]
            assert [tuple(s) for s in got["shards"]] == [tuple(s) for s in expect], (case, name, got["shards"])
    # the device bytes count them: w 128/8 + e 256/4 + b 48 + s 4
    assert outputs["rules_fsdp"][2]["device_bytes"] == 16 + 64 + 48 + 4
    assert outputs["replicated"][2]["device_bytes"] == 436
    notes = {(n["leaf"], n["note"]) for n in outputs["replicated"][2]["notes"]}
    assert ("w", "host array: replicated") in notes


def test_the_plan_says_where_each_host_arrays_spec_came_from(saved, tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([["^w$", ["data", "model"]]]))
    args = [str(saved), str(tmp_path / "never"), "--mesh", "data=2,model=4", "--devices", "8", "--dry-run"]
    code, out = _reshard(*args, "--json")
    assert code == 0, out
    plan = {leaf["leaf"]: leaf for leaf in json.loads(out)["leaves"]}
    assert {leaf["placement"] for leaf in plan.values()} == {"host"}
    code, text = _reshard(*args)
    assert code == 0 and "(restored as numpy arrays, on no device; --host-arrays-to-mesh lays them out on the mesh)" in text
    code, out = _reshard(*args, "--json", "--host-arrays-to-mesh", "--rules", str(rules), "--fsdp", "model")
    assert code == 0, out
    plan = {leaf["leaf"]: leaf for leaf in json.loads(out)["leaves"]}
    assert {leaf["placement"] for leaf in plan.values()} == {"mesh"}
    assert plan["w"]["origin"] == "rule 0 '^w$'" and plan["w"]["old"] == "host array"
    assert plan["e"]["origin"] == "host array + --fsdp model" and plan["e"]["new_spec"] == ["model"]
    assert plan["s"]["origin"] == "host array" and plan["s"]["new_spec"] == []
    assert not (tmp_path / "never").exists()


def test_a_rule_that_does_not_fit_a_host_array_is_refused_before_dst(saved, tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([["^b$", ["model"]]]))
    (tmp_path / "outs").mkdir()
    r = run_ckpt("reshard", str(saved), str(tmp_path / "outs" / "dst"), "--mesh", "data=2,model=4", "--devices", "8",
                 "--host-arrays-to-mesh", "--rules", str(rules))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "b: rule 0 '^b$' gives P('model'): dimension 0 (size 6) is not divisible by axis 'model' (size 4)" in r.stderr
    assert not list((tmp_path / "outs").iterdir())


@pytest.mark.slow
def test_a_checkpoint_of_jax_and_host_arrays_restores_bit_for_bit_with_orbaxs_chunk_grid(tmp_path):
    """orbax_ocdbt_zarr2 (jax arrays with recorded specs, and two host numpy arrays), resharded with
    --host-arrays-to-mesh --fsdp model: the recorded arrays keep their specs, the host ones are split
    over 'model'; orbax restores all as jax.Arrays shard by shard, with and without target shardings,
    and saving them again writes the chunk grid ckpt wrote (tests/ops/reshard/test_reshard.py's check)."""
    src = fixture_path("orbax_ocdbt_zarr2")
    dst = tmp_path / "dst"
    code, out = _reshard(str(src), str(dst), "--mesh", "data=2,model=4", "--devices", "8", "--host-arrays-to-mesh",
                         "--fsdp", "model", "--json")
    assert code == 0, out
    leaves = {leaf.path: leaf for leaf in ckpt_tool.open(str(dst)).arrays()}
    assert leaves["host/np_f32"].sharding is not None and leaves["host/np_i64"].sharding is not None
    assert leaves["params/dense/kernel"].sharding.partition_spec == ("data", "model")
    done = _restore([{"dst": str(dst), "src": str(src), "modes": ["plain", "target"], "orbax_chunks": True}])
    assert [r["mode"] for r in done] == ["plain", "target"] and all(r["shards"] > 0 for r in done)
