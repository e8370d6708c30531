"""DeepSpeed universal checkpoints: `convert ZERO --to deepspeed-universal` against DeepSpeed's own
ds_to_universal and DeepSpeed's own universal load, beside the conformance suite (tests/conformance/:
inspect and values of ds_to_universal's output against torch.load's, validate, damage, convert).

Here: every file ckpt writes is byte for byte the file ds_to_universal wrote from the same ZeRO
fixture (fixtures/deepspeed_universal_*, DeepSpeed 0.19), with no other file (no fragment
directory); ckpt's output holds, value for value, what DeepSpeed 0.19's `load_checkpoint(root,
load_universal=True)` restored from ds_to_universal's (recorded by DeepSpeed itself in
fixtures/deepspeed_universal_load/, compared without DeepSpeed); where build/venv-deepspeed-0.19
exists, DeepSpeed loads ckpt's output live too (a subprocess), restoring exactly what it restores from
ds_to_universal's and what was recorded, which is what was saved, and a training step after it gives
the same state (skipped when that venv is absent); sources and options a universal checkpoint cannot be made from are refused
in one line with nothing written; a parameter larger than --memory is streamed into its file in
bands; inspect and validate import neither torch nor DeepSpeed; a ZeRO root holding
`latest_universal` too reads as the ZeRO checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from conftest import FIXTURES, peak_rss_mib
from test_deepspeed import assert_read_without_torch_or_deepspeed

ROOT = Path(__file__).resolve().parents[3]
DS_PYTHON = ROOT / "build" / "venv-deepspeed-0.19" / "bin" / "python"
# the ZeRO fixtures ds_to_universal converted (fixtures/deepspeed_universal_<name>), by ZeRO stage;
# z3_bf16_uneven: 4 ranks, an attention model whose sizes 4 does not divide, six sub-groups
STAGES = {"z1_fp32": 1, "z1_bf16": 1, "z2_fp32": 2, "z2_bf16": 2, "z3_fp32": 3, "z3_bf16": 3, "z3_bf16_uneven": 3}
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def run(*args: object) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=environ, timeout=300)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STAGES))
def test_every_file_is_what_ds_to_universal_wrote(tmp_path, name):
    out = tmp_path / "uc"
    r = run("convert", FIXTURES / f"deepspeed_{name}", out, "--to", "deepspeed-universal")
    assert r.returncode == 0, r.stderr
    want = {k: v for k, v in files(FIXTURES / f"deepspeed_universal_{name}").items() if k != "_reference.json"}
    got = files(out)
    assert sorted(got) == sorted(want)  # the same files, and nothing else (no tmp/ of fragments)
    differ = [k for k in want if got[k] != want[k]]
    assert not differ, differ
    assert got["latest_universal"] == b"global_step2_universal"


@pytest.mark.slow
def test_a_step_directory_converts_the_same_and_the_tag_is_its_name(tmp_path):
    out = tmp_path / "uc"
    assert run("convert", FIXTURES / "deepspeed_z2_bf16" / "global_step2", out, "--to", "deepspeed-universal").returncode == 0
    assert files(out) == {k: v for k, v in files(FIXTURES / "deepspeed_universal_z2_bf16").items()
                          if k != "_reference.json"}


# --------------------------------------------------------------------------------------------
# DeepSpeed's own universal load (build/venv-deepspeed-0.19)
# --------------------------------------------------------------------------------------------

def _reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "_reference.json").read_text())


# what DeepSpeed 0.19's load_checkpoint(load_universal=True) restored from ds_to_universal's output of
# these ZeRO fixtures (fixtures/deepspeed_universal_load/<name>.json, fixtures/gen_deepspeed_universal_load.py)
LOADED = ["z1_bf16", "z2_fp32", "z3_bf16", "z3_bf16_uneven"]
RESTORED = ("params", "groups", "steps", "global_steps", "global_samples", "lr_scheduler", "client")


def _loaded(name: str) -> dict:
    return json.loads((FIXTURES / "deepspeed_universal_load" / f"{name}.json").read_text())


def _deepspeed_free_pickle():  # noqa: ANN202
    """A pickle module for torch.load of DeepSpeed's files where DeepSpeed is not installed: its own
    objects (optimizer_state.pt's loss scaler, ZeroStageEnum) come back as bare stand-ins holding
    their state; everything else as torch loads it."""
    import pickle
    import types

    class StandIn:
        def __init__(self, *args: object) -> None:
            self.args = args

        def __setstate__(self, state: object) -> None:
            self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            if module.split(".")[0] == "deepspeed":
                return type(name, (StandIn,), {})
            return super().find_class(module, name)

    stub = types.ModuleType("deepspeed_free_pickle")
    stub.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
    stub.Unpickler = Unpickler  # type: ignore[attr-defined]
    return stub


def _tensor_json(t) -> dict:  # noqa: ANN001
    """fixtures/gen_deepspeed.py's _tensor_json: shape, dtype and the bytes (base64)."""
    import base64

    import torch

    t = t.detach().contiguous()
    raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "data": base64.b64encode(raw).decode()}


