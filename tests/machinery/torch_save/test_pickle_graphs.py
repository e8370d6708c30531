"""Shared references and self-reference in torch.save objects (issue 29): each object walked once.

torch.load gives an object graph: `x = [x, x]` sixty levels deep is a 2 KB file whose tree has
2**60 paths, and a dict may hold itself. Every input here is written by the real torch.save (a
plain object, or a real DeepSpeed / Megatron fixture loaded with torch.load, given a shared or
self-referencing entry and saved again); each command runs in a subprocess with a deadline (the
walk used to be a tree walk: no end, or `internal error: RecursionError`) and its answers are
compared with what torch.load gives.
"""
from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "fixtures"
DEADLINE = 60  # seconds; each of these commands takes about one on a 2 KB file
LEVELS = 60


def ckpt(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """Run the CLI; a command still running after DEADLINE fails the test (it used to run forever)."""
    try:
        r = subprocess.run([sys.executable, "-m", "ckpt_tool", *args], capture_output=True, text=True,
                           timeout=DEADLINE, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckpt {' '.join(args)} still running after {DEADLINE} s")
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def leaves_json(path: Path, *extra: str) -> dict[str, dict]:
    out = json.loads(ckpt("inspect", "--json", "--values", str(path), *extra).stdout)
    return {"/".join(map(str, leaf["keys"])): leaf for leaf in out["leaves"]}


def doubled(inner: Any, levels: int = LEVELS) -> Any:
    """[[inner, inner], [inner, inner]] ... `levels` deep: one list per level in the pickle."""
    x = inner
    for _ in range(levels):
        x = [x, x]
    return x


def at(obj: Any, keys: list) -> Any:
    for k in keys:
        obj = obj[k]
    return obj


def assert_doubled(value: Any, inner: Any, levels: int = LEVELS) -> None:
    """`value` is `levels` of [x, x] around `inner`, each level one shared list (walked down one side)."""
    for _ in range(levels):
        assert isinstance(value, list) and len(value) == 2 and value[0] is value[1]
        value = value[0]
    assert value == inner


def check_commands(path: Path) -> None:
    """inspect (text, --values, --json --values), validate and validate --deep finish and succeed."""
    ckpt("inspect", str(path))
    ckpt("inspect", "--values", str(path))
    ckpt("inspect", "--json", "--values", str(path))
    assert "OK" in ckpt("validate", str(path)).stdout
    assert "OK" in ckpt("validate", "--deep", str(path)).stdout


def check_references(leaves: dict[str, dict], loaded: Any, prefix: int = 0) -> int:
    """Each reference leaf names a path at which torch.load's object is the very same one."""
    n = 0
    for path, leaf in leaves.items():
        if leaf.get("value_type") != "reference":
            continue
        keys = leaf["keys"][prefix:]
        first = leaf["value"].removeprefix("<the same object as ").removesuffix(">")
        first_keys = [] if first == "the top-level object" else [int(k) if k.isdigit() else k
                                                                  for k in first.split(".")][prefix:]
        assert at(loaded, keys) is at(loaded, first_keys), (path, first)
        n += 1
    return n


def load_dcp(path: Path) -> dict:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _load_state_dict_from_keys(checkpoint_id=str(path))


# ---------------------------------------------------------------------------
# Plain torch.save files
# ---------------------------------------------------------------------------
def test_shared_list_of_numbers_is_one_value(tmp_path: Path) -> None:
    """A list without tensors is one value: shown (bounded), decoded, written to DCP with its sharing."""
    src = tmp_path / "dag.pt"
    torch.save({"w": torch.arange(4.0), "x": doubled(1)}, src)
    loaded = torch.load(src, weights_only=True)
    check_commands(src)
    text = ckpt("inspect", "--values", str(src)).stdout
    assert "object = [[[[[[[" in text and "1, 1]" in text  # repr, cut to one line
    leaves = leaves_json(src)
    assert sorted(leaves) == ["w", "x"]
    # as JSON the value would be 2**61 objects: said, not attempted
    assert "unfolds to more than 1,048,576 values" in leaves["x"]["value_error"]
    out = tmp_path / "dcp"
    ckpt("convert", str(src), str(out), "--to", "dcp")
    back = load_dcp(out)
    assert torch.equal(back["w"], loaded["w"])
    assert_doubled(back["x"], 1)  # one list per level, as torch.save kept it
    assert (out / "__0_0.distcp").stat().st_size < 100_000
    r = ckpt("convert", str(src), str(tmp_path / "orbax"), "--to", "orbax", ok=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "x: shares objects so that it unfolds to more than 1,048,576 values" in r.stderr


def test_shared_list_holding_a_tensor_is_walked_once(tmp_path: Path) -> None:
    """Lists holding a tensor are subtrees: each shown once, a later path a reference to it."""
    src = tmp_path / "dag_tensor.pt"
    y = torch.arange(6.0).reshape(2, 3)
    torch.save({"w": torch.ones(2), "g": doubled(y)}, src)
    loaded = torch.load(src, weights_only=True)
    check_commands(src)
    leaves = leaves_json(src)
    # the first path down is shown; each list's second item is the list just shown, but the
    # innermost's: there both are the tensor y (tied: two array leaves on one storage)
    assert len(leaves) == 1 + (LEVELS - 1) + 2
    assert check_references(leaves, loaded) == LEVELS - 1
    assert leaves["g/1"]["value"] == "<the same object as g.0>"
    inner = "g/" + "/".join(["0"] * (LEVELS - 1))
    assert leaves[inner + "/0"]["kind"] == "array" and leaves[inner + "/1"]["kind"] == "array"  # tied: y twice
    note = json.loads(ckpt("inspect", "--json", str(src)).stdout)["notes"]
    assert any("59 paths to an object shown at another (dag_tensor.pt; torch.load gives one object at both)" in n
               for n in note)
    r = ckpt("convert", str(src), str(tmp_path / "st"), "--to", "safetensors", ok=False)
    assert r.returncode == 1
    assert re.search(r"g(/0)*/1: the same object as g(\.0)* \(torch\.load gives one object at both paths", r.stderr)
    out = tmp_path / "st"
    ckpt("convert", str(src), str(out), "--to", "safetensors", "--skip-unsupported")
    from safetensors.numpy import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert sorted(tensors) == sorted(["w", inner.replace("/", ".") + ".0", inner.replace("/", ".") + ".1"])
    np.testing.assert_array_equal(tensors[inner.replace("/", ".") + ".1"], at(loaded["g"], [0] * (LEVELS - 1) + [1]).numpy())


def test_self_referencing_dict(tmp_path: Path) -> None:
    """d['self'] = d, which torch.load rebuilds: a reference to the top, never a RecursionError."""
    src = tmp_path / "self.pt"
    d: dict[str, Any] = {"w": torch.arange(3.0)}
    d["self"] = d
    loop: list[Any] = [1]
    loop.append(loop)  # a value that holds itself
    d["loop"] = loop
    torch.save(d, src)
    loaded = torch.load(src, weights_only=True)
    assert loaded["self"] is loaded and loaded["loop"][1] is loaded["loop"]
    check_commands(src)
    leaves = leaves_json(src)
    assert leaves["self"]["value"] == "<the same object as the top-level object>"
    assert check_references(leaves, loaded) == 1
    assert "holds itself" in leaves["loop"]["value_error"]
    text = ckpt("inspect", "--values", "--flat", str(src)).stdout
    assert "loop  object = [1, [...]]" in text  # as repr spells it
    out = tmp_path / "dcp"
    r = ckpt("convert", str(src), str(out), "--to", "dcp", ok=False)
    assert r.returncode == 1 and "self: the same object as the top-level object" in r.stderr
    ckpt("convert", str(src), str(out), "--to", "dcp", "--skip-unsupported")
    back = load_dcp(out)
    assert torch.equal(back["w"], loaded["w"]) and "self" not in back
    assert back["loop"][0] == 1 and back["loop"][1] is back["loop"]  # the cycle, as torch.save keeps it


def test_sub_dict_under_two_keys(tmp_path: Path) -> None:
    """{'model': sd, 'ema': sd}: the tensors once under model, ema the same object; diff agrees with itself."""
    src = tmp_path / "ema.pt"
    sd = {"a": torch.ones(2, 2), "b": {"c": torch.zeros(3)}, "cfg": doubled(0.5, 40)}
    torch.save({"model": sd, "ema": sd, "step": 3}, src)
    loaded = torch.load(src, weights_only=True)
    check_commands(src)
    leaves = leaves_json(src)
    assert sorted(leaves) == ["ema", "model/a", "model/b/c", "model/cfg", "step"]
    assert leaves["ema"]["value"] == "<the same object as model>"
    assert check_references(leaves, loaded) == 1
    r = ckpt("diff", "--values", str(src), str(src))
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------
# Real DeepSpeed and Megatron files, given shared and self-referencing entries
# ---------------------------------------------------------------------------
def _inject(obj: dict) -> None:
    """What a training script's client state may hold: one object at many places, and itself."""
    obj["shared_state"] = {"curriculum": doubled(7), "buffers": doubled(torch.arange(2.0), 30)}
    loop: dict[str, Any] = {"epoch": 1}
    loop["me"] = loop
    obj["loop_state"] = loop


def test_deepspeed_client_state(tmp_path: Path) -> None:
    step = tmp_path / "ds" / "global_step2"
    shutil.copytree(FIXTURES / "deepspeed_z2_fp32", tmp_path / "ds")
    states = step / "mp_rank_00_model_states.pt"
    obj = torch.load(states, weights_only=False)
    _inject(obj)
    torch.save(obj, states)
    loaded = torch.load(states, weights_only=False)
    root = tmp_path / "ds"
    check_commands(root)
    leaves = leaves_json(root)
    engine = {p: leaf for p, leaf in leaves.items() if p.startswith("engine/")}
    assert engine["engine/loop_state/me"]["value"] == "<the same object as engine.loop_state>"
    assert check_references(engine, loaded, prefix=1) == 29 + 1
    assert engine["engine/shared_state/curriculum"]["value_type"] == "object"
    out = tmp_path / "st"
    ckpt("convert", str(root), str(out), "--to", "safetensors", "--skip-unsupported")


def test_megatron_core_common_pt(tmp_path: Path) -> None:
    save = tmp_path / "mc"
    shutil.copytree(FIXTURES / "megatron_torch_dist_tp2_dp2", save)
    obj = torch.load(save / "common.pt", weights_only=False)
    _inject(obj)
    torch.save(obj, save / "common.pt")
    loaded = torch.load(save / "common.pt", weights_only=False)
    check_commands(save)
    leaves = leaves_json(save)
    assert leaves["loop_state/me"]["value"] == "<the same object as loop_state>"
    assert check_references(leaves, loaded) == 29 + 1
    assert "unfolds to more than" in leaves["shared_state/curriculum"]["value_error"]


class _PlainMegatron(pickle.Unpickler):
    """torch.load's unpickler with Megatron's enums read as their values (Megatron is not
    installed here): the file torch.save writes back holds the same data as plain values."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("megatron.") or (module, name) == ("signal", "Signals"):
            return lambda value: value
        return super().find_class(module, name)


class _PlainMegatronModule:
    Unpickler = _PlainMegatron
    load = pickle.load
    __name__ = "pickle"


def test_megatron_lm_legacy_args(tmp_path: Path) -> None:
    step = tmp_path / "ml" / "iter_0000005"
    shutil.copytree(FIXTURES / "megatron_legacy", tmp_path / "ml")
    for rank in ("mp_rank_00", "mp_rank_01"):
        f = step / rank / "model_optim_rng.pt"
        obj = torch.load(f, weights_only=False, pickle_module=_PlainMegatronModule)
        vars(obj["args"])["shared"] = doubled(3)  # a run's args pickled with one list at many places
        _inject(obj)
        torch.save(obj, f)
    loaded = torch.load(step / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    check_commands(step)
    leaves = leaves_json(step)
    assert leaves["mp_rank_00/loop_state/me"]["value"] == "<the same object as mp_rank_00.loop_state>"
    assert check_references({p: v for p, v in leaves.items() if p.startswith("mp_rank_00/")}, loaded, 1) == 29 + 1
    assert "unfolds to more than" in leaves["mp_rank_00/args"]["value_error"]