def _as_deepspeed_loads(root: Path, stage: int, params: dict, groups: int, flats: int) -> dict:
    """What DeepSpeed 0.19's universal load takes from the files under `root`, read with torch.load,
    in the form tests/deepspeed_universal_load.py records what it restored:

    - each trained parameter's fp32 weights and Adam moments: zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt,
      the tensor (stages 1/2: its "param" entry) in the parameter's shape
      (checkpoint/universal_checkpoint.load_hp_checkpoint_state; stage3.load_hp_checkpoint_state);
    - the hyper-parameters: zero/optimizer_state.pt's param_groups, group by group at stages 1/2
      (base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir), at stage 3 its
      optimizer_state_dict's param_groups[0] for every group (load_hp_checkpoint_state_from_checkpoint_dir_stage3);
    - the optimizer step: each parameter's step.pt (stages 1/2: one per group), optimizer_state_dict's
      state[0]'s step (stage 3: one per sub-group's flat tensor);

    (`groups` and `flats`, stage 3's groups and sub-groups, are the model's, not the files'.)
    - the engine's counters, lr scheduler and client state from the model-states file
      (engine._load_checkpoint)."""
    import torch

    ds_pickle = _deepspeed_free_pickle()
    step = root / (root / "latest_universal").read_text().strip()
    zero = step / "zero"
    states = torch.load(sorted(step.glob("*model_states.pt"))[0], weights_only=False, pickle_module=ds_pickle)
    optim = torch.load(zero / "optimizer_state.pt", weights_only=False, pickle_module=ds_pickle)
    out: dict = {"params": {}}
    for name, recorded in params.items():
        out["params"][name] = {}
        for key in recorded:
            t = torch.load(zero / name / f"{key}.pt", weights_only=True)
            t = t["param"] if isinstance(t, dict) else t
            out["params"][name][key] = _tensor_json(t.reshape(recorded[key]["shape"]))
    plain = lambda group: {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}  # noqa: E731
    if stage < 3:
        out["groups"] = [plain(g) for g in optim["param_groups"]]
        steps = {float(torch.load(zero / name / "step.pt", weights_only=True)) for name in params}
        assert len(steps) == 1, steps  # DeepSpeed asserts one step per group
        out["steps"] = [steps.pop()] * len(out["groups"])
    else:
        osd = optim["optimizer_state_dict"]
        out["groups"] = [plain(osd["param_groups"][0])] * groups
        out["steps"] = [float(osd["state"][0]["step"])] * flats
    out["global_steps"] = states["global_steps"]
    out["global_samples"] = states["global_samples"]
    out["lr_scheduler"] = {k: v for k, v in states["lr_scheduler"].items()
                           if isinstance(v, (int, float, str, bool, type(None)))}
    out["client"] = {k: states[k] for k in ("run", "epoch")}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", LOADED)
def test_ckpts_output_holds_what_deepspeed_restored_from_ds_to_universals(tmp_path, name):
    """Without DeepSpeed: ckpt's universal output, read the way DeepSpeed 0.19's universal load reads
    it, holds value for value what DeepSpeed restored from ds_to_universal's output of the same ZeRO
    checkpoint (recorded by DeepSpeed itself: fixtures/deepspeed_universal_load/). The same reading of
    ds_to_universal's own files gives the recording too: the check of the reading itself."""
    want = _loaded(name)
    assert want["facts"]["stage"] == STAGES[name] and want["facts"]["zero_fixture"] == f"deepspeed_{name}"
    ours = tmp_path / "ours"
    r = run("convert", FIXTURES / f"deepspeed_{name}", ours, "--to", "deepspeed-universal")
    assert r.returncode == 0, r.stderr
    for root in (FIXTURES / f"deepspeed_universal_{name}", ours):
        got = _as_deepspeed_loads(root, STAGES[name], want["params"], len(want["groups"]), len(want["steps"]))
        for pname, state in want["params"].items():
            for key, tensor in state.items():
                assert got["params"][pname][key] == tensor, (root.name, pname, key)
        assert got["params"].keys() == want["params"].keys()
        # every parameter the optimizer holds state for is a trained one DeepSpeed restored
        step = root / (root / "latest_universal").read_text().strip()
        assert {p.parent.name for p in (step / "zero").glob("*/exp_avg.pt")} == set(want["params"]), root.name
        for key in RESTORED[1:]:
            assert got[key] == want[key], (root.name, key, got[key], want[key])


@pytest.mark.skipif(not DS_PYTHON.exists(), reason="no build/venv-deepspeed-0.19 (make fixtures builds it)")
@pytest.mark.parametrize("name", LOADED)
def test_deepspeed_loads_ckpts_output_as_ds_to_universals(tmp_path, name):
    stage = STAGES[name]
    ours = tmp_path / "ours"
    assert run("convert", FIXTURES / f"deepspeed_{name}", ours, "--to", "deepspeed-universal").returncode == 0
    theirs = tmp_path / "theirs"
    shutil.copytree(FIXTURES / f"deepspeed_universal_{name}", theirs)
    out = tmp_path / "loaded.json"
    r = subprocess.run([str(DS_PYTHON), str(ROOT / "tests" / "deepspeed_universal_load.py"), str(out),
                        f"deepspeed_{name}", str(ours), str(theirs)], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = json.loads(out.read_text())
    a, b = loaded[str(ours)], loaded[str(theirs)]
    # the same state restored, and the same state after one more step on the same batch
    assert a["before"] == b["before"]
    assert a["after"] == b["after"]
    assert a["client"] == {"run": {"name": "tiny", "seed": 0}, "epoch": 1}
    # ... which is what DeepSpeed held when it saved the ZeRO checkpoint
    saved = _reference(f"deepspeed_{name}")
    for pname, state in a["before"]["params"].items():
        assert state["fp32"]["data"] == saved["fp32_params"][pname]["data"], pname
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key]["data"] == saved["optimizer"][pname][key]["data"], (pname, key)
    assert a["before"]["global_steps"] == 2 and set(a["before"]["steps"]) == {2.0}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    if stage < 3:
        assert a["before"]["groups"] == groups
    else:
        # stage 3's universal load gives every group param_groups[0]'s hyper-parameters (DeepSpeed 0.19's
        # load_hp_checkpoint_state_from_checkpoint_dir_stage3), from ds_to_universal's file as from ckpt's
        assert all(g == groups[0] for g in a["before"]["groups"])
    assert a["after"]["global_steps"] == 3 and a["after"] != a["before"]
    # ... and what the committed recording holds (the check that runs without DeepSpeed, above)
    recorded = _loaded(name)
    assert {k: a["before"][k] for k in RESTORED[:-1]} == {k: recorded[k] for k in RESTORED[:-1]}
    assert a["client"] == recorded["client"]


# --------------------------------------------------------------------------------------------
# refusals: one line, nothing written
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("source, args, part", [
    ("safetensors_numpy", [], "written from DeepSpeed ZeRO checkpoints only"),
    ("deepspeed_universal_z2_fp32", [], "written from DeepSpeed ZeRO checkpoints only"),
    ("deepspeed_z2_fp32", ["--exclude", "optimizer/**"], "cannot leave out optimizer/state/embed.weight/"),
    ("deepspeed_z3_fp32", ["--select", "layers/**"], "cannot leave out"),
    ("deepspeed_z1_bf16", ["--rename", "layers/=blocks/"], "cannot leave out"),
    ("deepspeed_z2_bf16", ["--dtype", "bfloat16"], "--dtype"),
])
def test_what_a_universal_checkpoint_cannot_be_made_from_is_refused(tmp_path, source, args, part):
    r = run("convert", FIXTURES / source, tmp_path / "out", "--to", "deepspeed-universal", *args)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and part in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_merge_rules_the_writer_does_not_apply_are_refused_by_name(tmp_path):
    """A model-states file recording tensor-parallel merge patterns (Megatron-DeepSpeed's): ds_to_universal
    applies them (vocabulary padding stripped, ...); ckpt refuses rather than write other files."""
    import torch

    src = tmp_path / "run"
    shutil.copytree(FIXTURES / "deepspeed_z2_fp32", src)
    f = src / "global_step2" / "mp_rank_00_model_states.pt"
    states = torch.load(f, weights_only=False)
    states["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.2,
                                           "vocabulary_parameter_patterns": [r"embed\.weight"]}
    torch.save(states, f)
    (tmp_path / "outs").mkdir()
    r = run("convert", src, tmp_path / "outs" / "out", "--to", "deepspeed-universal")
    assert r.returncode == 1 and "vocabulary_parameter_patterns" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not list((tmp_path / "outs").iterdir())


# --------------------------------------------------------------------------------------------
# streamed: a parameter larger than --memory goes into its file in bands
# --------------------------------------------------------------------------------------------

@pytest.mark.serial
def test_a_parameter_larger_than_memory_is_streamed_into_its_file(tmp_path):
    """A 48 MiB parameter of an imitated stage-3 checkpoint (tests/formats/deepspeed/test_deepspeed.py's imitate: the
    layout DeepSpeed's state_dict writes), converted under --memory 16MiB: the peak stays far below
    the parameter's fp32 + moments (144 MiB), and torch.load reads each file back exactly."""
    import torch

    from test_deepspeed import imitate

    gen = torch.Generator().manual_seed(3)
    big = torch.randn(3 * 1024 + 1, 4096, generator=gen)
    root = imitate(tmp_path / "run", 3, [OrderedDict(big=big, small=torch.ones(3))])
    tiny = imitate(tmp_path / "tiny", 3, [OrderedDict(big=torch.randn(5, 4, generator=gen), small=torch.ones(3))])
    # against the same convert of a 5x4 parameter: only what grows with the data (what a convert
    # imports, numpy, tensorstore, torch's pickle machinery, is in both)
    grew = (peak_rss_mib("convert", root, tmp_path / "out", "--to", "deepspeed-universal", "--memory", "16MiB")
            - peak_rss_mib("convert", tiny, tmp_path / "out_tiny", "--to", "deepspeed-universal", "--memory", "16MiB"))
    assert grew < 48, grew
    step = tmp_path / "out" / "global_step1_universal"
    assert torch.equal(torch.load(step / "zero" / "big" / "fp32.pt").view(big.shape), big)
    rank0, rank1 = (torch.load(root / "global_step1" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
                    ["optimizer_state_dict"]["optimizer_state_dict"] for r in (0, 1))
    part = (big.numel() + 1) // 2
    want = torch.cat([rank0["state"][0]["exp_avg"][:part], rank1["state"][0]["exp_avg"][:big.numel() - part]])
    assert torch.equal(torch.load(step / "zero" / "big" / "exp_avg.pt"), want)
    assert not [p for p in step.rglob("*") if p.is_dir() and p.name not in ("zero", "big", "small")]


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------

def test_inspect_and_validate_import_neither_torch_nor_deepspeed():
    assert_read_without_torch_or_deepspeed(FIXTURES / "deepspeed_universal_z2_bf16",
                                           FIXTURES / "deepspeed_universal_z3_fp32" / "global_step2_universal")


@pytest.mark.slow
def test_the_tree_and_header(tmp_path):
    r = run("inspect", "--json", FIXTURES / "deepspeed_universal_z3_bf16")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["format"] == "deepspeed-universal"
    leaves = {leaf["name"]: leaf for leaf in doc["leaves"]}
    # a stage-3 file's flat tensor has the parameter's recorded shape
    assert leaves["layers.0.up.weight"]["shape"] == [24, 16] and leaves["layers.0.up.weight"]["dtype"] == "float32"
    assert leaves["optimizer.state.layers.0.up.weight.exp_avg"]["shape"] == [24, 16]
    assert "optimizer.param_groups" in leaves and "engine.global_steps" in leaves
    text = run("inspect", FIXTURES / "deepspeed_universal_z3_bf16").stdout
    assert "DeepSpeed universal (global_step2_universal, from ZeRO-3 on 2 data-parallel ranks)" in text


@pytest.mark.slow
def test_a_zero_root_holding_latest_universal_reads_as_the_zero_checkpoint(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(FIXTURES / "deepspeed_z2_fp32", root)
    shutil.copytree(FIXTURES / "deepspeed_universal_z2_fp32" / "global_step2_universal", root / "global_step2_universal")
    shutil.copy(FIXTURES / "deepspeed_universal_z2_fp32" / "latest_universal", root)
    assert json.loads(run("inspect", "--json", root).stdout)["format"] == "deepspeed"
    doc = json.loads(run("inspect", "--json", root / "global_step2_universal").stdout)
    assert doc["format"] == "deepspeed-universal"


@pytest.mark.slow
def test_a_trained_parameters_missing_state_is_named(tmp_path):
    root = tmp_path / "uc"
    shutil.copytree(FIXTURES / "deepspeed_universal_z1_fp32", root)
    (root / "global_step2_universal" / "zero" / "mix" / "exp_avg_sq.pt").unlink()
    r = run("validate", "--json", root)
    findings = json.loads(r.stdout)["findings"]
    assert r.returncode == 1
    assert any(f["code"] == "missing-file" and f["file"] == "global_step2_universal/zero/mix/exp_avg_sq.pt"
               for f in findings), findings
    doc = json.loads(run("inspect", "--json", root).stdout)
    assert doc["missing"] and doc["missing"][0]["file"].endswith("zero/mix/exp_avg_sq.pt")


# --------------------------------------------------------------------------------------------
# ZeRO-3 sub-groups and sizes the DP degree does not divide (issue 29)
# --------------------------------------------------------------------------------------------

def test_zero3_sub_groups_read_their_own_adam_state_as_deepspeed_gathers_it():
    """deepspeed_z3_bf16_uneven: three optimizer groups cut into six sub-groups (sub_group_size), each
    its own flat tensor listed in its group's params (the attention group holds three). Every
    parameter's fp32 weights and Adam moments equal DeepSpeed's safe_get_full_fp32_param /
    safe_get_full_optimizer_state from the run, and each group names its parameters as the script
    put them in it; the universal form ds_to_universal wrote reads the same."""
    import base64

    import numpy as np

    import ckpt_tool

    ref = _reference("deepspeed_z3_bf16_uneven")
    assert [len(g["params"]) for g in ref["param_groups"]] == [5, 10, 14]

    def recorded(t: dict) -> np.ndarray:
        return np.frombuffer(base64.b64decode(t["data"]), dtype=t["dtype"]).reshape(t["shape"])

    for path in (FIXTURES / "deepspeed_z3_bf16_uneven", FIXTURES / "deepspeed_universal_z3_bf16_uneven"):
        leaves = {leaf.name: leaf for leaf in ckpt_tool.open(str(path)).leaves}
        for pname, t in ref["fp32_params"].items():
            assert np.array_equal(leaves[pname][...], recorded(t)), (path.name, pname)
            for key in ("exp_avg", "exp_avg_sq"):
                got = leaves[f"optimizer.state.{pname}.{key}"]
                assert np.array_equal(got[...], recorded(ref["optimizer"][pname][key])), (path.name, pname, key)
    groups = {leaf.name: leaf for leaf in ckpt_tool.open(str(FIXTURES / "deepspeed_z3_bf16_uneven")).leaves}
    assert [g["params"] for g in groups["optimizer.param_groups"].load()] == [g["params"] for g in ref["param_groups"]]


@pytest.mark.slow
def test_validate_counts_each_file_once():
    """validate's "checked N files": the step's model-states, optimizer_state.pt and parameter files, once each."""
    step = FIXTURES / "deepspeed_universal_z3_bf16_uneven" / "global_step2_universal"
    r = run("validate", "--json", step.parent)
    assert r.returncode == 0, r.stdout
    assert json.loads(r.stdout)["checked"]["files"] == len([p for p in step.rglob("*") if p.is_file()]) == 92


@pytest.mark.slow
@pytest.mark.parametrize("expert_group", [False, True])
def test_zero3_sub_groups_partitioned_over_other_ranks_are_refused(tmp_path, expert_group):
    """AutoEP's ZeRO-3 layout records per sub-group the ranks it is partitioned over
    (ds_zero_partition_groups, DeepSpeed 0.19's stage3._zero3_partition_group_metadata): an expert
    sub-group split over 1 rank of 2 is not where the DP rule puts it, so inspect and convert refuse it
    in one line (zero_to_fp32 refuses it too); a record of every sub-group over the 2 ranks reads as usual.
    The checkpoint is IMITATED (test_deepspeed.imitate), the record added as DeepSpeed writes it."""
    import torch

    from test_deepspeed import imitate

    experts = torch.arange(6.0).reshape(2, 3)
    root = imitate(tmp_path / "run", 3, [OrderedDict(w=torch.ones(3, 5)), OrderedDict(experts=experts)])
    for r in range(2):
        f = root / "global_step1" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        sd = torch.load(f, weights_only=False)
        sd["optimizer_state_dict"]["ds_zero_partition_groups"] = [
            {"sub_group": g, "partition_count": 1 if expert_group and g == 1 else 2,
             "partition_rank": 0 if expert_group and g == 1 else r, "partition_ranks": [r] if expert_group and g == 1
             else [0, 1], "families": ["replicated"], "group_names": ["replicated"]} for g in range(2)]
        torch.save(sd, f)
    r = run("inspect", root)
    out = tmp_path / "outs"
    out.mkdir()
    c = run("convert", root, out / "uc", "--to", "deepspeed-universal")
    if expert_group:
        for result in (r, c):
            assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert "ds_zero_partition_groups: sub-group 1 is partitioned over other ranks" in result.stderr
        assert not list(out.iterdir())
    else:
        assert r.returncode == 0 and c.returncode == 0, r.stderr + c.stderr
        assert torch.equal(torch.load(out / "uc" / "global_step1_universal" / "zero" / "experts" / "fp32.pt"),
                           experts.reshape(-1))
